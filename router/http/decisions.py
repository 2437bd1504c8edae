"""What routing decided and how it turned out: per-decision metrics, prediction accuracy, the
recent decisions with their explanation, and a rolling window for the dashboard.

Every proxied request is one decision: the blocks in its query, the fleet's best match, the
chosen (worker, rank)'s match (the triple SGLang's router reports), and, once the worker
answered, the tokens the worker says it served from cache against the tokens the router
predicted (from events and pending marks, as the response headers say them). That makes
prediction accuracy a live number: `exact` when the worker reused exactly what the router said,
`over` when it reused less (a false hit: the index believed in blocks the worker no longer had,
or a request bringing them ran in the same batch), `under` when it reused more (its events had
not reached the index yet, or the admission forecast gave up a prefix the worker kept).
An answer of a worker whose events the false-hit watch left unfollowed when it was routed
(`Candidate.unfollowed`: predicted nothing, fail closed) is `unfollowed`, outside those three:
counted as `under`, it made the accuracy look worse for a reason that is no index lag.

The hot path only adds to plain Python numbers (a dict lookup and a few `+=`); the Prometheus
families are built from them when `/metrics` is scraped (`DecisionCollector`), so a request
pays no lock and no label validation. Labels are workers, ranks, models and fixed words only;
namespaces appear as keyed fingerprints in the recent-decision log (admin API), never as labels.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from router.http.metrics import Histogram
from router.routing.policy import Candidate

__all__ = [
    "BLOCK_BUCKETS",
    "TTFT_BUCKETS",
    "Decision",
    "DecisionCollector",
    "DecisionStats",
]

BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WINDOW_BUCKET_S = 10  # the dashboard's rolling window: 30 buckets of 10 s (5 minutes)
WINDOW_BUCKETS = 30
RECENT_DECISIONS = 50

# per (worker, dp rank, model) counters, in this order
(
    _ROUTED,
    _USAGE,
    _USAGE_PROMPT,
    _USAGE_PREDICTED,
    _CACHED,
    _EXACT,
    _OVER,
    _UNDER,
    _MISSING,
    _UNFOLLOWED,
) = range(10)
_ROW = 10
# per window bucket: requests, usage reports, their prompt, predicted and cached tokens, exact,
# unfollowed (reports outside the accuracy)
_W_FIELDS = 7


class Decision:
    """One routed request, as the metrics count it and the dashboard shows it."""

    __slots__ = (
        "at",
        "attempt",
        "block_size",
        "cached_tokens",
        "candidates",
        "chosen",
        "duration_s",
        "endpoint",
        "model",
        "namespace",
        "prompt_tokens",
        "request_id",
        "status",
        "ttft_s",
    )

    def __init__(
        self,
        request_id: str,
        endpoint: str,
        model: str,
        namespace: str,
        prompt_tokens: int,
        candidates: Sequence[Candidate],
        chosen: Candidate,
        attempt: int,
        block_size: int | None,
    ) -> None:
        self.at = time.time()
        self.request_id = request_id
        self.endpoint = endpoint
        self.model = model
        self.namespace = namespace  # a keyed fingerprint, never the salt
        self.prompt_tokens = prompt_tokens
        self.candidates = candidates
        self.chosen = chosen
        self.attempt = attempt
        self.block_size = block_size
        self.status: int | None = None
        self.ttft_s: float | None = None
        self.duration_s: float | None = None
        self.cached_tokens: int | None = None

    def best(self) -> Candidate:
        """The candidate holding the longest prefix (the chosen one on a tie)."""
        best = self.chosen
        for c in self.candidates:
            if c.matched_tokens + c.pending_tokens > best.matched_tokens + best.pending_tokens:
                best = c
        return best

    def reason(self) -> str:
        """`prefix` (the longest match won), `load` (a longer match lost on load), `room` (a
        longer match lost on what the request would evict there) or `none`."""
        best = self.best()
        return _reason(best, self.chosen)

    def explain(self) -> str:
        """One sentence on why the chosen worker got the request."""
        if self.chosen.unfollowed:
            # why it predicted nothing there, whatever the worker reuses
            return self._explain() + (
                f"; {self.chosen.worker}'s KV events were unfollowed (false-hit watch): no hit "
                "predicted there"
            )
        return self._explain()

    def _explain(self) -> str:
        chosen, best = self.chosen, self.best()
        where = _target(chosen)
        held = chosen.matched_tokens + chosen.pending_tokens
        retry = f" (retry {self.attempt})" if self.attempt else ""
        reason = self.reason()
        if reason == "none":
            return f"no worker holds a prefix: {where} had the least load ({chosen.load:g}){retry}"
        if reason == "prefix":
            pending = f", {chosen.pending_tokens} pending" if chosen.pending_tokens else ""
            # what the headers predict: the forecast's, when it expects less to be kept
            kept = chosen.predicted_tokens
            cause = chosen.admission.cause if chosen.admission is not None else ""
            forecast = f"; {kept} forecast at admission: {cause}" if kept < held else ""
            return (
                f"{where} holds the longest prefix: {chosen.matched_tokens} of "
                f"{self.prompt_tokens} tokens{pending}{forecast}, load {chosen.load:g}{retry}"
            )
        if best.unfit is not None and not best.healthy:
            # not routable for this request: its pool cannot hold it
            return (
                f"{_target(best)} holds {best.matched_tokens + best.pending_tokens} tokens but "
                f"{best.unfit}; {where} holds {held}, load {chosen.load:g}{retry}"
            )
        if reason == "room":
            return (
                f"{_target(best)} holds {best.matched_tokens + best.pending_tokens} tokens but "
                f"would evict {best.evicts_tokens or 0} cached tokens for the rest (score "
                f"{best.score:g}); {where} holds {held} and would evict "
                f"{chosen.evicts_tokens or 0} (score {chosen.score:g}){retry}"
            )
        return (
            f"{_target(best)} holds {best.matched_tokens + best.pending_tokens} tokens but "
            f"carries load {best.load:g} (score {best.score:g}); {where} holds {held}, load "
            f"{chosen.load:g} (score {chosen.score:g}){retry}"
        )

    def to_builtins(self) -> dict[str, object]:
        """The JSON row of this decision."""
        best = self.best()
        return {
            "at": self.at,
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "namespace": self.namespace,
            "prompt_tokens": self.prompt_tokens,
            "block_size": self.block_size,
            "worker": self.chosen.worker,
            "dp_rank": self.chosen.dp_rank,
            "matched_tokens": self.chosen.matched_tokens,
            "pending_tokens": self.chosen.pending_tokens,
            "best_worker": best.worker,
            "best_matched_tokens": best.matched_tokens + best.pending_tokens,
            "cached_tokens": self.cached_tokens,
            "status": self.status,
            "ttft_s": self.ttft_s,
            "duration_s": self.duration_s,
            "attempt": self.attempt,
            "reason": self.reason(),
            "explanation": self.explain(),
            "candidates": [
                {
                    "worker": c.worker,
                    "dp_rank": c.dp_rank,
                    "healthy": c.healthy,
                    "matched_tokens": c.matched_tokens,
                    "pending_tokens": c.pending_tokens,
                    "load": c.load,
                    "score": c.score,
                    "unfollowed": c.unfollowed,
                }
                for c in self.candidates[:8]
            ],
        }


def _reason(best: Candidate, chosen: Candidate) -> str:
    if best.matched_tokens + best.pending_tokens == 0:
        return "none"
    if best is chosen:
        return "prefix"
    # not its load: what placing the request there would have evicted (`room_weight`)
    room = (best.evicts_tokens or 0) > (chosen.evicts_tokens or 0) and best.load <= chosen.load
    return "room" if room else "load"


def _no_block_size(worker: str) -> int | None:
    return None


def _target(c: Candidate) -> str:
    return c.worker if c.dp_rank is None else f"{c.worker}#dp{c.dp_rank}"


# requests counted together: a few microseconds a request where their facts are counted one
# by one between the parser's and the worker client's code (measured: the statistics cost
# about 3% of a tiny request's router CPU counted one by one)
FLUSH_EVERY = 64


class DecisionStats:
    """Counters of every decision and outcome, the recent decisions, the rolling window.

    A request's decision is told once, when its observation is done with it (`told`: answered,
    failed, or given up for a retry), kept in arrival order and counted FLUSH_EVERY requests at
    a time, and before anything reads the statistics (`flush`: the scrape, the dashboard,
    `recent`, `window`), so every reader sees every request told so far."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # a worker's block size (the indexer's, set by the observer), read when counted
        self.block_size: Callable[[str], int | None] = _no_block_size
        self._pending: list[tuple[Decision, float]] = []
        # counters per (worker, dp rank or None, model)
        self._targets: dict[tuple[str, int | None, str], list[int]] = {}
        self._reasons: dict[tuple[str, str], int] = {}
        # per model: the blocks of the query, of the best match and of the chosen one
        self._blocks: dict[str, tuple[Histogram, Histogram, Histogram]] = {}
        self._ttft: dict[tuple[str, str], Histogram] = {}
        self._recent: deque[Decision] = deque(maxlen=RECENT_DECISIONS)
        self._window = [[0] * _W_FIELDS for _ in range(WINDOW_BUCKETS)]
        self._window_slot = [-1] * WINDOW_BUCKETS  # which 10 s period each bucket holds

    def told(self, decision: Decision) -> None:
        """What a request did, once its observation is done with it: counted as a first
        attempt's decision (`attempt` 0: the blocks of the query, the best and the chosen
        match), its time to first byte (`ttft_s`), and its outcome against the prediction and
        as a recent decision (`status`: it was answered)."""
        pending = self._pending
        pending.append((decision, self._clock()))
        if len(pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Count what was told and not counted yet.

        One loop over the batch with the counters in locals, and the histograms fed their
        values a batch at a time (a call per histogram, not per value): about half the cost of
        counting each decision through its own calls (7 us a request, measured in `timeit`).
        """
        pending = self._pending
        if not pending:
            return
        self._pending = []
        block_size = self.block_size
        reasons = self._reasons
        targets = self._targets
        keep_recent = self._recent.append
        # the values each histogram gets from this batch, counted after the loop
        blocks: dict[str, tuple[list[int], list[int], list[int]]] = {}
        ttfts: dict[tuple[str, str], list[float]] = {}
        period, window = -1, self._window[0]
        for decision, at in pending:
            chosen, model = decision.chosen, decision.model
            block = decision.block_size
            if block is None:
                block = decision.block_size = block_size(chosen.worker)
            if decision.attempt == 0:
                # the decision: the blocks of the query, of the fleet's best match and of the
                # chosen one, and why the chosen one won
                top = decision.best()
                best = top.matched_tokens + top.pending_tokens
                key = (model, _reason(top, chosen))
                reasons[key] = reasons.get(key, 0) + 1
                if block:  # else no stream says how long a block is: nothing in blocks
                    values = blocks.get(model)
                    if values is None:
                        values = blocks[model] = ([], [], [])
                    values[0].append(decision.prompt_tokens // block)
                    values[1].append(best // block)
                    values[2].append((chosen.matched_tokens + chosen.pending_tokens) // block)
            ttft = decision.ttft_s
            if ttft is not None:
                series = (decision.endpoint, model)
                times = ttfts.get(series)
                if times is None:
                    times = ttfts[series] = []
                times.append(ttft)
            # every attempt was sent to its (worker, rank, model), a retried one too
            target = (chosen.worker, chosen.dp_rank, model)
            row = targets.get(target)
            if row is None:
                row = targets[target] = [0] * _ROW
            row[_ROUTED] += 1
            if decision.status is None:
                continue  # retried: no answer of its own to count
            # the outcome: per (worker, rank, model), in the window, and as a recent decision
            at_period = int(at) // WINDOW_BUCKET_S
            if at_period != period:  # a batch mostly shares one period
                period = at_period
                window = self._bucket(period)
            window[0] += 1
            cached = decision.cached_tokens
            if cached is not None:
                # what the router told the client it reuses: x-kvroute-matched-tokens and
                # x-kvroute-pending-tokens (`Candidate.predicted_tokens`). Before, the pending
                # part was left out, and a prefix predicted from a pending mark that the
                # worker did not reuse (a false hit) counted as exact
                predicted = chosen.predicted_tokens
                row[_USAGE] += 1
                row[_USAGE_PROMPT] += decision.prompt_tokens
                row[_USAGE_PREDICTED] += predicted
                row[_CACHED] += cached
                if chosen.unfollowed:
                    outcome = _UNFOLLOWED  # predicted nothing on purpose: no index lag
                elif cached == predicted:
                    outcome = _EXACT
                else:
                    outcome = _OVER if cached < predicted else _UNDER
                row[outcome] += 1
                window[1] += 1
                window[2] += decision.prompt_tokens
                window[3] += predicted
                window[4] += cached
                window[5] += outcome == _EXACT
                window[6] += outcome == _UNFOLLOWED
            elif decision.status == 200:
                row[_MISSING] += 1
            keep_recent(decision)
        for model, (query, best_match, chosen_match) in blocks.items():
            hists = self._blocks.get(model)
            if hists is None:
                hists = self._blocks[model] = (
                    Histogram(BLOCK_BUCKETS),
                    Histogram(BLOCK_BUCKETS),
                    Histogram(BLOCK_BUCKETS),
                )
            hists[0].observe_many(query)
            hists[1].observe_many(best_match)
            hists[2].observe_many(chosen_match)
        for key, times in ttfts.items():
            hist = self._ttft.get(key)
            if hist is None:
                hist = self._ttft[key] = Histogram(TTFT_BUCKETS)
            hist.observe_many(times)

    @property
    def recent(self) -> deque[Decision]:
        """The last RECENT_DECISIONS requests that ended, oldest first."""
        self.flush()
        return self._recent

    def _bucket(self, period: int) -> list[int]:
        """The window's counters of the 10 s `period` (a scratch row for a period the window
        has moved past: counted late, it is older than the window)."""
        slot = period % WINDOW_BUCKETS
        held = self._window_slot[slot]
        if held != period:
            if held > period:
                return [0] * _W_FIELDS
            self._window_slot[slot] = period
            self._window[slot] = [0] * _W_FIELDS
        return self._window[slot]

    def window(self) -> list[dict[str, float]]:
        """The last 5 minutes, oldest first, one row per 10 s: requests, accuracy (over the
        usage reports of followed workers), hit rates."""
        self.flush()
        now = int(self._clock()) // WINDOW_BUCKET_S
        rows = []
        for period in range(now - WINDOW_BUCKETS + 1, now + 1):
            slot = period % WINDOW_BUCKETS
            v = self._window[slot] if self._window_slot[slot] == period else [0] * _W_FIELDS
            requests, usage, prompt, predicted, cached, exact, unfollowed = v
            judged = usage - unfollowed
            rows.append(
                {
                    "start": float(period * WINDOW_BUCKET_S),
                    "requests": requests,
                    "usage_reports": usage,
                    "accuracy": exact / judged if judged else -1.0,
                    "hit_rate": cached / prompt if prompt else -1.0,
                    "predicted_hit_rate": predicted / prompt if prompt else -1.0,
                    # the counts behind the ratios, so coarser periods can be summed exactly
                    "exact": exact,
                    "unfollowed": unfollowed,
                    "prompt_tokens": prompt,
                    "predicted_tokens": predicted,
                    "cached_tokens": cached,
                }
            )
        return rows

    def forget(self, workers: Collection[str]) -> None:
        """Drop the series of removed `workers` (`RouterMetrics.forget`)."""
        self.flush()
        if any(k[0] in workers for k in self._targets):
            self._targets = {k: v for k, v in self._targets.items() if k[0] not in workers}


_TARGET_COUNTERS = (
    (
        "kvroute_routed_requests",
        "Requests sent, by the (worker, dp rank) chosen and model",
        _ROUTED,
    ),
    (
        "kvroute_usage_reports",
        "Answers whose usage reported cached_tokens (prediction accuracy is over those not "
        "counted as the unfollowed outcome)",
        _USAGE,
    ),
    (
        "kvroute_usage_prompt_tokens",
        "Prompt tokens (the router's count) of the answers that reported cached_tokens",
        _USAGE_PROMPT,
    ),
    (
        "kvroute_usage_predicted_tokens",
        "Cached tokens the router predicted (x-kvroute-matched-tokens plus "
        "x-kvroute-pending-tokens) for those answers",
        _USAGE_PREDICTED,
    ),
    (
        "kvroute_usage_cached_tokens",
        "Cached tokens the worker reported in its usage (the truth to hold predictions against)",
        _CACHED,
    ),
    (
        "kvroute_usage_missing",
        "Successful answers without cached_tokens (the client asked for no usage, or the "
        "engine does not report it)",
        _MISSING,
    ),
)


class DecisionCollector(Collector):
    """Builds the decision and prediction families from `DecisionStats` when scraped."""

    def __init__(self, stats: DecisionStats) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        """The families' names and types, without samples."""
        yield from self._families(empty=True)

    def collect(self) -> Iterator[Metric]:
        """Every family with its current samples."""
        yield from self._families(empty=False)

    def _families(self, *, empty: bool) -> Iterator[Metric]:
        stats = self._stats
        if not empty:
            stats.flush()
        labels = ["worker", "dp_rank", "model"]
        targets = {
            (worker, "" if rank is None else str(rank), model): row
            for (worker, rank, model), row in ({} if empty else stats._targets).items()
        }
        for name, text, slot in _TARGET_COUNTERS:
            family = CounterMetricFamily(name, text, labels=labels)
            for key, row in sorted(targets.items()):
                family.add_metric(list(key), row[slot])
            yield family
        outcomes = CounterMetricFamily(
            "kvroute_prediction_outcomes",
            "Answers by how the worker's cached_tokens compared with the prediction: exact, "
            "over (it reused less than predicted: a false hit) or under (it reused more); "
            "unfollowed: the worker's KV events were left unfollowed by the false-hit watch "
            "when it was routed (no hit predicted on purpose: not in the accuracy)",
            labels=[*labels, "outcome"],
        )
        for key, row in sorted(targets.items()):
            for word, slot in (
                ("exact", _EXACT),
                ("over", _OVER),
                ("under", _UNDER),
                ("unfollowed", _UNFOLLOWED),
            ):
                outcomes.add_metric([*key, word], row[slot])
        yield outcomes
        reasons = CounterMetricFamily(
            "kvroute_route_decisions",
            "Routing decisions by why the chosen worker won: prefix (it held the longest "
            "match), load (a longer match elsewhere lost on load), room (a longer match "
            "elsewhere lost on what the request would evict there), none (no worker held any)",
            labels=["model", "reason"],
        )
        for (model, reason), n in sorted(({} if empty else stats._reasons).items()):
            reasons.add_metric([model, reason], n)
        yield reasons
        for which, (name, text) in enumerate(
            (
                (
                    "kvroute_route_query_blocks",
                    "Full blocks in each routed prompt (at the chosen worker's block size)",
                ),
                (
                    "kvroute_route_best_match_blocks",
                    "The fleet's longest held prefix of each routed prompt, in blocks (events "
                    "and pending marks)",
                ),
                (
                    "kvroute_route_chosen_match_blocks",
                    "The chosen (worker, rank)'s held prefix of each routed prompt, in blocks",
                ),
            )
        ):
            rows: dict[tuple[str, ...], Histogram] = (
                {} if empty else {(model,): hists[which] for model, hists in stats._blocks.items()}
            )
            yield _histogram_family(name, text, ["model"], rows)
        ttft: dict[tuple[str, ...], Histogram] = (
            {} if empty else {k: v for k, v in stats._ttft.items()}
        )
        yield _histogram_family(
            "kvroute_time_to_first_token_seconds",
            "Time from the request's arrival to the worker's first byte, at the router",
            ["endpoint", "model"],
            ttft,
        )


def _histogram_family(
    name: str, text: str, labels: list[str], rows: Mapping[tuple[str, ...], Histogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, text, labels=labels)
    for key, hist in sorted(rows.items()):
        family.add_metric(list(key), hist.buckets(), hist.total)
    return family
