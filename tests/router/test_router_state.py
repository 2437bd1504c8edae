"""Pure router state: circuit breaker, load tracking, the approximate prefix tree."""

from __future__ import annotations

from router.config import BreakerConfig, WorkerConfig
from router.http import metrics as metrics_module
from router.http.metrics import RouterMetrics
from router.routing.approx_tree import ApproxTree
from router.routing.breaker import BreakerState, CircuitBreaker
from router.routing.load import LoadTracker, load_keys
from router.routing.pool import WorkerPool


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


def test_a_worker_added_again_is_not_decremented_by_its_earlier_requests() -> None:
    """Removed with a request in flight and added back under the same id (an admin DELETE
    and POST, a reload that changed its settings): the old request ending must not drive the
    new counters negative, which would make it the least loaded worker for good."""
    loads = LoadTracker()
    old = loads.begin("w", 100, dp_rank=0, kv_tokens=7, output_tokens=20)
    loads.forget("w")
    assert loads.of("w", 0).running == 0  # planned again: fresh counters
    new = loads.begin("w", 30, dp_rank=0, output_tokens=5)
    loads.first_byte(old)
    loads.end(old)
    fresh = loads.of("w", 0)
    assert (fresh.running, fresh.queued_prefill_tokens, fresh.uncached_tokens) == (1, 30, 30)
    assert (fresh.kv_tokens, fresh.output_tokens, fresh.sized) == (0, 5, 1)
    loads.end(new)
    assert (fresh.running, fresh.queued_prefill_tokens, fresh.uncached_tokens) == (0, 0, 0)
    assert loads.running() == {"w": 0}


def _recount(tree: ApproxTree, tokens_by_worker: dict[str, list[list[int]]]) -> None:
    """Each worker's size is the distinct prefix tokens of what it still holds."""
    for worker in tree.workers():
        held = {
            tuple(p[:n]) for p in tokens_by_worker.get(worker, []) for n in range(1, len(p) + 1)
        }
        alive = {t for t in held if tree.matches(list(t)).get(worker, 0) == len(t)}
        assert tree.size(worker) == len(alive)


def test_approx_tree_matches_into_nodes_and_names_a_holder_of_the_deepest() -> None:
    tree = ApproxTree()
    tree.insert(list(range(10)), "a")
    tree.insert([*range(8), 50, 51, 52, 53], "b")
    # a partial match into a node counts (SGLang counts matched characters, not nodes)
    assert tree.matches(list(range(10))) == {"a": 10, "b": 8}
    assert tree.matches([*range(8), 50, 51, 99]) == {"a": 8, "b": 10}
    assert tree.prefix_match([*range(8), 50, 51, 99]) == (10, "b")
    assert tree.prefix_match(list(range(5)))[0] == 5
    assert tree.prefix_match(list(range(5)))[1] in {"a", "b"}
    assert tree.prefix_match([7, 7, 7]) == (0, None)
    # sizes are tokens held: a 8 + 2, b 8 + 4 (the split shares the first 8)
    assert tree.size("a") == 10 and tree.size("b") == 12
    assert len(tree) == 4  # root, the shared 8, two tails


def test_approx_tree_names_the_same_holder_every_time() -> None:
    tree = ApproxTree()
    for w in ("a", "b", "c"):
        tree.insert([1, 2, 3, 4], w)
    names = {tree.prefix_match([1, 2, 3, 4, 5])[1] for _ in range(5)}
    assert len(names) == 1


def test_approx_tree_evicts_the_oversized_workers_lru_leaves_only() -> None:
    tree = ApproxTree()
    a_prompts = [[i, 100 + i, 200 + i, 300 + i] for i in range(6)]
    for p in a_prompts:
        tree.insert(p, "a")
    tree.insert([90, 91], "b")
    tree.touch(a_prompts[0], "a")  # the oldest becomes the most recent
    tree.evict_by_size(8)  # a holds 24 tokens: its 4 least recently used prompts go
    assert tree.size("a") == 8 and tree.size("b") == 2
    kept = [p for p in a_prompts if tree.matches(p).get("a") == 4]
    assert kept == [a_prompts[0], a_prompts[5]]
    assert tree.matches([90, 91]) == {"b": 2}
    _recount(tree, {"a": a_prompts, "b": [[90, 91]]})


def test_approx_tree_eviction_takes_leaves_before_their_parents() -> None:
    tree = ApproxTree()
    tree.insert([1, 2, 3, 4], "a")
    tree.insert([1, 2, 9, 9, 9, 9], "a")
    tree.evict_by_size(6)  # 2 + 2 + 4 = 8 tokens: the older leaf [3, 4] goes
    assert tree.matches([1, 2, 9, 9, 9, 9]) == {"a": 6} and tree.size("a") == 6
    tree.evict_by_size(2)  # then the other leaf, and [1, 2] is a leaf it keeps
    assert tree.matches([1, 2, 9]) == {"a": 2} and tree.size("a") == 2


def test_approx_tree_sizes_stay_exact_under_random_inserts_and_evictions() -> None:
    import random

    seed = 20261201
    print(f"seed {seed}")
    rng = random.Random(seed)
    tree = ApproxTree()
    sent: dict[str, list[list[int]]] = {}
    for step in range(300):
        worker = rng.choice("abc")
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        tree.insert(prompt, worker)
        sent.setdefault(worker, []).append(prompt)
        if step % 50 == 49:
            tree.evict_by_size(rng.randrange(5, 30))
            _recount(tree, sent)
            assert all(tree.size(w) <= 30 for w in tree.workers())
    tree.remove_worker("a")
    assert "a" not in tree.workers()
    assert all("a" not in tree.matches(p) for p in sent["a"])
    _recount(tree, sent)


def test_the_routable_gauge_is_the_pool_when_scraped() -> None:
    """A breaker that opens or a drain shows at the next scrape, not the next health round."""
    breaker = BreakerConfig(failure_threshold=1, cooldown_s=60)
    pool = WorkerPool(breaker)
    for name in ("a", "b"):
        pool.add(WorkerConfig(id=name, url=f"http://127.0.0.1:1/{name}"))
    clock = [0.0]
    metrics = RouterMetrics()
    metrics.export_routable(lambda: {e.id: e.routable(clock[0]) for e in pool})
    text = metrics.render().decode()
    assert 'kvroute_worker_routable{worker="a"} 1.0' in text
    assert 'kvroute_worker_routable{worker="b"} 1.0' in text
    pool.get("a").breaker.failure(clock[0])
    pool.get("b").draining = True
    text = metrics.render().decode()
    assert 'kvroute_worker_routable{worker="a"} 0.0' in text
    assert 'kvroute_worker_routable{worker="b"} 0.0' in text
    clock[0] = 61.0  # the breaker's cooldown over: it lets a probe through
    assert 'kvroute_worker_routable{worker="a"} 1.0' in metrics.render().decode()


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
    clock = [100.0]
    metrics = RouterMetrics(clock=lambda: clock[0])  # the late-answer window, without waiting
    forgotten: list[set[str]] = []
    metrics.forget_with(lambda workers: forgotten.append(set(workers)))
    pool = {"gone": True, "kept": True}
    metrics.export_routable(lambda: pool)
    for worker in ("gone", "kept"):
        metrics.retries.labels(worker).inc()
        metrics.record("/generate", worker, 200, prompt=10, matched=4, seconds=0.01)
    text = metrics.render().decode()
    assert 'kvroute_worker_routable{worker="gone"} 1.0' in text
    assert 'kvroute_prompt_tokens_total{model="",worker="gone"} 10.0' in text
    metrics.forget("gone")
    del pool["gone"]  # the pool forgets it too
    assert forgotten == [{"gone"}]
    text = metrics.render().decode()
    # every series naming it is gone (a fleet that churns workers would grow them forever);
    # the latency histogram has no worker label and keeps counting
    assert 'worker="gone"' not in text
    for name in ("kvroute_worker_routable", "kvroute_retries_total", "kvroute_requests_total"):
        assert f"{name}{{" in text and 'worker="kept"' in text
    assert 'kvroute_request_duration_seconds_count{endpoint="/generate",model=""} 2.0' in text
    # a request it was serving when removed answers late: dropped again when scraped
    metrics.record("/generate", "gone", 200, prompt=10, matched=4, seconds=0.01)
    metrics.retries.labels("gone").inc()
    assert 'worker="gone"' not in metrics.render().decode()
    # added back under the same id: it counts again, from zero
    metrics.added("gone")
    metrics.record("/generate", "gone", 200, prompt=10, matched=4, seconds=0.01)
    text = metrics.render().decode()
    assert (
        'kvroute_requests_total{code="200",endpoint="/generate",model="",worker="gone"} 1.0' in text
    )
    # removed again: after the window a late answer is kept (nothing remembers it forever)
    metrics.forget("gone")
    clock[0] += metrics_module.LATE_ANSWERS_S + 1
    assert 'worker="gone"' not in metrics.render().decode()
    metrics.record("/generate", "gone", 200, prompt=10, matched=4, seconds=0.01)
    assert 'worker="gone"' in metrics.render().decode()


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
    # the fleet's workers are listed at 0 while nothing is counted there (a worker of one
    # stream counts without a rank, one of several per rank), counted ones as they are
    fleet = [*load_keys("w", [0, 1]), *load_keys("one", [0]), *load_keys("bare", [])]
    assert fleet == [("w", 0), ("w", 1), ("one", None), ("bare", None)]
    loads.begin("w", 9, dp_rank=1)
    assert loads.running(fleet) == {"w": 1, "one": 0, "bare": 0}
    assert loads.running_by_rank(fleet) == {("w", 0): 0, ("w", 1): 1}
    targets = loads.by_target(fleet)
    assert {key: load.running for key, load in targets.items()} == {
        ("w", 0): 0,
        ("w", 1): 1,
        ("one", None): 0,
        ("bare", None): 0,
    }
    assert targets["w", 1] is loads.of("w", 1) and loads.by_target().keys() == {("w", 1)}


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
