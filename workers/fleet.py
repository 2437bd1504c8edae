"""`Fleet`: N in-process reference workers on 127.0.0.1, for `kvroute up`, tests and benchmarks.

    async with Fleet(3, WorkerConfig(time_scale=0, page_size=16)) as fleet:
        for w in fleet.workers:
            w.id                    # "worker-0", "worker-1", ...
            w.url                   # http://127.0.0.1:PORT
            w.events_endpoints      # ["tcp://127.0.0.1:P"], one per DP rank (P, P+1, ...)
            w.replay_endpoints      # ["tcp://127.0.0.1:R"], one per DP rank
            w.topic, w.block_size, w.dp_size
            w.worker                # the ReferenceWorker itself (caches, schedulers)

Every worker gets the same `WorkerConfig` except its ports and topic. Ports are ephemeral by
default; with `http_port_base` / `events_port_base` / `replay_port_base` worker i gets
base + i (times `dp_size` for the event streams, so ranks never overlap). The topic defaults
to `kv@<id>` (`topic_template`, `{id}` substituted). Leaving the context stops every worker.
"""

from __future__ import annotations

import contextlib
from types import TracebackType

import msgspec

from workers.config import WorkerConfig
from workers.errors import PortTakenError
from workers.worker import KvEventsInfo, ReferenceWorker

__all__ = ["Fleet", "FleetWorker"]


class FleetWorker(msgspec.Struct, frozen=True):
    """How to reach one worker of a fleet."""

    id: str
    url: str
    kv_events: KvEventsInfo
    worker: ReferenceWorker

    @property
    def events_endpoints(self) -> list[str]:
        """PUB endpoint of each DP rank."""
        return self.kv_events.endpoints

    @property
    def replay_endpoints(self) -> list[str]:
        """ROUTER replay endpoint of each DP rank."""
        return self.kv_events.replay_endpoints

    @property
    def topic(self) -> str:
        """The topic every rank publishes on."""
        return self.kv_events.topic

    @property
    def block_size(self) -> int:
        """Tokens per page (SGLang's page_size)."""
        return self.kv_events.block_size

    @property
    def dp_size(self) -> int:
        """Number of DP ranks, each its own cache and stream."""
        return self.kv_events.dp_size


class Fleet:
    """N reference workers started together and stopped together (an async context manager)."""

    def __init__(
        self,
        count: int,
        config: WorkerConfig | None = None,
        *,
        http_port_base: int = 0,
        events_port_base: int = 0,
        replay_port_base: int = 0,
        topic_template: str = "kv@{id}",
        id_prefix: str = "worker-",
    ) -> None:
        if count < 1:
            raise ValueError("a fleet needs at least one worker")
        self.count = count
        self.config = config or WorkerConfig()
        self._bases = (http_port_base, events_port_base, replay_port_base)
        self._topic_template = topic_template
        self._id_prefix = id_prefix
        self._stack = contextlib.AsyncExitStack()
        self.workers: list[FleetWorker] = []

    def worker_config(self, index: int) -> WorkerConfig:
        """The config of worker `index`: the shared one with its own ports and topic."""
        http, events, replay = self._bases
        stride = self.config.dp_size
        worker_id = f"{self._id_prefix}{index}"
        return msgspec.structs.replace(
            self.config,
            port=http + index if http else 0,
            events_port=events + index * stride if events else 0,
            replay_port=replay + index * stride if replay else 0,
            topic=self._topic_template.format(id=worker_id),
        )

    async def __aenter__(self) -> Fleet:
        try:
            for index in range(self.count):
                config = self.worker_config(index)
                try:
                    worker = await self._stack.enter_async_context(ReferenceWorker(config))
                except PortTakenError as exc:
                    # said by worker too: which of the fleet's holds the port
                    raise PortTakenError(f"{self._id_prefix}{index}'s {exc}", exc.port) from exc
                self.workers.append(
                    FleetWorker(
                        id=f"{self._id_prefix}{index}",
                        url=worker.url,
                        kv_events=worker.kv_events,
                        worker=worker,
                    )
                )
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.workers = []
        await self._stack.aclose()
