"""A router whose event loop did not run (the process stopped, the loop blocked) proves its
streams again before it predicts from them: a worker may have restarted meanwhile, its dropped
connection still queued unread on the SUB's monitor when the first request is answered.

Real ZMQ on 127.0.0.1 (`ScriptedPublisher`); the stall is real too: the test blocks the loop
with a synchronous sleep (the ZMQ I/O thread runs on, as a stopped process's queues fill when
it is resumed) and queries before it yields, as a request handler run first would.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from indexer.config import IndexerConfig
from indexer.loop_watch import STALL_S
from indexer.namespace import Namespace
from indexer.protocol.events import EventBatch, Stored, TokenId
from indexer.service import IndexerService
from indexer.stats import StreamState
from tests.indexer.scripted import ScriptedPublisher
from tests.indexer.test_subscriber_zmq import WORKER, connect, wait_until

# no idle probe: nothing but the stall makes the stream prove itself again
CONFIG = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0)
PAGE: list[TokenId] = [1, 2, 3, 4]
STORED = EventBatch(0.0, [Stored(block_hashes=[7], parent=None, token_ids=PAGE, block_size=4)])


def predicted(svc: IndexerService) -> int:
    return svc.query(Namespace(), [*PAGE, 9])[WORKER].matched_tokens


def stalled(seconds: float, meanwhile: Callable[[], None] = lambda: None) -> None:
    """Block the event loop for `seconds` (the process stopped), doing `meanwhile` first."""
    until = time.monotonic() + seconds
    meanwhile()
    time.sleep(max(0.0, until - time.monotonic()))


async def holding_the_page(svc: IndexerService, pub: ScriptedPublisher, *, replay: bool) -> None:
    await connect(svc, pub, block_size=4, **({} if replay else {"replay_endpoint": None}))
    seq = await pub.publish(STORED)
    assert await svc.wait_applied(WORKER, seq)
    await wait_until(lambda: svc.streams()[0].state is StreamState.SYNCED)
    assert predicted(svc) == 4


async def test_a_worker_restarted_while_the_loop_stalled_is_not_predicted_at_once(
    ctx: zmq.asyncio.Context,
) -> None:
    """The worker's process died and a new one bound its ports while the router was stopped:
    the SUB's monitor holds the dropped connection, unread when the first request is answered.
    Before, that request was routed on the dead process's page (QA: 288 tokens, 0 cached)."""
    async with ScriptedPublisher(ctx) as old, IndexerService(CONFIG) as svc:
        await holding_the_page(svc, old, replay=True)
        new: list[ScriptedPublisher] = []

        def restart() -> None:
            old.pub.close(linger=0)  # the process dies: its connections drop
            old.router.close(linger=0)
            for _ in range(200):  # (its ports may take a moment to be free again)
                try:
                    new.append(
                        ScriptedPublisher(ctx, endpoints=(old.endpoint, old.replay_endpoint))
                    )
                    return
                except zmq.ZMQError:
                    time.sleep(0.005)
            raise AssertionError("the ports were never free again")

        stalled(STALL_S + 0.5, restart)
        assert predicted(svc) == 0  # the first query after the stall
        assert svc.streams()[0].state is StreamState.UNVERIFIED
        async with new[0]:  # its replay socket answers: an empty buffer
            await wait_until(
                lambda: (
                    svc.streams()[0].restarts == 1 and svc.streams()[0].state is StreamState.SYNCED
                )
            )
            assert svc.streams()[0].entries == 0 and predicted(svc) == 0


async def test_a_worker_that_did_not_restart_is_proven_and_keeps_its_pages(
    ctx: zmq.asyncio.Context,
) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await holding_the_page(svc, pub, replay=True)
        before = svc.streams()[0].verifications
        stalled(STALL_S + 0.3)
        assert predicted(svc) == 0  # until its replay proves it
        await wait_until(lambda: svc.streams()[0].state is StreamState.SYNCED)
        assert predicted(svc) == 4
        stats = svc.streams()[0]
        assert stats.verifications == before + 1 and stats.restarts == 0 and stats.clears == 0


async def test_a_stall_within_the_bound_and_a_stream_without_a_replay_socket_keep_their_pages(
    ctx: zmq.asyncio.Context,
) -> None:
    """A hiccup shorter than `STALL_S` is the loop's usual work; a stream without a replay
    socket is not suspected (nothing would prove it: an idle worker would start cold after
    every stall)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await holding_the_page(svc, pub, replay=True)
        stalled(STALL_S / 3)
        assert predicted(svc) == 4 and svc.streams()[0].verifications == 0
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await holding_the_page(svc, pub, replay=False)
        stalled(STALL_S + 0.3)
        assert predicted(svc) == 4 and svc.streams()[0].state is StreamState.SYNCED
        assert svc.streams()[0].clears == 0
