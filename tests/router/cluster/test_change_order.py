"""Concurrent admin changes of one worker end as the operator made them last, on every replica.

Each replica's `FleetState` (the real one) reads a fleet bucket that stores writes in whatever
order they reach it, and answers them whenever: a bucket of one key with revisions and
compare-and-set, stood in for NATS so that every interleaving a stall or a hung link can make
is run, thousands of them (tests/router/cluster/test_cluster_failures.py runs the stalls and the
hung link against a real nats-server). Replicas read the revisions in order, as a KV watch
delivers them.
"""

from __future__ import annotations

import random
from typing import Any, cast

import msgspec
import pytest

from router.cluster.fleet_state import FleetState, worker_key
from router.cluster.wire import WorkerRecord

KEY = worker_key("w1")
_decode = msgspec.json.Decoder(WorkerRecord).decode


class _Bucket:
    """One key's revisions (1, 2, ...), as a KV bucket keeps them."""

    def __init__(self, first: bytes) -> None:
        self.values = [first]

    @property
    def revision(self) -> int:
        return len(self.values)

    def put(self, value: bytes) -> int:
        self.values.append(value)
        return self.revision

    def update(self, value: bytes, last: int) -> int | None:
        return self.put(value) if last == self.revision else None


class _Replica:
    def __init__(self, name: str, read: int) -> None:
        self.state = FleetState(name, cast(Any, None), cast(Any, None), cast(Any, None))
        self.read = read  # the last revision read


class _Write:
    """A write on its way to the bucket, then its answer on its way back."""

    def __init__(self, replica: _Replica, value: bytes, last: int | None) -> None:
        self.replica = replica
        self.value = value
        self.last = last  # compare-and-set over this revision (None: a plain put)
        self.revision: int | None = None  # stored at (None: not yet, or refused)


def _run(
    seed: int, changes: int, *, restart: bool = False, skip: float = 0.0
) -> tuple[list[float], bytes, int]:
    """Replicas each make one change of w1 without seeing the others' (NATS hung on them);
    the writes and their answers go in a random order, some answers lost (timed out: kept),
    replicas read as they go (a read behind skipping to the newest revision with chance
    `skip`: NATS keeps one revision of a key), and, `restart`, one replica restarts (a new
    process under its id) once its change is stored. Returns the changes' `at`s, the record
    that stands, and the revisions written."""
    rng = random.Random(seed)
    seed_record = FleetState("seed", cast(Any, None), cast(Any, None), cast(Any, None))
    bucket = _Bucket(seed_record.record_worker("w1", None, draining=False))
    replicas = [_Replica(f"r{i}", 0) for i in range(changes)]
    for replica in replicas:
        _read(replica, bucket, [])  # the seed: every change is made over revision 1
    ats = sorted(rng.sample(range(1000, 2000), changes))
    flying: list[_Write] = []
    answering: list[_Write] = []
    for replica, at in zip(replicas, rng.sample(ats, changes), strict=True):
        flags = rng.choice([{"draining": True}, {"draining": False}, {"removed": True}])
        value = replica.state.record_worker("w1", None, at=float(at), **flags)
        replica.state.sending(KEY, value)
        flying.append(_Write(replica, value, None))
    restarted = not restart
    for _ in range(5000):
        moves: list[str] = []
        if flying:
            moves.append("land")
        if answering:
            moves.append("answer")
        if any(r.read < bucket.revision for r in replicas):
            moves.append("read")
        if not moves:
            break
        move = rng.choice(moves)
        if move == "land":
            write = flying.pop(rng.randrange(len(flying)))
            if write.last is None:
                write.revision = bucket.put(write.value)
            else:
                write.revision = bucket.update(write.value, write.last)
            answering.append(write)
        elif move == "answer":
            write = answering.pop(rng.randrange(len(answering)))
            state = write.replica.state
            if write.revision is None:
                continue  # refused: another write came first, the watcher weighs it
            if write.last is None and rng.random() < 0.3:
                state.keep_unsent("fleet", KEY, write.value, sent=True)  # timed out
            else:
                state.wrote(KEY, write.value, write.revision)
                state.written("fleet", KEY)
        else:
            replica = rng.choice([r for r in replicas if r.read < bucket.revision])
            if bucket.revision - replica.read > 1 and rng.random() < skip:
                replica.read = bucket.revision - 1  # written over before it was read
            _read(replica, bucket, flying)
        if not restarted and all(w.last is not None for w in flying):
            # every change stored or on its way: one replica's process restarts, and its
            # new process reads the record that stands now first
            victim = rng.randrange(changes)
            replicas[victim] = _Replica(f"r{victim}", bucket.revision - 1)
            restarted = True
    else:
        raise AssertionError(f"seed {seed}: still writing after 5000 moves")
    return [float(a) for a in ats], bucket.values[-1], bucket.revision


def _read(replica: _Replica, bucket: _Bucket, flying: list[_Write]) -> None:
    replica.read += 1
    again = replica.state.weigh(KEY, bucket.values[replica.read - 1], replica.read)
    if again is not None:  # written over that revision only
        flying.append(_Write(replica, again, replica.read))


@pytest.mark.parametrize("skip", [0.0, 0.3], ids=["every-revision-read", "revisions-skipped"])
@pytest.mark.parametrize("changes", [2, 3, 4])
def test_the_change_made_last_stands_whatever_order_nats_took_them_in(
    changes: int, skip: float
) -> None:
    """Also when replicas' watches skip revisions written over before they read them."""
    for seed in range(400):
        ats, stands, revisions = _run(seed, changes, skip=skip)
        assert _decode(stands).at == ats[-1], (seed, _decode(stands))
        # each change stored once, and each written again at most once per other change
        assert revisions <= 1 + changes * changes, (seed, revisions)


def test_the_change_made_last_stands_when_a_replica_restarts_after_its_change() -> None:
    """A replica that restarts forgets its change: the one whose earlier change NATS stored
    over it writes it back (QA: an undrain answered "shared" undone by a drain made before
    it, when the undrain's replica restarted before the drain landed)."""
    for seed in range(400):
        ats, stands, _ = _run(seed, 3, restart=True)
        assert _decode(stands).at == ats[-1], (seed, _decode(stands))


def test_a_replicas_earlier_change_read_after_its_next_was_sent_is_no_conflict() -> None:
    """A drain, then an undrain on the same replica before its watch read the drain back: the
    drain is the replica's own earlier change, not a concurrent one to write the undrain again
    over (before: written again for nothing, an INFO line in normal operation)."""
    replica = _Replica("r0", 0)
    bucket = _Bucket(replica.state.record_worker("w1", None, draining=False))
    _read(replica, bucket, [])
    drain = replica.state.record_worker("w1", None, at=1000.0, draining=True)
    replica.state.sending(KEY, drain)
    replica.state.wrote(KEY, drain, bucket.put(drain))
    undrain = replica.state.record_worker("w1", None, at=1001.0, draining=False)
    replica.state.sending(KEY, undrain)  # on its way
    flying: list[_Write] = []
    _read(replica, bucket, flying)  # the drain, read now
    assert flying == []


def test_any_replica_that_reads_an_earlier_change_over_a_later_one_writes_the_later_back() -> None:
    """r2's change (made last) is stored, then r1's, made before it without seeing it, over
    it; r2 has restarted since (it knows nothing of its change) and r1 missed r2's. r0, which
    made no change, read both: it writes r2's back over r1's. Before, only the replica whose
    change was overwritten did: r2's change was lost (with a watch skipping the revision
    written over, 383 of 6,000 simulated runs with a restart ended with an earlier change,
    145 now: those where no live replica read the later change)."""
    observer = _Replica("r0", 0)
    seed = observer.state.record_worker("w1", None, draining=False)
    bucket = _Bucket(seed)
    later = _Replica("r2", 0).state.record_worker("w1", None, at=2000.0, draining=True)
    earlier = _Replica("r1", 0).state.record_worker("w1", None, at=1000.0, removed=True)
    bucket.put(later)
    bucket.put(earlier)
    flying: list[_Write] = []
    for _ in range(3):
        _read(observer, bucket, flying)
    (write,) = flying
    assert write.last == 3
    record = _decode(write.value)
    assert (record.by, record.at, record.draining, record.over) == ("r2", 2000.0, True, 3)


def test_a_kept_change_read_back_as_another_replica_wrote_it_again_is_no_longer_kept() -> None:
    """A change kept unsent here (NATS hung past the deadline, then stored it) that the watch
    reads only as another replica wrote it again (its `over` differs: the first write was
    written over before it was read) is known written. Before, only its bytes matched: it
    stayed counted unsent until the next change of that worker (QA, 40 s)."""
    replica = _Replica("r1", 0)
    bucket = _Bucket(replica.state.record_worker("w1", None, draining=False))
    _read(replica, bucket, [])
    change = replica.state.record_worker("w1", None, at=1000.0, draining=False)
    replica.state.sending(KEY, change)
    replica.state.keep_unsent("fleet", KEY, change, sent=True)  # its answer timed out
    stored = bucket.put(change)
    again = msgspec.structs.replace(_decode(change), over=stored)
    bucket.put(msgspec.json.encode(again))  # another replica's write of it, over it
    replica.read = stored  # (the first write written over before the watch read it)
    _read(replica, bucket, [])
    assert replica.state.unsent == {}
