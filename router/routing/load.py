"""The router's own view of in-flight work per worker (it never asks the workers).

A request counts as queued prefill (its uncached prompt tokens) from dispatch until the first
response byte arrives, and as one running request until its response ends. Tokens from the
index are predictions, so this is an estimate; it is consistent, which is what routing needs.
Pure bookkeeping: no I/O.
"""

from __future__ import annotations

__all__ = ["LoadTracker", "Ticket", "WorkerLoad"]


class WorkerLoad:
    """In-flight counters of one worker."""

    __slots__ = ("queued_prefill_tokens", "running")

    def __init__(self) -> None:
        self.queued_prefill_tokens = 0
        self.running = 0


class Ticket:
    """One dispatched request; hand it back to the tracker as it progresses."""

    __slots__ = ("done", "prefill_tokens", "prefilled", "worker")

    def __init__(self, worker: str, prefill_tokens: int) -> None:
        self.worker = worker
        self.prefill_tokens = prefill_tokens
        self.prefilled = False
        self.done = False


class LoadTracker:
    """Per-worker queued prefill tokens and running requests."""

    def __init__(self) -> None:
        self._loads: dict[str, WorkerLoad] = {}

    def of(self, worker: str) -> WorkerLoad:
        """The counters of `worker` (zero for a worker with nothing in flight)."""
        load = self._loads.get(worker)
        if load is None:
            load = self._loads[worker] = WorkerLoad()
        return load

    def begin(self, worker: str, prefill_tokens: int) -> Ticket:
        """A request was sent to `worker` with this many uncached prompt tokens."""
        load = self.of(worker)
        load.queued_prefill_tokens += prefill_tokens
        load.running += 1
        return Ticket(worker, prefill_tokens)

    def first_byte(self, ticket: Ticket) -> None:
        """The worker answered: the prompt is prefilled (idempotent)."""
        if ticket.prefilled or ticket.done:
            return
        ticket.prefilled = True
        load = self._loads.get(ticket.worker)
        if load is not None:
            load.queued_prefill_tokens -= ticket.prefill_tokens

    def end(self, ticket: Ticket) -> None:
        """The request finished, failed or was cancelled (idempotent)."""
        if ticket.done:
            return
        self.first_byte(ticket)
        ticket.done = True
        load = self._loads.get(ticket.worker)
        if load is not None:
            load.running -= 1

    def running(self) -> dict[str, int]:
        """Requests in flight per worker (what `kvroute_in_flight_requests` exports)."""
        return {worker: load.running for worker, load in self._loads.items()}

    def forget(self, worker: str) -> None:
        """Drop a removed worker's counters (its open tickets then change nothing)."""
        self._loads.pop(worker, None)
