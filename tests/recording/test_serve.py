"""Acceptance: `kvroute replay --publish` into a running router (`RouterService`, what
`kvroute serve` runs) reproduces the offline index, read back through GET /admin/index/dump."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from bench.synthetic_recording import SyntheticWorkload, synthesize_recording
from indexer.recording.format import RecordingReader
from indexer.recording.replay import replay_into_index
from indexer.recording.republish import FaultPlan, RepublishConfig, Republisher
from indexer.snapshot import dump_index
from router.config import ListenConfig, RouterConfig, WorkerConfig
from router.service import RouterService
from tests.recording.snapshots import canonical


async def test_publish_into_a_running_router(tmp_path: Path) -> None:
    path = tmp_path / "fleet.kvrec"
    workload = SyntheticWorkload(streams=2, tenants=4, conversations=20, capacity_pages=64, seed=9)
    synthesize_recording(path, workload)
    with RecordingReader(path) as reader:
        records = [p.record for p in reader]
        sources = list(reader.sources.values())
    _, expected = replay_into_index(path)
    want = canonical(dump_index(expected))
    config = RepublishConfig(speed=None, faults=FaultPlan(drop=0.05, dup=0.05, seed=2))
    async with Republisher(sources, config) as rep:
        workers = tuple(
            WorkerConfig(
                # no HTTP backend is needed to index events (nothing listens on port 9; a
                # host of its own each: one server listed twice would be refused)
                url=f"http://127.0.0.{2 + i}:9",
                id=s.worker,
                events=pub.endpoint,
                replay=pub.replay_endpoint,
                block_size=s.block_size,
                topic=s.topic,
                model=s.model,
            )
            for i, (s, pub) in enumerate(zip(sources, rep.streams, strict=True))
        )
        router_config = RouterConfig(listen=ListenConfig(port=0), workers=workers)
        async with RouterService(router_config) as router, aiohttp.ClientSession() as http:
            assert await rep.wait_subscribed(20.0)
            await rep.run(records)
            got: dict[str, Any] = {}
            for _ in range(500):  # until the router's index settles on the offline one
                async with http.get(f"{router.url}/admin/index/dump") as response:
                    assert response.status == 200
                    got = canonical(await response.read())
                if got == want:
                    break
                await asyncio.sleep(0.02)
            assert got == want and want
