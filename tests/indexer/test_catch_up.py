"""A stream rebuilt from its publisher's replay buffer predicts none of the worker's past.

The buffer is the worker's history: a prompt stored early in it and evicted later is held by
the stream from the batch that stored it until the batch that evicted it is read. Reading a
long buffer yields the event loop (every `yield_every` replies), and the router's queries run
in between. Before, such a stream was `syncing` and trusted: the evicted prompt was predicted
while the buffer was read (QA: 288 tokens matched, 0 cached) at every join, re-registration
and restart rebuild. Now it is `syncing` and predicts nothing until it is caught up: its answer
read to the end (or the live stream followed on) and the live batches queued meanwhile applied.

Real ZMQ on 127.0.0.1 (`ScriptedPublisher`); a task queries the prompt at every turn of the
loop while the stream catches up, and checks the raw index too, so each case shows that the
stream did hold the evicted prompt at some turn while nothing predicted it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.namespace import Namespace
from indexer.protocol.events import Event, EventBatch, Removed, Stored, TokenId
from indexer.protocol.frames import build_live
from indexer.service import IndexerService
from indexer.stats import StreamState
from tests.indexer.scripted import ScriptedPublisher

WORKER = "w0"
STREAM = "w0#dp0"
NS = Namespace()
PAGE = 4
PROMPT: list[TokenId] = list(range(1, 4 * PAGE + 2))  # four pages and a last token
FILL = 120  # batches between the prompt's store and its eviction: many yields of the loop


def prompt_stored() -> EventBatch:
    hashes: list[int | bytes] = [100, 101, 102, 103]
    events: list[Event] = [
        Stored(block_hashes=hashes, parent=None, token_ids=PROMPT[: 4 * PAGE], block_size=PAGE)
    ]
    return EventBatch(0.0, events)


def prompt_evicted() -> EventBatch:
    return EventBatch(0.0, [Removed(block_hashes=[100, 101, 102, 103])])


def filler(i: int) -> EventBatch:
    """A batch of another prompt (its own page), so the buffer is long and varied."""
    tokens: list[TokenId] = [1000 + i] * PAGE
    return EventBatch(
        0.0, [Stored(block_hashes=[5000 + i], parent=None, token_ids=tokens, block_size=PAGE)]
    )


async def history(pub: ScriptedPublisher, *, live: bool = False) -> int:
    """The prompt stored, FILL batches, the prompt evicted, a few more: into the buffer only
    (nobody listens, or the live copies are dropped) unless `live`. Returns the last seq."""
    await pub.publish(prompt_stored(), drop=not live)
    for i in range(FILL):
        await pub.publish(filler(i), drop=not live)
    await pub.publish(prompt_evicted(), drop=not live)
    seq = -1
    for i in range(5):
        seq = await pub.publish(filler(FILL + i), drop=not live)
    return seq


class Watch:
    """Queries the prompt at every turn of the loop: what the service predicted, and what
    the raw index held on the stream then."""

    def __init__(self, svc: IndexerService) -> None:
        self.svc = svc
        self.predicted: list[tuple[int, StreamState]] = []
        self.held_unpredicted = 0  # turns at which the stream held the prompt, unpredicted
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Watch:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            match = self.svc.query(NS, PROMPT).get(WORKER)
            if match is not None:
                held = self.svc.index.match(NS, PROMPT).blocks.get(STREAM, 0)
                if match.matched_tokens:
                    self.predicted.append((match.matched_tokens, match.state))
                elif held:
                    self.held_unpredicted += 1
            await asyncio.sleep(0)


def config(*, probe: bool) -> IndexerConfig:
    # yield the loop every 2 replies (and live batches): the queries see every step
    return IndexerConfig(replay_timeout_s=2.0, probe_interval_s=0.2 if probe else 0, yield_every=2)


def stream(pub: ScriptedPublisher) -> StreamConfig:
    return StreamConfig(
        endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="kv", block_size=PAGE
    )


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        # the service has no event for these; a short poll is the honest wait
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def caught_up(svc: IndexerService, seq: int) -> Callable[[], bool]:
    def done() -> bool:
        (stats,) = svc.streams()
        return stats.state is StreamState.SYNCED and stats.last_seq == seq

    return done


async def live_until_received(svc: IndexerService, pub: ScriptedPublisher) -> int:
    """Publish empty batches until the subscriber has taken one live (the slow joiner)."""
    (sub,) = svc._workers[WORKER]
    for _ in range(200):
        seq = await pub.publish(EventBatch(0.0, []))
        await asyncio.sleep(0.02)
        if sub.tracker.live is not None:
            return seq
    raise AssertionError("the subscriber never received a live batch")


@pytest.mark.parametrize("join", ["probe", "gap", "again"])
async def test_a_joining_stream_predicts_nothing_of_the_buffer_it_reads(
    ctx: zmq.asyncio.Context, join: str
) -> None:
    """A router started (or a worker added) after the worker's history: the catch-up probe
    at connect reads the buffer (`probe`); without the probe, the first live batch shows a
    gap from 0 (`gap`); a worker registered anew joins again (`again`)."""
    async with (
        ScriptedPublisher(ctx) as pub,
        IndexerService(config(probe=join != "gap")) as svc,
        Watch(svc) as watch,
    ):
        last = await history(pub)
        if join == "again":
            await svc.add_worker(WORKER, [stream(pub)])
            await until(caught_up(svc, last))
            await svc.add_worker(WORKER, [stream(pub)])  # its settings read again: anew
        else:
            await svc.add_worker(WORKER, [stream(pub)])
        if join == "gap":
            last = await live_until_received(svc, pub)
        await until(caught_up(svc, last))
        assert watch.predicted == []
        assert watch.held_unpredicted > 0  # it did hold the evicted prompt while reading
        assert svc.streams()[0].restarts == 0


@pytest.mark.parametrize("new_run", ["longer", "shorter"])
async def test_a_restart_rebuilt_from_the_new_buffer_predicts_nothing_of_its_past(
    ctx: zmq.asyncio.Context, new_run: str
) -> None:
    """A synced stream's idle probe finds a new process (its batch at our seq is another:
    `longer`; its newest seq is below ours: `shorter`), and rebuilds from the new buffer,
    where the prompt was stored and evicted again. (None of the new run reached the SUB,
    connected all along: it is trusted once a live batch follows on.)"""
    async with ScriptedPublisher(ctx) as pub, IndexerService(config(probe=True)) as svc:
        await svc.add_worker(WORKER, [stream(pub)])
        before = 5 if new_run == "longer" else 2 * FILL
        old = -1
        for i in range(before):
            old = await pub.publish(filler(10_000 + i))
        await live_until_received(svc, pub)
        await until(lambda: (svc.streams()[0].last_seq or 0) >= old)
        async with Watch(svc) as watch:
            pub.restart()
            last = await history(pub)  # the new process's batches, missed live
            await until(lambda: svc.streams()[0].restarts == 1)
            await until(lambda: svc.streams()[0].last_seq == last)
            await until(lambda: svc.streams()[0].state is StreamState.UNVERIFIED)
            followed = await pub.publish(EventBatch(0.0, []))
            await until(caught_up(svc, followed))
        assert watch.predicted == []
        assert watch.held_unpredicted > 0


async def test_live_batches_queued_during_a_catch_up_are_applied_before_it_is_trusted(
    ctx: zmq.asyncio.Context,
) -> None:
    """The buffer's answer ends on the state the worker had when it was asked: the eviction
    published while the answer was read waits on the SUB, behind it. Until those queued live
    batches are applied the stream is still the past (before, `synced` the moment the
    answer ended: the evicted prompt was predicted until the loop read its eviction)."""
    async with (
        ScriptedPublisher(ctx) as pub,
        IndexerService(config(probe=False)) as svc,
    ):
        await pub.publish(prompt_stored(), drop=True)  # before the router subscribed
        for i in range(FILL):
            await pub.publish(filler(i), drop=True)
        pub.end_delay_s = 0.5  # the answer's end marker comes late
        await svc.add_worker(WORKER, [stream(pub)])
        await live_until_received(svc, pub)
        await until(lambda: bool(pub.replay_requests))  # the catch-up is being answered
        # live, queued on the SUB behind the answer: other batches, then the eviction
        for i in range(20):
            await pub.publish(filler(FILL + i))
        last = await pub.publish(prompt_evicted())
        async with Watch(svc) as watch:  # the worker holds the prompt no more
            await until(caught_up(svc, last))
        assert watch.predicted == []
        assert watch.held_unpredicted > 0


async def test_a_tail_the_idle_probe_finds_is_the_past_until_caught_up(
    ctx: zmq.asyncio.Context,
) -> None:
    """A synced stream whose publisher's batches were dropped with the connection up (a PUB
    at its high-water mark, a lossy hop): the idle probe reads them from the replay socket.
    They are the worker's past, the prompt stored and evicted in them: the stream predicts
    nothing from the first batch the probe brings until it is caught up, and (the live path
    having delivered none of them) until a live batch follows on. Before, the probe applied
    them while `synced` (QA: 304 tokens predicted, 0 cached, during the read)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(config(probe=True)) as svc:
        await svc.add_worker(WORKER, [stream(pub)])
        seq = await live_until_received(svc, pub)
        await until(caught_up(svc, seq))
        async with Watch(svc) as watch:
            last = await history(pub)  # every live copy dropped: only the probe finds them
            await until(lambda: svc.streams()[0].last_seq == last)
            await until(lambda: svc.streams()[0].state is StreamState.UNVERIFIED)
            last = await pub.publish(filler(FILL + 10))  # a live batch follows on
            await until(caught_up(svc, last))
        assert watch.predicted == []
        assert watch.held_unpredicted > 0  # the probe did apply the evicted prompt
        (stats,) = svc.streams()
        assert stats.gaps == 1 and stats.restarts == 0 and stats.clears == 0
        assert stats.undelivered_tails == 1


async def test_the_live_copy_of_the_batch_a_probe_ran_ahead_to_trusts_the_stream_again(
    ctx: zmq.asyncio.Context,
) -> None:
    """A probe finds the newest batch before its live copy arrives (in flight, or late): the
    stream is `unverified` (nothing yet shows the live path delivers), and the live copy of
    that very batch, the same bytes, shows it does: `synced`, without waiting for another
    batch. A live copy of an older batch does not (the copies after it are still to come)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(config(probe=True)) as svc:
        await svc.add_worker(WORKER, [stream(pub)])
        seq = await live_until_received(svc, pub)
        await until(caught_up(svc, seq))
        older = await pub.publish(filler(0), drop=True)
        last = await pub.publish(prompt_stored(), drop=True)
        await until(lambda: svc.streams()[0].last_seq == last)
        await until(lambda: svc.streams()[0].state is StreamState.UNVERIFIED)
        copies = dict(pub.buffer)
        await pub.send_raw(build_live(pub.topic, older, copies[older]))
        probes = svc.streams()[0].probes
        await until(lambda: svc.streams()[0].probes > probes)  # read, and a probe since
        assert svc.streams()[0].state is StreamState.UNVERIFIED
        assert svc.query(NS, PROMPT)[WORKER].matched_tokens == 0
        await pub.send_raw(build_live(pub.topic, last, copies[last]))
        await until(caught_up(svc, last))
        assert svc.query(NS, PROMPT)[WORKER].matched_tokens == 4 * PAGE
        assert svc.streams()[0].undelivered_tails == 1


async def test_a_probe_racing_a_live_batch_in_flight_says_nothing_of_a_deaf_path(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A healthy stream: a batch is published while the idle probe's answer is on its way,
    so the answer brings it before the SUB's copy, queued meanwhile, is read. Before, the
    probe counted an undelivered tail and warned of a deaf event path (QA: once in a 60 s run
    of a healthy fleet). Now that is said only once a later live batch comes without the
    copy, or at the next probe: the copy comes, nothing is said, the stream is synced."""
    caplog.set_level(logging.WARNING, logger="indexer.stream")
    async with ScriptedPublisher(ctx) as pub, IndexerService(config(probe=True)) as svc:
        await svc.add_worker(WORKER, [stream(pub)])
        seq = await live_until_received(svc, pub)
        await until(caught_up(svc, seq))

        async def asked_after(requests: int) -> None:
            await until(lambda: len(pub.replay_requests) > requests)

        async def probed_after(probes: int) -> None:
            await until(lambda: svc.streams()[0].probes > probes)

        for i in range(3):
            pub.answer_delay_s = 0.3
            await asked_after(len(pub.replay_requests))  # an idle probe asked
            last = await pub.publish(filler(FILL + i))  # live, and in the answer to come
            await until(caught_up(svc, last))
            pub.answer_delay_s = 0.0
            await probed_after(svc.streams()[0].probes + 1)  # two probes since
            assert svc.streams()[0].state is StreamState.SYNCED
        assert svc.streams()[0].undelivered_tails == 0
        assert "never delivered" not in caplog.text


async def test_an_idle_probe_that_finds_nothing_missing_keeps_the_stream_synced(
    ctx: zmq.asyncio.Context,
) -> None:
    """The probe of a quiet stream that misses nothing (its answer is the fence batch only)
    does not flip its trust: no `syncing` at every probe."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(config(probe=True)) as svc:
        await svc.add_worker(WORKER, [stream(pub)])
        await pub.publish(prompt_stored())
        seq = await live_until_received(svc, pub)
        await until(caught_up(svc, seq))
        probes = svc.streams()[0].probes
        seen: set[StreamState] = set()
        async with asyncio.timeout(5.0):
            while svc.streams()[0].probes < probes + 4:
                seen.add(svc.streams()[0].state)
                assert svc.query(NS, PROMPT)[WORKER].matched_tokens == 4 * PAGE
                await asyncio.sleep(0)
        assert seen == {StreamState.SYNCED}
