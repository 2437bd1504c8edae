"""This replica's decisions on their way to the others: the planner's `DecisionSink`.

Called on the request path, so each call only appends to a bounded buffer and wakes the
publisher (`ClusterService` sends the buffer as one `Batch`). A routing decision (a pending mark
and its begin) and a heartbeat wake it; a request's first byte and end only wait in the buffer
for the next message, or for `LAZY_S` at most: they only lower the load the others see, a few
milliseconds late, and one socket write per message is what the cluster costs under load.

While NATS is away nothing is buffered: decisions that old would only mislead, and the next
heartbeat, which lists every request still in flight, repairs the other replicas' view of this
one's load.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from indexer.namespace import Namespace
from router.cluster.wire import Begin, Decision, End, FirstByte, Heartbeat, OpenTicket, Pending
from router.routing.load import Ticket

__all__ = ["LAZY_S", "Outbox"]

# the longest a first byte or an end waits for a routing decision to go with
LAZY_S = 0.005


class _Open:
    """A request in flight, under the number the other replicas know it by."""

    __slots__ = ("answered", "number", "ticket")

    def __init__(self, number: int, ticket: Ticket) -> None:
        self.number = number
        self.ticket = ticket
        self.answered = False


class Outbox:
    """Decisions not yet published, and the requests in flight (for heartbeats)."""

    def __init__(self, max_decisions: int = 65_536) -> None:
        self.max_decisions = max_decisions
        self.wakeup = asyncio.Event()
        # whether decisions are buffered at all (False while NATS is away)
        self.sending = False
        self.dropped = 0  # decisions lost to a full buffer
        self._buffer: list[Decision] = []
        # keyed by id(): a ticket lives (the proxy holds it) at least until it is finished
        self._open: dict[int, _Open] = {}
        self._numbers = itertools.count(1)
        # wakes the publisher for the first byte or end nothing urgent came to take along
        self._lazy: asyncio.TimerHandle | None = None

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
            # the keys stand for the tokens (`Pending.keys`), but for an extra_key's: the
            # receivers shadow its plain twin, whose keys only the tokens give (`shadow`)
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
                )
            )
        self._put(
            Begin(
                number, ticket.worker, ticket.dp_rank, ticket.prefill_tokens, ticket.output_tokens
            )
        )

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
        if self.sending:
            self._put(End(entry.number), urgent=False)

    def heartbeat(self) -> None:
        """Queue a heartbeat listing every request in flight."""
        if not self.sending:
            return
        open_ = [
            OpenTicket(e.number, e.ticket.worker, e.ticket.dp_rank, e.ticket.prefill_tokens,
                       e.answered)
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
