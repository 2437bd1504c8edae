"""The other replicas' decisions, applied here as they arrive.

A peer's pending marks go into the indexer (the same cache key on the same (worker, rank)) and
its requests into the load tracker, as tickets this module holds per peer, so the planner's
view of load and pending prefixes is the fleet's. With a planner (`AdmissionBook`), a peer's
decision also goes into the admission forecast's book (the recency of its prompt's blocks and
a decision waiting for its answer), as the peer's own planner took it in. A peer whose
heartbeats stop for `timeout_s` is gone: its tickets end, its load stops counting. Every
heartbeat lists the peer's requests in flight, and the tickets held for it are made to match
(a `Begin` or `End` lost in a NATS outage heals within one heartbeat). A peer's shadows are
kept to send again (`shadow_seen`, `Outbox.remember`); an `End` that withdraws its request's
shadows takes back their keepings too, by the peer and its number for the request.

A decision names a worker by id and by the server the id named where it was made
(`Pending.server`). Ids move between servers (a reload that swaps two, a rename), and the
replicas take each change in one after another, each when it reads the fleet record: for a
moment two of them know one id as two servers. A pending mark made under the other mapping
goes on the server it meant, under that server's id here (none: not marked; a host spelled
otherwise here counts only where it surely is one, as `localhost` and `[::1]` are: a pending
mark on another server would be a false hit). A shadow goes on that server's id here, and on
the id where it may name that server here (its host spelled in a way that may be the same:
`indexer.hosts`): a shadow only hides, and one not applied trusts what it covers; at a server
no worker is followed at here yet (one being registered, or none there yet), it waits for the
worker added there (`IndexerService.shadow_at`). Marked under the id, a pending mark would
stand on a server that holds none of it, predicted hits a request would be sent for, until its
TTL. `misaddressed` counts the decisions whose id names a server spelled otherwise here.

Everything here runs on the one event loop without awaiting, like every index mutation.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import urlsplit

from indexer.hosts import may_be_one_host, one_host
from indexer.namespace import Namespace
from indexer.service import IndexerService
from router.cluster.sender_clock import SenderClock
from router.cluster.wire import (
    Batch,
    Begin,
    End,
    FirstByte,
    Goodbye,
    Heartbeat,
    Pending,
    Shadow,
)
from router.routing.load import LoadTracker, Ticket, Withdraw

__all__ = ["AdmissionBook", "Peers", "Servers"]

log = logging.getLogger(__name__)

# (stream, page size, page size) pairs warned of, at most: a warning per pair, not per decision
_WARNED_LIMIT = 256

_DELAY_SAMPLES = 4096
# marks of pending decisions whose `Begin` has not come (it follows in the same batch, so
# more than this many means Begins were lost: the oldest are dropped)
_MAX_UNBEGUN = 1024
# requests of one peer whose kept shadows its End may take back (each record goes with its
# End or the heartbeat that no longer lists it: more than this means both were lost)
_MAX_KEEPING = 8192


class AdmissionBook(Protocol):
    """Where a peer's decisions join the admission forecast (`router.routing.planner`)."""

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
    ) -> list[tuple[str, int]]: ...

    def release_marks(self, marks: list[tuple[str, int]], *, first_byte: bool) -> None: ...

    def keys_of(self, ns: Namespace, tokens: Sequence[int]) -> Callable[[str], list[int]]: ...


class Servers(Protocol):
    """Which server each worker id names on this replica (`router.routing.pool.WorkerPool`)."""

    def server_of(self, worker_id: str) -> str | None: ...

    def worker_at(self, server: str) -> str | None: ...


class _Peer:
    __slots__ = ("clock", "instance", "kept", "last_seen", "marks", "pending", "tickets")

    def __init__(self, now: float, instance: str = "") -> None:
        self.last_seen = now
        self.clock = SenderClock()  # how far its wall clock runs ahead of ours
        self.instance = instance  # its process's token (`Batch.instance`)
        self.tickets: dict[int, Ticket] = {}
        # the forecast's marks of a request whose Pending came, by its number, until its Begin
        self.marks: dict[int, list[tuple[str, int]]] = {}
        # the index's pending marks of a request whose Pending came, until its Begin: its End
        # may withdraw them (`End.withdraw`)
        self.pending: dict[int, list[tuple[str, int]]] = {}
        # what takes back each keeping of a shadow it sent (`Outbox.remember`), by its number
        # for the request: its End may withdraw them, and a withdrawn shadow must not come back
        self.kept: dict[int, list[Callable[[], None]]] = {}


class Peers:
    """Live peers, their tickets in the load tracker, and what their decisions cost to get."""

    def __init__(
        self,
        me: str,
        indexer: IndexerService,
        load: LoadTracker,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        book: AdmissionBook | None = None,
        servers: Servers | None = None,
    ) -> None:
        self.me = me
        self._servers = servers  # None: ids are taken as they come
        self._indexer = indexer
        # the peers' decisions are judged by what was removed since each was made, from the
        # first one on (`IndexerService.expect_peer_marks`)
        indexer.expect_peer_marks()
        self._load = load
        self._book = book
        self._timeout_s = timeout_s
        self._clock = clock
        self._peers: dict[str, _Peer] = {}
        # routing decisions applied: one per worker a peer sent a request to (its `Begin`: a
        # retry's attempts and a pair's sides apart), as the peer counts it published; not
        # the pending marks, ends and heartbeats beside them
        self.applied = 0
        # (decision, stream) pairs whose block keys were for pages other than this replica's
        # stream's (not marked there), and the (stream, theirs, ours) sizes already warned of
        self.unmatched_pages = 0
        self._warned: set[tuple[str, int, int]] = set()
        # decisions whose id names another server here than where they were made (moved to the
        # server meant, or not applied)
        self.misaddressed = 0
        self._twin_said = False  # another replica with our id was reported
        # told the name of each replica heard from for the first time (or again after it was
        # dropped as silent): what it missed that lasts, it is sent again (`Outbox.shadowed`)
        self.joined: Callable[[str], None] | None = None
        # told every shadow a peer sent (`Outbox.remember`); what it returns takes the
        # keeping back, should the peer's End withdraw the shadow
        self.shadow_seen: Callable[[Shadow], Callable[[], None] | None] | None = None
        # publish-to-apply delays in seconds (same host: both ends read one clock)
        self.delays: deque[float] = deque(maxlen=_DELAY_SAMPLES)

    def live(self) -> list[str]:
        """Ids of the peers heard from within the timeout."""
        return sorted(self._peers)

    def running(self, peer: str) -> int:
        """Requests `peer` has in flight, as known here."""
        state = self._peers.get(peer)
        return len(state.tickets) if state is not None else 0

    def apply(self, batch: Batch) -> None:
        """Apply one batch of a peer's decisions (our own are ignored)."""
        if batch.replica == self.me:
            # NATS echoes nothing back to its sender here (no_echo): this is another
            # replica under the same replica_id, whose decisions this one cannot tell apart
            if not self._twin_said:
                self._twin_said = True
                log.warning(
                    "another replica uses this replica_id (%s): its decisions and admin "
                    "changes are taken for this one's own and ignored; give each replica its "
                    "own cluster.replica_id, or leave it empty",
                    self.me,
                )
            return
        reading = time.time() - batch.sent_at
        self.delays.append(max(reading, 0.0))
        peer = self._peers.get(batch.replica)
        now = self._clock()
        if peer is None:
            peer = self._peers[batch.replica] = _Peer(now, batch.instance)
            log.info("replica %s joined", batch.replica)
            if self.joined is not None:
                self.joined(batch.replica)
        elif batch.instance and batch.instance != peer.instance:
            # back under the same id before its silence dropped it: the process before it is
            # gone (its requests end with the heartbeat that lists none), and what lasts, it
            # is told again
            fresh = not peer.instance
            peer.instance = batch.instance
            # its numbers start again: an End of the new process is not one of the old's (the
            # shadows the old one sent stay kept: fail closed)
            peer.kept.clear()
            if not fresh:
                log.info("replica %s restarted", batch.replica)
                if self.joined is not None:
                    self.joined(batch.replica)
        peer.last_seen = now
        # how long ago the sender decided: its pending marks live what is left of the TTL.
        # Before, each one lived the whole TTL from its arrival: decisions NATS held up (a
        # stalled server, shorter than the heartbeat timeout) were marked as fresh on workers
        # that had flushed them since (QA: `pending 560` predicted on a worker with nothing).
        # A sender's clock behind ours makes them older (fewer marks: fail closed); one ahead,
        # as far as its messages show it, is allowed for (`router.cluster.sender_clock`)
        age_s = max(reading + peer.clock.ahead_s(reading, now), 0.0)
        load = self._load
        for d in batch.decisions:
            if isinstance(d, Pending):
                worker = self._meant(d.worker, d.server)
                if worker is not None and self._indexer.has_worker(worker):
                    keys_of = self._keys_of(d, worker)
                    made = self._indexer.add_pending(
                        d.namespace, d.tokens, worker, d.dp_rank, keys_of=keys_of, age_s=age_s
                    )
                    if made and d.ticket:
                        if len(peer.pending) >= _MAX_UNBEGUN:  # Begins were lost
                            del peer.pending[next(iter(peer.pending))]
                        peer.pending[d.ticket] = made
                    self._take_in(peer, d, worker, keys_of)
            elif isinstance(d, Begin):
                old = peer.tickets.pop(d.ticket, None)
                if old is not None:
                    self._end(old)
                begun = peer.tickets[d.ticket] = load.begin(
                    d.worker,
                    d.prefill_tokens,
                    d.dp_rank,
                    kv_tokens=d.kv_tokens,
                    output_tokens=d.output_tokens,
                    prompt_tokens=d.prompt_tokens,
                )
                begun.marks = peer.marks.pop(d.ticket, [])
                begun.pending = peer.pending.pop(d.ticket, [])
                self.applied += 1
            elif isinstance(d, Shadow):
                if d.keep_s > 0:
                    self._shadow(d, peer.tickets.get(d.ticket) if d.ticket else None)
                if self.shadow_seen is not None and d.keep_s > 0:
                    take_back = self.shadow_seen(d)
                    if take_back is not None and d.ticket:
                        if d.ticket not in peer.kept and len(peer.kept) >= _MAX_KEEPING:
                            del peer.kept[next(iter(peer.kept))]  # its End and beats were lost
                        peer.kept.setdefault(d.ticket, []).append(take_back)
            elif isinstance(d, FirstByte):
                ticket = peer.tickets.get(d.ticket)
                if ticket is not None:
                    load.first_byte(ticket)
                    self._release(ticket, first_byte=True)
            elif isinstance(d, End):
                ticket = peer.tickets.pop(d.ticket, None)
                if ticket is not None:
                    self._end(ticket)
                    if d.withdraw:
                        self._withdraw(ticket, d.withdraw)
                take_backs = peer.kept.pop(d.ticket, [])
                if d.withdraw >= Withdraw.ALL:
                    # not sent again to a replica that joins: it would shadow them anew
                    for take_back in reversed(take_backs):
                        take_back()
            elif isinstance(d, Heartbeat):
                self._reconcile(peer, d)
            elif isinstance(d, Goodbye):
                self._drop(batch.replica, stopped=True)
                return  # sent last: nothing of it follows

    def _meant(self, worker: str, server: str) -> str | None:
        """The id here of the server a decision naming (`worker`, `server`) meant: `worker`
        when it names that server here too (or the decision does not say), else the id of
        that server here (None: not in this replica's fleet)."""
        if not server or self._servers is None:
            return worker
        here = self._servers.server_of(worker)
        if here is not None and _one_server(here, server, surely=True):
            return worker
        self.misaddressed += 1
        return self._servers.worker_at(server)

    def _shadowed_at(self, worker: str, server: str) -> list[str]:
        """The ids here a shadow naming (`worker`, `server`) goes on: `worker` where it may
        name that server here (spelled alike, or in a way that may be it: `indexer.hosts`),
        and the id that server has here. Not applying a shadow trusts the pages it covers (a
        false hit), applying one too many only hides them: before, `server` was compared as
        spelled, and a replica whose config spells a worker's host otherwise (`[::1]` for
        `127.0.0.1`, a name for its address) dropped every shadow the others sent for it."""
        servers = self._servers
        if not server or servers is None:
            return [worker]
        here = servers.server_of(worker)
        if here == server:
            return [worker]
        self.misaddressed += 1
        found = [worker] if here is not None and _one_server(here, server, surely=False) else []
        other = servers.worker_at(server)
        if other is not None and other != worker:
            found.append(other)
        return found

    def _shadow(self, shadow: Shadow, owner: Ticket | None) -> None:
        """Apply a peer's shadow on the ids here it goes on (`_shadowed_at`; `owner`: the
        ticket of its request, whose End may withdraw it). At a server no worker is followed
        at here (the id there, or the one it names, is still being registered: added, renamed,
        deleted and added again; or no id is there yet) it waits for the worker added there
        (`IndexerService.shadow_at`). Before, it was dropped: the replica still registering the
        worker predicted the pages of the `extra_key` requests another routed to it as soon as
        it followed it (QA: 288 tokens predicted, 0 cached)."""
        indexer, servers = self._indexer, self._servers
        waiting: set[str] = set()  # the servers (`WorkerEntry.server`) it waits at
        applied = False  # on an id that surely names its server here
        for worker in self._shadowed_at(shadow.worker, shadow.server):
            here = None if servers is None else servers.server_of(worker)
            if indexer.may_shadow(worker):  # (registered anew: kept)
                made = indexer.shadow(
                    shadow.namespace, shadow.tokens, worker, shadow.dp_rank, shadow.keep_s
                )
                if owner is not None:
                    owner.shadows.extend(made)
                applied |= here is not None and _one_server(here, shadow.server, surely=True)
            elif here is not None:
                waiting.add(here)
        if not applied and shadow.server and servers is not None:
            # no id there here yet, or one not followed yet (one whose host may be it is not
            # surely it: when unsure, hide)
            waiting.add(shadow.server)
        for url in waiting:  # (not withdrawn by its End: fail closed)
            indexer.shadow_at(url, shadow.namespace, shadow.tokens, shadow.dp_rank, shadow.keep_s)

    def _keys_of(self, pending: Pending, worker: str) -> Callable[[str], list[int]] | None:
        """The decision's block keys per stream: the ones it carries, on streams with its page
        size (none elsewhere: nothing is marked there); else the book's, made once from its
        tokens for the pending marks and the touch alike."""
        if pending.keys:
            index = self._indexer.index
            usable: set[str] = set()  # the streams with the keys' page size
            for stream in self._indexer.stream_ids(worker, pending.dp_rank):
                ours = index.block_size(stream) if index.has_stream(stream) else None
                if ours == pending.block_size:
                    usable.add(stream)
                elif ours is not None:  # unknown: nothing is held there to mark anyway
                    self._unmatched(stream, pending.block_size, ours)
            return lambda stream: pending.keys if stream in usable else []
        return None if self._book is None else self._book.keys_of(pending.namespace, pending.tokens)

    def _unmatched(self, stream: str, theirs: int, ours: int) -> None:
        """A peer's keys are for `theirs`-token pages where this replica's `stream` has `ours`:
        its decisions are not marked here, so sharing is lost on that stream. Counted, and
        said once per pair of sizes (replicas should agree on a worker's page size)."""
        self.unmatched_pages += 1
        if (stream, theirs, ours) in self._warned or len(self._warned) >= _WARNED_LIMIT:
            return
        self._warned.add((stream, theirs, ours))
        log.warning(
            "another replica's decisions for %s come with block keys for %d-token pages, but "
            "this replica's stream there has %d-token pages: their pending marks and recency "
            "are not applied here (do the replicas see the same page size for this worker?)",
            stream,
            theirs,
            ours,
        )

    def _take_in(
        self,
        peer: _Peer,
        pending: Pending,
        worker: str,
        keys_of: Callable[[str], list[int]] | None,
    ) -> None:
        """A peer's decision joins the admission forecast; its marks wait for its Begin."""
        if self._book is None or not pending.ticket:
            return
        marks = self._book.book_decision(
            pending.namespace,
            pending.tokens,
            worker,
            pending.dp_rank,
            kept_tokens=pending.kept_tokens,
            held_tokens=pending.held_tokens,
            keys_of=keys_of,
            output_tokens=pending.output_tokens,
        )
        if not marks:
            return
        if len(peer.marks) >= _MAX_UNBEGUN:
            oldest = next(iter(peer.marks))
            self._book.release_marks(peer.marks.pop(oldest), first_byte=False)
        peer.marks[pending.ticket] = marks

    def _release(self, ticket: Ticket, *, first_byte: bool) -> None:
        """A ticket held for a peer answered or ended: its marks leave the forecast."""
        if self._book is not None and ticket.marks:
            self._book.release_marks(ticket.marks, first_byte=first_byte)
        ticket.marks = []

    def _withdraw(self, ticket: Ticket, what: int) -> None:
        """A peer's request failed: what its End says goes, as on its own replica
        (`Planner.withdraw`)."""
        if ticket.pending:
            self._indexer.withdraw_pending(ticket.pending)
            ticket.pending = []
        if what >= Withdraw.ALL and ticket.shadows:
            self._indexer.unshadow(ticket.shadows)
            ticket.shadows = []

    def _end(self, ticket: Ticket) -> None:
        """A ticket held for a peer ends: its load, and its marks in the forecast."""
        self._load.end(ticket)
        self._release(ticket, first_byte=False)

    def _reconcile(self, peer: _Peer, beat: Heartbeat) -> None:
        """Make the tickets held for `peer` exactly the requests its heartbeat lists."""
        listed = {t.ticket: t for t in beat.open}
        for number in [n for n in peer.tickets if n not in listed]:
            self._end(peer.tickets.pop(number))
        for number in [n for n in peer.kept if n not in listed]:
            del peer.kept[number]  # ended, its End lost: its shadows stay (fail closed)
        for number, t in listed.items():
            ticket = peer.tickets.get(number)
            if ticket is None:
                ticket = peer.tickets[number] = self._load.begin(
                    t.worker,
                    t.prefill_tokens,
                    t.dp_rank,
                    kv_tokens=t.kv_tokens,
                    output_tokens=t.output_tokens,
                    prompt_tokens=t.prompt_tokens,
                )
            if t.prefilled and not ticket.prefilled:
                self._load.first_byte(ticket)
                self._release(ticket, first_byte=True)

    def sweep(self) -> list[str]:
        """Drop the peers not heard from within the timeout; returns their ids."""
        deadline = self._clock() - self._timeout_s
        gone = [name for name, peer in self._peers.items() if peer.last_seen < deadline]
        for name in gone:
            self._drop(name)
        return gone

    def _drop(self, name: str, *, quiet: bool = False, stopped: bool = False) -> None:
        peer = self._peers.pop(name)
        for ticket in peer.tickets.values():
            self._end(ticket)
        if self._book is not None:
            for marks in peer.marks.values():
                self._book.release_marks(marks, first_byte=False)
        if quiet:
            return
        if stopped:  # it said so (`Goodbye`): no failure
            log.info(
                "replica %s stopped: its %d requests in flight no longer count",
                name,
                len(peer.tickets),
            )
            return
        log.warning(
            "replica %s is silent: its %d requests in flight no longer count",
            name,
            len(peer.tickets),
        )

    def clear(self) -> None:
        """Drop every peer (this replica is shutting down)."""
        for name in list(self._peers):
            self._drop(name, quiet=True)


def _one_server(a: str, b: str, *, surely: bool) -> bool:
    """Whether two servers (`WorkerEntry.server`: `scheme://host[:port]/path`, spelled one
    way) are one (`surely`), or may be: the same scheme, port and path, on hosts that are one,
    or may be (`indexer.hosts`)."""
    if a == b:
        return True
    one, other = urlsplit(a), urlsplit(b)
    hosts = one_host if surely else may_be_one_host
    return (
        (one.scheme, one.port, one.path) == (other.scheme, other.port, other.path)
        and one.hostname is not None
        and other.hostname is not None
        and hosts(one.hostname, other.hostname)
    )
