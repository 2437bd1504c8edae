"""Real nats-server (JetStream) and real routers on 127.0.0.1 for the replica tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.cluster.server import NatsServer
from router.config import ClusterConfig, IndexerSection, RouterConfig
from router.service import RouterService
from tests.router.conftest import AUTH, router_config
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
