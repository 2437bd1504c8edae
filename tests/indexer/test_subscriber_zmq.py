"""The indexer service against a scripted publisher over real ZMQ on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.index import NS_MASK, PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol.encode import encode_batch
from indexer.protocol.events import Event, EventBatch, Removed, Stored, TokenId
from indexer.protocol.frames import build_live, pack_seq
from indexer.recording.capture import Capture
from indexer.recording.format import RecordingReader, RecordingWriter, Source
from indexer.recording.replay import replay_into_index
from indexer.service import IndexerService
from indexer.stats import StreamState
from indexer.stream import restarts
from indexer.stream.subscriber import StreamSubscriber
from tests.indexer.scripted import ScriptedPublisher, engine_hash, workload

WORKER = "w0"
STREAM = "w0#dp0"
# No idle probe: these tests drop messages on purpose and check how the LIVE path notices; a
# probe firing in a slow moment would repair the drop first (the probe has its own tests).
CONFIG = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0)
# what a router keeps of the request a task handles (`router.http.observe.OBSERVATION`: its id
# on every log line of the task)
REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("request", default=None)


def view(index: PrefixIndex, stream: str) -> dict[object, tuple[int, Namespace | None]]:
    """What a stream holds: engine hash -> (block key, namespace)."""
    st = index._streams[stream]
    return {h: (k, index._registry.names[index._table[k] & NS_MASK]) for h, k in st.blocks.items()}


def reference(batches: list[EventBatch]) -> PrefixIndex:
    index = PrefixIndex()
    index.add_stream(STREAM)
    for seq, batch in enumerate(batches):
        index.apply(STREAM, batch, seq)
    return index


async def connect(svc: IndexerService, pub: ScriptedPublisher, **kw: object) -> None:
    """Add the worker and wait until its SUB really receives (publishing empty batches)."""
    cfg = StreamConfig(
        endpoint=pub.endpoint,
        replay_endpoint=kw.pop("replay_endpoint", pub.replay_endpoint),  # type: ignore[arg-type]
        topic="kv",
        **kw,  # type: ignore[arg-type]
    )
    await svc.add_worker(WORKER, [cfg])
    (sub,) = svc._workers[WORKER]
    for _ in range(100):
        seq = await pub.publish(EventBatch(ts=0.0, events=[]))
        # applied is not enough: the catch-up probe can apply a batch the SUB never saw
        if await svc.wait_applied(WORKER, seq, timeout_s=0.1) and sub.tracker.live is not None:
            return
    raise AssertionError("subscriber never received anything")


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll a condition the service exposes no event for."""
    async with asyncio.timeout(timeout_s):
        # the service has no event for "restarted"; a short poll is the honest wait
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def publish_all(
    pub: ScriptedPublisher,
    batches: list[EventBatch],
    drop: set[int] | None = None,
    settle: IndexerService | None = None,
) -> int:
    """Publish `batches`, dropping the indexes in `drop`; with `settle`, one at a time."""
    seq = -1
    for i, batch in enumerate(batches):
        dropped = i in (drop or set())
        seq = await pub.publish(batch, drop=dropped)
        if settle is not None and not dropped:
            assert await settle.wait_applied(WORKER, seq)
    return seq


@pytest.mark.parametrize("with_topic", [True, False], ids=["new-layout", "old-layout"])
async def test_dropped_batches_are_repaired_to_the_loss_free_index(
    ctx: zmq.asyncio.Context, with_topic: bool
) -> None:
    batches = workload(seed=11, batches=60)
    async with (
        ScriptedPublisher(ctx, reply_with_topic=with_topic) as pub,
        IndexerService(CONFIG) as svc,
    ):
        await connect(svc, pub)
        warmup = pub.next_seq
        last = await publish_all(pub, batches, drop={3, 4, 20, 41, 42, 43, 59}, settle=svc)
        # the last batch was dropped: one more live message reveals the gap
        last = await pub.publish(EventBatch(ts=0.0, events=[]))
        assert await svc.wait_applied(WORKER, last)
        want = reference([EventBatch(ts=0.0, events=[])] * warmup + batches)
        assert view(svc.index, STREAM) == view(want, STREAM)
        assert view(svc.index, STREAM)  # not trivially empty
        stats = svc.streams()[0]
        assert (stats.gaps, stats.clears) == (4, 0)
        # probes that brought batches count as replay runs too; live checks ask apart
        asked = len(pub.replay_requests)
        assert stats.replays <= asked <= stats.replays + stats.probes + stats.live_checks
        assert stats.replays >= 4
        assert stats.state is StreamState.SYNCED
        assert stats.entries == len(want._streams[STREAM].blocks)
        ns = Namespace("", None, "tenant-a")
        tokens = [t for ev in batches[0].events if isinstance(ev, Stored) for t in ev.token_ids]
        assert svc.query(ns, tokens) == {WORKER: svc.query(ns, tokens)[WORKER]}


async def test_restart_clears_the_stream(ctx: zmq.asyncio.Context) -> None:
    before = workload(seed=1, batches=10)
    after = workload(seed=2, batches=5)
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        assert await svc.wait_applied(WORKER, await publish_all(pub, before))
        assert svc.streams()[0].entries > 0
        pub.restart()
        last = await publish_all(pub, after)
        await wait_until(lambda: svc.streams()[0].restarts == 1 and svc.streams()[0].batches > 15)
        assert await svc.wait_applied(WORKER, last)
        assert view(svc.index, STREAM) == view(reference(after), STREAM)
        stats = svc.streams()[0]
        assert stats.restarts == 1 and stats.last_seq == last


async def test_without_a_replay_socket_a_dead_process_batches_after_a_restart_are_skipped(
    ctx: zmq.asyncio.Context,
) -> None:
    """A busy worker without a replay socket restarts on the same ports: the dead process's
    batches still queued on our socket arrive interleaved with the new process's. Each one
    was a gap that rebuilt the stream from it, and each new batch a restart: whichever came
    last was the stream, the dead process's pages a false hit. Batches that continue the run
    before the restart are skipped now (counted), the new process's applied."""
    before = workload(seed=1, batches=4)
    new = workload(seed=2, batches=3)
    gone = workload(seed=3, batches=3)  # what the old process sent before it died
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, replay_endpoint=None)
        last = await publish_all(pub, before, settle=svc)
        pub.restart()
        for i in range(3):
            await pub.publish(new[i])  # the new process's, seq i
            await pub.send_raw(build_live(b"kv", last + 1 + i, encode_batch(gone[i], "array")))
        (sub,) = svc._workers[WORKER]
        await wait_until(lambda: sub.dead_batches == 3)
        assert view(svc.index, STREAM) == view(reference(new), STREAM)
        stats = svc.streams()[0]
        assert stats.restarts == 1 and stats.last_seq == 2


async def test_without_a_replay_socket_a_dead_batch_at_the_new_process_seq_is_never_predicted(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a replay socket, the new process's batches pass the old run's newest seq
    before the dead process's queued batch at that seq arrives. The new one was skipped (as
    the dead one's, counted) and the dead one then applied as the worker's: its page a false
    hit for good. Nothing tells them apart, so the batch is applied but the stream predicts
    nothing until the window after the restart ends, and is cleared then."""
    monkeypatch.setattr(restarts, "DEAD_RUN_S", 0.5)
    before = workload(seed=1, batches=4)
    new = workload(seed=2, batches=16)
    gone = workload(seed=3, batches=1)  # what the old process sent before it died
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, replay_endpoint=None)
        last = await publish_all(pub, before, settle=svc)
        pub.restart()
        new_last = await publish_all(pub, new[: last + 2], settle=svc)
        assert new_last == last + 1  # the new process is past the old run's newest seq
        await pub.send_raw(build_live(b"kv", last + 1, encode_batch(gone[0], "array")))
        (sub,) = svc._workers[WORKER]
        await wait_until(lambda: sub.dead_batches == 1)  # the new batches were not counted
        assert svc.streams()[0].state is StreamState.DEGRADED  # predicts nothing
        # the window ends while the worker is idle: what it held is cleared, once
        await wait_until(lambda: svc.streams()[0].entries == 0, timeout_s=2.0)
        assert svc.streams()[0].state is StreamState.SYNCED
        # past the window the new run's next seq proves nothing either (a late queued batch
        # of the dead run may sit at it): skipped, and the window opens once more
        await pub.publish(new[last + 2])
        await wait_until(lambda: sub.dead_batches == 2)
        assert svc.streams()[0].entries == 0
        await asyncio.sleep(0.6)  # the second window ends: a run going on is the live one
        seq = await pub.publish(new[last + 3])
        assert await svc.wait_applied(WORKER, seq)
        stats = svc.streams()[0]  # the stream goes on from it, cold
        assert stats.state is StreamState.SYNCED and stats.last_seq == seq
        assert stats.restarts == 1 and stats.dead_batches == 2


async def test_without_a_replay_socket_a_middle_process_late_batch_is_never_predicted(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker without a replay socket restarts twice within the window: A, then B (seqs
    0..3), then C (0..12). B's queued batch 4 arrives after C's 12: below the newest seq, so
    it reads as one more restart, and it was applied and predicted as the worker's (QA
    `two_norep`: B's page predicted, the worker never held it). A restart found inside the
    window of another proves nothing about the batch that shows it: the stream predicts
    nothing until that window ends, and is cleared then."""
    monkeypatch.setattr(restarts, "DEAD_RUN_S", 1.0)
    a, b, c = (workload(seed=s, batches=n) for s, n in ((1, 12), (2, 5), (3, 13)))
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, replay_endpoint=None)

        async def run(batches: list[EventBatch], restarts: int) -> None:
            pub.restart()
            for batch in batches:
                await pub.publish(batch)
            done = svc.streams()[0].batches + len(batches)
            await wait_until(lambda: svc.streams()[0].batches == done)
            assert svc.streams()[0].restarts == restarts

        await publish_all(pub, a[:11], settle=svc)  # A: seqs 0..10, its seq 11 queued
        await run(b[:4], 1)  # B: seqs 0..3, its seq 4 still queued on our socket
        await run(c, 2)  # C: seqs 0..12
        await pub.send_raw(build_live(b"kv", 11, encode_batch(a[11], "array")))
        (sub,) = svc._workers[WORKER]
        await wait_until(lambda: sub.dead_batches == 1)  # skipped: beyond B's run
        await pub.send_raw(build_live(b"kv", 4, encode_batch(b[4], "array")))
        await wait_until(lambda: svc.streams()[0].restarts == 3)
        assert svc.streams()[0].state is StreamState.DEGRADED  # predicts nothing
        # the window ends while the worker is idle: B's batch is cleared, never predicted
        await wait_until(lambda: svc.streams()[0].entries == 0, timeout_s=3.0)
        assert svc.streams()[0].state is StreamState.SYNCED


async def _restarted_with(
    svc: IndexerService, pub: ScriptedPublisher, batches: list[EventBatch], restarts: int
) -> None:
    """The publisher restarts and publishes `batches`; until the stream shows it."""
    pub.restart()
    for batch in batches:
        await pub.publish(batch)
    want = (restarts, len(batches) - 1)
    await wait_until(lambda: (svc.streams()[0].restarts, svc.streams()[0].last_seq) == want)


async def test_without_a_replay_socket_a_dead_batch_past_a_gap_is_never_predicted(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart, a dead middle process's queued batch (its seq 7, its earlier batches
    never seen) comes after the newest process's 0..3: a gap, which without a replay socket
    cleared the stream and applied that batch as the worker's (QA: its page predicted while
    the worker idled). In the window after a restart such a batch taints the stream: it
    predicts nothing until the window ends, and is cleared then."""
    monkeypatch.setattr(restarts, "DEAD_RUN_S", 1.0)
    a, new, b = (workload(seed=s, batches=n) for s, n in ((1, 11), (2, 4), (3, 8)))
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, replay_endpoint=None)
        await publish_all(pub, a, settle=svc)
        pub.restart()
        for batch in new:
            await pub.publish(batch)
        await wait_until(lambda: svc.streams()[0].restarts == 1 and svc.streams()[0].last_seq == 3)
        await pub.send_raw(build_live(b"kv", 7, encode_batch(b[7], "array")))
        await wait_until(lambda: svc.streams()[0].last_seq == 7)
        assert svc.streams()[0].state is StreamState.DEGRADED  # predicts nothing
        await wait_until(lambda: svc.streams()[0].entries == 0, timeout_s=3.0)


async def test_a_dead_batch_going_back_in_the_window_is_skipped_when_the_socket_lacks_it(
    ctx: zmq.asyncio.Context,
) -> None:
    """Two restarts within the window (A, B, then C), with a replay socket: B's queued batch 4
    after C's 12 goes back in seq, as a third restart would. The socket, C's, answers without
    it: a dead process's batch, skipped. It was applied instead, C's proven pages cleared and
    the stream predicting nothing (QA), as if nothing could tell the two apart."""
    a, b, c = (workload(seed=s, batches=n) for s, n in ((1, 12), (2, 5), (3, 13)))
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        await publish_all(pub, a[:11], settle=svc)
        await _restarted_with(svc, pub, b[:4], restarts=1)
        await _restarted_with(svc, pub, c, restarts=2)
        (sub,) = svc._workers[WORKER]
        await pub.send_raw(build_live(b"kv", 11, encode_batch(a[11], "array")))
        await wait_until(lambda: sub.dead_batches == 1)
        await pub.send_raw(build_live(b"kv", 4, encode_batch(b[4], "array")))
        await wait_until(lambda: sub.dead_batches == 2)
        stats = svc.streams()[0]
        assert stats.restarts == 2 and stats.state is StreamState.SYNCED
        assert view(svc.index, STREAM) == view(reference(c), STREAM)


async def test_a_dead_batch_at_the_new_runs_next_seq_is_asked_for_in_the_window(
    ctx: zmq.asyncio.Context,
) -> None:
    """After a restart the new process publishes 0..3; a dead middle process's queued batch
    comes at seq 4, the new run's next, before the new process's own 4. It followed on, so
    it was applied and kept for good, and the new process's 4 skipped as the dead one's (QA).
    In the window such a batch is asked for at the replay socket: not given back, skipped."""
    a, new, b = (workload(seed=s, batches=n) for s, n in ((1, 11), (2, 6), (3, 5)))
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        await publish_all(pub, a, settle=svc)
        await _restarted_with(svc, pub, new[:4], restarts=1)
        (sub,) = svc._workers[WORKER]
        await pub.send_raw(build_live(b"kv", 4, encode_batch(b[4], "array")))
        await wait_until(lambda: sub.dead_batches == 1)
        for batch in new[4:]:
            await pub.publish(batch)
        await wait_until(lambda: svc.streams()[0].last_seq == 5)
        assert view(svc.index, STREAM) == view(reference(new), STREAM)
        assert svc.streams()[0].state is StreamState.SYNCED


async def test_gap_older_than_the_buffer_clears_and_recovers(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=5, batches=30)
    async with ScriptedPublisher(ctx, buffer_steps=3) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        assert await svc.wait_applied(WORKER, await publish_all(pub, batches[:10]))
        # 6 lost batches, the buffer keeps 3: the replay cannot cover the gap
        first_lost = pub.next_seq
        last = await publish_all(pub, batches[10:], drop=set(range(6)), settle=svc)
        stats = svc.streams()[0]
        assert stats.clears == 1 and stats.gaps == 1 and stats.last_seq == last
        # asked from the last applied batch, whose copy proves the epoch (indexer.fence)
        assert pub.replay_requests[-1] == first_lost - 1
        # when the 7th batch revealed the gap the buffer held lost batches 5 and 6 and the 7th:
        # what is left is exactly what those and the later batches build on a clean stream
        kept = reference(batches[14:])
        assert view(svc.index, STREAM) == view(kept, STREAM)
        assert stats.state is StreamState.SYNCED


async def test_gap_without_replay_endpoint_clears(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=6, batches=12)
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, replay_endpoint=None)
        last = await publish_all(pub, batches, drop={5})
        assert await svc.wait_applied(WORKER, last)
        stats = svc.streams()[0]
        assert stats.clears == 1 and stats.replays == 0
        kept = reference([EventBatch(ts=0.0, events=[])] * 6 + batches[6:])
        assert view(svc.index, STREAM) == view(kept, STREAM)


async def test_replay_timeout_clears_and_continues(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=7, batches=8)
    async with ScriptedPublisher(ctx, answer_replays=False) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        last = await publish_all(pub, batches, drop={2})
        assert await svc.wait_applied(WORKER, last)
        stats = svc.streams()[0]
        assert stats.clears == 1 and stats.gaps == 1 and stats.last_seq == last
        asked = len(pub.replay_requests)  # (live checks ask apart)
        assert stats.replays <= asked <= stats.replays + stats.probes + stats.live_checks


async def test_every_replay_timeout_is_counted_though_warnings_are_rate_limited(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """Two gaps whose repairs time out within `log_interval_s`: one WARNING line, yet both
    requests (and any the join made) count in `unanswered_replays`. Before, nothing counted
    them: the second timeout showed nowhere."""
    batches = workload(seed=8, batches=8)
    caplog.set_level(logging.WARNING, logger="indexer.stream")
    async with ScriptedPublisher(ctx, answer_replays=False) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        last = await publish_all(pub, batches, drop={2, 5})
        assert await svc.wait_applied(WORKER, last)
        stats = svc.streams()[0]
        assert stats.gaps == 2
        assert stats.unanswered_replays == len(pub.replay_requests) >= 2
        warned = caplog.text.count("timed out after")
        assert 1 <= warned < stats.unanswered_replays


@pytest.mark.parametrize("missing", ["gap", "undecodable"])
async def test_a_stream_being_repaired_predicts_nothing_until_it_is(
    ctx: zmq.asyncio.Context, missing: str
) -> None:
    """A batch known missing (dropped: the next seq shows the gap; or its live copy does not
    decode) may have removed blocks the stream holds: while the replay socket is asked for it
    the stream is degraded and predicts nothing. Before, the prefix the worker had evicted
    was predicted for as long as the repair took (up to `replay_timeout_s`). The repair's end
    gives back what the stream holds at once."""
    ns = Namespace()
    a: list[TokenId] = [1, 2, 3, 4, 0]
    b: list[TokenId] = [5, 6, 7, 8, 0]
    c: list[TokenId] = [9, 10, 11, 12, 0]

    def stored(tokens: list[TokenId], block_hash: int) -> Stored:
        return Stored(block_hashes=[block_hash], parent=None, token_ids=tokens[:4], block_size=4)

    def matched(tokens: list[TokenId]) -> int:
        return svc.query(ns, tokens)[WORKER].matched_tokens

    config = IndexerConfig(replay_timeout_s=5.0, probe_interval_s=0)
    async with ScriptedPublisher(ctx) as pub, IndexerService(config) as svc:
        await connect(svc, pub, block_size=4)
        seq = await pub.publish(EventBatch(0.0, [stored(a, 10), stored(b, 11)]))
        assert await svc.wait_applied(WORKER, seq)
        assert (matched(a), matched(b)) == (4, 4)
        pub.answer_delay_s = 0.3  # a replay socket that takes its time
        evict = EventBatch(0.0, [Removed(block_hashes=[10])])
        if missing == "gap":
            await pub.publish(evict, drop=True)
            last = await pub.publish(EventBatch(0.0, [stored(c, 12)]))
        else:
            last = await pub.publish(evict, corrupt_live=True)
        await wait_until(lambda: svc.streams()[0].state is StreamState.DEGRADED)
        # nothing, b (still held) included: which blocks the missing batch removed is unknown
        assert (matched(a), matched(b), matched(c)) == (0, 0, 0)
        assert svc.query(ns, a)[WORKER].state is StreamState.DEGRADED
        assert await svc.wait_applied(WORKER, last)
        assert svc.streams()[0].state is StreamState.SYNCED
        assert (matched(a), matched(b)) == (0, 4)  # given back as the repair ended
        assert matched(c) == (4 if missing == "gap" else 0)
        stats = svc.streams()[0]
        assert stats.clears == 0 and (stats.gaps, stats.refetches) == (
            (1, 0) if missing == "gap" else (0, 1)
        )


async def test_garbage_frames_never_stop_the_stream(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=8, batches=6)
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        await publish_all(pub, batches[:3])
        await pub.send_raw([b"kv", b"\x00" * 3, b"payload"])  # bad seq frame
        await pub.send_raw([b"kv", pack_seq(1)])  # 2 frames
        await pub.publish_payload(b"\xc1\xff garbage")
        await pub.publish_payload(b"\x93\xcb")  # truncated msgpack
        await pub.send_raw([b"kv", pack_seq(10**15), b"\x90"])  # a seq from nowhere
        last = await publish_all(pub, batches[3:])
        assert await svc.wait_applied(WORKER, last)
        # the bogus seq's repair may still be reading the replay that brought the last batches
        await wait_until(lambda: svc.streams()[0].state is StreamState.SYNCED)
        stats = svc.streams()[0]
        # 3 bad frames; the first garbage payload live, then both fetched again (the second's
        # live copy arrives after the refetch applied it: a duplicate, never decoded)
        assert stats.decode_errors == 6 and stats.refetches == 1
        # a batch that decodes neither live nor replayed may have removed blocks: the stream
        # is cleared for it (fail closed), never a restart
        assert stats.lost_batches == 2 and stats.clears == 2 and stats.restarts == 0
        empty = EventBatch(ts=0.0, events=[])
        warm = last - len(batches) - 2 + 1
        want = reference([empty] * warm + batches[:3])
        want.clear_stream(STREAM)
        for seq, batch in enumerate(batches[3:], start=warm + 5):
            want.apply(STREAM, batch, seq)
        assert view(svc.index, STREAM) == view(want, STREAM)


async def test_late_router_replays_from_zero(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=9, batches=15)
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await publish_all(pub, batches[:10])  # nobody listens yet
        await connect(svc, pub)  # its first live message has seq >= 10: replay from 0
        last = await publish_all(pub, batches[10:])
        assert await svc.wait_applied(WORKER, last)
        assert pub.replay_requests[0] == 0
        warm = last + 1 - 15
        want = reference(batches[:10] + [EventBatch(ts=0.0, events=[])] * warm + batches[10:])
        assert view(svc.index, STREAM) == view(want, STREAM)
        assert svc.streams()[0].clears == 0


async def join(running: Capture, pub: ScriptedPublisher) -> None:
    """Publish empty batches until the capture's SUB really receives (the slow joiner)."""
    (sub,) = running._subs.all()
    for _ in range(100):
        seq = await pub.publish(EventBatch(ts=0.0, events=[]))
        try:
            await wait_until(lambda: (sub.tracker.last or -1) >= seq, timeout_s=0.1)  # noqa: B023
        except TimeoutError:
            continue
        if sub.tracker.live is not None:
            return
    raise AssertionError("capture never received anything")


@contextlib.asynccontextmanager
async def capturing(
    pub: ScriptedPublisher, path: Path, settings: IndexerConfig
) -> AsyncIterator[Capture]:
    """A capture of the publisher's stream into a new recording at `path`."""
    source = Source(
        stream=STREAM,
        worker=WORKER,
        topic="kv",
        endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint,
    )
    async with Capture(RecordingWriter.create(path, [source]), [source], settings=settings) as c:
        yield c


def replay_marks(path: Path) -> list[tuple[bool, bool]]:
    """(replayed, run_start) of every record of the recording at `path`."""
    with RecordingReader(path) as reader:
        return [(p.record.replayed, p.record.run_start) for p in reader.records()]


async def test_a_capture_records_every_message_in_order(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    batches = workload(seed=10, batches=12)
    path = tmp_path / "capture.kvrec"
    source = Source(stream=STREAM, worker=WORKER, topic="kv")
    async with ScriptedPublisher(ctx) as pub:
        source = msgspec.structs.replace(
            source, endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint
        )
        writer = RecordingWriter.create(path, [source])
        async with Capture(writer, [source], settings=CONFIG) as running:
            await join(running, pub)
            (sub,) = running._subs.all()
            last = -1
            for i, batch in enumerate(batches):
                last = await pub.publish(batch, drop=i in {4, 5})
                if i not in {4, 5}:
                    await wait_until(lambda: sub.tracker.last == last)  # noqa: B023
    with RecordingReader(path) as reader:
        seen = [(p.record.seq, p.record.replayed) for p in reader.records()]
    seqs = [seq for seq, _ in seen]
    assert seqs == list(range(last + 1))  # the warm-up's first seqs come from the join replay
    start = last + 1 - len(batches)
    # the replay also brings the live message that revealed the gap; its live copy is skipped
    replayed = [seq for seq, r in seen if r and seq >= start]
    assert replayed == [start + 4, start + 5, start + 6]


async def test_a_capture_says_what_it_did_without_claiming_entries_a_router_does(
    ctx: zmq.asyncio.Context, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`kvroute record` logged the router's words ("its entries predict nothing until ...",
    "cleared 0 entries") though a recording keeps no entries; the router's stay as they were."""
    caplog.set_level(logging.WARNING, logger="indexer.stream")

    async def restart(sub: StreamSubscriber, pub: ScriptedPublisher) -> None:
        last = await publish_all(pub, workload(seed=1, batches=6))
        await wait_until(lambda: sub.tracker.last == last)
        sub.suspect_restart("the event connection dropped")
        pub.restart()
        await publish_all(pub, workload(seed=2, batches=3))
        await wait_until(lambda: sub.restarts == 1)

    async with (
        ScriptedPublisher(ctx) as pub,
        capturing(pub, tmp_path / "r.kvrec", CONFIG) as running,
    ):
        await join(running, pub)
        await restart(running._subs.all()[0], pub)
    said = [r.getMessage() for r in caplog.records if r.name == "indexer.stream"]
    assert any(
        "the event connection dropped: checking through the replay socket" in m for m in said
    )
    assert any("stream reset (a router drops its entries here): " in m for m in said), said
    assert not [m for m in said if "cleared" in m or "entries predict" in m]

    caplog.clear()
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        await restart(svc._workers[WORKER][0], pub)
    said = [r.getMessage() for r in caplog.records if r.name == "indexer.stream"]
    assert any("the event connection dropped: its entries predict nothing until" in m for m in said)
    assert any(re.search(r"cleared \d+ entries: ", m) for m in said), said
    assert not [m for m in said if "stream reset" in m or "checking through" in m]


async def test_service_query_dump_load_and_pending(ctx: zmq.asyncio.Context) -> None:
    clock = [100.0]
    tokens = list(range(16))
    hashes = [engine_hash("s", tuple(tokens[: (b + 1) * 4])) for b in range(4)]
    stored = Stored(block_hashes=hashes, parent=None, token_ids=tokens, block_size=4)  # type: ignore[arg-type]
    salted = Stored(
        block_hashes=[h + 1 for h in hashes],
        parent=None,
        token_ids=tokens,  # type: ignore[arg-type]
        block_size=4,
        cache_salt="s",
    )
    async with (
        ScriptedPublisher(ctx) as pub,
        IndexerService(IndexerConfig(pending_ttl_s=2.0), clock=lambda: clock[0]) as svc,
    ):
        await connect(svc, pub, model="m")
        last = await pub.publish(EventBatch(ts=0.0, events=[stored, salted]))
        assert await svc.wait_applied(WORKER, last)
        salted_ns = Namespace("m", None, "s")
        match = svc.query(salted_ns, [*tokens, 99, 98, 97, 96])[WORKER]
        assert (match.matched_blocks, match.matched_tokens, match.block_size) == (4, 16, 4)
        assert match.by_medium == {"GPU": 4} and match.state is StreamState.SYNCED
        assert svc.query(Namespace("other"), tokens)[WORKER].matched_blocks == 0
        sizes = {n.namespace: (n.blocks, n.holders) for n in svc.namespaces()}
        assert sizes == {salted_ns: (4, {WORKER: 4}), Namespace("m"): (4, {WORKER: 4})}

        longer = [*tokens, 5, 5, 5, 5, 6, 6, 6, 6]
        svc.add_pending(salted_ns, longer, WORKER)
        assert svc.query(salted_ns, longer)[WORKER].pending_tokens == 8
        clock[0] += 2.5
        assert svc.query(salted_ns, longer)[WORKER].pending_tokens == 0

        snapshot = svc.dump()
        assert svc.evict_namespace(salted_ns) == 4
        assert svc.query(salted_ns, tokens)[WORKER].matched_blocks == 0
        svc.load(snapshot)
        # a loaded state predicts nothing until the publisher's fence proves it current
        loaded = svc.query(salted_ns, tokens)[WORKER]
        assert (loaded.matched_blocks, loaded.state) == (0, StreamState.UNVERIFIED)
        await wait_until(lambda: svc.streams()[0].state is StreamState.SYNCED)
        assert svc.streams()[0].verifications == 1 and svc.streams()[0].restarts == 0
        assert svc.query(salted_ns, tokens)[WORKER].matched_blocks == 4
        # the loaded stream continues from its seq: the next live batch applies in order
        last = await pub.publish(EventBatch(ts=0.0, events=[]))
        assert await svc.wait_applied(WORKER, last)
        assert svc.streams()[0].gaps == 0
        await svc.remove_worker(WORKER)
        assert svc.workers() == [] and svc.index.streams() == []


async def test_stale_state(ctx: zmq.asyncio.Context) -> None:
    clock = [0.0]
    async with (
        ScriptedPublisher(ctx) as pub,
        IndexerService(IndexerConfig(stale_after_s=5.0), clock=lambda: clock[0]) as svc,
    ):
        await connect(svc, pub)
        assert svc.streams()[0].state is StreamState.SYNCED
        clock[0] += 6.0
        assert svc.streams()[0].state is StreamState.STALE
        assert svc.query(Namespace(), [1, 2, 3])[WORKER].state is StreamState.STALE
        await asyncio.sleep(0)


async def test_late_router_with_a_short_buffer_starts_from_what_is_buffered(
    ctx: zmq.asyncio.Context,
) -> None:
    batches = workload(seed=12, batches=10)
    async with ScriptedPublisher(ctx, buffer_steps=3) as pub, IndexerService(CONFIG) as svc:
        await publish_all(pub, batches)  # nobody listens; only the last 3 stay buffered
        await connect(svc, pub)
        stats = svc.streams()[0]
        # joining is not a gap and there was nothing to clear
        assert (stats.gaps, stats.clears, stats.state) == (0, 0, StreamState.SYNCED)
        assert pub.replay_requests[0] == 0


async def test_publisher_that_buffers_nothing_still_recovers(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=13, batches=8)
    async with ScriptedPublisher(ctx, buffer_steps=0) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        # a lost batch: the empty replay cannot repair it; the stream is cleared and goes on
        await publish_all(pub, batches[:3], settle=svc)
        await pub.publish(batches[3], drop=True)
        await pub.publish(batches[4])  # reveals the gap; the empty replay makes it a suspect
        last = await publish_all(pub, batches[5:], settle=svc)
        stats = svc.streams()[0]
        assert stats.last_seq == last and stats.clears == 1
        kept = reference(batches[5:])  # batch 4 revealed the gap and was skipped as suspect
        assert view(svc.index, STREAM) == view(kept, STREAM)


async def test_router_started_after_a_silent_worker_learns_its_cache(
    ctx: zmq.asyncio.Context,
) -> None:
    # The worker publishes, then goes quiet: no later live message will ever reveal what the
    # SUB missed, so only the catch-up replay at subscription time can warm the index.
    batches = workload(seed=14, batches=6)
    config = IndexerConfig(replay_timeout_s=0.5)  # the default probe, on
    async with ScriptedPublisher(ctx) as pub, IndexerService(config) as svc:
        last = await publish_all(pub, batches)
        await svc.add_worker(WORKER, [StreamConfig(pub.endpoint, pub.replay_endpoint, topic="kv")])
        assert await svc.wait_applied(WORKER, last)
        assert view(svc.index, STREAM) == view(reference(batches), STREAM)
        # synced once a replay asked after the SUB connected has answered (a round trip more)
        await wait_until(lambda: svc.streams()[0].state is StreamState.SYNCED)
        stats = svc.streams()[0]
        assert (stats.gaps, stats.clears, stats.undelivered_tails) == (0, 0, 0)
        # the live copies of what the catch-up replay applied are not mistaken for a restart
        tail = await publish_all(pub, workload(seed=15, batches=2))
        assert await svc.wait_applied(WORKER, tail)
        assert svc.streams()[0].restarts == 0


async def test_a_dropped_last_batch_is_found_by_the_idle_probe(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=16, batches=5)
    config = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0.05)
    async with ScriptedPublisher(ctx) as pub, IndexerService(config) as svc:
        await connect(svc, pub)
        await publish_all(pub, batches[:-1], settle=svc)
        lost = await pub.publish(batches[-1], drop=True)  # PUB dropped it; nothing follows
        assert await svc.wait_applied(WORKER, lost)
        stats = svc.streams()[0]
        assert (stats.clears, stats.last_seq) == (0, lost) and stats.probes >= 2


async def test_a_batch_the_probe_found_is_a_gap_live_and_offline(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    batches = workload(seed=18, batches=5)
    # long enough that a probe never overtakes a live copy in flight during the settled run
    config = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0.3)
    path = tmp_path / "probe.kvrec"
    async with ScriptedPublisher(ctx) as pub, capturing(pub, path, config) as running:
        await join(running, pub)
        (sub,) = running._subs.all()
        for batch in batches[:-1]:
            applied = sub.batches
            seq = await pub.publish(batch)
            # applied, not only taken: a live check asks the replay socket for it first, and
            # its answer, asked after the lost batch went out, would bring that one too (CI)
            await wait_until(lambda: sub.tracker.last == seq and sub.batches > applied)  # noqa: B023
        lost = await pub.publish(batches[-1], drop=True)  # PUB dropped it; nothing follows
        await wait_until(lambda: sub.tracker.last == lost)
        live = running.streams()[0]
    # the lost batch was a gap (whatever the join did, joining is never one), repaired by the
    # probe's replay run; the recording replayed offline reads the same gaps from its records
    assert live.gaps == 1 and live.clears == 0
    summary, _ = replay_into_index(path)
    (offline,) = summary.streams
    assert (offline.gaps, offline.restarts, offline.lost_gaps, offline.last_seq) == (1, 0, 0, lost)
    # a join can take two runs live (probe, then what the SUB missed while connecting): the
    # file marks where each began
    assert offline.replays == live.replays


async def test_two_repair_runs_with_no_live_record_between_count_twice_offline(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    batches = workload(seed=19, batches=4)
    path = tmp_path / "runs.kvrec"
    async with ScriptedPublisher(ctx) as pub, capturing(pub, path, CONFIG) as running:
        await join(running, pub)
        (sub,) = running._subs.all()
        before = running.streams()[0]
        # each live batch reveals the dropped one before it; the repair's replay brings the
        # live one too, so its live copy is a duplicate and nothing live is recorded
        for i in (0, 2):
            await pub.publish(batches[i], drop=True)
            seq = await pub.publish(batches[i + 1])
            await wait_until(lambda: sub.tracker.last == seq)  # noqa: B023
        live = running.streams()[0]
    tail = replay_marks(path)[-4:]
    assert tail == [(True, True), (True, False), (True, True), (True, False)]
    assert (live.gaps - before.gaps, live.replays - before.replays) == (2, 2)
    summary, _ = replay_into_index(path)
    (offline,) = summary.streams
    assert (offline.gaps, offline.replays) == (live.gaps, live.replays)
    assert (offline.lost_gaps, offline.last_seq) == (0, seq)


async def test_what_a_verification_replays_is_no_run_live_or_offline(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    batches = workload(seed=20, batches=3)
    path = tmp_path / "verify.kvrec"
    async with ScriptedPublisher(ctx) as pub, capturing(pub, path, CONFIG) as running:
        await join(running, pub)
        (sub,) = running._subs.all()
        # a live batch after the join's replay, so the replay below cannot extend its run
        seq = await pub.publish(EventBatch(ts=0.0, events=[]))
        await wait_until(lambda: sub.tracker.last == seq)
        before = running.streams()[0]
        for batch in batches[:-1]:
            await pub.publish(batch, drop=True)  # buffered only
        # a health check came back: the stream is checked against the replay socket
        # before the next live batch, and that replay brings what the SUB missed
        sub.suspect_restart("its health check came back")
        seq = await pub.publish(batches[-1])
        await wait_until(lambda: sub.tracker.last == seq)
        live = running.streams()[0]
    assert live.verifications == before.verifications + 1
    assert (live.gaps, live.replays) == (before.gaps, before.replays)
    tail = replay_marks(path)[-4:]
    assert tail == [(False, False)] + [(True, False)] * 3
    summary, _ = replay_into_index(path)
    (offline,) = summary.streams
    assert (offline.gaps, offline.replays, offline.restarts) == (
        live.gaps,
        live.replays,
        live.restarts,
    )
    assert offline.last_seq == seq


async def test_without_the_probe_a_dropped_last_batch_stays_unknown(
    ctx: zmq.asyncio.Context,
) -> None:
    # the counterpart that shows the probe test above can fail
    batches = workload(seed=16, batches=5)
    config = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0)
    async with ScriptedPublisher(ctx) as pub, IndexerService(config) as svc:
        await connect(svc, pub)
        await publish_all(pub, batches[:-1], settle=svc)
        lost = await pub.publish(batches[-1], drop=True)
        assert not await svc.wait_applied(WORKER, lost, timeout_s=0.3)


async def test_a_refused_worker_leaves_no_stream_behind(ctx: zmq.asyncio.Context) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        cfg = StreamConfig(pub.endpoint, pub.replay_endpoint, topic="kv")
        with pytest.raises(ValueError, match="dp rank 0 twice"):
            await svc.add_worker(WORKER, [cfg, cfg])
        assert svc.workers() == [] and svc.index.streams() == []


async def test_a_timed_out_wait_is_forgotten(ctx: zmq.asyncio.Context) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        for _ in range(3):
            assert not await svc.wait_applied(WORKER, 10**6, timeout_s=0.01)
        assert svc._waiters == []  # an idle stream would otherwise keep them forever


async def test_removing_a_worker_does_not_swallow_the_callers_cancel(
    ctx: zmq.asyncio.Context,
) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        removing = asyncio.create_task(svc.remove_worker(WORKER))
        await asyncio.sleep(0)  # it cancelled the subscriber and waits for it to end
        removing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await removing


async def test_an_idle_worker_that_restarted_unseen_is_rebuilt_by_the_probe(
    ctx: zmq.asyncio.Context,
) -> None:
    # The worker restarts while nobody sees it (its first batches are lost, as a reconnecting
    # SUB loses them) and then stays idle: only the probe can notice that its seqs went back.
    before = workload(seed=17, batches=8)
    after = workload(seed=18, batches=2)
    config = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0.05)
    async with ScriptedPublisher(ctx) as pub, IndexerService(config) as svc:
        await connect(svc, pub)
        assert await svc.wait_applied(WORKER, await publish_all(pub, before, settle=svc))
        pub.restart()
        for batch in after:
            await pub.publish(batch, drop=True)
        await wait_until(lambda: svc.streams()[0].restarts == 1)
        await wait_until(lambda: svc.streams()[0].last_seq == len(after) - 1)
        assert view(svc.index, STREAM) == view(reference(after), STREAM)
        assert svc.streams()[0].restarts == 1  # and the probes that follow find nothing new


async def test_an_idle_worker_that_did_not_restart_is_left_alone(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=19, batches=6)
    config = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0.05)
    async with ScriptedPublisher(ctx) as pub, IndexerService(config) as svc:
        await connect(svc, pub)
        last = await publish_all(pub, batches, settle=svc)
        await wait_until(lambda: svc.streams()[0].probes >= 5)
        stats = svc.streams()[0]
        assert (stats.restarts, stats.clears, stats.last_seq) == (0, 0, last)
        assert view(svc.index, STREAM)  # still holding everything


async def test_a_quiet_stream_whose_probe_goes_unanswered_predicts_nothing(
    ctx: zmq.asyncio.Context,
) -> None:
    # batches the PUB dropped at the stream's end would go unseen: until a probe answers or
    # the next batch follows on, the entries predict nothing (they are kept)
    batches = workload(seed=5, batches=4)
    config = IndexerConfig(replay_timeout_s=0.1, probe_interval_s=0.05, stale_after_s=60.0)
    async with (
        ScriptedPublisher(ctx, answer_replays=False) as pub,
        IndexerService(config) as svc,
    ):
        await connect(svc, pub)
        await publish_all(pub, batches, settle=svc)
        entries = svc.streams()[0].entries
        await wait_until(lambda: svc.streams()[0].state is StreamState.UNVERIFIED)
        assert svc.query(Namespace(), [1, 2, 3])[WORKER].state is StreamState.UNVERIFIED
        assert svc.streams()[0].entries == entries > 0  # kept, only not trusted
        seq = await pub.publish(EventBatch(ts=0.0, events=[]))  # follows on: nothing was lost
        assert await svc.wait_applied(WORKER, seq)
        assert svc.streams()[0].state is StreamState.SYNCED


async def test_another_publishers_replay_socket_leaves_the_stream_predicting_nothing(
    ctx: zmq.asyncio.Context,
) -> None:
    # `replay` pointing at another worker's socket (a config typo): what it gives describes
    # that worker's cache, a false hit on this one for every prompt it holds. Nothing tells
    # which of the two sockets is the wrong one, so nothing is predicted from either, and the
    # replay socket is asked for a live batch at most once a second
    config = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0.05)
    async with (
        ScriptedPublisher(ctx) as other,
        ScriptedPublisher(ctx) as own,
        IndexerService(config) as svc,
    ):
        await publish_all(other, workload(seed=3, batches=3))  # buffered there
        for _ in range(50):  # this publisher is further along than the other one's buffer
            await own.publish(EventBatch(ts=0.0, events=[]))
        cfg = StreamConfig(endpoint=own.endpoint, replay_endpoint=other.replay_endpoint, topic="kv")
        await svc.add_worker(WORKER, [cfg])
        (sub,) = svc._workers[WORKER]
        for _ in range(100):  # the SUB's connection may still be on its way
            await own.publish(EventBatch(ts=0.0, events=[]))
            await asyncio.sleep(0.05)
            if sub._disagreeing is not None:
                break
        assert sub._disagreeing is not None
        assert view(svc.index, STREAM) == {}  # nothing of the other worker's cache is left
        asked = len(other.replay_requests)
        for batch in workload(seed=4, batches=3):  # nor of this one's
            await own.publish(batch)
        # several probe intervals: the newest live batch is asked for once
        await asyncio.sleep(0.3)
        assert view(svc.index, STREAM) == {}
        assert len(other.replay_requests) <= asked + 1
        assert svc.streams()[0].state is StreamState.UNVERIFIED


def _stored(tokens: list[TokenId], block_hash: int) -> EventBatch:
    events: list[Event] = [
        Stored(block_hashes=[block_hash], parent=None, token_ids=tokens, block_size=4)
    ]
    return EventBatch(ts=0.0, events=events)


def _hit(svc: IndexerService, tokens: list[TokenId]) -> int:
    return svc.query(Namespace(), [*tokens, 99])[WORKER].matched_tokens


async def test_an_odd_live_frame_at_an_applied_seq_predicts_nothing_until_the_next_agrees(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A second live frame at the seq just applied, with other bytes, while the replay socket
    gives back the batch that was applied: the live stream and the replay socket disagree
    (QA: a proxy re-pointed at another worker's PUB showed first as such a frame, and that
    worker's next batch, following on, was applied). The stream predicts nothing; the next
    live batch, which the socket gives back, shows them agreeing again: rebuilt from the
    socket, which is kept (a later gap is repaired through it). Writing it off for good, as
    once, cleared every later gap instead."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=4)
        caplog.set_level(logging.WARNING, logger="indexer.stream")
        seq = await pub.publish(_stored([1, 2, 3, 4], 10))
        assert await svc.wait_applied(WORKER, seq)
        odd = encode_batch(_stored([5, 6, 7, 8], 20), "array")
        await pub.send_raw([b"kv", pack_seq(seq), odd])
        (sub,) = svc._workers[WORKER]
        await wait_until(lambda: sub._disagreeing is not None)
        assert _hit(svc, [1, 2, 3, 4]) == 0 and _hit(svc, [5, 6, 7, 8]) == 0
        assert svc.streams()[0].state is StreamState.UNVERIFIED
        agreed = await pub.publish(EventBatch(ts=0.0, events=[]))
        assert await svc.wait_applied(WORKER, agreed)
        await wait_until(lambda: svc.streams()[0].state is StreamState.SYNCED)
        assert "agree again" in caplog.text
        assert _hit(svc, [1, 2, 3, 4]) == 4 and _hit(svc, [5, 6, 7, 8]) == 0
        # a later gap is repaired through the same socket, not cleared
        clears = svc.streams()[0].clears
        await pub.publish(_stored([11, 12, 13, 14], 30), drop=True)
        last = await pub.publish(EventBatch(ts=0.0, events=[]))
        assert await svc.wait_applied(WORKER, last)
        stats = svc.streams()[0]
        assert stats.clears == clears and stats.gaps == 1
        assert _hit(svc, [1, 2, 3, 4]) == 4 and _hit(svc, [11, 12, 13, 14]) == 4


async def test_a_late_live_copy_of_a_replayed_batch_is_no_restart(
    ctx: zmq.asyncio.Context,
) -> None:
    """Live seq 2 shows a gap, the replay applies seq 1, then seq 1's own live copy arrives
    (the same bytes, behind the newer one): counted as a restart, and the stream cleared."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=4)
        held = await pub.publish(_stored([1, 2, 3, 4], 10))
        assert await svc.wait_applied(WORKER, held)
        late = await pub.publish(EventBatch(ts=0.0, events=[Removed(block_hashes=[10])]), drop=True)
        ahead = await pub.publish(_stored([5, 6, 7, 8], 20))
        assert await svc.wait_applied(WORKER, ahead)  # seq `late` came through the replay
        await pub.send_raw(build_live(b"kv", late, pub.buffer[late - pub.buffer[0][0]][1]))
        last = await pub.publish(EventBatch(ts=0.0, events=[]))
        assert await svc.wait_applied(WORKER, last)
        stats = svc.streams()[0]
        assert stats.restarts == 0 and stats.clears == 0
        assert _hit(svc, [1, 2, 3, 4]) == 0 and _hit(svc, [5, 6, 7, 8]) == 4


async def test_removals_of_blocks_the_stream_does_not_hold_are_counted(
    ctx: zmq.asyncio.Context,
) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=4)
        stored = Stored(block_hashes=[7], parent=None, token_ids=[1, 2, 3, 4], block_size=4)
        events: list[Event] = [stored, Removed(block_hashes=[8, 9]), Removed(block_hashes=[7])]
        assert await svc.wait_applied(WORKER, await pub.publish(EventBatch(0.0, events)))
        stats = svc.streams()[0]
        assert (stats.unknown_removes, stats.blocks_removed, stats.entries) == (2, 1, 0)


async def test_a_batch_of_another_dp_rank_clears_the_stream_and_is_said(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    def stored(block: int, first: int) -> Stored:
        return Stored(block_hashes=[block], parent=None, token_ids=list(range(first, first + 4)),
                      block_size=4)  # fmt: skip

    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=4)  # rank 0
        caplog.set_level(logging.WARNING, logger="indexer.stream")
        for rank, block in ((0, 1), (None, 2)):
            seq = await pub.publish(EventBatch(0.0, [stored(block, 10 * block)], rank))
            assert await svc.wait_applied(WORKER, seq)
        assert svc.streams()[0].entries == 2  # its own rank's, and a batch that names none
        # rank 1's pages on rank 0's port: predicted here, the router would send requests to
        # rank 0 for pages rank 1 holds. Nothing is kept, that batch's stores included
        seq = await pub.publish(EventBatch(0.0, [stored(3, 30)], 1))
        assert await svc.wait_applied(WORKER, seq)
        stats = svc.streams()[0]
        assert (stats.rank_mismatches, stats.entries) == (1, 0)
        assert "DP RANK MISMATCH: batch" in caplog.text and "says dp rank 1" in caplog.text
        assert "check the worker's events endpoints" in caplog.text


async def test_a_batch_of_another_dp_rank_through_the_replay_names_the_replay(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0's live batches are rank 0's, and the batch of rank 1 came through the replay
    socket (per-rank `replay` lists swapped): the warning said to check the events endpoints
    and dp_size, which were right. It names the replay socket now."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=4)  # rank 0
        caplog.set_level(logging.WARNING, logger="indexer.stream")
        stored = Stored(block_hashes=[3], parent=None, token_ids=[30, 31, 32, 33], block_size=4)
        await pub.publish(EventBatch(0.0, [stored], 1), drop=True)  # repaired by the replay
        seq = await pub.publish(EventBatch(0.0, [], 0))
        assert await svc.wait_applied(WORKER, seq)
        assert svc.streams()[0].rank_mismatches == 1
        assert "DP RANK MISMATCH" in caplog.text
        assert f"through the replay socket {pub.replay_endpoint}" in caplog.text
        assert "check the worker's events endpoints" not in caplog.text


async def test_a_subscriber_started_on_a_requests_path_runs_outside_its_context(
    ctx: zmq.asyncio.Context,
) -> None:
    """A worker registered from a request's path (the router reads a worker that refused a
    rank again, and registers it anew) had its subscribers run in that request's context: its
    id on every line they logged, for as long as they ran ("replay from 12 timed out" minutes
    later, tagged with a request long gone), and its observation kept alive. Now they start
    in a context of their own."""
    said: list[tuple[str, str | None]] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            # called in the task that logs: what that task's context holds
            said.append((record.getMessage(), REQUEST.get()))

    handler = Said()
    logger = logging.getLogger("indexer.stream")
    logger.addHandler(handler)
    try:
        async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
            request = REQUEST.set("request-1")
            try:
                await connect(svc, pub)
            finally:
                REQUEST.reset(request)
            await pub.send_raw([b"kv", b"\x00" * 3, b"payload"])  # a bad seq frame: a warning
            await wait_until(lambda: any(STREAM in message for message, _ in said))
    finally:
        logger.removeHandler(handler)
    assert [request for message, request in said if STREAM in message] == [None]


async def test_without_a_replay_socket_a_late_dead_batch_at_the_new_runs_next_seq_is_skipped(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new process stays within the old run's seqs and idles past the window after the
    restart; then the dead process's queued batch arrives, at the new run's next seq. It was
    taken as the new run's (the window over) and its page predicted for good (QA). Nothing
    tells them apart without a replay socket: the stream is cleared and the batch skipped."""
    monkeypatch.setattr(restarts, "DEAD_RUN_S", 0.3)
    before = workload(seed=1, batches=6)
    new = workload(seed=2, batches=12)
    gone = workload(seed=3, batches=1)  # what the old process sent before it died
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, replay_endpoint=None)
        last = await publish_all(pub, before, settle=svc)
        pub.restart()
        new_last = await publish_all(pub, new[: last + 1], settle=svc)
        assert new_last == last  # the new run reaches the old one's newest seq, not past it
        await asyncio.sleep(0.5)  # idle past the window
        await pub.send_raw(build_live(b"kv", last + 1, encode_batch(gone[0], "array")))
        (sub,) = svc._workers[WORKER]
        await wait_until(lambda: sub.dead_batches == 1)
        assert svc.streams()[0].entries == 0  # nothing of either run is trusted
