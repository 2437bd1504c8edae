"""Offline replay: a recording decoded and applied into an in-memory index, as fast as possible.

The recorder writes what the live subscriber accepted, in the order it applied it (replayed
gap-repair batches included, flagged). Replaying therefore walks the same per-stream sequence
decisions the live subscriber made: consecutive seqs apply; a jump that no replay filled was an
unrepairable gap (the live subscriber cleared the stream, then went on); a decrease was an engine
restart (cleared); a repeat is a duplicate (skipped). The resulting index is the one the live
router held, which is what operators debugging an incident, and the round-trip test, compare.

Also here: `synthesize_recording`, a realistic recording from a scripted SGLang-like fleet, so
the index benchmark and the tests have a stream to replay without a capture at hand.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

from indexer.errors import ProtocolError
from indexer.fingerprint import Fingerprinter, salt_fingerprint
from indexer.index import PrefixIndex
from indexer.protocol.decode import decode_batch
from indexer.protocol.encode import WireLayout, encode_batch
from indexer.protocol.events import BlockHash, Cleared, EventBatch, Removed, Stored
from indexer.recording import Damage, Positioned, Record, RecordingReader, RecordingWriter, Source
from indexer.sequence import SequenceTracker, SeqVerdict

__all__ = [
    "NamespaceReplay",
    "RecordFilter",
    "ReplaySummary",
    "StreamReplay",
    "SyntheticWorkload",
    "replay_into_index",
    "select_records",
    "synthesize_recording",
]


class RecordFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which records to replay: a receive-time window, a per-stream seq window, some streams."""

    from_time: float | None = None
    to_time: float | None = None
    from_seq: int | None = None
    to_seq: int | None = None
    streams: frozenset[str] | None = None


def select_records(reader: RecordingReader, flt: RecordFilter) -> Iterator[Positioned]:
    """Records of `reader` passing `flt`, in file order (time windows seek, never scan)."""
    for positioned in reader.records(from_time=flt.from_time):
        record = positioned.record
        if flt.to_time is not None and record.recv_time > flt.to_time:
            return  # receive times never decrease in a recording
        if flt.streams is not None and record.stream not in flt.streams:
            continue
        if flt.from_seq is not None and record.seq < flt.from_seq:
            continue
        if flt.to_seq is not None and record.seq > flt.to_seq:
            continue
        yield positioned


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
    damage: Damage | None = None


class _StreamState:
    """Per-stream replay state: the live subscriber's tracker plus where a repair run is."""

    __slots__ = ("in_replay", "joined", "tracker")

    def __init__(self) -> None:
        self.tracker = SequenceTracker()
        self.in_replay = False
        self.joined = False  # the first record is a join: never a gap (as live)


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
        started = time.perf_counter()
        for positioned in select_records(reader, flt):
            record = positioned.record
            stats = streams.get(record.stream)
            if stats is None:
                stats = streams[record.stream] = StreamReplay(stream=record.stream)
                states[record.stream] = _StreamState()
                _add_stream(target, reader.sources.get(record.stream), record.stream)
            if summary.first_time is None:
                summary.first_time = record.recv_time
            summary.last_time = record.recv_time
            ops += _apply_record(target, stats, states[record.stream], record)
        summary.elapsed_s = time.perf_counter() - started
        summary.damage = reader.damage
    summary.records = sum(s.records for s in streams.values())
    summary.batches = sum(s.batches for s in streams.values())
    summary.events = sum(s.events for s in streams.values())
    summary.blocks_stored = sum(s.blocks_stored for s in streams.values())
    summary.blocks_removed = sum(s.blocks_removed for s in streams.values())
    summary.decode_errors = sum(s.decode_errors for s in streams.values())
    summary.block_ops_per_s = ops / summary.elapsed_s if summary.elapsed_s > 0 else 0.0
    for stats in streams.values():
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


def _add_stream(index: PrefixIndex, source: Source | None, stream: str) -> None:
    if source is None:
        index.add_stream(stream)
        return
    engine: Literal["sglang", "vllm"] = "vllm" if source.engine == "vllm" else "sglang"
    index.add_stream(stream, model=source.model, engine=engine, block_size=source.block_size)


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
    if record.replayed:
        if not state.in_replay:
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
        return 0
    ops = _count_batch(stats, batch)
    target.apply(record.stream, batch, record.seq)
    return ops


# ----------------------------------------------------------------------- synthetic recordings


class SyntheticWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """A scripted SGLang-like fleet: multi-tenant, salted, multi-turn, under cache pressure.

    Tenants share a few system prompts (so salted tenants with identical text land in different
    namespaces), conversations grow by turns (prefix reuse), each stream's paged cache holds
    `capacity_pages` pages and evicts LRU leaves (BlockRemoved), and every request is one batch
    with SGLang's coalescing (one BlockStored per run of new pages, parent = last cached page).
    """

    streams: int = 4
    tenants: int = 8
    salted_fraction: float = 0.75
    system_prompts: int = 3
    system_tokens: int = 256
    turns: int = 4
    turn_tokens: int = 64
    conversations: int = 100
    page_size: int = 16
    capacity_pages: int = 1024
    rate_per_s: float = 500.0
    layout: WireLayout = "array"
    model: str = "sim"
    seed: int = 0


class _SimCache:
    """One stream's paged prefix cache: SGLang's hash chain, LRU eviction of leaves."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, int | None] = OrderedDict()  # page hash -> parent hash
        self.children: dict[int, int] = {}

    def request(self, tokens: list[int], salt: str | None, page: int) -> list[Stored | Removed]:
        """The events of caching `tokens` (full pages only, like SGLang's page-aligned keys)."""
        prior = (
            hashlib.sha256(b"sglang-cache-salt-v1\x00" + salt.encode()).digest() if salt else b""
        )
        path: list[int] = []
        new_from = None
        for i in range(len(tokens) // page):
            chunk = tokens[i * page : (i + 1) * page]
            prior = hashlib.sha256(
                prior + b"".join(t.to_bytes(4, "little") for t in chunk)
            ).digest()
            h = int.from_bytes(prior[:8], "big", signed=True)
            if new_from is None and h not in self.lru:
                new_from = i
            path.append(h)
        events: list[Stored | Removed] = []
        if new_from is not None:
            evicted = self._evict(len(path) - new_from, set(path))
            if evicted:
                removed: list[BlockHash] = list(evicted)
                events.append(Removed(block_hashes=removed, medium="GPU"))
            parent = path[new_from - 1] if new_from else None
            for i in range(new_from, len(path)):
                self.lru[path[i]] = path[i - 1] if i else None
                if i:
                    self.children[path[i - 1]] = self.children.get(path[i - 1], 0) + 1
            stored: list[BlockHash] = list(path[new_from:])
            events.append(
                Stored(
                    block_hashes=stored,
                    parent=parent,
                    token_ids=list(tokens[new_from * page : len(path) * page]),
                    block_size=page,
                    medium="GPU",
                    cache_salt=salt,
                )
            )
        for h in reversed(path):  # deepest first, so a parent is always fresher than its child
            self.lru.move_to_end(h)
        return events

    def _evict(self, needed: int, keep: set[int]) -> list[int]:
        evicted: list[int] = []
        while len(self.lru) + needed > self.capacity and self.lru:
            h = next(iter(self.lru))
            if h in keep or self.children.get(h):
                self.lru.move_to_end(h)  # only when the whole cache is this request's path
                if len(evicted) > self.capacity:
                    break
                continue
            parent = self.lru.pop(h)
            self.children.pop(h, None)
            if parent is not None and parent in self.children:
                self.children[parent] -= 1
            evicted.append(h)
        return evicted


def synthesize_recording(
    path: str | os.PathLike[str],
    workload: SyntheticWorkload | None = None,
    *,
    compress: bool = False,
    overwrite: bool = False,
) -> int:
    """Write a realistic recording of `workload` (for benchmarks and tests); returns records."""
    w = workload or SyntheticWorkload()
    rng = random.Random(w.seed)
    vocab = 50_000
    prompts = [
        [rng.randrange(vocab) for _ in range(w.system_tokens)] for _ in range(w.system_prompts)
    ]
    salted = int(w.tenants * w.salted_fraction)
    salts = [f"tenant-{t}" if t < salted else None for t in range(w.tenants)]
    caches = [_SimCache(w.capacity_pages) for _ in range(w.streams)]
    seqs = [0] * w.streams
    # stream ids follow the indexer service's "{worker}#dp{rank}"
    names = [f"sim-{i}#dp0" for i in range(w.streams)]
    sources = [
        Source(
            stream=f"sim-{i}#dp0",
            topic="kv",
            block_size=w.page_size,
            model=w.model,
            worker=f"sim-{i}",
        )
        for i in range(w.streams)
    ]
    # interleave conversations: each arrival is the next turn of a random open conversation
    pending = [(c, 1) for c in range(w.conversations)]
    turns_text = {
        c: [rng.randrange(vocab) for _ in range(w.turns * w.turn_tokens)]
        for c in range(w.conversations)
    }
    now = 1_700_000_000.0
    records = 0
    with RecordingWriter.create(
        path, sources, compress=compress, overwrite=overwrite, buffer_bytes=1 << 20
    ) as writer:
        while pending:
            i = rng.randrange(len(pending))
            conv, turn = pending[i]
            if turn >= w.turns:
                pending[i] = pending[-1]
                pending.pop()
            else:
                pending[i] = (conv, turn + 1)
            tenant = conv % w.tenants
            tokens = prompts[tenant % w.system_prompts] + turns_text[conv][: turn * w.turn_tokens]
            stream = conv % w.streams if rng.random() < 0.9 else rng.randrange(w.streams)
            events = caches[stream].request(tokens, salts[tenant], w.page_size)
            now += rng.expovariate(w.rate_per_s)
            if not events:
                continue
            batch = EventBatch(ts=now, events=list(events), dp_rank=0)
            payload = encode_batch(batch, w.layout)
            writer.write(names[stream], b"kv", seqs[stream], payload, recv_time=now)
            seqs[stream] += 1
            records += 1
    return records
