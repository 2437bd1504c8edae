"""The soak benchmark: its growth arithmetic, and a tiny real run end to end."""

from __future__ import annotations

import json
from pathlib import Path

from bench.soak_report import Sample, SoakReport, growth_mb
from router.commands.cli import main

MB = 1024 * 1024


def _report(rss: list[int]) -> SoakReport:
    samples = [
        Sample(t_s=10.0 * i, router_rss=r, router_traced=r // 2, worker_rss=[r], requests=i)
        for i, r in enumerate(rss)
    ]
    return SoakReport(
        command="x", minutes=3.0, warmup_minutes=1.0, concurrency=1, workers=1, requests=0,
        ok=0, errors=0, disconnects=0, worker_restarted=False, samples=samples, growth=[],
    )  # fmt: skip


def test_growth_compares_the_first_and_last_measured_minutes_by_their_medians() -> None:
    # 4 minutes of samples every 10 s: warm-up growth and one spike are not growth
    flat = [200 * MB] * 6 + [100 * MB] * 18 + [100 * MB]
    flat[10] = 400 * MB  # a transient spike inside the first measured minute
    assert growth_mb(_report(flat), "router_rss") == 0.0
    rising = [100 * MB + i * MB // 4 for i in range(25)]
    grown = growth_mb(_report(rising), "worker_rss", 0)
    assert grown == 3.0  # medians at 1.5 and 3.5 minutes: 12 samples x 0.25 MB
    assert growth_mb(_report(rising[:8]), "router_rss") is None  # no last minute yet


def test_a_tiny_soak_runs_end_to_end(tmp_path: Path) -> None:
    argv = [
        "bench", "soak", "--minutes", "0.15", "--warmup-minutes", "0.05", "--sample-s", "1",
        "--concurrency", "4", "--workers", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["requests"] > 0 and data["ok"] > 0
    assert len(data["samples"]) >= 5 and all(s["router_rss"] > 0 for s in data["samples"])
    assert data["growth"], "the router's tracemalloc baseline and growth sites"
    text = (tmp_path / "soak.md").read_text()
    assert "| router RSS |" in text and (tmp_path / "soak_rss.png").read_bytes()[:4] == b"\x89PNG"
