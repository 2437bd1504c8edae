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
