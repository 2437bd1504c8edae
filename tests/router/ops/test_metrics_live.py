"""The operator's metrics after real traffic through a real router and reference workers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.cluster.server import NatsServer
from router.service import RouterService
from tests.router.cluster.conftest import replica_config
from tests.router.conftest import Fleet, eventually, unfollow

PROMPT = "The quarterly report of the ACME support desk, section one. " * 6  # ~360 tokens


def _chat(salt: str, *, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "cache_salt": salt,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


Samples = dict[str, list[tuple[dict[str, str], float]]]


async def scrape(fleet: Fleet) -> Samples:
    """Every sample of /metrics by name."""
    async with fleet.session.get(fleet.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels`."""
    return sum(
        v for got, v in samples.get(name, []) if all(got.get(k) == x for k, x in labels.items())
    )


async def _stream_cached(fleet: Fleet, body: dict[str, Any]) -> tuple[dict[str, str], int]:
    """Headers and the final usage chunk's cached_tokens of a streamed chat."""
    async with fleet.session.post(fleet.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        lines = [line async for line in resp.content]
        headers = dict(resp.headers)
    events = [json.loads(x[5:]) for x in lines if x.startswith(b"data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    return headers, int(usage[-1]["prompt_tokens_details"]["cached_tokens"])


async def test_prediction_against_the_workers_usage(fleet: Fleet) -> None:
    first = _chat("tenant-a")
    status, headers, answer = await fleet.post("/v1/chat/completions", first)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(first, holder, 300), what="the prefix indexed")
    # the same prompt again (whole body), then streamed (its final usage chunk), then /generate
    status, headers, answer = await fleet.post("/v1/chat/completions", first)
    predicted = int(headers["x-kvroute-matched-tokens"])
    cached = int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert predicted == cached >= 300
    s_headers, s_cached = await _stream_cached(fleet, _chat("tenant-a", stream=True))
    assert int(s_headers["x-kvroute-matched-tokens"]) == s_cached == cached
    ids = list(range(3, 200))
    status, _, gen = await fleet.post("/generate", {"input_ids": ids, "cache_salt": "tenant-g"})
    assert status == 200 and gen["meta_info"]["cached_tokens"] == 0

    samples = await scrape(fleet)
    model = "kvroute/reference-byte-lm"
    assert total(samples, "kvroute_usage_reports_total") == 4
    assert total(samples, "kvroute_usage_cached_tokens_total", worker=holder) == 2 * cached
    assert total(samples, "kvroute_usage_predicted_tokens_total", worker=holder) == 2 * cached
    exact = total(samples, "kvroute_prediction_outcomes_total", outcome="exact")
    assert exact == 4  # both misses were predicted as misses, both hits exactly
    assert total(samples, "kvroute_routed_requests_total", model=model) == 4
    # the decision triple, in blocks of 16 tokens
    assert total(samples, "kvroute_route_query_blocks_count", model=model) == 4
    assert total(samples, "kvroute_route_chosen_match_blocks_sum", model=model) >= 2 * 300 // 16
    assert total(samples, "kvroute_route_decisions_total", reason="prefix") == 2
    assert total(samples, "kvroute_route_decisions_total", reason="none") == 2
    # latency at the router, per model
    ttft = total(samples, "kvroute_time_to_first_token_seconds_count", model=model)
    assert ttft == 4
    assert total(samples, "kvroute_request_duration_seconds_count", model=model) == 4

    # streams and load per (worker, rank)
    for worker in ("w0", "w1"):
        assert total(samples, "kvroute_stream_state", worker=worker, state="synced") == 1
        assert total(samples, "kvroute_stream_state", worker=worker, dp_rank="0") == 1
        assert total(samples, "kvroute_stream_gaps_total", worker=worker) == 0
        # what the index cannot use, one series per stream from the start (0 on a sound one)
        for lost in ("unindexable_blocks", "rank_mismatches", "token_kind_mismatches"):
            series = [v for got, v in samples[f"kvroute_stream_{lost}_total"]
                      if got.get("worker") == worker]  # fmt: skip
            assert series == [0.0], (lost, series)
        assert total(samples, "kvroute_stream_batches_total", worker=worker) >= 1
        assert total(samples, "kvroute_load_running_requests", worker=worker) == 0
    assert total(samples, "kvroute_stream_index_entries", worker=holder) >= 300 // 16
    assert samples["kvroute_stream_lag_seconds"]

    # namespaces only as a size distribution: no salt and no fingerprint is a label value
    fingerprints: set[str] = set()

    async def namespaces_settled() -> bool:
        nonlocal samples, fingerprints
        _, namespaces = await fleet.admin("GET", "/namespaces")
        fingerprints = {row["id"] for row in namespaces["namespaces"]}
        samples = await scrape(fleet)  # the /generate's events may still be on their way
        return total(samples, "kvroute_namespaces") == len(fingerprints) >= 3

    await eventually(namespaces_settled, what="every namespace indexed")
    assert total(samples, "kvroute_namespace_size_tokens_count") == len(fingerprints)
    secrets = fingerprints | {"tenant-a", "tenant-g", "warm-up"}
    for rows in samples.values():
        for labels, _ in rows:
            assert not secrets & set(labels.values()), labels


async def test_the_false_hit_watch_shows_and_its_unfollowed_answers_are_kept_apart(
    fleet: Fleet,
) -> None:
    """The watch's quarantine showed nowhere in /metrics (only in /admin/workers): no alert
    could say "worker X is unfollowed" or count how often the watch acted. And the answers of
    an unfollowed worker, predicted nothing on purpose, counted as `under` wherever it reused
    its own cache: the accuracy fell for a reason that is no index lag."""
    samples = await scrape(fleet)
    for worker in ("w0", "w1"):  # from 0: increase() sees the first action
        assert total(samples, "kvroute_worker_unfollowed_seconds", worker=worker) == 0
        for action in ("resubscribed", "unfollowed"):
            series = [v for got, v in samples["kvroute_false_hit_actions_total"]
                      if got == {"worker": worker, "action": action}]  # fmt: skip
            assert series == [0.0], (worker, action)
    await unfollow(fleet.router, "w0")
    samples = await scrape(fleet)
    assert 50 < total(samples, "kvroute_worker_unfollowed_seconds", worker="w0") <= 60
    assert total(samples, "kvroute_worker_unfollowed_seconds", worker="w1") == 0
    actions = {(got["worker"], got["action"]): v
               for got, v in samples["kvroute_false_hit_actions_total"]}  # fmt: skip
    assert actions == {
        ("w0", "resubscribed"): 1,
        ("w0", "unfollowed"): 1,
        ("w1", "resubscribed"): 0,
        ("w1", "unfollowed"): 0,
    }

    status, _ = await fleet.admin("POST", "/workers/w1/drain")
    assert status == 200  # every request to the unfollowed worker
    cached = []
    for _ in range(2):
        status, headers, answer = await fleet.post("/v1/chat/completions", _chat("tenant-u"))
        assert status == 200 and headers["x-kvroute-worker"] == "w0"
        assert headers["x-kvroute-matched-tokens"] == "0"  # unfollowed: no hit predicted
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] >= 300  # its own cache, which the router did not follow
    samples = await scrape(fleet)
    outcomes = {got["outcome"]: v for got, v in samples["kvroute_prediction_outcomes_total"]
                if got["worker"] == "w0"}  # fmt: skip
    assert outcomes == {"exact": 0, "over": 0, "under": 0, "unfollowed": 2}
    assert total(samples, "kvroute_usage_reports_total", worker="w0") == 2
    assert total(samples, "kvroute_usage_cached_tokens_total", worker="w0") == cached[1]


DOCS = Path(__file__).resolve().parents[3] / "docs"


def exported_names(text: str) -> set[str]:
    """Every sample name /metrics can show, from its families (samples or not yet)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total", "_created"),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
        }.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


async def test_grafana_dashboard_and_docs_use_exactly_the_exported_names(fleet: Fleet) -> None:
    status, _, _ = await fleet.post("/v1/chat/completions", _chat("tenant-a"))
    assert status == 200
    async with fleet.session.get(fleet.url + "/metrics") as resp:
        text = await resp.text()
    exported = exported_names(text)
    dashboard = json.loads((DOCS / "grafana" / "kvroute.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"kvroute_[a-z_]+", e)}
    assert used and used <= exported, sorted(used - exported)
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            _read_once_per_process(target["expr"], target["legendFormat"], types)
    # and every family the router exports is described in docs/operations.md
    described = _described_families()
    families = {n for n in exported if not n.endswith(("_bucket", "_sum", "_count", "_created"))}
    families = {n.removesuffix("_total") for n in families}
    assert families <= described | {f + "_total" for f in described}, sorted(families - described)


# what every process holds a copy of (`kvroute serve --processes N`, replicas): each follows and
# indexes every stream itself, so the stream and index families (counters included) say the
# same of one stream in every process. Every gauge is a state read when scraped (load, which
# with [cluster] is the fleet's in each process, routable, unfollowed): never added up either
_COPIES = ("kvroute_stream_", "kvroute_namespace")
_AGGREGATION = re.compile(r"\b(sum|max|min|count)\s*(?:by\s*\(([^)]*)\)\s*)?\(")


def _aggregations(expr: str) -> list[tuple[int, int, str, set[str]]]:
    """Each aggregation of `expr`: where its argument starts and ends, its kind, its labels."""
    found = []
    for match in _AGGREGATION.finditer(expr):
        start = end = match.end() - 1  # its argument's opening parenthesis
        depth = 0
        for end in range(start, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            if depth == 0:
                break
        labels = {x.strip() for x in (match.group(2) or "").split(",") if x.strip()}
        found.append((start, end, match.group(1), labels))
    return found


def _read_once_per_process(expr: str, legend: str, types: dict[str, str]) -> None:
    """Under `--processes N` every series comes once per process (`process="<i>"`): the
    panels drew N lines of one legend ("In flight", "Index entries", "Stream event lag") and
    summed the copies ("Workers routable" read 4 of 4 for 2 workers on 2 processes; one worker
    restart showed as 2). Each selector is aggregated away from `process` now: a count of
    what a process served summed, a copy or a state read once (max or min)."""
    aggregations = _aggregations(expr)
    for found in re.finditer(r"kvroute_[a-z_]+", expr):
        name = found.group()
        family = re.sub(r"_(total|bucket|sum|count)$", "", name)
        around = sorted(
            (a for a in aggregations if a[0] < found.start() < a[1]), key=lambda a: -a[0]
        )
        assert around, f"{name} drawn once per process: {expr}"
        kind = around[0][2]  # the innermost
        assert all("process" not in a[3] for a in around), expr
        copy = family.startswith(_COPIES) or types.get(family) == "gauge"
        assert (kind in ("max", "min")) if copy else (kind == "sum"), (kind, expr)
    # one line per legend: the outermost aggregations keep what the legend names
    outer = [a for a in aggregations if not any(b[0] < a[0] < b[1] for b in aggregations)]
    kept = set().union(*(a[3] for a in outer)) - {"le"}
    assert kept == set(re.findall(r"{{(\w+)}}", legend)), (legend, expr)


def _described_families() -> set[str]:
    """The metric names docs/operations.md's tables describe."""
    return set(re.findall(r"`(kvroute_[a-z_]+)", (DOCS / "operations.md").read_text()))


async def test_a_replicas_cluster_series_are_described_and_counters_are_counters() -> None:
    """A replica's `kvroute_cluster_*` were left out of the check above (its fleet has no
    [cluster]): seven of them were in no table, and the running totals were typed gauges,
    with no `_total`, so rate() read nothing into them."""
    async with (
        NatsServer() as nats,
        RouterService(replica_config([], nats.url, "r1")) as router,
        aiohttp.ClientSession() as session,
        session.get(router.url + "/metrics") as resp,
    ):
        text = await resp.text()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    cluster = {name: kind for name, kind in types.items() if name.startswith("kvroute_cluster_")}
    assert len(cluster) == 10, cluster
    for total in ("published", "applied", "unmatched_pages", "misaddressed", "late", "dropped"):
        assert cluster.pop(f"kvroute_cluster_decisions_{total}") == "counter"
    assert cluster.pop("kvroute_cluster_evictions_applied") == "counter"
    assert set(cluster.values()) == {"gauge"}, cluster  # states: degraded, replicas, unsent
    exported = exported_names(text)
    families = {n for n in exported if not n.endswith(("_bucket", "_sum", "_count", "_created"))}
    families = {n.removesuffix("_total") for n in families}
    assert families <= _described_families(), sorted(families - _described_families())
