"""Pure router state: circuit breaker, load tracking, the approximate prefix tree."""

from __future__ import annotations

from router.http.metrics import RouterMetrics
from router.routing.approx_tree import ApproxTree
from router.routing.breaker import BreakerState, CircuitBreaker
from router.routing.load import LoadTracker


def test_breaker_opens_after_threshold_and_half_opens_after_cooldown() -> None:
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0)
    b.failure(0.0)
    b.failure(1.0)
    assert b.allows(1.0)
    b.failure(2.0)
    assert b.state(2.0) is BreakerState.OPEN and not b.allows(6.9)
    assert b.state(7.0) is BreakerState.HALF_OPEN and b.allows(7.0)
    b.failure(7.5)  # a failure while half open reopens at once
    assert b.state(8.0) is BreakerState.OPEN
    b.success()
    assert b.state(8.0) is BreakerState.CLOSED and b.failures == 0


def test_a_hard_failure_opens_the_breaker_at_once() -> None:
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0)
    b.failure(10.0, hard=True)
    assert not b.allows(10.0)


def test_load_tracks_prefill_until_first_byte_and_running_until_end() -> None:
    loads = LoadTracker()
    t1 = loads.begin("a", 100)
    t2 = loads.begin("a", 50)
    assert (loads.of("a").queued_prefill_tokens, loads.of("a").running) == (150, 2)
    loads.first_byte(t1)
    loads.first_byte(t1)  # idempotent
    assert (loads.of("a").queued_prefill_tokens, loads.of("a").running) == (50, 2)
    loads.end(t2)  # ending before the first byte releases its prefill too
    loads.end(t2)
    loads.end(t1)
    assert (loads.of("a").queued_prefill_tokens, loads.of("a").running) == (0, 0)
    t3 = loads.begin("b", 10)
    loads.forget("b")
    loads.end(t3)  # a ticket of a forgotten worker changes nothing
    assert loads.of("b").running == 0


def test_approx_tree_matches_whole_chunks_of_the_routed_prefix() -> None:
    tree = ApproxTree(chunk_tokens=4)
    tree.insert(list(range(10)), "a")
    tree.insert([*list(range(8)), 50, 51, 52, 53], "b")
    assert tree.match(list(range(10))) == {"a": 10, "b": 8}
    assert tree.match([*list(range(8)), 50, 51, 52, 53, 54]) == {"a": 8, "b": 12}
    assert tree.match([7, 7, 7, 7]) == {}
    assert tree.size("a") == 3 and tree.size("b") == 3


def test_approx_tree_is_bounded_and_forgets_workers() -> None:
    tree = ApproxTree(chunk_tokens=2, max_chunks=5)
    for i in range(20):
        tree.insert([i, i, i, i], "a")
    assert len(tree) == 5
    assert tree.size("a") == 5
    tree.remove_worker("a")
    assert len(tree) == 0 and tree.size("a") == 0


def test_in_flight_metrics_follow_the_load_tracker() -> None:
    loads = LoadTracker()
    metrics = RouterMetrics()
    metrics.export_in_flight(loads.running)
    ticket = loads.begin("w", 10)
    loads.begin("w", 5)
    assert 'kvroute_in_flight_requests{worker="w"} 2.0' in metrics.render().decode()
    loads.end(ticket)
    assert 'kvroute_in_flight_requests{worker="w"} 1.0' in metrics.render().decode()
    loads.forget("w")  # a removed worker's series goes with it
    assert 'worker="w"' not in metrics.render().decode()


def test_metrics_forget_a_removed_workers_series() -> None:
    metrics = RouterMetrics()
    metrics.healthy.labels("gone").set(1)
    metrics.record("/generate", "gone", 200, prompt=10, matched=4, seconds=0.01)
    assert 'kvroute_worker_routable{worker="gone"} 1.0' in metrics.render().decode()
    metrics.forget("gone")
    assert 'kvroute_worker_routable{worker="gone"}' not in metrics.render().decode()
    metrics.record("/generate", "gone", 200, prompt=10, matched=4, seconds=0.01)
    assert 'kvroute_requests_total{code="200",endpoint="/generate",model="",worker="gone"} 2.0' in (
        metrics.render().decode()
    )


def test_load_is_kept_per_dp_rank_and_summed_per_worker() -> None:
    loads = LoadTracker()
    r0 = loads.begin("w", 100, dp_rank=0)
    r1 = loads.begin("w", 40, dp_rank=1)
    bare = loads.begin("w", 7)  # sent without a rank (the engine picks)
    assert (loads.of("w", 0).running, loads.of("w", 1).running, loads.of("w").running) == (1, 1, 1)
    assert loads.of("w", 1).queued_prefill_tokens == 40
    total = loads.total("w")
    assert (total.queued_prefill_tokens, total.running) == (147, 3)
    assert loads.running() == {"w": 3}
    assert loads.running_by_rank() == {("w", 0): 1, ("w", 1): 1}  # ranked requests only
    loads.first_byte(r1)
    loads.end(r0)
    assert (loads.of("w", 0).running, loads.of("w", 1).queued_prefill_tokens) == (0, 0)
    loads.end(r1)
    loads.end(bare)
    assert loads.running() == {"w": 0} and loads.total("w").queued_prefill_tokens == 0
    loads.forget("w")
    assert loads.running() == {} and loads.running_by_rank() == {}


def test_rank_in_flight_metrics_follow_the_load_tracker() -> None:
    loads = LoadTracker()
    metrics = RouterMetrics()
    metrics.export_in_flight(loads.running)
    metrics.export_rank_in_flight(loads.running_by_rank)
    ticket = loads.begin("w", 10, dp_rank=1)
    loads.begin("w", 5, dp_rank=0)
    text = metrics.render().decode()
    assert 'kvroute_dp_rank_in_flight_requests{dp_rank="1",worker="w"} 1.0' in text
    assert 'kvroute_in_flight_requests{worker="w"} 2.0' in text  # the worker's total
    loads.end(ticket)
    assert 'kvroute_dp_rank_in_flight_requests{dp_rank="1",worker="w"} 0.0' in (
        metrics.render().decode()
    )
    loads.forget("w")
    assert 'worker="w"' not in metrics.render().decode()
