"""Acceptance: record a live fleet, replay offline, get the live router's index; republish
into a live indexer, with and without faults, and get the same index again.

The fleet is a scripted SGLang-like publisher: a synthetic recording republished on real
PUB + replay ROUTER sockets (127.0.0.1, ephemeral ports).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench.synthetic_recording import SyntheticWorkload, synthesize_recording
from indexer.config import IndexerConfig, StreamConfig
from indexer.recording.format import RecordingReader, Source
from indexer.recording.replay import RecordFilter, replay_into_index
from indexer.recording.republish import FaultPlan, RepublishConfig, Republisher
from indexer.service import IndexerService
from indexer.snapshot import dump_index
from router.commands.record import record
from tests.recording.snapshots import CountingWriter, canonical

WORKLOAD = SyntheticWorkload(streams=2, tenants=4, conversations=30, capacity_pages=96, seed=5)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rt") / "fleet.kvrec"
    synthesize_recording(path, WORKLOAD)
    return path


def _records(path: Path) -> list[Any]:
    with RecordingReader(path) as reader:
        return [p.record for p in reader.records()]


def _sources(path: Path) -> list[Source]:
    with RecordingReader(path) as reader:
        return list(reader.sources.values())


def _last_seqs(records: list[Any], offset: int = 0) -> dict[str, int]:
    last: dict[str, int] = {}
    for r in records:
        last[r.stream] = r.seq - offset
    return last


async def _publish_into_service(
    path: Path,
    config: RepublishConfig,
    *,
    record_to: Path | None = None,
    restart_at: int = 0,
    settle_to: dict[str, Any] | None = None,
    recorded: dict[str, dict[str, int]] | None = None,
    published: list[Any] | None = None,
) -> tuple[IndexerService, bytes, list[Any]]:
    """Republish `path`; a live IndexerService (and optionally the recorder) consume it.

    The recorder's own per-stream subscriber counters land in `recorded`, what the republisher
    sent (its fault counts) in `published`.
    """
    recorded = {} if recorded is None else recorded
    sources = _sources(path)
    records = _records(path)
    # no idle probe: the fault counts below are about what the live path notices
    settings = IndexerConfig(replay_timeout_s=2.0, probe_interval_s=0)
    async with Republisher(sources, config) as rep, IndexerService(settings) as service:
        for s, pub in zip(sources, rep.streams, strict=True):
            await service.add_worker(
                s.worker,
                [
                    StreamConfig(
                        endpoint=pub.endpoint,
                        replay_endpoint=pub.replay_endpoint,
                        topic="kv",
                        block_size=s.block_size,
                        model=s.model,
                    )
                ],
            )
        recorder: asyncio.Task[Any] | None = None
        writer: CountingWriter | None = None
        stop = asyncio.Event()
        if record_to is not None:
            live_sources = [
                msgspec.structs.replace(s, endpoint=p.endpoint, replay_endpoint=p.replay_endpoint)
                for s, p in zip(sources, rep.streams, strict=True)
            ]
            writer = CountingWriter.create(record_to, live_sources)
            writer.target = len(records) - restart_at * len(sources)
            writer.reached = asyncio.Event()
            recorder = asyncio.create_task(record(writer, live_sources, stop=stop))
        assert await rep.wait_subscribed(10.0, subscribers=2 if recorder else 1)
        sent = await rep.run(records)
        if published is not None:
            published.extend(sent)
        for s in sources:
            stream_last = _last_seqs([r for r in records if r.stream == s.stream], restart_at)
            assert await service.wait_applied(s.worker, stream_last[s.stream], timeout_s=20.0)
        if settle_to is not None:
            # a late (reordered) message can restart a stream after its last seq was applied
            for _ in range(500):
                if canonical(service.dump()) == settle_to:
                    break
                await asyncio.sleep(0.02)
        if recorder is not None and writer is not None:
            # the recorder applies the same messages; wait until its file holds them all
            async with asyncio.timeout(20.0):
                await writer.reached.wait()
            stop.set()
            recorded.update((await recorder).streams)
        return service, service.dump(), service.streams()


async def test_recorded_live_stream_replays_to_the_live_index(
    recording: Path, tmp_path: Path
) -> None:
    recorded = tmp_path / "live.kvrec"
    _, live_dump, stats = await _publish_into_service(
        recording, RepublishConfig(speed=None), record_to=recorded
    )
    summary, index = replay_into_index(recorded)
    assert summary.damage is None and summary.decode_errors == 0
    assert canonical(dump_index(index)) == canonical(live_dump)
    assert canonical(live_dump)  # not trivially empty
    # and the source recording itself replays to the same index
    _, original = replay_into_index(recording)
    assert canonical(dump_index(original)) == canonical(live_dump)
    assert all(s.decode_errors == 0 for s in stats)


async def test_faults_converge_when_the_replay_buffer_covers_the_gaps(recording: Path) -> None:
    seed = random.randrange(1 << 30)
    print("seed", seed)
    faults = FaultPlan(drop=0.05, dup=0.05, seed=seed)
    published: list[Any] = []
    _, live_dump, stats = await _publish_into_service(
        recording, RepublishConfig(speed=None, faults=faults), published=published
    )
    _, expected = replay_into_index(recording)
    assert canonical(live_dump) == canonical(dump_index(expected))
    by_stream = {p.stream: p for p in published}
    assert sum(p.dropped for p in published) > 0 or sum(p.duplicated for p in published) > 0
    for s in stats:
        if by_stream[s.stream].dropped > 1:
            # a drop other than a stream's last batch (which is sent again at the end) is
            # repaired through the replay socket: mid-stream as a gap; one of the stream's first
            # batches by the replay that joins it, which can cover the later drops too and is
            # not counted as a gap (seed 438795423 drops both streams' seq 0)
            assert s.replays > 0, s


async def test_lost_gaps_are_reported_as_clears(recording: Path) -> None:
    faults = FaultPlan(drop=0.3, seed=11)
    _, _, stats = await _publish_into_service(
        recording, RepublishConfig(speed=None, faults=faults, replay_buffer=1)
    )
    assert sum(s.gaps for s in stats) > 0
    assert sum(s.clears for s in stats) > 0  # the buffer could not cover: streams were cleared


async def test_restart_clears_and_rebuilds_from_the_new_seqs(recording: Path) -> None:
    restart_at = 20
    faults = FaultPlan(restart_at=restart_at)
    _, live_dump, stats = await _publish_into_service(
        recording, RepublishConfig(speed=None, faults=faults), restart_at=restart_at
    )
    assert [s.restarts for s in stats] == [1, 1]
    _, expected = replay_into_index(recording, flt=RecordFilter(from_seq=restart_at))
    assert canonical(live_dump) == canonical(dump_index(expected))


async def test_reorder_converges_while_the_buffer_holds_the_whole_stream(recording: Path) -> None:
    _, expected = replay_into_index(recording)
    want = canonical(dump_index(expected))
    # a seed can plan no reorder at all (seed 992601122 draws none in the 120 messages): such a
    # run proves nothing, so another seed is drawn
    for _ in range(5):
        seed = random.randrange(1 << 30)
        print("seed", seed)
        faults = FaultPlan(reorder=0.05, seed=seed)
        published: list[Any] = []
        _, live_dump, stats = await _publish_into_service(
            recording,
            RepublishConfig(speed=None, faults=faults),
            settle_to=want,
            published=published,
        )
        assert canonical(live_dump) == want
        if sum(p.reordered for p in published) > 0:
            break
    assert sum(p.reordered for p in published) > 0
    # a late seq is the live copy of a batch the gap's replay already applied, the same
    # bytes: skipped, never taken for an engine restart (which cleared and rebuilt the stream)
    assert sum(s.restarts for s in stats) == 0


async def test_offline_counts_match_the_recording_subscriber(
    recording: Path, tmp_path: Path
) -> None:
    seed = random.randrange(1 << 30)
    print("seed", seed)
    path = tmp_path / "faulty.kvrec"
    faults = FaultPlan(drop=0.1, dup=0.05, seed=seed)
    live_counts: dict[str, dict[str, int]] = {}
    _, live_dump, _ = await _publish_into_service(
        recording,
        RepublishConfig(speed=None, faults=faults),
        record_to=path,
        recorded=live_counts,
    )
    summary, index = replay_into_index(path)
    assert canonical(dump_index(index)) == canonical(live_dump)
    offline = {s.stream: (s.gaps, s.replays, s.restarts) for s in summary.streams}
    live = {k: (v["gaps"], v["replays"], v["restarts"]) for k, v in live_counts.items()}
    assert offline == live
    assert sum(s.replayed_records for s in summary.streams) > 0
