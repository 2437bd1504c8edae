"""Report arithmetic (summaries, targets) and the files the report writer produces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.report import render_markdown, write_report
from bench.routing_results import (
    EXTERNAL_BASELINE,
    AffinityProbe,
    BenchReport,
    EndpointIsolation,
    PolicyRun,
    RequestRecord,
    WorkloadSection,
    evaluate_targets,
    percentile,
    summarize,
)


def _run(policy: str, cached: int, ttft_s: float, predicted: int | None = None) -> PolicyRun:
    records = [
        RequestRecord(
            index=i,
            sent_s=i * 0.1,
            ok=True,
            worker="w0",
            prompt_tokens=100,
            cached_tokens=cached,
            output_tokens=4,
            ttft_s=ttft_s,
            e2e_s=ttft_s + 0.05,
            predicted_tokens=predicted,
        )
        for i in range(10)
    ]
    records.append(RequestRecord(index=10, sent_s=1.0, ok=False, error="HTTP 503"))
    return PolicyRun(policy=policy, records=records, wall_s=2.0)


def _section(pressure: float, kv_cached: int = 80) -> WorkloadSection:
    return WorkloadSection(
        workload="multi_tenant",
        description="test",
        seed=1,
        params={"tenants": 2},
        requests=11,
        rate_rps=10.0,
        working_set_tokens=1000,
        capacity_tokens=250,
        workers=2,
        pressure=pressure,
        pooled_hit_rate=0.9,
        runs=[
            _run("kv", kv_cached, 0.01, predicted=kv_cached),
            _run("approx_tree", 40, 0.05),
            _run("round_robin", 20, 0.08),
            _run("oracle", 81, 0.01),
        ],
    )


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_summary_counts_hits_failures_and_accuracy() -> None:
    s = summarize(_run("kv", 30, 0.02, predicted=40))
    assert (s.requests, s.completed, s.failed) == (11, 10, 1)
    assert s.hit_rate == pytest.approx(0.30)
    assert s.ttft_p90_ms == pytest.approx(20.0)
    assert s.index_accuracy == pytest.approx(30 / 40)
    assert s.index_exact_share == 0.0
    # 10 completions between the first send (0 s) and the last end (0.9 + 0.07 s)
    assert s.throughput_rps == pytest.approx(10 / 0.97)
    assert summarize(_run("round_robin", 30, 0.02)).index_accuracy is None


def test_targets_met_and_missed() -> None:
    met = {t.target: t for t in evaluate_targets(_section(2.5))}
    assert all(t.met for t in met.values()), met
    # without sglang-router in the section, kv is held against its mirror
    assert met["kv hit rate >= 1.2x approx_tree"].value == pytest.approx(2.0)
    assert met["kv isolation violations = 0"].value == 0
    missed = {t.target: t for t in evaluate_targets(_section(2.5, kv_cached=45))}
    assert missed["kv hit rate >= 1.2x approx_tree"].met is False
    assert missed["kv hit rate >= 0.98x oracle"].met is False
    # a policy that never ran makes its targets unevaluable, not passed
    section = _section(2.5)
    section.runs = [r for r in section.runs if r.policy != "oracle"]
    gone = {t.target: t for t in evaluate_targets(section)}
    assert gone["kv hit rate >= 0.98x oracle"].met is None


def test_a_cross_salt_hit_misses_the_isolation_target() -> None:
    section = _section(2.5)
    section.runs[0].records[0].violation_tokens = 16
    section.runs[0].isolation = [EndpointIsolation(endpoint="/generate", requests=6)]
    by = {t.target: t for t in evaluate_targets(section)}
    assert by["kv isolation violations = 0"].value == 16
    assert by["kv isolation violations = 0"].met is False
    text = render_markdown(
        BenchReport(command="c", seed=1, mode="full", started_at="", fleet={}, sections=[section]),
        {},
    )
    assert "| kv | 1/10 requests, 16 tokens | 0/6 requests, 0 tokens | - | - |" in text
    assert "kv isolation violations = 0 missed (16 tokens)" in text


def test_zero_baseline_hit_rate_is_an_infinite_ratio() -> None:
    section = _section(3.0)
    section.runs[1] = _run("approx_tree", 0, 0.08)
    by = {t.target: t for t in evaluate_targets(section)}
    assert by["kv hit rate >= 1.2x approx_tree"].value == math.inf
    assert by["kv hit rate >= 1.2x approx_tree"].met is True


def test_write_report_files(tmp_path: Path) -> None:
    report = BenchReport(
        command="kvroute bench routing --quick --seed 1",
        seed=1,
        mode="quick",
        started_at="now",
        fleet={"workers": 2},
        sections=[_section(1.0), _section(2.5)],
        notes=["sglang-router not installed: external baseline skipped"],
    )
    report.sections[1].runs[0].affinity = AffinityProbe(repeats=8, kept=7)
    md = write_report(report, tmp_path)
    text = md.read_text()
    assert "kvroute bench routing --quick --seed 1" in text
    assert "### multi_tenant at KV pressure 2.50" in text
    assert "| kv | 10/11 | 1 | 80.0% |" in text
    assert "sglang-router not installed" in text
    for png in ("routing_ttft_cdf.png", "routing_hit_rate_vs_pressure.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text
    data = json.loads((tmp_path / "routing.json").read_text())
    assert [s["pressure"] for s in data["sections"]] == [1.0, 2.5]
    assert data["sections"][0]["targets"] == []
    assert len(data["sections"][1]["targets"]) == 5
    # each router's affinity probe, where it ran
    assert data["sections"][0]["affinity"] == {}
    assert data["sections"][1]["affinity"] == {
        "kv": {"repeats": 8, "kept": 7, "errors": 0, "error": ""}
    }
    # the pooled bound's line and each policy's share of it
    assert "- pooled bound (one LRU cache of the fleet's whole capacity, same trace): 90.0%" in text
    assert "| multi_tenant | 2.50 | 90.0% | 90.0% | 88.9% | 44.4% | 22.2% |" in text
    # the markdown renders without plots too
    assert "## Plots" not in render_markdown(report, {})


def test_closing_note_explains_each_missed_target() -> None:
    report = BenchReport(
        command="c",
        seed=1,
        mode="full",
        started_at="now",
        fleet={},
        sections=[_section(2.5, kv_cached=45)],
    )
    text = render_markdown(report, {})
    assert "## Closing note" in text
    assert "kv hit rate >= 0.98x oracle missed" in text
    met = BenchReport(
        command="c", seed=1, mode="full", started_at="now", fleet={}, sections=[_section(2.5)]
    )
    assert "## Closing note" not in render_markdown(met, {})


def test_pending_tokens_count_as_the_routers_prediction() -> None:
    run = _run("kv", 60, 0.01, predicted=20)
    for r in run.records:
        r.pending_tokens = 40
    s = summarize(run)
    assert s.index_accuracy == pytest.approx(1.0)
    assert s.index_events_accuracy == pytest.approx(20 / 60)
    assert s.index_exact_share == 1.0


def test_closing_note_tells_an_oracle_bound_from_a_policy_gap() -> None:
    bounded = _section(2.5)
    bounded.runs[1] = _run("approx_tree", 70, 0.08)  # kv 1.14x, oracle only 1.16x
    text = render_markdown(
        BenchReport(command="c", seed=1, mode="full", started_at="", fleet={}, sections=[bounded]),
        {},
    )
    assert "The greedy oracle itself reaches only 1.16x approx_tree" in text
    assert "pooled bound" not in text.split("## Closing note")[1]
    bounded.pooled_hit_rate = 0.8  # approx_tree is at 87.5% of it: 1.2x is out of reach
    text = render_markdown(
        BenchReport(command="c", seed=1, mode="full", started_at="", fleet={}, sections=[bounded]),
        {},
    )
    # LRU's pooled bound is no strict ceiling: the note says how far off the target is, not
    # that no router can reach it (routers have passed the bound by a few points)
    assert (
        "is 80.0%: approx_tree reaches 87.5% of it, so 1.2x approx_tree would take 105.0% of it, "
        "where the best policy of this run reached 101.2% (the bound is not strict"
    ) in text
    assert "no router can reach" not in text
    assert "The greedy oracle itself reaches only 1.16x approx_tree" in text
    gap = _section(2.5, kv_cached=45)  # kv 1.12x approx_tree; oracle 2.02x
    text = render_markdown(
        BenchReport(command="c", seed=1, mode="full", started_at="", fleet={}, sections=[gap]),
        {},
    )
    assert "The oracle shows a placement worth 2.02x exists" in text
    gap.runs = [r for r in gap.runs if r.policy != "oracle"]  # e.g. the pd topology
    text = render_markdown(
        BenchReport(command="c", seed=1, mode="full", started_at="", fleet={}, sections=[gap]),
        {},
    )
    closing = text.split("## Closing note")[1]
    assert "No oracle ran on this topology" in closing and "-x" not in closing


def test_the_external_baseline_is_the_headline_where_it_ran() -> None:
    def report(*sections: WorkloadSection) -> str:
        return render_markdown(
            BenchReport(
                command="c", seed=1, mode="full", started_at="", fleet={}, sections=[*sections]
            ),
            {},
        )

    low, high = _section(1.0), _section(2.5)
    for section in (low, high):
        section.runs.append(_run(EXTERNAL_BASELINE, 40, 0.04))
    text = report(low, high)
    assert f"### kv against `{EXTERNAL_BASELINE}`" in text
    # kv 80% vs 40% cached; TTFT 10 ms vs 40 ms; only the section at pressure >= 2 is compared
    assert "| multi_tenant | 2.50 | 80.0% | 40.0% | 2.00x | 0.25x | 0.25x | 0.25x |" in text
    assert "| multi_tenant | 1.00 | 80.0% |" not in text
    # the targets are read against it, and approx_tree is held against it for fidelity
    targets = [t.target for t in evaluate_targets(high)]
    assert f"kv hit rate >= 1.2x {EXTERNAL_BASELINE}" in targets and len(targets) == 5
    assert (
        "| multi_tenant | 2.50 | 40.0% | 40.0% | 1.00x | 40.0% | 40.0% | 1.00x | - | - | met |"
        in (text)
    )
    assert f"kv against `{EXTERNAL_BASELINE}`" not in report(_section(2.5))


def test_a_ttft_verdict_against_approx_tree_says_its_latency_is_not_validated() -> None:
    def report(*sections: WorkloadSection) -> str:
        return render_markdown(
            BenchReport(
                command="c", seed=1, mode="quick", started_at="", fleet={}, sections=[*sections]
            ),
            {},
        )

    # no sglang-router (a quick or CI run): kv's TTFT (10 ms) is judged against approx_tree's
    alone = report(_section(2.5))
    assert (
        "| multi_tenant | 2.50 | kv TTFT p90 <= 0.5x approx_tree | 0.20x | met (against "
        "`approx_tree`, an approximation whose latency is not validated) |"
    ) in alone
    # the hit-rate target against it is what the fidelity check validates: unmarked
    assert "| multi_tenant | 2.50 | kv hit rate >= 1.2x approx_tree | 2.00x | met |" in alone
    (note,) = [line for line in alone.splitlines() if "latency is not validated and" in line]
    assert note.startswith(f"`{EXTERNAL_BASELINE}` did not run on multi_tenant at 2.50, so")
    # with sglang-router beside it: the fidelity table shows approx_tree's TTFT p90 over the
    # real router's (50 ms over 40 ms), and the TTFT target, read against the real one, is plain
    both = _section(2.5)
    both.runs.append(_run(EXTERNAL_BASELINE, 40, 0.04))
    text = report(both)
    assert "TTFT p90 ratio (not validated) |" in text
    assert "| 1.00x | - | - | met | 1.25x |" in text
    assert f"| kv TTFT p90 <= 0.5x {EXTERNAL_BASELINE} | 0.25x | met |" in text
    assert "not validated)" not in text.split("### Fidelity")[0]
    assert "latency is not validated and" not in text


def test_a_peer_that_does_not_keep_repeats_is_named_beside_the_fidelity_it_voids() -> None:
    def report(*sections: WorkloadSection) -> str:
        return render_markdown(
            BenchReport(
                command="c", seed=1, mode="full", started_at="", fleet={}, sections=[*sections]
            ),
            {},
        )

    flat, pd = _section(2.5), _section(2.5)
    pd.workload = "multi_tenant [prefill/decode 2P+2D]"
    for section, kept in ((flat, 8), (pd, 5)):
        peer = _run(EXTERNAL_BASELINE, 40, 0.04)
        peer.affinity = AffinityProbe(repeats=8, kept=kept)
        section.runs.append(peer)
        mirror = next(r for r in section.runs if r.policy == "approx_tree")
        mirror.affinity = AffinityProbe(repeats=8, kept=8, errors=1, error="HTTP 503")
    text = report(flat, pd)
    assert "| 1.00x | 8/8 (1 errors) | 8/8 | met |" in text
    assert "| 1.00x | 8/8 (1 errors) | 5/8 | met |" in text
    # only the section where the peer did not keep its repeats is named
    (note,) = [line for line in text.splitlines() if "kept fewer than 90%" in line]
    assert "multi_tenant [prefill/decode 2P+2D] at KV pressure 2.50 (5 of 8)" in note
    assert note.count("KV pressure") == 1
    # no probe: no note
    assert "kept fewer than" not in report(_section(2.5))


def test_an_accuracy_miss_is_broken_down_by_what_the_forecast_said() -> None:
    section = _section(2.5)
    kv = section.runs[0]
    ok = [r for r in kv.records if r.ok]
    # four requests disagree: two kept by the forecast but gone (over by 30 each), one
    # dropped as batched yet found (under by 80), one the index had not seen (under by 10)
    for r in ok[:2]:
        r.predicted_tokens, r.cached_tokens = 80, 50
    ok[2].predicted_tokens, ok[2].cached_tokens, ok[2].forecast_lost = 0, 80, "batched"
    ok[3].predicted_tokens, ok[3].cached_tokens = 70, 80
    report = BenchReport(
        command="c", seed=1, mode="full", started_at="now", fleet={}, sections=[section]
    )
    text = render_markdown(report, {})
    (note,) = [line for line in text.splitlines() if "kv index accuracy >= 98% missed" in line]
    assert "60 were predicted but not cached at admission (60 kept by the forecast" in note
    assert "90 were cached but not predicted (80 dropped as coming with a sibling" in note
    assert "10 not in the index when routed" in note
    # the largest share names what to fix
    assert "The largest share: the batch rule puts siblings in one batch" in note


def test_a_ttft_miss_is_explained_by_how_many_requests_were_cold() -> None:
    def closing(kv_cached: int, cold: int) -> str:
        section = _section(2.5, kv_cached=kv_cached)
        section.runs.append(_run(EXTERNAL_BASELINE, kv_cached, 0.01))  # kv's TTFT: 1.0x
        for record in section.runs[0].records[:cold]:
            record.cached_tokens = 0
        report = BenchReport(
            command="c", seed=1, mode="full", started_at="", fleet={}, sections=[section]
        )
        return render_markdown(report, {}).split("## Closing note")[1]

    # 1 of kv's 10 answered requests found nothing cached: its p90 is a wait, not a prefill
    warm = closing(80, cold=1)
    assert "kv TTFT p90 <= 0.5x" in warm and "10.0% of kv's requests found nothing" in warm
    assert "the p90 is set less by cold prefills" in warm and "(`--seeds`" in warm
    assert "the p90 is a full prefill" not in warm
    # 3 of 10: a cold prefill under any policy
    cold = closing(80, cold=3)
    assert "30.0% of kv's requests found nothing" in cold
    assert "the p90 is a full prefill under any policy" in cold
    assert "the p90 is set less by cold prefills" not in cold


def test_targets_against_a_peer_that_does_not_keep_repeats_are_marked() -> None:
    # sglang-router's PD mode kept 4 of 8 repeats: the targets read against it were "met" bare
    flat, pd = _section(2.5), _section(2.5)
    pd.workload = "multi_tenant [prefill/decode 2P+2D]"
    for section, kept in ((flat, 8), (pd, 4)):
        peer = _run(EXTERNAL_BASELINE, 20, 0.05)
        peer.affinity = AffinityProbe(repeats=8, kept=kept)
        section.runs.append(peer)
    marked = {t.target: t for t in evaluate_targets(pd)}
    # kv 80% cached at 10 ms; approx_tree 40% at 50 ms
    beside = (
        "sglang-router kept 4 of 8 affinity repeats here: not cache-aware routing; kv against "
        "`approx_tree`, which keeps them: hit rate 2.00x, TTFT p90 0.20x"
    )
    assert marked[f"kv hit rate >= 1.2x {EXTERNAL_BASELINE}"].caveat == beside
    assert marked[f"kv TTFT p90 <= 0.5x {EXTERNAL_BASELINE}"].caveat == beside
    assert marked["kv index accuracy >= 98%"].caveat == ""
    assert all(not t.caveat for t in evaluate_targets(flat))
    text = render_markdown(
        BenchReport(command="c", seed=1, mode="full", started_at="", fleet={}, sections=[flat, pd]),
        {},
    )
    assert f"| kv hit rate >= 1.2x {EXTERNAL_BASELINE} | 4.00x | met ({beside}) |" in text
    assert (
        f"| multi_tenant | 2.50 | kv hit rate >= 1.2x {EXTERNAL_BASELINE} | 4.00x | met |" in text
    )
    (note,) = [line for line in text.splitlines() if "mostly affinity it does not keep" in line]
    assert note.startswith("On multi_tenant [prefill/decode 2P+2D] at 2.50, `sglang_cache_aware`")
    assert "latency is not validated and" not in text
    # a probe that did not run, or no approx_tree to quote: still marked, or not, as it knows
    pd.runs = [r for r in pd.runs if r.policy != "approx_tree"]
    (alone,) = {t.caveat for t in evaluate_targets(pd) if "1.2x" in t.target}
    assert alone == "sglang-router kept 4 of 8 affinity repeats here: not cache-aware routing"
    pd.runs[-1].affinity = None
    assert not any(t.caveat for t in evaluate_targets(pd))
