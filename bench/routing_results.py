"""Routing benchmark results: the record model, per-policy summaries and the targets.

The harness fills `RequestRecord`s; everything here is pure arithmetic over them. The report
itself (markdown, closing note, plots, files) is `bench.report`.

Definitions used in the report:
- hit rate: sum of worker-reported `cached_tokens`, less isolation violations (cached tokens
  only another salt's prompt could have produced, `bench.isolation`), / sum of `prompt_tokens`
  (completed requests);
- pooled bound: the hit rate of one LRU cache with the whole fleet's capacity fed the same
  trace in arrival order (`bench.pooled_bound`); each policy is also given as a share of it;
- TTFT: client send to the first streamed chunk carrying content; e2e: send to the last byte;
- throughput: completed requests / (last completion - first send);
- routing overhead: per request, the time the router (or the oracle's `/debug/match` fan-out)
  spent choosing, as reported by the run (absent when it cannot be observed);
- index accuracy (kv): token agreement between the router-predicted matched tokens p and the
  worker-reported cached tokens c, sum(min(p, c)) / sum(max(p, c)); requests where both are 0
  agree trivially and carry no weight. p is what the router's index answered for the chosen
  worker: blocks known from KV events (`x-kvroute-matched-tokens`) plus its pending entries,
  the prefixes of requests it just routed there whose events have not arrived yet
  (`x-kvroute-pending-tokens`). The events-only agreement and the exact share (p == c) are
  printed beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

__all__ = [
    "AFFINE",
    "EXTERNAL_BASELINE",
    "TARGET_PRESSURE",
    "UNVALIDATED_LATENCY",
    "AffinityProbe",
    "BenchReport",
    "EndpointIsolation",
    "PolicyRun",
    "PolicySummary",
    "RequestRecord",
    "TargetResult",
    "WorkloadSection",
    "evaluate_targets",
    "headline_baseline",
    "isolation_violations",
    "percentile",
    "summarize",
    "unaffine_caveat",
    "verdict",
]

TARGET_PRESSURE = 2.0
# the external baseline's policy name (bench.harness.SGLANG_CACHE_AWARE; report stays pure)
EXTERNAL_BASELINE = "sglang_cache_aware"
# below this share of the affinity probe's repeats kept, a router did not route by cache
AFFINE = 0.9


class RequestRecord(msgspec.Struct):
    """What happened to one request of one policy run."""

    index: int
    sent_s: float
    ok: bool
    worker: str = ""
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    predicted_tokens: int | None = None
    # tokens the router credited to recent routing decisions (pending entries), beyond events
    pending_tokens: int | None = None
    route_s: float | None = None
    # of cached_tokens, those only another salt's prompt could have produced (`bench.isolation`)
    violation_tokens: int = 0
    # the worker whose cache served it, as the worker itself says (`X-Reference-Worker`)
    served_by: str = ""
    # why the router's admission forecast dropped part of the match ("": it dropped nothing;
    # `x-kvroute-forecast-lost`)
    forecast_lost: str = ""


class EndpointIsolation(msgspec.Struct):
    """One endpoint's isolation probe through one router (`bench.isolation.probe_isolation`)."""

    endpoint: str
    requests: int  # answered probe requests, each with a salt of its own
    violating: int = 0  # of them, those that got cached tokens
    violation_tokens: int = 0
    errors: int = 0
    error: str = ""


class AffinityProbe(msgspec.Struct):
    """Repeated prompts on the idle fleet through one router (`bench.affinity.probe_affinity`)."""

    repeats: int = 0  # answered repeats of a prompt the router had routed before
    kept: int = 0  # of them, those whose worker had its pages (cached tokens > 0)
    errors: int = 0
    error: str = ""

    @property
    def share(self) -> float | None:
        """The share of repeats kept (None: none answered)."""
        return self.kept / self.repeats if self.repeats else None


class PolicyRun(msgspec.Struct):
    """One policy against one workload on a fresh fleet."""

    policy: str
    records: list[RequestRecord]
    wall_s: float
    # routing overhead samples taken apart from the workload's requests (router probes)
    route_overhead_s: list[float] = []
    note: str = ""
    # the isolation probe per endpoint, after the workload (router policies only)
    isolation: list[EndpointIsolation] = []
    # the affinity probe, after the isolation probe (router policies only)
    affinity: AffinityProbe | None = None


class WorkloadSection(msgspec.Struct):
    """A workload at one KV pressure, with every policy's run."""

    workload: str
    description: str
    seed: int
    params: dict[str, object]
    requests: int
    rate_rps: float
    working_set_tokens: int
    capacity_tokens: int
    workers: int
    pressure: float
    runs: list[PolicyRun]
    dp_size: int = 1  # ranks per worker, each its own cache of capacity_tokens
    host_capacity_tokens: int = 0  # the host tier behind each cache (0: none)
    # the physical limit: one LRU cache of the whole fleet's capacity on the same trace
    # (`bench.pooled_bound`); None when not computed
    pooled_hit_rate: float | None = None
    # TTFT p90 with the pooled cache's hits and no queue: each request's own uncached
    # prefill (`bench.pooled_bound.ttft_floor_p90_ms`); None when not computed
    ttft_floor_p90_ms: float | None = None


class BenchReport(msgspec.Struct):
    """Everything a routing benchmark run produced, with how to reproduce it."""

    command: str
    seed: int
    mode: str
    started_at: str
    fleet: dict[str, object]
    sections: list[WorkloadSection]
    notes: list[str] = []


class PolicySummary(msgspec.Struct):
    """The per-policy row of the results table."""

    policy: str
    requests: int
    completed: int
    failed: int
    hit_rate: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    throughput_rps: float
    output_tokens_per_s: float
    route_overhead_p50_ms: float | None
    route_overhead_p99_ms: float | None
    index_accuracy: float | None
    index_events_accuracy: float | None
    index_exact_share: float | None
    # cached tokens only another salt could have produced (not in hit_rate), and their requests
    violation_tokens: int = 0
    violating_requests: int = 0
    # hit_rate with the violations counted as hits (what the workers reported)
    reported_hit_rate: float = 0.0


class TargetResult(msgspec.Struct):
    """One acceptance target evaluated on one workload section."""

    workload: str
    pressure: float
    target: str
    value: float | None
    threshold: float
    met: bool | None  # None: cannot be evaluated (missing policy or failed run)
    detail: str
    at_most: bool = False  # met at or below the threshold (else at or above it)
    # why the verdict means less than it says (printed beside it); "" when it stands as is
    caveat: str = ""

    def holds(self, value: float | None) -> bool | None:
        """Whether `value` meets this target (None: no value)."""
        if value is None:
            return None
        return value <= self.threshold if self.at_most else value >= self.threshold

    def shown(self, value: float | None = None) -> str:
        """This target's value (or another value of it, such as a median) as reports print it."""
        value = self.value if value is None else value
        if value is None:
            return "-"
        if "isolation" in self.target:
            return f"{value:.0f} tokens"
        if "accuracy" in self.target:
            return f"{value * 100:.1f}%"
        if "oracle" in self.target:
            return f"{value * 100:.1f}% of oracle"
        return "inf" if math.isinf(value) else f"{value:.2f}x"

    def judged(self, met: bool | None) -> str:
        """A verdict on this target (its own or a median's) with its caveat, if any."""
        shown = verdict(met)
        return f"{shown} ({self.caveat})" if self.caveat and met is not None else shown


def verdict(met: bool | None) -> str:
    """A target's verdict as the reports print it (None: it could not be evaluated)."""
    return {True: "met", False: "**missed**", None: "n/a"}[met]


# approx_tree's fidelity check compares hit rates only; its latency is not held to the real
# router's (in the committed full run of 2026-12-05 23:14 UTC its TTFT p90 was 0.44x-2.26x
# sglang-router's; 0.41x-2.72x in the run before), so a TTFT
# verdict against it says nothing about SGLang's router
UNVALIDATED_LATENCY = "against `approx_tree`, an approximation whose latency is not validated"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def _agreement(pairs: Sequence[tuple[int, int]]) -> float | None:
    if not pairs:
        return None
    weight = sum(max(p, c) for p, c in pairs)
    return sum(min(p, c) for p, c in pairs) / weight if weight else 1.0


def summarize(run: PolicyRun) -> PolicySummary:
    """Aggregate one policy run into its table row."""
    done = [r for r in run.records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    reported = sum(r.cached_tokens for r in done)
    violations = sum(r.violation_tokens for r in done)
    cached = reported - violations
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    route = [r.route_s for r in run.records if r.route_s is not None] + run.route_overhead_s
    span = 0.0
    if done:
        first = min(r.sent_s for r in run.records)
        span = max(r.sent_s + (r.e2e_s or 0.0) for r in done) - first
    events = [(r.predicted_tokens, r.cached_tokens) for r in done if r.predicted_tokens is not None]
    full = [
        (r.predicted_tokens + (r.pending_tokens or 0), r.cached_tokens)
        for r in done
        if r.predicted_tokens is not None
    ]
    exact = sum(1 for p, c in full if p == c) / len(full) if full else None
    return PolicySummary(
        policy=run.policy,
        requests=len(run.records),
        completed=len(done),
        failed=len(run.records) - len(done),
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50_ms=_ms(percentile(ttft, 50)),
        ttft_p90_ms=_ms(percentile(ttft, 90)),
        ttft_p99_ms=_ms(percentile(ttft, 99)),
        e2e_p50_ms=_ms(percentile(e2e, 50)),
        e2e_p99_ms=_ms(percentile(e2e, 99)),
        throughput_rps=len(done) / span if span > 0 else 0.0,
        output_tokens_per_s=sum(r.output_tokens for r in done) / span if span > 0 else 0.0,
        route_overhead_p50_ms=_ms(percentile(route, 50)),
        route_overhead_p99_ms=_ms(percentile(route, 99)),
        index_accuracy=_agreement(full),
        index_events_accuracy=_agreement(events),
        index_exact_share=exact,
        violation_tokens=violations,
        violating_requests=sum(1 for r in done if r.violation_tokens),
        reported_hit_rate=reported / prompt if prompt else 0.0,
    )


def _ratio_target(
    section: WorkloadSection,
    rows: dict[str, PolicySummary],
    name: str,
    mine: str,
    other: str,
    field: str,
    threshold: float,
    at_most: bool,
    caveat: str = "",
) -> TargetResult:
    a = rows.get(mine)
    b = rows.get(other)
    value: float | None = None
    if a is not None and b is not None:
        x = getattr(a, field)
        y = getattr(b, field)
        if x is not None and y:
            value = x / y
        elif x is not None and y == 0:
            value = math.inf if x > 0 else None
    relation = "<=" if at_most else ">="
    result = TargetResult(
        workload=section.workload,
        pressure=section.pressure,
        target=name,
        value=value,
        threshold=threshold,
        met=None,
        detail=f"{mine}.{field} / {other}.{field} {relation} {threshold:g}",
        at_most=at_most,
        caveat=caveat,
    )
    result.met = result.holds(value)
    return result


def headline_baseline(section: WorkloadSection) -> str:
    """What kv is held against: SGLang's own router where it ran, else its mirror."""
    ran = {run.policy for run in section.runs if run.records}
    return EXTERNAL_BASELINE if EXTERNAL_BASELINE in ran else "approx_tree"


def unaffine_caveat(section: WorkloadSection, rows: dict[str, PolicySummary]) -> str:
    """Why a target against sglang-router means less where it did not keep the affinity probe's
    repeats (its PD mode did not: 4 of 8), with kv against `approx_tree`, which keeps them,
    quoted beside it ("": it kept them, or was not probed)."""
    run = next((r for r in section.runs if r.policy == EXTERNAL_BASELINE and r.records), None)
    probe = None if run is None else run.affinity
    if probe is None or probe.share is None or probe.share >= AFFINE:
        return ""
    out = (
        f"sglang-router kept {probe.kept} of {probe.repeats} affinity repeats here: not "
        "cache-aware routing"
    )
    kv, mirror = rows.get("kv"), rows.get("approx_tree")
    if kv is not None and mirror is not None and mirror.completed:
        hit = f"{kv.hit_rate / mirror.hit_rate:.2f}x" if mirror.hit_rate else "-"
        ttft = (
            f"{kv.ttft_p90_ms / mirror.ttft_p90_ms:.2f}x"
            if kv.ttft_p90_ms is not None and mirror.ttft_p90_ms
            else "-"
        )
        out += f"; kv against `approx_tree`, which keeps them: hit rate {hit}, TTFT p90 {ttft}"
    return out


def isolation_violations(run: PolicyRun) -> int:
    """Violating tokens of a run: over its workload plus every endpoint's probe."""
    return sum(r.violation_tokens for r in run.records if r.ok) + sum(
        p.violation_tokens for p in run.isolation
    )


def evaluate_targets(section: WorkloadSection) -> list[TargetResult]:
    """The issue's acceptance targets on one section (meaningful at KV pressure >= 2)."""
    rows = {run.policy: summarize(run) for run in section.runs}
    base = headline_baseline(section)
    # against sglang-router in a mode that did not route by cache, both verdicts say so
    unaffine = unaffine_caveat(section, rows) if base == EXTERNAL_BASELINE else ""
    out = [
        _ratio_target(
            section, rows, f"kv hit rate >= 1.2x {base}", "kv", base,
            "hit_rate", 1.2, at_most=False, caveat=unaffine,
        ),
        _ratio_target(
            section, rows, f"kv TTFT p90 <= 0.5x {base}", "kv", base,
            "ttft_p90_ms", 0.5, at_most=True,
            caveat=UNVALIDATED_LATENCY if base == "approx_tree" else unaffine,
        ),
        # relative: kv's hit rate over the greedy oracle's (named "oracle - 2%" before, which
        # read as two points)
        _ratio_target(
            section, rows, "kv hit rate >= 0.98x oracle", "kv", "oracle",
            "hit_rate", 0.98, at_most=False,
        ),
    ]  # fmt: skip
    kv = rows.get("kv")
    accuracy = kv.index_accuracy if kv is not None else None
    out.append(
        TargetResult(
            workload=section.workload,
            pressure=section.pressure,
            target="kv index accuracy >= 98%",
            value=accuracy,
            threshold=0.98,
            met=None if accuracy is None else accuracy >= 0.98,
            detail="sum(min(predicted, cached)) / sum(max(predicted, cached)), events + pending",
        )
    )
    kv_run = next((run for run in section.runs if run.policy == "kv" and run.records), None)
    violations = None if kv_run is None else float(isolation_violations(kv_run))
    out.append(
        TargetResult(
            workload=section.workload,
            pressure=section.pressure,
            target="kv isolation violations = 0",
            value=violations,
            threshold=0.0,
            met=None if violations is None else violations == 0,
            detail="cross-salt cached tokens over the workload and every endpoint's probe",
            at_most=True,
        )
    )
    return out
