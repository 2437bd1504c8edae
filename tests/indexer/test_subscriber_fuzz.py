"""Seeded fuzzing of a live subscriber over real ZMQ: garbage on the wire never corrupts the index.

A scripted publisher (127.0.0.1) interleaves valid batches with bounded random garbage: frame
counts, seq frames of every length and value, mutated and truncated payloads, topics that do
and do not match. The subscriber task must survive all of it, and once the publisher restarts
and publishes a known history, the stream must hold exactly that history (nothing the garbage
did lingers). Set KVROUTE_FUZZ_SEED to replay a failing run; the seed is printed and in every
failure message.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import zmq.asyncio

from indexer.config import IndexerConfig
from indexer.protocol.encode import encode_batch
from indexer.protocol.events import EventBatch
from indexer.protocol.frames import pack_seq
from indexer.service import IndexerService
from indexer.stats import StreamState
from indexer.stream import restarts
from tests.indexer.scripted import ScriptedPublisher, workload
from tests.indexer.test_subscriber_zmq import STREAM, WORKER, connect, reference, view, wait_until

MESSAGES = 400  # garbage and valid messages per run: bounded, a second or so


def _garbage(rng: random.Random, valid: list[bytes], next_seq: int) -> list[bytes]:
    """One random message: wrong frame counts, odd seqs, mutated payloads."""
    payload = rng.choice(valid)
    kind = rng.randrange(6)
    if kind == 0:  # flipped bytes
        data = bytearray(payload)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        payload = bytes(data)
    elif kind == 1:  # truncated
        payload = payload[: rng.randrange(len(payload))]
    elif kind == 2:
        payload = rng.randbytes(rng.randrange(0, 64))
    seq_choice = rng.randrange(5)
    if seq_choice == 0:
        seq = rng.randbytes(rng.choice([0, 1, 7, 9, 16]))  # not 8 bytes
    elif seq_choice == 1:
        seq = pack_seq(rng.randrange(2**64))
    elif seq_choice == 2:
        seq = pack_seq(max(0, next_seq + rng.randrange(-3, 4)))
    else:
        seq = pack_seq(next_seq)
    frames = [rng.choice([b"kv", b"kv-extra", b"other", b""]), seq, payload]
    if rng.random() < 0.1:
        frames = frames[: rng.randrange(3)] or [b""]
    elif rng.random() < 0.05:
        frames.append(b"extra frame")
    return frames


async def _drained(svc: IndexerService) -> None:
    """Until the subscriber has read all it was sent: its counters still for longer than a
    replay's timeout (bounded)."""
    loop = asyncio.get_running_loop()
    stop = loop.time() + 10.0
    last, since = svc.streams()[0], loop.time()
    while loop.time() < stop and loop.time() - since < 0.6:
        await asyncio.sleep(0.05)
        now = svc.streams()[0]
        if (now.batches, now.decode_errors, now.dead_batches, now.restarts, now.gaps) != (
            last.batches,
            last.decode_errors,
            last.dead_batches,
            last.restarts,
            last.gaps,
        ):
            last, since = now, loop.time()


# seeds whose garbage left the replay socket trusted when they were chosen, so the known
# history is checked whole in most runs (a random seed mostly gets it taken for another
# publisher's; the timing of replays can still change that)
_TRUSTED_SOCKET_SEEDS = (2228166063, 3536830228)


@pytest.mark.parametrize("fixed", [None, *_TRUSTED_SOCKET_SEEDS], ids=["random", "s1", "s2"])
async def test_garbage_on_the_wire_never_corrupts_the_stream(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch, fixed: int | None
) -> None:
    # a garbage seq below the newest reads as a restart and opens the window after it; a
    # restart inside that window is held unproven (`_window_proof`), so the known history
    # below starts after the window, once the garbage is read
    monkeypatch.setattr(restarts, "DEAD_RUN_S", 0.3)
    seed = fixed or int(os.environ.get("KVROUTE_FUZZ_SEED", random.randrange(2**32)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    noise = workload(seed=seed % 1000, batches=20)
    valid = [encode_batch(b) for b in noise]
    settings = IndexerConfig(replay_timeout_s=0.3, probe_interval_s=0.05, log_interval_s=60)
    async with ScriptedPublisher(ctx) as pub, IndexerService(settings) as svc:
        await connect(svc, pub)
        task = svc._subs.task(STREAM)
        assert task is not None
        for _ in range(MESSAGES):
            if rng.random() < 0.4:
                await pub.publish(rng.choice(noise), drop=rng.random() < 0.2)
            else:
                await pub.send_raw(_garbage(rng, valid, pub.next_seq))
        assert not task.done(), f"seed={seed}: the subscriber task ended"
        await _drained(svc)
        await asyncio.sleep(0.35)
        # a new process with a known history: the stream must hold exactly it
        pub.restart()
        known = workload(seed=seed % 1000 + 1, batches=12)
        for batch in known:
            await pub.publish(batch)
        # the garbage may leave the live path waiting on a bogus seq: the probe settles it
        await wait_until(
            lambda: (
                svc._workers[WORKER][0].tracker.last == len(known) - 1
                and svc.streams()[0].state is StreamState.SYNCED
            ),
            timeout_s=10,
        )
        assert not task.done(), f"seed={seed}: the subscriber task ended"
        held, want = view(svc.index, STREAM), view(reference(known), STREAM)
        if svc._workers[WORKER][0]._replay_foreign:
            # the garbage contradicted what the replay socket gives, so it was taken for
            # another publisher's: with no socket, nothing proves the new run's batches in the
            # window after its restart, and the stream holds nothing the worker does not
            assert held.items() <= want.items(), f"seed={seed}"
        else:
            assert held == want, f"seed={seed}"
        stats = svc.streams()[0]
        # garbage is refused when decoded, or skipped unread when its seq, after a garbage seq
        # looked like a restart, continues the run before it (a dead process's batch)
        seen = stats.decode_errors + stats.dead_batches
        assert seen > 0, f"seed={seed}: the garbage was never seen"
        print(f"seed={seed} decode_errors={stats.decode_errors} restarts={stats.restarts}")


def test_the_fuzz_case_mix_covers_every_kind() -> None:
    rng = random.Random(1)
    valid = [encode_batch(EventBatch(ts=0.0, events=[]))]
    counts = {len(_garbage(rng, valid, 5)) for _ in range(500)}
    assert counts >= {1, 2, 3, 4}
