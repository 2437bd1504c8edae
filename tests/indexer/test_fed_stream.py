"""A stream fed by a relay's records holds the relay's state or a part of it, never more.

Records are handed to the `FedStream` of an `IndexerService(fed=True)` as the relay follower
hands them (pure: no NATS here; tests/router/cluster/test_relay.py runs the real relay). Each
case is a way the follower could end up holding a page the worker no longer holds: records
lost, a new relay process, a snapshot that is not the relay's past, a restart suspected here.
"""

from __future__ import annotations

import logging

import msgspec
import pytest

from indexer.config import IndexerConfig, StreamConfig
from indexer.fed_stream import MISMATCH_REREAD_S, FedStream
from indexer.fence import payload_digest
from indexer.namespace import Namespace
from indexer.protocol.encode import encode_batch
from indexer.protocol.events import Cleared, Event, EventBatch, Stored, TokenId
from indexer.relay_record import RelayKind, RelayRecord
from indexer.service import IndexerService
from indexer.stats import UNTRUSTED, StreamState

NS = Namespace("", None, None)
A: list[TokenId] = [1, 2, 3, 4, 9]  # one 4-token page and a last token
B: list[TokenId] = [5, 6, 7, 8, 9]
STREAM = "w0#dp0"
EPOCH = 7


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(tokens: list[TokenId], block_hash: int) -> bytes:
    events: list[Event] = [
        Stored(block_hashes=[block_hash], parent=None, token_ids=tokens[:4], block_size=4)
    ]
    return encode_batch(EventBatch(0.0, events), "array")


CLEARED = encode_batch(EventBatch(0.0, [Cleared()]), "array")


def batch(rseq: int, seq: int, payload: bytes, epoch: int = EPOCH) -> RelayRecord:
    return RelayRecord(RelayKind.BATCH, STREAM, epoch, rseq, StreamState.SYNCED, seq, payload)


def heartbeat(
    rseq: int, seq: int | None, payload: bytes = b"", epoch: int = EPOCH, checks: int = 0
) -> RelayRecord:
    digest = payload_digest(payload) if payload else b""
    return RelayRecord(
        RelayKind.HEARTBEAT,
        STREAM,
        epoch,
        rseq,
        StreamState.SYNCED,
        seq=seq,
        digest=digest,
        checks=checks,
    )


async def fed(clock: Clock | None = None) -> IndexerService:
    svc = IndexerService(IndexerConfig(stale_after_s=5.0), fed=True, clock=clock or Clock())
    await svc.add_worker("w0", [StreamConfig(endpoint="tcp://127.0.0.1:1", block_size=4)])
    return svc


def take(svc: IndexerService, *records: RelayRecord) -> None:
    assert svc.fed is not None
    for record in records:
        svc.fed.by_stream[STREAM].take(record)


def matched(svc: IndexerService, tokens: list[TokenId]) -> int:
    return svc.query(NS, tokens)["w0"].matched_tokens


def state(svc: IndexerService) -> StreamState:
    return svc.streams()[0].state


async def test_records_in_order_build_the_relays_state() -> None:
    svc = await fed()
    take(svc, batch(0, 0, stored(A, 10)), batch(1, 1, stored(B, 20)))
    assert matched(svc, A) == 4 and matched(svc, B) == 4
    assert state(svc) is StreamState.SYNCED


async def test_a_missed_record_drops_the_stream_which_goes_on_from_the_next() -> None:
    """Record 1 (here: the removal of A's page) never arrived: A must not stay predicted."""
    svc = await fed()
    take(svc, batch(0, 0, stored(A, 10)), batch(2, 2, stored(B, 20)))
    assert matched(svc, A) == 0
    assert matched(svc, B) == 4
    assert svc.streams()[0].gaps == 1


async def test_a_heartbeat_ahead_of_the_records_drops_the_stream() -> None:
    svc = await fed()
    take(svc, batch(0, 0, stored(A, 10)), heartbeat(3, 3))
    assert matched(svc, A) == 0


async def test_a_new_relay_process_drops_the_stream() -> None:
    svc = await fed()
    take(svc, batch(0, 0, stored(A, 10)), batch(0, 5, stored(B, 20), epoch=EPOCH + 1))
    assert matched(svc, A) == 0 and matched(svc, B) == 4
    assert svc.streams()[0].restarts == 1


async def test_a_record_seen_again_is_not_applied_twice() -> None:
    svc = await fed()
    take(svc, batch(0, 0, stored(A, 10)), batch(1, 1, CLEARED), batch(0, 0, stored(A, 10)))
    assert matched(svc, A) == 0


async def _snapshotted(payload_a: bytes) -> IndexerService:
    """A follower whose index was loaded from a snapshot that ended on batch 0 (A stored)."""
    first = await fed()
    take(first, batch(0, 0, payload_a))
    snapshot = first.dump()
    svc = await fed()
    svc.load(snapshot)
    return svc


async def test_a_loaded_snapshot_predicts_nothing_until_the_relay_shows_its_last_batch() -> None:
    payload_a = stored(A, 10)
    svc = await _snapshotted(payload_a)
    assert state(svc) in UNTRUSTED  # unproven (and nothing fresh heard yet)
    assert matched(svc, A) == 0  # held, not trusted
    take(svc, batch(0, 0, payload_a))  # the relay's own batch 0: the snapshot is its past
    assert state(svc) is StreamState.SYNCED
    assert matched(svc, A) == 4
    take(svc, batch(1, 1, CLEARED))
    assert matched(svc, A) == 0


async def test_a_heartbeat_naming_the_snapshots_last_batch_proves_it() -> None:
    payload_a = stored(A, 10)
    svc = await _snapshotted(payload_a)
    take(svc, heartbeat(0, 0, payload_a))
    assert state(svc) is StreamState.SYNCED
    assert matched(svc, A) == 4


@pytest.mark.parametrize(
    "records",
    [
        pytest.param((batch(0, 0, stored(B, 20)),), id="another batch at its seq"),
        pytest.param((batch(4, 4, stored(B, 20)),), id="a later batch"),
        pytest.param((heartbeat(4, 4, stored(B, 20)),), id="a heartbeat past it"),
        pytest.param(
            (
                RelayRecord(RelayKind.CLEAR, STREAM, EPOCH, 3, StreamState.SYNCING),
                heartbeat(3, None),
            ),
            id="a clear, then nothing held",
        ),
    ],
)
async def test_a_snapshot_the_relay_does_not_continue_is_dropped(
    records: tuple[RelayRecord, ...],
) -> None:
    svc = await _snapshotted(stored(A, 10))
    take(svc, *records)
    assert state(svc) is not StreamState.UNVERIFIED
    assert matched(svc, A) == 0
    assert svc.streams()[0].entries <= 1  # A is gone (B's page may have been applied)


async def test_a_restart_suspected_here_waits_for_the_relay_to_check_the_stream() -> None:
    clock = Clock()
    svc = await fed(clock)
    take(svc, batch(0, 0, stored(A, 10)), heartbeat(0, 0, stored(A, 10), checks=2))
    svc.suspect_restart("w0", "its health check came back from down")
    assert state(svc) is StreamState.UNVERIFIED
    take(svc, heartbeat(0, 0, stored(A, 10), checks=2))  # the relay has not checked since
    assert state(svc) is StreamState.UNVERIFIED and matched(svc, A) == 0
    take(svc, heartbeat(0, 0, stored(A, 10), checks=3))  # it proved the stream since
    assert state(svc) is StreamState.SYNCED and matched(svc, A) == 4


async def test_a_restart_the_relay_never_checks_drops_the_stream() -> None:
    clock = Clock()
    svc = await fed(clock)
    take(svc, batch(0, 0, stored(A, 10)))
    svc.suspect_restart("w0", "its health check came back from down")
    clock.now += 11.0  # past the verify window
    take(svc, heartbeat(0, 0, stored(A, 10)))
    assert matched(svc, A) == 0 and svc.streams()[0].entries == 0


def clear(rseq: int) -> RelayRecord:
    return RelayRecord(RelayKind.CLEAR, STREAM, EPOCH, rseq, StreamState.SYNCING)


def restarted(svc: IndexerService, down_age_s: float) -> None:
    """This replica's health check saw the worker come back, `down_age_s` after it last
    found it down."""
    svc.suspect_restart("w0", "its health check came back from down", down_age_s=down_age_s)


@pytest.mark.parametrize("read_back", [False, True], ids=["live", "read back"])
async def test_a_stream_the_relay_made_anew_since_the_worker_went_down_is_not_suspected(
    read_back: bool,
) -> None:
    """The relay registered the worker anew (a restart with more ranks: it cleared the
    stream and followed the new process) before this replica's health check saw the worker
    come back: nothing is left for the relay to check. Before, the stream was UNVERIFIED and
    dropped 10 s later (0 predicted against what the worker had cached)."""
    clock = Clock()
    svc = await fed(clock)
    stream = svc.fed.by_stream[STREAM] if svc.fed is not None else None
    assert stream is not None
    stream.take(batch(0, 0, stored(A, 10)))  # the old process's page
    clock.now += 1.0  # 101: a health check here finds the worker down
    clock.now += 2.0  # 103: the relay has it back and registered anew
    records = [clear(1), batch(2, 0, stored(B, 20))]
    if read_back:
        # a replica that registered the worker anew too reads its stream back: the records
        # are the relay's past, but their ages are known
        stream = await _followed_anew(svc)
        clock.now += 0.5
        for record in [batch(0, 0, stored(A, 10)), *records]:
            stream.take(record, age_s=0.5)
    else:
        for record in records:
            stream.take(record)
    clock.now += 1.0  # 104: the health check here sees it back
    restarted(svc, down_age_s=3.0 + (0.5 if read_back else 0.0))
    assert state(svc) is StreamState.SYNCED
    assert matched(svc, B) == 4 and matched(svc, A) == 0
    clock.now += 11.0  # past the verify window: nothing dropped
    stream.take(heartbeat(2, 0, stored(B, 20)))
    assert state(svc) is StreamState.SYNCED and matched(svc, B) == 4


async def _followed_anew(svc: IndexerService) -> FedStream:
    """The replica registers `w0` anew (its settings changed): a new stream, empty."""
    await svc.add_worker("w0", [StreamConfig(endpoint="tcp://127.0.0.1:1", block_size=4)])
    assert svc.fed is not None
    return svc.fed.by_stream[STREAM]


@pytest.mark.parametrize(
    ("records", "ages"),
    [
        pytest.param((), (), id="nothing since"),
        pytest.param((clear(1), batch(2, 0, stored(A, 10))), (3.5, 3.5), id="cleared before"),
        pytest.param(
            (clear(1), batch(2, 0, stored(A, 10))), (2.8, 2.8), id="cleared within the margin"
        ),
        pytest.param((clear(1), batch(2, 0, stored(A, 10))), (None, None), id="age unknown"),
    ],
)
async def test_a_restart_suspected_where_the_relay_made_nothing_anew_since_stays_fail_closed(
    records: tuple[RelayRecord, ...], ages: tuple[float | None, ...]
) -> None:
    """The worker restarted quickly and the relay may not have noticed: what the stream holds
    may be the dead process's. Records the relay wrote before the worker was last seen down
    here (or too close to it to tell, or of unknown age) prove nothing: UNVERIFIED, dropped
    after the verify window unless the relay checks it."""
    clock = Clock()
    svc = await fed(clock)
    assert svc.fed is not None
    stream = svc.fed.by_stream[STREAM]
    stream.take(batch(0, 0, stored(A, 10)))
    clock.now += 4.0  # 104: back; last seen down at 101
    for record, age in zip(records, ages, strict=True):
        stream.take(record, age_s=age)
    restarted(svc, down_age_s=3.0)
    assert state(svc) is StreamState.UNVERIFIED and matched(svc, A) == 0
    clock.now += 11.0
    stream.take(heartbeat(len(records), 0, stored(A, 10)))
    assert matched(svc, A) == 0 and svc.streams()[0].entries == 0


async def test_a_suspected_restart_ends_at_a_clear_written_after_it_not_one_read_late() -> None:
    """A clear read back from the relay's past (age unknown) says nothing of the restart; one
    written after the worker was seen down leaves nothing older to prove."""
    clock = Clock()
    svc = await fed(clock)
    assert svc.fed is not None
    stream = svc.fed.by_stream[STREAM]
    stream.take(batch(0, 0, stored(A, 10)))
    clock.now += 4.0
    restarted(svc, down_age_s=2.0)
    stream.take(clear(1), age_s=None)
    stream.take(batch(2, 1, stored(A, 10)), age_s=None)
    assert state(svc) is StreamState.UNVERIFIED and matched(svc, A) == 0
    clock.now += 1.0
    stream.take(clear(3))
    stream.take(batch(4, 0, stored(B, 20)))
    assert state(svc) is StreamState.SYNCED and matched(svc, B) == 4


async def test_a_silent_relay_makes_the_stream_stale() -> None:
    clock = Clock()
    svc = await fed(clock)
    take(svc, batch(0, 0, stored(A, 10)))
    clock.now += 4.0
    take(svc, heartbeat(0, 0, stored(A, 10)))
    clock.now += 4.0
    assert state(svc) is StreamState.SYNCED  # heard 4 s ago
    clock.now += 2.0
    assert state(svc) is StreamState.STALE
    assert matched(svc, A) == 0


async def test_a_stream_the_relay_no_longer_hears_is_stale_here_too() -> None:
    svc = await fed()
    take(svc, batch(0, 0, stored(A, 10)))
    stale = RelayRecord(RelayKind.HEARTBEAT, STREAM, EPOCH, 0, StreamState.STALE, seq=0)
    take(svc, stale)
    assert state(svc) is StreamState.STALE
    assert matched(svc, A) == 0


async def test_a_new_relay_process_ends_a_restart_suspected_here() -> None:
    """The new relay's records, written after the suspicion, are a stream started afresh:
    nothing is left to prove (its count of checks starts over and could never pass the old
    relay's)."""
    clock = Clock()
    svc = await fed(clock)
    take(svc, batch(0, 0, stored(A, 10)), heartbeat(0, 0, stored(A, 10), checks=5))
    svc.suspect_restart("w0", "its health check came back from down")
    clock.now += 1.0
    take(svc, batch(0, 3, stored(B, 20), epoch=EPOCH + 1))
    assert state(svc) is StreamState.SYNCED
    assert matched(svc, A) == 0 and matched(svc, B) == 4


async def test_records_read_from_the_relays_past_do_not_make_the_stream_fresh() -> None:
    """Read back from the stream (a replica starting after the relay died): they build the
    state, but only a record arriving as it is written says the relay is alive now."""
    clock = Clock()
    svc = IndexerService(IndexerConfig(), fed=True, clock=clock, fed_silent_after_s=3.0)
    await svc.add_worker("w0", [StreamConfig(endpoint="tcp://127.0.0.1:1", block_size=4)])
    assert svc.fed is not None
    stream = svc.fed.by_stream[STREAM]
    clock.now += 5.0  # the replica started a while ago
    stream.take(batch(0, 0, stored(A, 10)), age_s=None)
    stream.take(heartbeat(0, 0, stored(A, 10)), age_s=None)
    assert state(svc) is StreamState.STALE  # the relay may be long gone
    assert matched(svc, A) == 0
    stream.take(heartbeat(0, 0, stored(A, 10)), age_s=0.0)
    assert state(svc) is StreamState.SYNCED
    assert matched(svc, A) == 4


async def test_a_snapshot_stream_a_worker_takes_up_later_waits_for_its_proof() -> None:
    """A snapshot loaded before the worker was followed keeps its stream for it: when the
    worker is added, the stream holds entries nothing has proven yet."""
    payload_a = stored(A, 10)
    first = await fed()
    take(first, batch(0, 0, payload_a))
    snapshot = first.dump()
    svc = IndexerService(IndexerConfig(stale_after_s=5.0), fed=True, clock=Clock())
    svc.load(snapshot)  # no worker yet: kept for it
    await svc.add_worker("w0", [StreamConfig(endpoint="tcp://127.0.0.1:1", block_size=4)])
    assert state(svc) in UNTRUSTED
    assert matched(svc, A) == 0
    take(svc, heartbeat(3, None))  # the relay holds nothing of it now (the worker restarted)
    assert matched(svc, A) == 0 and svc.streams()[0].entries == 0


async def test_records_older_than_the_snapshot_wait_for_its_last_batch() -> None:
    """The follower reads from a little before the snapshot: the relay's older batches,
    heartbeats and clears come first and are skipped, and the snapshot's last batch (here in
    a heartbeat) still proves it."""
    payload_a = stored(A, 10)
    svc = await _snapshotted(payload_a)
    take(
        svc,
        RelayRecord(RelayKind.CLEAR, STREAM, EPOCH, 0, StreamState.SYNCING),
        heartbeat(0, None),
        batch(1, 0, payload_a),  # the snapshot's last batch, after the clear
    )
    assert state(svc) is StreamState.SYNCED and matched(svc, A) == 4


def _other_snapshot() -> bytes:
    """A snapshot of another history than the relay's below: it ends on batch 1 (C stored)."""
    return stored([11, 12, 13, 14, 9], 30)


async def _loaded_from_elsewhere() -> IndexerService:
    first = await fed()
    take(first, batch(0, 0, stored(A, 10)), batch(1, 1, _other_snapshot()))
    snapshot = first.dump()
    svc = await fed()
    svc.load(snapshot)
    return svc


@pytest.mark.parametrize("fails_at", ["a batch", "a heartbeat"])
async def test_what_the_relay_stored_before_a_failed_proof_is_predicted(fails_at: str) -> None:
    """A snapshot that is not the relay's past, loaded into a running follower: the records
    read from before its last seq are skipped while it waits for its proof; when the proof
    fails, they are applied (they run unbroken to the failing record). Before, the stream
    joined at the failing record only: B, stored before it, was predicted nothing until the
    worker stored it again (QA)."""
    svc = await _loaded_from_elsewhere()
    take(svc, batch(0, 0, stored(B, 20)))  # older than the snapshot's last seq: skipped
    assert state(svc) is StreamState.UNVERIFIED
    if fails_at == "a batch":
        take(svc, batch(1, 1, stored(A, 10)))  # its seq 1 is not the snapshot's
        assert matched(svc, A) == 4
    else:
        take(svc, heartbeat(0, 0, stored(B, 20)))  # older: waits on
        assert state(svc) is StreamState.UNVERIFIED
        take(svc, heartbeat(0, 5, stored(B, 20)))  # the relay is past the snapshot
    assert state(svc) is StreamState.SYNCED
    assert matched(svc, B) == 4
    assert matched(svc, [11, 12, 13, 14, 9]) == 0  # the snapshot's own: gone


async def test_skipped_records_with_a_hole_are_not_applied_after_a_failed_proof() -> None:
    """The skipped records do not run unbroken to the failing one (a record lost between):
    the stream joins at the failing record, holding nothing older."""
    svc = await _loaded_from_elsewhere()
    take(svc, batch(0, 0, stored(B, 20)))
    take(svc, batch(2, 1, stored(A, 10)))  # record 1 never came
    assert matched(svc, B) == 0
    assert matched(svc, A) == 4


async def test_an_older_heartbeat_does_not_refuse_the_snapshot() -> None:
    payload_a = stored(A, 10)
    first = await fed()
    take(first, batch(0, 0, stored(B, 20)), batch(1, 1, payload_a))
    snapshot = first.dump()  # ends on seq 1
    svc = await fed()
    svc.load(snapshot)
    take(svc, heartbeat(0, 0, stored(B, 20)))  # written before the snapshot
    assert state(svc) is StreamState.UNVERIFIED
    take(svc, heartbeat(1, 1, payload_a))
    assert state(svc) is StreamState.SYNCED and matched(svc, A) == 4


async def test_a_snapshot_not_proven_in_time_is_dropped() -> None:
    clock = Clock()
    payload_a = stored(A, 10)
    first = await fed()
    take(first, batch(0, 0, stored(B, 20)), batch(1, 1, payload_a))
    snapshot = first.dump()
    svc = await fed(clock)
    svc.load(snapshot)
    clock.now += 11.0
    take(svc, heartbeat(0, 0, stored(B, 20)))
    assert matched(svc, A) == 0 and svc.streams()[0].entries == 0


async def test_a_relay_says_stale_of_a_stream_it_has_not_heard_for_longer_than_its_probes() -> None:
    """A relay whose loop stalled (stopped, swapped out) must not vouch for its streams in the
    first heartbeat after it wakes, before it took what queued meanwhile: a stream not heard
    for longer than two probes and a replay's timeout is STALE in its heartbeats."""
    clock = Clock()
    config = IndexerConfig(probe_interval_s=2.0, replay_timeout_s=1.0)
    async with IndexerService(config, clock=clock) as svc:
        await svc.add_worker("w0", [StreamConfig(endpoint="tcp://127.0.0.1:9", block_size=4)])
        clock.now += 4.0
        assert [h.state for h in svc.stream_heads()] != [StreamState.STALE]
        clock.now += 2.0  # 6 s unheard: more than 2 x 2 + 1
        assert [h.state for h in svc.stream_heads()] == [StreamState.STALE]


def told(svc: IndexerService) -> list[str]:
    """The workers the stream's restarts and mismatches are told of (the router's listener)."""
    workers: list[str] = []
    svc.restart_listeners.append(workers.append)
    return workers


def restarts(rseq: int, count: int, epoch: int = EPOCH) -> RelayRecord:
    """A heartbeat saying the relay counted `count` restarts of the stream's publisher."""
    return msgspec.structs.replace(heartbeat(rseq, None, epoch=epoch), restarts=count)


async def test_a_restart_the_relay_counts_has_the_workers_settings_read_again() -> None:
    """A new process with another page size, ranks or role: the router re-reads it as it does
    for a restart its own subscriber sees. Before, nothing reached it (60 s of the old page
    size: every prediction 0)."""
    svc = await fed()
    workers = told(svc)
    take(svc, batch(0, 0, stored(A, 10)), restarts(0, 0))
    assert workers == []  # the count it joined at: no restart seen
    take(svc, restarts(0, 1))
    assert workers == ["w0"]
    take(svc, restarts(0, 1), restarts(0, 2, epoch=EPOCH + 1))
    assert workers == ["w0"]  # the same count; another relay process's count of its own


async def test_restarts_the_relay_counted_before_the_stream_was_followed_are_not_told() -> None:
    """Read back from the relay's stream (the worker registered anew here: its restart is
    what registered it), or of unknown age: the registration's past."""
    clock = Clock()
    svc = await fed(clock)
    workers = told(svc)
    assert svc.fed is not None
    stream = svc.fed.by_stream[STREAM]
    clock.now += 5.0
    stream.take(restarts(-1, 0), age_s=8.0)
    stream.take(restarts(-1, 1), age_s=6.0)
    stream.take(restarts(-1, 2), age_s=None)
    assert workers == []
    stream.take(restarts(-1, 3), age_s=0.1)
    assert workers == ["w0"]


def stored8(tokens: list[TokenId], block_hash: int) -> bytes:
    """A page of 8 tokens: a worker restarted with page size 8."""
    events: list[Event] = [
        Stored(block_hashes=[block_hash], parent=None, token_ids=tokens, block_size=8)
    ]
    return encode_batch(EventBatch(0.0, events), "array")


async def test_pages_of_another_size_are_said_and_have_the_settings_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay's restart count may not say it (a relay of the version before, a heartbeat
    lost): pages that do not fit tell, at most every MISMATCH_REREAD_S, and are said as a
    subscriber says them. Before, the stream said `synced`, with nothing in the log."""
    clock = Clock()
    svc = await fed(clock)
    workers = told(svc)
    page: list[TokenId] = [1, 2, 3, 4, 5, 6, 7, 8]
    with caplog.at_level(logging.WARNING, logger="indexer.fed_stream"):
        take(svc, batch(0, 0, stored8(page, 10)), batch(1, 1, stored8(page, 11)))
    assert workers == ["w0"]
    assert svc.streams()[0].block_size_mismatches == 2
    said = [r.getMessage() for r in caplog.records if "BLOCK SIZE MISMATCH" in r.getMessage()]
    assert len(said) == 1 and "block size 4" in said[0]
    clock.now += MISMATCH_REREAD_S
    take(svc, batch(2, 2, stored8(page, 12)))
    assert workers == ["w0", "w0"]


async def test_pages_of_another_size_read_back_from_before_are_not_counted_as_mismatches(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Records the relay wrote before the stream was followed (read back after the worker was
    registered anew with another page size, or of unknown age) are the old process's: skipped,
    not said, not counted where alerts look. Before, each re-registration counted them again:
    QA saw 97 `block_size_mismatches` on a stream that never logged one."""
    clock = Clock()
    svc = await fed(clock)
    workers = told(svc)
    assert svc.fed is not None
    stream = svc.fed.by_stream[STREAM]
    page: list[TokenId] = [1, 2, 3, 4, 5, 6, 7, 8]
    clock.now += 5.0
    with caplog.at_level(logging.WARNING, logger="indexer.fed_stream"):
        stream.take(batch(0, 0, stored8(page, 10)), age_s=8.0)
        stream.take(batch(1, 1, stored8(page, 11)), age_s=None)
        assert workers == [] and not caplog.records
        stats = svc.streams()[0]
        assert (stats.block_size_mismatches, stats.skipped_events) == (0, 2)
        stream.take(batch(2, 2, stored8(page, 12)), age_s=0.1)  # live: a real mismatch
    assert workers == ["w0"]
    said = [r.getMessage() for r in caplog.records if "BLOCK SIZE MISMATCH" in r.getMessage()]
    assert len(said) == 1
    stats = svc.streams()[0]
    assert (stats.block_size_mismatches, stats.skipped_events) == (1, 2)


async def test_a_stream_read_back_from_the_relays_records_predicts_none_of_that_past() -> None:
    """The follower reads a stream's stored records back (a worker followed after the relay
    wrote them, or registered anew): a page stored early in them and removed later is held
    until its removal is read, and each record says `synced`, the relay's state when written.
    Until the read-back is over the stream predicts nothing (before: A's page, which the worker
    had evicted, was predicted while the records were read)."""
    svc = await fed()
    assert svc.fed is not None
    stream = svc.fed.by_stream[STREAM]
    stream.catching_up(True)
    take(svc, batch(0, 0, stored(A, 10)), batch(1, 1, stored(B, 20)))
    assert (matched(svc, A), matched(svc, B)) == (0, 0)
    assert state(svc) is StreamState.SYNCING and state(svc) in UNTRUSTED
    take(svc, batch(2, 2, CLEARED), batch(3, 3, stored(B, 21)))
    stream.catching_up(False)  # read to the end, and what came meanwhile applied
    assert state(svc) is StreamState.SYNCED
    assert (matched(svc, A), matched(svc, B)) == (0, 4)
    # a stream the relay itself is repairing stays so when the read-back ends meanwhile
    stream.catching_up(True)
    take(svc, msgspec.structs.replace(batch(4, 4, stored(A, 11)), state=StreamState.DEGRADED))
    assert state(svc) is StreamState.DEGRADED
    stream.catching_up(False)
    assert state(svc) is StreamState.DEGRADED and matched(svc, A) == 0


# a relay that says its presence every 0.25 s (its followers take it for gone after 0.75 s)
PRESENT_S = 0.25


def said(record: RelayRecord, presence_n: int) -> RelayRecord:
    """`record` as a relay that says its presence writes it, after `presence_n` of them."""
    return msgspec.structs.replace(record, presence_s=PRESENT_S, presence_n=presence_n)


async def _present() -> tuple[IndexerService, FedStream, Clock]:
    """A fed stream of a relay heard alive (its presence 0 heard), holding A, trusted."""
    clock = Clock()
    svc = await fed(clock)
    assert svc.fed is not None
    stream = svc.fed.by_stream[STREAM]
    svc.fed.relays.heard(EPOCH, 0, now=clock.now, until=clock.now + 3 * PRESENT_S)
    stream.take(said(batch(0, 0, stored(A, 10)), 1))
    assert state(svc) is StreamState.SYNCED and matched(svc, A) == 4
    return svc, stream, clock


async def test_a_stream_predicts_nothing_at_once_when_this_replica_loses_nats() -> None:
    """Nothing the relay writes can reach the replica: as a subscriber whose socket dropped,
    not after the relay's silence (`stale_after_s`). Before, it stayed SYNCED for 3 s (QA: 8
    false hits of 34 answers over 0.74 s after the replica said it lost NATS)."""
    svc, stream, clock = await _present()
    assert svc.fed is not None
    svc.fed.relays.forget()
    assert stream.relay_lost()
    assert state(svc) is StreamState.STALE and matched(svc, A) == 0
    # back: records read again before the relay is heard, fresh or not, trust nothing
    clock.now += 5.0
    stream.take(said(heartbeat(0, 0, stored(A, 10)), 4), age_s=0.0)
    assert state(svc) is StreamState.STALE
    # heard again (presence 9): a record written before that presence proves nothing, one
    # written after it comes after everything of the stream the relay wrote before
    svc.fed.relays.heard(EPOCH, 9, now=clock.now, until=clock.now + 3 * PRESENT_S)
    stream.take(said(heartbeat(0, 0, stored(A, 10)), 9), age_s=0.0)
    assert state(svc) is StreamState.STALE
    stream.take(said(heartbeat(0, 0, stored(A, 10)), 10), age_s=0.0)
    assert state(svc) is StreamState.SYNCED and matched(svc, A) == 4


async def test_records_of_a_relay_no_longer_heard_trust_nothing_by_their_age() -> None:
    """The relay died: its last records, read back (the false-hit watch reading the stream
    anew) with ages under `stale_after_s`, are its past, not now. Before, they restored the
    prompts the worker had flushed since (QA: a second round of false hits)."""
    svc, stream, clock = await _present()
    assert svc.fed is not None
    clock.now += 1.0  # the presence ran out: the follower forgets the relay
    svc.fed.relays.forget(EPOCH)
    assert stream.relay_lost(EPOCH)
    stream.take(said(heartbeat(0, 0, stored(A, 10)), 5), age_s=0.5)
    assert state(svc) is StreamState.STALE and matched(svc, A) == 0


async def test_another_relay_gone_leaves_the_stream_trusted() -> None:
    svc, stream, _ = await _present()
    assert not stream.relay_lost(EPOCH + 1)  # not the relay whose records it took
    assert state(svc) is StreamState.SYNCED


async def test_a_relay_that_says_no_presence_is_trusted_again_at_its_next_fresh_record() -> None:
    """A relay of the version before writes `presence_s` 0: its records' ages alone tell, as
    before, but a replica that lost NATS still predicts nothing until one comes."""
    clock = Clock()
    svc = await fed(clock)
    stream = svc.fed.by_stream[STREAM] if svc.fed is not None else None
    assert stream is not None
    take(svc, batch(0, 0, stored(A, 10)))
    assert state(svc) is StreamState.SYNCED
    stream.relay_lost()
    assert state(svc) is StreamState.STALE
    stream.take(heartbeat(0, 0, stored(A, 10)), age_s=None)  # read back: of no known age
    assert state(svc) is StreamState.STALE
    stream.take(heartbeat(0, 0, stored(A, 10)), age_s=0.1)
    assert state(svc) is StreamState.SYNCED and matched(svc, A) == 4
