"""Every counter `/admin/streams` shows per stream is a Prometheus series too.

A real `IndexerService` subscribed to a scripted publisher over ZMQ on 127.0.0.1, and the
`FleetCollector` the router registers, read as `/metrics` renders it. Before, the skip counters
(block-size mismatches, skipped events, unknown parents and removes, skipped group blocks) and
the repair ones (probes, refetches, verifications) were only in `/admin/streams`: nothing could
alert on a block-size mismatch, the most common way KV routing silently stops working.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from indexer.config import IndexerConfig
from indexer.protocol.events import Event, EventBatch, Removed, Stored, TokenId
from indexer.service import IndexerService
from indexer.stats import StreamStats
from router.http.fleet_metrics import FleetCollector
from router.routing.load import LoadTracker
from tests.indexer.scripted import ScriptedPublisher
from tests.indexer.test_subscriber_zmq import WORKER, connect

# what a StreamStats row says that is not a count of things that happened
NOT_COUNTERS = {
    "stream",
    "worker",
    "endpoint",
    "replay_endpoint",
    "topic",
    "state",  # kvroute_stream_state
    "last_seq",
    "block_size",
    "last_event_age_s",  # kvroute_stream_lag_seconds
    "entries",  # kvroute_stream_index_entries
    "dp_rank",  # a label
}


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def scrape(svc: IndexerService) -> dict[str, dict[tuple[str, str], float]]:
    """Per sample name, (worker, dp_rank) -> value, as /metrics renders the collector."""
    registry = CollectorRegistry()
    registry.register(FleetCollector(svc, LoadTracker()))
    out: dict[str, dict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if "worker" in s.labels and "state" not in s.labels:
                assert set(s.labels) == {"worker", "dp_rank"}, s  # no salt, no namespace
                key = (s.labels["worker"], s.labels["dp_rank"])
                out.setdefault(s.name, {})[key] = s.value
    return out


async def test_every_stream_counter_of_the_admin_api_is_a_series(
    ctx: zmq.asyncio.Context,
) -> None:
    config = IndexerConfig(replay_timeout_s=0.5, probe_interval_s=0)
    async with ScriptedPublisher(ctx) as pub, IndexerService(config) as svc:
        await connect(svc, pub, block_size=4)
        page: list[TokenId] = list(range(16))
        events: list[Event] = [
            # 16-token pages on a stream of 4: not indexed, KV routing misses
            Stored(block_hashes=[1], parent=None, token_ids=page, block_size=16),
            Stored(block_hashes=[2], parent=77, token_ids=page[:4], block_size=4),
            Removed(block_hashes=[99]),
        ]
        assert await svc.wait_applied(WORKER, await pub.publish(EventBatch(0.0, events)))
        (stats,) = svc.streams()
        assert (stats.block_size_mismatches, stats.unknown_parents, stats.unknown_removes) == (
            1,
            1,
            1,
        )
        samples = scrape(svc)
        row = msgspec.to_builtins(stats)  # what /admin/streams shows
        counters = [f for f in StreamStats.__struct_fields__ if f not in NOT_COUNTERS]
        missing = [f for f in counters if f"kvroute_stream_{f}_total" not in samples]
        assert not missing, missing
        for field in counters:
            got = samples[f"kvroute_stream_{field}_total"][(WORKER, "0")]
            assert got == row[field], (field, got, row[field])
        assert samples["kvroute_stream_block_size_mismatches_total"][(WORKER, "0")] == 1
