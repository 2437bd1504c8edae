"""Offline replay: a recording decoded and applied into an in-memory index, as fast as possible.

The recorder writes what the live subscriber accepted, in the order it applied it (replayed
gap-repair batches included, flagged). Replaying therefore walks the same per-stream sequence
decisions the live subscriber made: consecutive seqs apply; a jump that no replay filled was an
unrepairable gap (the live subscriber cleared the stream, then went on); a decrease was an engine
restart (cleared); a repeat is a duplicate (skipped). Clears the seqs do not show (a proof that
failed with the seqs continuous) are marked in the file (`RecordMark`, version 3) and applied
where they were decided. The resulting index is the one the live router held, which is what
operators debugging an incident, and the round-trip test, compare.

A window that starts after a stream's first record (`--from`) holds only part of its state: the
index keeps no seq and no fence for it, so a router loading a dump of it rebuilds the stream
from the worker instead of proving a fence over entries it never had. A time window seeks past
damage that lies before it; the records between the damage and the window are then unknown, so
every stream is partial, and the damage is reported (`ReplaySummary.damage_before_window`).

Also here: `synthesize_recording`, a realistic recording from a scripted SGLang-like fleet, so
the index benchmark and the tests have a stream to replay without a capture at hand.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from indexer.engines import ENGINES
from indexer.errors import ProtocolError
from indexer.fingerprint import Fingerprinter, salt_fingerprint
from indexer.index import PrefixIndex
from indexer.protocol.decode import decode_batch
from indexer.protocol.events import Cleared, EventBatch, Removed, Stored, Unreadable
from indexer.recording.format import (
    Damage,
    Positioned,
    Record,
    RecordingError,
    RecordingReader,
    RecordMark,
    Source,
)
from indexer.sequence import SequenceTracker, SeqVerdict

__all__ = [
    "NamespaceReplay",
    "RecordFilter",
    "ReplaySummary",
    "StreamReplay",
    "before_window",
    "parse_window",
    "replay_into_index",
    "select_records",
    "streams_of",
]


class RecordFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which records to replay: a receive-time window, a per-stream seq window, some streams."""

    from_time: float | None = None
    to_time: float | None = None
    from_seq: int | None = None
    to_seq: int | None = None
    streams: frozenset[str] | None = None


def select_records(
    reader: RecordingReader,
    flt: RecordFilter,
    *,
    marks: bool = False,
    cut: set[str] | None = None,
) -> Iterator[Positioned]:
    """Records of `reader` passing `flt`, in file order (time windows seek, never scan).

    Messages only, unless `marks` (`RecordingReader.records`). `cut` collects the streams
    that have a record before the window's `from_seq` (their state is not whole in it)."""
    for positioned in reader.records(from_time=flt.from_time, marks=marks):
        record = positioned.record
        if flt.to_time is not None and record.recv_time > flt.to_time:
            return  # receive times never decrease in a recording
        if flt.streams is not None and record.stream not in flt.streams:
            continue
        if flt.from_seq is not None and record.seq < flt.from_seq:
            if cut is not None and not record.mark:
                cut.add(record.stream)
            continue
        if flt.to_seq is not None and record.seq > flt.to_seq:
            continue
        yield positioned


def parse_window(reader: RecordingReader, start: str | None, end: str | None) -> RecordFilter:
    """Turn `--from/--to` (and nothing else) into a filter; ValueError names the bad bound."""
    first: float | None = None
    bounds: dict[str, float | int] = {}
    for name, text in (("from", start), ("to", end)):
        if text is None:
            continue
        text = text.strip()
        if text.startswith("seq:"):
            try:
                bounds[f"{name}_seq"] = int(text[4:])
            except ValueError:
                raise ValueError(f"--{name} {text!r}: seq:N needs an integer") from None
            continue
        if text.startswith("+") or text.endswith("s") or _is_number(text):
            try:
                offset = float(text.lstrip("+").rstrip("s"))
            except ValueError:
                offset = math.nan
            if not math.isfinite(offset):  # nan would select everything, silently
                raise ValueError(f"--{name} {text!r}: not a number of seconds")
            if first is None:
                first = _first_time(reader)
            bounds[f"{name}_time"] = first + offset
            continue
        try:
            when = datetime.datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(
                f"--{name} {text!r}: expected +SECONDS, SECONDSs, an ISO 8601 time or seq:N"
            ) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        bounds[f"{name}_time"] = when.timestamp()
    for kind in ("time", "seq"):
        low, high = bounds.get(f"from_{kind}"), bounds.get(f"to_{kind}")
        if low is not None and high is not None and low > high:
            raise ValueError(f"--from {start!r} is after --to {end!r}: the window is empty")
    return msgspec.convert(bounds, RecordFilter)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _first_time(reader: RecordingReader) -> float:
    for positioned in reader.records():
        return positioned.record.recv_time
    return 0.0


def streams_of(reader: RecordingReader, flt: RecordFilter) -> list[Source]:
    """Every stream the selected records hold, sorted by stream id (one pass, no decoding).

    The order `kvroute record inspect` lists them in, which `kvroute replay --publish` binds
    ports in (stream i: PUB port + i): in first-record order, the port of a stream hung on
    which worker happened to publish first during the capture."""
    seen: set[str] = set()
    for positioned in select_records(reader, flt):
        seen.add(positioned.record.stream)
    return [reader.sources.get(s) or Source(stream=s) for s in sorted(seen)]


class StreamReplay(msgspec.Struct, kw_only=True):
    """What one stream's records did to the index."""

    stream: str
    records: int = 0
    replayed_records: int = 0
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0  # AllBlocksCleared events
    gaps: int = 0  # missing seqs noticed (each repaired by a replay run, or lost)
    replays: int = 0  # gap repairs (runs of replayed records)
    lost_gaps: int = 0  # gaps no replay covered: the stream was cleared and rebuilt
    restarts: int = 0
    duplicates: int = 0
    decode_errors: int = 0
    refetches: int = 0  # live batches that did not decode, fetched again by replay
    lost_batches: int = 0  # batches that decoded neither live nor replayed: stream cleared
    marked_clears: int = 0  # clears the recorder's subscriber marked in the file (version 3)
    # the window starts after the stream's first record: its state is a part, so the index
    # keeps no seq and no fence for it (a router loading a dump rebuilds it from the worker)
    partial: bool = False
    skipped_events: int = 0
    unknown_parents: int = 0
    block_size_mismatches: int = 0
    block_size: int | None = None
    first_seq: int | None = None
    last_seq: int | None = None
    entries: int = 0  # blocks the stream holds in the final index


class NamespaceReplay(msgspec.Struct, kw_only=True):
    """One namespace of the final index; the salt only as a fingerprint."""

    model: str
    lora: str | None
    salt: str  # fingerprint, "-" when unsalted
    namespace: str = ""  # the id /admin/namespaces shows under the same fingerprint key
    blocks: int
    tokens: int
    holders: dict[str, int]


class ReplaySummary(msgspec.Struct, kw_only=True):
    """The outcome of one offline replay (`kvroute replay --into index`)."""

    path: str
    records: int = 0
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    decode_errors: int = 0
    first_time: float | None = None
    last_time: float | None = None
    elapsed_s: float = 0.0
    block_ops_per_s: float = 0.0
    index_entries: int = 0
    streams: list[StreamReplay] = []
    namespaces: list[NamespaceReplay] = []
    damage: Damage | None = None  # where reading stopped, inside the window
    # damage before the window's start that its time seek read past: what the file held from
    # there to the window is unknown (any stream may have had records in it), so every stream
    # the window holds is partial
    damage_before_window: Damage | None = None

    @property
    def damaged(self) -> bool:
        """Damage stopped the replay or lies before its window: not all it asked for was read."""
        return self.damage is not None or self.damage_before_window is not None


class _StreamState:
    """Per-stream replay state: the live subscriber's tracker plus where a repair run is."""

    __slots__ = ("in_replay", "joined", "marked", "refetch", "tracker")

    def __init__(self, marked: bool) -> None:
        self.tracker = SequenceTracker()
        # the file marks where each counted replay run begins (`Record.run_start`, version 2):
        # a run is counted there and only there; a version-1 file's runs are guessed
        self.marked = marked
        self.in_replay = False
        self.joined = False  # the first record is a join: never a gap (as live)
        # a live batch that did not decode: the subscriber fetched it again through the
        # replay, so its replayed copy is what comes next (or it was lost)
        self.refetch: int | None = None


def _count_batch(stats: StreamReplay, batch: EventBatch) -> int:
    stats.batches += 1
    stats.events += len(batch.events)
    stats.skipped_events += batch.skipped
    ops = 0
    for event in batch.events:
        if isinstance(event, Stored):
            stats.blocks_stored += len(event.block_hashes)
            ops += len(event.block_hashes)
        elif isinstance(event, Removed):
            stats.blocks_removed += len(event.block_hashes)
            ops += len(event.block_hashes)
        elif isinstance(event, Cleared):
            stats.clears += 1
        elif isinstance(event, Unreadable):
            stats.skipped_events += 1
    return ops


def replay_into_index(
    path: str | os.PathLike[str],
    index: PrefixIndex | None = None,
    *,
    flt: RecordFilter | None = None,
) -> tuple[ReplaySummary, PrefixIndex]:
    """Decode and apply every selected record of `path` into `index` (a fresh one by default)."""
    flt = flt or RecordFilter()
    target = index if index is not None else PrefixIndex()
    summary = ReplaySummary(path=str(Path(path)))
    streams: dict[str, StreamReplay] = {}
    states: dict[str, _StreamState] = {}
    ops = 0
    with RecordingReader(path) as reader:
        marked = reader.header.format_version >= 2
        started = time.perf_counter()
        cut, skipped = before_window(reader, flt)
        for positioned in select_records(reader, flt, marks=True, cut=cut):
            record = positioned.record
            stats = streams.get(record.stream)
            if stats is None:
                stats = streams[record.stream] = StreamReplay(stream=record.stream)
                states[record.stream] = _StreamState(marked)
                _add_stream(target, reader.sources.get(record.stream), record.stream)
            if summary.first_time is None:
                summary.first_time = record.recv_time
            summary.last_time = record.recv_time
            ops += _apply_record(target, stats, states[record.stream], record)
        summary.elapsed_s = time.perf_counter() - started
        summary.damage = reader.damage
        if skipped is not None and (
            reader.damage is None or reader.damage.offset != skipped.offset
        ):
            summary.damage_before_window = skipped  # else the window's read stopped there too
    summary.records = sum(s.records for s in streams.values())
    summary.batches = sum(s.batches for s in streams.values())
    summary.events = sum(s.events for s in streams.values())
    summary.blocks_stored = sum(s.blocks_stored for s in streams.values())
    summary.blocks_removed = sum(s.blocks_removed for s in streams.values())
    summary.decode_errors = sum(s.decode_errors for s in streams.values())
    summary.block_ops_per_s = ops / summary.elapsed_s if summary.elapsed_s > 0 else 0.0
    for stats in streams.values():
        if stats.stream in cut or summary.damage_before_window is not None:
            stats.partial = True
            target.set_last_seq(stats.stream, None)  # no fence over a part of the state
        stats.entries = target.entries(stats.stream)
        counters = target.counters(stats.stream)
        stats.unknown_parents = counters.unknown_parents
        stats.block_size_mismatches = counters.block_size_mismatches
        stats.block_size = target.block_size(stats.stream)
    summary.streams = sorted(streams.values(), key=lambda s: s.stream)
    fingerprint = Fingerprinter()
    summary.namespaces = [
        NamespaceReplay(
            model=ns.namespace.model,
            lora=ns.namespace.lora,
            salt=salt_fingerprint(ns.namespace.cache_salt),
            namespace=fingerprint(ns.namespace),
            blocks=ns.blocks,
            tokens=ns.tokens,
            holders=ns.holders,
        )
        for ns in sorted(target.namespaces(), key=lambda n: -n.blocks)
    ]
    summary.index_entries = len(target)
    return summary, target


def before_window(reader: RecordingReader, flt: RecordFilter) -> tuple[set[str], Damage | None]:
    """The streams with a message before the window's `from_time` (a scan of the file up to
    it, without decoding payloads; nothing to scan without a start time), and the damage that
    stopped the scan short of the window (None: it reached the window, or the file's end).

    The window's own read seeks by time, so it starts past such damage and would not see it:
    the damage is only known here (the reader's next read clears `reader.damage`)."""
    if flt.from_time is None:
        return set(), None
    before: set[str] = set()
    for positioned in reader.records():
        record = positioned.record
        if record.recv_time >= flt.from_time:
            return before, None
        before.add(record.stream)
    return before, reader.damage


def _add_stream(index: PrefixIndex, source: Source | None, stream: str) -> None:
    if source is None:
        index.add_stream(stream)
        return
    spec = ENGINES.get(source.engine)
    if spec is None:
        raise RecordingError(
            f"stream {stream!r} was recorded from engine {source.engine!r}, which this build "
            f"does not know (known: {', '.join(ENGINES)})"
        )
    index.add_stream(stream, model=source.model, engine=spec.name, block_size=source.block_size)


def _sequence(
    target: PrefixIndex, stats: StreamReplay, state: _StreamState, record: Record
) -> bool:
    """Walk the live subscriber's decision for `record`; False when it was not applied.

    The file holds what the subscriber applied, in order, so verdicts other than APPLY replay
    what the subscriber did next: a run of replayed records is one gap repaired by replay; a
    replayed seq below the tracker's is only possible after an engine restart that a later live
    message revealed; a seq jump nobody filled was a gap the replay buffer no longer covered.
    """
    tracker = state.tracker
    joining = not state.joined
    state.joined = True
    refetch, state.refetch = state.refetch, None
    if refetch is not None and not (record.replayed and record.seq == refetch):
        # the copy never came (no replay, timed out, no longer buffered): the subscriber
        # gave the batch up and cleared the stream
        stats.lost_batches += 1
        target.clear_stream(record.stream)
        tracker.restart_at(refetch + 1)
    if record.replayed:
        if refetch is not None:
            stats.refetches += 1  # the subscriber's refetch of one batch: not a gap
        elif record.run_start if state.marked else not state.in_replay:
            # marked: a run that follows another with no live record between counts again,
            # and what the subscriber replayed without counting a run (the check of a
            # reconnected stream) does not count; a version-1 file counts every run of
            # replayed records once (two back to back read as one)
            stats.replays += 1
            stats.gaps += 0 if joining else 1
        state.in_replay = True
        decision = tracker.on_replay(record.seq)
        if decision.verdict is SeqVerdict.DUPLICATE:
            stats.restarts += 1
            target.clear_stream(record.stream)
            tracker.reset()
            decision = tracker.on_replay(record.seq)
        if decision.verdict is SeqVerdict.GAP:
            if tracker.last is not None:
                stats.lost_gaps += 1
                target.clear_stream(record.stream)
            tracker.restart_at(record.seq)
            decision = tracker.on_replay(record.seq)
        return decision.verdict is SeqVerdict.APPLY
    state.in_replay = False
    decision = tracker.on_live(record.seq)
    if decision.verdict is SeqVerdict.DUPLICATE:
        stats.duplicates += 1  # only in files not written through the subscriber
        return False
    if decision.verdict is SeqVerdict.RESTART:
        stats.restarts += 1
        target.clear_stream(record.stream)
        decision = tracker.on_live(record.seq)
    if decision.verdict is SeqVerdict.GAP:
        stats.gaps += 0 if joining else 1
        if tracker.last is not None:
            stats.lost_gaps += 1
            target.clear_stream(record.stream)
        tracker.restart_at(record.seq)
        decision = tracker.on_live(record.seq)
    return decision.verdict is SeqVerdict.APPLY


def _apply_record(
    target: PrefixIndex, stats: StreamReplay, state: _StreamState, record: Record
) -> int:
    if record.mark:
        return _apply_mark(target, stats, state, record)
    stats.records += 1
    if record.replayed:
        stats.replayed_records += 1
    if not _sequence(target, stats, state, record):
        return 0
    if stats.first_seq is None:
        stats.first_seq = record.seq
    stats.last_seq = record.seq
    try:
        batch = decode_batch(record.payload)
    except ProtocolError:
        stats.decode_errors += 1
        target.set_last_seq(record.stream, record.seq, record.payload)
        if record.replayed:
            # a copy from the replay does not decode either: given up, as live
            stats.lost_batches += 1
            target.clear_stream(record.stream)
        else:
            state.refetch = record.seq
            state.tracker.restart_at(record.seq)  # its replayed copy applies next
        return 0
    ops = _count_batch(stats, batch)
    target.apply(record.stream, batch, record.seq, record.payload)
    return ops


def _apply_mark(
    target: PrefixIndex, stats: StreamReplay, state: _StreamState, record: Record
) -> int:
    """Do what the recorder's subscriber did to the stream at this point (`RecordMark`)."""
    if record.mark is RecordMark.CLEAR:
        stats.marked_clears += 1
        target.clear_stream(record.stream)
    elif record.mark is RecordMark.FORGET_SEQ:
        # the subscriber's restart: it rebuilds from 0 (the next seqs apply from there, and
        # the restart is counted here rather than by the seq going back)
        stats.restarts += 1
        target.set_last_seq(record.stream, None)
        state.tracker.reset()
        state.refetch = None
    return 0
