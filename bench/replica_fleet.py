"""Routing through several router replicas: does sharing decisions keep one router's quality?

Two pseudo-policies of `kvroute bench routing`, each three `kv` replicas in front of the same
fresh fleet, every request sent to a replica chosen at random (a load balancer with no
affinity):

- `kv_replicas3`: the replicas share a real nats-server (started for the run): each applies
  the others' pending marks and load (`router.cluster`);
- `kv_replicas3_alone`: the same three replicas without a `[cluster]`: each knows only its own
  decisions, so a burst of siblings spread over them loses its pending marks at each hop;
- `kv_replicas3_one`: the control. Three sharing replicas as in `kv_replicas3`, but every
  request goes to the first one: the fleet sees one router's decisions, and the benchmark's
  process still carries three routers (their bookkeeping shares the event loop with the
  reference workers and the load driver). What it loses against `kv` is the cost of running
  three routers in the benchmark, not of spreading requests over them.

Compared with `kv` (one replica) in the same run, on the same workload and fleet.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec

from bench.harness import (
    FleetSpec,
    PolicyWeights,
    Target,
    _await_streams,
    _drive,
    _fleet,
    _probe_overhead,
)
from bench.routing_results import PolicyRun, RequestRecord
from bench.workloads import BenchRequest, Workload
from router.cluster.server import NatsServer
from router.config import AdminConfig, ClusterConfig, ListenConfig, PolicyConfig, RouterConfig
from router.config import WorkerConfig as RoutedWorker
from router.service import RouterService

__all__ = ["REPLICATED", "UNSPREAD", "run_replicated"]

REPLICAS = 3
# pseudo-policy -> whether its replicas share a cluster
REPLICATED = {"kv_replicas3": True, "kv_replicas3_alone": False, "kv_replicas3_one": True}
# the control: every request to the first replica (no spreading)
UNSPREAD = frozenset({"kv_replicas3_one"})


class _RandomReplica:
    """Each request to one of the replicas, uniformly at random (seeded)."""

    def __init__(self, urls: list[str], seed: int) -> None:
        self._targets = [Target(url=url) for url in urls]
        self._rng = random.Random(seed)

    async def choose(self, session: aiohttp.ClientSession, request: BenchRequest) -> Target:
        """A replica's URL."""
        return self._rng.choice(self._targets)

    def release(self, target: Target) -> None:
        """Nothing to track: the replicas keep their own load."""


@contextlib.asynccontextmanager
async def _replicas(
    urls: dict[str, str], spec: FleetSpec, seed: int, weights: PolicyWeights, shared: bool
) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        nats = await stack.enter_async_context(NatsServer()) if shared else None
        services = []
        for i in range(REPLICAS):
            cluster = (
                ClusterConfig(url=nats.url, replica_id=f"r{i}", snapshot_interval_s=0.0)
                if nats is not None
                else None
            )
            config = RouterConfig(
                listen=ListenConfig(host="127.0.0.1", port=0),
                admin=AdminConfig(enabled=False),
                policy=PolicyConfig(
                    name="kv",
                    seed=seed + i,
                    admission_batch_window_ms=spec.decode_step_ms,
                    decode_step_weight=spec.decode_step_weight,
                    **{k: v for k, v in msgspec.structs.asdict(weights).items() if v is not None},
                ),
                workers=tuple(RoutedWorker(url=url, id=name) for name, url in urls.items()),
                cluster=cluster,
            )
            service = await stack.enter_async_context(RouterService(config))
            await _await_streams(service, urls, spec.page_size, seed + i)
            services.append(service)
        yield [s.url for s in services]


async def run_replicated(
    policy: str,
    workload: Workload,
    spec: FleetSpec,
    seed: int,
    on_done: Callable[[RequestRecord], None],
    timeout_s: float,
    weights: PolicyWeights,
) -> PolicyRun:
    """Run `workload` through three replicas (sharing or not, spread over or not, by
    `policy`) on a fresh fleet."""
    started = time.perf_counter()
    async with (
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024), timeout=aiohttp.ClientTimeout(total=None)
        ) as session,
        _fleet(spec) as fleet,
    ):
        names = {name: worker.url for name, worker in fleet.items()}
        async with _replicas(names, spec, seed, weights, REPLICATED[policy]) as urls:
            chooser = _RandomReplica(urls[:1] if policy in UNSPREAD else urls, seed)
            records = await _drive(session, workload, chooser, timeout_s, on_done)
            overhead = await _probe_overhead(session, urls[0], names, seed)
    return PolicyRun(
        policy=policy,
        records=records,
        wall_s=time.perf_counter() - started,
        route_overhead_s=overhead,
    )
