"""The publisher's transport: live frames, the bounded replay buffer, DP port runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from indexer.protocol import (
    Cleared,
    Event,
    Removed,
    ReplayEnd,
    Stored,
    build_replay_request,
    decode_batch,
    parse_live,
    parse_replay_reply,
)
from workers.errors import PortRangeError
from workers.publisher import EventPublisher, bind_port_run


def _event(expected: dict[str, Any]) -> Event:
    if expected["type"] == "BlockStored":
        return Stored(
            block_hashes=expected["block_hashes"],
            parent=expected["parent_block_hash"],
            token_ids=expected["token_ids"],
            block_size=expected["block_size"],
            lora_id=expected["lora_id"],
            medium=expected["medium"],
            cache_salt=expected["cache_salt"],
        )
    if expected["type"] == "BlockRemoved":
        return Removed(block_hashes=expected["block_hashes"], medium=expected["medium"])
    return Cleared()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def _replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart(build_replay_request(start))
        replies = []
        for _ in range(10_000):
            assert await dealer.poll(5000), "no replay reply within 5 s"
            raw = await dealer.recv_multipart()
            replies.append(raw)
            if isinstance(parse_replay_reply(raw), ReplayEnd):
                return replies
        raise AssertionError("no end marker")
    finally:
        dealer.close()


def _publisher(
    ctx: zmq.asyncio.Context,
    topic: str,
    buffer_steps: int,
    clock: Callable[[], float] | None = None,
) -> tuple[EventPublisher, str, str]:
    (pub,), pub_port = bind_port_run(ctx, zmq.PUB, "127.0.0.1", 0, 1)
    (router,), replay_port = bind_port_run(ctx, zmq.ROUTER, "127.0.0.1", 0, 1)
    publisher = EventPublisher(
        pub=pub,
        replay=router,
        topic=topic,
        layout="map",
        buffer_steps=buffer_steps,
        dp_rank=0,
        clock=clock or time.time,
    )
    return publisher, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"


@pytest.mark.parametrize("name", ["sglang-0.5.23-replay-gap.json", "sglang-0.5.23-replay.json"])
async def test_replay_equals_sglang_capture(
    ctx: zmq.asyncio.Context, kv_fixture: Callable[[str], Any], name: str
) -> None:
    fixture = kv_fixture(name)
    expected = fixture["expected"]
    by_seq = {b["seq"]: b for b in expected["batches"]}
    topic = expected["batches"][0]["topic"]
    # batches before the replayed ones are not in the capture: any content will do for them
    skipped = fixture["published_batches"] - len(by_seq)
    stamps = iter([0.0] * skipped + [by_seq[s]["ts"] for s in sorted(by_seq)])
    publisher, _, replay = _publisher(
        ctx, topic, fixture["buffer_steps"], clock=lambda: next(stamps)
    )
    async with publisher:
        for seq in range(fixture["published_batches"]):
            batch = by_seq.get(seq)
            events: list[Event] = [_event(e) for e in batch["events"]] if batch else [Cleared()]
            assert publisher.publish(events) == seq
        replies = await _replay(ctx, replay, fixture["request"]["start_seq"])
    assert [[f.hex() for f in r] for r in replies] == fixture["replies"]


async def test_live_frames_and_replay_of_a_suffix(ctx: zmq.asyncio.Context) -> None:
    publisher, live, replay = _publisher(ctx, "kv@x", buffer_steps=4)
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.subscribe(b"kv@")
    sub.connect(live)
    async with publisher:
        assert publisher.publish([]) is None  # nothing to say: nothing sent, no seq used
        # PUB/SUB joins late: publish until the SUB sees a batch, then count from there
        first = None
        for _ in range(200):
            publisher.publish([Cleared()])
            if await sub.poll(20):
                first = parse_live(await sub.recv_multipart()).seq
                break
        assert first is not None
        for _ in range(5):  # more than the buffer holds, so a replay from 0 has a gap
            publisher.publish([Cleared()])
        while await sub.poll(20):
            await sub.recv_multipart()
        seq = publisher.publish([Removed(block_hashes=[-5, 2**63 - 1], medium="GPU")])
        msg = parse_live(await sub.recv_multipart())
        assert (msg.topic, msg.seq) == (b"kv@x", seq)
        assert decode_batch(msg.payload).events == [
            Removed(block_hashes=[-5, 2**63 - 1], medium="GPU")
        ]
        assert seq is not None
        replies = await _replay(ctx, replay, seq - 1)
        assert [parse_replay_reply(r).seq for r in replies[:-1]] == [seq - 1, seq]  # type: ignore[union-attr]
        # past the newest: only the end marker; older than the buffer: starts later (a gap)
        assert len(await _replay(ctx, replay, seq + 1)) == 1
        oldest = parse_replay_reply((await _replay(ctx, replay, 0))[0])
        assert oldest.seq == seq - 3  # type: ignore[union-attr]
    sub.close()


async def test_malformed_replay_requests_are_ignored(ctx: zmq.asyncio.Context) -> None:
    publisher, _, replay = _publisher(ctx, "", buffer_steps=4)
    async with publisher:
        publisher.publish([Cleared()])
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(replay)
        # one connection keeps order: the good request is served after both bad ones
        await dealer.send_multipart([b"", b"\x01\x02"])
        await dealer.send_multipart([b"junk"])
        await dealer.send_multipart(build_replay_request(0))
        replies: list[list[bytes]] = []
        while not replies or not isinstance(parse_replay_reply(replies[-1]), ReplayEnd):
            assert await dealer.poll(5000)
            replies.append(await dealer.recv_multipart())
        dealer.close()
        assert len(replies) == 2
        assert publisher.bad_replay_requests == 2


def test_dp_ranks_get_consecutive_ports(ctx: zmq.asyncio.Context) -> None:
    sockets, base = bind_port_run(ctx, zmq.PUB, "127.0.0.1", 0, 3)
    try:
        ports = [int(s.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]) for s in sockets]
        assert ports == [base, base + 1, base + 2]
        with pytest.raises(PortRangeError):
            bind_port_run(ctx, zmq.PUB, "127.0.0.1", base + 1, 1)
    finally:
        for s in sockets:
            s.close()


def test_a_port_clash_names_the_port_and_not_a_sum(ctx: zmq.asyncio.Context) -> None:
    sockets, base = bind_port_run(ctx, zmq.PUB, "127.0.0.1", 0, 2)
    try:
        # one port: just that port (it read `tcp://127.0.0.1:P+1`, as if P + 1 were taken)
        with pytest.raises(PortRangeError) as one:
            bind_port_run(ctx, zmq.PUB, "127.0.0.1", base + 1, 1)
        assert str(one.value).startswith(f"cannot bind tcp://127.0.0.1:{base + 1}: "), one.value
        assert "+" not in str(one.value)
        # a run: the port that failed, and which rank of how many from where
        with pytest.raises(PortRangeError) as run:
            bind_port_run(ctx, zmq.PUB, "127.0.0.1", base, 3)
        assert str(run.value).startswith(
            f"cannot bind tcp://127.0.0.1:{base} (DP rank 0; the 3 ranks take consecutive "
            f"ports from {base}): "
        ), run.value
    finally:
        for s in sockets:
            s.close()


def _small_buffered_router(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, str]:
    """A replay ROUTER with a tiny kernel send buffer, so a slow reader fills its pipe fast."""
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.sndbuf = 4096
    router.sndhwm = 16
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


def _slow_dealer(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvhwm = 1
    dealer.rcvbuf = 4096
    dealer.connect(endpoint)
    return dealer


async def test_a_slow_replay_reader_gets_every_batch_and_the_end(
    ctx: zmq.asyncio.Context,
) -> None:
    (pub,), _ = bind_port_run(ctx, zmq.PUB, "127.0.0.1", 0, 1)
    router, endpoint = _small_buffered_router(ctx)
    publisher = EventPublisher(
        pub=pub, replay=router, topic="kv", layout="array", buffer_steps=500, dp_rank=0
    )
    page: list[int | tuple[int, int]] = list(
        range(1000, 1512)
    )  # ~1.5 kB a batch: far more than the pipes hold
    async with publisher:
        for _ in range(500):
            publisher.publish(
                [Stored(block_hashes=[1], parent=None, token_ids=page, block_size=512)]
            )
        dealer = _slow_dealer(ctx, endpoint)
        await dealer.send_multipart(build_replay_request(0))
        assert await dealer.poll(5000)  # the replay is under way
        # A slow reader: meanwhile a plain ROUTER would drop most replies and the end marker.
        await asyncio.sleep(0.2)
        seqs: list[int] = []
        while True:
            assert await dealer.poll(5000), f"replay stopped after {len(seqs)} batches"
            reply = parse_replay_reply(await dealer.recv_multipart())
            if isinstance(reply, ReplayEnd):
                break
            seqs.append(reply.seq)
        dealer.close()
    assert seqs == list(range(500))
    assert publisher.abandoned_replays == 0


async def test_a_stalled_replay_reader_does_not_block_the_others(
    ctx: zmq.asyncio.Context,
) -> None:
    (pub,), _ = bind_port_run(ctx, zmq.PUB, "127.0.0.1", 0, 1)
    router, endpoint = _small_buffered_router(ctx)
    publisher = EventPublisher(
        pub=pub,
        replay=router,
        topic="kv",
        layout="array",
        buffer_steps=500,
        dp_rank=0,
        replay_stall_s=0.2,
    )
    page: list[int | tuple[int, int]] = list(range(1000, 1512))
    async with publisher:
        for _ in range(500):
            publisher.publish(
                [Stored(block_hashes=[1], parent=None, token_ids=page, block_size=512)]
            )
        stalled = _slow_dealer(ctx, endpoint)
        await stalled.send_multipart(build_replay_request(0))  # and never reads
        async with asyncio.timeout(10):
            while True:  # no event to wait on: poll the counter, under a deadline
                if publisher.abandoned_replays:
                    break
                await asyncio.sleep(0.02)
        replies = await _replay(ctx, endpoint, 499)
        assert [parse_replay_reply(r).seq for r in replies[:-1]] == [499]  # type: ignore[union-attr]
        stalled.close()
