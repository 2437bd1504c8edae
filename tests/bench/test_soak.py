"""The soak benchmark: its growth arithmetic, and a tiny real run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from bench.soak_report import Sample, SoakReport, growth_mb, render
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


def _rendered(**changes: object) -> str:
    # 5 minutes of flat samples, every 10 s (warm-up 1 minute, 3 measured)
    report = msgspec.structs.replace(_report([100 * MB] * 30), **changes)
    return render(report, None)


def test_errors_are_blamed_on_the_restart_only_when_there_are_errors_and_a_restart() -> None:
    clean = _rendered(errors=0, worker_restarted=True)
    assert ", errors 0, client disconnects" in clean and "restarted halfway:" not in clean
    some = _rendered(errors=3, worker_restarted=True)
    assert "errors 3 (a worker was killed and restarted halfway: requests in flight" in some
    alone = _rendered(errors=3, worker_restarted=False)
    assert ", errors 3, client disconnects" in alone
    assert "a worker killed and restarted halfway" not in alone


def test_an_untraced_run_says_its_heap_was_not_traced() -> None:
    untraced = [
        Sample(t_s=10.0 * i, router_rss=100 * MB, router_traced=0, worker_rss=[MB], requests=i)
        for i in range(30)
    ]
    # a report written before the `traced` field: the all-zero heap series tells
    for text in (_rendered(samples=untraced), _rendered(samples=untraced, traced=False)):
        assert "| router traced heap | not traced (`--no-trace`) | - |" in text
        assert "| router traced heap | +0.00 MB" not in text
        assert "the run ended before the warm-up" not in text
        assert "(the router ran without tracemalloc (`--no-trace`): no allocation sites)" in text
        assert "| 0.0 | 100.0 | - | 1.0 | 0 |" in text
    # traced, past the warm-up, yet no sites: not blamed on the warm-up either
    traced = _rendered(traced=True)
    assert "| router traced heap | +0.00 MB | met |" in traced
    assert "(the router listed no growing sites" in traced
    # a run that ended inside its warm-up
    short = _rendered(samples=_report([MB] * 3).samples, traced=True)
    assert "(no baseline was taken: the run ended before the warm-up did)" in short
