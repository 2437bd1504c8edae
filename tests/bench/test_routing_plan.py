"""`kvroute bench routing`'s settings as its report states them: the notes on the oracle and
the pooled bound, the kv settings that differ from the router's defaults, and the order the
policies run in."""

from __future__ import annotations

import argparse

from bench import routing_bench
from bench.routing_bench import SuiteSettings, settings_from_args


def _settings(*argv: str) -> SuiteSettings:
    parser = argparse.ArgumentParser()
    routing_bench.add_arguments(parser)
    return settings_from_args(parser.parse_args(["--quick", *argv]))


def test_the_oracle_is_called_a_greedy_affinity_oracle_not_a_bound() -> None:
    notes = routing_bench._notes(_settings())
    (oracle,) = [n for n in notes if n.startswith("`oracle` is the harness")]
    assert "greedy affinity oracle, not a bound" in oracle and "bounds affinity" not in oracle
    (pooled,) = [n for n in notes if n.startswith("`% of pooled bound`")]
    assert "can only lose" not in pooled and "not a strict bound" in pooled


def test_the_fleet_section_names_every_kv_setting_that_is_not_the_routers_default() -> None:
    # the harness sets the batch window to the simulated decode step (0.4 ms, default 20 ms),
    # which the report's "the router's defaults" hid, and the step in prefill tokens (2 ms
    # over 0.5 ms: 4, default 200)
    line = routing_bench.kv_settings_line(_settings())
    assert line == (
        "the router's defaults but seed=1 (router default 0; the run's --seed), "
        "decode_step_weight=4 (router default 200; the simulated fleet's decode step in "
        "prefill tokens, decode_ms_per_token / prefill_ms_per_token, as an operator sets it "
        "for their fleet), "
        "admission_batch_window_ms=0.4 (router default 20; the simulated fleet's decode step, "
        "decode_ms_per_token x time_scale, as an operator sets it for their fleet)"
    )
    tuned = routing_bench.kv_settings_line(
        _settings("--seed", "0", "--kv-hit-weight", "8", "--time-scale", "0.5")
    )
    assert tuned.startswith("the router's defaults but hit_weight=8 (router default 4; --kv-")
    assert "admission_batch_window_ms=1 (router default 20;" in tuned and "seed=" not in tuned


def test_the_policies_take_turns_at_running_first() -> None:
    # kv ran first in every section, so a run's drift always fell on the same policy
    policies = ["kv", "approx_tree", "sglang_cache_aware", "least_load", "oracle"]
    orders = [routing_bench.run_order(policies, 1, section) for section in range(5)]
    assert [order[0] for order in orders] == [
        "approx_tree", "sglang_cache_aware", "least_load", "oracle", "kv",
    ]  # fmt: skip
    assert all(sorted(order) == sorted(policies) for order in orders)
    # each one keeps the others' cyclic order, and the seed moves the offset
    assert orders[0] == ["approx_tree", "sglang_cache_aware", "least_load", "oracle", "kv"]
    assert routing_bench.run_order(policies, 2, 0) == orders[1]
    assert routing_bench.run_order([], 1, 3) == []
    (note,) = [n for n in routing_bench._notes(_settings()) if "order rotates" in n]
    assert "the tables list them in a fixed order" in note
