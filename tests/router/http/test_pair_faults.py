"""Whose failure a pair's failed handoff was, told by its partners (`PairFaults`)."""

from __future__ import annotations

from router.http.pair_faults import PairFaults


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_first_failure_takes_its_default() -> None:
    assert PairFaults().blame("p0", "d0", None) is None
    assert PairFaults().blame("p0", "d0", "decode") == "decode"


def test_a_decode_failing_with_another_prefill_is_blamed() -> None:
    faults = PairFaults()
    assert faults.blame("p0", "d0", None) is None
    assert faults.blame("p1", "d0", None) == "decode"
    assert faults.blame("p2", "d0", None) == "decode"


def test_a_prefill_failing_with_another_decode_is_blamed_whatever_the_default() -> None:
    faults = PairFaults()
    assert faults.blame("p0", "d0", "decode") == "decode"
    assert faults.blame("p0", "d1", "decode") == "prefill"


def test_the_same_pair_again_says_nothing_new() -> None:
    faults = PairFaults()
    faults.blame("p0", "d0", None)
    assert faults.blame("p0", "d0", None) is None


def test_both_seen_with_others_is_not_told_apart() -> None:
    faults = PairFaults()
    faults.blame("p0", "d1", None)
    faults.blame("p1", "d0", None)
    assert faults.blame("p0", "d0", "decode") == "decode"
    assert faults.blame("p0", "d0", None) is None


def test_old_failures_are_forgotten() -> None:
    clock = _Clock()
    faults = PairFaults(clock)
    faults.blame("p0", "d0", None)
    clock.now = 3601.0
    assert faults.blame("p1", "d0", None) is None
