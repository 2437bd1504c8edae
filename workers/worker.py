"""`ReferenceWorker`: one reference worker as an in-process service.

    async with ReferenceWorker(WorkerConfig(time_scale=0)) as worker:
        worker.url              # http://127.0.0.1:PORT
        worker.kv_events        # KvEventsInfo: SGLang's kv_events block (host, port bases,
                                #   topic, block_size, dp_size); .endpoints per DP rank

It owns a ZMQ context, one cache + scheduler + publisher per DP rank (rank r publishes on
events_port + r and replays on replay_port + r), and the aiohttp server of the HTTP API. Leaving
the context stops the schedulers, the replay services and the server, and closes every socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from types import TracebackType

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from workers.cache import Namespace, PagedRadixCache
from workers.config import WorkerConfig
from workers.disagg import Disaggregation, room_rank
from workers.errors import CacheBusyError, RequestError, WorkerError
from workers.io_struct import Generation
from workers.listener import WorkerRunner, bind_site
from workers.publisher import EventPublisher, bind_port_run
from workers.scheduler import Job, RankScheduler
from workers.server import build_app
from workers.socket_room import size_for_ranks

__all__ = ["KvEventsInfo", "ReferenceWorker"]


class KvEventsInfo(msgspec.Struct, frozen=True):
    """Where a worker's KV events are: its /server_info `kv_events` block, field for field
    what SGLang 0.5.23 advertises (`runtime_context.describe_kv_events_publisher`): the bind
    host (maybe a wildcard, which a subscriber replaces with the worker's host) and port bases,
    DP rank r on base + r. No load publisher, so no `load_endpoint_port_base`/`load_topic`.
    """

    publisher: str
    endpoint_host: str
    endpoint_port_base: int
    topic: str
    block_size: int
    dp_size: int
    replay_endpoint_port_base: int

    @property
    def endpoints(self) -> list[str]:
        """PUB endpoint of each DP rank, to connect to from this host."""
        return [f"tcp://{self._local_host}:{self.endpoint_port_base + r}" for r in self._ranks]

    @property
    def replay_endpoints(self) -> list[str]:
        """ROUTER replay endpoint of each DP rank, to connect to from this host."""
        base = self.replay_endpoint_port_base
        return [f"tcp://{self._local_host}:{base + r}" for r in self._ranks]

    @property
    def endpoint(self) -> str:
        """DP rank 0's PUB endpoint."""
        return self.endpoints[0]

    @property
    def replay_endpoint(self) -> str:
        """DP rank 0's replay endpoint."""
        return self.replay_endpoints[0]

    @property
    def _ranks(self) -> range:
        return range(self.dp_size)

    @property
    def _local_host(self) -> str:
        # a wildcard bind is reached on the loopback, as the worker's own host
        if self.endpoint_host in _WILDCARD_HOSTS:
            return "[::1]" if ":" in self.endpoint_host else "127.0.0.1"
        return self.endpoint_host


# ZMQ's bind-anywhere spellings (SGLang brackets IPv6 hosts in what it advertises)
_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]"})


def _advertised_host(host: str) -> str:
    """The bind host as SGLang advertises it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ReferenceWorker:
    """A reference SGLang worker: HTTP API, paged radix caches, KV-event streams."""

    def __init__(self, config: WorkerConfig | None = None) -> None:
        self.config = config or WorkerConfig()
        self.ranks: list[RankScheduler] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self._next_rank = itertools.count()
        self._url: str | None = None
        self._kv_events: KvEventsInfo | None = None
        # prefill/decode: the bootstrap server (prefill) or the KV fetches (decode)
        self.disagg = Disaggregation(self.config, self._held_tokens, self._release_hold)

    @property
    def url(self) -> str:
        """Base URL of the HTTP API (available once started)."""
        if self._url is None:
            raise WorkerError("the worker is not running")
        return self._url

    @property
    def kv_events(self) -> KvEventsInfo:
        """The KV-event endpoints (available once started)."""
        if self._kv_events is None:
            raise WorkerError("the worker is not running")
        return self._kv_events

    async def __aenter__(self) -> ReferenceWorker:
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _start(self) -> None:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        size_for_ranks(self._ctx, cfg.dp_size)
        host = cfg.events_host
        pubs, pub_base = bind_port_run(self._ctx, zmq.PUB, host, cfg.events_port, cfg.dp_size)
        replays, replay_base = bind_port_run(
            self._ctx, zmq.ROUTER, host, cfg.replay_port, cfg.dp_size
        )
        for rank in range(cfg.dp_size):
            publisher = EventPublisher(
                pub=pubs[rank],
                replay=replays[rank],
                topic=cfg.topic,
                layout=cfg.event_format,
                buffer_steps=cfg.buffer_steps,
                buffer_bytes=cfg.buffer_bytes,
                dp_rank=rank,
            )
            await self._stack.enter_async_context(publisher)
            cache = PagedRadixCache(
                page_size=cfg.page_size,
                capacity_tokens=cfg.capacity_tokens,
                host_capacity_tokens=cfg.host_capacity_tokens,
            )
            self.ranks.append(RankScheduler(cfg, rank, cache, publisher))
        self._kv_events = KvEventsInfo(
            publisher="zmq",
            endpoint_host=_advertised_host(host),
            endpoint_port_base=pub_base,
            topic=cfg.topic,
            block_size=cfg.page_size,
            dp_size=cfg.dp_size,
            replay_endpoint_port_base=replay_base,
        )
        for sched in self.ranks:
            self._tasks.append(asyncio.create_task(sched.run(), name=f"scheduler-{sched.rank}"))
        await self.disagg.start()
        self._runner = WorkerRunner(
            build_app(self), access_log=None, handle_signals=False, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        await bind_site(site, "HTTP port", cfg.port)
        port = self._runner.addresses[0][1]
        self._url = f"http://{cfg.host}:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.disagg.aclose()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self._stack.aclose()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        self._url = None

    # ----------------------------------------------------------------- used by the HTTP API

    def check_alive(self) -> None:
        """Raise if a scheduler task died (the worker is then unhealthy)."""
        for task in self._tasks:
            if task.done():
                raise WorkerError(f"{task.get_name()} stopped")

    def submit(self, generation: Generation) -> Job:
        """Queue one request on its DP rank: the one asked for, else on a prefill worker the
        bootstrap room's (`room_rank`), else round robin."""
        self.check_alive()  # a dead scheduler would never run it
        rank = generation.dp_rank
        if rank is None:
            rank = room_rank(self.config, generation)
        if rank is None:
            rank = next(self._next_rank) % len(self.ranks)
        elif not 0 <= rank < len(self.ranks):  # SGLang's tokenizer manager, word for word
            raise RequestError(f"routed_dp_rank={rank} out of range [0, {len(self.ranks)})")
        return self.ranks[rank].submit(generation)

    def cancel(self, job: Job) -> None:
        """Stop a request whose client went away."""
        self.ranks[job.rank].cancel(job)

    def flush_all(self) -> int:
        """Flush every rank's whole cache; refused unless every rank is idle (as SGLang).
        Returns the pages they held."""
        if not all(sched.idle and not sched.holding for sched in self.ranks):
            raise CacheBusyError("cache not flushed: requests are running or waiting")
        return sum(sched.flush() for sched in self.ranks)

    def flush_namespace(self, cache_salt: str | None) -> int:
        """Evict one salt's unreferenced pages on every rank (None: the unsalted ones)."""
        return sum(sched.flush_namespace(cache_salt) for sched in self.ranks)

    def match(self, namespace: Namespace, tokens: list[int]) -> list[int]:
        """Cached prefix length of `tokens` on each rank, with no side effect."""
        return [sched.cache.peek(namespace, tokens) for sched in self.ranks]

    def would_reuse(self, generation: Generation) -> list[int]:
        """The `cached_tokens` the request would report on each rank if admitted now (its
        reusable part of the prompt, matched), with no side effect."""
        return self.match(generation.namespace, generation.input_ids[: generation.reusable_tokens])

    def _held_tokens(self, generation: Generation) -> int:
        """Tokens of a decode's prompt its rank caches already (they need no transfer); 0 when
        the rank is not known yet (several ranks, none named)."""
        rank = generation.dp_rank if generation.dp_rank is not None else 0
        if (len(self.ranks) > 1 and generation.dp_rank is None) or not 0 <= rank < len(self.ranks):
            return 0
        return self.ranks[rank].cache.peek(generation.namespace, generation.input_ids[:-1])

    def _release_hold(self, job: Job) -> None:
        self.ranks[job.rank].release_hold(job)
