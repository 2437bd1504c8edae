"""The affinity probe through real routers in front of real reference workers."""

from __future__ import annotations

import aiohttp

from bench.affinity import probe_affinity
from router.config import AdminConfig, ListenConfig, PolicyConfig, PolicyName, RouterConfig
from router.config import WorkerConfig as RoutedWorker
from router.service import RouterService
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker


def _worker() -> WorkerConfig:
    return WorkerConfig(page_size=16, capacity_tokens=65_536, prefill_ms_per_token=0.0,
                        decode_ms_per_token=0.0, time_scale=0.0)  # fmt: skip


async def _probe(policy: PolicyName) -> tuple[int, int, int]:
    async with ReferenceWorker(_worker()) as w0, ReferenceWorker(_worker()) as w1:
        config = RouterConfig(
            listen=ListenConfig(host="127.0.0.1", port=0),
            admin=AdminConfig(enabled=False),
            policy=PolicyConfig(name=policy),
            workers=(RoutedWorker(url=w0.url, id="w0"), RoutedWorker(url=w1.url, id="w1")),
        )
        async with RouterService(config) as service, aiohttp.ClientSession() as session:
            probe = await probe_affinity(session, service.url, seed=5, prompts=3, rounds=3)
    assert probe.errors == 0, probe.error
    return probe.repeats, probe.kept, probe.errors


async def test_a_cache_aware_router_keeps_every_repeat_on_its_worker() -> None:
    assert await _probe("approx_tree") == (6, 6, 0)


async def test_a_router_blind_to_the_cache_keeps_only_the_repeats_chance_brings_back() -> None:
    # three prompts over two workers in turn: the second round lands each on the other worker
    # (nothing kept), the third on its first worker again (all kept)
    assert await _probe("round_robin") == (6, 3, 0)
