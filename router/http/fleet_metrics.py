"""Prometheus families of the fleet's state, read when `/metrics` is scraped.

Per (worker, dp rank): the KV-event stream's state, event lag, index entries and every
counter of the indexer's `StreamStats` (what `/admin/streams` shows: repairs, and what the
index skipped, so an alert can watch each), and the router's in-flight load on that rank
(`LoadTracker`; every rank of the fleet's workers, at 0 while idle). Per index: how many
namespaces it holds and their sizes as a histogram. Nothing here is kept twice: every number is
the one the indexer and the load tracker already hold for routing and for `/admin/streams`.

No namespace fingerprint and no salt is a label (one series per tenant would be unbounded and
would say who is active): namespaces only as a size distribution; the largest ones by
fingerprint through `GET /admin/namespaces`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from indexer.service import IndexerService, StreamState
from router.routing.load import LoadTracker, Target

__all__ = ["NAMESPACE_TOKEN_BUCKETS", "FleetCollector"]

NAMESPACE_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)

# StreamStats counter -> (metric name, help)
_STREAM_COUNTERS = (
    ("gaps", "kvroute_stream_gaps", "Sequence gaps noticed in the stream"),
    ("replays", "kvroute_stream_replays", "Replay runs (gap repairs and probes that brought data)"),
    ("restarts", "kvroute_stream_restarts", "Publisher restarts detected (the stream was rebuilt)"),
    ("clears", "kvroute_stream_clears", "Times the stream's entries were dropped wholesale"),
    ("decode_errors", "kvroute_stream_decode_errors", "Batches or events that failed to decode"),
    ("lost_batches", "kvroute_stream_lost_batches", "Batches undecodable even from the replay"),
    ("batches", "kvroute_stream_batches", "Event batches applied"),
    ("events", "kvroute_stream_events", "Events in the batches applied"),
    ("blocks_stored", "kvroute_stream_blocks_stored", "Blocks stored by the events applied"),
    ("blocks_removed", "kvroute_stream_blocks_removed", "Blocks removed by the events applied"),
    ("probes", "kvroute_stream_probes", "Catch-up replay requests made while the stream was quiet"),
    (
        "undelivered_tails",
        "kvroute_stream_undelivered_tails",
        "Replays (probes, proofs, rebuilds) that found batches the event socket never delivered",
    ),
    (
        "refetches",
        "kvroute_stream_refetches",
        "Batches that did not decode and were fetched again through the replay socket",
    ),
    (
        "unanswered_replays",
        "kvroute_stream_unanswered_replays",
        "Replay requests whose answer never came to its end (timed out, or not the stream's "
        "buffer)",
    ),
    (
        "verifications",
        "kvroute_stream_verifications",
        "Restart candidates (reconnects, health transitions, snapshot loads) checked against "
        "the publisher's epoch fence",
    ),
    # what the index cannot use, which no other counter shows: each is KV routing lost for that
    # stream, silently otherwise
    (
        "block_size_mismatches",
        "kvroute_stream_block_size_mismatches",
        "Events whose pages do not fit the stream's block size: not indexed (KV routing for "
        "the worker misses; check its page size against the configured block_size)",
    ),
    (
        "skipped_events",
        "kvroute_stream_skipped_events",
        "Events not indexed (malformed, or of a kind the index does not use)",
    ),
    (
        "unknown_parents",
        "kvroute_stream_unknown_parents",
        "Stored events whose parent block the stream does not hold: not indexed",
    ),
    (
        "unknown_removes",
        "kvroute_stream_unknown_removes",
        "Removals of blocks the stream does not hold (in the tier they name): changed nothing",
    ),
    (
        "skipped_group_blocks",
        "kvroute_stream_skipped_group_blocks",
        "Blocks of KV-cache groups that make no reusable prefix (sliding window, Mamba): not kept",
    ),
    (
        "unindexable_blocks",
        "kvroute_stream_unindexable_blocks",
        "Blocks keyed by what their tokens do not show (vLLM images, embeddings): not kept",
    ),
    (
        "rank_mismatches",
        "kvroute_stream_rank_mismatches",
        "Batches naming another dp rank than the stream's (the stream is cleared)",
    ),
    (
        "token_kind_mismatches",
        "kvroute_stream_token_kind_mismatches",
        "Pages of the other token kind (EAGLE pairs or ints) than the stream holds: not kept",
    ),
    (
        "dead_batches",
        "kvroute_stream_dead_batches",
        "Live batches of a restarted worker's dead process, still queued: skipped",
    ),
    (
        "live_checks",
        "kvroute_stream_live_checks",
        "Live batches asked of the replay socket (the two must be one publisher's)",
    ),
    (
        "rebuilds",
        "kvroute_stream_rebuilds",
        "Streams a gap cleared, rebuilt afterwards from the replay buffer",
    ),
)


class FleetCollector(Collector):
    """Streams, per-rank load and namespace sizes, collected from the live objects."""

    def __init__(
        self,
        indexer: IndexerService,
        load: LoadTracker,
        fleet: Callable[[], Iterable[Target]] = tuple,
    ) -> None:
        self._indexer = indexer
        self._load = load
        # where the fleet's workers count their load: listed at 0 while idle
        self._fleet = fleet

    def describe(self) -> Iterator[Metric]:
        """The families' names and types, without samples."""
        yield from self._families(empty=True)

    def collect(self) -> Iterator[Metric]:
        """Every family with its current samples."""
        yield from self._families(empty=False)

    def _families(self, *, empty: bool) -> Iterator[Metric]:
        labels = ["worker", "dp_rank"]
        streams = [] if empty else sorted(self._indexer.streams(), key=lambda s: s.stream)
        state = GaugeMetricFamily(
            "kvroute_stream_state",
            "1 for the stream's current state (syncing, synced, degraded, unverified, stale)",
            labels=[*labels, "state"],
        )
        lag = GaugeMetricFamily(
            "kvroute_stream_lag_seconds",
            "Seconds since the stream's last event (absent before its first)",
            labels=labels,
        )
        entries = GaugeMetricFamily(
            "kvroute_stream_index_entries", "Blocks the index holds for the stream", labels=labels
        )
        counters = [
            CounterMetricFamily(name, text, labels=labels) for _, name, text in _STREAM_COUNTERS
        ]
        for stats in streams:
            key = [stats.worker, str(stats.dp_rank)]
            for value in StreamState:
                state.add_metric([*key, str(value)], 1.0 if stats.state is value else 0.0)
            if stats.last_event_age_s is not None:
                lag.add_metric(key, stats.last_event_age_s)
            entries.add_metric(key, stats.entries)
            for family, (field, _, _) in zip(counters, _STREAM_COUNTERS, strict=True):
                family.add_metric(key, getattr(stats, field))
        yield state
        yield lag
        yield entries
        yield from counters
        yield from self._load_families(empty=empty)
        yield from self._namespace_families(empty=empty)

    def _load_families(self, *, empty: bool) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "kvroute_load_running_requests",
            "Requests the router has in flight per (worker, dp rank); dp_rank is empty for "
            "requests sent without a rank (the engine picks)",
            labels=["worker", "dp_rank"],
        )
        queued = GaugeMetricFamily(
            "kvroute_load_queued_prefill_tokens",
            "Uncached prompt tokens sent but not yet answered (on a pair's prefill worker: not yet "
            "stored), per (worker, dp rank)",
            labels=["worker", "dp_rank"],
        )
        targets = {} if empty else self._load.by_target(self._fleet())
        for (worker, rank), load in sorted(
            targets.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)
        ):
            key = [worker, "" if rank is None else str(rank)]
            running.add_metric(key, load.running)
            queued.add_metric(key, load.queued_prefill_tokens)
        yield running
        yield queued

    def _namespace_families(self, *, empty: bool) -> Iterator[Metric]:
        sizes = [] if empty else [ns.tokens for ns in self._indexer.namespaces()]
        count = GaugeMetricFamily("kvroute_namespaces", "Namespaces the index holds blocks of")
        count.add_metric([], len(sizes))
        yield count
        counts = [0] * (len(NAMESPACE_TOKEN_BUCKETS) + 1)
        for tokens in sizes:
            counts[_bucket(tokens)] += 1
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*NAMESPACE_TOKEN_BUCKETS, None), counts, strict=True):
            running += n
            buckets.append(("+Inf" if bound is None else str(float(bound)), running))
        hist = HistogramMetricFamily(
            "kvroute_namespace_size_tokens",
            "Namespaces by the tokens of their unique indexed blocks (a distribution: the "
            "largest ones by fingerprint are in GET /admin/namespaces)",
        )
        hist.add_metric([], buckets, float(sum(sizes)))
        yield hist


def _bucket(tokens: int) -> int:
    for i, bound in enumerate(NAMESPACE_TOKEN_BUCKETS):
        if tokens <= bound:
            return i
    return len(NAMESPACE_TOKEN_BUCKETS)
