"""Pure pieces of the benchmark runner and suite: the oracle's page matching, rate from load."""

from __future__ import annotations

import argparse

import pytest

from bench.harness import FleetSpec, _shared_pages
from bench.routing_bench import add_arguments, build_workloads, rate_for_load, settings_from_args


def test_shared_pages_counts_whole_common_pages_without_the_last_token() -> None:
    a = list(range(100))
    assert _shared_pages(a, a, 16) == 96  # 99 matchable tokens -> 6 whole pages
    assert _shared_pages(a, a[:40], 16) == 32  # the other prompt cached 2 whole pages
    b = [*a[:20], -1, *a[21:]]
    assert _shared_pages(a, b, 16) == 16
    assert _shared_pages(a, [7, *a[1:]], 16) == 0
    assert _shared_pages([1], [1], 16) == 0


def _settings(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rate_from_load_fills_the_stated_share_of_prefill_capacity() -> None:
    settings = settings_from_args(_settings("--quick", "--workloads", "shared_prefix"))
    (workload,) = build_workloads(settings)
    fleet = FleetSpec(workers=2, prefill_ms_per_token=0.5, time_scale=0.2)
    rate = rate_for_load(workload, fleet, 1.0)
    mean_prompt = workload.prompt_tokens / len(workload.requests)
    # offered prefill seconds per second, spread over the workers, is the load
    assert rate * mean_prompt * 0.5 * 0.2 / 1000.0 / 2 == pytest.approx(1.0)
    assert workload.params["rate_rps"] == pytest.approx(
        rate_for_load(workload, settings.fleet, settings.load)
    )


def test_bad_command_lines_are_refused() -> None:
    with pytest.raises(SystemExit, match="workloads"):
        settings_from_args(_settings("--workloads", "nope"))
    with pytest.raises(SystemExit, match="pressures"):
        settings_from_args(_settings("--pressures", "0"))
    fixed = settings_from_args(_settings("--quick", "--rate", "5", "--workloads", "mooncake"))
    (workload,) = build_workloads(fixed)
    assert workload.params["rate_rps"] == 5.0
