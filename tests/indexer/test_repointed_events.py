"""A worker's KV events come through an XSUB/XPUB forwarder, its replay socket direct, and the
forwarder is re-pointed at another busy worker's PUB (an operator's slip, a forwarder's bug).

The replay socket is the worker's own and answers from the worker's ring, so it is the truth
about which publisher owns a seq: the live stream and it disagree (`indexer.stream.disagreement`'s
`_disagree`), and the stream predicts nothing, whether the other worker's seqs follow on this
one's (`_live_check`), go back (`_went_back`: no restart, since the replay socket's process
never went back), or, after a restart, continue the run before it past the window
(`_dead_batch`). Real reference workers, a real forwarder (`tests.indexer.forwarder`); what
is held against the index is what the worker itself caches. No idle probe runs within a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import aiohttp
import msgspec
import pytest
import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.protocol.events import EventBatch, Stored
from indexer.service import IndexerService
from indexer.stats import StreamState
from indexer.stream import restarts, state
from tests.indexer.forwarder import Forwarder
from tests.indexer.scripted import ScriptedPublisher
from tests.indexer.test_forwarded_events import (
    MODEL,
    WORKER,
    Restartable,
    generate,
    predicted,
    streams_of,
    tokens,
    until,
)
from tests.indexer.test_subscriber_zmq import WORKER as SCRIPTED
from tests.indexer.test_subscriber_zmq import connect

SETTINGS = IndexerConfig(probe_interval_s=30.0, replay_timeout_s=1.0)  # no idle probe here
DISAGREE = "disagree about the publisher"


async def _subscribe(
    svc: IndexerService, fwd: Forwarder, replay: str, block_size: int = 16
) -> None:
    """The worker's stream: events through `fwd`, which the worker advertises as its own
    (a forwarder's address), and its replay socket `replay`, advertised too (proven)."""
    await svc.add_worker(
        WORKER,
        [
            StreamConfig(
                endpoint=fwd.endpoint,
                replay_endpoint=replay,
                block_size=block_size,
                model=MODEL,
                advertised_endpoint=fwd.endpoint,
                advertised_replay=replay,
            )
        ],
    )
    await fwd.subscribed()


class _Pair(NamedTuple):
    """A worker followed through a forwarder (`own`: its replay socket direct), and another
    busy worker (`other`) the forwarder can be re-pointed at."""

    own: Restartable
    other: Restartable
    fwd: Forwarder
    svc: IndexerService
    session: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def _two_workers(ctx: zmq.asyncio.Context) -> AsyncIterator[_Pair]:
    """Two reference workers, the first's events through a forwarder and followed (both
    stopped at the end, whatever a test did to them)."""
    own, other = Restartable(), Restartable()
    await own.start()
    await other.start()
    try:
        async with (
            Forwarder(ctx, own.live.kv_events.endpoint) as fwd,
            IndexerService(SETTINGS) as svc,
            aiohttp.ClientSession() as session,
        ):
            await fwd.connected(1)
            await _subscribe(svc, fwd, own.live.kv_events.replay_endpoint)
            yield _Pair(own, other, fwd, svc, session)
    finally:
        await own.stop()
        await other.stop()


async def _repoint(svc: IndexerService, fwd: Forwarder, own: Restartable, to: str) -> None:
    """Re-point `fwd` at `to` once the stream has read all `own` published: a libzmq XSUB
    that drops a connection with a message still queued on it can abort the process."""
    await until(lambda: svc.streams()[0].last_seq == own.next_seq() - 1, "the old run read")
    handshakes = fwd.handshakes
    fwd.repoint(to)
    await fwd.connected(handshakes + 1)


async def _flush(session: aiohttp.ClientSession, worker: Restartable) -> None:
    async with session.post(f"{worker.live.url}/flush_cache", json={}) as response:
        assert response.status == 200, await response.text()


async def _busy(
    session: aiohttp.ClientSession, worker: Restartable, tag: str, count: int
) -> list[list[int]]:
    """`count` prompts of `tag` cached on `worker` back to back (one batch each)."""
    prompts = [tokens(f"{tag}-{i}") for i in range(count)]
    for prompt in prompts:
        await generate(session, worker.live, prompt)
    return prompts


async def _false_hits(
    svc: IndexerService,
    seconds: float,
    truths: list[tuple[list[int], Callable[[], int]]],
) -> list[tuple[float, int, int]]:
    """Every (time, prompt index, predicted tokens) where the index predicted more of a
    prompt than its worker holds (`truths`: the prompt, and what the worker holds of it),
    polled for `seconds`; times from the start."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    seen: list[tuple[float, int, int]] = []
    while loop.time() - start < seconds:
        for i, (prompt, held) in enumerate(truths):
            (got,) = predicted(svc, prompt)
            if got > held():
                seen.append((round(loop.time() - start, 3), i, got))
        await asyncio.sleep(0.01)
    return seen


async def test_a_repointed_forwarder_whose_seqs_follow_on_is_found_before_its_batch_is_taken(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The other worker has published as many batches as this one: its next batch is this
    stream's next seq, which follows on, so it was applied and predicted as this worker's, for
    good (QA: 1,960 false hits in 15 s, no ERROR), and this worker's flushes went unheard. A
    live batch is asked of the replay socket before it is applied when no check was asked
    lately: the worker's socket does not have it, and the two sockets disagree at once."""
    caplog.set_level(logging.ERROR, logger="indexer.stream")
    async with _two_workers(ctx) as (own, other, fwd, svc, session):
        P = tokens("own")
        await generate(session, own.live, P)
        await until(lambda: predicted(svc, P) == [80], "P predicted")
        while other.next_seq() < own.next_seq():
            await generate(session, other.live, tokens(f"early-{other.next_seq()}"))
        assert other.next_seq() == own.next_seq()  # its next batch follows on
        await _repoint(svc, fwd, own, other.live.kv_events.endpoint)
        Y = tokens("other")
        await generate(session, other.live, Y)
        seen = await _false_hits(svc, 1.0, [(Y, lambda: own.holds(Y)[0])])
        assert not seen, seen  # never predicted: asked before it was applied
        assert streams_of(svc) == [StreamState.UNVERIFIED]
        assert svc.streams()[0].restarts == 0  # no restart was taken for it
        assert DISAGREE in caplog.text
        assert "is not in what the replay socket gives back" in caplog.text
        await _flush(session, own)  # unheard: the stream holds nothing to predict
        assert predicted(svc, P) == [0]


async def test_a_busy_repointed_stream_is_found_within_the_live_check_bound(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """Both workers busy: the checks of this worker's last batches are spent, so the other
    worker's first batches, following on, are applied. The newest live batch applied is asked
    for once a check is due (`live_check_interval_s`): the other worker's prompts are predicted for
    less than that, and never again (before: for good, and this worker's own flushes unheard,
    its prompt predicted after it was gone)."""
    caplog.set_level(logging.ERROR, logger="indexer.stream")
    async with _two_workers(ctx) as (own, other, fwd, svc, session):
        P = tokens("own")
        await generate(session, own.live, P)
        await _busy(session, own, "own-busy", 2 * state.LIVE_CHECK_BURST)
        await until(lambda: predicted(svc, P) == [80], "P predicted")
        while other.next_seq() < own.next_seq():
            await generate(session, other.live, tokens(f"early-{other.next_seq()}"))
        assert other.next_seq() == own.next_seq()
        await _repoint(svc, fwd, own, other.live.kv_events.endpoint)
        prompts: list[list[int]] = []

        async def both_busy() -> None:
            for i in range(12):  # the other worker caches, this one flushes and caches P
                prompts.extend(await _busy(session, other, f"other-{i}", 1))
                if i % 2:
                    await generate(session, own.live, P)
                else:
                    await _flush(session, own)
                await asyncio.sleep(0.1)

        work = asyncio.create_task(both_busy())
        truths = [(P, lambda: own.holds(P)[0])]
        truths += [(tokens(f"other-{i}-0"), lambda: 0) for i in range(12)]
        seen = await _false_hits(svc, 2.5, truths)
        await work
        # the other worker's first batches, applied before a check was due, and nothing
        # after the check that found them
        span = seen[-1][0] - seen[0][0] if seen else 0.0
        assert span < IndexerConfig().live_check_interval_s + 0.25, seen
        assert streams_of(svc) == [StreamState.UNVERIFIED]
        assert svc.streams()[0].restarts == 0 and svc.streams()[0].live_checks > 0
        assert caplog.text.count(DISAGREE) == 1  # one ERROR, however many batches


@pytest.mark.parametrize("behind", [3, 8])
async def test_a_repointed_forwarder_whose_seqs_go_back_is_no_restart(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture, behind: int
) -> None:
    """The other worker is `behind` batches behind this one: its first batch goes back in
    seq, which was taken for a restart of this worker: the stream was rebuilt from this
    worker's buffer, and every later batch of the other worker skipped as a dead process's
    while `synced`, deaf to this worker's own flushes (QA: a false hit after each, no ERROR).
    The replay socket is asked for that batch: it is not the worker's, whose seqs never went
    back, so the two sockets disagree, and nothing is predicted."""
    caplog.set_level(logging.WARNING, logger="indexer.stream")
    async with _two_workers(ctx) as (own, other, fwd, svc, session):
        await generate(session, other.live, tokens("early"))
        P = tokens("own")
        await generate(session, own.live, P)
        while own.next_seq() < other.next_seq() + behind:
            await generate(session, own.live, tokens(f"own-{own.next_seq()}"))
        await until(lambda: predicted(svc, P) == [80], "P predicted")
        await _repoint(svc, fwd, own, other.live.kv_events.endpoint)
        Y = tokens("other")
        await generate(session, other.live, Y)
        await asyncio.sleep(0.3)  # its batch read (a replay round trip, or a rebuild)
        await _flush(session, own)  # the worker's own flush, unheard
        truths = [(P, lambda: own.holds(P)[0]), (Y, lambda: own.holds(Y)[0])]
        truths += [(prompt, lambda: 0) for prompt in await _busy(session, other, "o", 3)]
        seen = await _false_hits(svc, 1.0, truths)
        assert not seen, seen
        assert DISAGREE in caplog.text
        stats = svc.streams()[0]
        assert stats.restarts == 0 and stats.state is StreamState.UNVERIFIED
        assert "goes back" in caplog.text and "publisher restarted" not in caplog.text


async def test_a_run_after_a_restart_that_the_replay_never_gives_back_ends_in_a_disagreement(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker restarts behind its forwarder (found, rebuilt, its new cache predicted),
    and the forwarder is then re-pointed at another worker ahead of the old run's seqs: its
    batches continue the run before the restart, which the new process's socket does not
    give back. Past the window after the restart they were skipped as late queued batches
    for good while `synced`: the new process's flushes unheard, its prompt predicted after it
    was gone. Past the window the stream predicts nothing; a run still going on past one more
    window is no queue, and the two sockets disagree."""
    monkeypatch.setattr(restarts, "DEAD_RUN_S", 0.5)
    caplog.set_level(logging.ERROR, logger="indexer.stream")
    async with _two_workers(ctx) as (own, other, fwd, svc, session):
        await _busy(session, own, "old", 3)
        await until(lambda: svc.streams()[0].last_seq == own.next_seq() - 1, "the old run")
        await _busy(session, other, "ahead", own.next_seq() + 3)  # ahead of the old run
        await own.stop()
        await until(lambda: streams_of(svc) == [StreamState.UNVERIFIED], "the suspicion")
        await own.start()  # a new process on the same ports
        await fwd.connected(2)
        await until(lambda: svc.streams()[0].restarts == 1, "the restart found")
        P = tokens("new")
        await generate(session, own.live, P)
        await until(lambda: predicted(svc, P) == [80], "the new process's P predicted")
        await _repoint(svc, fwd, own, other.live.kv_events.endpoint)

        async def other_busy() -> None:
            for i in range(30):
                await generate(session, other.live, tokens(f"other-{i}"))
                await asyncio.sleep(0.05)

        work = asyncio.create_task(other_busy())
        await asyncio.sleep(0.7)  # past the window after the restart
        await _flush(session, own)  # unheard
        seen = await _false_hits(svc, 1.0, [(P, lambda: own.holds(P)[0])])
        await work
        assert not seen, seen
        await until(lambda: DISAGREE in caplog.text, "the disagreement")
        assert "still come" in caplog.text
        stats = svc.streams()[0]
        assert stats.state is StreamState.UNVERIFIED and stats.restarts == 1


async def test_a_seq_going_back_that_the_silent_replay_cannot_judge_predicts_nothing(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forwarder is re-pointed at a fresh publisher (its first batch is seq 0) while this
    worker's replay socket does not answer: nothing tells a restart from another publisher.
    Seq 0 follows no run, so it was applied at once, untainted: the other publisher's page
    predicted here. Taken for a restart, it predicts nothing now until the window after it
    ends (and the stream is cleared then). Both publishers are scripted (real sockets): a
    reference worker always answers, and publishes its seq 0 as it starts."""
    monkeypatch.setattr(restarts, "DEAD_RUN_S", 1.0)
    caplog.set_level(logging.WARNING, logger="indexer.stream")
    settings = IndexerConfig(probe_interval_s=30.0, replay_timeout_s=0.3)
    Y = [5, 6, 7, 8, 9]  # one 4-token page and a last token
    page = Stored(block_hashes=[20], parent=None, token_ids=[*Y[:4]], block_size=4)
    async with (
        ScriptedPublisher(ctx) as own,
        ScriptedPublisher(ctx) as other,
        Forwarder(ctx, own.endpoint) as fwd,
        IndexerService(settings) as svc,
    ):
        await fwd.connected(1)
        await _subscribe(svc, fwd, own.replay_endpoint, block_size=4)
        seq = -1
        for i in range(3):
            seq = await own.publish(EventBatch(float(i), []))
        assert await svc.wait_applied(WORKER, seq)
        own.answer_replays = False
        fwd.repoint(other.endpoint)
        await fwd.connected(2)
        assert await other.publish(EventBatch(9.0, [page])) == 0
        await until(lambda: svc.streams()[0].restarts == 1, "taken for a restart")
        seen = await _false_hits(svc, 0.5, [(Y, lambda: 0)])
        assert not seen, seen
        assert streams_of(svc) == [StreamState.DEGRADED]
        assert "nothing proves its publisher restarted" in caplog.text
        await until(lambda: svc.streams()[0].entries == 0, "cleared at the window's end")


async def _checks_in(ctx: zmq.asyncio.Context, settings: IndexerConfig, seconds: float) -> int:
    """The live checks a stream asks while its publisher sends a batch every 10 ms."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(settings) as svc:
        await connect(svc, pub, block_size=4)
        before = svc.streams()[0].live_checks
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            await pub.publish(EventBatch(0.0, [Stored([pub.next_seq + 1], None, [1, 2, 3, 4], 4)]))
            await asyncio.sleep(0.01)
        seq = pub.next_seq - 1
        assert await svc.wait_applied(SCRIPTED, seq, timeout_s=5.0)
        return svc.streams()[0].live_checks - before


async def test_the_live_check_interval_is_the_operators(ctx: zmq.asyncio.Context) -> None:
    """`live_check_interval_s` sets how often a busy stream asks: a large fleet trades the
    re-pointed forwarder's window for replay traffic (before, one a second, fixed)."""
    seconds = 2.0
    default = await _checks_in(ctx, SETTINGS, seconds)
    fast = await _checks_in(
        ctx, msgspec.structs.replace(SETTINGS, live_check_interval_s=0.2), seconds
    )
    # at most the burst and one an interval (the check's own schedule bounds it)
    assert 0 < default <= state.LIVE_CHECK_BURST + seconds / 1.0 + 1
    assert fast > default + 3, (fast, default)
