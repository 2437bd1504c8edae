"""Restarts that seqs cannot show, and batches that arrive damaged: the epoch fence and refetch.

A scripted publisher on real ZMQ sockets (127.0.0.1) plays a worker whose process restarted
while the router was not looking: its seqs start again from 0 and reach the router's last seq,
so the numbers alone look continuous (seq aliasing). The router must notice from the batch at
its last seq (`indexer.fence`), drop the dead process's entries and apply the new process's
batches from its first one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import pytest
import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.errors import SnapshotError
from indexer.namespace import Namespace
from indexer.protocol.encode import encode_batch
from indexer.protocol.events import EventBatch, Stored, TokenId
from indexer.protocol.frames import build_live, build_replay_reply
from indexer.service import ORPHAN_GRACE_S, IndexerService
from indexer.snapshot import dump_index, load_index
from indexer.stats import StreamState, StreamStats
from indexer.stream import restarts
from tests.indexer.scripted import ScriptedPublisher, workload
from tests.indexer.test_subscriber_zmq import (
    STREAM,
    WORKER,
    connect,
    reference,
    view,
    wait_until,
)

# the idle probe on, fast: the aliasing case is the probe meeting the new process's seq L
PROBING = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0.05)
LIVE_ONLY = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0)
EMPTY = EventBatch(ts=0.0, events=[])


async def follow_old_epoch(svc: IndexerService, pub: ScriptedPublisher) -> list[EventBatch]:
    """Connect and apply an 'old process' history; returns every batch it published."""
    await connect(svc, pub)
    old = [EMPTY] * pub.next_seq + workload(seed=1, batches=8)
    for batch in old[pub.next_seq :]:
        await pub.publish(batch)
    assert await svc.wait_applied(WORKER, len(old) - 1)
    assert view(svc.index, STREAM) == view(reference(old), STREAM) != {}
    return old


def new_epoch(old_last: int) -> list[EventBatch]:
    """What the restarted process publishes: more batches than the old one had (last + 3)."""
    return workload(seed=2, batches=old_last + 3)


async def dump_then_restart(
    svc: IndexerService, pub: ScriptedPublisher, *, drop: bool
) -> tuple[list[EventBatch], bytes, list[EventBatch]]:
    """Follow an old process, dump the index, then restart the publisher and publish a new
    epoch (its live copies dropped with `drop`): (old batches, the dump, new batches)."""
    old = await follow_old_epoch(svc, pub)
    snapshot = svc.dump()
    pub.restart()
    new = new_epoch(len(old) - 1)
    for batch in new:
        await pub.publish(batch, drop=drop)
    return old, snapshot, new


def synced(svc: IndexerService) -> bool:
    return svc.streams()[0].state is StreamState.SYNCED


async def new_run_heard(svc: IndexerService, pub: ScriptedPublisher) -> None:
    """A restart whose new run the SUB, connected all along (the scripted publisher keeps its
    sockets, as a hop between it and the router would), delivered none of is rebuilt by
    replay and stays unproven (the path may be deaf: `Repair._undelivered_since`): a live
    batch of the new run follows on, and it is `synced`. (The rebuild's answer may still be
    read, `syncing`, when its last batch is applied: its end is waited for.)"""
    await wait_until(lambda: svc.streams()[0].state is not StreamState.SYNCING)
    assert svc.streams()[0].state is StreamState.UNVERIFIED
    assert await svc.wait_applied(WORKER, await pub.publish(EMPTY))
    await wait_until(lambda: synced(svc))


async def test_the_idle_probe_meeting_a_new_process_at_our_seq_rebuilds(
    ctx: zmq.asyncio.Context,
) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(PROBING) as svc:
        old = await follow_old_epoch(svc, pub)
        last = len(old) - 1
        pub.restart()  # same sockets: no connection drops, only the batches tell
        new = new_epoch(last)
        for batch in new:
            await pub.publish(batch, drop=True)  # every live copy missed, all buffered
        # the probe asks from `last`: the new process has a batch there, a different one
        await wait_until(lambda: svc.streams()[0].restarts == 1)
        await wait_until(lambda: svc._workers[WORKER][0].tracker.last == len(new) - 1)
        # the dead process's entries are gone and the new batches 0..last are applied too
        assert view(svc.index, STREAM) == view(reference(new), STREAM)
        assert svc.streams()[0].clears >= 1
        await new_run_heard(svc, pub)


async def test_a_live_gap_into_a_new_process_rebuilds(ctx: zmq.asyncio.Context) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        pub.restart()
        new = new_epoch(len(old) - 1)
        for batch in new[:-1]:
            await pub.publish(batch, drop=True)
        # the last one arrives live: a gap after our seq, whose repair meets the new epoch
        assert await svc.wait_applied(WORKER, await pub.publish(new[-1]))
        await wait_until(lambda: synced(svc))
        stats = svc.streams()[0]
        assert stats.restarts == 1 and stats.gaps == 1
        assert view(svc.index, STREAM) == view(reference(new), STREAM)


async def test_a_replay_that_no_longer_holds_our_batch_proves_nothing(
    ctx: zmq.asyncio.Context,
) -> None:
    async with ScriptedPublisher(ctx, buffer_steps=3) as pub, IndexerService(PROBING) as svc:
        old = await follow_old_epoch(svc, pub)
        more = workload(seed=3, batches=3)
        for batch in more:
            await pub.publish(batch, drop=True)
        # the buffer holds exactly the three batches after ours: they may well follow it, but
        # nothing proves that, so the state is rebuilt from them (cleared, never a restart)
        await wait_until(lambda: svc._workers[WORKER][0].tracker.last == len(old) + 2)
        stats = svc.streams()[0]
        assert stats.restarts == 0 and stats.clears == 1
        rebuilt = reference([EMPTY] * len(old))
        for seq, batch in enumerate(more, start=len(old)):
            rebuilt.apply(STREAM, batch, seq)
        assert view(svc.index, STREAM) == view(rebuilt, STREAM)


async def test_a_dropped_connection_trusts_nothing_until_proven(ctx: zmq.asyncio.Context) -> None:
    async with IndexerService(LIVE_ONLY) as svc:
        pub = ScriptedPublisher(ctx)
        async with pub:
            old = await follow_old_epoch(svc, pub)
        # the process died: its sockets closed, the SUB's monitor sees the connection drop
        await wait_until(lambda: svc.streams()[0].state is StreamState.UNVERIFIED)
        doc = workload(seed=1, batches=8)
        stored = next(e for b in doc for e in b.events if isinstance(e, Stored))
        tokens = list(stored.token_ids)
        salt = stored.cache_salt
        assert len(svc.index) > 0  # still held, but predicting nothing
        assert svc.query(Namespace("", None, salt), tokens)[WORKER].matched_blocks == 0
        # a new process on the same ports, with fewer batches than the old one had
        async with ScriptedPublisher(ctx, endpoints=(pub.endpoint, pub.replay_endpoint)) as again:
            new = workload(seed=2, batches=3)
            for batch in new:
                await again.publish(batch, drop=True)
            await wait_until(lambda: synced(svc) and svc.streams()[0].restarts == 1)
            assert view(svc.index, STREAM) == view(reference(new), STREAM)
            assert svc.streams()[0].verifications >= 1
            assert len(old) > len(new)


async def test_the_idle_probe_trusts_no_stream_whose_event_connection_is_down(
    ctx: zmq.asyncio.Context,
) -> None:
    """The events path down (a forwarder's PUB gone), the replay socket answering: the probe's
    answer proves the stream only up to the moment it was read, and a SUB that is not connected
    hears nothing published after it. Before, the idle probe trusted the suspected stream again
    (QA: 288 tokens matched, 0 cached, after a flush the router could not hear)."""
    async with IndexerService(PROBING) as svc:
        pub = ScriptedPublisher(ctx)
        async with pub:
            await follow_old_epoch(svc, pub)
            held = [
                (Namespace("", None, e.cache_salt), list(e.token_ids))
                for b in workload(seed=1, batches=8)
                for e in b.events
                if isinstance(e, Stored)
            ]
            namespace, tokens = next(
                (ns, t) for ns, t in held if svc.query(ns, t)[WORKER].matched_blocks > 0
            )  # a page the stream holds (the workload evicts some of its own)
            pub.pub.close(linger=0)  # the events path goes; the replay socket answers on
            await wait_until(lambda: svc.streams()[0].state is StreamState.UNVERIFIED)
            probes = svc.streams()[0].probes
            loop = asyncio.get_running_loop()
            until = loop.time() + 0.6  # a dozen probes at 0.05 s
            while loop.time() < until:
                assert svc.query(namespace, tokens)[WORKER].matched_blocks == 0
                assert svc.streams()[0].state is StreamState.UNVERIFIED
                await asyncio.sleep(0.01)
            assert svc.streams()[0].probes > probes + 3  # the probe ran meanwhile


async def test_a_catch_up_whose_event_connection_never_came_is_not_trusted(
    ctx: zmq.asyncio.Context,
) -> None:
    """The replay socket answers, the events port reaches nothing (a wrong port, a forwarder
    down): the catch-up applies the buffer, but a SUB that never connected hears nothing
    published since. Before, the stream was `synced` as soon as the answer ended."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(PROBING) as svc:
        doc = workload(seed=1, batches=8)
        for batch in doc:
            await pub.publish(batch)  # into the replay buffer; no subscriber yet
        with socket.socket() as unused:  # a port nothing listens on
            unused.bind(("127.0.0.1", 0))
            nowhere = f"tcp://127.0.0.1:{unused.getsockname()[1]}"
        config = StreamConfig(endpoint=nowhere, replay_endpoint=pub.replay_endpoint, topic="kv")
        await svc.add_worker(WORKER, [config])
        await wait_until(lambda: len(svc.index) > 0)  # the buffer was read
        held = [
            (Namespace("", None, e.cache_salt), list(e.token_ids))
            for b in doc
            for e in b.events
            if isinstance(e, Stored)
        ]
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.5  # ten probes at 0.05 s
        while loop.time() < until:
            assert svc.streams()[0].state is StreamState.SYNCING
            assert all(svc.query(ns, t)[WORKER].matched_blocks == 0 for ns, t in held)
            await asyncio.sleep(0.02)


async def test_a_health_transition_is_proven_and_keeps_the_entries(
    ctx: zmq.asyncio.Context,
) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        svc.suspect_restart(WORKER, "its health check came back")
        assert svc.streams()[0].state is StreamState.UNVERIFIED
        await wait_until(lambda: synced(svc))
        stats = svc.streams()[0]
        assert (stats.verifications, stats.restarts, stats.clears) == (1, 0, 0)
        assert view(svc.index, STREAM) == view(reference(old), STREAM)


async def test_without_a_replay_socket_a_suspected_restart_clears(
    ctx: zmq.asyncio.Context,
) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        await connect(svc, pub, replay_endpoint=None)
        await pub.publish(workload(seed=1, batches=1)[0])
        await wait_until(lambda: len(svc.index) > 0)
        svc.suspect_restart(WORKER, "its health check came back")
        await wait_until(lambda: synced(svc))
        assert len(svc.index) == 0 and svc.streams()[0].restarts == 1


async def test_a_snapshot_of_a_dead_process_is_not_trusted(ctx: zmq.asyncio.Context) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        _, snapshot, new = await dump_then_restart(svc, pub, drop=True)
        # the snapshot's seq exists in the new process too; only its batch digest differs
        svc.load(snapshot)
        await wait_until(lambda: svc.streams()[0].restarts == 1)
        await wait_until(lambda: svc._workers[WORKER][0].tracker.last == len(new) - 1)
        assert view(svc.index, STREAM) == view(reference(new), STREAM)
        await new_run_heard(svc, pub)


async def test_a_damaged_live_batch_is_fetched_again(ctx: zmq.asyncio.Context) -> None:
    batches = workload(seed=4, batches=40)
    damaged = {3, 4, 17, 39}
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        await connect(svc, pub)
        warm = pub.next_seq
        last = -1
        for i, batch in enumerate(batches):
            # one at a time: a refetch replays everything buffered after the damaged batch,
            # which would turn later live copies (damaged or not) into duplicates
            last = await pub.publish(batch, corrupt_live=i in damaged)
            assert await svc.wait_applied(WORKER, last)
        await wait_until(lambda: synced(svc))
        stats = svc.streams()[0]
        assert stats.refetches == len(damaged) and stats.decode_errors == len(damaged)
        assert stats.lost_batches == 0 and stats.clears == 0 and stats.gaps == 0
        # every batch applied as published: the loss-free index
        want = reference([EMPTY] * warm + batches)
        assert view(svc.index, STREAM) == view(want, STREAM)


async def test_a_batch_damaged_in_the_buffer_too_is_lost_and_clears(
    ctx: zmq.asyncio.Context,
) -> None:
    batches = workload(seed=4, batches=6)
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        await connect(svc, pub)
        for batch in batches[:3]:
            await pub.publish(batch)
        await pub.publish_payload(b"\xc1 damaged at the source")
        last = -1
        for batch in batches[3:]:
            last = await pub.publish(batch)
        assert await svc.wait_applied(WORKER, last)
        await wait_until(lambda: synced(svc))
        stats = svc.streams()[0]
        assert (stats.refetches, stats.lost_batches, stats.clears) == (1, 1, 1)
        # the lost batch may have removed blocks: nothing from before it is trusted
        lost_at = last - len(batches[3:])
        want = reference([EMPTY] * (lost_at + 1))
        for seq, batch in enumerate(batches[3:], start=lost_at + 1):
            want.apply(STREAM, batch, seq)
        assert view(svc.index, STREAM) == view(want, STREAM)


async def test_a_late_joiner_catching_up_from_zero_is_no_restart(ctx: zmq.asyncio.Context) -> None:
    # a router that joins after the worker published: a catch-up from 0 is not a restart
    async with ScriptedPublisher(ctx) as pub, IndexerService(PROBING) as svc:
        batches = workload(seed=6, batches=5)
        for batch in batches:
            await pub.publish(batch)
        cfg = StreamConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="kv")
        await svc.add_worker(WORKER, [cfg])
        await wait_until(lambda: svc._workers[WORKER][0].tracker.last == len(batches) - 1)
        stats = svc.streams()[0]
        assert stats.restarts == 0 and stats.clears == 0
        assert view(svc.index, STREAM) == view(reference(batches), STREAM)


async def test_a_probe_answered_across_a_snapshot_load_does_not_prove_the_snapshot(
    ctx: zmq.asyncio.Context,
) -> None:
    """A probe in flight when a snapshot is loaded was asked for the state the load replaced:
    its answer proves that state, not the snapshot's. Before, it made the loaded stream
    trusted, the dead process's entries predicting hits until the next probe."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(PROBING) as svc:
        old, snapshot, new = await dump_then_restart(svc, pub, drop=False)
        await wait_until(lambda: svc._workers[WORKER][0].tracker.last == len(new) - 1)
        await wait_until(lambda: synced(svc))
        # a slow replay socket: the next probe's batches come at once (its fence proven on
        # the state the load will replace), its end marker only later
        pub.end_delay_s = 0.3
        asked = len(pub.replay_requests)
        await wait_until(lambda: len(pub.replay_requests) > asked)
        await asyncio.sleep(0.05)
        svc.load(snapshot)  # while that probe waits for the end of its answer
        dead = view(reference(old), STREAM)
        loaded = asyncio.get_running_loop().time()
        while asyncio.get_running_loop().time() - loaded < 1.5:
            holds_dead = view(svc.index, STREAM) == dead
            assert not (holds_dead and svc.streams()[0].state is not StreamState.UNVERIFIED)
            await asyncio.sleep(0.005)
        await wait_until(lambda: synced(svc))
        assert view(svc.index, STREAM) == view(reference(new), STREAM)


async def test_a_snapshot_stream_with_entries_but_no_seq_is_not_trusted(
    ctx: zmq.asyncio.Context,
) -> None:
    """Nothing can prove entries no seq stands for (a `kvroute replay --from` dump's part of
    a stream): they go, and the stream rebuilds from the worker's replay at once, `syncing`
    until that is read. Before, it read `synced` with 0 entries and no seq, and rebuilt only
    at the next probe (with the probe off: never, until the worker published again)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        index = load_index(svc.dump())
        index.set_last_seq(STREAM, None)  # a snapshot that names no seq for its entries
        withheld: list[int] = []

        def first_unanswered(start: int) -> list[list[bytes]] | None:
            if withheld:
                return None
            withheld.append(start)
            return []  # no reply, no end marker: the first rebuild times out (and is seen)

        pub.answer_with = first_unanswered
        svc.load(dump_index(index))
        assert len(svc.index) > 0
        assert svc.streams()[0].state is StreamState.UNVERIFIED
        seen: list[tuple[StreamState, int | None]] = []
        rebuilt = states_until(
            svc, lambda: synced(svc) and svc.streams()[0].last_seq == len(old) - 1, seen
        )
        await wait_until(rebuilt, timeout_s=3.0)
        assert withheld == [0]  # asked from 0: nothing to continue from
        assert (StreamState.SYNCING, None) in seen
        assert (StreamState.SYNCED, None) not in seen  # cleared, it never read `synced`
        assert view(svc.index, STREAM) == view(reference(old), STREAM)


async def test_a_stream_the_snapshot_lacks_is_rebuilt_from_the_replay_at_once(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A snapshot that does not know a subscribed stream (another router's, of other workers)
    leaves it empty: it is `syncing` while the worker's whole buffer is read, at once, and
    then holds what it held. Before, it read `synced` with no seq and no entries (predicting
    none of what the worker holds) until the next probe, which also said the event path
    might be deaf (its batches were delivered, to the state the load replaced), or, with
    the probe off, until the worker published again (QA: 560 tokens held, 0 predicted)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        async with IndexerService(LIVE_ONLY) as other:
            foreign = other.dump()  # knows no stream of this worker
        seen: list[tuple[StreamState, int | None]] = []
        with caplog.at_level(logging.WARNING, logger="indexer"):
            svc.load(foreign)
            stats = svc.streams()[0]
            assert (stats.state, stats.last_seq) == (StreamState.SYNCING, None)
            rebuilt = states_until(
                svc, lambda: synced(svc) and svc.streams()[0].last_seq == len(old) - 1, seen
            )
            await wait_until(rebuilt, timeout_s=3.0)
        assert (StreamState.SYNCED, None) not in seen  # empty, it never read `synced`
        assert view(svc.index, STREAM) == view(reference(old), STREAM)
        assert not [r for r in caplog.records if "deaf" in r.getMessage()], caplog.text


async def test_a_snapshot_keeps_this_process_counters_and_its_orphans_go_in_time(
    ctx: zmq.asyncio.Context,
) -> None:
    """A loaded stream's counters are this process's (metrics never go back); the snapshot's
    streams no worker takes up are dropped after the grace (they were dumped again forever)."""
    offset = [0.0]
    async with (
        ScriptedPublisher(ctx) as pub,
        IndexerService(LIVE_ONLY, clock=lambda: time.monotonic() + offset[0]) as svc,
    ):
        await follow_old_epoch(svc, pub)
        svc.index.counters(STREAM).clears = 7  # this process's history so far
        index = load_index(svc.dump())
        index.add_stream("ghost#dp0", block_size=4)
        ghost = [Stored(block_hashes=[1], parent=None, token_ids=[9, 9, 9, 9], block_size=4)]
        index.apply("ghost#dp0", EventBatch(0.0, list(ghost)), 0)
        index.counters(STREAM).clears = 0  # the snapshot's own count
        svc.load(dump_index(index))
        assert svc.streams()[0].clears >= 7
        assert "ghost#dp0" in svc.index.streams()  # kept for a worker that may come
        svc.namespaces()
        assert "ghost#dp0" in svc.index.streams()  # within the grace
        offset[0] += ORPHAN_GRACE_S + 1
        svc.namespaces()
        assert svc.index.streams() == [STREAM]
        assert "ghost#dp0" not in load_index(svc.dump()).streams()


async def test_batches_of_the_dead_process_still_queued_after_a_restart_are_not_taken(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A router behind its socket while a worker restarts reads the dead process's last batches
    after the new process's buffer proved the restart. Before, the first was skipped as a bad
    seq, the second made the (healthy) replay socket "another publisher's", and the rest were
    applied: the dead process's cache predicted."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(PROBING) as svc:
        old = await follow_old_epoch(svc, pub)
        last = len(old) - 1
        later = workload(seed=5, batches=4)  # what the old process sent before it died
        pub.restart()
        new = workload(seed=6, batches=2)
        await pub.publish(new[0], drop=True)  # the new process's startup batch, buffered
        await wait_until(lambda: svc.streams()[0].restarts == 1)
        await wait_until(lambda: svc._workers[WORKER][0].tracker.last == 0)
        # (replayed only, the SUB connected all along: unproven until a live batch follows)
        await wait_until(lambda: svc.streams()[0].state is StreamState.UNVERIFIED)
        caplog.set_level(logging.ERROR, logger="indexer.stream")
        for seq, batch in enumerate(later, start=last + 1):  # now read off the socket
            await pub.send_raw(build_live(b"kv", seq, encode_batch(batch, "array")))
        sub = svc._workers[WORKER][0]
        await wait_until(lambda: sub.dead_batches == len(later))  # each skipped, counted
        # none of them was taken: the index is the new process's, its replay socket trusted
        assert view(svc.index, STREAM) == view(reference(new[:1]), STREAM)
        assert not sub._replay_foreign
        # the new process goes on: its next batch follows on what it buffers
        assert await svc.wait_applied(WORKER, await pub.publish(new[1]))
        await wait_until(lambda: svc._workers[WORKER][0].tracker.last == 1)
        assert view(svc.index, STREAM) == view(reference(new), STREAM)
        assert not svc._workers[WORKER][0]._replay_foreign
        assert "another publisher's" not in caplog.text


async def test_a_burst_after_a_restart_is_proven_by_few_replay_answers(
    ctx: zmq.asyncio.Context,
) -> None:
    """In the window after a restart, each live batch past the old run's newest seq is proven
    the new process's by its replay socket. Each was one round trip, asking from its seq: a
    burst of n batches read the buffer n times (QA: 600 batches, 597 requests, 4 s behind). The
    last answer's batches now prove those it held; only a batch it did not hold asks again."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        pub.restart()
        new = workload(seed=7, batches=len(old) + 60)
        asked = len(pub.replay_requests)
        for batch in new:  # the new process's burst, all sent before any is read
            await pub.publish(batch)
        assert await svc.wait_applied(WORKER, len(new) - 1)
        await wait_until(lambda: svc._workers[WORKER][0].tracker.last == len(new) - 1)
        assert view(svc.index, STREAM) == view(reference(new), STREAM)
        beyond = len(new) - len(old)  # the batches past the old run's newest seq
        assert len(pub.replay_requests) - asked < beyond // 4, pub.replay_requests[asked:]
        assert svc._workers[WORKER][0].dead_batches == 0


async def test_a_dead_backlog_drained_after_the_window_is_never_taken(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dead process's queued batches arrive after the window after the restart (a long
    backlog). The first was skipped as a bad seq, the second flagged the worker's advertised
    socket another publisher's and it and the rest were applied: the dead pages predicted.
    Each is asked for now; the new process's socket does not give it back: skipped."""
    monkeypatch.setattr(restarts, "DEAD_RUN_S", 0.3)
    async with ScriptedPublisher(ctx) as pub, IndexerService(PROBING) as svc:
        old = await follow_old_epoch(svc, pub)
        last = len(old) - 1
        later = workload(seed=5, batches=3)  # what the old process sent before it died
        pub.restart()
        new = workload(seed=6, batches=2)
        await pub.publish(new[0], drop=True)  # the new process's startup batch, buffered
        await wait_until(lambda: svc.streams()[0].restarts == 1)
        sub = svc._workers[WORKER][0]
        await wait_until(lambda: sub.tracker.last == 0)
        await asyncio.sleep(0.35)  # past the window
        caplog.set_level(logging.ERROR, logger="indexer.stream")
        for seq, batch in enumerate(later, start=last + 1):  # now read off the socket
            await pub.send_raw(build_live(b"kv", seq, encode_batch(batch, "array")))
        await wait_until(lambda: sub.dead_batches == len(later))
        assert view(svc.index, STREAM) == view(reference(new[:1]), STREAM)
        assert not sub._replay_foreign and "another publisher's" not in caplog.text
        assert await svc.wait_applied(WORKER, await pub.publish(new[1]))
        await wait_until(lambda: sub.tracker.last == 1)
        assert view(svc.index, STREAM) == view(reference(new), STREAM)


async def test_a_new_process_whose_first_batch_we_see_is_our_last_seq_is_a_restart(
    ctx: zmq.asyncio.Context,
) -> None:
    """The restarted process's earlier batches were all dropped: the first live batch the
    router sees has exactly its last seq, a duplicate by number. Its bytes are not the batch
    applied there, and the replay socket has them: a restart, rebuilt. Before, it was skipped
    as a duplicate and the dead process's entries stayed."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        last = len(old) - 1
        pub.restart()  # same sockets: only the batches tell
        new = workload(seed=2, batches=last + 1)
        for batch in new[:-1]:
            await pub.publish(batch, drop=True)
        assert await pub.publish(new[-1]) == last  # live, at our last seq
        await wait_until(lambda: svc.streams()[0].restarts == 1 and synced(svc))
        assert view(svc.index, STREAM) == view(reference(new), STREAM)


def states_until(
    svc: IndexerService, done: Callable[[], bool], seen: list[tuple[StreamState, int | None]]
) -> Callable[[], bool]:
    """A `wait_until` predicate that also records every (state, last_seq) it polled."""

    def poll() -> bool:
        stats = svc.streams()[0]
        seen.append((stats.state, stats.last_seq))
        return done()

    return poll


@pytest.mark.parametrize("restarted", [False, True], ids=["same-process", "restarted"])
async def test_a_proof_answered_to_its_end_trusts_the_tail_and_resets_the_probe(
    ctx: zmq.asyncio.Context, restarted: bool
) -> None:
    """While a worker was down its replay socket did not answer the probes (the tail
    unproven, the probe backed off). The proof when it is back gets the whole answer: that
    proves the tail too, so the stream is synced at once. Before, it stayed `unverified`
    (predicting nothing) until the backed-off probe: up to 60 s for a real restart. (A new
    process none of whose batches the SUB, connected all along, delivered waits for its
    first live batch: `new_run_heard`.)"""
    config = IndexerConfig(replay_timeout_s=0.1, probe_interval_s=0.05, stale_after_s=60.0)
    async with ScriptedPublisher(ctx) as pub, IndexerService(config) as svc:
        old = await follow_old_epoch(svc, pub)
        sub = svc._workers[WORKER][0]
        pub.answer_replays = False  # down: the probes time out and back off
        await wait_until(lambda: sub._probe_wait_ms >= 1600)
        assert svc.streams()[0].state is StreamState.UNVERIFIED
        # (each probe's unanswered replay owes a proof: asked at the probe's back-off too)
        verified = svc.streams()[0].verifications
        # the loop now waits >= 1.6 s for its next probe: what follows is the proof's doing
        pub.answer_replays = True
        new = workload(seed=2, batches=3)
        if restarted:  # a new process with fewer batches than the old one had
            pub.restart()
            for batch in new:
                await pub.publish(batch, drop=True)
        svc.suspect_restart(WORKER, "its health check came back")
        if restarted:
            await wait_until(lambda: svc.streams()[0].restarts == 1, timeout_s=0.6)
            await wait_until(lambda: sub.tracker.last == len(new) - 1, timeout_s=0.6)
            await new_run_heard(svc, pub)
            new.append(EMPTY)
        else:
            await wait_until(lambda: synced(svc), timeout_s=0.6)
        assert sub._probe_wait_ms == 50
        stats = svc.streams()[0]
        assert stats.verifications > verified and stats.restarts == int(restarted)
        want = reference(new) if restarted else reference(old)
        assert view(svc.index, STREAM) == view(want, STREAM) != {}


async def test_a_proof_that_timed_out_is_followed_by_a_rebuild_from_zero(
    ctx: zmq.asyncio.Context,
) -> None:
    """The proof's replay timed out on a busy machine: the stream is cleared (nothing proved
    the publisher unchanged), and the new process's buffer is read soon after, probe or not.
    Before, the cleared stream read `synced` with nothing in it, and an idle worker's new
    cache was never fetched (with the probe on: not before the backed-off probe). Read by
    replay only, it is trusted once a live batch of the new run follows on, as when the proof
    finds the restart (`new_run_heard`; before, trusted whole at once: CI)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        last = len(old) - 1
        pub.restart()
        new = new_epoch(last)
        for batch in new:
            await pub.publish(batch, drop=True)  # an idle new process: nothing live follows
        withheld: list[int] = []

        def first_unanswered(start: int) -> list[list[bytes]] | None:
            if withheld:
                return None
            withheld.append(start)
            return []  # no reply, no end marker: the replay times out

        pub.answer_with = first_unanswered
        svc.suspect_restart(WORKER, "its health check came back")
        seen: list[tuple[StreamState, int | None]] = []
        rebuilt = states_until(
            svc,
            lambda: (
                svc.streams()[0].state is not StreamState.SYNCING
                and svc.streams()[0].last_seq == last + 2
            ),
            seen,
        )
        await wait_until(rebuilt, timeout_s=3.0)
        assert withheld == [last]
        # cleared and not yet rebuilt, it never read `synced`
        assert (StreamState.SYNCED, None) not in seen
        assert (StreamState.SYNCING, None) in seen
        assert view(svc.index, STREAM) == view(reference(new), STREAM)
        stats = svc.streams()[0]
        assert (stats.verifications, stats.restarts) == (1, 1)
        await new_run_heard(svc, pub)


async def test_a_proof_whose_answer_stopped_short_trusts_nothing_until_it_ends(
    ctx: zmq.asyncio.Context,
) -> None:
    """The proof's answer brought the fence (the same process) and then stopped before its
    end: the batches after the one it brought, missed while the connection was down, may
    have removed blocks. Nothing is trusted until an answer ends; it is asked again soon.
    Before, the stream read `synced` without them, for good on a quiet worker. Its SUB's
    connection never dropped, so batches it did not deliver (they were published to it) keep
    the stream `unverified` after the whole answer too, until a live batch follows on (the
    live path may be deaf: `_undelivered_since`)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        last = len(old) - 1
        missed = workload(seed=9, batches=3)
        for batch in missed:
            await pub.publish(batch, drop=True)
        cut: list[int] = []

        def stop_short(start: int) -> list[list[bytes]] | None:
            if cut:
                return None
            cut.append(start)
            held = [(seq, payload) for seq, payload in pub.buffer if start <= seq <= start + 1]
            return [build_replay_reply(pub.topic, seq, payload) for seq, payload in held]

        pub.answer_with = stop_short
        svc.suspect_restart(WORKER, "its health check came back")
        seen: list[tuple[StreamState, int | None]] = []
        whole = states_until(svc, lambda: svc.streams()[0].last_seq == last + 3, seen)
        await wait_until(whole, timeout_s=3.0)
        assert cut == [last]
        assert (StreamState.UNVERIFIED, last + 1) in seen  # the fence and one batch: untrusted
        assert all(state is not StreamState.SYNCED for state, seq in seen)
        assert view(svc.index, STREAM) == view(reference(old + missed), STREAM)
        await asyncio.sleep(0.3)  # (no live batch: the tail the SUB missed stays unproven)
        assert svc.streams()[0].state is StreamState.UNVERIFIED
        assert await svc.wait_applied(WORKER, await pub.publish(EMPTY))
        await wait_until(lambda: synced(svc))
        assert svc.streams()[0].restarts == 0


def _reshaped(snapshot: bytes, *, block_size: int = 4, model: str = "") -> bytes:
    """`snapshot` whose stream is one of another shape, at the same seq: one page of
    `block_size` tokens under `model`."""
    index = load_index(snapshot)
    last = index.last_seq(STREAM)
    index.drop_stream(STREAM)
    index.add_stream(STREAM, model=model, block_size=block_size)
    page = Stored(
        block_hashes=[77], parent=None, token_ids=list(range(block_size)), block_size=block_size
    )
    batch = EventBatch(ts=0.0, events=[page])
    index.apply(STREAM, batch, last, encode_batch(batch))
    return dump_index(index)


@pytest.mark.parametrize(
    ("shape", "said"),
    [
        ({"block_size": 8}, "block size 8 in the snapshot, 4 live"),
        ({"model": "other-model"}, "model 'other-model' in the snapshot, '' live"),
    ],
)
async def test_a_snapshot_stream_of_another_shape_is_dropped_at_load(
    ctx: zmq.asyncio.Context,
    caplog: pytest.LogCaptureFixture,
    shape: dict[str, object],
    said: str,
) -> None:
    """The live stream's block size (learned from its events here) and model win: kept, the
    snapshot's block size refused every later event of the worker as a mismatch, and another
    model's entries stayed in its namespace (misses)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        snapshot = _reshaped(svc.dump(), **shape)  # type: ignore[arg-type]
        with caplog.at_level(logging.INFO, logger="indexer"):
            svc.load(snapshot)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert [m for m in warned if said in m and STREAM in m], warned
        assert (svc.index.block_size(STREAM), svc.index.entries(STREAM)) == (4, 0)
        assert svc.index.stream_model(STREAM)[0] == ""
        loaded = [r.getMessage() for r in caplog.records if "snapshot loaded" in r.getMessage()]
        assert loaded and "1 dropped" in loaded[0], loaded
        # the worker's next batches apply (the stream rebuilds from its replay)
        more = workload(seed=7, batches=3)
        for batch in more:
            await pub.publish(batch)
        assert await svc.wait_applied(WORKER, len(old) + len(more) - 1)
        assert svc.streams()[0].block_size_mismatches == 0
        assert view(svc.index, STREAM) == view(reference(old + more), STREAM)


async def test_every_snapshot_load_says_what_became_of_it(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """One line per load (refused: why; accepted: streams and entries), and one per loaded
    stream once its fence is proven or it is cleared, whatever the rate limiter let through."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        _, snapshot, _ = await dump_then_restart(svc, pub, drop=False)
        with caplog.at_level(logging.INFO, logger="indexer"):
            with pytest.raises(SnapshotError):
                svc.load(b"not a snapshot")
            entries = load_index(snapshot).entries(STREAM)
            svc.load(snapshot)
            await wait_until(lambda: synced(svc))
            svc.load(svc.dump())  # the new process's own state: proven
            await wait_until(lambda: synced(svc))
        said = [r.getMessage() for r in caplog.records]
        assert [m for m in said if "snapshot load refused" in m], said
        loads = [m for m in said if m.startswith("snapshot loaded: ")]
        assert len(loads) == 2, said
        assert loads[0].startswith(f"snapshot loaded: 1 streams, {entries} entries; 1 of ")
        outcomes = [
            r.getMessage()
            for r in caplog.records
            if "state loaded from a snapshot " in r.getMessage() and r.levelno == logging.INFO
        ]
        assert len(outcomes) == 2, said
        assert "not proven" in outcomes[0] and "cleared" in outcomes[0], outcomes
        assert "proven at seq" in outcomes[1] and "not proven" not in outcomes[1], outcomes


def _outcomes(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The once-per-load lines that say what became of a snapshot's stream."""
    return [
        r.getMessage()
        for r in caplog.records
        if "state loaded from a snapshot " in r.getMessage() and r.levelno == logging.INFO
    ]


async def test_a_proof_whose_replay_did_not_answer_says_so(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker stopped (SIGSTOP), its replay timed out: the line said "not proven (the worker
    restarted since, or its replay does not reach back to seq N)", neither of which was so."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        old = await follow_old_epoch(svc, pub)
        pub.answer_with = lambda start: []  # no reply, no end marker: every replay times out
        with caplog.at_level(logging.INFO, logger="indexer"):
            svc.load(svc.dump())
            await wait_until(lambda: svc.streams()[0].state is not StreamState.UNVERIFIED)
        (outcome,) = _outcomes(caplog)
        assert f"its replay from seq {len(old) - 1} did not answer to its end" in outcome
        assert "restarted" not in outcome and "reach back" not in outcome


async def test_an_orphan_taken_up_by_another_process_is_not_said_proven(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A snapshot's orphan stream taken up by a worker that is another process, with fewer
    seqs: the stream was cleared as "it restarted" (it never did), and the proof of what was
    rebuilt from the new process then read `state loaded from a snapshot proven at seq 5`."""
    async with ScriptedPublisher(ctx) as old_pub, IndexerService(LIVE_ONLY) as svc:
        await follow_old_epoch(svc, old_pub)
        for i in range(200):  # far ahead of what the other process will have sent
            last = await old_pub.publish(EventBatch(ts=1000.0 + i, events=[]))
        assert await svc.wait_applied(WORKER, last)
        snapshot = svc.dump()
    async with ScriptedPublisher(ctx) as pub, IndexerService(LIVE_ONLY) as svc:
        with caplog.at_level(logging.INFO, logger="indexer"):
            svc.load(snapshot)  # no worker yet: the stream is an orphan, kept for one
            for batch in workload(seed=5, batches=6):  # another process, seqs far below
                await pub.publish(batch, drop=True)  # all buffered: its replay gives them
            cfg = StreamConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)
            await svc.add_worker(WORKER, [cfg])
            await wait_until(lambda: synced(svc) and svc.streams()[0].last_seq == 5)
        outcomes = _outcomes(caplog)
        assert len(outcomes) == 1, outcomes
        assert outcomes[0].startswith(f"stream {STREAM}: state loaded from a snapshot not proven")
        assert "not the process this state was taken from" in outcomes[0], outcomes
        said = [r.getMessage() for r in caplog.records]
        assert not [m for m in said if m.endswith(": it restarted")], said


# a page one rank of a two-rank worker stores, for the DP tests below
_DP_PAGE: list[TokenId] = [1, 2, 3, 4]
_DP_STORED = EventBatch(
    0.0, [Stored(block_hashes=[7], parent=None, token_ids=_DP_PAGE, block_size=4)]
)


def _dp_streams(pubs: tuple[ScriptedPublisher, ...], *, replay: bool) -> list[StreamConfig]:
    """One stream per rank, rank r on `pubs[r]`'s sockets (its replay socket if `replay`)."""
    return [
        StreamConfig(
            endpoint=pub.endpoint,
            replay_endpoint=pub.replay_endpoint if replay else None,
            topic="kv",
            block_size=4,
            dp_rank=dp,
        )
        for dp, pub in enumerate(pubs)
    ]


def _rank(svc: IndexerService, dp: int) -> StreamStats:
    """The stats of rank `dp`'s stream of the DP worker."""
    return next(s for s in svc.streams() if s.dp_rank == dp)


def _dp_predicted(svc: IndexerService, dp: int) -> int:
    """What rank `dp` is predicted to hold of `_DP_PAGE`."""
    return svc.query(Namespace(), [*_DP_PAGE, 9])[WORKER].ranks[dp].matched_tokens


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
async def test_a_restart_one_rank_finds_makes_its_sibling_ranks_suspect_at_once(
    ctx: zmq.asyncio.Context, replay: bool
) -> None:
    """A worker of two ranks restarts; rank 0's stream finds it (its seq went back), rank 1's
    connection did not drop (a forwarder between) and its new process is quiet. The ranks of
    one server restart together: rank 1 is suspected the moment rank 0 finds the restart, and
    proven (rebuilt from its new, empty buffer) or, without a replay socket, cleared. Before,
    it predicted the dead process's page until its own probe found out (QA: 288 tokens for
    about 1.2 s; without the probe, for good). Its restart, found by that check, is not told
    to rank 0 again: without replay sockets each suspicion clears, and they would take turns."""
    stored = _DP_STORED

    async with (
        ScriptedPublisher(ctx) as r0,
        ScriptedPublisher(ctx) as r1,
        IndexerService(LIVE_ONLY) as svc,
    ):
        await svc.add_worker(WORKER, _dp_streams((r0, r1), replay=replay))
        subs = sorted(svc._workers[WORKER], key=lambda sub: sub.config.dp_rank)
        for sub, pub in zip(subs, (r0, r1), strict=True):
            for _ in range(100):  # until each SUB really receives (the slow joiner)
                await pub.publish(EMPTY)
                await asyncio.sleep(0.02)
                if sub.tracker.live is not None:
                    break
        await r1.publish(stored)
        # (applied: its seq is taken before a live check's round trip, and applied after it)
        await wait_until(
            lambda: _dp_predicted(svc, 1) == 4 and _rank(svc, 1).state is StreamState.SYNCED
        )
        r0.restart()
        r1.restart()  # same sockets: nothing drops, rank 1's new process publishes nothing
        await r0.publish(EventBatch(1.0, []))  # seq 0: rank 0 sees its seq go back
        await wait_until(lambda: _rank(svc, 0).restarts == 1)
        assert _dp_predicted(svc, 1) == 0  # at once, not at rank 1's next probe
        await wait_until(
            lambda: _rank(svc, 1).restarts == 1 and _rank(svc, 1).state is StreamState.SYNCED
        )
        assert _rank(svc, 1).entries == 0 and _dp_predicted(svc, 1) == 0
        seq = await r0.publish(stored)  # the new process's page on rank 0
        await wait_until(lambda: _rank(svc, 0).last_seq == seq)
        await asyncio.sleep(0.3)  # no suspicion comes back to rank 0 from rank 1's restart
        assert (_rank(svc, 0).restarts, _rank(svc, 1).restarts) == (1, 1)
        if replay:  # (without one, the window after a restart predicts nothing: 5 s)
            assert _dp_predicted(svc, 0) == 4 and _rank(svc, 0).state is StreamState.SYNCED


@pytest.mark.parametrize("rank0_holds", [False, True], ids=["rank0-quiet", "rank0-holds"])
async def test_a_rank_whose_connection_drops_makes_its_siblings_suspect_at_once(
    ctx: zmq.asyncio.Context, rank0_holds: bool
) -> None:
    """A worker of two ranks dies: rank 0's event connection drops (a restart candidate, whose
    proof waits for the reconnect), rank 1's does not (a forwarder between) and its new process
    is quiet. Rank 1 predicts nothing from the drop on, before any proof. Before, siblings were
    told only once a proof found the restart (the new process served first) and, when rank 0
    held nothing, never: its suspicion stopped there (QA: 304 tokens matched, 0 cached)."""
    stored = _DP_STORED

    async with (
        ScriptedPublisher(ctx) as r0,
        ScriptedPublisher(ctx) as r1,
        IndexerService(LIVE_ONLY) as svc,
    ):
        await svc.add_worker(WORKER, _dp_streams((r0, r1), replay=True))
        subs = sorted(svc._workers[WORKER], key=lambda sub: sub.config.dp_rank)
        # rank 0 publishes nothing (it holds nothing, no seq): connected is all it is
        await wait_until(lambda: subs[0]._connected)
        for _ in range(100):  # until rank 1's SUB really receives (the slow joiner)
            await r1.publish(EMPTY)
            await asyncio.sleep(0.02)
            if subs[1].tracker.live is not None:
                break
        await r1.publish(stored)
        # (applied: its seq is taken before a live check's round trip, and applied after it)
        await wait_until(
            lambda: _dp_predicted(svc, 1) == 4 and _rank(svc, 1).state is StreamState.SYNCED
        )
        if rank0_holds:
            seq0 = await r0.publish(stored)
            await wait_until(lambda: _rank(svc, 0).last_seq == seq0 and _dp_predicted(svc, 0) == 4)
        else:
            assert subs[0].tracker.last is None and _rank(svc, 0).entries == 0
        assert _dp_predicted(svc, 1) == 4
        r1.restart()  # same sockets (behind a forwarder): nothing drops on rank 1
        r0.pub.close(linger=0)  # rank 0's process dies: its connection drops, no reconnect
        r0.router.close(linger=0)
        await wait_until(lambda: not subs[0]._connected)
        await wait_until(lambda: _dp_predicted(svc, 1) == 0, timeout_s=1.0)
        # rank 1 is proven through its own replay socket: the new process holds nothing
        await wait_until(
            lambda: _rank(svc, 1).restarts == 1 and _rank(svc, 1).state is StreamState.SYNCED
        )
        assert (
            _rank(svc, 1).entries == 0 and _dp_predicted(svc, 1) == 0 and _dp_predicted(svc, 0) == 0
        )
