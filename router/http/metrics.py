"""Prometheus metrics of one router, in its own registry (several routers may share a process).

Labels are worker ids, endpoints, outcomes and served models only: never a salt, never a
fingerprint (a label per tenant would be unbounded and would leak who is active), and never the
client's `model` string: a request is labelled with the served model it resolved to (its pool's
cache name, "" in a fleet whose workers name none), `UNKNOWN_MODEL` when it named a model the
fleet does not serve, the adapter's own name when it named an adapter that workers of several
base models list (`AmbiguousModelError`: a name the workers list, so bounded), and "" when the
router answered before reading a model at all.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import ClassVar, cast

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from router.fleet.false_hits import WATCH_ACTIONS, WatchAction

__all__ = [
    "CLIENT_CLOSED",
    "CLIENT_CLOSED_ERROR",
    "DEADLINE_CUT",
    "NO_ROUTE",
    "REQUEST_MODEL",
    "UNKNOWN_MODEL",
    "WORKER_BROKE_OFF",
    "Histogram",
    "RouterMetrics",
    "route_template",
]

UNKNOWN_MODEL = "(unknown)"  # one label value for every model nobody serves
# a request its client abandoned before its answer was complete: the `code` it counts under in
# `kvroute_requests` (nginx's "client closed request", which operators read in access logs),
# and the `error` in `kvroute_rejected_requests` when no worker had been sent it yet. Left
# uncounted, the requests clients gave up on (a slow fleet's) would vanish from the latency
# histogram, which would hide exactly the bad cases
CLIENT_CLOSED = 499
CLIENT_CLOSED_ERROR = "ClientClosedRequest"
# a streamed answer its worker broke off after its status line reached the client (the
# connection dropped mid-stream): the `code` it counts under in `kvroute_requests`, nginx's
# "bad gateway" for an upstream that failed. The client got the worker's status line (a 200)
# and a cut body; counted as that status, an operator's error rate would never see the failure
WORKER_BROKE_OFF = 502
# a streamed answer the request deadline (`timeouts.request_s`) cut after its status line reached
# the client: the `code` it counts under, as a 504 the router answers itself (the client has a
# cut body, not the whole answer its 200 promised)
DEADLINE_CUT = 504
# the model label of a request once it is known, for the error middleware's rejection count
REQUEST_MODEL = web.RequestKey("kvroute_model", str)
# the `endpoint` of a request whose path is no route (or was never read): paths are client
# input, one series per path ever tried would be unbounded
NO_ROUTE = "-"

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


# how long after a worker's removal its answers may still arrive (requests it was serving then,
# streams included) and are dropped from its series when scraped; a worker added back under
# the same id before that counts again at once
LATE_ANSWERS_S = 3600.0


async def route_template(
    router: web.UrlDispatcher,
    request: web.BaseRequest,
    match: web.UrlMappingMatchInfo | None = None,
) -> str:
    """The template of the route `request`'s path is (`/admin/workers/{id}/drain`), the
    `endpoint` label; `NO_ROUTE` for a path that is none. `match`: what `router` resolved
    the request to already, when it has.

    A method the route does not take (a 405) is resolved again with one it takes (the first
    in order, where routes of several methods match the path): aiohttp's 405 keeps no route,
    and its refusals were counted under `-` as if the path were none.
    """
    # the app's requests are all `web.Request`s (its request factory makes them), the
    # listener's, not yet routed, included
    req = cast(web.Request, request)
    if match is None:
        match = await router.resolve(req)
    resource = match.route.resource
    if resource is not None:
        return resource.canonical
    refused = match.http_exception
    if isinstance(refused, web.HTTPMethodNotAllowed) and refused.allowed_methods:
        match = await router.resolve(req.clone(method=min(refused.allowed_methods)))
        if match.route.resource is not None:
            return match.route.resource.canonical
    return NO_ROUTE


class Histogram:
    """A cumulative-bucket histogram of plain numbers, exported when scraped (the request
    latency here, the decision statistics' block counts and times to first byte)."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (a bucket counts the values up to and including its bound)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value

    def observe_many(self, values: Sequence[float]) -> None:
        """`observe` each of `values`, in order (their buckets found in one C-level pass)."""
        counts = self.counts
        for i in map(bisect.bisect_left, itertools.repeat(self.bounds), values):
            counts[i] += 1
        self.count += len(values)
        total = self.total
        for value in values:  # one by one, as `observe` adds them: the same float sum
            total += value
        self.total = total

    def buckets(self) -> list[tuple[str, float]]:
        """Prometheus' cumulative (le, count) pairs."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class _PerWorker(Collector):
    """A per-worker gauge read from the router's own state when scraped: the in-flight counts
    (`kvroute_in_flight_requests`: the load tracker's, which a gauge of its own would keep
    twice, with two locked updates on every request) and whether each worker is routable
    (`kvroute_worker_routable`: the pool's, so a breaker that opened or a drain shows at once,
    not at the next health round)."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name
        self._documentation = documentation
        self.source: Callable[[], Mapping[str, float]] = dict

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self._name, self._documentation, labels=["worker"])

    def describe(self) -> Iterator[Metric]:
        """The metric's name and type, without samples."""
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        """Every worker's value now."""
        family = self._family()
        for worker, value in sorted(self.source().items()):
            family.add_metric([worker], float(value))
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


class _FalseHitWatch(Collector):
    """The false-hit watch's doings per worker (`router.fleet.false_hits`,
    `router.fleet.false_hit_response`): `kvroute_worker_unfollowed_seconds`, read from the pool
    when scraped, and `kvroute_false_hit_actions`, counted here as the false-hit response acts.

    Every worker of the pool has each action's series from 0: a series born at 1 shows no
    `increase()`, so an alert would miss a worker's first action, the one that matters most.
    """

    def __init__(self) -> None:
        # every worker's seconds left unfollowed (0: followed)
        self.source: Callable[[], Mapping[str, float]] = dict
        self.counts: dict[tuple[str, WatchAction], int] = {}

    def forget(self, workers: Collection[str]) -> None:
        """Drop the action counts of removed `workers`."""
        if any(worker in workers for worker, _ in self.counts):
            self.counts = {k: n for k, n in self.counts.items() if k[0] not in workers}

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily(
                "kvroute_worker_unfollowed_seconds",
                "Seconds the worker's KV events stay unfollowed by the false-hit watch's "
                "quarantine (routed by load, no hit predicted); 0 while followed",
                labels=["worker"],
            ),
            CounterMetricFamily(
                "kvroute_false_hit_actions",
                "What the false-hit watch did about a worker whose answers kept reusing far "
                "less than predicted: resubscribed (its streams subscribed anew) or unfollowed "
                "(its streams left unfollowed a while)",
                labels=["worker", "action"],
            ),
        )

    def describe(self) -> Iterator[Metric]:
        """The metrics' names and types, without samples."""
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """Every worker's seconds left unfollowed and its actions so far."""
        seconds, actions = self._families()
        unfollowed = self.source()
        for worker, left in sorted(unfollowed.items()):
            seconds.add_metric([worker], left)
        # a worker's late count (removed while the check ran) is dropped at the next scrape
        for worker in sorted(set(unfollowed) | {w for w, _ in self.counts}):
            for action in WATCH_ACTIONS:
                actions.add_metric([worker, action], self.counts.get((worker, action), 0))
        yield seconds
        yield actions


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
        "decisions_misaddressed": "Routing decisions of other replicas whose worker id names "
        "another server here than where they were made (ids swapped or renamed in between): "
        "pending marks moved to the server meant, shadows not applied",
        "decisions_late": "Routing decisions of other replicas not marked on a stream here "
        "(one per stream) because they came late: past the pending TTL, made before the "
        "stream was last cleared, or held past 50 ms across a removal there",
        "decisions_dropped": "Routing decisions not published (buffer full or NATS error)",
        "unsent_admin_writes": "Admin changes kept here until NATS takes them",
        "evictions_applied": "Namespace evictions of other replicas applied to the index here",
        "relay_records_published": "kvroute relay: records of the index's streams written to NATS",
        "relay_records_dropped": "kvroute relay: records never written (NATS away too long, or "
        "the queue full): the replicas rebuild the streams that lost some",
        "relay_records_waiting": "kvroute relay: records queued for NATS",
        "relay_records_applied": "Records of the relay applied to this replica's streams",
        "relay_records_skipped": "Records of the relay for streams this replica does not follow",
        "relay_records_malformed": "Records of the relay that did not decode",
    }

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, float]] = dict

    def describe(self) -> Iterator[Metric]:
        """Nothing until a cluster exports: a lone router has no such series."""
        return iter(())

    # the running totals among them: counters (`_total`), so rate() reads them as counts
    _COUNTERS: ClassVar[frozenset[str]] = frozenset(
        (
            "decisions_published",
            "decisions_applied",
            "decisions_unmatched_pages",
            "decisions_misaddressed",
            "decisions_late",
            "decisions_dropped",
            "evictions_applied",
            "relay_records_published",
            "relay_records_dropped",
            "relay_records_applied",
            "relay_records_skipped",
            "relay_records_malformed",
        )
    )

    def collect(self) -> Iterator[Metric]:
        """One series per value the cluster reports: a counter for a running total, a gauge
        for a state."""
        for name, value in self.source().items():
            family: CounterMetricFamily | GaugeMetricFamily
            text = self._HELP.get(name, name)
            if name in self._COUNTERS:
                family = CounterMetricFamily(f"kvroute_cluster_{name}", text)
            else:
                family = GaugeMetricFamily(f"kvroute_cluster_{name}", text)
            family.add_metric([], value)
            yield family


class _Labelled:
    """A registry's metrics with constant labels added to every sample (`process` under
    `kvroute serve --processes`): each process's series are its own, never one series whose
    value jumps between the processes' totals."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._registry = registry
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        """The registry's metrics, every sample with the labels."""
        for metric in self._registry.collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [
                s._replace(labels={**s.labels, **self._labels}) for s in metric.samples
            ]
            yield labelled


class _Proxied(Collector):
    """The per-request series: `kvroute_requests`, `kvroute_prompt_tokens`,
    `kvroute_matched_tokens` and `kvroute_request_duration_seconds`, counted in plain numbers
    and made into metrics when scraped.

    prometheus-client's own counters and histograms take a lock on every update, and a proxied
    request made four: 3.5% of the router's CPU per request (paired runs), for series whose
    exposition is the same.
    """

    def __init__(self) -> None:
        # each series' numbers, then the time it was first counted (its `_created` sample)
        self._requests: dict[tuple[str, str, str, str], list[float]] = {}  # count
        self._tokens: dict[tuple[str, str], list[float]] = {}  # by worker, model: prompt, matched
        # by endpoint and model
        self._latency: dict[tuple[str, str], tuple[Histogram, float]] = {}

    def record(
        self,
        endpoint: str,
        worker: str,
        code: str,
        model: str,
        prompt: int,
        matched: int,
        seconds: float,
    ) -> None:
        """Count one request."""
        requests = self._requests.get((endpoint, worker, code, model))
        if requests is None:
            requests = self._requests[endpoint, worker, code, model] = [0, time.time()]
        requests[0] += 1
        tokens = self._tokens.get((worker, model))
        if tokens is None:
            tokens = self._tokens[worker, model] = [0, 0, time.time()]
        tokens[0] += prompt
        tokens[1] += matched
        latency = self._latency.get((endpoint, model))
        if latency is None:
            latency = self._latency[endpoint, model] = (Histogram(_LATENCY_BUCKETS), time.time())
        latency[0].observe(seconds)

    def forget(self, workers: Collection[str]) -> None:
        """Drop the series (requests, prompt and matched tokens) of `workers`."""
        if any(k[1] in workers for k in self._requests):
            self._requests = {k: v for k, v in self._requests.items() if k[1] not in workers}
        if any(k[0] in workers for k in self._tokens):
            self._tokens = {k: v for k, v in self._tokens.items() if k[0] not in workers}

    def describe(self) -> Iterator[Metric]:
        """The metrics' names and types, without samples."""
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """Every series counted so far."""
        requests, prompt, matched, latency = self._families()
        for key, (count, created) in self._requests.items():
            requests.add_metric(list(key), count, created)
        for (worker, model), (p, m, created) in self._tokens.items():
            prompt.add_metric([worker, model], p, created)
            matched.add_metric([worker, model], m, created)
        for (endpoint, model), (hist, created) in self._latency.items():
            latency.add_metric([endpoint, model], hist.buckets(), hist.total)
            labels = {"endpoint": endpoint, "model": model}
            latency.samples.append(Sample(latency.name + "_created", labels, created))
        yield requests
        yield prompt
        yield matched
        yield latency

    @staticmethod
    def _families() -> tuple[
        CounterMetricFamily, CounterMetricFamily, CounterMetricFamily, HistogramMetricFamily
    ]:
        return (
            CounterMetricFamily(
                "kvroute_requests",
                "Proxied requests by endpoint, worker, status code and model",
                labels=["endpoint", "worker", "code", "model"],
            ),
            CounterMetricFamily(
                "kvroute_prompt_tokens",
                "Prompt tokens routed, by worker and model",
                labels=["worker", "model"],
            ),
            CounterMetricFamily(
                "kvroute_matched_tokens",
                "Prompt tokens the index predicted cached on the chosen worker at admission "
                "(x-kvroute-matched-tokens), by worker and model",
                labels=["worker", "model"],
            ),
            HistogramMetricFamily(
                "kvroute_request_duration_seconds",
                "Time from request to last byte, by endpoint and model",
                labels=["endpoint", "model"],
            ),
        )


class RouterMetrics:
    """Every metric the router exports."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        """`labels`: constant labels on every series (a replica process's `process`)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self._exported: CollectorRegistry | _Labelled = _Labelled(r, labels) if labels else r
        # the series every proxied request counts in (`record`)
        self._proxied = _Proxied()
        r.register(self._proxied)
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
        self.unindexed = Counter(
            "kvroute_unindexed_requests",
            "Requests routed without event-based affinity because their cache key has a part "
            "the KV events do not carry, by that part (e.g. extra_key)",
            ["reason"],
            registry=r,
        )
        self._in_flight = _PerWorker(
            "kvroute_in_flight_requests", "Requests the router has in flight per worker"
        )
        r.register(self._in_flight)
        self._rank_in_flight = _RankInFlight()
        r.register(self._rank_in_flight)
        self._cluster = _Cluster()
        r.register(self._cluster)
        self._routable = _PerWorker(
            "kvroute_worker_routable", "1 when the worker takes new requests"
        )
        r.register(self._routable)
        self._watch = _FalseHitWatch()
        r.register(self._watch)
        # what else keeps per-worker series (the decision statistics), told of removals too
        self._forgetters: list[Callable[[Collection[str]], None]] = []
        # removed workers whose late answers are dropped when scraped, until this monotonic time
        self._removed: dict[str, float] = {}
        self._clock = clock

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
        """Count one proxied request of `model` (a served model's name, never client input);
        `matched`: the prediction x-kvroute-matched-tokens carries (`Candidate.
        predicted_split`'s first part), not the raw index match: under KV pressure that counts
        prefixes the admission forecast says will be evicted first (it did, overstating the
        predicted hit rate)."""
        self._proxied.record(endpoint, worker, str(code), model, prompt, matched, seconds)

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
        if self._removed:
            self._drop_late_answers()
        return generate_latest(self._exported)

    def export_routable(self, routable: Callable[[], Mapping[str, bool]]) -> None:
        """Export `routable()` (whether each worker takes new requests now) as
        `kvroute_worker_routable`."""
        self._routable.source = routable

    def export_unfollowed(self, unfollowed: Callable[[], Mapping[str, float]]) -> None:
        """Export `unfollowed()` (every worker's seconds left unfollowed, 0: followed) as
        `kvroute_worker_unfollowed_seconds`; its workers have `kvroute_false_hit_actions`
        series from 0."""
        self._watch.source = unfollowed

    def false_hit_action(self, worker: str, action: WatchAction) -> None:
        """Count what the false-hit watch did about `worker` (`kvroute_false_hit_actions`)."""
        key = (worker, action)
        self._watch.counts[key] = self._watch.counts.get(key, 0) + 1

    def added(self, worker: str) -> None:
        """`worker` joined the pool: a late answer under its id counts again (`forget`)."""
        if self._removed:
            self._removed.pop(worker, None)

    def forget_with(self, forget: Callable[[Collection[str]], None]) -> None:
        """Call `forget(workers)` as well to drop removed workers' series."""
        self._forgetters.append(forget)

    def forget(self, worker: str) -> None:
        """Drop a removed worker's series: retries, requests, tokens, the false-hit watch's
        actions, and those of every `forget_with` (its in-flight count leaves with the load
        tracker, its routable and unfollowed gauges with the pool). A fleet whose
        workers come and go (autoscaling, discovery) would otherwise grow a series per worker
        it ever had. Answers of requests the worker was serving when removed still count
        until the next scrape drops them again (`LATE_ANSWERS_S`)."""
        self._removed[worker] = self._clock() + LATE_ANSWERS_S
        self._drop({worker})

    def _drop(self, workers: Collection[str]) -> None:
        for worker in workers:
            with contextlib.suppress(KeyError):
                self.retries.remove(worker)
        self._proxied.forget(workers)
        self._watch.forget(workers)
        for forget in self._forgetters:
            forget(workers)

    def _drop_late_answers(self) -> None:
        self._drop(self._removed.keys())
        now = self._clock()
        self._removed = {w: until for w, until in self._removed.items() if until > now}
