"""Versioned msgpack snapshots of a whole `PrefixIndex` (a restarted router starts warm).

Layout (version 6): a map with `format` ("kvroute-index"), `version`, `digest` and `body`. The
body is the msgpack of the index: `hash_probe` (the key scheme's probe value: a runtime whose
`hash` mixes differently refuses the snapshot instead of silently mismatching), `namespaces`
([id, namespace] pairs) and `streams`, each with its block size, engine, model, last applied
seq and parallel arrays of engine hashes, block keys and namespace ids, the rare side tables
(reference counts, media with the copies per storage tier, partial pages), the digest of the
batch at the last seq (its epoch fence, `indexer.fence`), its skipped KV-cache groups, its
lookahead and whether its pages are SGLang EAGLE (prev, next) pairs; and `shadows`, the
`extra_key` shadows of the service that wrote it (`indexer.shadowed`: each stream's shadowed
keys, the seeds that are tails, the streams hidden whole, the shadows still waiting for a
page size, the server's stream each stream followed, and the shadows parked for the servers
of workers that left, with their streams' fences), each time as the seconds it had left.
`digest` is BLAKE2b-256 of the body's bytes, checked before anything in the body is decoded:
a snapshot damaged on disk or on the way (one flipped bit in an engine hash made an entry that
the worker's removal never named again: a false hit for good) is refused, never half-trusted.
It detects damage, not forgery: whoever may load a snapshot may write any index (the admin API
is the guard).

Versions 1-4 had no digest and are refused: a router upgraded past them starts cold (it
rebuilds each stream from its worker's replay and events), which costs hits for a while and
never a false one. Version 5 had no shadows and is read as having none (what a router that
loaded one trusted before: an `extra_key` request's pages for a plain request of its salt);
a release before version 6 refuses a version 6 snapshot (it starts cold). The shared table
is not stored: it is rebuilt from the streams, which also re-derives every size. Pending
entries are not stored (they live for seconds). The copies each key was stored again since its
last removal (`PrefixIndex.extra_copies`) are (version 6), as the stream's events left them at
its last seq: before, every held page counted as one copy after a load, so a block an
`extra_key` shadow covers was trusted only once its copies were stored again (a missed hit).

Loading validates everything into a fresh index and only then returns it, so a damaged
snapshot raises `SnapshotError` and never leaves a half-loaded index behind. That includes each
field's range (`_check_ranges`): a digest proves the bytes are the ones written, not that their
writer was sound, and a last seq of -1 was taken as it was and crashed the stream's subscriber
on every restart (its replay request could not be packed). Each stream's
entries are linked into the shared table in whole-array passes (`_link_in_bulk`), the
per-entry loop kept beside it as the reference the tests compare it with.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import operator
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from itertools import compress
from typing import NamedTuple

import msgspec

from indexer.backend import DEFAULT, Backend
from indexer.engines import engine_spec
from indexer.errors import SnapshotError
from indexer.fence import DIGEST_BYTES, BatchFence
from indexer.index import CODE_MASK, NS_MASK, PrefixIndex, StreamCounters, ns_code
from indexer.index.media import best_medium
from indexer.index.stream_table import IndexedStream
from indexer.namespace import HASH_PROBE, Namespace
from indexer.protocol.events import BlockHash
from indexer.protocol.frames import END_SEQ
from indexer.protocol.wire import MAX_BLOCK_SIZE, MAX_TOKENS_PER_EVENT
from indexer.server_stream import ServerStream
from indexer.shadowed import Shadow

__all__ = ["SNAPSHOT_VERSION", "KeptShadows", "dump_index", "load_index", "load_snapshot"]

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 6
# versions 1-4 carry no digest: a damaged one could not be told from a sound one (start cold);
# version 5 has no `shadows` (read as none: the gap version 6 closes)
_READABLE_VERSIONS = (5, 6)
# more copies of one page than a worker could hold (one per extra_key and the plain one)
_MAX_COPIES = 1 << 32
# the signed 64-bit range of a shadowed prompt's head tokens (kept as `array("q")`)
_TOKEN_MIN, _TOKEN_MAX = -(1 << 63), (1 << 63) - 1
_FORMAT = "kvroute-index"
_DIGEST_BYTES = 32


class _StreamSnapshot(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    stream: str
    slot: int
    model: str
    engine: str
    block_size: int | None
    last_seq: int | None
    hashes: list[BlockHash]
    keys: list[int]
    ns_ids: list[int]
    refs: list[tuple[BlockHash, int]]
    media: list[tuple[BlockHash, dict[str, int]]]  # copies per tier
    partial: list[tuple[BlockHash, int, int]]
    counters: StreamCounters
    # the digest of the batch at last_seq, so a warm start can prove that the publisher it
    # reconnects to is still the process the snapshot followed (indexer.fence)
    fence: bytes | None
    # whether its pages are SGLang EAGLE (prev, next) pairs (None: not known yet), the
    # KV-cache groups whose removals are not a prefix's (hybrid models: without them, a
    # sliding-window group's removal after a load took full-attention blocks away), and the
    # engine's lookahead (`PrefixIndex._trim_lookahead`)
    bigram: bool | None
    skipped_groups: list[int]
    lookahead: int
    # the copies of a key stored again since its last removal (`PrefixIndex.extra_copies`),
    # which tell a plain copy of an `extra_key` shadow's block (version 6; none in version 5)
    again: list[tuple[int, int]] = []


class _Shadows(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The `extra_key` shadows (`indexer.shadowed`) of the service that wrote the snapshot,
    each time as the seconds it had left then (negative: past it, kept while the stream holds
    the key). The keys one request shadowed share one kind, as they share one tuple."""

    # (seconds left, the extra_keys whose prompt has the key, those whose tail it is)
    kinds: list[tuple[float, list[str], list[str]]]
    # (stream, its shadowed keys, the kind of each)
    streams: list[tuple[str, list[int], list[int]]]
    # the seeds that are tails of prompts with no full block, and their plain namespace
    seeds: list[tuple[int, Namespace]]
    # streams whose plain entries are all hidden
    blanket: list[str]
    # shadows sent before the stream's page size was known: (stream, plain namespace, the
    # prompt's head tokens, its extra_key, seconds left)
    unsized: list[tuple[str, Namespace, list[int], str, float]]
    # the server's stream each stream followed (a stream id names a worker, which a loading
    # router may call otherwise: the shadows go with the server, as a renamed worker's do)
    servers: list[tuple[str, ServerStream]] = []
    # the shadows parked for the servers' streams of workers that left (`ShadowedPrefixes.park`):
    # (server's stream, keys, the kind of each, the fences of the streams parked there: seq
    # and digest, None where a stream had applied nothing)
    parked: list[tuple[ServerStream, list[int], list[int], list[tuple[int, bytes] | None]]] = []
    # the parked unsized shadows and hidden streams, by server's stream
    parked_unsized: list[tuple[ServerStream, Namespace, list[int], str, float]] = []
    parked_blanket: list[ServerStream] = []


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    hash_probe: int
    namespaces: list[tuple[int, Namespace]]
    streams: list[_StreamSnapshot]
    shadows: _Shadows | None = None  # version 6


class KeptShadows(NamedTuple):
    """A service's `extra_key` shadows as a snapshot keeps them: every time (each `Shadow`'s
    first field, each unsized shadow's last) in the terms of the clock that read `at`."""

    at: float
    streams: dict[str, dict[int, Shadow]]
    seeds: dict[int, Namespace]
    blanket: set[str]
    unsized: list[tuple[str, Namespace, Sequence[Hashable], str, float]]
    servers: dict[str, ServerStream]
    # server's stream -> (its shadows, the fences of the streams parked there)
    parked: dict[ServerStream, tuple[dict[int, Shadow], list[BatchFence | None]]]
    parked_unsized: list[tuple[ServerStream, Namespace, Sequence[Hashable], str, float]]
    parked_blanket: set[ServerStream]


class _Sealed(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    version: int
    digest: bytes
    body: memoryview  # a view into the snapshot: the body is hashed and decoded in place


class _Header(msgspec.Struct):
    """What every version shares, so that a version this build does not read is named."""

    format: str = ""
    version: int = 0


_encoder = msgspec.msgpack.Encoder()
_body_decoder = msgspec.msgpack.Decoder(_Body)
_sealed_decoder = msgspec.msgpack.Decoder(_Sealed)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def _digest(body: bytes | memoryview) -> bytes:
    return hashlib.blake2b(body, digest_size=_DIGEST_BYTES).digest()


def _seal(body: bytes) -> bytes:
    """A snapshot of `body` (the msgpack of a `_Body`): the envelope `load_index` checks."""
    return _encoder.encode(
        _Sealed(
            format=_FORMAT,
            version=SNAPSHOT_VERSION,
            digest=_digest(body),
            body=memoryview(body),
        )
    )


def _unseal(data: bytes) -> memoryview:
    """The body of snapshot `data` once its digest is checked; SnapshotError otherwise."""
    try:
        header = _header_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"not an index snapshot: {exc}") from exc
    if header.format != _FORMAT or header.version not in _READABLE_VERSIONS:
        older = header.format == _FORMAT and 0 < header.version < SNAPSHOT_VERSION
        raise SnapshotError(
            f"unsupported snapshot {header.format!r} version {header.version} "
            f"(this build reads {_FORMAT!r} version {' and '.join(map(str, _READABLE_VERSIONS))}"
            + ("; older versions have no digest: start cold" if older else "")
            + ")"
        )
    try:
        sealed = _sealed_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"damaged snapshot: {exc}") from exc
    if sealed.format != _FORMAT or sealed.version != header.version:
        raise SnapshotError("damaged snapshot: its header reads two ways")
    if not hmac.compare_digest(sealed.digest, _digest(sealed.body)):
        raise SnapshotError("damaged snapshot: its body does not match its digest")
    return sealed.body


def dump_index(index: PrefixIndex, shadows: KeptShadows | None = None) -> bytes:
    """Serialize `index` (without pending entries) and the service's `shadows`."""
    table = index._table
    streams = []
    # the namespaces the snapshot refers to, and no other: the registry keeps ids nothing
    # refers to any more until its next sweep (an evicted tenant, a salt only a pending mark
    # or a refused request named), and a snapshot would carry their salts on for good
    referenced: set[int] = set()
    for name, st in index._streams.items():
        if st.held is not None and st.held.events:
            # not written: a stream loaded from the snapshot waits for a page that proves the
            # size again, and a page held here is a missed hit there (never a false one)
            log.warning(
                "stream %s: %d events held while its page size is unknown are not in the "
                "snapshot (a stream loaded from it learns the size from later events)",
                name,
                len(st.held.events),
            )
        keys = list(st.blocks.values())
        ns_ids = [table[k] & NS_MASK for k in keys]
        referenced.update(ns_ids)
        referenced.update(ns for _, ns in st.partial.values())
        streams.append(
            _StreamSnapshot(
                stream=name,
                slot=st.slot,
                model=st.model,
                engine=st.engine.name,
                block_size=st.block_size,
                last_seq=st.last_seq,
                hashes=list(st.blocks),
                keys=keys,
                ns_ids=ns_ids,
                refs=list(st.refs.items()),
                media=[(h, dict(held)) for h, held in st.media.items()],
                partial=[(h, k, ns) for h, (k, ns) in st.partial.items()],
                counters=st.counters,
                fence=None if st.fence is None else st.fence.digest(),
                bigram=st.bigram,
                skipped_groups=sorted(st.skipped_groups),
                lookahead=st.lookahead,
                again=list(st.again.items()),
            )
        )
    names = index._registry.names
    namespaces = [(i, ns) for i in sorted(referenced) if (ns := names[i]) is not None]
    body = _encoder.encode(
        _Body(
            hash_probe=HASH_PROBE,
            namespaces=namespaces,
            streams=streams,
            shadows=None if shadows is None else _shadows_out(shadows),
        )
    )
    return _seal(body)


def _shadows_out(kept: KeptShadows) -> _Shadows:
    """`kept` as the snapshot writes it: times as seconds left, one kind per shared tuple."""
    at = kept.at
    kinds: list[tuple[float, list[str], list[str]]] = []
    kind_of: dict[int, int] = {}  # id(shadow) -> its kind (`kept` holds every tuple meanwhile)

    def kinds_of(shadows: dict[int, Shadow]) -> list[int]:
        which = []
        for shadow in shadows.values():
            kind = kind_of.get(id(shadow))
            if kind is None:
                kind = kind_of[id(shadow)] = len(kinds)
                kinds.append((shadow[0] - at, sorted(shadow[1]), sorted(shadow[2])))
            which.append(kind)
        return which

    streams = [
        (stream, list(shadows), kinds_of(shadows)) for stream, shadows in kept.streams.items()
    ]
    parked = [
        (
            server,
            list(shadows),
            kinds_of(shadows),
            [None if f is None else (f.seq, f.digest()) for f in fences],
        )
        for server, (shadows, fences) in kept.parked.items()
    ]
    return _Shadows(
        kinds=kinds,
        streams=streams,
        seeds=list(kept.seeds.items()),
        blanket=sorted(kept.blanket),
        unsized=[
            (stream, plain, list(head), extra_key, until - at)  # type: ignore[arg-type]
            for stream, plain, head, extra_key, until in kept.unsized
        ],
        servers=list(kept.servers.items()),
        parked=parked,
        parked_unsized=[
            (server, plain, list(head), extra_key, until - at)  # type: ignore[arg-type]
            for server, plain, head, extra_key, until in kept.parked_unsized
        ],
        parked_blanket=sorted(kept.parked_blanket),
    )


def load_index(
    data: bytes,
    *,
    clock: Callable[[], float] = time.monotonic,
    pending_ttl_s: float = 2.0,
    backend: Backend = DEFAULT,
) -> PrefixIndex:
    """Rebuild an index from `dump_index` output; raises SnapshotError on anything wrong."""
    return load_snapshot(data, clock=clock, pending_ttl_s=pending_ttl_s, backend=backend)[0]


def load_snapshot(
    data: bytes,
    *,
    clock: Callable[[], float] = time.monotonic,
    pending_ttl_s: float = 2.0,
    backend: Backend = DEFAULT,
) -> tuple[PrefixIndex, KeptShadows | None]:
    """The index of `dump_index` output and the shadows it kept (None: a snapshot without
    them, version 5, or written without a service's); raises SnapshotError on anything wrong
    in either."""
    body = _unseal(data)
    try:
        snap = _body_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"damaged snapshot body: {exc}") from exc
    if snap.hash_probe != HASH_PROBE:
        raise SnapshotError("snapshot was made with another block-key hash; start cold")
    try:
        index = _rebuild(snap, clock, pending_ttl_s, backend)
        shadows = None if snap.shadows is None else _shadows_in(snap.shadows, clock())
    except (ValueError, KeyError, IndexError, TypeError, OverflowError) as exc:
        raise SnapshotError(f"inconsistent snapshot: {exc}") from exc
    return index, shadows


def _shadows_in(wire: _Shadows, at: float) -> KeptShadows:
    """The shadows a snapshot kept, their times from `at` on; ValueError naming the first
    field that is not one a service could have written."""
    kinds: list[Shadow] = []
    for i, (left, named, tails) in enumerate(wire.kinds):
        if not math.isfinite(left):
            raise ValueError(f"shadows.kinds[{i}]: seconds left {left} is not finite")
        kinds.append((at + left, frozenset(named), frozenset(tails)))

    def shadows_of(where: str, keys: list[int], which: list[int]) -> dict[int, Shadow]:
        if len(keys) != len(which):
            raise ValueError(f"shadows: {where}: arrays of different lengths")
        if which and not 0 <= min(which) <= max(which) < len(kinds):
            raise ValueError(f"shadows: {where}: a kind outside 0..{len(kinds) - 1}")
        return dict(zip(keys, map(kinds.__getitem__, which), strict=True))

    def head_of(where: str, head: list[int], left: float) -> list[int]:
        if not math.isfinite(left):
            raise ValueError(f"shadows.{where}: seconds left {left} is not finite")
        if head and not _TOKEN_MIN <= min(head) <= max(head) <= _TOKEN_MAX:
            raise ValueError(f"shadows.{where}: a token outside the signed 64-bit range")
        return head

    streams: dict[str, dict[int, Shadow]] = {}
    for stream, keys, which in wire.streams:
        if stream in streams:
            raise ValueError(f"shadows: stream {stream!r} appears twice")
        streams[stream] = shadows_of(f"stream {stream!r}", keys, which)
    parked: dict[ServerStream, tuple[dict[int, Shadow], list[BatchFence | None]]] = {}
    for i, (server, keys, which, fences) in enumerate(wire.parked):
        if server in parked:
            raise ValueError(f"shadows: parked[{i}]: its server's stream appears twice")
        for fence in fences:
            if fence is not None and (
                not 0 <= fence[0] <= END_SEQ or len(fence[1]) != DIGEST_BYTES
            ):
                raise ValueError(f"shadows: parked[{i}]: a fence no stream could have")
        parked[server] = (
            shadows_of(f"parked[{i}]", keys, which),
            [None if f is None else BatchFence(f[0], digest=f[1]) for f in fences],
        )
    return KeptShadows(
        at=at,
        streams=streams,
        seeds=dict(wire.seeds),
        blanket=set(wire.blanket),
        unsized=[
            (stream, plain, head_of(f"unsized[{i}]", head, left), extra_key, at + left)
            for i, (stream, plain, head, extra_key, left) in enumerate(wire.unsized)
        ],
        servers=dict(wire.servers),
        parked=parked,
        parked_unsized=[
            (server, plain, head_of(f"parked_unsized[{i}]", head, left), extra_key, at + left)
            for i, (server, plain, head, extra_key, left) in enumerate(wire.parked_unsized)
        ],
        parked_blanket=set(wire.parked_blanket),
    )


def _rebuild(
    snap: _Body, clock: Callable[[], float], pending_ttl_s: float, backend: Backend
) -> PrefixIndex:
    index = PrefixIndex(clock=clock, pending_ttl_s=pending_ttl_s, backend=backend)
    registry = index._registry
    for ns_id, namespace in snap.namespaces:
        registry.place(ns_id, namespace)  # ValueError on a bad or repeated id
    size = len(registry.names)
    slots = {s.slot for s in snap.streams}
    if len(slots) != len(snap.streams) or any(not 0 <= s < 1 << 20 for s in slots):
        raise ValueError("stream slots are not unique small integers")
    for s in snap.streams:
        if s.stream in index._streams:
            raise ValueError(f"stream {s.stream!r} appears twice")
        if not len(s.hashes) == len(s.keys) == len(s.ns_ids):
            raise ValueError(f"stream {s.stream!r}: arrays of different lengths")
        _check_ranges(s)
        if s.hashes and s.block_size is None:
            raise ValueError(f"stream {s.stream!r}: entries without a block size")
        st = index._new_stream(s.slot, s.model, engine_spec(s.engine))  # ValueError if unknown
        index._streams[s.stream] = st
        index._by_slot[s.slot] = s.stream
        if s.block_size is not None:
            index._set_block_size(st, s.block_size)
        if s.bigram is not None:
            index._set_bigram(st, s.bigram)
        st.last_seq = s.last_seq
        if s.fence is not None:
            if s.last_seq is None:
                raise ValueError(f"stream {s.stream!r}: a fence without a seq")
            st.fence = BatchFence(s.last_seq, digest=s.fence)
        st.counters = s.counters
        st.skipped_groups = set(s.skipped_groups)
        st.lookahead = s.lookahead
        if s.lookahead:
            index._lookahead_streams[s.stream] = st
        if not st.blocks.insert_new(s.hashes, s.keys):  # all or nothing
            raise ValueError(f"stream {s.stream!r}: an engine hash appears twice")
        _link(index, st, s)
        partial = {p[0] for p in s.partial}
        for h, n in s.refs:
            if n < 2 or (h not in st.blocks and h not in partial):
                raise ValueError(f"stream {s.stream!r}: bad reference count")
            st.refs[h] = n
        for h, key, ns_id in s.partial:
            if not 0 < ns_id < size:
                raise ValueError(f"stream {s.stream!r}: bad partial entry")
            st.partial[h] = (key, ns_id)
        if s.again:
            keys = set(s.keys)
            for key, n in s.again:
                if key not in keys or not 1 <= n < _MAX_COPIES:
                    raise ValueError(f"stream {s.stream!r}: bad copies entry")
                st.again[key] = n
        for h, media in s.media:
            key = st.blocks[h]
            held = dict(media)
            if not held or any(n <= 0 for n in held.values()):
                raise ValueError(f"stream {s.stream!r}: bad media entry")
            if sum(held.values()) != st.refs.get(h, 1):
                raise ValueError(f"stream {s.stream!r}: media copies and references disagree")
            st.media[h] = held
            best = best_medium(held)
            if best != index.default_medium:
                tier = index._tiers.setdefault(best, {})
                tier[key] = tier.get(key, 0) | st.bit
    used = set(index._by_slot)
    index._free_slots = [i for i in range(max(used, default=-1) + 1) if i not in used]
    return index


def _check_ranges(s: _StreamSnapshot) -> None:
    """ValueError naming the first field of `s` that no index could hold, with its range.

    Each bound is one the code that makes the value keeps: a seq is 64 unsigned bits on the
    wire (`pack_seq`; the subscriber asks its replay from the last seq, so one out of range
    failed at every attempt, the stream never synced); a page holds at least one token and at
    most the wire's largest page (a namespace seed packs it as a msgpack int); a
    fence is a digest of `indexer.fence`'s size (another size never matches: only a failed
    proof, but no sound writer made it); counters count up from 0; a lookahead is the tokens
    after a block that one event carries (the wire's bound on them); a KV-cache group index is
    never negative (as on the wire)."""
    where = f"stream {s.stream!r}"
    if s.last_seq is not None and not 0 <= s.last_seq <= END_SEQ:
        raise ValueError(f"{where}: last_seq {s.last_seq} is outside 0..2**64-1")
    if s.block_size is not None and not 1 <= s.block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"{where}: block_size {s.block_size} is outside 1..{MAX_BLOCK_SIZE}")
    if s.fence is not None and len(s.fence) != DIGEST_BYTES:
        raise ValueError(
            f"{where}: fence of {len(s.fence)} bytes, not a {DIGEST_BYTES}-byte digest"
        )
    for name in s.counters.__struct_fields__:
        value = getattr(s.counters, name)
        if value < 0:
            raise ValueError(f"{where}: counters.{name} {value} is negative")
    if not 0 <= s.lookahead <= MAX_TOKENS_PER_EVENT:
        raise ValueError(f"{where}: lookahead {s.lookahead} is outside 0..{MAX_TOKENS_PER_EVENT}")
    if any(g < 0 for g in s.skipped_groups):
        raise ValueError(f"{where}: skipped_groups holds a negative group index")


def _link_in_bulk(index: PrefixIndex, st: IndexedStream, s: _StreamSnapshot) -> None:
    """Link a stream's entries into the shared table and the counts, in whole-array passes.

    The compiled map's bulk calls (`insert_new`, `get_many`, `or_many`) and C-level builtins
    (`Counter`, `compress`, `map`) do the per-entry work, so no Python bytecode runs per entry:
    `load_index` of the 1 M-entry snapshot of `kvroute bench cluster` took 0.52-0.56 s of CPU
    against 0.70-0.73 s entry by entry, most of what is left being the map inserts and the
    msgpack decode. Checks are the loop's: every namespace id known, one namespace per key,
    repeated keys of the stream counted in `dup_keys`.
    """
    registry = index._registry
    table = index._table
    counts = Counter(s.ns_ids)
    if not all(map(registry.known, counts)):
        raise ValueError(f"stream {s.stream!r}: an entry of an unknown namespace")
    st.ns_counts = dict(counts)  # every entry, repeated keys included
    value_of = {ns_id: st.sbit | registry.codes[ns_id] for ns_id in counts}
    keys, ns_ids = s.keys, s.ns_ids
    want = list(map(value_of.__getitem__, ns_ids))
    if table.insert_new(keys, want):  # no key held by an earlier stream, none repeated
        fresh: dict[int, int] = counts
    else:
        per_key = Counter(keys)
        if len(per_key) != len(keys):  # repeated keys: link each once, count the others
            st.dup_keys = {k: n - 1 for k, n in per_key.items() if n > 1}
            if len(counts) == 1:
                keys = list(per_key)
                want = want[: len(keys)]  # all alike
            else:
                ns_of = dict(zip(keys, ns_ids, strict=True))
                if list(map(ns_of.__getitem__, keys)) != ns_ids:
                    raise ValueError(f"stream {s.stream!r}: key in two namespaces")
                keys, ns_ids = list(ns_of), list(ns_of.values())
                want = list(map(value_of.__getitem__, ns_ids))
        held = table.get_many(keys, 0)
        shared = list(map(bool, held))
        for v, w in zip(compress(held, shared), compress(want, shared), strict=True):
            if v & CODE_MASK != w & CODE_MASK:
                raise ValueError(f"stream {s.stream!r}: key in two namespaces")
        is_new = list(map(operator.not_, shared))
        if not table.insert_new(list(compress(keys, is_new)), list(compress(want, is_new))):
            raise ValueError(f"stream {s.stream!r}: the table changed under the load")
        table.or_many(compress(keys, shared), st.sbit)
        fresh = Counter(compress(ns_ids, is_new)) if len(counts) > 1 else {s.ns_ids[0]: sum(is_new)}
    bs = s.block_size or 0
    for ns_id, n in fresh.items():
        registry.blocks[ns_id] += n
        registry.tokens[ns_id] += n * bs


def _link_one_by_one(index: PrefixIndex, st: IndexedStream, s: _StreamSnapshot) -> None:
    """`_link_in_bulk` entry by entry: the reference the tests hold it against."""
    registry = index._registry
    table = index._table
    bs = s.block_size or 0
    for key, ns_id in zip(s.keys, s.ns_ids, strict=True):
        if not registry.known(ns_id):
            raise ValueError(f"stream {s.stream!r}: an entry of an unknown namespace")
        v = table.get(key)
        if v is None:
            table[key] = st.sbit | ns_code(ns_id)
            registry.blocks[ns_id] += 1
            registry.tokens[ns_id] += bs
        elif v & CODE_MASK != ns_code(ns_id):
            raise ValueError(f"stream {s.stream!r}: key in two namespaces")
        elif v & st.sbit:
            st.dup_keys[key] = st.dup_keys.get(key, 0) + 1
        else:
            table[key] = v | st.sbit
        st.ns_counts[ns_id] = st.ns_counts.get(ns_id, 0) + 1


_link = _link_in_bulk  # the tests swap in `_link_one_by_one` to compare
