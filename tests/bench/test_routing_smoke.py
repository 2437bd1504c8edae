"""CI smoke test: a tiny `kvroute bench routing` end to end on real workers and routers.

No performance assertions: only that the report has its structure and that every policy
completed every request of every workload.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import sglang_router
from bench.harness import POLICIES, SGLANG_CACHE_AWARE
from bench.routing_bench import WORKLOADS
from router.commands.cli import main


def test_tiny_routing_bench_writes_a_complete_report(tmp_path: Path) -> None:
    argv = [
        "bench", "routing", "--quick", "--seed", "3", "--requests", "6", "--rate", "40",
        "--time-scale", "0.02", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    text = (tmp_path / "routing.md").read_text()
    assert "kvroute bench routing --quick --seed 3" in text
    assert "## Targets" in text and "## Results" in text
    for png in ("routing_ttft_cdf.png", "routing_hit_rate_vs_pressure.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    # the external baseline joins when the environment names a python that has it
    expected = set(POLICIES)
    if sglang_router.importable(sglang_router.DEFAULT_PYTHON):
        expected.add(SGLANG_CACHE_AWARE)
    data = json.loads((tmp_path / "routing.json").read_text())
    assert [s["workload"] for s in data["sections"]] == list(WORKLOADS)
    for section in data["sections"]:
        assert section["pressure"] > 0
        summaries = {s["policy"]: s for s in section["summaries"]}
        assert set(summaries) == expected
        for policy, s in summaries.items():
            assert s["completed"] == s["requests"] == 6, (section["workload"], policy, s)
            assert s["failed"] == 0
            assert s["ttft_p50_ms"] is not None
        assert summaries["kv"]["index_accuracy"] is not None
        for policy in expected:
            assert f"| {policy} | 6/6 | 0 |" in text
