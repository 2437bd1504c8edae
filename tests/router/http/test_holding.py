"""The held requests' queues (`router.http.holding`): who looks again, and when."""

from __future__ import annotations

from router.http.holding import HeldRequests

A = ("w0", None)
B = ("w1", 0)


def test_progress_on_a_rank_wakes_the_head_of_its_queue_only() -> None:
    held = HeldRequests(poll_s=0.05)
    first, second = held.enter(A), held.enter(A)
    other = held.enter(B)
    held.progressed(A)
    assert first.woken.is_set() and not second.woken.is_set() and not other.woken.is_set()
    held.progressed(("w9", None))  # nobody waits there: nothing happens
    assert held.count == 3


def test_only_the_head_of_a_queue_polls_and_leaving_hands_the_turn_on() -> None:
    held = HeldRequests(poll_s=0.05)
    first, second = held.enter(A), held.enter(A)
    assert held.wait_s(first, 10.0) == 0.05  # the head looks again every poll
    assert held.wait_s(second, 10.0) == 10.0  # the rest wait their turn (or their deadline)
    assert held.wait_s(first, 0.01) == 0.01  # never past its own deadline
    held.leave(first)  # it went: the next may fit in the room it found
    assert second.woken.is_set() and held.count == 1
    assert held.wait_s(second, 10.0) == 0.05
    held.leave(second)
    assert held.count == 0 and held.wait_s(second, 1.0) == 1.0


def test_a_request_whose_first_choice_changes_queues_for_the_new_one() -> None:
    held = HeldRequests(poll_s=0.05)
    first, second = held.enter(A), held.enter(A)
    held.move(first, B)  # its first choice is another rank now
    assert first.target == B
    held.progressed(A)
    assert second.woken.is_set() and not first.woken.is_set()
    held.progressed(B)
    assert first.woken.is_set()
    held.move(second, A)  # the same rank: no change of place
    assert held.wait_s(second, 1.0) == 0.05 and held.count == 2


def test_a_head_that_moves_away_hands_the_turn_on_at_once() -> None:
    # the one behind it heads the old queue now: woken, or nothing on an idle rank would ever
    # wake it (it waits its turn, up to its deadline, and only a head polls)
    held = HeldRequests(poll_s=0.05)
    first, second, third = held.enter(A), held.enter(A), held.enter(A)
    held.move(first, B)
    assert second.woken.is_set() and not third.woken.is_set()
    assert held.wait_s(second, 10.0) == 0.05


def test_a_request_waits_behind_those_held_before_it_for_the_same_rank() -> None:
    held = HeldRequests(poll_s=0.05)
    assert not held.ahead(A)  # nobody waits there: a new request may go if it fits
    first = held.enter(A)
    assert held.ahead(A)  # a new request does not overtake it, room or not
    assert not held.ahead(B)
    second = held.enter(A)
    assert not held.ahead(A, first) and held.ahead(A, second)


def test_a_request_moved_to_another_rank_keeps_its_age_there() -> None:
    # held before the ones already waiting there: it goes first there too
    held = HeldRequests(poll_s=0.05)
    old = held.enter(A)
    young = held.enter(B)
    held.move(old, B)
    assert not held.ahead(B, old) and held.ahead(B, young)
    assert held.wait_s(old, 10.0) == 0.05 and held.wait_s(young, 10.0) == 10.0


def test_over_the_cap_the_oldest_held_goes_first() -> None:
    held = HeldRequests(poll_s=0.05)
    assert not held.release_oldest()  # none held: nothing to let go
    first, second = held.enter(B), held.enter(A)
    third = held.enter(B)
    assert held.release_oldest()
    assert first.released and first.woken.is_set() and held.count == 2
    # the one behind it heads the queue now, and polls
    assert third.woken.is_set() and held.wait_s(third, 10.0) == 0.05
    held.leave(first)  # already out of the queues and the count
    assert held.count == 2
    assert held.release_oldest() and second.released and not third.released
    held.leave(third)
    assert held.count == 0 and not held.release_oldest()
