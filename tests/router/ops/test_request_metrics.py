"""The per-request series and the decision statistics' histograms are counted in plain
numbers: the exposition must be what prometheus-client's own counters and histograms write for
the same requests."""

from __future__ import annotations

import random
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from router.http.decisions import BLOCK_BUCKETS, TTFT_BUCKETS, _histogram_family
from router.http.metrics import _LATENCY_BUCKETS, RouterMetrics
from router.http.metrics import Histogram as DecisionHistogram

_REQUESTS = [
    # endpoint, worker, code, prompt, matched, seconds, model
    ("/generate", "w0", 200, 100, 64, 0.0005, "m"),  # on a bucket's bound: counted in it
    ("/generate", "w0", 200, 80, 0, 0.0031, "m"),
    ("/generate", "w1", 503, 12, 0, 61.0, "m"),  # beyond every bound: +Inf only
    ("/v1/completions", "w0", 200, 7, 0, 0.2, ""),
    ("/v1/completions", "w1", 200, 9, 3, 1.0, ""),
]


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition but the `_created` ones (times of first use differ)."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _reference(requests: list[tuple[str, str, int, int, int, float, str]]) -> bytes:
    registry = CollectorRegistry()
    counted = Counter(
        "kvroute_requests", "", ["endpoint", "worker", "code", "model"], registry=registry
    )
    prompt = Counter("kvroute_prompt_tokens", "", ["worker", "model"], registry=registry)
    matched = Counter("kvroute_matched_tokens", "", ["worker", "model"], registry=registry)
    latency = Histogram(
        "kvroute_request_duration_seconds",
        "",
        ["endpoint", "model"],
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )
    for endpoint, worker, code, p, m, seconds, model in requests:
        counted.labels(endpoint, worker, str(code), model).inc()
        prompt.labels(worker, model).inc(p)
        matched.labels(worker, model).inc(m)
        latency.labels(endpoint, model).observe(seconds)
    return generate_latest(registry)


def _ours(requests: list[tuple[str, str, int, int, int, float, str]]) -> RouterMetrics:
    metrics = RouterMetrics()
    for endpoint, worker, code, p, m, seconds, model in requests:
        metrics.record(endpoint, worker, code, p, m, seconds, model)
    return metrics


def test_the_request_series_read_as_prometheus_clients_own_would() -> None:
    rng = random.Random(7)
    requests = list(_REQUESTS)
    for _ in range(500):
        requests.append(
            (
                rng.choice(["/generate", "/v1/chat/completions"]),
                rng.choice(["w0", "w1", "w2"]),
                rng.choice([200, 200, 200, 429, 502]),
                rng.randrange(4000),
                rng.randrange(4000),
                rng.lognormvariate(-4, 2),
                rng.choice(["m", "other"]),
            )
        )
    ours = _samples(_ours(requests).render())
    reference = _samples(_reference(requests))
    # the reference's series, each with its value, among ours (ours has the router's other
    # metrics too)
    assert reference, "the reference wrote nothing"
    assert {k: ours.get(k) for k in reference} == reference
    # and the created series are there as prometheus-client writes them
    text = _ours(_REQUESTS).render().decode()
    for name in ("kvroute_requests_created", "kvroute_request_duration_seconds_created"):
        assert name in text


class _OneFamily(Collector):
    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> Iterator[Metric]:
        yield self._family


def test_decision_histograms_expose_as_prometheus_client_s() -> None:
    # the decision statistics' histograms (blocks, time to first byte) are plain numbers too:
    # on every bound, between bounds, below the first and beyond the last, their exposition
    # is prometheus-client's own, whether counted one by one or a batch at a time (as the
    # statistics count them)
    rng = random.Random(11)
    for bounds in (BLOCK_BUCKETS, TTFT_BUCKETS):
        values = [*bounds, *(b * 1.5 for b in bounds), -1.0, bounds[-1] * 10]
        values += [rng.uniform(0, bounds[-1] * 1.2) for _ in range(300)]
        rng.shuffle(values)
        ours, batched = DecisionHistogram(bounds), DecisionHistogram(bounds)
        registry = CollectorRegistry()
        theirs = Histogram("h", "", ["model"], buckets=bounds, registry=registry)
        for value in values:
            ours.observe(value)
            theirs.labels("m").observe(value)
        for start in range(0, len(values), 64):
            batched.observe_many(values[start : start + 64])
        expected = _samples(generate_latest(registry))
        for hist in (ours, batched):
            mine = CollectorRegistry()
            mine.register(_OneFamily(_histogram_family("h", "", ["model"], {("m",): hist})))
            assert _samples(generate_latest(mine)) == expected, bounds
