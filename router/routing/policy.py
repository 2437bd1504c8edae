"""Routing policies: pure functions of what the router knows, deciding but never sending.

A policy ranks every worker for one request: the planner hands it one `Candidate` per worker,
or per (worker, dp rank) for a worker with several data-parallel ranks (the index's match for
it, turned into the prefix hit it can give; the router's own in-flight load; health), and the
policy fills in each candidate's load and score and returns them best first. It is told
afterwards which candidate actually got the request (`record`, by its `target`).
`rank` changes no state of the policy, which is what makes the `/admin/route` dry run
honest. Ties are broken by draws fixed by (seed, decisions so far), so a run is
reproducible and a dry run sees the tie-break the next real request would.

Scores are "higher is better". For `kv`:

    score = hit_weight * max(0, hit_tokens - queue_wait) - load
            - eviction_weight * evicted_hot_tokens - room_weight * evicted_tokens
    load  = queued_prefill_tokens + decode_weight * running + queue_wait

which orders workers exactly like the prefill work they would do for this request
(prompt - hit) plus the work already queued on them, with the prompt length cancelling out.
`queue_wait` (`Policy.queue_wait`) is what the request would wait in the worker's queue for a
place in its batch, in prefill tokens: 0 while fewer requests than its `max_running_requests`
(`Candidate.running_cap`) are in flight there; beyond, the queue drains a batch's worth of
requests per request's run (its output tokens x `decode_step_weight`). A hit found only after
that wait saves that much less, so a holder whose queue outlasts most of the prefill its hit
saves loses to a worker with a free place: a burst of one long prompt spreads over the fleet
instead of queueing on the worker that first cached it. Before, a request waiting in the
queue counted as one more running request (`decode_weight`), a fraction of its wait.
`evicted_hot_tokens` (`Candidate.eviction`, `router.routing.eviction_cost`) is what placing
the request there would push out of the fleet's cache (0 unless `eviction_weight` is set);
`evicted_tokens` (`Candidate.evicts_tokens`) is everything the request's own allocation would
evict there, used or not: where some pools have room, a prefix a page long no longer outweighs
filling them (charged only when every candidate's capacity is known). `decode_weight` is the
config's, or the planner's learned one (`router.routing.balance`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import msgspec

from indexer.index import DEFAULT_MEDIUM
from router.config import PolicyConfig
from router.routing.admission import AdmissionForecast
from router.routing.approx_tree import ApproxTree
from router.routing.eviction_cost import EvictionCost

__all__ = [
    "ApproxTreePolicy",
    "Candidate",
    "KvPolicy",
    "LeastLoadPolicy",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "build_policy",
    "effective_hit",
    "rank_target",
]


_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value from a counter."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Candidate(msgspec.Struct, gc=False):
    """One worker (or one dp rank of it) in one routing decision: what placed it, and where it
    came out.

    The planner fills everything but `load` and `score`, which the policy's `rank` sets.
    """

    worker: str
    url: str
    # health check ok, circuit closed, not draining (the worker's, every rank's), and its pool
    # can hold the request where another's can (`unfit`)
    healthy: bool
    status: str  # why it does or does not take traffic (`WorkerStatus`)
    # the data-parallel rank the engine is told to use; None: the worker has one rank, or its
    # ranks are unknown (no KV events), and the engine picks
    dp_rank: int | None = None
    matched_tokens: int = 0  # leading prompt tokens the worker holds, per its KV events
    matched_blocks: int = 0
    pending_tokens: int = 0  # further tokens covered by recent routing decisions only
    # its rank's KV-event stream state (a worker's best one's), None without events
    stream_state: str | None = None
    # its KV events are left unfollowed by the false-hit watch (`WorkerEntry.unfollowed_until`):
    # no hit is predicted there, and its answer is no measure of the index
    # (`router.http.decisions` counts it apart from the accuracy)
    unfollowed: bool = False
    # why no hit is predicted there whatever the index holds (None: predicted as it holds),
    # e.g. its SGLang is not known to read the request's `model` as the router does
    # (`Planner.plan`); nothing is marked pending there either
    unpredicted: str | None = None
    # the matched blocks per storage tier each is held in at best (e.g. {"GPU": 6, "CPU": 2})
    by_medium: dict[str, int] = {}
    hit_tokens: float = 0.0  # the prefix it can give, as the policy weighs it (`effective_hit`)
    queued_prefill_tokens: int = 0
    running: int = 0
    kv_tokens: int = 0  # KV its running requests hold (counted on decode workers of PD pairs)
    # how many requests it runs at once (its rank's `max_running_requests`; a worker offered
    # whole, its ranks' together): a request beyond waits in the worker's queue
    # (`Policy.queue_wait`). None: unknown, or a prefill/decode side (no wait counted)
    running_cap: int | None = None
    # the output tokens a request in flight there may generate, on average (their limits,
    # `admission_reserve_tokens` for each that named none): how long one holds its place
    running_output_tokens: float = 0.0
    load: float = 0.0  # set by `rank`: in-flight work in prefill-token equivalents
    score: float = 0.0  # set by `rank`: higher is better
    # set by `rank`: what the request would wait there for a place in the batch, in prefill
    # tokens (`Policy.queue_wait`; in `load`, and taken off the hit by `kv`)
    queue_wait: float = 0.0
    # that wait in words, told by the `/admin/route` dry run only (`Policy.explain_queue`;
    # None on the request path, or where it waits for nothing)
    queue: str | None = None
    # what of matched + pending the worker is predicted to still hold when it admits the
    # request, and why (`router.routing.admission`); None: not forecast (admission off)
    admission: AdmissionForecast | None = None
    # the hot blocks its own allocation would evict there (`router.routing.eviction_cost`),
    # charged by `[policy] eviction_weight`; None: not computed (weight 0 or admission off)
    eviction: EvictionCost | None = None
    # what its own allocation (the uncached prompt and output) would evict there, held blocks
    # used or not, after what the requests ahead of it evict (`admission`; 0: it fits),
    # charged by `[policy] room_weight`; None: not forecast (capacity unknown, admission off,
    # several ranks the engine picks among)
    evicts_tokens: int | None = None
    # whether its rank can admit the request beside those in flight there (`Planner.has_room`,
    # asked with `[policy] hold_until_room`: the request waits while the first choice cannot);
    # None: not asked
    room: bool | None = None
    # why its KV pool cannot hold this request at all, its prompt and output limit over the
    # rank's `max_total_num_tokens` (None: it can, or its capacity is unknown): not routable
    # for it (`healthy` false) while another candidate can hold it, else left to the worker
    # to refuse, as before (`Planner.plan`)
    unfit: str | None = None
    # why the index's entries for this prompt there are not counted though it holds some,
    # told by the `/admin/route` dry run only (`Planner.explain_hidden`; None on the request
    # path): "extra_key shadow" (`indexer.shadowed`), so a shadow does not read as a cold cache
    hidden: str | None = None

    @property
    def predicted_tokens(self) -> int:
        """The prefix the worker is expected to reuse at admission (matched + pending, less
        what it will have evicted by then)."""
        raw = self.matched_tokens + self.pending_tokens
        return raw if self.admission is None else min(raw, self.admission.kept_tokens)

    def uncached_tokens(self, prompt_tokens: int) -> int:
        """The tokens of a `prompt_tokens` prompt the worker is expected to compute (not reuse)."""
        return max(0, prompt_tokens - self.predicted_tokens)

    @property
    def predicted_split(self) -> tuple[int, int]:
        """`predicted_tokens` as (from events, from pending marks): eviction takes the deepest
        blocks first, and pending blocks lie below the matched ones."""
        kept = self.predicted_tokens
        matched = min(self.matched_tokens, kept)
        return matched, kept - matched

    @property
    def target(self) -> str:
        """What a request goes to: the worker, or one of its ranks as its stream is named."""
        return self.worker if self.dp_rank is None else rank_target(self.worker, self.dp_rank)


def rank_target(worker: str, dp_rank: int) -> str:
    """The name of one dp rank of a worker, as its KV-event stream is named (`w#dp1`)."""
    return f"{worker}#dp{dp_rank}"


def _target_worker(target: str) -> str:
    """The worker of a target (`rank_target`'s inverse; a worker is its own target)."""
    worker, sep, rank = target.rpartition("#dp")
    return worker if sep and rank.isdigit() else target


def effective_hit(
    *,
    matched_blocks: int,
    pending_tokens: int,
    block_size: int | None,
    by_medium: Mapping[str, int],
    stale: bool,
    weights: Mapping[str, float],
) -> float:
    """Prefix tokens a worker is expected to reuse: tier-weighted blocks plus pending tokens.

    A STALE stream says nothing reliable about the worker's cache, so it earns no affinity.
    """
    if stale or not block_size:
        return float(pending_tokens) if not stale else 0.0
    tiered = sum(by_medium.values())
    # a tier the weights do not name earns nothing (fail closed: its reload cost is unknown),
    # except the GPU itself, which needs no weight to be worth a full block
    hit = sum(
        blocks * weights.get(medium, 1.0 if medium == DEFAULT_MEDIUM else 0.0)
        for medium, blocks in by_medium.items()
    )
    # blocks reported without a tier count at full weight
    hit += max(0, matched_blocks - tiered)
    return hit * block_size + pending_tokens


class Policy:
    """Base policy: rank by score, healthy first, ties to the less loaded, then random."""

    name = "base"
    # whether a decision leaves pending index entries behind it, so a burst of siblings follows
    # the first request before its KV events arrive: only a policy that reads the index gains
    marks_pending = False

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._decisions = 0
        # prefill tokens one running request is worth: the config's, or the planner's learned
        # value (`router.routing.balance`)
        self.decode_weight = config.decode_weight

    def reconfigure(self, config: PolicyConfig) -> None:
        """Score by `config`'s weights from the next decision on (a reload); the policy's
        memory (turns, tree, decisions so far) is kept. Its name and the approx tree's sizes
        are fixed at start (`router.config_diff`)."""
        self._config = config
        # the learned value (`policy.balance_learning`) replaces it again at the next plan
        self.decode_weight = config.decode_weight

    def load(self, view: Candidate) -> float:
        """The in-flight work on a worker, in prefill-token equivalents: its queued prefill,
        its requests in flight, and the wait for a place in its batch."""
        return (
            view.queued_prefill_tokens + self.decode_weight * view.running + self.queue_wait(view)
        )

    def queue_wait(self, view: Candidate) -> float:
        """What a request sent to the candidate would wait in its queue before it runs, in
        prefill tokens: 0 while fewer than its `running_cap` requests are in flight there (or
        the cap is unknown). Beyond, it is the (running - cap + 1)th to wait for a place, and
        the batch frees `cap` places per request's run (`running_output_tokens` x
        `decode_step_weight`), so the queue drains for (running - cap + 1) / cap of a run
        before it starts. Each request in flight still counts `decode_weight` too: once it
        runs, the batch it joins is as full."""
        cap = view.running_cap
        if cap is None or view.running < cap:
            return 0.0
        run = view.running_output_tokens * self._config.decode_step_weight
        return (view.running - cap + 1) / cap * run

    def explain_queue(self, view: Candidate) -> str | None:
        """The candidate's queue wait in words (`Candidate.queue`), None: it waits for
        nothing."""
        wait = self.queue_wait(view)
        cap = view.running_cap
        if not wait or cap is None:
            return None
        ahead = view.running - cap + 1
        output = round(view.running_output_tokens, 1)
        step = self._config.decode_step_weight
        return (
            f"{view.running} requests in flight, {cap} run at once: it waits for {ahead} to "
            f"finish, {ahead}/{cap} of a request's run ({output:g} output tokens x "
            f"decode_step_weight {step:g} = {output * step:.0f} prefill tokens): {wait:.0f} "
            "prefill tokens, counted in its load"
        )

    def _scores(self, tokens: Sequence[int], views: Sequence[Candidate]) -> list[float]:
        """Each candidate's score; `rank` has filled in their `load` and `queue_wait`."""
        raise NotImplementedError

    def _draws(self, n: int, salt: int = 0) -> list[int]:
        """`n` pseudo-random draws fixed by (seed, decisions so far, salt): reproducible, and
        the same in a dry run as in the real decision that follows it."""
        base = (
            self._config.seed * 0x9E3779B97F4A7C15 + self._decisions * 0xBF58476D1CE4E5B9 + salt
        ) & _MASK
        return [_mix(base + i) for i in range(n)]

    def rank(self, tokens: Sequence[int], views: Sequence[Candidate]) -> list[Candidate]:
        """Every candidate, best first (unhealthy ones last), its load and score filled in."""
        for view in views:  # once each: the scores read them
            view.queue_wait = self.queue_wait(view)
            view.load = self.load(view)
        scores = self._scores(tokens, views)
        draws = self._draws(len(views))
        keyed = []
        for view, score, draw in zip(views, scores, draws, strict=True):
            view.score = score
            keyed.append(((not view.healthy, -score, view.load, draw), view))
        keyed.sort(key=lambda pair: pair[0])
        return [view for _, view in keyed]

    def record(self, tokens: Sequence[int], target: str) -> None:
        """Learn that the request with `tokens` was sent to `target` (`Candidate.target`)."""
        self._decisions += 1

    def forget(self, worker: str) -> None:
        """Drop what the policy remembers about a worker that left the pool (every rank)."""


class KvPolicy(Policy):
    """Namespaced prefix hit from KV events against the router's own in-flight load."""

    name = "kv"
    marks_pending = True

    def _scores(self, tokens: Sequence[int], views: Sequence[Candidate]) -> list[float]:
        weight = self._config.hit_weight
        evict = self._config.eviction_weight
        room = self._config.room_weight
        # charged only where every candidate's is known: one not forecast would evict
        # "nothing" and win every tie, its own pool full or not
        if room and any(v.evicts_tokens is None for v in views):
            room = 0.0
        # a hit found only after the wait for a place in the batch saves that much less
        return [
            weight * max(0.0, v.hit_tokens - v.queue_wait)
            - v.load
            - (evict * v.eviction.sole_hot_tokens if v.eviction is not None else 0.0)
            - (room * v.evicts_tokens if room and v.evicts_tokens else 0.0)
            for v in views
        ]

    def explain_queue(self, view: Candidate) -> str | None:
        """As every policy's, and the hit it finds there saves that much less."""
        said = super().explain_queue(view)
        return None if said is None else said + ", and taken off the hit it would find there"


class LeastLoadPolicy(Policy):
    """The least in-flight work wins; no cache affinity."""

    name = "least_load"

    def _scores(self, tokens: Sequence[int], views: Sequence[Candidate]) -> list[float]:
        return [-v.load for v in views]


class RandomPolicy(Policy):
    """A seeded uniform choice among healthy workers."""

    name = "random"

    def _scores(self, tokens: Sequence[int], views: Sequence[Candidate]) -> list[float]:
        return [float(draw) for draw in self._draws(len(views), salt=1 << 32)]


class RoundRobinPolicy(Policy):
    """Healthy targets in turn, in pool order: the one chosen longest ago goes next.

    Turns are kept per target (a worker, or one DP rank of it), not as one counter over the
    fleet: the planner offers only the workers of the request's model, and with one counter,
    requests of two models taking turns would land every request of one model on the same
    worker of its pool; kept per worker, a worker's second rank would never get a turn.
    """

    name = "round_robin"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._last: dict[str, int] = {}  # target -> the decision that last chose it

    def _scores(self, tokens: Sequence[int], views: Sequence[Candidate]) -> list[float]:
        n = len(views)
        # never chosen counts as chosen before everything, in pool order
        return [-float(self._last.get(v.target, -1) * (n + 1) + i) for i, v in enumerate(views)]

    def record(self, tokens: Sequence[int], target: str) -> None:
        """The chosen target's turn is over."""
        self._last[target] = self._decisions
        super().record(tokens, target)

    def forget(self, worker: str) -> None:
        """A worker that left takes no more turns (none of its ranks)."""
        for target in [t for t in self._last if t == worker or _target_worker(t) == worker]:
            del self._last[target]


class ApproxTreePolicy(Policy):
    """sglang-router's `cache_aware` policy (0.3.2), as a baseline: no events, only its tree.

    - load is the requests in flight on a worker (SGLang's `load()`), not prefill tokens;
    - the fleet is out of balance when max - min load > `approx_balance_abs` and max >
      `approx_balance_rel` x min (healthy workers): then the least loaded worker wins;
    - otherwise the tree's longest match anywhere (`ApproxTree.prefix_match`) decides when it
      covers more than `approx_cache_threshold` of the prompt: the one worker it names;
    - otherwise the worker with the smallest tree takes the new prefix;
    - the chosen worker's part of the tree grows by the whole prompt, balanced or not, and every
      `approx_eviction_interval_s` each worker's part is cut to `approx_max_tree_size` tokens.

    Its tree is kept per target, each dp rank apart, as SGLang's router does in its dp-aware
    mode: a rank is a cache of its own. The salt plays no part, as in SGLang's tree.
    """

    name = "approx_tree"

    def __init__(self, config: PolicyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config)
        self._tree = ApproxTree()
        self._clock = clock
        self._evicted_at = clock()

    def matched(self, tokens: Sequence[int]) -> dict[str, int]:
        """Tokens of the prompt previously routed to each worker."""
        return self._tree.matches(tokens)

    def load(self, view: Candidate) -> float:
        """Requests in flight on the worker: SGLang's thresholds count requests."""
        return float(view.running)

    def queue_wait(self, view: Candidate) -> float:
        """None: SGLang's policy knows no running limit (its requests in flight are all)."""
        return 0.0

    def _imbalanced(self, loads: list[float]) -> bool:
        if not loads:
            return False
        low, high = min(loads), max(loads)
        cfg = self._config
        return high - low > cfg.approx_balance_abs and high > low * cfg.approx_balance_rel

    def _scores(self, tokens: Sequence[int], views: Sequence[Candidate]) -> list[float]:
        loads = [v.load for v in views]
        if self._imbalanced([load for load, v in zip(loads, views, strict=True) if v.healthy]):
            return [-load for load in loads]
        matched, holder = self._tree.prefix_match(tokens)
        if tokens and matched / len(tokens) > self._config.approx_cache_threshold:
            return [1.0 if v.target == holder else 0.0 for v in views]
        # a new prefix goes to the worker with the smallest tree
        return [-float(self._tree.size(v.target)) for v in views]

    def rank(self, tokens: Sequence[int], views: Sequence[Candidate]) -> list[Candidate]:
        """As the base rank, reporting the tree's match as the hit (it knows no events)."""
        matched = self._tree.matches(tokens)
        for v in views:
            v.hit_tokens = float(matched.get(v.target, 0))
        return super().rank(tokens, views)

    def record(self, tokens: Sequence[int], target: str) -> None:
        """Insert the prompt into the chosen target's part of the tree; evict on schedule."""
        super().record(tokens, target)
        _, holder = self._tree.prefix_match(tokens)
        if holder is not None:
            self._tree.touch(tokens, holder)
        self._tree.insert(tokens, target)
        interval = self._config.approx_eviction_interval_s
        now = self._clock()
        if interval > 0 and now - self._evicted_at >= interval:
            self._evicted_at = now
            self._tree.evict_by_size(self._config.approx_max_tree_size)

    def forget(self, worker: str) -> None:
        """Drop the worker's parts of the tree (itself and each of its ranks)."""
        for target in self._tree.workers():
            if target == worker or _target_worker(target) == worker:
                self._tree.remove_worker(target)


_POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (KvPolicy, RoundRobinPolicy, RandomPolicy, LeastLoadPolicy, ApproxTreePolicy)
}


def build_policy(config: PolicyConfig) -> Policy:
    """The policy named by `config.name`."""
    return _POLICIES[config.name](config)
