"""`kvroute bench proxy` prices the operations layer against a router without it, round by round."""

from __future__ import annotations

import pytest

from bench.proxy_bench import PairedCost, RoundResult, ops_cost_table, paired_cost

BASELINE = "kvroute, observe off"


def rounds(*rates: float, cpu: float | None = None) -> list[RoundResult]:
    return [RoundResult(rate, cpu) for rate in rates]


def test_the_cost_is_the_median_of_ratios_taken_within_each_round() -> None:
    # the second round ran while the machine was busy: both routers slowed, the ratio held.
    # The ratio of totals (245 / 250 = 0.98) would blur that; the per-round ratios do not
    baseline = [RoundResult(100, 200.0), RoundResult(50, 300.0), RoundResult(100, 210.0)]
    mine = [RoundResult(95, 204.0), RoundResult(60, 290.0), RoundResult(90, 230.0)]
    cost = paired_cost(mine, baseline)
    assert cost == PairedCost(
        rounds=3, ratio=0.95, low=0.9, high=1.2, cpu_us=230.0, cpu_added_us=4.0
    )
    assert cost.cost == pytest.approx(0.05)


def test_rounds_without_requests_or_cpu_are_left_out() -> None:
    cost = paired_cost(rounds(0, 80, 90), rounds(100, 100, 0))
    assert cost is not None
    assert (cost.rounds, cost.ratio, cost.cpu_us, cost.cpu_added_us) == (1, 0.8, None, None)
    assert paired_cost(rounds(0), rounds(100)) is None
    assert paired_cost([], []) is None


def test_the_table_gives_each_router_its_verdict_against_five_percent() -> None:
    by_round = {
        BASELINE: rounds(100, 100, 100, cpu=200.0),
        f"{BASELINE}, a second identical router (control)": rounds(103, 98, 101, cpu=199.0),
        "kvroute": rounds(96, 97, 95, cpu=205.0),  # 4% cost
        "kvroute, tracing on (in-memory exporter)": rounds(50, 45, 55, cpu=400.0),
        "kvroute, tracing on, 1% sampled (in-memory exporter)": rounds(94, 93, 99, cpu=210.0),
    }
    lines = ops_cost_table(by_round, per_round=2000)
    text = "\n".join(lines)
    assert "3 interleaved rounds of 2000 requests" in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert rows["kvroute"].endswith("| met |")
    assert "0.960 (cost +4.0%)" in rows["kvroute"]
    assert "| 0.950-0.970 |" in rows["kvroute"]
    assert "| 205 | +5 us |" in rows["kvroute"]
    assert rows["kvroute, tracing on (in-memory exporter)"].endswith("| **missed** |")
    assert rows["kvroute, tracing on, 1% sampled (in-memory exporter)"].endswith("| **missed** |")
    assert "| 200 | - | - |" in rows[f"{BASELINE} (baseline)"]
    # the control shows the measure's noise, and no verdict
    control = rows[f"{BASELINE}, a second identical router (control)"]
    assert "1.010 (cost -1.0%) | 0.980-1.030 | 199 | -1 us | - (noise) |" in control
    # a router the run did not start has no row
    assert not any("10% sampled" in line for line in lines)


def test_no_baseline_no_section() -> None:
    assert ops_cost_table({"kvroute": rounds(100)}, per_round=10) == []
