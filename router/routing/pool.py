"""The fleet as the router sees it: workers, their health, breakers and drain flags.

Plain state, mutated only from the event loop (health checker, proxy, admin API), never across
an await in the middle of an update, so it needs no lock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

import msgspec

from router.config import BreakerConfig, WorkerConfig
from router.errors import ConflictError, NotFoundError
from router.routing.breaker import BreakerState, CircuitBreaker

__all__ = ["WorkerEntry", "WorkerPool", "WorkerStatus", "WorkerSummary"]


class WorkerStatus(enum.StrEnum):
    """Why a worker does or does not take traffic."""

    READY = "ready"
    UNHEALTHY = "unhealthy"  # last health check failed
    CIRCUIT_OPEN = "circuit_open"
    DRAINING = "draining"


class WorkerSummary(msgspec.Struct):
    """One worker on `GET /admin/workers`."""

    id: str
    url: str
    status: WorkerStatus
    healthy: bool
    draining: bool
    breaker: BreakerState
    consecutive_failures: int
    model: str
    kv_events: bool
    discovered: bool
    streams: list[str]
    queued_prefill_tokens: int
    running: int


class WorkerEntry:
    """One worker and the router's knowledge of it."""

    def __init__(self, config: WorkerConfig, breaker: BreakerConfig) -> None:
        self.config = config
        self.id = config.worker_id
        self.url = config.url.rstrip("/")
        # optimistic until the first health check says otherwise: a fresh router serves at once
        self.healthy = True
        self.draining = False
        self.breaker = CircuitBreaker(breaker.failure_threshold, breaker.cooldown_s)
        # set once the worker's streams are registered with the indexer
        self.streams: list[str] = []
        self.discovered = not config.kv_events

    def status(self, now: float) -> WorkerStatus:
        """The worker's routing status at `now`."""
        if self.draining:
            return WorkerStatus.DRAINING
        if not self.healthy:
            return WorkerStatus.UNHEALTHY
        if not self.breaker.allows(now):
            return WorkerStatus.CIRCUIT_OPEN
        return WorkerStatus.READY

    def routable(self, now: float) -> bool:
        """Whether new requests may go to this worker at `now`."""
        return self.status(now) is WorkerStatus.READY


class WorkerPool:
    """Workers by id, in the order they were added."""

    def __init__(self, breaker: BreakerConfig) -> None:
        self._breaker = breaker
        self._workers: dict[str, WorkerEntry] = {}
        self._models: frozenset[str] = frozenset()  # asked on every request: kept, not rebuilt

    def add(self, config: WorkerConfig) -> WorkerEntry:
        """Add a worker; its id must be new."""
        entry = WorkerEntry(config, self._breaker)
        if entry.id in self._workers:
            raise ConflictError(f"worker {entry.id!r} already exists")
        self._workers[entry.id] = entry
        self._models = self._models | {entry.config.model}
        return entry

    def remove(self, worker_id: str) -> WorkerEntry:
        """Take a worker out of the pool."""
        try:
            entry = self._workers.pop(worker_id)
        except KeyError:
            raise NotFoundError(f"no worker {worker_id!r}") from None
        self._models = frozenset(w.config.model for w in self._workers.values())
        return entry

    def get(self, worker_id: str) -> WorkerEntry:
        """The worker with this id."""
        try:
            return self._workers[worker_id]
        except KeyError:
            raise NotFoundError(f"no worker {worker_id!r}") from None

    def find(self, worker_id: str) -> WorkerEntry | None:
        """The worker with this id, or None."""
        return self._workers.get(worker_id)

    def models(self) -> frozenset[str]:
        """The namespace models configured across the fleet."""
        return self._models

    def __iter__(self) -> Iterator[WorkerEntry]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)
