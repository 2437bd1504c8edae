"""The running subscriptions of a process: one task per stream, grouped by worker.

`Subscriptions` owns the zmq context and one `StreamSubscriber` task per (worker, dp rank)
stream, whatever their sinks are: the indexer service (`indexer.service`, sinks into the index)
and a capture (`indexer.recording.capture`, sinks into a recording file) both run on it.
It is an async context manager: leaving it stops every task and closes every socket.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Sequence

import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.sink import StreamSink
from indexer.stats import StreamState
from indexer.subscriber import StreamSubscriber

__all__ = ["Subscriptions", "stream_id", "stream_worker"]


def stream_id(worker: str, dp_rank: int) -> str:
    """The id of one (worker, dp rank) stream, as used in stats and the index."""
    return f"{worker}#dp{dp_rank}"


def stream_worker(stream: str) -> str | None:
    """The worker of a stream id (`stream_id`'s inverse); None when it is not one."""
    worker, sep, rank = stream.rpartition("#dp")
    return worker if sep and worker and rank.isdigit() else None


class Subscriptions:
    """Subscriber tasks by worker, over one zmq context (see the module docstring)."""

    def __init__(
        self,
        settings: IndexerConfig,
        *,
        on_applied: Callable[[str, int], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
        on_state: Callable[[str, StreamState], None] | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self._on_applied = on_applied
        self._on_restart = on_restart
        self._on_state = on_state
        self._clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self.by_worker: dict[str, list[StreamSubscriber]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def __aenter__(self) -> Subscriptions:
        self._ctx = zmq.asyncio.Context()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            for worker in list(self.by_worker):
                await self.stop(worker)
        finally:  # even when cancelled meanwhile: no socket left open
            if self._ctx is not None:
                self._ctx.destroy(linger=0)
                self._ctx = None

    def start(
        self,
        worker: str,
        streams: Sequence[StreamConfig],
        sink_for: Callable[[str, StreamConfig], StreamSink],
    ) -> list[StreamSubscriber]:
        """Subscribe to a worker's streams, each into `sink_for(stream id, config)`.

        The worker must not be subscribed already (`stop` it first); ranks must be distinct.
        """
        if self._ctx is None:
            raise RuntimeError("subscriptions are not entered (use `async with`)")
        if worker in self.by_worker:
            raise ValueError(f"worker {worker!r} is subscribed already")
        ranks = [cfg.dp_rank for cfg in streams]
        for rank in ranks:
            # checked before anything changes: a refused worker leaves no stream behind
            if ranks.count(rank) > 1:
                raise ValueError(f"worker {worker!r} lists dp rank {rank} twice")
        subs = []
        for cfg in streams:
            sid = stream_id(worker, cfg.dp_rank)
            subs.append(
                StreamSubscriber(
                    sid,
                    worker,
                    cfg,
                    sink_for(sid, cfg),
                    self._ctx,
                    self.settings,
                    on_applied=self._on_applied,
                    on_restart=self._on_restart,
                    on_state=self._on_state,
                    on_siblings=self._suspect_siblings,
                    clock=self._clock,
                )
            )
        self.by_worker[worker] = subs
        for sub in subs:
            # in a context of their own: a registration started on a request's path (a worker
            # refusing a rank, read again) would give them that request's, its id on every line
            # they log for as long as they run, and its observation kept alive with them
            self._tasks[sub.stream_id] = asyncio.create_task(
                sub.run(), name=f"kv-events {sub.stream_id}", context=contextvars.Context()
            )
        return subs

    def _suspect_siblings(self, sub: StreamSubscriber) -> None:
        """`sub` found its publisher restarted: the worker's other ranks are the same server's
        processes, which restart together, so each is suspected at once (UNVERIFIED, proven or
        rebuilt through its own replay socket; without one, cleared). Before, a rank whose
        event connection did not drop (a forwarder between) and that stayed quiet predicted the
        dead process's pages until its own idle probe found the restart."""
        subs = self.by_worker.get(sub.worker, [])
        if sub not in subs:
            return  # a worker registered anew since: its streams are new subscribers
        for other in subs:
            if other is not sub:
                other.suspect_restart(
                    f"dp rank {sub.config.dp_rank} of its worker restarted (the ranks of one "
                    "server restart together)",
                    sibling=True,
                )

    async def stop(self, worker: str) -> list[StreamSubscriber]:
        """Stop a worker's subscriber tasks; returns its subscribers (none if unknown)."""
        subs = self.by_worker.pop(worker, [])
        tasks = [self._tasks.pop(s.stream_id) for s in subs if s.stream_id in self._tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            # asyncio.wait, not `suppress(CancelledError): await task`: that would also swallow
            # a cancellation of the caller arriving while the subscribers wind down
            await asyncio.wait(tasks)
        return subs

    def task(self, stream: str) -> asyncio.Task[None] | None:
        """The running task of one stream (tests watch it survive hostile input)."""
        return self._tasks.get(stream)

    def all(self) -> list[StreamSubscriber]:
        """Every subscriber, in worker order."""
        return [sub for subs in self.by_worker.values() for sub in subs]
