"""Faults on the replay link that nothing but silence shows: a worker behind a hop that keeps
the router's replay connection open while the process behind it is gone (a TCP proxy, a
stateful middlebox), and a worker that hangs.

The replay DEALER is the one socket connected to the worker's process itself (its events may
come through a forwarder that stays up), so its ZMTP heartbeat is the process's pulse: a PING
every quarter of `replay_timeout_s`, the connection dropped when nothing came back within
`replay_timeout_s` (`indexer.replay_client`). A drop is a restart candidate
(`indexer.stream.restart_candidates`'s `_replay_link`). No idle probe runs within a test
(`PROBE_S`): a busy stream never probes, so what finds the fault here is the heartbeat, not a
probe that happens to fall in the right moment. Real reference workers, a real forwarder, a
real TCP relay.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq.asyncio

from indexer.config import IndexerConfig
from indexer.errors import ReplayError
from indexer.protocol.frames import build_replay_end, build_replay_reply, parse_replay_request
from indexer.replay_client import ReplayClient
from indexer.service import IndexerService
from indexer.stats import StreamState
from tests.indexer.test_forwarded_events import (
    PROBE_S,
    Hops,
    Restartable,
    TcpRelay,
    behind_hops,
    generate,
    predicted,
    streams_of,
    tokens,
    until,
)

REPLAY_TIMEOUT_S = 0.5
SETTINGS = IndexerConfig(probe_interval_s=PROBE_S, replay_timeout_s=REPLAY_TIMEOUT_S)
# a heartbeat slower than the restart test's restart: the new process's batches that follow on
# are applied before the drop is seen
SLOW_TIMEOUT_S = 2.0
SLOW = IndexerConfig(probe_interval_s=PROBE_S, replay_timeout_s=SLOW_TIMEOUT_S)
BUFFER = 64  # batches a busy worker's replay socket keeps (`buffer_steps`)


def found_within(timeout_s: float) -> float:
    """The heartbeat sees a silent process within 1.25 x `timeout_s` of its last bytes; the
    rest is slack for a loaded host (the subscriber reads the drop at its next loop pass)."""
    return 1.25 * timeout_s + 1.0


async def _proven(h: Hops, prompt: list[int]) -> None:
    """Wait until `prompt`, the worker's newest batch, is predicted and the stream trusted."""
    last = h.worker.next_seq() - 1
    await until(
        lambda: (
            predicted(h.svc, prompt) == [80]
            and h.svc.streams()[0].last_seq == last
            and streams_of(h.svc) == [StreamState.SYNCED]
        ),
        "the prompt predicted",
    )


async def _unpredicted_at(svc: IndexerService, prompt: list[int]) -> float:
    """The loop time at which `prompt` is first predicted nothing (polled every 10 ms)."""
    loop = asyncio.get_running_loop()
    while any(predicted(svc, prompt)):  # noqa: ASYNC110 (the service has no event for it)
        await asyncio.sleep(0.01)
    return loop.time()


async def _restarted_behind_the_hops(
    h: Hops, prompt: list[int]
) -> tuple[asyncio.Task[float], float]:
    """`prompt` cached and proven, then the worker killed and restarted, its first batches
    (seqs 0..L, L the dead run's last) lost behind the forwarder, so that its next one follows
    on the dead run in seq. Returns the watch of when `prompt` is first predicted nothing and
    the loop time of the kill."""
    await generate(h.session, h.worker.live, prompt)
    await _proven(h, prompt)
    last = h.worker.next_seq() - 1
    watch = asyncio.create_task(_unpredicted_at(h.svc, prompt))
    h.fwd.dropping = True  # the forwarder's path to the worker away a moment
    stopped = asyncio.get_running_loop().time()
    await h.worker.stop()
    await h.worker.start()
    await h.fwd.connected(2)
    i = 0
    while h.worker.next_seq() < last + 1:  # the new process's seqs 0..L: lost
        await generate(h.session, h.worker.live, tokens(f"lost-{i}"))
        i += 1
    await asyncio.sleep(0.2)  # (read and dropped by the forwarder, not passed on late)
    h.fwd.dropping = False
    return watch, stopped


@contextlib.asynccontextmanager
async def _busy(h: Hops, every_s: float = 0.1) -> AsyncIterator[list[list[int]]]:
    """A batch of a new prompt every `every_s` while in the block (a busy worker, never idle
    long enough for a probe); yields the prompts sent so far."""
    sent: list[list[int]] = []

    async def publish() -> None:
        while True:
            prompt = tokens(f"busy-{len(sent)}")
            await generate(h.session, h.worker.live, prompt)
            sent.append(prompt)
            await asyncio.sleep(every_s)

    task = asyncio.create_task(publish())
    try:
        yield sent
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_restart_hidden_by_a_replay_hop_is_found_on_a_busy_stream(
    ctx: zmq.asyncio.Context,
) -> None:
    """The worker restarts behind a replay hop that keeps the router's connection open (QA
    v13: a TCP proxy); its first batches, up to the dead run's last seq, are lost on the
    forwarder's path, and its next ones follow on the dead run in seq, one every 0.1 s.
    Before, only an idle probe's unanswered request told (within `probe_interval_s` +
    `replay_timeout_s` of a quiet worker), and a busy stream never probes: the dead process's
    P was predicted for good (QA: 288 tokens matched, 0 cached, 12 s and on). Now the DEALER's
    heartbeat goes unanswered and its connection drops. The drop comes after the new
    process's batches were applied (`SLOW`), so its proof asks from the fence the last whole
    answer proved, not from the newest batch (the new process's, which it gives back: with
    the heartbeat alone, P was proven and predicted for good): the restart is found, and P is
    predicted nothing within the heartbeat's bound, for good."""
    async with behind_hops(ctx, SLOW, sticky=True) as h:
        await until(lambda: streams_of(h.svc) == [StreamState.SYNCED], "the stream")
        P = tokens("dead")
        watch, stopped = await _restarted_behind_the_hops(h, P)
        async with _busy(h) as sent:
            found = await asyncio.wait_for(watch, found_within(SLOW_TIMEOUT_S))
            assert found - stopped < found_within(SLOW_TIMEOUT_S)
            await until(
                lambda: (
                    len(sent) > 5
                    and predicted(h.svc, sent[-3]) == [80]
                    and streams_of(h.svc) == [StreamState.SYNCED]
                ),
                "the new process's batches predicted",
            )
            assert h.worker.holds(P) == [0]
            for _ in range(50):  # and the dead process's P never again, batches flowing
                assert predicted(h.svc, P) == [0]
                await asyncio.sleep(0.02)
        assert h.svc.streams()[0].restarts >= 1


async def test_a_hung_busy_worker_is_suspected_by_its_heartbeat_and_kept_once_it_answers(
    ctx: zmq.asyncio.Context,
) -> None:
    """A busy worker hangs (a stopped process: nothing it is sent is answered, not even the
    heartbeat) and no replay is asked. Before, nothing saw it until a probe timed out, and a
    busy stream, or one with the probe off, never: a watchdog's kill and restart behind a hop
    that hides it left the dead cache predicted. Now the heartbeat's drop makes the stream
    predict nothing within its bound; the worker answering again is proven in one round
    trip, its entries kept: the proof asks from a batch applied before the worker went silent
    (its buffer still holds it), not from the last whole answer (the join's, long out of a
    busy worker's buffer: asked from there, the stream was cleared and rebuilt from the
    buffer, P, stored before it, forgotten). A healthy quiet worker costs nothing: no drop
    over many heartbeats."""
    worker = Restartable()
    worker.config = msgspec.structs.replace(worker.config, buffer_steps=BUFFER)
    async with behind_hops(ctx, SETTINGS, worker=worker) as h:
        P = tokens("kept")
        await generate(h.session, h.worker.live, P)
        await _proven(h, P)
        before = h.svc.streams()[0]
        await asyncio.sleep(8 * REPLAY_TIMEOUT_S)  # quiet, healthy: every PING answered
        assert predicted(h.svc, P) == [80]
        assert h.svc.streams()[0].verifications == before.verifications
        async with _busy(h, every_s=0.01) as sent:  # the join's answer out of the buffer
            await until(lambda: len(sent) > 3 * BUFFER, "a busy spell", timeout_s=30.0)
        await _proven(h, sent[-1])
        await asyncio.sleep(0.5)

        loop = asyncio.get_running_loop()
        watch = asyncio.create_task(_unpredicted_at(h.svc, P))
        h.relay.held = True
        hung = loop.time()
        found = await asyncio.wait_for(watch, found_within(REPLAY_TIMEOUT_S))
        assert found - hung < found_within(REPLAY_TIMEOUT_S)
        assert streams_of(h.svc) == [StreamState.UNVERIFIED]
        h.relay.held = False
        await until(
            lambda: predicted(h.svc, P) == [80] and streams_of(h.svc) == [StreamState.SYNCED],
            "proven once it answers",
            timeout_s=3.0,
        )
        stats = h.svc.streams()[0]
        assert (stats.restarts, stats.clears) == (before.restarts, before.clears)
        assert stats.verifications > before.verifications


async def test_a_restart_while_a_live_check_waits_on_the_dead_process_is_found_at_the_heartbeat(
    ctx: zmq.asyncio.Context,
) -> None:
    """The worker restarts behind a replay hop that keeps the router's connection open (QA
    v20), its first batches lost behind the forwarder; its next batch, following on the dead
    run's seqs, comes before the heartbeat can have dropped the connection (within
    `replay_timeout_s` of the kill), and its live check is asked on that connection: of the
    dead process. Before, the check waited out `replay_timeout_s`, and the heartbeat's drop
    was read only then: the dead process's P was predicted until the resume plus the timeout
    (QA: 1.9 s after the kill at a 1 s timeout; here 3.8 s and more). Now the drop ends the
    check's wait: P is predicted nothing within the heartbeat's bound (1.25 x the timeout),
    and the restart is proven."""
    async with behind_hops(ctx, SLOW, sticky=True) as h:
        await until(lambda: streams_of(h.svc) == [StreamState.SYNCED], "the stream")
        P = tokens("dead")
        watch, stopped = await _restarted_behind_the_hops(h, P)
        loop = asyncio.get_running_loop()
        # before the heartbeat can drop the connection (at the earliest `replay_timeout_s`
        # after the kill): the batch's check waits on the dead process
        await asyncio.sleep(stopped + 0.9 * SLOW_TIMEOUT_S - loop.time())
        assert not watch.done()
        checks = h.svc.streams()[0].live_checks
        await generate(h.session, h.worker.live, tokens("first"))
        found = await asyncio.wait_for(watch, 3 * SLOW_TIMEOUT_S)
        assert h.svc.streams()[0].live_checks > checks  # (the check was asked)
        # the heartbeat's bound and a loop pass; before, 0.9 + 1 timeouts at the least
        assert found - stopped < 1.25 * SLOW_TIMEOUT_S + 0.8
        async with _busy(h) as sent:
            await until(
                lambda: (
                    len(sent) > 3
                    and predicted(h.svc, sent[-2]) == [80]
                    and streams_of(h.svc) == [StreamState.SYNCED]
                ),
                "the new process's batches predicted",
            )
        assert h.worker.holds(P) == [0] and predicted(h.svc, P) == [0]
        assert h.svc.streams()[0].restarts >= 1


async def test_a_request_sent_as_its_process_goes_silent_ends_as_a_drop(
    ctx: zmq.asyncio.Context,
) -> None:
    """A request sent as the process behind a hop goes silent (hung, or gone where the hop
    hides the close) waits until the heartbeat can drop the connection: it ends as a drop,
    whose proof asks from a batch applied before the silence. Before, its own timeout
    (`replay_timeout_s` from the request) and the heartbeat's (at most 1.25 x from the
    silence) raced, and a timeout first made it unanswered, its proof asked from the last
    whole answer's fence: on a busy worker, out of its buffer, so a worker that only hung a
    moment was cleared and rebuilt (a flaky heartbeat test here, 1 run in 10 under load)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    relay = TcpRelay(router.bind_to_random_port("tcp://127.0.0.1"))
    await relay.start()
    client = ReplayClient(
        ctx,
        f"tcp://127.0.0.1:{relay.port}",
        b"kv",
        timeout_s=REPLAY_TIMEOUT_S,
        yield_every=64,
        on_malformed=lambda _: None,
    )

    async def answer() -> None:
        identity, *body = await router.recv_multipart()
        seq = parse_replay_request(body)
        await router.send_multipart([identity, *build_replay_reply(b"kv", seq, b"x")])
        await router.send_multipart([identity, *build_replay_end()])

    async def ask(seq: int) -> list[int]:
        async with contextlib.aclosing(client.replies(seq)) as replies:
            return [reply.seq async for reply in replies]

    try:
        answering = asyncio.create_task(answer())
        assert await asyncio.wait_for(ask(7), 5.0) == [7]  # a connection made
        await answering
        for _ in range(5):  # each time: silent from the request on
            relay.held = True
            with pytest.raises(ReplayError, match="its connection dropped"):
                await asyncio.wait_for(ask(8), 5 * REPLAY_TIMEOUT_S)
            link = client.link()
            assert link is not None and link.dropped and link.unanswered
            relay.held = False
            await relay.cut()  # (what the relay held for the dead connection goes with it)
            answering = asyncio.create_task(answer())
            assert await asyncio.wait_for(ask(7), 5.0) == [7]  # a new connection, answered
            await answering
    finally:
        client.close()
        await relay.close()
        router.close(linger=0)
