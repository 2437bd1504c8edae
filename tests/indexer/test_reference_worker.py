"""Integration with a real reference worker: the index agrees with the worker's own caches.

One reference worker with two dp ranks and a small KV pool (so pages get evicted) serves salted
and unsalted requests over HTTP; its real publisher streams the events over ZMQ. Once the
indexer has applied every published batch, for every prompt and every namespace the number of
leading blocks the index says each rank holds equals what that rank's radix cache reports,
and no salt's prefix is ever credited to another namespace.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp

from indexer.config import StreamConfig
from indexer.namespace import Namespace
from indexer.service import IndexerService, stream_id
from workers.cache import Namespace as CacheNamespace
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

MODEL = "m"
SALTS = [None, "tenant-a", "tenant-b"]


async def test_index_matches_the_reference_workers_caches() -> None:
    seed = random.randrange(1 << 30)
    print(f"reference worker seed={seed}")
    rng = random.Random(seed)
    config = WorkerConfig(dp_size=2, time_scale=0.0, capacity_tokens=384, event_format="map")
    async with ReferenceWorker(config) as worker, IndexerService() as service:
        kv = worker.kv_events
        await service.add_worker(
            "w",
            [
                StreamConfig(
                    endpoint=endpoint,
                    replay_endpoint=replay,
                    topic=kv.topic,
                    block_size=kv.block_size,
                    dp_rank=rank,
                    model=MODEL,
                )
                for rank, (endpoint, replay) in enumerate(
                    zip(kv.endpoints, kv.replay_endpoints, strict=True)
                )
            ],
        )
        systems = [[rng.randrange(3, 259) for _ in range(64)] for _ in range(2)]
        prompts: list[list[int]] = []
        async with aiohttp.ClientSession() as session:
            for i in range(24):
                tokens = systems[i % 2] + [
                    rng.randrange(3, 259) for _ in range(rng.choice([8, 40, 72]))
                ]
                prompts.append(tokens)
                body = {
                    "input_ids": tokens,
                    "sampling_params": {"max_new_tokens": 1},
                    "cache_salt": SALTS[i % 3],
                }
                async with session.post(f"{worker.url}/generate", json=body) as response:
                    assert response.status == 200, await response.text()
        want = {stream_id("w", s.rank): s.publisher.next_seq - 1 for s in worker.ranks}
        async with asyncio.timeout(10.0):
            # no event says "caught up with every rank": poll the streams' applied seqs
            while {s.stream: s.last_seq for s in service.streams()} != want:  # noqa: ASYNC110
                await asyncio.sleep(0.01)

        checked = 0
        for tokens in prompts:
            for salt in SALTS:
                held = worker.match(CacheNamespace(cache_salt=salt), tokens)
                per_stream = service.index.query(Namespace(MODEL, None, salt), tokens)
                for rank, cached in enumerate(held):
                    blocks = per_stream[stream_id("w", rank)].blocks
                    assert blocks * kv.block_size == cached // kv.block_size * kv.block_size, (
                        salt,
                        rank,
                    )
                    checked += blocks
                best = service.query(Namespace(MODEL, None, salt), tokens)["w"]
                assert best.matched_tokens == max(held) // kv.block_size * kv.block_size
        assert checked > 0  # the comparison was not trivially all zeros
        stats = {s.stream: s for s in service.streams()}
        assert all(s.block_size_mismatches == 0 and s.decode_errors == 0 for s in stats.values())
        assert sum(s.blocks_removed for s in stats.values()) > 0  # the pool did evict
