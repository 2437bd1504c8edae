"""Where the planner reports each real decision, for whoever shares them (`router.cluster`).

The planner calls its optional `DecisionSink` after it changed its own state: synchronously, on
the request path, so an implementation only takes note (a bounded buffer) and never awaits or
does I/O here. Replicas of one router use it to apply each other's pending marks and load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from indexer.namespace import Namespace
from router.routing.load import Ticket

__all__ = ["DecisionSink"]


class DecisionSink(Protocol):
    """Told of every committed decision and of how its request progresses."""

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
        """A request went to `ticket`'s (worker, rank); `marked`: its prefix was marked pending
        there (the worker, rank and uncached tokens are the ticket's); `kept_tokens`: what it
        was predicted to reuse there, `held_tokens`: what the events showed held; `keys`: the
        prompt's block keys there, for pages of `block_size` tokens (empty: not known)."""
        ...

    def shadowed(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        worker: str,
        dp_rank: int | None,
        ticket: Ticket | None = None,
    ) -> None:
        """A request with an extra_key (in `ns`) went to (worker, rank): its plain twin was
        shadowed there (`Planner.shadow`); `ticket`: the request's, committed already (None:
        a gateway's request, `/v1/kv/routed`), whose end may withdraw the shadow."""
        ...

    def first_byte(self, ticket: Ticket) -> None:
        """The worker answered the request of `ticket`."""
        ...

    def finished(self, ticket: Ticket) -> None:
        """The request of `ticket` ended (`ticket.withdraw`: what it takes back)."""
        ...
