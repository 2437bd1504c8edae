"""Real nats-server (JetStream) and real routers on 127.0.0.1 for the replica tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.cluster.server import NatsServer
from router.config import ClusterConfig, IndexerSection, RouterConfig
from router.service import RouterService
from tests.router.conftest import AUTH, Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


@pytest.fixture
async def nats_server() -> AsyncIterator[NatsServer]:
    """A nats-server with JetStream on a free loopback port, its store in a temp dir."""
    async with NatsServer() as server:
        yield server


def cluster(url: str, **overrides: Any) -> ClusterConfig:
    """Fast heartbeats, so failures show within a test's patience."""
    fields: dict[str, Any] = {
        "url": url,
        "heartbeat_interval_s": 0.1,
        "heartbeat_timeout_s": 0.5,
        "startup_timeout_s": 5.0,
        "snapshot_interval_s": 0.0,
    }
    fields.update(overrides)
    return ClusterConfig(**fields)


def replica_config(
    workers: list[tuple[str, str]], nats_url: str, name: str, **overrides: Any
) -> RouterConfig:
    """A router replica in front of (id, url) workers, on a free port, in the cluster."""
    fields: dict[str, Any] = {
        "cluster": cluster(nats_url, replica_id=name),
        # pending marks long enough to be seen across replicas on a loaded test machine
        "indexer": IndexerSection(pending_ttl_s=5.0),
    }
    fields.update(overrides)
    return router_config(workers, **fields)


@contextlib.asynccontextmanager
async def workers(n: int, **options: Any) -> AsyncIterator[list[ReferenceWorker]]:
    """`n` reference workers (no simulated latency unless `options` say otherwise)."""
    cfg = ReferenceConfig(**{"time_scale": 0.0, "page_size": 16, **options})
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(ReferenceWorker(cfg)) for _ in range(n)]


async def admin(
    session: aiohttp.ClientSession,
    router: RouterService,
    method: str,
    path: str,
    body: object = None,
) -> tuple[int, Any]:
    """One admin API call on `router`."""
    async with session.request(
        method, router.url + "/admin" + path, json=body, headers=AUTH
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def health(session: aiohttp.ClientSession, router: RouterService) -> tuple[int, Any]:
    """GET /health."""
    async with session.get(router.url + "/health") as resp:
        return resp.status, await resp.json()


class CuttableLink:
    """A TCP relay on a free loopback port to `port`, which a test cuts and restores: one
    replica loses NATS while the others keep it (a partition no nats-server stop can make).
    `held`: what either side sends waits in the link until it is cleared (one replica's link
    hung a moment, its connection open)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pairs: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    @property
    def held(self) -> bool:
        return not self._flowing.is_set()

    @held.setter
    def held(self, held: bool) -> None:
        if held:
            self._flowing.clear()
        else:
            self._flowing.set()

    @property
    def url(self) -> str:
        """The NATS URL through the link."""
        return f"nats://127.0.0.1:{self.port}"

    async def open(self) -> None:
        """Listen (again, on the same port once it has one) and relay."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Stop listening and close every relayed connection, both ends."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._pairs):
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._pairs |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    await self._flowing.wait()
                    dst.write(data)
                    await dst.drain()
            dst.close()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            self._pairs -= {writer, up_writer}

    async def __aenter__(self) -> CuttableLink:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            await self.cut()


async def extra_key_snapshot(fleet: Fleet, plain: dict[str, Any]) -> dict[str, Any]:
    """Through `fleet`'s replica (its worker `w0`): `plain` (a prompt of 20 pages of 16
    tokens and one more) sent with an `extra_key`, then under another salt; once the index holds
    the other salt's pages and hides the extra_key's from `plain`, the replica publishes its
    snapshot. Returns the other salt's body."""
    await fleet.warm()
    other = {**plain, "cache_salt": "tenant-y"}
    for body in ({**plain, "extra_key": "view-1"}, other):
        body = {**body, "sampling_params": {"max_new_tokens": 1}}
        async with fleet.session.post(fleet.url + "/generate", json=body) as resp:
            assert resp.status == 200
    await eventually(lambda: fleet.holds(other, "w0", 320), what="the pages indexed")
    assert not await fleet.holds(plain, "w0", 16)
    assert fleet.router.cluster is not None
    assert await fleet.router.cluster.publish_snapshot() > 0
    return other
