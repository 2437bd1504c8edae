"""The republisher on real ZMQ sockets: exact bytes, pacing, and each injected fault."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
import zmq
import zmq.asyncio

from indexer.protocol import Cleared, EventBatch, Removed, Stored, encode_batch
from indexer.protocol.decode import batch_layout, decode_batch
from indexer.protocol.frames import (
    ReplayData,
    build_replay_request,
    parse_live,
    parse_replay_reply,
)
from indexer.recording.format import Record, RecordMark, Source
from indexer.recording.republish import (
    FaultPlan,
    RepublishConfig,
    Republisher,
    parse_faults,
)

SOURCE = Source(stream="w0/0", topic="kv")


def _records(n: int, *, t0: float = 50.0, step: float = 0.001) -> list[Record]:
    return [Record(t0 + i * step, "w0/0", b"kv", i, b"payload-%d" % i) for i in range(n)]


class _Consumer:
    """A bare SUB + DEALER pair: what a subscriber would see, without its logic."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(endpoint)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)

    async def live(self, until_seq: int, count: int = 0) -> list[tuple[int, bytes]]:
        got: list[tuple[int, bytes]] = []
        async with asyncio.timeout(10.0):
            while len(got) < count if count else not got or got[-1][0] != until_seq:
                message = parse_live(await self.sub.recv_multipart())
                got.append((message.seq, message.payload))
        return got

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        await self.dealer.send_multipart(build_replay_request(start))
        got: list[tuple[int, bytes]] = []
        async with asyncio.timeout(5.0):
            while True:
                reply = parse_replay_reply(await self.dealer.recv_multipart())
                if not isinstance(reply, ReplayData):
                    return got
                assert reply.topic == b"kv"
                got.append((reply.seq, reply.payload))

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


Seen = list[tuple[int, bytes]]


async def _run(
    records: list[Record], config: RepublishConfig, *, count: int = 0
) -> tuple[Seen, Seen, Republisher]:
    ctx = zmq.asyncio.Context()
    try:
        async with Republisher([SOURCE], config) as rep:
            (stream,) = rep.streams
            consumer = _Consumer(ctx, stream.endpoint, stream.replay_endpoint)
            try:
                assert await rep.wait_subscribed(5.0)
                last = records[-1].seq - (config.faults.restart_at or 0)
                live_task = asyncio.create_task(consumer.live(last, count))
                await rep.run(records)
                live = await live_task
                replayed = await consumer.replay(0)
            finally:
                consumer.close()
        return live, replayed, rep
    finally:
        ctx.term()


async def test_republishes_exact_bytes_in_order() -> None:
    records = _records(200)
    live, replayed, rep = await _run(records, RepublishConfig(speed=None))
    expected = [(r.seq, r.payload) for r in records]
    assert live == expected
    assert replayed == expected
    assert rep.streams[0].sent == 200


async def test_replay_buffer_is_bounded() -> None:
    records = _records(50)
    _, replayed, _ = await _run(records, RepublishConfig(speed=None, replay_buffer=10))
    assert [s for s, _ in replayed] == list(range(40, 50))


async def test_recorded_pace_times_speed() -> None:
    records = _records(11, step=0.05)  # 0.5 s of recording
    started = time.monotonic()
    await _run(records, RepublishConfig(speed=2.0))
    assert time.monotonic() - started >= 0.25


async def test_drops_and_dups_leave_gaps_that_replay_fills() -> None:
    seed = random.randrange(1 << 30)
    print("seed", seed)
    records = _records(300)
    faults = FaultPlan(drop=0.2, dup=0.2, seed=seed)
    live, replayed, rep = await _run(records, RepublishConfig(speed=None, faults=faults))
    info = rep.streams[0]
    seqs = [s for s, _ in live]
    assert info.dropped > 0 and info.duplicated > 0
    assert len(set(seqs)) < 300  # real gaps
    # real duplicates (the consumer stops at the first 299, before a possible copy of it)
    assert len(seqs) - len(set(seqs)) >= info.duplicated - 1
    assert seqs[-1] == 299  # the tail is never lost for good
    assert set(seqs) | {s for s, _ in replayed} == set(range(300))


async def test_a_refetched_batch_is_no_second_message() -> None:
    """The recorder keeps a batch whose live copy did not decode twice: the live copy, then
    its refetch (`replayed`) at the same seq. That is one message of the engine's: sent live
    as it arrived, its buffer holding the refetched copy. Before, both were sent and buffered,
    so every replay answer held the seq twice, which the subscriber refuses (QA: a router
    following the republisher never converged)."""
    records = _records(6)
    records.insert(3, Record(50.0025, "w0/0", b"kv", 2, b"refetched-2", replayed=True))
    live, replayed, rep = await _run(records, RepublishConfig(speed=None))
    assert [s for s, _ in live] == list(range(6))
    assert live[2] == (2, b"payload-2")  # as it arrived live
    assert [s for s, _ in replayed] == list(range(6))
    assert replayed[2] == (2, b"refetched-2")  # as the engine's buffer held it
    assert rep.streams[0].sent == 6


async def test_reorder_sends_a_message_after_its_successor() -> None:
    records = _records(100)
    faults = FaultPlan(reorder=0.3, seed=7)
    live, _, rep = await _run(records, RepublishConfig(speed=None, faults=faults), count=100)
    seqs = [s for s, _ in live]
    assert rep.streams[0].reordered > 0
    assert sorted(seqs) == list(range(100))
    assert seqs != sorted(seqs)


async def test_restart_starts_seqs_over_and_empties_the_buffer() -> None:
    records = _records(60)
    faults = FaultPlan(restart_at=40)
    config = RepublishConfig(speed=None, faults=faults)
    live, replayed, rep = await _run(records, config, count=60)
    assert [s for s, _ in live] == [*range(40), *range(20)]
    assert [p for _, p in live][40] == b"payload-40"
    assert [s for s, _ in replayed] == list(range(20))
    assert rep.streams[0].restarts == 1


async def test_a_clear_mark_is_sent_as_an_all_blocks_cleared_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The recorder's marks were not republished: a subscriber kept the pages the recorder's
    dropped. A clear now goes out as the engine's own AllBlocksCleared batch (the layout and
    dp rank of the stream's batches) at the next seq, live and in the replay buffer, the later
    seqs following it; a forget-seq mark has no message and is said once; a clear before the
    stream's first message has nothing to clear."""
    stored = Stored(block_hashes=[7], parent=None, token_ids=[1, 2], block_size=2)
    batches = [
        encode_batch(EventBatch(ts=1.0, events=[stored], dp_rank=1), "array"),
        encode_batch(EventBatch(ts=2.0, events=[Removed(block_hashes=[7])], dp_rank=1), "array"),
        encode_batch(EventBatch(ts=3.0, events=[stored], dp_rank=1), "array"),
    ]
    records = [
        Record(50.0, "w0/0", b"", 0, b"", mark=RecordMark.CLEAR),
        Record(50.1, "w0/0", b"kv", 0, batches[0]),
        Record(50.2, "w0/0", b"kv", 1, batches[1]),
        Record(50.3, "w0/0", b"", 1, b"", mark=RecordMark.CLEAR),
        Record(50.3, "w0/0", b"", 1, b"", mark=RecordMark.FORGET_SEQ),
        Record(50.4, "w0/0", b"", 1, b"", mark=RecordMark.FORGET_SEQ),
        Record(50.5, "w0/0", b"kv", 2, batches[2]),
    ]
    caplog.set_level(logging.WARNING, logger="indexer.recording.republish")
    live, replayed, rep = await _run(records, RepublishConfig(speed=None), count=4)
    assert [s for s, _ in live] == [0, 1, 2, 3]
    assert live == replayed
    clear = live[2][1]
    assert decode_batch(clear).events == [Cleared()]
    assert batch_layout(clear) == ("array", 1)
    assert [p for _, p in live[:2]] + [live[3][1]] == batches  # the recorded bytes as they were
    info = rep.streams[0]
    assert (info.clears, info.forgets, info.last_seq) == (1, 2, 3)
    said = [r for r in caplog.records if "forget-seq mark" in r.getMessage()]
    assert len(said) == 1


def test_parse_faults() -> None:
    plan = parse_faults("drop=0.01, dup=0.02,reorder=0,restart-at=500", seed=3)
    assert plan == FaultPlan(drop=0.01, dup=0.02, reorder=0.0, restart_at=500, seed=3)
    assert not parse_faults("").any
    for bad, message in [
        ("drop", "NAME=VALUE"),
        ("lose=0.1", "unknown fault"),
        ("drop=2", "outside"),
        ("dup=x", "probability"),
        ("restart-at=-1", ">= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_faults(bad)
