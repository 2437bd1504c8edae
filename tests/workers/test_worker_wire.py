"""SGLang's scenario byte for byte: our cache's events through the real encoder and publisher."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from indexer.protocol import (
    EventBatch,
    ReplayData,
    ReplayEnd,
    build_replay_request,
    encode_batch,
    parse_replay_reply,
)
from workers.cache import Namespace, PagedRadixCache
from workers.publisher import EventPublisher, bind_port_run

T1 = Namespace(cache_salt="tenant-1")
T2 = Namespace(cache_salt="tenant-2")


def _operations(cache: PagedRadixCache, tokens: dict[str, list[int]]) -> list[Callable[[], object]]:
    a, b, c = tokens["A"], tokens["B"], tokens["C"]
    return [
        lambda: None,  # step 0: construction (its AllBlocksCleared is already recorded)
        lambda: cache.insert(T1, a),
        lambda: cache.insert(T1, a + b),
        lambda: cache.insert(T2, a),
        lambda: cache.insert(T1, a[:8]),
        lambda: cache.evict(8),
        lambda: cache.evict(4),
        lambda: cache.evict(4),
        cache.flush,
        lambda: cache.insert(T1, a),
        lambda: cache.insert(Namespace(), c),
    ]


def test_payloads_equal_sglang_bytes(scenario: Any) -> None:
    cache = PagedRadixCache(page_size=scenario["page_size"], capacity_tokens=1024)
    ops = _operations(cache, scenario["tokens"])
    for op, step in zip(ops, scenario["operations"], strict=True):
        op()
        events = cache.take_events()
        if not step["published"]:
            assert events == []
            continue
        expected = step["expected"]
        batch = EventBatch(ts=expected["ts"], events=events, dp_rank=expected["dp_rank"])
        assert encode_batch(batch, "map").hex() == step["frames"][2], step["op"]


async def test_publisher_replays_the_scenario_frames(scenario: Any) -> None:
    published = [s for s in scenario["operations"] if s["published"]]
    stamps = iter([s["expected"]["ts"] for s in published])
    ctx = zmq.asyncio.Context()
    try:
        (pub,), _ = bind_port_run(ctx, zmq.PUB, "127.0.0.1", 0, 1)
        (router,), _ = bind_port_run(ctx, zmq.ROUTER, "127.0.0.1", 0, 1)
        replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        publisher = EventPublisher(
            pub=pub,
            replay=router,
            topic=published[0]["expected"]["topic"],
            layout="map",
            buffer_steps=100,
            dp_rank=0,
            clock=lambda: next(stamps),
        )
        async with publisher:
            cache = PagedRadixCache(page_size=scenario["page_size"], capacity_tokens=1024)
            for op in _operations(cache, scenario["tokens"]):
                op()
                publisher.publish(cache.take_events())
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.connect(replay_endpoint)
            await dealer.send_multipart(build_replay_request(0))
            frames: list[list[str]] = []
            while True:
                assert await dealer.poll(5000)
                raw = await dealer.recv_multipart()
                reply = parse_replay_reply(raw)
                if isinstance(reply, ReplayEnd):
                    assert [f.hex() for f in raw] == ["", "", "ffffffffffffffff", ""]
                    break
                assert isinstance(reply, ReplayData)
                frames.append([f.hex() for f in raw[1:]])
            dealer.close()
        assert frames == [s["frames"] for s in published]
    finally:
        ctx.destroy(linger=0)


def test_array_layout_keeps_seven_slots_unsalted_and_eight_salted() -> None:
    import msgspec

    cache = PagedRadixCache(page_size=2, capacity_tokens=64)
    cache.take_events()
    cache.insert(Namespace(extra_key="not-on-the-wire"), [1, 2, 3, 4])
    cache.insert(T1, [1, 2, 3, 4])
    payload = encode_batch(EventBatch(ts=1.0, events=cache.take_events(), dp_rank=0), "array")
    unsalted, salted = msgspec.msgpack.decode(payload)[1]
    assert len(unsalted) == 7 and unsalted[0] == "BlockStored" and unsalted[6] == "GPU"
    assert len(salted) == 8 and salted[7] == {"cache_salt": "tenant-1"}
    assert unsalted[1] != salted[1]  # the salt seeds a different chain
