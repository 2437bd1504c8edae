"""Prometheus metrics of one router, in its own registry (several routers may share a process).

Labels are worker ids, endpoints, outcomes and served models only: never a salt, never a
fingerprint (a label per tenant would be unbounded and would leak who is active), and never the
client's `model` string: a request is labelled with the served model it resolved to (its pool's
cache name, "" in a fleet whose workers name none), `UNKNOWN_MODEL` when it named a model the
fleet does not serve, and "" when the router answered before reading a model at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["REQUEST_MODEL", "UNKNOWN_MODEL", "RouterMetrics"]

UNKNOWN_MODEL = "(unknown)"  # one label value for every model nobody serves
# the model label of a request once it is known, for the error middleware's rejection count
REQUEST_MODEL = web.RequestKey("kvroute_model", str)

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


class _InFlight(Collector):
    """`kvroute_in_flight_requests`, read from the load tracker when scraped.

    The router already counts running requests per worker for routing; a gauge of its own
    would be the same number kept twice, with two locked updates on every request.
    """

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, int]] = dict

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "kvroute_in_flight_requests",
            "Requests the router has in flight per worker",
            labels=["worker"],
        )

    def describe(self) -> Iterator[Metric]:
        """The metric's name and type, without samples."""
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        """The current in-flight count of every worker."""
        family = self._family()
        for worker, running in sorted(self.source().items()):
            family.add_metric([worker], running)
        yield family


class _RankInFlight(Collector):
    """`kvroute_dp_rank_in_flight_requests`: the same count per dp rank, read when scraped.

    Only requests the router sent with a rank (workers with several ranks) are counted here;
    the ranks are the workers' own (their streams), so the label set is as bounded as the fleet.
    """

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[tuple[str, int], int]] = dict

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "kvroute_dp_rank_in_flight_requests",
            "Requests the router has in flight per data-parallel rank it told a worker to use",
            labels=["worker", "dp_rank"],
        )

    def describe(self) -> Iterator[Metric]:
        """The metric's name and type, without samples."""
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        """The current in-flight count of every (worker, rank)."""
        family = self._family()
        for (worker, rank), running in sorted(self.source().items()):
            family.add_metric([worker, str(rank)], running)
        yield family


class _Cluster(Collector):
    """`kvroute_cluster_*`: where this replica stands with the others, read when scraped."""

    _HELP: ClassVar[dict[str, str]] = {
        "degraded": "1 while this replica is not in step with the others (NATS away): it "
        "serves on its own state",
        "replicas": "Replicas of this router heard from (this one included)",
        "decisions_published": "Routing decisions this replica published",
        "decisions_applied": "Routing decisions of other replicas applied here",
        "decisions_unmatched_pages": "Routing decisions of other replicas not marked on a "
        "stream here (one per stream): their block keys are for another page size than the "
        "stream's",
        "decisions_dropped": "Routing decisions not published (buffer full or NATS error)",
        "unsent_admin_writes": "Admin changes kept here until NATS takes them",
    }

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, float]] = dict

    def describe(self) -> Iterator[Metric]:
        """Nothing until a cluster exports: a lone router has no such series."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        """One gauge per value the cluster reports."""
        for name, value in self.source().items():
            family = GaugeMetricFamily(f"kvroute_cluster_{name}", self._HELP.get(name, name))
            family.add_metric([], value)
            yield family


class RouterMetrics:
    """Every metric the router exports."""

    def __init__(self) -> None:
        # label children cached: `labels()` validates and locks on every call (hot path)
        self._children: dict[
            tuple[str, str, int, str], tuple[Counter, Counter, Counter, Histogram]
        ] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Proxied requests by endpoint, worker, status code and model",
            ["endpoint", "worker", "code", "model"],
            registry=r,
        )
        self.rejected = Counter(
            "kvroute_rejected_requests",
            "Requests answered by the router itself (4xx/5xx), by the model they resolved to",
            ["endpoint", "error", "model"],
            registry=r,
        )
        self.held = Counter(
            "kvroute_held_requests",
            "Requests held in the router until the worker chosen for them had KV room "
            "(policy.hold_until_room)",
            registry=r,
        )
        self.holding = Gauge(
            "kvroute_holding_requests",
            "Requests held in the router now, waiting for a worker with KV room",
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Upstream attempts that failed before any byte reached the client",
            ["worker"],
            registry=r,
        )
        self.latency = Histogram(
            "kvroute_request_duration_seconds",
            "Time from request to last byte, by endpoint and model",
            ["endpoint", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens",
            "Prompt tokens routed, by worker and model",
            ["worker", "model"],
            registry=r,
        )
        self.matched_tokens = Counter(
            "kvroute_matched_tokens",
            "Prompt tokens the index predicted cached on the chosen worker, by worker and model",
            ["worker", "model"],
            registry=r,
        )
        self.unindexed = Counter(
            "kvroute_unindexed_requests",
            "Requests routed without event-based affinity because their cache key has a part "
            "the KV events do not carry, by that part (e.g. extra_key)",
            ["reason"],
            registry=r,
        )
        self._in_flight = _InFlight()
        r.register(self._in_flight)
        self._rank_in_flight = _RankInFlight()
        r.register(self._rank_in_flight)
        self._cluster = _Cluster()
        r.register(self._cluster)
        self.healthy = Gauge(
            "kvroute_worker_routable",
            "1 when the worker takes new requests",
            ["worker"],
            registry=r,
        )

    def record(
        self,
        endpoint: str,
        worker: str,
        code: int,
        prompt: int,
        matched: int,
        seconds: float,
        model: str = "",
    ) -> None:
        """Count one proxied request of `model` (a served model's name, never client input)."""
        key = (endpoint, worker, code, model)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(endpoint, worker, str(code), model),
                self.prompt_tokens.labels(worker, model),
                self.matched_tokens.labels(worker, model),
                self.latency.labels(endpoint, model),
            )
        requests, prompt_tokens, matched_tokens, latency = children
        requests.inc()
        prompt_tokens.inc(prompt)
        matched_tokens.inc(matched)
        latency.observe(seconds)

    def export_in_flight(self, running: Callable[[], Mapping[str, int]]) -> None:
        """Export `running()` (requests in flight per worker) as the in-flight gauge."""
        self._in_flight.source = running

    def export_rank_in_flight(self, running: Callable[[], Mapping[tuple[str, int], int]]) -> None:
        """Export `running()` (requests in flight per (worker, dp rank)) as the rank gauge."""
        self._rank_in_flight.source = running

    def export_cluster(self, gauges: Callable[[], Mapping[str, float]]) -> None:
        """Export `gauges()` (the cluster's state) as `kvroute_cluster_<name>` gauges."""
        self._cluster.source = gauges

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

    def set_routable(self, worker: str, routable: bool) -> None:
        """Export whether `worker` takes new requests (`kvroute_worker_routable`)."""
        self.healthy.labels(worker).set(1 if routable else 0)

    def forget(self, worker: str) -> None:
        """Drop a removed worker's series (its in-flight count leaves with the load tracker)."""
        self._children = {k: v for k, v in self._children.items() if k[1] != worker}
        with contextlib.suppress(KeyError):
            self.healthy.remove(worker)
