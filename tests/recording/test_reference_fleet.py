"""Acceptance with reference workers: record a live fleet under a scripted workload, replay the
file offline, and get exactly the index the live indexer built (compared as dumps)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp

from indexer.config import StreamConfig
from indexer.recording.format import Source
from indexer.recording.replay import replay_into_index
from indexer.service import IndexerService, stream_id
from indexer.snapshot import dump_index
from router.commands.record import record
from tests.recording.snapshots import CountingWriter, canonical
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker


def _streams(worker: ReferenceWorker) -> list[StreamConfig]:
    kv = worker.kv_events
    return [
        StreamConfig(
            endpoint=endpoint,
            replay_endpoint=replay,
            topic=kv.topic,
            block_size=kv.block_size,
            dp_rank=rank,
            model="m",
        )
        for rank, (endpoint, replay) in enumerate(
            zip(kv.endpoints, kv.replay_endpoints, strict=True)
        )
    ]


async def _workload(urls: list[str], seed: int) -> None:
    """Salted tenants sharing system prompts, growing conversations, under cache pressure."""
    rng = random.Random(seed)
    system = [[rng.randrange(3, 259) for _ in range(96)] for _ in range(2)]
    async with aiohttp.ClientSession() as session:
        for turn in range(1, 4):
            for conv in range(10):
                tenant = conv % 4
                convo = random.Random(conv).choices(range(3, 259), k=48 * turn)
                body = {
                    "input_ids": system[tenant % 2] + convo,
                    "sampling_params": {"max_new_tokens": 2},
                    "cache_salt": f"tenant-{tenant}" if tenant else None,
                }
                url = urls[(conv + turn) % len(urls)]
                async with session.post(f"{url}/generate", json=body) as response:
                    assert response.status == 200, await response.text()


async def test_recorded_reference_fleet_replays_to_the_live_index(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    print("seed", seed)
    w0 = ReferenceWorker(WorkerConfig(dp_size=2, time_scale=0.0, capacity_tokens=1024))
    w1 = ReferenceWorker(
        WorkerConfig(event_format="map", topic="kv", time_scale=0.0, capacity_tokens=1024)
    )
    path = tmp_path / "fleet.kvrec"
    async with w0, w1, IndexerService() as service:
        fleet = {"w0": w0, "w1": w1}
        sources = [
            Source(
                stream=stream_id(name, s.dp_rank),
                endpoint=s.endpoint,
                replay_endpoint=s.replay_endpoint,
                topic=s.topic,
                block_size=s.block_size,
                dp_rank=s.dp_rank,
                model="m",
                worker=name,
            )
            for name, w in fleet.items()
            for s in _streams(w)
        ]
        for name, w in fleet.items():
            await service.add_worker(name, _streams(w))
        writer = CountingWriter.create(path, sources)
        writer.reached = asyncio.Event()
        writer.target = 1 << 60
        stop = asyncio.Event()
        recorder = asyncio.create_task(record(writer, sources, stop=stop))
        await _workload([w0.url, w1.url], seed)
        published = {
            stream_id(name, sched.rank): sched.publisher.next_seq
            for name, w in fleet.items()
            for sched in w.ranks
        }
        assert all(n > 0 for n in published.values()), published
        writer.target = sum(published.values())
        if writer.records >= writer.target:
            writer.reached.set()
        async with asyncio.timeout(20.0):
            await writer.reached.wait()
        want = {stream: n - 1 for stream, n in published.items()}
        # wait_applied is per worker; the dp ranks of w0 end at different seqs
        for _ in range(1000):
            if {s.stream: s.last_seq for s in service.streams()} == want:
                break
            await asyncio.sleep(0.02)
        assert {s.stream: s.last_seq for s in service.streams()} == want
        live = service.dump()
        stop.set()
        await recorder
    summary, index = replay_into_index(path)
    assert summary.damage is None and summary.decode_errors == 0
    assert summary.blocks_removed > 0  # the workload ran under cache pressure
    assert len(summary.namespaces) >= 3  # salted tenants are separate namespaces
    assert canonical(dump_index(index)) == canonical(live)
    assert canonical(live)
