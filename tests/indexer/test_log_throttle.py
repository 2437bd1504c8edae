"""LogThrottle: one line per key per interval, the held-back count, the bounded key set."""

from __future__ import annotations

import pytest

from indexer.log_throttle import LogThrottle


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_says_how_many_were_held_back() -> None:
    clock = Clock()
    throttle = LogThrottle(10.0, clock=clock)
    said = []
    for _ in range(100):  # 100 lines over 25 s, one every 0.25 s
        said.append(throttle.allow("k"))
        clock.now += 0.25
    assert [n for n in said if n is not None] == [0, 39, 39]
    assert [i for i, n in enumerate(said) if n is not None] == [0, 40, 80]


def test_the_interval_counts_from_the_line_said_not_the_ones_held_back() -> None:
    clock = Clock()
    throttle = LogThrottle(10.0, clock=clock)
    assert throttle.allow("k") == 0
    clock.now += 9.999
    assert throttle.allow("k") is None  # held back: does not start the interval again
    clock.now += 0.001
    assert throttle.allow("k") == 1
    clock.now += 10.0
    assert throttle.allow("k") == 0  # nothing held back since the last one said


def test_an_interval_of_zero_says_every_line() -> None:
    throttle = LogThrottle(0.0, clock=Clock())
    assert [throttle.allow("k") for _ in range(3)] == [0, 0, 0]


def test_keys_are_independent() -> None:
    clock = Clock()
    throttle = LogThrottle(10.0, clock=clock)
    assert throttle.allow("a") == 0
    assert throttle.allow("a") is None
    assert throttle.allow("b") == 0  # a's interval does not hold b back
    assert throttle.allow("b") is None and throttle.allow("b") is None
    clock.now += 5.0
    assert throttle.allow("c") == 0
    clock.now += 5.0
    assert throttle.allow("a") == 1 and throttle.allow("b") == 2  # each its own count
    assert throttle.allow("c") is None  # its interval started 5 s later


def test_the_key_set_is_bounded_by_forgetting_the_key_said_longest_ago() -> None:
    clock = Clock()
    throttle = LogThrottle(10.0, max_keys=3, clock=clock)
    for key in ("a", "b", "c"):
        assert throttle.allow(key) == 0
        clock.now += 1.0
    clock.now += 7.5  # a was said 10.5 s ago, its interval is over; b 9.5 s, c 8.5 s ago
    assert throttle.allow("a") == 0  # said again: now the newest
    assert throttle.allow("b") is None  # held back: keeps its place, said no later
    assert throttle.allow("d") == 0  # a fourth key forgets b, said longest ago
    assert len(throttle) == 3
    assert throttle.allow("b") == 0  # forgotten: said at once, its held-back line lost
    # b forgot c; a and d are remembered, each still within its interval
    assert throttle.allow("a") is None and throttle.allow("d") is None
    assert len(throttle) == 3


def test_one_key_is_enough_for_a_single_line() -> None:
    clock = Clock()
    throttle = LogThrottle(10.0, max_keys=1, clock=clock)
    assert throttle.allow("refused") == 0
    assert throttle.allow("refused") is None
    clock.now += 10.0
    assert throttle.allow("refused") == 1


def test_it_remembers_at_least_one_key() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        LogThrottle(10.0, max_keys=0)
