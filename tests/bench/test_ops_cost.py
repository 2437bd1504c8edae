"""`kvroute bench proxy` prices the operations layer against a router without it, round by round."""

from __future__ import annotations

import pytest

from bench.proxy_bench import RoundResult, ops_cost_table, paired_cost

BASELINE = "kvroute, observe off"


def rounds(*rates: float, cpu: float | None = None) -> list[RoundResult]:
    return [RoundResult(rate, cpu) for rate in rates]


def test_the_cost_is_the_median_of_ratios_taken_within_each_round() -> None:
    # the second round ran while the machine was busy: both routers slowed, the ratio held.
    # The ratio of totals (245 / 250 = 0.98) would blur that; the per-round ratios do not
    baseline = [RoundResult(100, 200.0), RoundResult(50, 300.0), RoundResult(100, 210.0)]
    mine = [RoundResult(95, 204.0), RoundResult(60, 290.0), RoundResult(90, 230.0)]
    cost = paired_cost(mine, baseline)
    assert cost is not None
    assert (cost.rounds, cost.ratio, cost.low, cost.high) == (3, 0.95, 0.9, 1.2)
    assert (cost.cpu_us, cost.cpu_added_us) == (230.0, 4.0)
    assert cost.cost == pytest.approx(0.05)
    # CPU per request, paired the same way: 204/200, 290/300, 230/210
    assert cost.cpu_ratio == pytest.approx(1.02)
    assert cost.cpu_low == pytest.approx(290 / 300)
    assert cost.cpu_high == pytest.approx(230 / 210)
    assert cost.capacity_cost == pytest.approx(1 - 1 / 1.02)


def test_rounds_without_requests_or_cpu_are_left_out() -> None:
    cost = paired_cost(rounds(0, 80, 90), rounds(100, 100, 0))
    assert cost is not None
    assert (cost.rounds, cost.ratio, cost.cpu_us, cost.cpu_added_us) == (1, 0.8, None, None)
    assert cost.cpu_ratio is None and cost.capacity_cost is None
    assert paired_cost(rounds(0), rounds(100)) is None
    assert paired_cost([], []) is None


def test_the_table_judges_capacity_and_shows_requests_per_second_beside_it() -> None:
    by_round = {
        BASELINE: rounds(100, 100, 100, cpu=200.0),
        f"{BASELINE}, a second identical router (control)": rounds(103, 98, 101, cpu=199.0),
        # 4% fewer requests/s in the run, but 2.5% more CPU per request: met on both
        "kvroute": rounds(96, 97, 95, cpu=205.0),
        # half the requests/s, twice the CPU per request
        "kvroute, tracing on (in-memory exporter)": rounds(50, 45, 55, cpu=400.0),
        # requests/s 6% down in a noisy run, CPU per request 2% up: capacity decides, met
        "kvroute, tracing on, 1% sampled (in-memory exporter)": rounds(94, 93, 99, cpu=204.0),
        # requests/s level, CPU per request 10% up: missed
        "kvroute, tracing on, 10% sampled (in-memory exporter)": rounds(100, 101, 99, cpu=220.0),
    }
    lines = ops_cost_table(by_round, per_round=2000)
    text = "\n".join(lines)
    assert "3 interleaved rounds of 2000 requests" in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert rows["kvroute"].endswith("| met |")
    assert "| 0.976 (cost +2.4%) | 0.976-0.976 |" in rows["kvroute"]
    assert "| 0.960 (cost +4.0%) | 0.950-0.970 |" in rows["kvroute"]
    assert "| 205 | +5 us |" in rows["kvroute"]
    traced = rows["kvroute, tracing on (in-memory exporter)"]
    assert "| 0.500 (cost +50.0%) |" in traced and traced.endswith("| **missed** |")
    assert rows["kvroute, tracing on, 1% sampled (in-memory exporter)"].endswith("| met |")
    sampled = rows["kvroute, tracing on, 10% sampled (in-memory exporter)"]
    assert "| 0.909 (cost +9.1%) |" in sampled and sampled.endswith("| **missed** |")
    assert "| 1.000 | - | 1.000 | - | 200 | - | - |" in rows[f"{BASELINE} (baseline)"]
    # the control shows the measure's noise, and no verdict
    control = rows[f"{BASELINE}, a second identical router (control)"]
    assert "| 1.005 (cost -0.5%) | 1.005-1.005 |" in control
    assert "1.010 (cost -1.0%) | 0.980-1.030 | 199 | -1 us | - (noise) |" in control


def test_without_cpu_counts_requests_per_second_decides() -> None:
    by_round = {
        BASELINE: rounds(100, 100, 100),
        "kvroute": rounds(96, 97, 95),
        "kvroute, tracing on (in-memory exporter)": rounds(90, 91, 92),
    }
    lines = ops_cost_table(by_round, per_round=10)
    rows = [line for line in lines if line.startswith("| kvroute") and "baseline" not in line]
    assert rows[0].startswith("| kvroute | - | - | 0.960") and rows[0].endswith("| met |")
    assert rows[1].endswith("| **missed** |")
    # a router the run did not start has no row
    assert len(rows) == 2


def test_no_baseline_no_section() -> None:
    assert ops_cost_table({"kvroute": rounds(100)}, per_round=10) == []
