"""A fed stream takes the relay's records only while they name the endpoint its worker publishes.

A relay's records name their stream by worker id and rank; the id may name another server on a
replica than on the relay (re-pointed through one side's admin API). Each record says the
KV-event endpoint the relay reads (`RelayRecord.source`): a stream of a worker that publishes
elsewhere takes none of them (pure: tests/router/cluster/test_relay_sources.py runs the real
relay and workers).
"""

from __future__ import annotations

import logging

import msgspec
import pytest

from indexer.relay_record import RelayRecord
from indexer.service import IndexerService
from indexer.stats import StreamState
from tests.indexer.test_fed_stream import STREAM, A, B, batch, fed, heartbeat, matched, stored

HERE = "tcp://127.0.0.1:1"  # the endpoint the stream's worker publishes at (`fed`)
ELSEWHERE = "tcp://127.0.0.1:2"


def reading(record: RelayRecord, source: str) -> RelayRecord:
    """`record` as a relay whose subscriber of the stream reads `source` writes it."""
    return msgspec.structs.replace(record, source=source)


def state(svc: IndexerService) -> StreamState:
    return svc.streams()[0].state


def take(svc: IndexerService, *records: RelayRecord) -> None:
    assert svc.fed is not None
    for record in records:
        svc.fed.by_stream[STREAM].take(record)


async def test_records_of_another_servers_endpoint_are_not_taken_until_they_agree_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay reads w0 at another server's socket than this replica's w0 (QA: an id
    re-pointed on the replicas alone): its pages are that server's. Before, they were taken by
    the id and predicted (320 tokens, 0 cached)."""
    svc = await fed()
    take(svc, reading(batch(0, 0, stored(A, 10)), HERE))
    assert matched(svc, A) == 4 and state(svc) is StreamState.SYNCED
    with caplog.at_level(logging.WARNING, logger="indexer.fed_stream"):
        take(
            svc,
            reading(batch(1, 1, stored(B, 20)), ELSEWHERE),
            reading(heartbeat(1, 1), ELSEWHERE),
            reading(heartbeat(1, 1), ELSEWHERE),
        )
    assert (matched(svc, A), matched(svc, B)) == (0, 0)  # what it held goes too
    assert state(svc) is StreamState.STALE
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1, said  # one line, naming the worker and both endpoints
    assert "worker w0" in said[0] and ELSEWHERE in said[0] and HERE in said[0]
    # the relay reads this replica's worker again (re-pointed there too): joined afresh
    take(svc, reading(batch(0, 0, stored(B, 21)), HERE))
    assert state(svc) is StreamState.SYNCED and matched(svc, B) == 4
    take(svc, reading(batch(1, 1, stored(A, 11)), HERE))
    assert matched(svc, A) == 4


async def test_one_endpoint_spelled_otherwise_is_taken() -> None:
    """`localhost` and `127.0.0.1` are one host: a relay configured with the one and a replica
    with the other follow one socket."""
    svc = await fed()
    take(svc, reading(batch(0, 0, stored(A, 10)), "tcp://localhost:1"))
    assert state(svc) is StreamState.SYNCED and matched(svc, A) == 4


async def test_a_relay_that_names_no_endpoint_is_taken_by_the_stream_id() -> None:
    """A relay of the version before says no `source`: its records are taken as they were."""
    svc = await fed()
    take(svc, batch(0, 0, stored(A, 10)))
    assert state(svc) is StreamState.SYNCED and matched(svc, A) == 4


async def test_records_of_another_endpoint_read_back_are_said_only_once_live(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Read back, such records may be the stream's past only (the relay re-pointed since):
    not taken, and not said until one comes live."""
    svc = await fed()
    assert svc.fed is not None
    stream = svc.fed.by_stream[STREAM]
    stream.catching_up(True)
    with caplog.at_level(logging.WARNING, logger="indexer.fed_stream"):
        take(svc, reading(batch(0, 0, stored(A, 10)), ELSEWHERE))
        assert not caplog.records
        take(svc, reading(batch(1, 1, stored(B, 20)), HERE))
        stream.catching_up(False)
        assert not caplog.records
    assert (matched(svc, A), matched(svc, B)) == (0, 4)
