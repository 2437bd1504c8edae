"""Whom a pair's deadline is charged to when neither leg answered (`PairStalls`)."""

from __future__ import annotations

from router.http.pair_stalls import PairStalls


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_first_stall_is_the_prefills_as_before() -> None:
    assert PairStalls().charge("p0", "d0") == "prefill"


def test_a_decode_stalling_with_another_prefill_is_charged() -> None:
    stalls = PairStalls()
    assert stalls.charge("p0", "d0") == "prefill"
    assert stalls.charge("p1", "d0") == "decode"
    assert stalls.charge("p2", "d0") == "decode"


def test_a_prefill_stalling_with_another_decode_stays_charged() -> None:
    stalls = PairStalls()
    assert stalls.charge("p0", "d0") == "prefill"
    assert stalls.charge("p0", "d1") == "prefill"


def test_the_same_pair_again_says_nothing_new() -> None:
    stalls = PairStalls()
    stalls.charge("p0", "d0")
    assert stalls.charge("p0", "d0") == "prefill"


def test_both_seen_with_others_is_not_told_apart() -> None:
    # each stalled with another partner before: no side stands out, the prefill as before
    stalls = PairStalls()
    stalls.charge("p0", "d1")
    stalls.charge("p1", "d0")
    assert stalls.charge("p0", "d0") == "prefill"


def test_old_stalls_are_forgotten() -> None:
    clock = _Clock()
    stalls = PairStalls(clock)
    stalls.charge("p0", "d0")
    clock.now = 3601.0
    assert stalls.charge("p1", "d0") == "prefill"
