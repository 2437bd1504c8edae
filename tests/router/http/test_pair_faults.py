"""Whose failure a pair's failed handoff was, told by what its workers did since
(`PairFaults`)."""

from __future__ import annotations

from router.http.pair_faults import AVOID_S, PairFaults


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_first_failure_takes_its_default_and_the_pair_is_avoided() -> None:
    faults = PairFaults()
    assert faults.blame("p0", "d0", None) == (None, False)
    assert faults.blame("p1", "d1", "decode") == ("decode", False)
    assert faults.avoided() == {("p0", "d0"), ("p1", "d1")}


def test_the_side_that_failed_before_while_the_other_answered_is_blamed() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    faults.answered("p0", "d1")  # p0 is fine with another decode
    assert faults.blame("p0", "d0", None) == ("decode", True)


def test_a_decode_failing_with_another_prefill_is_blamed() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    assert faults.blame("p1", "d0", None) == ("decode", True)


def test_a_prefill_failing_with_every_decode_is_blamed_whatever_its_word() -> None:
    faults = PairFaults()
    assert faults.blame("p0", "d0", "decode") == ("decode", False)
    assert faults.blame("p0", "d1", "decode") == ("prefill", True)


def test_the_same_pair_again_with_nothing_between_says_nothing() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    assert faults.blame("p0", "d0", None) == (None, False)


def test_a_worker_blamed_explains_its_partners_failures() -> None:
    # d0 was wedged: blamed at its second prefill; then d1 wedges. p0's failure with d0 is
    # not held against p0 (it charged a healthy prefill before)
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    assert faults.blame("p1", "d0", None) == ("decode", True)
    assert faults.blame("p0", "d1", None) == (None, False)
    assert faults.blame("p1", "d1", None) == ("decode", True)


def test_an_answer_clears_both_workers_records() -> None:
    # d0 restarted after it was found wedged, and answers again; then p0 wedges
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    faults.blame("p1", "d0", None)
    faults.answered("p0", "d0")
    assert faults.blame("p0", "d0", None) == (None, False)
    assert faults.blame("p0", "d1", None) == ("prefill", True)


def test_a_worker_gone_from_the_pool_leaves_no_record() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    present = {"p0", "p1", "d1"}.__contains__  # d0 removed
    assert faults.blame("p0", "d1", None, present) == (None, False)


def test_old_failures_and_avoided_pairs_are_forgotten() -> None:
    clock = _Clock()
    faults = PairFaults(clock)
    faults.blame("p0", "d0", None)
    clock.now = AVOID_S + 1
    assert faults.avoided() == set()
    clock.now = 3601.0
    faults.answered("p1", "d1")
    assert faults.blame("p1", "d0", None) == (None, False)
