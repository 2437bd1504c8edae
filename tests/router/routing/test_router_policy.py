"""Routing policies: pure ranking, deterministic tie-breaks, dry runs that change nothing."""

from __future__ import annotations

import random
from typing import get_args

import pytest

from router.config import PolicyConfig, PolicyName
from router.routing.policy import (
    ApproxTreePolicy,
    Candidate,
    KvPolicy,
    LeastLoadPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    build_policy,
    effective_hit,
)


def _views(
    *specs: tuple[str, float, int, int], unhealthy: set[str] | None = None
) -> list[Candidate]:
    down = unhealthy or set()
    return [
        Candidate(
            w,
            url=f"http://{w}",
            healthy=w not in down,
            status="ready" if w not in down else "unhealthy",
            hit_tokens=hit,
            queued_prefill_tokens=q,
            running=r,
        )
        for w, hit, q, r in specs
    ]


def test_kv_prefers_the_longest_hit_when_loads_are_equal() -> None:
    policy = KvPolicy(PolicyConfig(hit_weight=1.0))
    ranked = policy.rank([1] * 100, _views(("a", 0, 0, 0), ("b", 64, 0, 0), ("c", 32, 0, 0)))
    assert [s.worker for s in ranked] == ["b", "c", "a"]
    assert ranked[0].score == 64


def test_kv_weighs_the_hit_against_in_flight_load() -> None:
    policy = KvPolicy(PolicyConfig(hit_weight=1.0, decode_weight=32.0))
    # b holds 64 more tokens but has 3 running (96 token-equivalents) and 10 queued: a wins
    ranked = policy.rank([1] * 200, _views(("a", 0, 0, 0), ("b", 64, 10, 3)))
    assert ranked[0].worker == "a"
    assert ranked[1].load == 10 + 3 * 32


def test_kv_charges_room_only_where_every_candidate_s_is_known() -> None:
    policy = KvPolicy(PolicyConfig(hit_weight=4.0, room_weight=0.5))
    # a holds a one-page head but its pool is full: 400 tokens evicted; b has room
    a, b = _views(("a", 4, 0, 0), ("b", 0, 0, 0))
    a.evicts_tokens, b.evicts_tokens = 400, 0
    ranked = policy.rank([1] * 404, [a, b])
    assert [c.worker for c in ranked] == ["b", "a"]
    assert (ranked[0].score, ranked[1].score) == (0.0, 16 - 200)
    # b's capacity unknown: not a bonus for b, no charge for anyone (the head decides)
    a, b = _views(("a", 4, 0, 0), ("b", 0, 0, 0))
    a.evicts_tokens, b.evicts_tokens = 400, None
    ranked = policy.rank([1] * 404, [a, b])
    assert [c.worker for c in ranked] == ["a", "b"]
    assert (ranked[0].score, ranked[1].score) == (16.0, 0.0)


def test_kv_ties_go_to_the_less_loaded_then_random() -> None:
    policy = KvPolicy(PolicyConfig(hit_weight=1.0, decode_weight=0.0))
    # same score (hit - load): a has hit 10 and load 10, b has hit 0 and load 0
    ranked = policy.rank([1] * 50, _views(("a", 10, 10, 0), ("b", 0, 0, 0)))
    assert ranked[0].worker == "b"
    # full ties: both orders occur across decisions, and each decision is reproducible
    seen = set()
    for _ in range(40):
        first = policy.rank([1], _views(("a", 0, 0, 0), ("b", 0, 0, 0)))[0].worker
        again = policy.rank([1], _views(("a", 0, 0, 0), ("b", 0, 0, 0)))[0].worker
        assert first == again  # rank changes no state
        seen.add(first)
        policy.record([1], first)
    assert seen == {"a", "b"}


def test_unhealthy_workers_rank_last_whatever_their_hit() -> None:
    policy = KvPolicy(PolicyConfig())
    ranked = policy.rank([1] * 10, _views(("a", 1000, 0, 0), ("b", 0, 0, 0), unhealthy={"a"}))
    assert [(s.worker, s.healthy) for s in ranked] == [("b", True), ("a", False)]


def test_round_robin_cycles_over_healthy_workers_only_on_record() -> None:
    policy = RoundRobinPolicy(PolicyConfig())
    views = _views(("a", 0, 0, 0), ("b", 0, 0, 0), ("c", 0, 0, 0), unhealthy={"b"})
    picks = []
    for _ in range(4):
        first = policy.rank([], views)[0].worker
        assert policy.rank([], views)[0].worker == first
        policy.record([], first)
        picks.append(first)
    assert picks == ["a", "c", "a", "c"]


def test_round_robin_takes_turns_within_each_pool_of_candidates() -> None:
    # the planner offers only the workers of the request's model: requests of two models
    # taking turns must still spread over each model's workers
    policy = RoundRobinPolicy(PolicyConfig())
    pools = [_views(("a0", 0, 0, 0), ("a1", 0, 0, 0)), _views(("b0", 0, 0, 0), ("b1", 0, 0, 0))]
    picks: list[str] = []
    for i in range(8):
        first = policy.rank([], pools[i % 2])[0].worker
        policy.record([], first)
        picks.append(first)
    assert picks == ["a0", "b0", "a1", "b1"] * 2
    policy.forget("a0")  # a worker that left and came back starts over, first in line
    assert policy.rank([], pools[0])[0].worker == "a0"


def test_least_load_ignores_hits() -> None:
    policy = LeastLoadPolicy(PolicyConfig())
    ranked = policy.rank([1], _views(("a", 1000, 5, 1), ("b", 0, 0, 1), ("c", 0, 0, 2)))
    assert [s.worker for s in ranked] == ["b", "a", "c"]


def test_random_is_seeded_and_spreads() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    views = _views(("a", 0, 0, 0), ("b", 0, 0, 0), ("c", 0, 0, 0))

    def run() -> list[str]:
        policy = RandomPolicy(PolicyConfig(name="random", seed=seed))
        out = []
        for _ in range(60):
            w = policy.rank([], views)[0].worker
            policy.record([], w)
            out.append(w)
        return out

    first = run()
    assert first == run()
    assert set(first) == {"a", "b", "c"}


def test_approx_tree_follows_past_decisions_and_balances() -> None:
    policy = ApproxTreePolicy(PolicyConfig(name="approx_tree"))
    prompt = list(range(40))
    views = _views(("a", 0, 0, 0), ("b", 0, 0, 0))
    first = policy.rank(prompt, views)[0].worker
    policy.record(prompt, first)
    # same prefix, longer prompt: the tree's match wins
    ranked = policy.rank([*prompt, 99, 98], views)
    assert ranked[0].worker == first
    assert ranked[0].hit_tokens == 40
    # a new prefix goes to the worker with the smaller tree
    other = policy.rank(list(range(100, 140)), views)[0].worker
    assert other != first
    # thousands of queued prefill tokens are no imbalance: SGLang counts requests
    busy = [
        Candidate(first, "", True, "ready", queued_prefill_tokens=5000, running=10),
        Candidate(other, "", True, "ready"),
    ]
    assert policy.rank(prompt, busy)[0].worker == first
    # more than 64 requests apart (and 1.5x) is
    loaded = [
        Candidate(first, "", True, "ready", running=70),
        Candidate(other, "", True, "ready", running=5),
    ]
    assert policy.rank(prompt, loaded)[0].worker == other
    policy.forget(first)
    assert policy.rank(prompt, views)[0].hit_tokens == 0


def test_approx_tree_needs_more_than_the_cache_threshold_of_the_prompt() -> None:
    policy = ApproxTreePolicy(PolicyConfig(name="approx_tree", approx_cache_threshold=0.3))
    views = _views(("a", 0, 0, 0), ("b", 0, 0, 0))
    policy.record(list(range(30)), "a")  # a's tree is now the larger one
    # 30 of 100 tokens (not more than 0.3): the smallest tree, b
    assert policy.rank([*range(30), *range(500, 570)], views)[0].worker == "b"
    # 30 of 99: a
    assert policy.rank([*range(30), *range(500, 569)], views)[0].worker == "a"


def test_approx_tree_evicts_on_its_interval() -> None:
    now = [0.0]
    config = PolicyConfig(
        name="approx_tree", approx_eviction_interval_s=60.0, approx_max_tree_size=16
    )
    policy = ApproxTreePolicy(config, clock=lambda: now[0])
    for i in range(4):
        policy.record([i] * 10, "a")
    assert policy.matched([0] * 10) == {"a": 10}
    now[0] = 61.0
    policy.record([9] * 10, "a")  # past the interval: a is cut to 16 tokens, oldest first
    assert policy.matched([0] * 10) == {} and policy.matched([9] * 10) == {"a": 10}


def test_effective_hit_weights_tiers_and_ignores_stale_streams() -> None:
    weights = {"GPU": 1.0, "CPU": 0.5}

    def hit(by_medium: dict[str, int], *, stale: bool) -> float:
        return effective_hit(
            matched_blocks=4,
            pending_tokens=8,
            block_size=16,
            by_medium=by_medium,
            stale=stale,
            weights=weights,
        )

    assert hit({"GPU": 2, "CPU": 2}, stale=False) == (2 * 16 + 1 * 16 + 8)
    assert hit({}, stale=False) == 4 * 16 + 8
    assert hit({"GPU": 4}, stale=True) == 0


@pytest.mark.parametrize("name", ["kv", "round_robin", "random", "least_load", "approx_tree"])
def test_every_policy_is_buildable_by_name(name: str) -> None:
    policy = build_policy(PolicyConfig(name=name))  # type: ignore[arg-type]
    assert policy.name == name
    ranked = policy.rank([1, 2, 3], _views(("a", 0, 0, 0)))
    assert ranked[0].worker == "a"


def test_the_default_hit_weight_keeps_affinity_against_moderate_load() -> None:
    # the default (4) keeps a 64-token hit on a worker with 3 running requests and 10 queued
    # tokens, which the plain saved-prefill comparison (weight 1) would give up
    policy = KvPolicy(PolicyConfig())
    ranked = policy.rank([1] * 200, _views(("a", 0, 0, 0), ("b", 64, 10, 3)))
    assert ranked[0].worker == "b" and ranked[0].score == 4 * 64 - (10 + 3 * 32)


def test_only_the_kv_policy_leaves_pending_marks() -> None:
    # the planner asks the policy instead of comparing its name
    names = get_args(PolicyName)
    marking = {n for n in names if build_policy(PolicyConfig(name=n)).marks_pending}
    assert marking == {"kv"}


def test_a_tier_the_weights_do_not_name_earns_nothing_but_the_gpu_always_counts() -> None:
    def hit(by_medium: dict[str, int], weights: dict[str, float]) -> float:
        return effective_hit(
            matched_blocks=sum(by_medium.values()),
            pending_tokens=0,
            block_size=16,
            by_medium=by_medium,
            stale=False,
            weights=weights,
        )

    assert hit({"MYSTERY": 4}, {"GPU": 1.0}) == 0  # fail closed: reload cost unknown
    assert hit({"GPU": 2, "CPU_PINNED": 2}, PolicyConfig().medium_weights) == 2 * 16 + 1 * 16
    assert hit({"GPU": 3}, {"CPU": 0.5}) == 3 * 16  # GPU needs no weight entry


def test_round_robin_gives_every_dp_rank_its_turn() -> None:
    policy = RoundRobinPolicy(PolicyConfig())
    views = [Candidate(w, "", True, "ready", dp_rank=r) for w in ("a", "b") for r in (0, 1)]
    picks = []
    for _ in range(8):
        first = policy.rank([], views)[0]
        policy.record([], first.target)
        picks.append(first.target)
    assert sorted(set(picks)) == sorted(v.target for v in views)
    assert len(set(picks[:4])) == 4  # one full round before any target repeats
    policy.forget("a")
    assert all(not t.startswith("a") for t in policy._last)


@pytest.mark.parametrize("name", ["kv", "least_load"])
def test_a_reload_changes_the_decode_weight_of_the_next_decision(name: PolicyName) -> None:
    policy = build_policy(PolicyConfig(name=name, decode_weight=32.0))
    (view,) = _views(("a", 0.0, 10, 3))
    assert policy.load(view) == 10 + 32 * 3
    policy.reconfigure(PolicyConfig(name=name, decode_weight=1.0))
    assert policy.load(view) == 10 + 1 * 3


def _capped(worker: str, hit: float, running: int, cap: int | None = 4) -> Candidate:
    """A candidate running `running` requests of 32 output tokens, `cap` at once."""
    (view,) = _views((worker, hit, 0, running))
    view.running_cap, view.running_output_tokens = cap, 32.0
    return view


def test_kv_takes_the_wait_for_a_place_in_a_full_batch_off_the_hit_and_counts_it_as_load() -> None:
    # a burst of one 4,000-token prompt: its holder runs 4 at once, and a request's run is 32
    # output tokens x decode_step_weight 200 = 6,400 prefill tokens; the idle worker has none
    policy = KvPolicy(PolicyConfig())
    run = 32 * 200
    # under its cap nothing waits: the hit wins as before
    ranked = policy.rank([1] * 4000, [_capped("holder", 3984, 3), _capped("idle", 0, 0)])
    assert ranked[0].worker == "holder" and ranked[0].queue_wait == 0
    assert ranked[0].score == 4 * 3984 - 3 * 32
    # full: the next waits for 1 of 4 places, a quarter of a run; the hit still saves more
    ranked = policy.rank([1] * 4000, [_capped("holder", 3984, 4), _capped("idle", 0, 0)])
    holder = ranked[0]
    assert holder.worker == "holder" and holder.queue_wait == run / 4
    assert holder.load == 4 * 32 + run / 4
    assert holder.score == 4 * (3984 - run / 4) - holder.load
    # 2 queued already: the third waits 3/4 of a run, longer than the hit's prefill: the idle
    # worker prefills it sooner, and takes it (before, the holder won up to ~500 in flight)
    ranked = policy.rank([1] * 4000, [_capped("holder", 3984, 6), _capped("idle", 0, 0)])
    assert [c.worker for c in ranked] == ["idle", "holder"]
    holder = ranked[1]
    assert holder.queue_wait == 3 * run / 4 and holder.score == -(6 * 32 + 3 * run / 4)
    assert policy.explain_queue(holder) == (
        "6 requests in flight, 4 run at once: it waits for 3 to finish, 3/4 of a request's run "
        "(32 output tokens x decode_step_weight 200 = 6400 prefill tokens): 4800 prefill "
        "tokens, counted in its load, and taken off the hit it would find there"
    )
    assert policy.explain_queue(ranked[0]) is None


def test_a_worker_whose_running_limit_is_unknown_waits_for_nothing() -> None:
    policy = KvPolicy(PolicyConfig())
    ranked = policy.rank([1] * 4000, [_capped("holder", 3984, 60, cap=None), _capped("idle", 0, 0)])
    assert ranked[0].worker == "holder" and ranked[0].queue_wait == 0
    assert ranked[0].load == 60 * 32 and policy.explain_queue(ranked[0]) is None


def test_least_load_counts_the_wait_and_approx_tree_counts_requests() -> None:
    # two queued on a worker of 4 places against 5 running on one of 8: the queue is longer
    least = LeastLoadPolicy(PolicyConfig(decode_step_weight=10.0))
    ranked = least.rank([1], [_capped("full", 0, 6), _capped("big", 0, 7, cap=8)])
    assert [c.worker for c in ranked] == ["big", "full"]
    assert ranked[1].load == 6 * 32 + 3 / 4 * 32 * 10
    assert least.explain_queue(ranked[1]) is not None
    assert "taken off the hit" not in (least.explain_queue(ranked[1]) or "")
    # SGLang's cache_aware knows no running limit: approx_tree's load stays its requests
    tree = ApproxTreePolicy(PolicyConfig())
    ranked = tree.rank([1], [_capped("full", 0, 6), _capped("big", 0, 7, cap=8)])
    assert [(c.worker, c.load, c.queue_wait) for c in ranked] == [
        ("full", 6.0, 0.0), ("big", 7.0, 0.0),
    ]  # fmt: skip
