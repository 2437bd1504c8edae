"""This replica's decisions on their way to the others: the planner's `DecisionSink`.

Called on the request path, so each call only appends to a bounded buffer and wakes the
publisher (`ClusterService` sends the buffer as one `Batch`). A routing decision (a pending mark
and its begin) and a heartbeat wake it; a request's first byte and end only wait in the buffer
for the next message, or for `LAZY_S` at most: they only lower the load the others see, a few
milliseconds late, and one socket write per message is what the cluster costs under load.

While NATS is away nothing is buffered: decisions that old would only mislead, and the next
heartbeat, which lists every request still in flight, repairs the other replicas' view of this
one's load. Shadows are the exception (`shadowed`): they last an hour, and a replica that
missed one would predict a plain request the pages an extra_key's request stored. So the
shadows of the last `SHADOW_KEEP_S`, this replica's and those the others sent (`remember`), are
kept (the newest `MAX_SHADOWS`) and sent again when NATS is back and when a replica joins or
comes back: the one that made a shadow may be the one coming back, with nothing of it left. A
request that stored nothing (`Withdraw.ALL`) takes its shadows back from what is kept too,
unless a later shadow of the same head renewed them since: this replica's own at `finished`,
another's through what `remember` returns (called by `Peers` when its `End` says so).

Each pending mark and shadow names the server its worker id names here when it is made
(`server_of`, `Pending.server`): a replica that has moved the id to another server by the time
it applies the decision can tell. A kept shadow keeps the server it was made for.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from indexer.namespace import Namespace
from indexer.service import SHADOW_HEAD_TOKENS
from router.cluster.wire import (
    Begin,
    Decision,
    End,
    FirstByte,
    Heartbeat,
    OpenTicket,
    Pending,
    Shadow,
)
from router.routing.load import Ticket, Withdraw
from router.routing.planner import SHADOW_KEEP_S

__all__ = ["LAZY_S", "MAX_SHADOWS", "Outbox"]

# the longest a first byte or an end waits for a routing decision to go with
LAZY_S = 0.005
# shadows kept to send again: beyond them the oldest go (a replica that joins then may
# predict a plain request pages an extra_key's request stored, as before shadows were shared)
MAX_SHADOWS = 8192


# a kept shadow's key: (worker, its server then ("": not said), rank, namespace, head as
# 8-byte ids)
_Key = tuple[str, str, int | None, Namespace, bytes]
# a kept shadow: (when it lapses, `clock`; which keeping it is, so a withdrawal takes back only
# its own)
_Kept = tuple[float, int]


class _Open:
    """A request in flight, under the number the other replicas know it by."""

    __slots__ = ("answered", "number", "shadows", "ticket")

    def __init__(self, number: int, ticket: Ticket) -> None:
        self.number = number
        self.ticket = ticket
        self.answered = False
        # the shadows it kept: (key, what was kept before, None: nothing, what it kept)
        self.shadows: list[tuple[_Key, _Kept | None, _Kept]] = []


class Outbox:
    """Decisions not yet published, and the requests in flight (for heartbeats)."""

    def __init__(
        self,
        max_decisions: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
        server_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.max_decisions = max_decisions
        # the server a worker id names here (`WorkerPool.server_of`; None: not said)
        self._server_of = server_of
        self.wakeup = asyncio.Event()
        self._sending = False
        self._clock = clock
        # oldest first: 2 KiB a shadow at most
        self._shadows: OrderedDict[_Key, _Kept] = OrderedDict()
        self._keepings = itertools.count(1)
        self.dropped = 0  # decisions lost to a full buffer
        self._buffer: list[Decision] = []
        # keyed by id(): a ticket lives (the proxy holds it) at least until it is finished
        self._open: dict[int, _Open] = {}
        self._numbers = itertools.count(1)
        # wakes the publisher for the first byte or end nothing urgent came to take along
        self._lazy: asyncio.TimerHandle | None = None

    @property
    def sending(self) -> bool:
        """Whether decisions are buffered at all (False while NATS is away)."""
        return self._sending

    @sending.setter
    def sending(self, value: bool) -> None:
        back = value and not self._sending
        self._sending = value
        if back:
            self.resend_shadows()

    def shadowed(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        worker: str,
        dp_rank: int | None,
        ticket: Ticket | None = None,
    ) -> None:
        """An extra_key's plain twin was shadowed on (worker, rank) (see `DecisionSink`)."""
        head = list(tokens[:SHADOW_HEAD_TOKENS])
        entry = None if ticket is None else self._open.get(id(ticket))
        if entry is not None and entry.ticket is not ticket:
            entry = None
        server = self._server(worker)
        if self._sending:
            number = entry.number if entry is not None else 0
            self._put(Shadow(worker, dp_rank, ns, head, SHADOW_KEEP_S, number, server))
        try:
            key = (worker, server, dp_rank, ns, array("q", head).tobytes())
        except OverflowError:
            return  # ids beyond 64 bits, which no tokenizer makes: sent once, not kept
        kept = (self._clock() + SHADOW_KEEP_S, next(self._keepings))
        if entry is not None:
            entry.shadows.append((key, self._shadows.get(key), kept))
        self._keep(key, kept)

    def remember(self, shadow: Shadow) -> Callable[[], None] | None:
        """Keep a shadow another replica sent, to send again when a replica (re)joins: its
        sender may be the one coming back. Returns what takes this keeping back (its request
        withdrew the shadow), None when it kept nothing (one that lasts longer stands)."""
        try:
            head = array("q", shadow.tokens[:SHADOW_HEAD_TOKENS]).tobytes()
        except OverflowError:
            return None
        key = (shadow.worker, shadow.server, shadow.dp_rank, shadow.namespace, head)
        until = self._clock() + shadow.keep_s
        before = self._shadows.get(key)
        if before is not None and before[0] >= until:
            return None
        kept = (until, next(self._keepings))
        self._keep(key, kept)
        return lambda: self._take_back([(key, before, kept)])

    def _keep(self, key: _Key, kept: _Kept) -> None:
        self._shadows[key] = kept
        self._shadows.move_to_end(key)
        while len(self._shadows) > MAX_SHADOWS:
            self._shadows.popitem(last=False)

    def resend_shadows(self) -> None:
        """Queue every shadow still in force (NATS came back, or a replica joined)."""
        if not self._sending:
            return
        now = self._clock()
        for key, (until, _) in list(self._shadows.items()):
            if until <= now:
                del self._shadows[key]
                continue
            worker, server, dp_rank, ns, head = key
            ids = array("q")
            ids.frombytes(head)
            shadow = Shadow(worker, dp_rank, ns, ids.tolist(), until - now, 0, server)
            self._put(shadow, force=True)

    def committed(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        ticket: Ticket,
        *,
        marked: bool,
        kept_tokens: int = 0,
        held_tokens: int = 0,
        block_size: int = 0,
        keys: Sequence[int] = (),
    ) -> None:
        """A request was routed (see `router.routing.decisions.DecisionSink`)."""
        number = next(self._numbers)
        self._open[id(ticket)] = _Open(number, ticket)
        if not self.sending:
            return
        if marked:
            # the keys stand for the tokens (`Pending.keys`); an extra_key's plain twin goes
            # as a `Shadow` of its own (`shadowed`). Not an extra_key's: a receiver ties its
            # marks to the plain keys of the same blocks (`PendingTable.twin`), which it makes
            # from the tokens (such requests are few)
            if keys and block_size and ns.extra_key is None:
                ids: list[int] = []
                sent = list(keys)
            else:
                ids = tokens if isinstance(tokens, list) else list(tokens)
                sent, block_size = [], 0
            self._put(
                Pending(
                    ticket.worker,
                    ticket.dp_rank,
                    ns,
                    ids,
                    number,
                    kept_tokens,
                    held_tokens,
                    block_size,
                    sent,
                    self._server(ticket.worker),
                    ticket.output_tokens,
                )
            )
        self._put(
            Begin(
                number,
                ticket.worker,
                ticket.dp_rank,
                ticket.prefill_tokens,
                ticket.output_tokens,
                ticket.kv_tokens,
                ticket.prompt_tokens,
            )
        )

    def _server(self, worker: str) -> str:
        """The server `worker` names here now ("": not known)."""
        server = None if self._server_of is None else self._server_of(worker)
        return server or ""

    def first_byte(self, ticket: Ticket) -> None:
        """The worker answered a request."""
        entry = self._open.get(id(ticket))
        if entry is None or entry.ticket is not ticket or entry.answered:
            return
        entry.answered = True
        if self.sending:
            self._put(FirstByte(entry.number), urgent=False)

    def finished(self, ticket: Ticket) -> None:
        """A request ended."""
        entry = self._open.get(id(ticket))
        if entry is None or entry.ticket is not ticket:
            return
        del self._open[id(ticket)]
        if ticket.withdraw is Withdraw.ALL:
            self._take_back(entry.shadows)
        if self.sending:
            self._put(End(entry.number, int(ticket.withdraw)), urgent=False)

    def _take_back(self, keepings: list[tuple[_Key, _Kept | None, _Kept]]) -> None:
        """A request stored nothing: its shadows are not sent again, each back to what was
        kept before it, unless another request's shadow renewed it since."""
        for key, before, kept in reversed(keepings):
            if self._shadows.get(key) is not kept:
                continue
            if before is None:
                del self._shadows[key]
            else:
                self._shadows[key] = before

    def heartbeat(self) -> None:
        """Queue a heartbeat listing every request in flight."""
        if not self.sending:
            return
        open_ = [
            OpenTicket(e.number, e.ticket.worker, e.ticket.dp_rank, e.ticket.prefill_tokens,
                       e.answered, e.ticket.kv_tokens, e.ticket.output_tokens,
                       e.ticket.prompt_tokens)
            for e in self._open.values()
        ]  # fmt: skip
        self._put(Heartbeat(open_), force=True)

    def in_flight(self) -> int:
        """Requests this replica has in flight."""
        return len(self._open)

    def take(self) -> list[Decision]:
        """Everything buffered, in order; the buffer starts empty again."""
        out, self._buffer = self._buffer, []
        self.wakeup.clear()
        if self._lazy is not None:
            self._lazy.cancel()
            self._lazy = None
        return out

    def clear(self) -> None:
        """Forget what was buffered (NATS went away)."""
        self.take()

    def _put(self, decision: Decision, *, force: bool = False, urgent: bool = True) -> None:
        if len(self._buffer) >= self.max_decisions and not force:
            self.dropped += 1
            return
        self._buffer.append(decision)
        if urgent:
            self.wakeup.set()
        elif self._lazy is None:
            self._lazy = asyncio.get_running_loop().call_later(LAZY_S, self._lazy_due)

    def _lazy_due(self) -> None:
        self._lazy = None
        self.wakeup.set()
