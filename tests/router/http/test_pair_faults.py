"""Whose failure a pair's failed handoff was, told by its workers' other partners
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


def test_a_decode_failing_with_another_prefill_is_blamed() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    assert faults.blame("p1", "d0", None) == ("decode", True)


def test_a_prefill_failing_with_every_decode_is_blamed_whatever_its_word() -> None:
    faults = PairFaults()
    assert faults.blame("p0", "d0", "decode") == ("decode", False)
    assert faults.blame("p0", "d1", "decode") == ("prefill", True)


def test_the_same_pair_again_tells_nothing_whatever_came_between() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    faults.answered("p0", "d1")  # p0 answered with another decode; d0 got no traffic
    assert faults.blame("p0", "d0", None) == (None, False)


def test_a_worker_with_no_traffic_is_not_taken_for_a_healthy_one() -> None:
    # a transient failure of p0 with d0, then d1 wedges: d1 never failed before only because
    # it got nothing (QA: the only prefill charged, every request a 503). p0 failed before
    # with another decode, so it is charged once here; d1 is not cleared by having no record
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    assert faults.blame("p0", "d1", None) == ("prefill", True)
    # its record is spent: the next stall with d1 tells nothing more against it
    assert faults.blame("p0", "d1", None) == (None, False)


def test_a_worker_blamed_explains_its_partners_failures() -> None:
    # d0 was wedged, blamed at its second prefill; then d1 wedges: p0's failure with d0 is not
    # held against p0 (a record that outlived its verdict charged a healthy prefill)
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    assert faults.blame("p1", "d0", None) == ("decode", True)
    assert faults.blame("p0", "d1", None) == (None, False)
    assert faults.blame("p1", "d1", None) == ("decode", True)


def test_a_recovered_worker_is_not_blamed_on_its_spent_record() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    faults.blame("p1", "d0", None)  # d0 blamed: charged, its record spent
    assert faults.blame("p0", "d0", None) == (None, False)  # p0's transfer engine fails now


def test_an_answer_clears_both_workers_records() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    faults.answered("p0", "d0")
    assert faults.blame("p0", "d1", None) == (None, False)


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
    assert faults.blame("p1", "d0", None) == (None, False)
