"""The soak benchmark's samples, the growth it reads from them, and its report.

Growth after warm-up is measured robustly against allocator noise: the median RSS of the first
minute after warm-up against the median RSS of the last minute of the run, per process. The
target is <= 2 MB over 30 minutes; a shorter run is held to the same rate (2 MB per 30 min)
and says it is shorter.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["Sample", "SoakReport", "growth_mb", "traced", "write_soak_report"]

TARGET_MB_PER_30_MIN = 2.0
_MB = 1024 * 1024


class Sample(msgspec.Struct, frozen=True):
    """One sampling instant."""

    t_s: float  # since the load started
    router_rss: int
    router_traced: int  # tracemalloc's traced bytes (the router's Python heap)
    worker_rss: list[int]
    requests: int  # sent so far


class SoakReport(msgspec.Struct):
    """Everything a soak run produced, with how to reproduce it."""

    command: str
    minutes: float
    warmup_minutes: float
    concurrency: int
    workers: int
    requests: int
    ok: int
    errors: int
    disconnects: int
    worker_restarted: bool
    samples: list[Sample]
    growth: list[dict[str, Any]]  # the router's top growing allocation sites since warm-up
    # whether the router ran under tracemalloc (`--no-trace`: not); None in reports written
    # before the field, where the samples tell (a traced heap is never 0 bytes)
    traced: bool | None = None


def _window(samples: list[Sample], start_s: float, end_s: float) -> list[Sample]:
    return [s for s in samples if start_s <= s.t_s <= end_s]


def growth_mb(report: SoakReport, series: str, index: int = 0) -> float | None:
    """MB grown by one series between the first and the last measured minute (None: too short).

    `series` is "router_rss", "router_traced" or "worker_rss" (with the worker's `index`).
    """
    warm = report.warmup_minutes * 60
    end = warm + report.minutes * 60
    first = _window(report.samples, warm, warm + 60)
    last = _window(report.samples, end - 60, end)
    if not first or not last or last[0].t_s <= first[-1].t_s:
        return None

    def value(s: Sample) -> float:
        if series == "worker_rss":
            return float(s.worker_rss[index]) if index < len(s.worker_rss) else 0.0
        return float(getattr(s, series))

    return (statistics.median(map(value, last)) - statistics.median(map(value, first))) / _MB


def traced(report: SoakReport) -> bool:
    """Whether the router's heap was traced in this run (else its heap series is all zeros)."""
    if report.traced is not None:
        return report.traced
    return any(s.router_traced for s in report.samples)


def _errors(report: SoakReport) -> str:
    """The errors, and where a worker restart may have made some of them, only if any."""
    if report.errors and report.worker_restarted:
        return (
            f"errors {report.errors:,} (a worker was killed and restarted halfway: requests "
            "in flight on it count here)"
        )
    return f"errors {report.errors:,}"


def _no_growth_sites(report: SoakReport) -> str:
    """Why the report lists no allocation sites."""
    if not traced(report):
        return "(the router ran without tracemalloc (`--no-trace`): no allocation sites)"
    last = report.samples[-1].t_s if report.samples else 0.0
    if last < report.warmup_minutes * 60:
        return "(no baseline was taken: the run ended before the warm-up did)"
    return "(the router listed no growing sites: its baseline was not taken, or nothing grew)"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f} MB"


def _plot(report: SoakReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    minutes = [s.t_s / 60 for s in report.samples]
    ax.plot(minutes, [s.router_rss / _MB for s in report.samples], label="router RSS")
    ax.plot(minutes, [s.router_traced / _MB for s in report.samples], label="router traced heap")
    for i in range(report.workers):
        rss = [s.worker_rss[i] / _MB if i < len(s.worker_rss) else 0 for s in report.samples]
        ax.plot(minutes, rss, label=f"worker-{i} RSS", alpha=0.7)
    ax.axvline(report.warmup_minutes, color="grey", linestyle="--", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MB")
    ax.set_title("memory over the soak")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(report: SoakReport, plot: str | None) -> str:
    """The markdown report."""
    allowed = TARGET_MB_PER_30_MIN * report.minutes / 30
    rows = [("router RSS", growth_mb(report, "router_rss"))]
    rows += [("router traced heap", growth_mb(report, "router_traced"))]
    rows += [(f"worker-{i} RSS", growth_mb(report, "worker_rss", i)) for i in range(report.workers)]
    rate = report.requests / ((report.minutes + report.warmup_minutes) * 60)
    out = [
        "# Soak: memory under long traffic",
        "",
        f"Written by `{report.command}`. The router and {report.workers} reference workers run "
        "as their own processes on 127.0.0.1; see `bench/soak_bench.py` for the workload "
        "(salted and unsalted, completions, chat and /generate, streaming, client disconnects"
        + (", a worker killed and restarted halfway)." if report.worker_restarted else ").")
        + ("" if traced(report) else " The router ran without tracemalloc (`--no-trace`)."),
        "",
        f"- requests: {report.requests:,} ({rate:,.0f}/s), ok {report.ok:,}, "
        f"{_errors(report)}, client disconnects {report.disconnects:,}",
        f"- warm-up {report.warmup_minutes:g} min, then {report.minutes:g} min measured; "
        f"concurrency {report.concurrency}",
        "",
        f"Target: <= {TARGET_MB_PER_30_MIN:g} MB per 30 minutes after warm-up "
        f"(this run: <= {allowed:.2f} MB over {report.minutes:g} min). Growth = median of the "
        "last minute minus median of the first minute after warm-up.",
        "",
        "| series | growth after warm-up | verdict |",
        "|---|---|---|",
    ]
    for name, value in rows:
        if name == "router traced heap" and not traced(report):
            out.append(f"| {name} | not traced (`--no-trace`) | - |")  # not a 0 MB growth
            continue
        verdict = "-" if value is None else ("met" if value <= allowed else "**missed**")
        out.append(f"| {name} | {_mb(value)} | {verdict} |")
    out += ["", "## Router allocation sites that grew most since warm-up (tracemalloc)", ""]
    if report.growth:
        out += ["| site | size now | growth | allocations growth |", "|---|---|---|---|"]
        for g in report.growth:
            out.append(
                f"| `{g.get('site')}` | {g.get('size_bytes', 0) / 1024:,.0f} KiB | "
                f"{g.get('size_diff_bytes', 0) / 1024:+,.0f} KiB | {g.get('count_diff', 0):+,} |"
            )
    else:
        out.append(_no_growth_sites(report))
    if plot:
        out += ["", f"![RSS over time]({plot})"]
    out += [
        "",
        "## Samples",
        "",
        "| minute | router RSS MB | router heap MB | workers RSS MB | requests |",
    ]
    out.append("|---|---|---|---|---|")
    step = max(1, len(report.samples) // 40)
    heap = traced(report)
    for s in report.samples[::step]:
        workers = " / ".join(f"{w / _MB:.1f}" for w in s.worker_rss)
        traced_mb = f"{s.router_traced / _MB:.1f}" if heap else "-"
        out.append(
            f"| {s.t_s / 60:.1f} | {s.router_rss / _MB:.1f} | {traced_mb} | "
            f"{workers} | {s.requests:,} |"
        )
    return "\n".join(out) + "\n"


def write_soak_report(report: SoakReport, out_dir: Path) -> Path:
    """soak.md, soak.json and soak_rss.png in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = "soak_rss.png" if report.samples else None
    if plot:
        _plot(report, out_dir / plot)
    (out_dir / "soak.json").write_bytes(msgspec.json.encode(report))
    path = out_dir / "soak.md"
    path.write_text(render(report, plot))
    return path
