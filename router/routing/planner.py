"""The routing decision for one request: index lookup + health + load, ranked by the policy.

`plan` is read-only (it backs the `/admin/route` dry run as well as real routing); `commit`
is the one place a real decision changes state: pending index entries (when the policy marks
them), the policy's memory, and the in-flight load. The proxy reports back what became of the
request (`first_byte`, `finish`, `record_failure`, `record_success`) without reaching into the
load tracker or the breakers. It picks the worker and nothing else: the batch scheduling of
a worker's requests is the workers' business (`workers.scheduler` in the reference worker).

Data-parallel ranks: a worker whose KV events come from several ranks (one cache each) is
offered as one candidate per rank, each with that rank's own match and load, and the engine
is told the rank (`Candidate.dp_rank`; the proxy says it the way the worker's engine reads
it). A worker with one rank, or without KV events (its ranks unknown), is one candidate with
no rank: nothing is added to its requests and the engine picks, as before. A request whose
client named a rank (`ParsedRequest.dp_rank`) is offered only that rank of each worker (a
worker with one rank only when the rank is 0, since the engine refuses any other; a worker
whose ranks are unknown is kept and left to check it). Health, the circuit breaker and
retries stay per worker: a failure is the worker's, so a retry goes to another worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import msgspec

from indexer.engines import SGLANG, EngineSpec, PdRole, engine_spec
from indexer.index import DEFAULT_MEDIUM
from indexer.service import (
    UNTRUSTED,
    IndexerService,
    Namespace,
    RankMatch,
    ShadowMark,
    StreamState,
    WorkerMatch,
)
from router.config import LimitsConfig, PolicyConfig
from router.prompt.output_limit import PREFILL_OUTPUT_TOKENS
from router.prompt.request import Endpoint, ParsedRequest
from router.routing.admission import (
    AdmissionForecast,
    RecencyBook,
    WaitingDecisions,
    forecast,
    recency_stride,
    stretch_keys,
    unbooked,
    unforecast,
)
from router.routing.balance import BalanceEstimate, BalanceModel
from router.routing.decisions import DecisionSink
from router.routing.eviction_cost import eviction_cost
from router.routing.load import LoadTracker, Ticket, Withdraw
from router.routing.namespace import (
    Fingerprinter,
    KeyedShadow,
    keyed_namespaces,
    request_namespace,
)
from router.routing.policy import Candidate, Policy, effective_hit
from router.routing.pool import WorkerEntry, WorkerPool, WorkerStatus
from router.routing.prefill_watch import PrefillWatch
from router.routing.prompt_keys import PromptKeys

__all__ = ["SHADOW_KEEP_S", "Candidate", "Plan", "Planner", "unindexed_reason"]

# how long at least a prompt sent with an extra_key shadows its plain twin on that stream: longer
# than any request waits and runs, so its pages are stored and their events in by then (after
# that, for as long as the stream still holds the prefix: `indexer.shadowed`)
SHADOW_KEEP_S = 3600.0

# answers that could be no balance sample (whole, or streamed behind a whole one) before the log
# says the fit has too few samples (once, `Planner._sampled`)
THIN_UNSAMPLED = 100

_log = logging.getLogger(__name__)


class Plan(msgspec.Struct, frozen=True):
    """A ranked decision: candidates best first, unroutable ones last."""

    namespace: str  # fingerprint, never the salt
    prompt_tokens: int
    candidates: list[Candidate]
    # why no KV event can vouch for this request's prefix on any worker (then only pending
    # marks of earlier decisions count), e.g. "extra_key"; None when events can
    unindexed: str | None = None
    # the learned hit/load balance the scores used (`router.routing.balance`), None: the
    # configured decode_weight (balance_learning off)
    balance: BalanceEstimate | None = None

    @property
    def worker(self) -> str | None:
        """The chosen worker, or None when no worker is routable."""
        first = self.candidates[0] if self.candidates else None
        return first.worker if first is not None and first.healthy else None

    @property
    def dp_rank(self) -> int | None:
        """The chosen worker's rank the engine is told to use (None: the engine picks)."""
        first = self.candidates[0] if self.candidates else None
        return first.dp_rank if first is not None and first.healthy else None

    def ranked(self) -> list[Candidate]:
        """The routable candidates in order: the first choice, then retries."""
        return [c for c in self.candidates if c.healthy]


def unindexed_reason(ns: Namespace) -> str | None:
    """Which part of the request's cache key the KV events cannot show, if any.

    SGLang keys its radix cache by (extra_key, cache_salt) but publishes only the salt (and a
    LoRA adapter's name, whose id the engine appends to extra_key itself), so a request with
    its own extra_key may not share pages an event shows: no event-based hit (fail closed).
    """
    return "extra_key" if ns.extra_key is not None else None


# the recency book keeps a backlog's prompts up to this many pools' worth of blocks: a block
# below that many is lost however the rest is counted, and it bounds the book per stream
_BACKLOG_POOLS = 8

_NO_MATCH = WorkerMatch(
    worker="",
    matched_blocks=0,
    matched_tokens=0,
    pending_tokens=0,
    block_size=None,
    by_medium={},
    state=StreamState.STALE,
)


def _split_unknown(entry: WorkerEntry, model: str) -> str:
    """Why a worker is predicted no hit for an OpenAI request whose `model` SGLang 0.5.17-0.5.22
    split elsewhere than 0.5.23 does: its pages are another adapter's, or may be."""
    shown = repr(model[:64])
    if entry.version is not None and entry.splits_served_name_first is False:
        return (
            f"its SGLang {entry.version[:32]} reads the adapter of model {shown} at the "
            "first ':' (0.5.17-0.5.22), another than the router's: no hit predicted"
        )
    version = "not advertised" if entry.version is None else repr(entry.version[:32])
    return (
        f"its SGLang version is {version}: whether it reads the adapter of model {shown} "
        "after the served name (0.5.23) or at the first ':' (0.5.17-0.5.22) is not known: "
        "no hit predicted"
    )


def _adapter_reader(parsed: ParsedRequest, ns: Namespace) -> str | None:
    """The one engine that reads the adapter of `ns` from `parsed` (None: no adapter, or
    both read it alike). vLLM names an adapter by the request's `model` alone and ignores
    `lora_path`; SGLang reads it from `lora_path` or a `base:adapter` model, and takes a model
    it does not serve for its own. In a pool of both engines (given one model name), the pages
    one engine cached for that adapter are not what the other serves the request from: QA saw
    96 tokens predicted on a vLLM worker for a `lora_path` request it served from the base
    model, 0 cached."""
    if ns.lora is None:
        return None
    if parsed.endpoint is not Endpoint.GENERATE and ns.lora == parsed.model:
        return None if parsed.lora == ns.lora else "vllm"  # named by itself
    return "sglang"


def _read_otherwise(entry: WorkerEntry, reader: str) -> str:
    """Why a worker is predicted no hit for a request whose adapter only `reader` reads."""
    how = (
        "ignores lora_path and a base:adapter model"
        if reader == "sglang"
        else "reads no adapter from a model it does not serve"
    )
    return (
        f"its engine ({entry.config.engine}) {how}: the adapter's pages there are not this "
        "request's, no hit predicted"
    )


def _match_limit(tokens: Sequence[int], reuse_limit: int | None) -> int:
    """The leading tokens of the prompt a worker can reuse at most."""
    # Engines never reuse the cache for a prompt's last token (its logits must be computed),
    # so the hit a worker can give is the held prefix of tokens[:-1], rounded to its blocks
    # (`limit` says so without copying an 8k-token list); nor from the first prompt token
    # whose logprob the request asks for (`router.prompt.reuse_limit`)
    limit = max(len(tokens) - 1, 0)
    return limit if reuse_limit is None else min(limit, reuse_limit)


# a request's bounds where a caller names none (tests; the proxy passes its config's)
_LIMITS = LimitsConfig()
# what a candidate's `hidden` and its forecast's `why` say of entries an extra_key's shadow
# hides: never the extra_key itself
_SHADOWED = "extra_key shadow"
_SHADOWED_WHY = (
    "nothing matched: its entries for this prompt are hidden by an extra_key shadow (a "
    "request with an extra_key sent here may have stored them, and the events cannot tell "
    "its pages from plain ones)"
)
_SHADOWED_CUT = (
    "{} more tokens of this prompt that its entries hold are hidden by an extra_key shadow "
    "(a request with an extra_key sent here may have stored them, and the events cannot tell "
    "its pages from plain ones); "
)


def _gpu_reused_tokens(candidate: Candidate) -> int:
    """The prefix the candidate is predicted to reuse from its GPU pages, without allocating:
    the predicted reuse less its blocks on another tier (`by_medium`: a block held on the GPU
    and the host counts as the GPU's), which the worker loads back into new GPU pages. Counted
    as if every such block were in the predicted part, so a host-tier match never makes room."""
    offloaded_blocks = sum(
        blocks for medium, blocks in candidate.by_medium.items() if medium != DEFAULT_MEDIUM
    )
    if not offloaded_blocks or not candidate.matched_blocks:
        return candidate.predicted_tokens
    block_size = candidate.matched_tokens // candidate.matched_blocks
    return max(0, candidate.predicted_tokens - offloaded_blocks * block_size)


def _unfit(capacity_tokens: int | None, prompt_tokens: int, output_tokens: int) -> str | None:
    """Why a rank with a KV pool of `capacity_tokens` cannot hold a request of `prompt_tokens`
    that may generate `output_tokens` at all (None: it can, or its capacity is unknown): a
    request runs with its whole prompt and output in the pool (SGLang's `max_total_num_tokens`;
    the reference worker refuses it with a 400)."""
    need = prompt_tokens + output_tokens
    if capacity_tokens is None or need <= capacity_tokens:
        return None
    return (
        f"its KV pool holds {capacity_tokens} tokens, fewer than the request's "
        f"{prompt_tokens}-token prompt and the {output_tokens} tokens it may generate: it "
        "cannot run there"
    )


def _evicted_by(found: AdmissionForecast, new_tokens: int) -> int | None:
    """What a request allocating `new_tokens` evicts where `found` was forecast, after the
    requests ahead of it (0: it fits; None: the capacity is unknown), from the events' view:
    the stores not in them yet (`unseen_tokens`) left out of the queue."""
    if found.capacity_tokens is None:
        return None
    before = found.held_tokens + found.queued_tokens - found.unseen_tokens - found.capacity_tokens
    return max(0, before + new_tokens) - max(0, before)


class Planner:
    """Plans and commits routing decisions for a pool of workers."""

    def __init__(
        self,
        config: PolicyConfig,
        policy: Policy,
        pool: WorkerPool,
        indexer: IndexerService,
        load: LoadTracker,
        fingerprint: Fingerprinter,
    ) -> None:
        self._config = config
        self.policy = policy
        self.pool = pool
        self.indexer = indexer
        self.load = load
        self.fingerprint = fingerprint
        self.clock = time.monotonic
        # told of every commit and its progress (router replicas share them); None: alone
        self.decisions: DecisionSink | None = None
        # called when a request answers or ends here (room may have come free): the proxy's
        # held requests look again (`policy.hold_until_room`)
        self.on_progress: Callable[[Ticket], None] | None = None
        # per stream id: the order the router last sent requests over its blocks, and the
        # stamps of its decisions whose requests have not started answering
        self.recency: dict[str, RecencyBook] = {}
        self.waiting: dict[str, WaitingDecisions] = {}
        # requests on prefill sides until their events show the prompt computed
        self.prefills = PrefillWatch()
        indexer.applied_listeners.append(self._events_applied)
        # a request's end frees pages: the requests waiting there for KV room may go in
        load.end_listeners.append(self._room_freed)
        self.balance = BalanceModel(config.decode_weight, config.balance_prior_samples)
        # whether the log said the balance fit has too few samples (`_sampled`)
        self._thin_said = False
        # the prompt being routed: its block keys, made once for every candidate's forecast,
        # its pending marks and its recency
        self.keys = PromptKeys(indexer)

    def reconfigure(self, config: PolicyConfig) -> None:
        """Plan with `config`'s weights from the next request on (a reload)."""
        self._config = config
        self.policy.reconfigure(config)

    def namespace(self, parsed: ParsedRequest, limits: LimitsConfig = _LIMITS) -> Namespace:
        """The cache namespace `parsed` lives in (UnknownModelError: no worker serves it; a
        RequestError for an adapter its model names that `limits` refuse)."""
        return request_namespace(parsed, self.pool.resolve(parsed.model), limits)

    def keyed(self, parsed: ParsedRequest) -> tuple[KeyedShadow, ...]:
        """The namespaces and tokens of `parsed`'s batch items (after the first) that carry
        an extra_key (`keyed_namespaces`), for `commit` to shadow; () for most requests."""
        if not parsed.keyed:
            return ()
        return keyed_namespaces(parsed, self.pool.resolve(parsed.model))

    def plan(
        self,
        parsed: ParsedRequest,
        namespace: Namespace | None = None,
        *,
        role: PdRole = "both",
        policy: Policy | None = None,
    ) -> Plan:
        """Rank every worker of `parsed`'s model (every rank of one with several) that has
        `role` (prefill/decode pairs plan each side: `router.routing.pd`), by `policy` (default:
        the configured one); changes no state."""
        ns = namespace if namespace is not None else self.namespace(parsed)
        output = parsed.output_tokens
        # the output it surely may generate, for the pools that cannot hold it at all (one
        # that named no limit: its first token)
        least = 1 if output is None else output
        if role == "prefill":
            output = least = PREFILL_OUTPUT_TOKENS
        elif output is None:
            output = self._config.admission_reserve_tokens
        # SGLang's OpenAI routes read `base:adapter` from the model (`/generate` takes none)
        openai = parsed.endpoint is not Endpoint.GENERATE
        contested = openai and ":" in parsed.model and self.pool.split_contested(parsed.model)
        return self._plan(
            ns,
            parsed.tokens,
            parsed.dp_rank,
            role,
            policy or self.policy,
            output_tokens=output,
            least_output_tokens=least,
            reuse_limit=parsed.reuse_limit,
            contested=parsed.model if contested else None,
            read_by=_adapter_reader(parsed, ns),
        )

    def _plan(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        pinned: int | None = None,
        role: PdRole = "both",
        policy: Policy | None = None,
        *,
        output_tokens: int,
        least_output_tokens: int | None = None,
        reuse_limit: int | None = None,
        contested: str | None = None,
        read_by: str | None = None,
    ) -> Plan:
        """`contested`: the request's model, when SGLang releases read its adapter otherwise
        (`WorkerPool.split_contested`): the workers not known to read it as the router does
        are predicted no hit (`_split_unknown`). `read_by`: the one engine that reads the
        namespace's adapter from the request as the router did (`_adapter_reader`): workers
        of another engine in the pool are predicted no hit. `least_output_tokens`: the output
        the request surely may generate (default `output_tokens`): a rank whose KV pool cannot
        hold it and the prompt is not routable for it while another can (`_unfit`)."""
        now = self.clock()
        limit = _match_limit(tokens, reuse_limit)
        matches = self.indexer.query(ns, tokens, limit) if self.indexer.worker_count() else {}
        views: list[Candidate] = []
        least = output_tokens if least_output_tokens is None else least_output_tokens
        for entry in self.pool.serving(ns.model):  # a request never leaves its model's pool
            if entry.role != role:
                continue
            match = matches.get(entry.id, _NO_MATCH)
            unpredicted = None
            if contested is not None and not entry.splits_served_name_first:
                match, unpredicted = _NO_MATCH, _split_unknown(entry, contested)
            elif read_by is not None and entry.config.engine != read_by:
                match, unpredicted = _NO_MATCH, _read_otherwise(entry, read_by)
            found = self._candidates(entry, match, now, pinned, ns, tokens, limit, output_tokens)
            unfit = _unfit(entry.capacity_tokens, len(tokens), least)
            for candidate in found:
                candidate.unpredicted = unpredicted
                candidate.unfit = unfit
            views.extend(found)
        if any(view.healthy and view.unfit is None for view in views):
            # a rank whose pool cannot hold the request is not routable for it while another
            # can: the worker would refuse it (before, one was chosen and its 400 passed to the
            # client: QA, 8 of 12 2,000-token prompts to a 1,024-token pool beside an 8,192 one)
            for view in views:
                if view.unfit is not None:
                    view.healthy = False
        chooser = policy or self.policy
        balance = None
        if self._config.balance_learning:
            balance = self.balance.estimate()
            chooser.decode_weight = balance.decode_weight
        candidates = chooser.rank(tokens, views)
        if (
            self._config.hold_until_room
            and role != "decode"
            and candidates
            and candidates[0].healthy
        ):
            # only the first choice is held for (`Proxy.hold_for_room`), and a pair only for
            # its prefill side
            first = candidates[0]
            first.room = self.has_room(first, len(tokens), output_tokens)
        return Plan(
            namespace=self.fingerprint(ns),
            prompt_tokens=len(tokens),
            candidates=candidates,
            unindexed=unindexed_reason(ns),
            balance=balance,
        )

    def explain_hidden(
        self, candidates: Sequence[Candidate], parsed: ParsedRequest, ns: Namespace
    ) -> None:
        """Say on each of the candidates (a dry run's: this matches the prompt again)
        whose index entries for the prompt are hidden or cut by an extra_key shadow: it
        predicts nothing there, or less than its entries hold, as a cold cache (or a shorter
        match) would, and `hidden` (and the forecast's `why`) tells them apart."""
        if unindexed_reason(ns) is not None or not self.indexer.worker_count():
            return
        limit = _match_limit(parsed.tokens, parsed.reuse_limit)
        hidden = self.indexer.shadow_hidden(ns, parsed.tokens, limit)
        if not hidden:
            return
        for candidate in candidates:
            streams = self.indexer.stream_ids(candidate.worker, candidate.dp_rank)
            # a worker offered whole (its ranks' best match; the engine picks the rank): said
            # where one of its ranks is hidden
            cut = max((hidden[s] for s in streams if s in hidden), default=None)
            if cut is None:
                continue
            candidate.hidden = _SHADOWED
            admission = candidate.admission
            if admission is None:
                continue
            if not admission.raw_tokens:
                admission.why = _SHADOWED_WHY
            else:
                # a match cut to what the plain tree surely holds: the rest is not evicted
                admission.why = _SHADOWED_CUT.format(cut) + admission.why

    def _candidates(
        self,
        entry: WorkerEntry,
        match: WorkerMatch,
        now: float,
        pinned: int | None,
        ns: Namespace,
        tokens: Sequence[int],
        limit: int,
        output_tokens: int,
    ) -> list[Candidate]:
        """One candidate per rank of a worker with several, else one for the worker."""
        status = entry.status(now)
        ranks = match.ranks
        if len(ranks) > 1:
            out = [
                self._candidate(entry, status, rank.dp_rank, rank, str(rank.state))
                for rank in ranks
                if pinned is None or rank.dp_rank == pinned
            ]
        elif pinned is not None and ranks and ranks[0].dp_rank != pinned:
            return []  # its one rank is another: the engine would refuse the request
        else:
            state = str(match.state) if match.worker else None
            out = [self._candidate(entry, status, None, match, state)]
        if self._config.admission:
            for candidate in out:
                self._forecast(entry, candidate, ns, tokens, limit, output_tokens)
        return out

    def _forecast(
        self,
        entry: WorkerEntry,
        candidate: Candidate,
        ns: Namespace,
        tokens: Sequence[int],
        limit: int,
        output_tokens: int,
    ) -> None:
        """Forecast what of the candidate's match it still holds when it admits the request
        (`router.routing.admission`): the prediction it reports, and with
        `admission_scoring` the hit it is scored by (shrunk in proportion); with an
        `eviction_weight`, what its own allocation (the uncached prompt and `output_tokens`)
        would evict (`router.routing.eviction_cost`)."""
        raw = candidate.matched_tokens + candidate.pending_tokens
        streams = self.indexer.stream_ids(entry.id, candidate.dp_rank)
        if len(streams) != 1:
            why = "no KV-event stream" if not streams else "several ranks, the engine picks"
            whole = unforecast(raw, why, entry.capacity_tokens)
            if entry.caches_prompts_late:
                whole = unbooked(whole, candidate.matched_tokens)
            self._admit_forecast(candidate, whole)
            return
        # A match that reaches an offload tier is forecast the same way, in a pool the size of
        # the host tier where the worker advertises one (SGLang's HiCache keeps a copy of
        # what the GPU holds there, so the host pool is what the two keep), and of the GPU
        # pool where it does not (as if that tier kept nothing more: the GPU evictions the
        # forecast counts are what fill it, and so what evicts from it). Offloaded blocks are
        # the older ones, first to go. Before, the raw match was used, and a host-tier prefix
        # evicted meanwhile was predicted whole (992 tokens predicted, 0 cached).
        stream = streams[0]
        capacity, held = entry.capacity_tokens, self.indexer.held_tokens(stream)
        host = entry.host_capacity_tokens
        offloaded = any(medium != DEFAULT_MEDIUM for medium in candidate.by_medium)
        if offloaded and host is not None and capacity is not None and host > capacity:
            capacity, held = host, self.indexer.held_tokens(stream, every_tier=True)
        load = self.load.of(entry.id, candidate.dp_rank)
        # the output its running requests may add (their own limits where they named one)
        reserve = round(load.output_per_request(self._config.admission_reserve_tokens))
        waiting = self._waiting(stream)
        block_size = self.indexer.index.block_size(stream)
        stride = recency_stride(block_size or 1)
        stretch = None if block_size is None else block_size * stride
        holds = self.indexer.index.holds
        unseen = waiting.unseen(self.clock(), lambda key: holds(stream, [key])[0])

        # the forecast and the eviction charge may both need the prompt's block keys: made
        # once, and only when asked (a plain memo: functools.cache costs a microsecond to
        # make, per candidate of every request)
        made: list[int] | None = None

        def keys() -> list[int]:
            nonlocal made
            if made is None:
                made = self.keys.of(stream, ns, tokens, limit)
            return made

        found: AdmissionForecast = forecast(
            raw_tokens=raw,
            matched_tokens=candidate.matched_tokens,
            capacity_tokens=capacity,
            held_tokens=held,
            queued_tokens=load.queued_prefill_tokens,
            # and the prompts of requests that answered, stored, and are not in the events yet
            unseen_tokens=unseen * (block_size or 0),
            # only the requests a rank runs at once hold private pages; the rest wait
            in_flight=min(load.running, entry.max_running_requests or load.running),
            reserve_tokens=reserve,
            block_size=block_size,
            keys=keys,
            book=self.recency.get(stream),
            # a namespace no event can show (extra_key): its pending marks are all there is
            waiting=waiting if unindexed_reason(ns) is None else None,
            # the next batch there: what the running cap leaves beside the requests decoding
            # (in flight and answered)
            batch_room=(
                None
                if entry.max_running_requests is None
                else entry.max_running_requests - max(0, load.running - len(waiting))
            ),
            now=self.clock(),
            seq=self._last_seq(stream),
            stride=stride,
            # a prefill side keeps each prompt's pages until its decode has them: in a
            # backlog it admits as they come free, a few at a time
            trickles=entry.role == "prefill",
            # no batch takes more: what bounds the batch of a request waiting for KV room
            running_cap=entry.max_running_requests,
            cached_late=entry.caches_prompts_late,
        )
        self._admit_forecast(candidate, found)
        # its own allocation: the uncached prompt and the output it may generate there
        own = max(0, len(tokens) - found.kept_tokens) + output_tokens
        # the room charge as before, from the events' view: counting the stores not in them
        # yet there too moved the routing benchmark's hit rates 0.2-1.8 points down in one
        # sitting (2026-12-06), the forecast alone none beyond its noise
        candidate.evicts_tokens = _evicted_by(found, own)
        if self._config.eviction_weight > 0 and block_size:
            kept_blocks = found.kept_tokens // block_size

            def reused() -> set[int]:
                return set(stretch_keys(keys()[:kept_blocks], stride))  # as the book keeps

            candidate.eviction = eviction_cost(
                admission=found,
                new_tokens=own,
                # the book keeps a block per stretch: each stands for the stretch it ends
                block_size=stretch,
                book=self.recency.get(stream),
                holder_counts=self.indexer.holder_counts,
                reused=reused,
            )

    def _admit_forecast(self, candidate: Candidate, found: AdmissionForecast) -> None:
        """`found` is what `candidate` predicts; with `admission_scoring`, its hit is scored
        in proportion to what of the raw match it keeps."""
        candidate.admission = found
        if found.kept_tokens < found.raw_tokens and self._config.admission_scoring:
            candidate.hit_tokens *= found.kept_tokens / found.raw_tokens

    def _candidate(
        self,
        entry: WorkerEntry,
        status: WorkerStatus,
        dp_rank: int | None,
        match: WorkerMatch | RankMatch,
        stream_state: str | None,
    ) -> Candidate:
        load = self.load.of(entry.id, dp_rank)
        cap = self._running_cap(entry, dp_rank)
        return Candidate(
            worker=entry.id,
            url=entry.url,
            healthy=status is WorkerStatus.READY,
            status=status,
            dp_rank=dp_rank,
            matched_tokens=match.matched_tokens,
            matched_blocks=match.matched_blocks,
            pending_tokens=match.pending_tokens,
            stream_state=stream_state,
            unfollowed=entry.unfollowed_until is not None,
            by_medium=match.by_medium,
            hit_tokens=effective_hit(
                matched_blocks=match.matched_blocks,
                pending_tokens=match.pending_tokens,
                block_size=match.block_size,
                by_medium=match.by_medium,
                # entries kvroute cannot vouch for: no affinity
                stale=match.state in UNTRUSTED,
                weights=self._config.medium_weights,
            ),
            # requests held in the router for the rank wait as if queued there
            queued_prefill_tokens=load.queued_prefill_tokens + load.held_tokens,
            running=load.running,
            kv_tokens=load.kv_tokens,
            running_cap=cap,
            running_output_tokens=(
                0.0
                if cap is None
                else load.output_per_request(self._config.admission_reserve_tokens)
            ),
        )

    @staticmethod
    def _running_cap(entry: WorkerEntry, dp_rank: int | None) -> int | None:
        """How many requests the candidate runs at once, the rest waiting in its queue
        (`Policy.queue_wait`): its rank's `max_running_requests`, every rank's for a worker
        offered whole (its engine picks the rank). None: unknown, or a prefill/decode side,
        whose places are held by KV transfers rather than by outputs."""
        cap = entry.max_running_requests
        if cap is None or entry.role != "both":
            return None
        if dp_rank is None:
            cap *= max(1, len(entry.streams), entry.config.dp_size or 1)
        return cap

    def engine(self, worker: str) -> EngineSpec:
        """The engine rules of `worker` (how it is told a rank); SGLang's if it left the pool."""
        entry = self.pool.find(worker)
        return engine_spec(entry.config.engine) if entry is not None else SGLANG

    def commit(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        candidate: Candidate,
        *,
        first_try: bool,
        output_tokens: int | None = None,
        keyed: Sequence[KeyedShadow] = (),
        stores_prompt: bool = True,
        whole_answer: bool = False,
    ) -> Ticket:
        """Record that the request goes to `candidate`; returns its load ticket.

        Pending marks and load go to the candidate's rank only (with no rank, the engine picks:
        the marks go on every stream of the worker). `output_tokens`: the output the request
        may generate there (None: not known). `keyed`: a batch's other items with an
        extra_key (`shadow`). `stores_prompt` False: the engine may store the prompt under
        other keys than these tokens' (a request that can reuse nothing the router can
        predict: `ParsedRequest.reuse_limit` 0), so nothing is marked pending, nor made
        recently used (the worker touches no blocks of these keys for it). `whole_answer`: the
        client gets its answer whole, whose first byte comes only once it has decoded too:
        until then it counts as queued prefill of unknown state (`WorkerLoad.blind`)."""
        if first_try:
            self.policy.record(tokens, candidate.target)
        # there its pages may be another namespace's than `ns` (`Plan` predicted it nothing)
        stores_prompt = stores_prompt and candidate.unpredicted is None
        marked = (
            stores_prompt
            and self.policy.marks_pending
            and self.indexer.has_worker(candidate.worker)
        )
        pending: list[tuple[str, int]] = []
        if marked:
            pending = self.indexer.add_pending(
                ns, tokens, candidate.worker, candidate.dp_rank, keys_of=self.keys_of(ns, tokens)
            )
        marks: list[tuple[str, int]] = []
        if stores_prompt:
            marks = self.book_decision(
                ns,
                tokens,
                candidate.worker,
                candidate.dp_rank,
                kept_tokens=candidate.predicted_tokens,
                held_tokens=candidate.matched_tokens,
                output_tokens=output_tokens,
            )
        before = self.load.of(candidate.worker, candidate.dp_rank)
        ahead_tokens, ahead_running = before.queued_prefill_tokens, before.running
        ticket = self.load.begin(
            candidate.worker,
            candidate.uncached_tokens(len(tokens)),
            candidate.dp_rank,
            output_tokens=output_tokens,
            prompt_tokens=len(tokens),
            blind=whole_answer,
        )
        ticket.marks = marks
        ticket.pending = pending
        # one sent behind a full batch first waits for a place: its time to first token is
        # the queue's drain (`Policy.queue_wait`), which the balance's two terms cannot fit
        cap = candidate.running_cap
        ticket.sent_at = self.clock() if cap is None or ahead_running < cap else None
        if self._config.balance_learning:
            self._sampled(ticket, whole_answer=whole_answer, blind_ahead=before.blind)
        ticket.ahead_tokens = ahead_tokens + ticket.prefill_tokens
        ticket.ahead_running = ahead_running
        entry = self.pool.find(candidate.worker)
        if entry is not None and entry.role == "prefill" and ticket.prefill_tokens:
            self._watch_prefill(ns, tokens, candidate, ticket)
        self.share(ns, tokens, candidate, ticket, marked=marked)
        # after `share`: the other replicas know the request by then, and tie its shadows to it
        ticket.shadows = self.shadow(ns, tokens, candidate.worker, candidate.dp_rank, keyed, ticket)
        return ticket

    def _sampled(self, ticket: Ticket, *, whole_answer: bool, blind_ahead: int) -> None:
        """Whether the request can be a sample of the balance fit. A whole answer cannot (its
        first byte comes after its decode); nor can a streamed one sent while a whole answer
        was counted as queued prefill on its rank (`blind_ahead`, not counting itself): that
        one may have been prefilled long ago and be decoding now, and the fit would spread
        the time to first token over prefill that was not ahead. Before, it was a sample: half
        the answers whole drove decode_weight to its floor (prior / 4). A fleet where that
        leaves the fit too few samples is said once in the log."""
        balance = self.balance
        if whole_answer:
            balance.whole_answers += 1
        elif blind_ahead and ticket.sent_at is not None:
            balance.behind_whole += 1
            ticket.sent_at = None
        else:
            return
        unsampled = balance.whole_answers + balance.behind_whole
        if (
            not self._thin_said
            and unsampled >= THIN_UNSAMPLED
            and balance.samples < self._config.balance_prior_samples
        ):
            self._thin_said = True
            _log.warning(
                "balance learning has %.0f samples after %d answers that could be none "
                "(%d whole, %d streamed behind a whole one on their rank): decode_weight "
                "stays near the configured %s until streamed answers arrive with no whole "
                "answer queued ahead (/admin/route: the plan's balance)",
                balance.samples,
                unsampled,
                balance.whole_answers,
                balance.behind_whole,
                self._config.decode_weight,
            )

    def share(
        self, ns: Namespace, tokens: Sequence[int], candidate: Candidate, ticket: Ticket, *,
        marked: bool,
    ) -> None:  # fmt: skip
        """Tell the other replicas (`decisions`) that the request of `ticket` went to
        `candidate`, its prefix marked pending there or not."""
        if self.decisions is None:
            return
        block_size, keys = self._shared_keys(ns, tokens, candidate) if marked else (0, [])
        self.decisions.committed(
            ns,
            tokens,
            ticket,
            marked=marked,
            kept_tokens=candidate.predicted_tokens,
            held_tokens=candidate.matched_tokens,
            block_size=block_size,
            keys=keys,
        )

    def shadow(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        worker: str,
        dp_rank: int | None,
        keyed: Sequence[KeyedShadow] = (),
        ticket: Ticket | None = None,
    ) -> list[ShadowMark]:
        """What a request with an extra_key stores on (worker, rank) (each item of a batch
        that has one), its events show as plain pages of its salt: plain queries must not
        take them for their own (`indexer.shadowed`). Returns the shadows made here, which
        its `ticket` (None: a request routed by a gateway, `router.http.kv_query`) takes
        back, here and on the other replicas, if it stores nothing (`Withdraw.ALL`)."""
        if (ns.extra_key is None and not keyed) or not self.indexer.may_shadow(worker):
            return []  # the common request: nothing to shadow, no lookup on its path
        shadows = [(ns, tokens)] if ns.extra_key is not None else []
        shadows.extend(keyed)
        made: list[ShadowMark] = []
        for shadow_ns, shadow_tokens in shadows:
            made.extend(
                self.indexer.shadow(shadow_ns, shadow_tokens, worker, dp_rank, SHADOW_KEEP_S)
            )
            if self.decisions is not None:  # whatever the policy: every replica routes plain
                self.decisions.shadowed(shadow_ns, shadow_tokens, worker, dp_rank, ticket)
        return made

    def _watch_prefill(
        self, ns: Namespace, tokens: Sequence[int], candidate: Candidate, ticket: Ticket
    ) -> None:
        """Watch a prefill side's request until its events show its prompt computed
        (`router.routing.prefill_watch`): by the last full block short of the prompt's last
        token, on each stream it went to that does not hold that block already (none for a
        worker without KV events)."""
        for stream in self.indexer.stream_ids(candidate.worker, candidate.dp_rank):
            keys = self.keys.of(stream, ns, tokens, max(len(tokens) - 1, 0))
            if keys and not self.indexer.holds(stream, keys[-1:])[0]:
                self.prefills.watch(stream, ticket, keys[-1])

    def _events_applied(self, stream: str) -> None:
        """An event batch was applied on `stream`: the requests whose prompts it stored there
        no longer count as queued prefill."""
        for computed in self.prefills.sweep(stream, self.indexer.holds):
            self.load.computed(computed)

    def _shared_keys(
        self, ns: Namespace, tokens: Sequence[int], candidate: Candidate
    ) -> tuple[int, list[int]]:
        """(block size, the prompt's block keys) on the candidate's stream(s), made already
        for its marks, for the other replicas to mark and touch the blocks by (`Pending.keys`);
        (0, []) when its streams do not share one page size or the keys are not known."""
        index = self.indexer.index
        streams = self.indexer.stream_ids(candidate.worker, candidate.dp_rank)
        sizes = {index.block_size(s) if index.has_stream(s) else None for s in streams}
        if len(sizes) != 1 or not (size := sizes.pop()):
            return 0, []
        keys = self.keys.of(streams[0], ns, tokens)
        return (size, keys) if keys else (0, [])

    def keys_of(self, ns: Namespace, tokens: Sequence[int]) -> Callable[[str], list[int]]:
        """The prompt's keys per stream, for the index's pending marks (`PromptKeys`)."""
        return lambda stream: self.keys.of(stream, ns, tokens)

    def release_marks(self, marks: list[tuple[str, int]], *, first_byte: bool) -> None:
        """The request of these (stream, stamp) marks answered (`first_byte`) or ended: its
        prompt is no longer on its way (another replica's, through `router.cluster`)."""
        now = self.clock()
        for stream, stamp in marks:
            waiting = self.waiting.get(stream)
            if waiting is not None:
                waiting.answered(stamp, first_byte=first_byte, now=now, seq=self._last_seq(stream))

    def book_decision(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        worker: str,
        dp_rank: int | None,
        *,
        kept_tokens: int,
        held_tokens: int,
        keys_of: Callable[[str], list[int]] | None = None,
        output_tokens: int | None = None,
    ) -> list[tuple[str, int]]:
        """A request goes to (worker, rank), predicted to reuse `kept_tokens` of the
        `held_tokens` the events showed held: its prompt's blocks on the chosen stream(s)
        become the most recently used, as the worker will make them when it admits and caches
        the request, and the decision waits for its answer. Called before the request's load
        begins, for this router's decisions and for another replica's (`router.cluster`);
        returns the (stream, stamp) marks for its ticket, to release once it answers or ends
        (none with `admission` off). `keys_of(stream)`: the prompt's block keys there when
        the caller has them instead of the tokens (a peer's decision); else made from
        `tokens`. `output_tokens`: the output it may generate (None: not known), for whether
        the rank's KV pool has room for it beside the requests in flight."""
        marks: list[tuple[str, int]] = []
        if not self._config.admission:
            return marks
        entry = self.pool.find(worker)
        capacity = entry.capacity_tokens if entry is not None else None
        if capacity is None:
            return marks  # nothing is forecast without a capacity: keep no book
        # the pool has room for it when it and the requests in flight there fit, each at
        # its whole prompt and output (a cached prefix's pages are kept while a request
        # runs): else the worker keeps it waiting until requests end (`WaitingDecisions`).
        # Not asked of a prefill side: its backlog has a rule of its own (`trickles`), and
        # this one there took the routing benchmark's index accuracy (multi_tenant, 2P+2D,
        # KV pressure 4, seeds 1-2) from 91-94% to 68-79%, every prefix behind a backlog
        # predicted batched where the worker took the backlog in a few at a time
        in_flight = self.load.of(worker, dp_rank)
        reserve = self._config.admission_reserve_tokens
        asks_room = entry is not None and entry.role != "prefill"
        for stream in self.indexer.stream_ids(worker, dp_rank):
            keys = keys_of(stream) if keys_of is not None else self.keys.of(stream, ns, tokens)
            if not keys:
                continue
            book = self.recency.get(stream)
            if book is None:
                book = self.recency[stream] = RecencyBook()
            block = self.indexer.index.block_size(stream) or 1
            stride = recency_stride(block)
            kept = stretch_keys(keys, stride)  # a block per stretch: what the forecast reads
            stamp = book.touch(kept)
            waiting = self._waiting(stream)
            # a peer's decision may carry keys and no tokens: its prompt is as long as them
            footprint = max(len(tokens), len(keys) * block) + (
                reserve if output_tokens is None else output_tokens
            )
            waiting.sent(
                stamp,
                kept_blocks=kept_tokens // block,
                held_blocks=held_tokens // block,
                # the requests in flight there before this one (its load begins after)
                running=in_flight.running,
                now=self.clock(),
                seq=self._last_seq(stream),
                room=not asks_room
                or not in_flight.running
                or in_flight.footprint_tokens(reserve) + footprint <= capacity,
                footprint_tokens=footprint,
                stores_blocks=max(0, len(keys) - held_tokens // block),
                probe=keys[-1],
            )
            marks.append((stream, stamp))
            # the blocks the stream can hold, and this prompt's (on their way, not held yet)
            pool = capacity // (block * stride)
            keep = max(pool, len(kept))
            if len(book) <= 2 * keep:
                continue
            # and the backlog's: every decision since the oldest still waiting is used before
            # one routed now is admitted, held or not, and a block that many keys down the
            # stack is lost; its prompts keep their recency for the requests that will reuse
            # them once stored (up to `_BACKLOG_POOLS` pools, which bounds the book). Read
            # only when the book might be pruned: it can only keep more
            oldest = waiting.oldest()
            if oldest is not None:
                keep = max(keep, min(book.not_older(oldest), _BACKLOG_POOLS * pool))
            if len(book) > 2 * keep:
                book.prune(partial(self.indexer.holds, stream), keep)
        return marks

    def _room_freed(self, ticket: Ticket) -> None:
        """A request ended on its rank (its pages free): the requests waiting there for KV
        room may go in (`WaitingDecisions.room_came`), each once the requests in flight but
        those waiting behind it fit the pool."""
        blocked = [
            (stream, waiting)
            for stream in self.indexer.stream_ids(ticket.worker, ticket.dp_rank)
            if (waiting := self.waiting.get(stream)) is not None and waiting.awaiting_room
        ]
        if not blocked:
            return  # the usual end: nothing waits for room there
        entry = self.pool.find(ticket.worker)
        if entry is None or entry.capacity_tokens is None:
            over = 0  # gone, or no longer known: nothing says they still wait
        else:
            load = self.load.of(ticket.worker, ticket.dp_rank)
            footprint = load.footprint_tokens(self._config.admission_reserve_tokens)
            over = footprint - entry.capacity_tokens
        now = self.clock()
        for stream, waiting in blocked:
            waiting.room_came(over, now, self._last_seq(stream))

    def _last_seq(self, stream: str) -> int | None:
        """The stream's last event batch applied (None: none, or no such stream yet)."""
        index = self.indexer.index
        return index.last_seq(stream) if index.has_stream(stream) else None

    def _waiting(self, stream: str) -> WaitingDecisions:
        waiting = self.waiting.get(stream)
        if waiting is None:
            window = self._config.admission_batch_window_ms / 1000.0
            waiting = self.waiting[stream] = WaitingDecisions(window)
        return waiting

    def _answered(self, ticket: Ticket, *, first_byte: bool) -> None:
        """The request's prompt is no longer on its way: its stores have been made (or, when
        it ended unanswered, never will be)."""
        self.release_marks(ticket.marks, first_byte=first_byte)
        ticket.marks = []

    def first_byte(self, ticket: Ticket, *, first_token: bool = False) -> None:
        """The worker answered: the request's prompt no longer counts as queued prefill
        (once: a pair's prefill side may be told by its own answer and by its decode's).

        `first_token`: this is a streamed answer's first chunk, its first token, so the time
        since it was sent is its time to first token: one sample of the balance fit
        (`router.routing.balance`). A whole answer's first byte comes only once it has decoded
        too, and a prefill side's once its decode has the KV: no sample. Before, every first
        byte was one, and whole answers fitted their decode as prefill (0.124 ms per prompt
        token against the streamed 0.052, decode_weight 118 against 53)."""
        if ticket.prefilled or ticket.done:
            return
        if first_token and ticket.sent_at is not None:
            ttft_ms = (self.clock() - ticket.sent_at) * 1000.0
            self.balance.observe(ttft_ms, ticket.ahead_tokens, ticket.ahead_running)
        self.load.first_byte(ticket)
        self._answered(ticket, first_byte=True)
        if self.decisions is not None:
            self.decisions.first_byte(ticket)
        if self.on_progress is not None:
            self.on_progress(ticket)

    def finish(self, ticket: Ticket) -> None:
        """The request ended (answered, failed or cancelled): it no longer counts as running
        (once: a pair's prefill side ends with its own answer, and again with the pair)."""
        if ticket.done:
            return
        self.load.end(ticket)
        self._answered(ticket, first_byte=False)
        self.withdraw(ticket)
        if self.decisions is not None:
            self.decisions.finished(ticket)
        if self.on_progress is not None:
            self.on_progress(ticket)

    def withdraw(self, ticket: Ticket) -> None:
        """Take back what routing marked for a request that failed (`ticket.withdraw`), on
        this replica (a peer's, `router.cluster.peers`, the same way): its pending marks, and
        when the worker stored nothing its shadows. Without that, a request the worker
        refused steered its siblings to a worker that held nothing for them."""
        if ticket.withdraw is Withdraw.NOTHING:
            return
        if ticket.pending:
            self.indexer.withdraw_pending(ticket.pending)
            ticket.pending = []
        if ticket.withdraw is Withdraw.ALL and ticket.shadows:
            self.indexer.unshadow(ticket.shadows)
            ticket.shadows = []

    def has_room(self, candidate: Candidate, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether the candidate's rank can admit a request of `prompt_tokens` that may generate
        `output_tokens` beside the requests in flight there (`policy.hold_until_room`): what
        they and it allocate beyond the cache they reuse (uncached prompt, output; the
        default reserve for a request that named no output; the in-flight ones' outputs at
        `policy.hold_output_ratio` of it, as an engine that reserves a share) fits the rank's
        KV pool. A rank with nothing in flight, or whose capacity is unknown, always has room
        (else a request larger than the pool, or a fleet without `max_total_num_tokens`,
        would wait forever). A match held on a host tier is loaded back into GPU pages before
        the request runs: it allocates as an uncached prompt does (`_gpu_reused_tokens`).
        """
        entry = self.pool.find(candidate.worker)
        capacity = entry.capacity_tokens if entry is not None else None
        load = self.load.of(candidate.worker, candidate.dp_rank)
        if capacity is None or load.running == 0:
            return True
        config = self._config
        allocated = load.allocated_tokens(config.admission_reserve_tokens, config.hold_output_ratio)
        need = max(0, prompt_tokens - _gpu_reused_tokens(candidate)) + output_tokens
        return allocated + need <= capacity

    def record_failure(self, worker: str, *, hard: bool) -> None:
        """A request to `worker` failed; a `hard` failure (the process looks gone) opens its
        circuit at once. A worker removed meanwhile is ignored."""
        entry = self.pool.find(worker)
        if entry is not None:
            entry.breaker.failure(self.clock(), hard=hard)

    def record_success(self, worker: str) -> None:
        """A request to `worker` succeeded: its circuit closes."""
        entry = self.pool.find(worker)
        if entry is not None:
            entry.breaker.success()
