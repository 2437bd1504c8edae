"""Events through a ZMQ forwarder: a SUB that is connected proves nothing it did not deliver.

A real reference worker publishes on its PUB; a real XSUB/XPUB forwarder (`Forwarder`) relays
to the indexer's SUB; the replay socket is the worker's own, direct. Real requests store a
prompt, a real `/flush_cache` evicts it, and the worker's own radix cache is the truth: the
index must never predict more of the prompt than the worker holds.

- A catch-up that ends before the SUB connects (the forwarder not up yet) is not over at the
  connect: batches published between its answer and the connection reached nobody (a PUB
  drops for a subscriber not connected), so a replay is read once more. Before, the stream was
  `synced` at the connect and the flush in that window was a false hit until the next probe
  (QA: 288 tokens predicted, 0 cached).
- An idle probe that finds batches the connected SUB never delivered (the forwarder lost its
  upstream, or swallows what it gets) leaves the stream `unverified` until a live batch follows
  on. Before, it was `synced` again once the probe's batches were applied: each flush was a
  false hit until the next probe, round after round (QA: 4 of 4 rounds).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.namespace import Namespace
from indexer.service import IndexerService
from indexer.stats import StreamState, StreamStats
from tests.indexer.late_forwarder import Forwarder, free_endpoint
from workers.cache import Namespace as CacheNamespace
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

MODEL = "m"
WORKER = "w"
PAGE = 16
NS = Namespace(MODEL)


@pytest.fixture
async def worker() -> AsyncIterator[ReferenceWorker]:
    async with ReferenceWorker(WorkerConfig(time_scale=0.0, page_size=PAGE)) as w:
        yield w


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def prompt(rng: random.Random) -> list[int]:
    """Four whole pages and a last token, unlike any other prompt of the test."""
    return [rng.randrange(3, 259) for _ in range(4 * PAGE + 1)]


async def store(http: aiohttp.ClientSession, worker: ReferenceWorker, tokens: list[int]) -> None:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}}
    async with http.post(f"{worker.url}/generate", json=body) as response:
        assert response.status == 200, await response.text()


async def flush(http: aiohttp.ClientSession, worker: ReferenceWorker) -> None:
    async with http.post(f"{worker.url}/flush_cache", json={}) as response:
        assert response.status == 200, await response.text()


async def store_until_relayed(
    http: aiohttp.ClientSession, worker: ReferenceWorker, fwd: Forwarder, rng: random.Random
) -> list[int]:
    """Store prompts until the forwarder relays one: the batches published before the
    forwarder's subscription reached the worker's PUB (just connected) are dropped there, as
    a PUB does. Returns the last prompt."""
    relayed = fwd.relayed
    for _ in range(100):
        tokens = prompt(rng)
        await store(http, worker, tokens)
        await asyncio.sleep(0.02)
        if fwd.relayed > relayed:
            return tokens
    raise AssertionError("the forwarder relayed nothing")


def newest(worker: ReferenceWorker) -> int:
    """The seq of the worker's last published batch."""
    return worker.ranks[0].publisher.next_seq - 1


def stream(worker: ReferenceWorker, endpoint: str) -> StreamConfig:
    kv = worker.kv_events
    return StreamConfig(
        endpoint=endpoint,
        replay_endpoint=kv.replay_endpoint,
        topic=kv.topic,
        block_size=PAGE,
        model=MODEL,
    )


def stats(svc: IndexerService) -> StreamStats:
    (only,) = svc.streams()
    return only


def predicted(svc: IndexerService, tokens: list[int]) -> int:
    return svc.query(NS, tokens)[WORKER].matched_tokens


def cached(worker: ReferenceWorker, tokens: list[int]) -> int:
    (rank0,) = worker.match(CacheNamespace(), tokens)
    return rank0 // PAGE * PAGE


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        # nothing signals these (a seq applied, a state): a short poll is the honest wait
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def test_a_catch_up_read_before_the_sub_connected_reads_the_replay_again_at_connect(
    ctx: zmq.asyncio.Context, worker: ReferenceWorker, http: aiohttp.ClientSession
) -> None:
    """The router joins while its events port (a forwarder) reaches nothing yet: the catch-up
    reads the worker's buffer (the prompt stored), the worker flushes, then the forwarder comes
    up. The flush was published to nobody: only a replay asked once the SUB is connected
    brings it, and until that answer the stream is `syncing`."""
    rng = random.Random(1)
    tokens = prompt(rng)
    await store(http, worker, tokens)
    fwd_endpoint = free_endpoint()
    # the probe is slow: what the connect itself does decides, not the next probe
    config = IndexerConfig(probe_interval_s=5.0, replay_timeout_s=2.0)
    async with IndexerService(config) as svc:
        await svc.add_worker(WORKER, [stream(worker, fwd_endpoint)])
        await until(lambda: stats(svc).last_seq == newest(worker))
        assert stats(svc).state is StreamState.SYNCING  # read, but the SUB is not connected
        await flush(http, worker)  # published while nothing listens
        assert cached(worker, tokens) == 0
        async with Forwarder(ctx, worker.kv_events.endpoint, fwd_endpoint) as fwd:
            await until(lambda: stats(svc).state is StreamState.SYNCED)
            assert predicted(svc, tokens) == 0  # before: 64, the flushed prompt
            assert stats(svc).last_seq == newest(worker)  # the flush, read at the connect
            assert stats(svc).undelivered_tails == 0  # the join's batches are no deaf path's
            # and the SUB hears what comes next, live
            again = await store_until_relayed(http, worker, fwd, rng)
            await until(lambda: stats(svc).last_seq == newest(worker))
            assert predicted(svc, again) == cached(worker, again) == 4 * PAGE
            assert stats(svc).state is StreamState.SYNCED


@pytest.mark.parametrize("failure", ["cut", "swallow"])
async def test_a_probe_finding_what_the_connected_sub_missed_leaves_the_stream_untrusted(
    ctx: zmq.asyncio.Context,
    worker: ReferenceWorker,
    http: aiohttp.ClientSession,
    failure: str,
) -> None:
    """The forwarder loses its upstream (`cut`) or swallows every batch (`swallow`); the
    router's SUB stays connected to it. A prompt stored on the worker reaches the stream only
    through the idle probe, which makes the stream `unverified`: flushed right after, the
    prompt is predicted nowhere, and probes that find nothing more (or the flush) leave it so.
    Once the forwarder relays again, the first live batch that follows on trusts it again."""
    rng = random.Random(2)
    config = IndexerConfig(probe_interval_s=0.5, replay_timeout_s=2.0)
    async with (
        Forwarder(ctx, worker.kv_events.endpoint, free_endpoint()) as fwd,
        IndexerService(config) as svc,
    ):
        await svc.add_worker(WORKER, [stream(worker, fwd.endpoint)])
        await until(lambda: stats(svc).state is StreamState.SYNCED)
        warm = prompt(rng)
        await store(http, worker, warm)  # live, through the forwarder
        await until(lambda: stats(svc).last_seq == newest(worker))
        # (trusted once the idle probe that may be reading the replay socket meanwhile has
        # ended: at once on an idle machine, a moment later on a loaded one, CI: 0 == 64)
        await until(lambda: predicted(svc, warm) == 4 * PAGE)
        assert cached(worker, warm) == 4 * PAGE
        assert fwd.relayed > 0

        if failure == "cut":
            fwd.cut()
        else:
            fwd.swallow = True
        tokens = prompt(rng)
        await store(http, worker, tokens)  # lost on the way: only the probe brings it
        await until(lambda: stats(svc).last_seq == newest(worker))
        await flush(http, worker)  # lost on the way too
        assert cached(worker, tokens) == 0
        assert predicted(svc, tokens) == 0  # before: 64 until the next probe, every round
        # the probe's catch-up may still be ending its answer (syncing: predicting nothing too)
        assert stats(svc).state in (StreamState.SYNCING, StreamState.UNVERIFIED)
        await until(lambda: stats(svc).state is StreamState.UNVERIFIED)
        assert predicted(svc, tokens) == 0
        probes = stats(svc).probes
        while stats(svc).probes < probes + 3:  # the flush found, then nothing more
            assert predicted(svc, tokens) <= cached(worker, tokens)
            assert predicted(svc, warm) <= cached(worker, warm)
            await asyncio.sleep(0.01)
        # the store's batch and the flush's, each said at the probe after the one that found
        # it (no live copy came meanwhile)
        assert stats(svc).undelivered_tails == 2
        assert stats(svc).last_seq == newest(worker)
        assert stats(svc).state is StreamState.UNVERIFIED  # an idle deaf path stays untrusted

        if failure == "cut":
            fwd.mend()
        else:
            fwd.swallow = False
        again = await store_until_relayed(http, worker, fwd, rng)  # trusts the stream again
        await until(lambda: stats(svc).state is StreamState.SYNCED)
        await until(lambda: stats(svc).last_seq == newest(worker))
        assert predicted(svc, again) == cached(worker, again) == 4 * PAGE
        assert predicted(svc, tokens) == cached(worker, tokens) == 0
