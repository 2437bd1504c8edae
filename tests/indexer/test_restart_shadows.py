"""A worker's restart and the `extra_key` shadows made on the process that ended.

The pages an `extra_key` request stored show in the events as plain pages of its salt, so the
service shadows them (`indexer.shadowed`). A new process holds none of them: once its stream
has found the restart and synced again, its first batch, numbered behind the last batch of the
process that ended, drops them, and a prompt it stores plain is predicted. A sign of a restart
that was none keeps them: the same process's seq goes on past that batch (fail closed).

A scripted publisher on real ZMQ sockets plays the worker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from indexer.namespace import Namespace
from indexer.protocol.events import EventBatch, TokenId
from indexer.protocol.frames import build_live
from indexer.service import IndexerService
from indexer.stats import StreamState
from tests.indexer.scripted import ScriptedPublisher
from tests.indexer.test_replay_answers import A, C, D, matched, stored
from tests.indexer.test_subscriber_zmq import CONFIG, WORKER, connect, wait_until

KEYED = Namespace("", None, None, "view-1")  # A sent with an extra_key; NS is A plain


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def _shadowed_a(svc: IndexerService, pub: ScriptedPublisher) -> int:
    """A sent with an extra_key and stored (plain to the events) after a few other batches;
    returns the last seq. Its plain request is predicted nothing."""
    for n in range(4):  # this process's seq runs ahead of the next one's
        await pub.publish(stored(C if n % 2 else D, 10 + n))
    svc.shadow(KEYED, A, WORKER, None, keep_s=3600.0)
    seq = await pub.publish(stored(A, 20))
    assert await svc.wait_applied(WORKER, seq)
    assert svc.index.entries(svc.stream_ids(WORKER)[0]) >= 3
    assert matched(svc, A) == 0  # held, and hidden by the shadow
    return seq


def _synced(svc: IndexerService) -> bool:
    return svc.streams()[0].state is StreamState.SYNCED


async def test_a_restart_drops_the_shadows_of_the_process_that_ended(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """On the code before: A stayed hidden (matched 0) as long as the new process held it."""
    caplog.set_level(logging.INFO, logger="indexer")
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=4)
        await _shadowed_a(svc, pub)
        pub.restart()  # the new process numbers from 0 and stores A plain
        await pub.publish(stored(A, 30))
        await wait_until(lambda: svc.streams()[0].restarts == 1 and _synced(svc))
        # its next batch, applied while synced, shows a process behind the last one's seq
        seq = await pub.publish(EventBatch(0.0, []))
        assert seq < 5
        await wait_until(lambda: matched(svc, A) == 4)
        assert "its publisher is a new process" in caplog.text
        # an extra_key sent to the new process shadows again
        svc.shadow(KEYED, A, WORKER, None, keep_s=3600.0)
        assert matched(svc, A) == 0


async def test_a_shadow_made_before_the_stream_found_the_restart_stays(
    ctx: zmq.asyncio.Context,
) -> None:
    """An `extra_key` request may reach the new process before its stream has found it (QA:
    80-150 ms after a restart; until its first batch behind a forwarder): its shadow, made
    after the old process's last batch was applied, is not judged with the old ones. Dropped
    with them (the first version of the change), the next plain request was predicted the
    pages the new process stored for the extra_key: 320 tokens, 0 cached."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=4)
        await _shadowed_a(svc, pub)
        svc.shadow(KEYED, C, WORKER, None, keep_s=3600.0)  # C, for the old process
        seq = await pub.publish(stored(C, 21))
        assert await svc.wait_applied(WORKER, seq)
        pub.restart()
        # the new process is sent D with the extra_key before anything of it was heard
        svc.shadow(KEYED, D, WORKER, None, keep_s=3600.0)
        await pub.publish(stored(D, 30))
        await pub.publish(stored(A, 31))  # and A plain
        await wait_until(lambda: svc.streams()[0].restarts == 1 and _synced(svc))
        await pub.publish(EventBatch(0.0, []))
        await wait_until(lambda: matched(svc, A) == 4)  # the old process's shadows went
        stream = svc.stream_ids(WORKER)[0]
        assert svc.index.holds(stream, svc.block_keys(stream, Namespace("", None, None), D))
        assert matched(svc, D) == 0  # the new process's extra_key pages stay hidden


async def test_a_sign_of_a_restart_that_was_none_keeps_the_shadows(
    ctx: zmq.asyncio.Context,
) -> None:
    """A garbage live frame numbered behind the stream counts as a restart (it cannot be
    compared with the replay socket's copy): the stream is cleared and rebuilt from the same
    process's buffer, A's pages with it. The process goes on numbering past its last batch, so
    the shadow stays: dropped at the sign, A would be predicted to a plain request, 4 tokens
    the worker keeps under the extra_key alone."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=4)
        last = await _shadowed_a(svc, pub)
        await pub.send_raw(build_live(pub.topic, 1, b"\xc1 not a batch"))
        await wait_until(lambda: svc.streams()[0].restarts == 1)
        later: list[TokenId] = [31, 32, 33, 34, 9]
        for n in range(3):  # batches of the same process, applied synced, past the last one
            seq = await pub.publish(stored(later, 40 + n))
            assert seq > last
            assert await svc.wait_applied(WORKER, seq)
        await wait_until(lambda: _synced(svc) and matched(svc, later) == 4)
        stream = svc.stream_ids(WORKER)[0]
        assert svc.index.holds(stream, svc.block_keys(stream, Namespace("", None, None), A))
        assert matched(svc, A) == 0
