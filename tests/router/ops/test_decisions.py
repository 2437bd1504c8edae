"""Decision statistics: outcomes against the prediction, reasons, the window, explanations."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.http.decisions import FLUSH_EVERY, Decision, DecisionCollector, DecisionStats
from router.routing.admission import AdmissionForecast
from router.routing.policy import Candidate


def _candidate(
    worker: str, matched: int, *, load: float = 0.0, rank: int | None = None
) -> Candidate:
    return Candidate(
        worker=worker,
        url="http://127.0.0.1:1",
        healthy=True,
        status="ready",
        dp_rank=rank,
        matched_tokens=matched,
        matched_blocks=matched // 16,
        load=load,
        score=4 * matched - load,
    )


def _samples(stats: DecisionStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(DecisionCollector(stats))
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_outcomes_reasons_and_blocks() -> None:
    now = [1000.0]
    stats = DecisionStats(clock=lambda: now[0])
    a, b = _candidate("a", 64), _candidate("b", 0, rank=1)
    cases = [([a, b], a, 64), ([a, b], a, 32), ([b, a], b, 16), ([_candidate("a", 0), b], b, None)]
    for candidates, chosen, cached in cases:
        d = Decision("id", "/v1/completions", "m", "ns", 100, candidates, chosen, 0, 16)
        d.status, d.cached_tokens = 200, cached
        stats.told(d)
    s = _samples(stats)
    a_key = (("dp_rank", ""), ("model", "m"), ("worker", "a"))
    b_key = (("dp_rank", "1"), ("model", "m"), ("worker", "b"))
    assert s[("kvroute_usage_reports_total", a_key)] == 2
    assert s[("kvroute_usage_predicted_tokens_total", a_key)] == 128
    assert s[("kvroute_usage_cached_tokens_total", a_key)] == 96
    assert (
        s[("kvroute_prediction_outcomes_total", (*a_key[:2], ("outcome", "exact"), a_key[2]))] == 1
    )
    assert (
        s[("kvroute_prediction_outcomes_total", (*a_key[:2], ("outcome", "over"), a_key[2]))] == 1
    )
    assert (
        s[("kvroute_prediction_outcomes_total", (*b_key[:2], ("outcome", "under"), b_key[2]))] == 1
    )
    assert s[("kvroute_usage_missing_total", b_key)] == 1
    reasons = {k[1][1][1]: v for k, v in s.items() if k[0] == "kvroute_route_decisions_total"}
    assert reasons == {"prefix": 2, "load": 1, "none": 1}
    assert s[("kvroute_route_query_blocks_count", (("model", "m"),))] == 4
    assert s[("kvroute_route_best_match_blocks_sum", (("model", "m"),))] == 12  # 4 + 4 + 4 + 0
    window = stats.window()
    assert len(window) == 30 and window[-1]["requests"] == 4
    assert window[-1]["accuracy"] == 1 / 3 and window[-1]["hit_rate"] == 112 / 300
    now[0] += 400  # five minutes later the window is empty again
    assert all(row["requests"] == 0 for row in stats.window())


def test_a_prediction_from_pending_marks_counts_in_the_outcome() -> None:
    # what the router told the client it reuses: 0 from events, 320 pending (its headers
    # said x-kvroute-matched-tokens: 0, x-kvroute-pending-tokens: 320)
    stats = DecisionStats(clock=lambda: 1000.0)
    pending = msgspec.structs.replace(_candidate("a", 0), pending_tokens=320)
    for cached in (0, 320):  # the worker reused none of it (a false hit), then all of it
        d = Decision("id", "/generate", "m", "ns", 337, [pending], pending, 0, 16)
        d.status, d.cached_tokens = 200, cached
        stats.told(d)
    s = _samples(stats)
    key = (("dp_rank", ""), ("model", "m"), ("worker", "a"))
    outcomes = {
        word: s[("kvroute_prediction_outcomes_total", (*key[:2], ("outcome", word), key[2]))]
        for word in ("exact", "over", "under")
    }
    # before, the pending part was left out: the false hit counted as exact, the hit as under
    assert outcomes == {"exact": 1, "over": 1, "under": 0}
    assert s[("kvroute_usage_predicted_tokens_total", key)] == 640
    assert stats.window()[-1]["accuracy"] == 1 / 2


def test_explanations_say_why() -> None:
    a, b = _candidate("a", 64, load=500), _candidate("b", 0, load=10)
    d = Decision("id", "/generate", "m", "ns", 100, [b, a], b, 0, 16)
    assert d.reason() == "load"
    assert d.explain().startswith("a holds 64 tokens but carries load 500")
    d = Decision("id", "/generate", "m", "ns", 100, [a, b], a, 1, 16)
    assert d.reason() == "prefix" and "longest prefix: 64 of 100" in d.explain()
    assert d.explain().endswith("(retry 1)")
    row = d.to_builtins()
    assert row["best_worker"] == "a" and len(row["candidates"]) == 2  # type: ignore[arg-type]
    assert "forecast" not in d.explain()
    # a longer match that lost on what the rest of the prompt would evict there, not on load
    full = msgspec.structs.replace(_candidate("a", 4), evicts_tokens=450)
    empty = _candidate("b", 0)
    full.score, empty.score = 16 - 225, 0.0
    d = Decision("id", "/generate", "m", "ns", 452, [empty, full], empty, 0, 4)
    assert d.reason() == "room"
    assert d.explain() == (
        "a holds 4 tokens but would evict 450 cached tokens for the rest (score -209); "
        "b holds 0 and would evict 0 (score 0)"
    )
    # a longer match on a pool that cannot hold the request: not routable, and said so
    small = msgspec.structs.replace(
        _candidate("a", 64), healthy=False, unfit="its KV pool holds 1024 tokens, fewer ..."
    )
    d = Decision("id", "/generate", "m", "ns", 2000, [empty, small], empty, 0, 16)
    assert d.explain() == (
        "a holds 64 tokens but its KV pool holds 1024 tokens, fewer ...; b holds 0, load 0"
    )
    # what the headers predict is said too when the forecast keeps less than the index holds
    a.pending_tokens = 32
    a.admission = AdmissionForecast(raw_tokens=96, kept_tokens=64, capacity_tokens=None)
    a.admission.cause = "answered"
    d = Decision("id", "/generate", "m", "ns", 100, [a, b], a, 0, 16)
    assert "64 of 100 tokens, 32 pending; 64 forecast at admission: answered" in d.explain()


def test_counted_in_batches_yet_every_reader_sees_every_request() -> None:
    now = [1000.0]
    stats = DecisionStats(clock=lambda: now[0])
    a = _candidate("a", 32)
    key = (("dp_rank", ""), ("model", "m"), ("worker", "a"))

    def one(cached: int) -> Decision:
        d = Decision("id", "/v1/completions", "m", "ns", 100, [a], a, 0, 16)
        d.ttft_s, d.status, d.cached_tokens = 0.01, 200, cached
        stats.told(d)
        return d

    first = one(32)
    # told, not counted yet: the scrape, `recent` and the window count it before they read
    assert _samples(stats)[("kvroute_routed_requests_total", key)] == 1
    assert list(stats.recent) == [first]
    assert stats.window()[-1]["requests"] == 1
    # a batch's worth is counted without a reader, and no more than that waits
    for _ in range(FLUSH_EVERY):
        one(0)
        assert len(stats._pending) < FLUSH_EVERY
    routed = stats._targets[("a", None, "m")][0]
    assert 1 < routed <= 1 + FLUSH_EVERY
    assert _samples(stats)[("kvroute_routed_requests_total", key)] == 1 + FLUSH_EVERY
    ttft = (
        "kvroute_time_to_first_token_seconds_count",
        (("endpoint", "/v1/completions"), ("model", "m")),
    )
    assert _samples(stats)[ttft] == 1 + FLUSH_EVERY


def test_a_request_counted_after_the_window_moved_on_spares_the_newer_period() -> None:
    now = [1000.0]
    stats = DecisionStats(clock=lambda: now[0])
    a = _candidate("a", 0)
    old = Decision("id", "/v1/completions", "m", "ns", 100, [a], a, 0, 16)
    old.status = 200
    # 300 s later (the window's length) the same slot holds a newer period, counted first
    now[0] += 300
    new = Decision("id", "/v1/completions", "m", "ns", 100, [a], a, 0, 16)
    new.status = 200
    stats.told(new)
    stats.flush()
    # then one told at t=1000 (a clock stepped back) is counted after it, in the next batch
    stats._pending.append((old, 1000.0))
    rows = stats.window()
    assert rows[-1]["requests"] == 1  # the older request did not reset the newer period
    assert sum(row["requests"] for row in rows) == 1


def test_what_a_request_got_to_is_what_is_counted() -> None:
    """A retried attempt counts its decision and its send; one that failed after its
    decision, its decision, its send and no outcome; the block size is read from the source
    when counted."""
    stats = DecisionStats(clock=lambda: 1000.0)
    sizes = {"a": 16}
    stats.block_size = lambda worker: sizes.get(worker)
    a, b = _candidate("a", 64), _candidate("b", 0)
    retried = Decision("r1", "/v1/completions", "m", "ns", 100, [a, b], a, 0, None)
    stats.told(retried)  # its worker failed before answering
    second = Decision("r1", "/v1/completions", "m", "ns", 100, [b, a], b, 1, None)
    second.ttft_s, second.status = 0.02, 200
    stats.told(second)
    abandoned = Decision("r2", "/v1/completions", "m", "ns", 100, [a, b], a, 0, None)
    stats.told(abandoned)  # the client went away
    s = _samples(stats)
    assert s[("kvroute_route_decisions_total", (("model", "m"), ("reason", "prefix")))] == 2
    assert ("kvroute_route_decisions_total", (("model", "m"), ("reason", "load"))) not in s
    queries = ("kvroute_route_query_blocks_count", (("model", "m"),))
    assert s[queries] == 2  # the first attempts, at worker a's 16 tokens a block
    assert retried.block_size == 16 and second.block_size is None
    ttft = (
        "kvroute_time_to_first_token_seconds_count",
        (("endpoint", "/v1/completions"), ("model", "m")),
    )
    assert s[ttft] == 1
    # sent: every attempt, to the worker it went to (as its `upstream` span says)
    for worker, sent in (("a", 2), ("b", 1)):
        routed = (
            "kvroute_routed_requests_total",
            (("dp_rank", ""), ("model", "m"), ("worker", worker)),
        )
        assert s[routed] == sent, worker
    assert list(stats.recent) == [second]


def test_an_unfollowed_workers_answers_are_counted_apart_from_the_accuracy() -> None:
    """A worker whose KV events the false-hit watch left unfollowed is predicted nothing on
    purpose (fail closed); its answers reusing its own cache counted as `under`, and the
    accuracy fell for a reason that is no index lag. They count as `unfollowed` now, in the
    usage counters but out of the accuracy (the window's too)."""
    stats = DecisionStats(clock=lambda: 1000.0)
    a = _candidate("a", 64)
    unfollowed = msgspec.structs.replace(_candidate("b", 0), unfollowed=True)
    for chosen, cached in ((a, 64), (unfollowed, 0), (unfollowed, 96)):
        d = Decision("id", "/v1/completions", "m", "ns", 100, [a, unfollowed], chosen, 0, 16)
        d.status, d.cached_tokens = 200, cached
        stats.told(d)
    s = _samples(stats)
    b_key = (("dp_rank", ""), ("model", "m"))
    outcomes = {
        word: s[("kvroute_prediction_outcomes_total", (*b_key, ("outcome", word), ("worker", "b")))]
        for word in ("exact", "over", "under", "unfollowed")
    }
    assert outcomes == {"exact": 0, "over": 0, "under": 0, "unfollowed": 2}
    b_usage = (*b_key, ("worker", "b"))
    assert s[("kvroute_usage_reports_total", b_usage)] == 2
    assert s[("kvroute_usage_cached_tokens_total", b_usage)] == 96  # the real hit rate keeps it
    (row,) = [r for r in stats.window() if r["requests"]]
    assert row["accuracy"] == 1.0 and row["unfollowed"] == 2 and row["cached_tokens"] == 160
    assert "b's KV events were unfollowed (false-hit watch)" in stats.recent[-1].explain()
