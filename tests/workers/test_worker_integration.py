"""A real in-process worker: real HTTP, a real ZMQ SUB for live events, a DEALER for replay."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from indexer.protocol import (
    Cleared,
    EventBatch,
    Removed,
    ReplayData,
    ReplayEnd,
    Stored,
    build_replay_request,
    decode_batch,
    parse_live,
    parse_replay_reply,
)
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

PAGE = 4
TOPIC = "kv@test-worker"


@pytest.fixture
async def worker() -> AsyncIterator[ReferenceWorker]:
    config = WorkerConfig(page_size=PAGE, capacity_tokens=4096, time_scale=0, topic=TOPIC)
    async with ReferenceWorker(config) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class Subscriber:
    """A SUB socket that is known to be subscribed (it has received a flush's batch)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.linger = 0
        self.sock.subscribe(TOPIC[:3].encode())  # a prefix, as real consumers subscribe
        self.sock.connect(endpoint)

    async def sync(self, http: aiohttp.ClientSession, url: str) -> int:
        """Flush until a batch arrives (PUB/SUB joins late); returns the seq seen."""
        for _ in range(200):
            async with http.post(f"{url}/flush_cache") as resp:
                assert resp.status == 200
            if await self.sock.poll(50):
                seq = parse_live(await self.sock.recv_multipart()).seq
                while await self.sock.poll(0):  # drain other flushes' batches
                    seq = parse_live(await self.sock.recv_multipart()).seq
                return seq
        raise AssertionError("the SUB socket never received a batch")

    async def batches_until(
        self, predicate: object, limit: int = 50
    ) -> list[tuple[int, EventBatch]]:
        """Receive batches until one satisfies `predicate` (bounded)."""
        got: list[tuple[int, EventBatch]] = []
        for _ in range(limit):
            assert await self.sock.poll(5000), "no batch within 5 s"
            msg = parse_live(await self.sock.recv_multipart())
            assert msg.topic == TOPIC.encode()
            batch = decode_batch(msg.payload)
            got.append((msg.seq, batch))
            if callable(predicate) and predicate(batch):
                return got
        raise AssertionError("predicate never satisfied")


async def _generate(http: aiohttp.ClientSession, url: str, **body: object) -> dict[str, object]:
    async with http.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        result = await resp.json()
    assert isinstance(result, dict)
    return result


async def test_events_cached_tokens_and_replay(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    ctx = zmq.asyncio.Context()
    try:
        sub = Subscriber(ctx, worker.kv_events.endpoint)
        synced_seq = await sub.sync(http, worker.url)
        prompt = "a shared system prompt of some length, then the question"  # 56 bytes
        first = await _generate(
            http,
            worker.url,
            text=prompt,
            cache_salt="tenant-a",
            sampling_params={"max_new_tokens": 3},
        )
        meta = first["meta_info"]
        assert isinstance(meta, dict)
        assert meta["cached_tokens"] == 0
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["completion_tokens"] == 3
        got = await sub.batches_until(lambda b: any(isinstance(e, Stored) for e in b.events))
        stored = [e for _, b in got for e in b.events if isinstance(e, Stored)]
        assert stored[0].cache_salt == "tenant-a"
        assert stored[0].token_ids[:PAGE] == [ord(c) + 3 for c in prompt[:PAGE]]
        assert stored[0].medium == "GPU"

        again = await _generate(
            http,
            worker.url,
            text=prompt,
            cache_salt="tenant-a",
            sampling_params={"max_new_tokens": 3},
        )
        assert again["text"] == first["text"]
        assert again["meta_info"]["cached_tokens"] == (len(prompt) - 1) // PAGE * PAGE  # type: ignore[index]
        other = await _generate(
            http,
            worker.url,
            text=prompt,
            cache_salt="tenant-b",
            sampling_params={"max_new_tokens": 3},
        )
        assert other["meta_info"]["cached_tokens"] == 0  # type: ignore[index]
        unsalted = await _generate(
            http, worker.url, text=prompt, sampling_params={"max_new_tokens": 1}
        )
        assert unsalted["meta_info"]["cached_tokens"] == 0  # type: ignore[index]

        async with http.post(
            f"{worker.url}/debug/match", json={"text": prompt, "cache_salt": "tenant-a"}
        ) as resp:
            match = await resp.json()
        assert match["held_tokens"] == len(prompt) // PAGE * PAGE

        # replay everything from seq 0: the startup AllBlocksCleared first, then all batches
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(worker.kv_events.replay_endpoint)
        await dealer.send_multipart(build_replay_request(0))
        replies: list[ReplayData] = []
        for _ in range(1000):
            assert await dealer.poll(5000)
            reply = parse_replay_reply(await dealer.recv_multipart())
            if isinstance(reply, ReplayEnd):
                break
            replies.append(reply)
        seqs = [r.seq for r in replies]
        assert seqs == list(range(len(seqs)))
        assert seqs[-1] > synced_seq
        assert all(r.topic == TOPIC.encode() for r in replies)
        assert decode_batch(replies[0].payload).events == [Cleared()]
        salts = {
            e.cache_salt
            for r in replies
            for e in decode_batch(r.payload).events
            if isinstance(e, Stored)
        }
        assert salts == {"tenant-a", "tenant-b", None}
        dealer.close()
        sub.sock.close()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    "body",
    [
        {"text": "hi", "cache_salt": 7},
        {"text": "hi", "cache_salt": ["a"]},
        {"text": "hi", "extra_key": {"x": 1}},
        {"text": ["a", "b"], "cache_salt": ["a"]},
        {"text": ["a", "b"], "cache_salt": ["a", 3]},
    ],
)
async def test_non_string_salt_is_a_400_naming_the_field(
    worker: ReferenceWorker, http: aiohttp.ClientSession, body: dict[str, object]
) -> None:
    async with http.post(f"{worker.url}/generate", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    field = "extra_key" if "extra_key" in body else "cache_salt"
    assert field in error["message"]
    assert error["type"]
    assert all(sched.idle and sched.completed == 0 for sched in worker.ranks)


async def test_batch_takes_one_salt_per_item(
    worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    prompt = "batched prompts share nothing across salts"
    body = {
        "text": [prompt, prompt],
        "cache_salt": ["s1", "s2"],
        "sampling_params": {"max_new_tokens": 1},
    }
    async with http.post(f"{worker.url}/generate", json=body) as resp:
        assert resp.status == 200
        results = await resp.json()
    assert len(results) == 2
    for salt in ("s1", "s2"):
        again = await _generate(
            http, worker.url, text=prompt, cache_salt=salt, sampling_params={"max_new_tokens": 1}
        )
        assert again["meta_info"]["cached_tokens"] > 0  # type: ignore[index]
    none = await _generate(
        http, worker.url, text=prompt, cache_salt="s3", sampling_params={"max_new_tokens": 1}
    )
    assert none["meta_info"]["cached_tokens"] == 0  # type: ignore[index]


async def test_replayed_events_reproduce_the_worker_cache_under_pressure(
    http: aiohttp.ClientSession, event_consumer: Any
) -> None:
    """Random traffic over several salts on a tiny pool: the events alone rebuild each cache."""
    seed = 4242
    print(f"seed={seed}")
    rng = random.Random(seed)
    config = WorkerConfig(
        page_size=PAGE, capacity_tokens=160, dp_size=2, max_running_requests=3, time_scale=0
    )
    stems = [[rng.randint(3, 258) for _ in range(12)] for _ in range(4)]
    ctx = zmq.asyncio.Context()
    try:
        async with ReferenceWorker(config) as worker:

            async def one() -> None:
                prompt = rng.choice(stems) + [rng.randint(3, 9) for _ in range(rng.randint(1, 14))]
                body = {
                    "input_ids": prompt,
                    "cache_salt": rng.choice(["", "s1", "s2"]),
                    "sampling_params": {"max_new_tokens": rng.randint(1, 6)},
                }
                async with http.post(f"{worker.url}/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()

            for _ in range(15):
                await asyncio.gather(*(one() for _ in range(4)))
            # a namespace flush in the middle of the stream
            async with http.post(f"{worker.url}/flush_cache", json={"cache_salt": "s1"}) as resp:
                assert resp.status == 200, await resp.text()
            await asyncio.gather(*(one() for _ in range(4)))
            removed = 0
            for rank, endpoint in enumerate(worker.kv_events.replay_endpoints):
                consumer = event_consumer()
                dealer = ctx.socket(zmq.DEALER)
                dealer.linger = 0
                dealer.connect(endpoint)
                await dealer.send_multipart(build_replay_request(0))
                while True:
                    assert await dealer.poll(5000)
                    reply = parse_replay_reply(await dealer.recv_multipart())
                    if isinstance(reply, ReplayEnd):
                        break
                    events = decode_batch(reply.payload).events
                    removed += sum(isinstance(e, Removed) for e in events)
                    consumer.apply(events)
                dealer.close()
                cache = worker.ranks[rank].cache
                expected = {(ns.cache_salt, t) for ns, t in cache.cached_pages()}
                assert consumer.prefixes() == expected
                stats = cache.stats()
                assert stats.tree_pages <= stats.total_pages
                assert (stats.reserved_pages, stats.protected_pages) == (0, 0)
            assert removed > 0  # the pool was under pressure
    finally:
        ctx.destroy(linger=0)
