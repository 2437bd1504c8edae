"""The router's own view of in-flight work per (worker, dp rank) (it never asks the workers).

A request counts as queued prefill (its uncached prompt tokens) from dispatch until the first
response byte arrives, and as one running request until its response ends. A prefill side of
a prefill/decode pair answers only once its decode has fetched the KV: there the request stops
counting as queued prefill as soon as the KV events show its prompt stored (`computed`, told
by `router.routing.prefill_watch`), since what is left is the handoff, which computes
nothing. Tokens from the index are predictions, so this is an estimate; it is consistent,
which is what routing needs.

A decode worker of a prefill/decode pair also counts the KV its running requests hold
(`kv_tokens`: their prompts, moved in from the prefill side), which fills its memory as long
as they decode.

`uncached_tokens` counts the uncached prompt tokens of the requests in flight from dispatch to
their end (`queued_prefill_tokens` drops them at the first byte, but their pages stay): with
their output, `allocated_tokens` is the KV they allocate beyond the cache they reuse, what
`policy.hold_until_room` holds a request against (`Planner.has_room`).

`prompt_tokens` counts their whole prompts, cached or not: a running request keeps the pages of
its cached prefix too (a worker locks them), so with whole outputs, `footprint_tokens` is a
bound the KV the requests in flight hold cannot exceed (a prefix two of them share is counted
twice): the admission forecast takes a request as waiting for KV room beside them when that
bound and its own footprint do not fit the pool (`Planner.book_decision`).

`held_tokens` counts the uncached prompts of the requests `policy.hold_until_room` holds in the
router for the rank (they have not been sent): the `kv` score counts them as queued there, as it
would if they waited in the worker's queue. Without that, every request arriving behind a held
one would see the rank as idle, pick it too, and be held as well.

A worker with several data-parallel ranks runs one scheduler per rank, so its load is kept per
rank: the rank the router told the engine to use. A request sent without a rank (a worker with
one rank, or whose ranks are not known) counts under the rank `None`. Pure bookkeeping: no I/O.

What is read for the metrics lists the fleet's workers too (`fleet`: their `load_keys`), at 0
until a request is counted there: a worker's series exist from its registration, and again
from the moment it is added back under its id (`forget` dropped its counters). Before, counters
were made by the first request routed there, and dashboards saw a gap where the load was 0.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence

from indexer.shadowed import ShadowMark

__all__ = ["LoadTracker", "Target", "Ticket", "Withdraw", "WorkerLoad", "load_keys"]

# (worker, dp rank) a request's load is counted under (rank None: sent without a rank)
Target = tuple[str, int | None]


def load_keys(worker: str, stream_ranks: Sequence[int]) -> list[Target]:
    """Where requests routed to `worker` count, given the dp ranks of its KV-event streams:
    each rank of a worker with several streams (the planner offers each rank and names it),
    else the worker as a whole (rank None: the engine picks, or it has one scheduler)."""
    if len(stream_ranks) > 1:
        return [(worker, rank) for rank in sorted(set(stream_ranks))]
    return [(worker, None)]


class Withdraw(enum.IntEnum):
    """What a request's end takes back of what routing it marked (`Ticket.withdraw`)."""

    NOTHING = 0  # it was answered (2xx): its prompt is stored, or its events will say why not
    PENDING = 1  # it failed (5xx, dropped, timed out): its pending marks; a store it may have
    # made before failing is shown by its events
    ALL = 2  # the worker refused it (4xx) or never got it: its pending marks and its shadows


class WorkerLoad:
    """In-flight counters of one worker (or one dp rank of it)."""

    __slots__ = (
        "blind",
        "held_tokens",
        "kv_tokens",
        "output_tokens",
        "prompt_tokens",
        "queued_prefill_tokens",
        "running",
        "sized",
        "uncached_tokens",
    )

    def __init__(self) -> None:
        self.queued_prefill_tokens = 0
        self.running = 0
        self.kv_tokens = 0
        # the uncached prompts of the requests in flight, until they end, and their whole
        # prompts (a sender that did not say counts its uncached prompt: `LoadTracker.begin`)
        self.uncached_tokens = 0
        self.prompt_tokens = 0
        # the output limits of the requests in flight that named one (`sized` of them)
        self.output_tokens = 0
        self.sized = 0
        # the uncached prompts of the requests held in the router for this rank (not sent)
        self.held_tokens = 0
        # how many of the requests counted as queued prefill may have been prefilled long
        # ago: whole answers, whose first byte comes only once they have decoded too
        # (`LoadTracker.begin`, `blind`); a time to first token measured behind one is no
        # sample of the balance fit (`Planner.commit`)
        self.blind = 0

    def allocated_tokens(self, default: int, output_ratio: float = 1.0) -> int:
        """The KV the requests in flight allocate beyond the cache they reuse: their uncached
        prompts and outputs (`default` for each that named none), the outputs counted at
        `output_ratio` of their limits (an engine that reserves only a share of them)."""
        unsized = max(0, self.running - self.sized)
        outputs = self.output_tokens + unsized * default
        return self.uncached_tokens + round(outputs * output_ratio)

    def footprint_tokens(self, default: int) -> int:
        """The most KV the requests in flight can hold: their whole prompts (a cached prefix's
        pages are kept while a request runs) and whole outputs (`default` for each that named
        none)."""
        unsized = max(0, self.running - self.sized)
        return self.prompt_tokens + self.output_tokens + unsized * default

    def output_per_request(self, default: int) -> float:
        """The output tokens an in-flight request may generate, on average (`default` for
        each that named none; `default` when none is in flight)."""
        if not self.running:
            return float(default)
        unsized = max(0, self.running - self.sized)
        return (self.output_tokens + unsized * default) / self.running


class Ticket:
    """One dispatched request; hand it back to the tracker as it progresses."""

    __slots__ = (
        "ahead_running",
        "ahead_tokens",
        "blind",
        "done",
        "dp_rank",
        "kv_tokens",
        "load",
        "marks",
        "output_tokens",
        "pending",
        "prefill_tokens",
        "prefilled",
        "prompt_tokens",
        "queued",
        "sent_at",
        "shadows",
        "withdraw",
        "worker",
    )

    def __init__(
        self,
        worker: str,
        prefill_tokens: int,
        dp_rank: int | None = None,
        kv_tokens: int = 0,
        output_tokens: int | None = None,
        load: WorkerLoad | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        # the counters it was counted in: a worker removed and added again under the same id
        # has new ones, which its requests from before must not decrement
        self.load = load
        self.worker = worker
        self.dp_rank = dp_rank
        self.prefill_tokens = prefill_tokens
        # its whole prompt (None: not known, its uncached part counts in the load)
        self.prompt_tokens = prompt_tokens
        self.kv_tokens = kv_tokens
        self.output_tokens = output_tokens
        self.prefilled = False
        self.done = False
        # whether its prompt still counts as queued prefill (until its first byte, or until
        # the events show a prefill side has computed it)
        self.queued = True
        # whether it counts in its load's `blind` while queued (a whole answer)
        self.blind = False
        # (stream, recency stamp) of the decision on each stream it was sent to, while its
        # prompt is on its way (`router.routing.admission`); set by the planner
        self.marks: list[tuple[str, int]] = []
        # the index's pending marks and shadows made for it (`indexer.service`), and what of
        # them its end takes back (the proxy says, from the worker's answer)
        self.pending: list[tuple[str, int]] = []
        self.shadows: list[ShadowMark] = []
        self.withdraw = Withdraw.NOTHING
        # when it was sent, and the prefill tokens (its own included) and running requests
        # on its rank then: one sample of the hit/load balance (`router.routing.balance`);
        # None: no sample (sent behind a full batch, `Planner.commit`)
        self.sent_at: float | None = None
        self.ahead_tokens = 0
        self.ahead_running = 0


class LoadTracker:
    """Queued prefill tokens and running requests per (worker, dp rank)."""

    def __init__(self) -> None:
        self._loads: dict[str, dict[int | None, WorkerLoad]] = {}
        # told of each request's end, after its counters dropped (its pages are free: the
        # admission forecast's requests waiting for KV room there may go in)
        self.end_listeners: list[Callable[[Ticket], None]] = []

    def of(self, worker: str, dp_rank: int | None = None) -> WorkerLoad:
        """The counters of one rank of `worker` (None: sent without a rank), zero when idle."""
        ranks = self._loads.get(worker)
        if ranks is None:
            ranks = self._loads[worker] = {}
        load = ranks.get(dp_rank)
        if load is None:
            load = ranks[dp_rank] = WorkerLoad()
        return load

    def total(self, worker: str) -> WorkerLoad:
        """The counters of `worker` summed over its ranks (a fresh object)."""
        out = WorkerLoad()
        for load in self._loads.get(worker, {}).values():
            out.queued_prefill_tokens += load.queued_prefill_tokens
            out.uncached_tokens += load.uncached_tokens
            out.prompt_tokens += load.prompt_tokens
            out.running += load.running
            out.kv_tokens += load.kv_tokens
            out.output_tokens += load.output_tokens
            out.sized += load.sized
            out.held_tokens += load.held_tokens
            out.blind += load.blind
        return out

    def begin(
        self,
        worker: str,
        prefill_tokens: int,
        dp_rank: int | None = None,
        kv_tokens: int = 0,
        output_tokens: int | None = None,
        prompt_tokens: int | None = None,
        *,
        blind: bool = False,
    ) -> Ticket:
        """A request was sent to `worker` (rank `dp_rank`) with this many uncached tokens (and,
        to a decode worker, this much KV it will hold while it runs; `output_tokens`: the
        output it may generate, None: not known; `prompt_tokens`: its whole prompt, None: not
        known, its uncached tokens are counted). `blind`: when its prompt is computed will not
        be known (a whole answer answers after its decode): it counts in `WorkerLoad.blind`
        until it stops counting as queued prefill."""
        load = self.of(worker, dp_rank)
        load.blind += blind
        load.queued_prefill_tokens += prefill_tokens
        load.uncached_tokens += prefill_tokens
        load.running += 1
        load.kv_tokens += kv_tokens
        if output_tokens is not None:
            load.output_tokens += output_tokens
            load.sized += 1
        load.prompt_tokens += prefill_tokens if prompt_tokens is None else prompt_tokens
        ticket = Ticket(
            worker, prefill_tokens, dp_rank, kv_tokens, output_tokens, load, prompt_tokens
        )
        ticket.blind = blind
        return ticket

    def hold(self, worker: str, dp_rank: int | None, prefill_tokens: int) -> None:
        """A request with this many uncached tokens waits in the router for this rank."""
        self.of(worker, dp_rank).held_tokens += prefill_tokens

    def release(self, worker: str, dp_rank: int | None, prefill_tokens: int) -> None:
        """A held request stopped waiting for this rank (sent, moved or given up)."""
        ranks = self._loads.get(worker)
        load = ranks.get(dp_rank) if ranks is not None else None
        if load is not None:  # a worker removed meanwhile has no counters left
            load.held_tokens = max(0, load.held_tokens - prefill_tokens)

    @staticmethod
    def _load(ticket: Ticket) -> WorkerLoad | None:
        # a removed worker's counters are no one's any more (`forget`): changing them is moot
        return ticket.load

    def first_byte(self, ticket: Ticket) -> None:
        """The worker answered: the prompt is prefilled (idempotent)."""
        if ticket.prefilled or ticket.done:
            return
        ticket.prefilled = True
        self.computed(ticket)

    def computed(self, ticket: Ticket) -> None:
        """The request's prompt is computed (the worker's events show it stored), though the
        worker has not answered yet: it no longer counts as queued prefill (idempotent; an
        answered or ended request no longer counts already)."""
        if not ticket.queued:
            return
        ticket.queued = False
        load = self._load(ticket)
        if load is not None:
            load.queued_prefill_tokens -= ticket.prefill_tokens
            load.blind -= ticket.blind

    def end(self, ticket: Ticket) -> None:
        """The request finished, failed or was cancelled (idempotent)."""
        if ticket.done:
            return
        self.first_byte(ticket)
        ticket.done = True
        load = self._load(ticket)
        if load is not None:
            load.running -= 1
            load.uncached_tokens -= ticket.prefill_tokens
            prompt = ticket.prompt_tokens
            load.prompt_tokens -= ticket.prefill_tokens if prompt is None else prompt
            load.kv_tokens -= ticket.kv_tokens
            if ticket.output_tokens is not None:
                load.output_tokens -= ticket.output_tokens
                load.sized -= 1
        for listener in self.end_listeners:
            listener(ticket)

    def running(self, fleet: Iterable[Target] = ()) -> dict[str, int]:
        """Requests in flight per worker, over all its ranks (`kvroute_in_flight_requests`);
        the workers of `fleet` at 0 when none is."""
        out = dict.fromkeys((worker for worker, _ in fleet), 0)
        for worker, ranks in self._loads.items():
            out[worker] = sum(load.running for load in ranks.values())
        return out

    def running_by_rank(self, fleet: Iterable[Target] = ()) -> dict[tuple[str, int], int]:
        """Requests in flight per (worker, dp rank), for requests sent with a rank; the ranks
        of `fleet` at 0 when none is.

        As bounded as the fleet: ranks are those the workers' streams name.
        """
        out = {(worker, rank): 0 for worker, rank in fleet if rank is not None}
        for worker, ranks in self._loads.items():
            for rank, load in ranks.items():
                if rank is not None:
                    out[worker, rank] = load.running
        return out

    def by_target(self, fleet: Iterable[Target] = ()) -> dict[Target, WorkerLoad]:
        """The counters of every (worker, dp rank) seen (rank None: sent without a rank), and
        of each of `fleet` (zero counters, not kept, where none was seen).

        The live objects: read them, do not keep them (`kvroute_load_*` when scraped)."""
        out = {target: WorkerLoad() for target in fleet}
        for worker, ranks in self._loads.items():
            for rank, load in ranks.items():
                out[worker, rank] = load
        return out

    def forget(self, worker: str) -> None:
        """Drop a removed worker's counters (its open tickets then change only theirs, never
        the counters of a worker added again under its id)."""
        self._loads.pop(worker, None)
