"""SequenceTracker verdicts, one rule per test line."""

from __future__ import annotations

from indexer.sequence import SeqDecision, SequenceTracker, SeqVerdict

APPLY = SeqDecision(SeqVerdict.APPLY)
DUP = SeqDecision(SeqVerdict.DUPLICATE)
RESTART = SeqDecision(SeqVerdict.RESTART)


def gap(n: int) -> SeqDecision:
    return SeqDecision(SeqVerdict.GAP, n)


def test_in_order_gap_duplicate_restart() -> None:
    t = SequenceTracker()
    assert [t.on_live(s) for s in (0, 1, 2)] == [APPLY, APPLY, APPLY]
    assert t.on_live(2) == DUP
    assert t.on_live(5) == gap(3) and t.last == 2
    assert t.on_live(1) == RESTART and t.last is None
    assert t.on_live(1) == gap(0)


def test_joining_mid_way_replays_from_zero() -> None:
    t = SequenceTracker()
    assert t.on_live(7) == gap(0)
    assert [t.on_replay(s) for s in (0, 1, 2, 3, 4, 5, 6, 7)] == [APPLY] * 8
    assert t.on_live(7) == DUP and t.on_live(8) == APPLY


def test_replay_that_cannot_cover_the_gap() -> None:
    t = SequenceTracker(3)
    assert t.on_live(9) == gap(4)
    assert t.on_replay(6) == gap(4)  # the buffer starts later than asked: clear and restart
    t.restart_at(6)
    assert [t.on_replay(s) for s in (6, 7, 8, 9)] == [APPLY] * 4
    assert t.on_live(9) == DUP


def test_live_messages_queued_during_a_replay_are_duplicates_not_restarts() -> None:
    t = SequenceTracker(3)
    assert t.on_live(5) == gap(4)
    assert [t.on_replay(s) for s in (3, 4, 5, 6, 7, 8)] == [DUP] + [APPLY] * 5
    assert [t.on_live(s) for s in (6, 7, 8, 9)] == [DUP, DUP, DUP, APPLY]
    assert t.on_live(2) == RESTART


def test_after_a_snapshot_load_an_old_seq_is_a_restart() -> None:
    t = SequenceTracker(10)
    assert t.on_live(4) == RESTART
    t = SequenceTracker(10)
    assert t.on_live(11) == APPLY


def test_a_first_live_seq_below_the_replayed_run_is_a_restart() -> None:
    # joining: the catch-up replay gave 5..8; a first live seq inside it is a duplicate
    t = SequenceTracker()
    t.restart_at(5)
    assert [t.on_replay(s) for s in (5, 6, 7, 8)] == [APPLY] * 4
    assert t.on_live(6) == DUP
    # below it (a publisher counts from 0: a new process, or the answer was not its buffer)
    t = SequenceTracker()
    t.restart_at(1 << 40)
    assert t.on_replay(1 << 40) == APPLY
    assert t.on_live(0) == RESTART and t.last is None
    assert t.on_live(0) == APPLY and t.on_live(1) == APPLY
