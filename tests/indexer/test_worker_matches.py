"""The cached per-worker answers equal a fresh per-query computation, through state changes.

`StreamHealth` objects as the subscribers own them; the test moves what a subscriber task
would move (the state, heard-at times, a learned block size, the clock) and compares every
answer with the reference: states, best streams and every rank's own answer recomputed per
query.
"""

from __future__ import annotations

import os
import random

from indexer.health import StreamHealth
from indexer.index.walk import PrefixMatch
from indexer.stats import STATE_RANK, UNTRUSTED, RankMatch, StreamState, WorkerMatch
from indexer.worker_matches import REFRESH_S, WorkerMatches

STALE_AFTER_S = 5.0
STATES = [StreamState.SYNCING, StreamState.SYNCED, StreamState.DEGRADED, StreamState.UNVERIFIED]


def _rank(sub: StreamHealth, found: PrefixMatch, now: float) -> RankMatch:
    """One rank's own answer: what its stream holds, nothing while it is untrusted."""
    state = sub.current_state(now)
    if state in UNTRUSTED:
        return RankMatch(sub.dp_rank, 0, 0, 0, sub.block_size, {}, state)
    size = sub.block_size or 0
    held = found.blocks.get(sub.stream_id, 0)
    by_medium = found.by_medium.get(sub.stream_id) or ({"GPU": held} if held else {})
    more = found.pending_blocks.get(sub.stream_id, 0)
    return RankMatch(sub.dp_rank, held, held * size, more * size, sub.block_size, by_medium, state)


def reference(
    workers: dict[str, list[StreamHealth]], found: PrefixMatch, now: float
) -> dict[str, WorkerMatch]:
    """The uncached rule: best state among a worker's streams, best stream by matched tokens,
    and every stream's own answer in `ranks`, in the order the streams are given.

    Streams kvroute cannot vouch for (SYNCING, DEGRADED, UNVERIFIED, STALE) are never the
    best: they match nothing.
    """
    out = {}
    for worker, subs in workers.items():
        state = StreamState.STALE
        best: StreamHealth | None = None
        best_score = (-1, -1)
        ranks = tuple(_rank(sub, found, now) for sub in subs)
        for sub in subs:
            s_state = sub.current_state(now)
            if STATE_RANK[s_state] < STATE_RANK[state]:
                state = s_state
            if s_state in UNTRUSTED:
                continue
            bs = sub.block_size or 0
            held = found.blocks.get(sub.stream_id, 0)
            score = (held * bs, (held + found.pending_blocks.get(sub.stream_id, 0)) * bs)
            if score > best_score:
                best, best_score = sub, score
        if best is None:
            size = subs[0].block_size if subs else None
            out[worker] = WorkerMatch(worker, 0, 0, 0, size, {}, state, ranks)
            continue
        sid = best.stream_id
        size = best.block_size or 0
        held = found.blocks.get(sid, 0)
        by_medium = found.by_medium.get(sid) or ({"GPU": held} if held else {})
        out[worker] = WorkerMatch(
            worker,
            held,
            held * size,
            found.pending_blocks.get(sid, 0) * size,
            best.block_size,
            by_medium,
            state,
            ranks,
        )
    return out


def test_cached_answers_match_the_uncached_rule() -> None:
    seed = int(os.environ.get("KVROUTE_SEED", random.randrange(1 << 30)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    clock = [100.0]

    def fresh_streams(worker: str) -> list[StreamHealth]:
        """A worker's streams as `add_worker` makes them: one per rank, in rank order."""
        return [
            StreamHealth(
                f"{worker}#dp{dp}",
                started_at=clock[0],
                stale_after_s=STALE_AFTER_S,
                block_size=rng.choice([None, 16, 16, 32]),
                dp_rank=dp,
            )
            for dp in range(rng.choice([0, 1, 1, 1, 2, 3, 4]))
        ]

    workers = {f"w{w}": fresh_streams(f"w{w}") for w in range(8)}
    streams = [sub for subs in workers.values() for sub in subs]
    matches = WorkerMatches(lambda: clock[0])
    for step in range(3000):
        op = rng.random()
        if op < 0.15:
            rng.choice(streams).state = rng.choice(STATES)
        elif op < 0.3:
            sub = rng.choice(streams)
            sub.last_event_at = clock[0]  # an applied batch (heard again)
            if sub.block_size is None and rng.random() < 0.3:
                sub.block_size = 16  # learned from the wire
            if rng.random() < 0.5:  # replayed batches notify only once a repair ends
                matches.on_applied(sub.stream_id)
        elif op < 0.35:
            rng.choice(streams).last_heard_at = clock[0]  # a probe answered, nothing new
        elif op < 0.55:
            # small steps near REFRESH_S, now and then one past stale_after_s
            clock[0] += rng.choice([0.0, 0.01, REFRESH_S, 1.0, STALE_AFTER_S / 2, STALE_AFTER_S])
        elif op < 0.58:
            # a worker re-registered (its streams may be unsized again, its rank count new)
            worker = rng.choice(sorted(workers))
            workers[worker] = fresh_streams(worker)
            matches.invalidate()
        # (a stream of no worker when every worker has none, so the ops above have a target)
        streams = [sub for subs in workers.values() for sub in subs] or [
            StreamHealth("idle#dp0", started_at=0.0, stale_after_s=STALE_AFTER_S)
        ]
        found = PrefixMatch({}, {}, {})
        busy = rng.random() < 0.4  # pending entries or tiers: the general path
        for sub in rng.sample(streams, rng.randrange(len(streams) + 1)):
            if rng.random() < 0.8:
                found.blocks[sub.stream_id] = rng.choice([1, 2, 32, 32, 512])
            if busy and rng.random() < 0.2:
                found.pending_blocks[sub.stream_id] = rng.randrange(1, 4)
            if busy and rng.random() < 0.1 and sub.stream_id in found.blocks:
                found.by_medium[sub.stream_id] = {"CPU": found.blocks[sub.stream_id]}
        if rng.random() < 0.02:
            found.blocks["ghost#dp0"] = 3  # a stream no worker owns (left by a snapshot)
        got = matches.answer(workers, found, "GPU")
        want = reference(workers, found, clock[0])
        assert got == want, f"step {step} (seed {seed})"


def test_stale_exactly_at_the_deadline_and_back() -> None:
    clock = [10.0]
    sub = StreamHealth("w#dp0", started_at=clock[0], stale_after_s=STALE_AFTER_S, block_size=16)
    sub.state = StreamState.SYNCED
    sub.last_event_at = 10.0
    workers = {"w": [sub]}
    matches = WorkerMatches(lambda: clock[0])
    empty = PrefixMatch({}, {}, {})
    assert matches.answer(workers, empty, "GPU")["w"].state is StreamState.SYNCED
    clock[0] = 10.0 + STALE_AFTER_S
    assert matches.answer(workers, empty, "GPU")["w"].state is StreamState.SYNCED
    clock[0] += 1e-6
    assert matches.answer(workers, empty, "GPU")["w"].state is StreamState.STALE
    sub.last_heard_at = clock[0]  # a probe answer revives it, no batch applied
    assert matches.answer(workers, empty, "GPU")["w"].state is StreamState.SYNCED
    sub.state = StreamState.DEGRADED  # a gap: seen at the very next query
    assert matches.answer(workers, empty, "GPU")["w"].state is StreamState.DEGRADED


def test_answers_are_fresh_dicts_with_one_entry_per_worker() -> None:
    workers = {
        f"w{i}": [
            StreamHealth(
                f"w{i}#dp0",
                started_at=0.0,
                stale_after_s=30.0,
                block_size=16,
                state=StreamState.SYNCED,
            )
        ]
        for i in range(3)
    }
    workers["none"] = []
    matches = WorkerMatches(lambda: 0.0)
    first = matches.answer(workers, PrefixMatch({"w1#dp0": 2}, {}, {}), "GPU")
    assert set(first) == set(workers) and first["w1"].matched_tokens == 32
    assert first["none"] == WorkerMatch("none", 0, 0, 0, None, {}, StreamState.STALE, ())
    assert [r.matched_tokens for r in first["w1"].ranks] == [32]
    first.clear()  # the caller owns the dict
    again = matches.answer(workers, PrefixMatch({}, {}, {}), "GPU")
    assert set(again) == set(workers) and again["w1"].matched_blocks == 0


def test_every_rank_is_answered_apart_and_the_best_one_on_top() -> None:
    clock = [0.0]
    subs = [
        StreamHealth(f"w#dp{r}", started_at=0.0, stale_after_s=30.0, block_size=16, dp_rank=r)
        for r in range(3)
    ]
    for sub in subs:
        sub.state = StreamState.SYNCED
    subs[2].state = StreamState.UNVERIFIED  # may have restarted: predicts nothing
    workers = {"w": subs}
    matches = WorkerMatches(lambda: clock[0])
    found = PrefixMatch({"w#dp0": 2, "w#dp1": 5, "w#dp2": 9}, {"w#dp0": 1}, {})
    got = matches.answer(workers, found, "GPU")["w"]
    assert [(r.dp_rank, r.matched_tokens, r.pending_tokens) for r in got.ranks] == [
        (0, 32, 16),
        (1, 80, 0),
        (2, 0, 0),
    ]
    assert [r.state for r in got.ranks] == [StreamState.SYNCED] * 2 + [StreamState.UNVERIFIED]
    assert got.matched_tokens == 80 and got.state is StreamState.SYNCED  # rank 1 is the best
    # nothing matched: the cached zero answer still lists every rank
    zero = matches.answer(workers, PrefixMatch({}, {}, {}), "GPU")["w"]
    assert [(r.dp_rank, r.matched_tokens) for r in zero.ranks] == [(0, 0), (1, 0), (2, 0)]


def test_a_degraded_rank_predicts_nothing_and_is_not_its_workers_state() -> None:
    """A stream being repaired holds blocks the worker may have evicted: its rank answers
    nothing, and a worker with a trusted rank beside it takes that rank's state (a worker is
    untrusted only when every rank is: before, DEGRADED outranked SYNCING). A SYNCING rank
    (read from its replay buffer: the worker's past) predicts nothing either."""
    subs = [
        StreamHealth(f"w#dp{dp}", started_at=0.0, stale_after_s=30.0, block_size=16, dp_rank=dp)
        for dp in range(2)
    ]
    subs[0].state, subs[1].state = StreamState.DEGRADED, StreamState.SYNCED
    found = PrefixMatch({"w#dp0": 8, "w#dp1": 2}, {}, {})
    got = WorkerMatches(lambda: 1.0).answer({"w": subs}, found, "GPU")["w"]
    assert got.state is StreamState.SYNCED and got.matched_tokens == 32
    assert [(r.state, r.matched_tokens) for r in got.ranks] == [
        (StreamState.DEGRADED, 0),
        (StreamState.SYNCED, 32),
    ]
    subs[1].state = StreamState.SYNCING
    got = WorkerMatches(lambda: 1.0).answer({"w": subs}, found, "GPU")["w"]
    assert got.state is StreamState.SYNCING and got.matched_tokens == 0
    assert [(r.state, r.matched_tokens) for r in got.ranks] == [
        (StreamState.DEGRADED, 0),
        (StreamState.SYNCING, 0),
    ]
