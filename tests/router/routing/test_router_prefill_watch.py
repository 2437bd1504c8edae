"""A prefill side's request stops counting as queued prefill once its events show its prompt."""

from __future__ import annotations

from collections.abc import Sequence

from router.routing.load import LoadTracker, Ticket
from router.routing.prefill_watch import PrefillWatch


class Held:
    """What each stream holds, as `IndexerService.holds` answers it."""

    def __init__(self) -> None:
        self.keys: dict[str, set[int]] = {}
        self.asked: list[tuple[str, list[int]]] = []

    def __call__(self, stream: str, keys: Sequence[int]) -> list[bool]:
        self.asked.append((stream, list(keys)))
        held = self.keys.get(stream, set())
        return [key in held for key in keys]


def test_computed_takes_the_prompt_off_the_queue_once_and_keeps_it_running() -> None:
    load = LoadTracker()
    ticket = load.begin("p0", 500)
    other = load.begin("p0", 300)
    load.computed(ticket)
    load.computed(ticket)
    assert (load.of("p0").queued_prefill_tokens, load.of("p0").running) == (300, 2)
    # its answer later: the prompt is not taken off a second time
    load.first_byte(ticket)
    assert load.of("p0").queued_prefill_tokens == 300
    load.end(ticket)
    load.end(other)
    worker = load.of("p0")
    assert (worker.queued_prefill_tokens, worker.running, worker.uncached_tokens) == (0, 0, 0)
    # an answered or ended request is never computed again
    late = load.begin("p0", 100)
    load.first_byte(late)
    load.computed(late)
    assert load.of("p0").queued_prefill_tokens == 0
    load.end(late)
    load.computed(late)
    assert load.of("p0").queued_prefill_tokens == 0


def _two_watched() -> tuple[LoadTracker, PrefillWatch, Held, Ticket, Ticket]:
    """Two requests on stream s0, watched by last blocks 11 and 22; nothing held yet."""
    load = LoadTracker()
    watch = PrefillWatch()
    first, second = load.begin("p0", 64), load.begin("p0", 64)
    watch.watch("s0", first, 11)
    watch.watch("s0", second, 22)
    return load, watch, Held(), first, second


def test_a_watched_request_is_computed_when_its_stream_holds_its_last_block() -> None:
    _, watch, held, first, _ = _two_watched()
    assert watch.sweep("s0", held) == [] and len(watch) == 2
    held.keys["s0"] = {11}
    assert watch.sweep("s1", held) == []  # another stream's batch says nothing of these
    assert watch.sweep("s0", held) == [first]
    assert len(watch) == 1
    # reported once: the next sweep asks only about the one still watched
    held.asked.clear()
    assert watch.sweep("s0", held) == []
    assert held.asked == [("s0", [22])]


def test_answered_and_ended_requests_leave_the_watch_unreported() -> None:
    load, watch, held, answered, ended = _two_watched()
    load.first_byte(answered)
    load.end(ended)
    held.keys = {"s0": {11, 22}}
    assert watch.sweep("s0", held) == []
    assert len(watch) == 0 and held.asked == []  # nothing left to ask about


def test_a_request_on_several_streams_is_reported_once() -> None:
    load = LoadTracker()
    watch = PrefillWatch()
    held = Held()
    ticket = load.begin("p0", 64)  # no rank: its prompt went to every stream of the worker
    watch.watch("rank0", ticket, 11)
    watch.watch("rank1", ticket, 11)
    held.keys = {"rank0": {11}, "rank1": {11}}
    assert watch.sweep("rank0", held) == [ticket]
    load.computed(ticket)  # as the planner does with what a sweep reports
    assert watch.sweep("rank1", held) == []
    assert len(watch) == 0


def test_a_stream_that_applies_no_batch_keeps_only_its_requests_in_flight() -> None:
    load = LoadTracker()
    watch = PrefillWatch()
    for i in range(1000):
        ticket = load.begin("p0", 64)
        watch.watch("silent", ticket, i)
        load.end(ticket)
    assert len(watch) <= 64
    open_ = [load.begin("p0", 64) for _ in range(100)]
    for i, ticket in enumerate(open_):
        watch.watch("silent", ticket, 5000 + i)
    assert len(watch) >= 100  # the ones in flight are never dropped unswept
    held = Held()
    held.keys = {"silent": {5000 + i for i in range(100)}}
    assert watch.sweep("silent", held) == open_
