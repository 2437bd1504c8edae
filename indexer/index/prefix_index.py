"""The namespaced prefix index: which stream holds which block of which namespace.

Pure and synchronous (no asyncio, no zmq). Its mutators (applied batches, pending marks,
evictions) run on one event loop and never await midway, and readers query between them, so
there are no locks.

Data layout, chosen for speed and memory (see docs/benchmarks/index.md). The two big maps are
int-keyed maps of the backend (`indexer.backend`): the compiled `IntMap`, 16-byte slots in one
flat array, or its dict twin:
- `_table`: block key -> `(stream bits << CODE_BITS) | ns_code(namespace id)`. Every stream
  has a slot (a bit); a key's value says which streams hold it and which namespace it belongs
  to. A query (`indexer.index.walk`) ANDs the values of its blocks in C: the code of id x is
  `x | ~x << 24`, so the AND of two different codes never equals either of them, and an entry
  of another namespace ends every match right there (isolation is structural, not a matter of
  hash odds). Values are shared int objects (few distinct holder sets).
- per stream, `blocks`: engine hash -> block key (packed int64 values). Engine hashes are
  opaque ids, used only to resolve `parent_block_hash` and `BlockRemoved`.
- rare cases live in small side dicts so the common entry costs one slot in each map: extra
  reference counts (`refs`), a second engine hash of the same key on one stream (`dup_keys`),
  entries in a non-default medium (`media` + per-tier tables), partial trailing pages
  (`partial`).
- pending entries (`indexer.index.pending`) have the same value shape, with their namespace's code.

Applying: the steady SGLang store (a child of a known block, a namespace already seen, fresh
hashes and keys) is a few C-level map passes per event (`_store`); everything else goes
through `_store_general`, block by block where it must. Removes pop both maps in bulk.

Namespaces: SGLang names the salt per event (`cache_salt`); vLLM puts it in `extra_keys[0]` of
the first block of a request (`["salt"]`, or `[lora_name, salt]`) and children inherit their
parent's namespace. A block whose parent is unknown is not indexed (fail closed) and counted.
Namespace ids, codes, seeds and per-namespace sizes live in `indexer.index.registry`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from itertools import compress
from operator import not_
from typing import cast

from indexer.backend import DEFAULT, Backend
from indexer.engines import EngineName, EngineSpec, engine_spec
from indexer.fence import BatchFence
from indexer.index.pending import PendingTable
from indexer.index.registry import NamespaceRegistry, NamespaceSize
from indexer.index.stream_table import ApplyOutcome, IndexedStream, StreamCounters
from indexer.index.values import CODE_BITS, CODE_MASK, NS_BITS, NS_MASK, ns_code
from indexer.index.walk import PrefixMatch, StreamMatch, collect, walk_prefix
from indexer.namespace import Namespace, vllm_salt
from indexer.protocol.events import BlockHash, Cleared, EventBatch, Removed, Stored

__all__ = [
    "CODE_BITS",
    "CODE_MASK",
    "DEFAULT_MEDIUM",
    "NS_BITS",
    "NS_MASK",
    "ApplyOutcome",
    "NamespaceSize",
    "PrefixIndex",
    "PrefixMatch",
    "StreamCounters",
    "StreamMatch",
    "ns_code",
]

DEFAULT_MEDIUM = "GPU"

_INTERN_LIMIT = 1 << 16  # distinct table values shared as one int object each


class PrefixIndex:
    """Per-namespace prefix index over many streams; see the module docstring for the layout."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        pending_ttl_s: float = 2.0,
        default_medium: str = DEFAULT_MEDIUM,
        backend: Backend = DEFAULT,
        namespace_sweep: int = 4096,
    ) -> None:
        self.clock = clock
        self.default_medium = default_medium
        self.backend = backend
        self._chain = backend.chain
        self._table = backend.int_map(False)  # key -> (stream bits << CODE_BITS) | ns code
        self._tiers: dict[str, dict[int, int]] = {}  # medium -> key -> stream bits (unshifted)
        self._streams: dict[str, IndexedStream] = {}
        self._by_slot: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._by_block_size: dict[int, int] = {}  # block size -> stream bits (unshifted)
        self._registry = NamespaceRegistry()
        self._values: dict[int, int] = {}
        # namespace ids are swept for reuse once this many are in use (then at twice the
        # number left), so the registry stays within ~2x the live namespaces
        self._sweep_floor = max(namespace_sweep, 1)
        self._next_sweep = self._sweep_floor
        self.pending = PendingTable(clock, pending_ttl_s, shift=CODE_BITS, int_map=backend.int_map)

    # ---------------------------------------------------------------- streams

    def add_stream(
        self,
        stream: str,
        *,
        model: str = "",
        engine: EngineName = "sglang",
        block_size: int | None = None,
    ) -> None:
        """Register a stream (idempotent: an existing stream keeps its entries)."""
        spec = engine_spec(engine)
        st = self._streams.get(stream)
        if st is not None:
            if (st.model, st.engine) != (model, spec):
                st.model = model
                st.engine = spec
                st.ns_cache.clear()
            if block_size is not None and st.block_size is None:
                self._set_block_size(st, block_size)
            return
        slot = min(self._free_slots) if self._free_slots else len(self._streams)
        if self._free_slots:
            self._free_slots.remove(slot)
        st = self._new_stream(slot, model, spec)
        self._streams[stream] = st
        self._by_slot[slot] = stream
        if block_size is not None:
            self._set_block_size(st, block_size)

    def _new_stream(self, slot: int, model: str, engine: EngineSpec) -> IndexedStream:
        return IndexedStream(slot, model, engine, None, self.backend.int_map)

    def _set_block_size(self, st: IndexedStream, block_size: int) -> None:
        st.block_size = block_size
        bit = 1 << st.slot
        self._by_block_size[block_size] = self._by_block_size.get(block_size, 0) | bit

    def drop_stream(self, stream: str) -> int:
        """Forget a stream and all its entries; returns how many entries were dropped."""
        st = self._streams.get(stream)
        if st is None:
            return 0
        dropped = self.clear_stream(stream, count=False)
        self.pending.discard_slot(st.slot)
        if st.block_size is not None:
            rest = self._by_block_size.get(st.block_size, 0) & ~(1 << st.slot)
            if rest:
                self._by_block_size[st.block_size] = rest
            else:
                self._by_block_size.pop(st.block_size, None)
        del self._streams[stream]
        del self._by_slot[st.slot]
        self._free_slots.append(st.slot)
        return dropped

    def clear_stream(self, stream: str, *, count: bool = True) -> int:
        """Drop exactly one stream's entries (AllBlocksCleared, restart, lost gap)."""
        st = self._streams.get(stream)
        if st is None:
            return 0
        dropped = len(st.blocks) + len(st.partial)
        for h, key in st.blocks.items():
            self._unlink(st, h, key)
        st.blocks.clear()
        st.refs.clear()
        st.media.clear()
        st.partial.clear()
        st.ns_counts.clear()
        if count:
            st.counters.clears += 1
        return dropped

    def streams(self) -> list[str]:
        """Ids of every registered stream."""
        return list(self._streams)

    def has_stream(self, stream: str) -> bool:
        """Whether `stream` is registered."""
        return stream in self._streams

    def block_size(self, stream: str) -> int | None:
        """The stream's block size (configured or learned), None while unknown."""
        return self._streams[stream].block_size

    def entries(self, stream: str) -> int:
        """Blocks the stream holds now (partial pages included)."""
        st = self._streams[stream]
        return len(st.blocks) + len(st.partial)

    def counters(self, stream: str) -> StreamCounters:
        """The stream's cumulative counters (a live object: read, do not keep)."""
        return self._streams[stream].counters

    def last_seq(self, stream: str) -> int | None:
        """Seq of the last batch applied to this stream (None when unknown)."""
        return self._streams[stream].last_seq

    def set_last_seq(self, stream: str, seq: int | None, payload: bytes | None = None) -> None:
        """Record the seq (and batch) the stream's state corresponds to (snapshots carry it)."""
        st = self._streams[stream]
        st.last_seq = seq
        st.fence = None if seq is None or payload is None else BatchFence.of(seq, payload)

    def fence(self, stream: str) -> BatchFence | None:
        """What identifies the stream's last applied batch (None: nothing can prove it)."""
        return self._streams[stream].fence

    def __len__(self) -> int:
        return sum(len(st.blocks) + len(st.partial) for st in self._streams.values())

    # ------------------------------------------------------------- namespaces

    def _event_namespace(self, st: IndexedStream, ev: Stored, parent_key: int | None) -> int:
        lora = ev.lora_name if ev.lora_name else None
        if lora is None and ev.lora_id is not None and ev.lora_id != 0:
            lora = str(ev.lora_id)
        salt = ev.cache_salt or None
        if salt is None and (st.engine.salt_in_root_extra_keys or ev.extra_keys is not None):
            if parent_key is not None:
                # children inherit their parent's namespace (vLLM's rule)
                inherited = self._table.get(parent_key, 0) & NS_MASK
                if inherited:
                    return inherited
            salt = vllm_salt(ev.extra_keys, ev.lora_name)
        cache = st.ns_cache
        ns_id = cache.get((lora, salt))
        if ns_id is None:
            ns_id = self._intern(Namespace(st.model, lora, salt))
            if len(cache) >= 4096:
                cache.clear()  # bounded: a miss only costs building the Namespace again
            cache[(lora, salt)] = ns_id
        return ns_id

    def _intern(self, namespace: Namespace) -> int:
        """The id of `namespace`, sweeping unused ids first when their number calls for it."""
        if len(self._registry) >= self._next_sweep and self._registry.find(namespace) is None:
            self.reclaim_namespaces()
        return self._registry.intern(namespace)

    def reclaim_namespaces(self) -> int:
        """Release the ids of namespaces with no entry of any kind left; returns how many.

        Live means: unique keys in the table, pending entries (expired ones are dropped
        first) or partial pages. Every cache that maps to ids (per-stream namespace caches
        and shared values) is cleared, since a released id will name another namespace.
        """
        registry = self._registry
        self.pending.expire()
        live = self.pending.namespaces()
        for st in self._streams.values():
            live.update(ns_id for _, ns_id in st.partial.values())
        idle = [i for i in registry.ids() if not registry.blocks[i] and i not in live]
        registry.release(idle)
        if idle:
            for st in self._streams.values():
                st.ns_cache.clear()
                st.singles.clear()
                for ns_id in idle:
                    st.ns_counts.pop(ns_id, None)
        self._next_sweep = max(self._sweep_floor, 2 * len(registry))
        return len(idle)

    def namespaces(self) -> list[NamespaceSize]:
        """Every namespace that holds blocks, with sizes and per-stream holders."""
        holders: dict[int, dict[str, int]] = {}
        for stream, st in self._streams.items():
            for ns_id, n in st.ns_counts.items():
                if n:
                    holders.setdefault(ns_id, {})[stream] = n
        return self._registry.sizes(holders)

    def evict_namespace(self, namespace: Namespace) -> int:
        """Drop every entry of one namespace from every stream; returns entries dropped."""
        ns_id = self._registry.find(namespace)
        if ns_id is None:
            return 0
        self.pending.discard_namespace(ns_id)
        # every table key of the namespace goes, whoever holds it: drop them in bulk, then
        # each stream's entries of those keys in one pass over its map
        table = self._table
        keys = [k for k, v in table.items() if v & NS_MASK == ns_id]
        doomed = self.backend.int_map(True)
        doomed.assign(keys, 0)
        table.pop_many(keys, None)
        for tier_medium, tier in list(self._tiers.items()):
            for k in [k for k in tier if k in doomed]:
                del tier[k]
            if not tier:
                del self._tiers[tier_medium]
        self._registry.blocks[ns_id] = 0
        self._registry.tokens[ns_id] = 0
        dropped = 0
        for st in self._streams.values():
            gone = st.blocks.pop_by_value(doomed)
            if gone:
                for h, _ in gone:
                    st.refs.pop(h, None)
                    st.media.pop(h, None)
                for k in [k for k in st.dup_keys if k in doomed]:
                    del st.dup_keys[k]
                st.ns_counts.pop(ns_id, None)
            dropped += len(gone)
            lost = [h for h, (_, pns) in st.partial.items() if pns == ns_id]
            for h in lost:
                del st.partial[h]
                st.refs.pop(h, None)
            dropped += len(lost)
        return dropped

    # --------------------------------------------------------------- applying

    def apply(
        self,
        stream: str,
        batch: EventBatch,
        seq: int | None = None,
        payload: bytes | None = None,
    ) -> ApplyOutcome:
        """Apply one decoded batch to `stream` (registered first if needed).

        `payload`, the batch's wire bytes, becomes the stream's fence (kept by reference).
        """
        st = self._streams.get(stream)
        if st is None:
            self.add_stream(stream)
            st = self._streams[stream]
        outcome = ApplyOutcome(skipped=batch.skipped)
        store = self._store
        remove = self._remove
        for ev in batch.events:
            if type(ev) is Stored:
                store(st, ev, outcome)
            elif type(ev) is Removed:
                remove(st, ev, outcome)
            elif type(ev) is Cleared:
                self.clear_stream(stream)
                outcome.cleared = True
            else:
                outcome.skipped += 1
        c = st.counters
        c.blocks_stored += outcome.stored
        c.blocks_removed += outcome.removed
        c.unknown_parents += outcome.unknown_parents
        c.block_size_mismatches += outcome.block_size_mismatches
        c.skipped_events += outcome.skipped
        if seq is not None:
            st.last_seq = seq
            st.fence = None if payload is None else BatchFence.of(seq, payload)
        return outcome

    def _store(self, st: IndexedStream, ev: Stored, outcome: ApplyOutcome) -> None:
        """A `BlockStored`: the steady SGLang case inline, everything else in `_store_general`.

        The fast path only runs when its outcome is exactly the general path's: a known
        parent on this stream, full pages of the stream's size, an already seen (lora, salt),
        the default medium, no pending or partial entries, hashes and keys all new.
        """
        parent = ev.parent
        tokens = ev.token_ids
        hashes = ev.block_hashes
        block_size = st.block_size
        n = len(hashes)
        blocks = st.blocks
        if (
            parent is None
            or not n
            or ev.block_size != block_size
            or len(tokens) != n * block_size
            or st.engine.salt_in_root_extra_keys
            or ev.extra_keys is not None
            or ev.lora_id is not None
            or (ev.medium is not None and ev.medium != self.default_medium)
            or self.pending.bits
            or st.partial
        ):
            self._store_general(st, ev, outcome)
            return
        prev = blocks.get(parent)
        ns_id = st.ns_cache.get((ev.lora_name or None, ev.cache_salt or None))
        single = st.singles.get(ns_id) if ns_id is not None else None
        if prev is None or single is None:
            self._store_general(st, ev, outcome)
            return
        assert ns_id is not None and block_size is not None
        keys = self._chain(prev, tokens, block_size, 0, -1)
        table = self._table
        if not table.isdisjoint(keys):
            self._store_general(st, ev, outcome)
            return
        if not blocks.insert_new(hashes, keys):
            # a hash already held, or one hash twice in this event (nothing was inserted)
            self._store_general(st, ev, outcome)
            return
        table.assign(keys, single)
        self._registry.blocks[ns_id] += n
        self._registry.tokens[ns_id] += n * block_size
        st.ns_counts[ns_id] = st.ns_counts.get(ns_id, 0) + n  # a clear may have emptied it
        outcome.stored += n

    def _store_general(self, st: IndexedStream, ev: Stored, outcome: ApplyOutcome) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        page = ev.block_size
        tokens = ev.token_ids
        if n == 0 or page <= 0:
            outcome.skipped += 1
            return
        if st.block_size is None:
            self._set_block_size(st, page)
        block_size = st.block_size
        assert block_size is not None
        partial = False
        if page != block_size or len(tokens) != n * page:
            if n == 1 and page < block_size and len(tokens) == page:
                partial = True  # SGLang's trailing partial page: kept, never matchable
            else:
                outcome.block_size_mismatches += 1
                return
        parent = ev.parent
        prev: int | None = None
        if parent is not None:
            prev = st.blocks.get(parent)
            if prev is None:
                held = st.partial.get(parent)
                if held is None:
                    outcome.unknown_parents += 1
                    return
                # below a partial page nothing can match a full request block either
                self._store_partial(st, ev, held[0], held[1], outcome)
                return
        ns_id = None
        if ev.extra_keys is None and ev.lora_id is None and not st.engine.salt_in_root_extra_keys:
            # steady per-event traffic (SGLang): the namespace is (lora_name, cache_salt), seen
            ns_id = st.ns_cache.get((ev.lora_name or None, ev.cache_salt or None))
        if ns_id is None:
            ns_id = self._event_namespace(st, ev, prev)
        if prev is None:
            prev = self._registry.seed(ns_id, block_size)
        if partial:
            self._store_partial(st, ev, prev, ns_id, outcome)
            return
        keys = self._chain(prev, tokens, block_size, 0, -1)
        medium = ev.medium
        code = self._registry.codes[ns_id]
        blocks = st.blocks
        pending = self.pending.bits
        if (
            (medium is None or medium == self.default_medium)
            and (not pending or pending.isdisjoint(keys))
            and (not st.partial or st.partial.keys().isdisjoint(hashes))
            and blocks.insert_new(hashes, keys)
        ):
            # the common case, in C: new hashes on this stream (none twice), mostly new keys
            table = self._table
            if table.isdisjoint(keys):
                # every key is new to the table: one C-level assignment, no per-key work
                single = st.singles.get(ns_id)
                if single is None:
                    single = self._single(st, ns_id)
                table.assign(keys, single)
                self._registry.blocks[ns_id] += n
                self._registry.tokens[ns_id] += n * block_size
                st.ns_counts[ns_id] = st.ns_counts.get(ns_id, 0) + n
            else:
                values = table.get_many(keys, None)
                self._link(st, hashes, keys, values, code, ns_id, block_size)
            outcome.stored += n
            return
        if medium is None:
            medium = self.default_medium
        self._store_slow(st, hashes, keys, medium, code, ns_id, block_size)
        outcome.stored += n

    def _link(
        self,
        st: IndexedStream,
        hashes: list[BlockHash],
        keys: list[int],
        values: list[int | None],
        code: int,
        ns_id: int,
        block_size: int,
    ) -> None:
        """Set the stream's bit on `keys` (already in its map; `values` as read before)."""
        table = self._table
        single = self._shared(st.sbit | code)
        n = len(keys)
        if not values or values.count(None) == n:
            table.assign(keys, single)
            new_unique = added = n
        else:
            new_unique = 0
            added = n
            sbit = st.sbit
            for h, key, v in zip(hashes, keys, values, strict=True):
                if v is None:
                    table[key] = single
                    new_unique += 1
                elif v & CODE_MASK != code:
                    # a key collision across namespaces: keep it out of the table
                    del st.blocks[h]
                    st.partial[h] = (key, ns_id)
                    added -= 1
                elif v & sbit:
                    st.dup_keys[key] = st.dup_keys.get(key, 0) + 1
                else:
                    table[key] = self._shared(v | sbit)
        self._registry.blocks[ns_id] += new_unique
        self._registry.tokens[ns_id] += new_unique * block_size
        st.ns_counts[ns_id] = st.ns_counts.get(ns_id, 0) + added

    def _store_slow(
        self,
        st: IndexedStream,
        hashes: list[BlockHash],
        keys: list[int],
        medium: str,
        code: int,
        ns_id: int,
        block_size: int,
    ) -> None:
        """Block by block: repeated hashes, pending entries to replace, non-default media."""
        tiered = medium != self.default_medium
        blocks = st.blocks
        table = self._table
        sbit = st.sbit
        single = self._shared(sbit | code)
        pending = self.pending.bits
        ns_counts = st.ns_counts
        for h, key in zip(hashes, keys, strict=True):
            # counts move block by block here: a later block of this very event may undo one
            if st.partial and st.partial.pop(h, None) is not None:
                st.refs.pop(h, None)  # a partial page's hash now names a full page
            old = blocks.get(h)
            if old is not None:
                if old == key:
                    st.refs[h] = st.refs.get(h, 1) + 1
                    continue
                # the engine reused a hash for other content: the old mapping is gone
                self._drop_hash(st, h, old)
            v = table.get(key)
            if v is None:
                table[key] = single
                self._registry.blocks[ns_id] += 1
                self._registry.tokens[ns_id] += block_size
            elif v & CODE_MASK != code:
                # a key collision across namespaces: keep it out of the table (never matches)
                st.partial[h] = (key, ns_id)
                continue
            elif v & sbit:
                st.dup_keys[key] = st.dup_keys.get(key, 0) + 1
            else:
                table[key] = self._shared(v | sbit)
            blocks[h] = key
            ns_counts[ns_id] = ns_counts.get(ns_id, 0) + 1
            if pending and pending.get(key, 0) & sbit:
                self.pending.discard(key, st.slot)
            if tiered:
                st.media[h] = medium
                tier = self._tiers.setdefault(medium, {})
                tier[key] = tier.get(key, 0) | st.bit

    def _single(self, st: IndexedStream, ns_id: int) -> int:
        """The table value of a key only `st` holds in namespace `ns_id` (cached per stream)."""
        if len(st.singles) >= 4096:
            st.singles.clear()  # bounded: a miss only recomputes one value
        single = st.singles[ns_id] = self._shared(st.sbit | self._registry.codes[ns_id])
        return single

    def _shared(self, value: int) -> int:
        """One shared int object per distinct table value (most keys have few holder sets)."""
        shared = self._values.get(value)
        if shared is None:
            if len(self._values) >= _INTERN_LIMIT:
                self._values.clear()  # bounded: only sharing is lost, never correctness
            self._values[value] = shared = value
        return shared

    def _store_partial(
        self, st: IndexedStream, ev: Stored, prev: int, ns_id: int, outcome: ApplyOutcome
    ) -> None:
        page = ev.block_size
        tokens = ev.token_ids
        for i, h in enumerate(ev.block_hashes):
            prev = self.backend.partial(prev, tokens[i * page : (i + 1) * page])
            if h in st.partial or h in st.blocks:
                st.refs[h] = st.refs.get(h, 1) + 1
                continue
            st.partial[h] = (prev, ns_id)
        outcome.stored += len(ev.block_hashes)

    def _remove(self, st: IndexedStream, ev: Removed, outcome: ApplyOutcome) -> None:
        if st.refs or st.media or st.dup_keys:
            self._remove_slow(st, ev, outcome)
            return
        hashes = ev.block_hashes
        blocks = st.blocks
        popped = blocks.pop_many(hashes, None)
        if None in popped:
            # unknown hashes or partial pages among them: undo and go block by block
            for h, old in zip(hashes, popped, strict=True):
                if old is not None:
                    blocks[h] = old
            self._remove_slow(st, ev, outcome)
            return
        keys = cast(list[int], popped)
        # the common case, in C: every hash known, each key held by this stream alone, in
        # one namespace; pop them all, then put back whatever another stream still holds
        table = self._table
        values = table.pop_many(keys, 0)
        n = len(keys)
        first = values[0] if values else 0
        ns_id = first & NS_MASK
        if values.count(first) == n and first >> CODE_BITS == st.bit:
            st.ns_counts[ns_id] -= n
            self._registry.blocks[ns_id] -= n
            self._registry.tokens[ns_id] -= n * (st.block_size or 0)
        else:
            keep = ~st.sbit
            for key, v in zip(keys, values, strict=True):
                ns_id = v & NS_MASK
                st.ns_counts[ns_id] -= 1
                rest = v & keep
                if rest >> CODE_BITS:
                    table[key] = self._shared(rest)
                else:
                    self._registry.blocks[ns_id] -= 1
                    self._registry.tokens[ns_id] -= st.block_size or 0
        outcome.removed += n

    def _remove_slow(self, st: IndexedStream, ev: Removed, outcome: ApplyOutcome) -> None:
        blocks = st.blocks
        refs = st.refs
        for h in ev.block_hashes:
            if refs:
                r = refs.get(h)
                if r is not None:
                    if r > 2:
                        refs[h] = r - 1
                    else:
                        del refs[h]
                    outcome.removed += 1
                    continue
            key = blocks.pop(h, None)
            if key is None:
                if st.partial.pop(h, None) is None:
                    st.counters.unknown_removes += 1
                else:
                    outcome.removed += 1
                continue
            self._unlink(st, h, key)
            outcome.removed += 1

    def _drop_hash(self, st: IndexedStream, h: BlockHash, key: int) -> None:
        del st.blocks[h]
        st.refs.pop(h, None)
        self._unlink(st, h, key)

    def _unlink(self, st: IndexedStream, h: BlockHash, key: int) -> None:
        """Take stream `st`'s hold of `key` (via engine hash `h`) out of the tables."""
        v = self._table[key]
        ns_id = v & NS_MASK
        st.ns_counts[ns_id] -= 1
        # another engine hash of this stream may still hold the same key (rare)
        still = False
        if st.dup_keys:
            extra = st.dup_keys.get(key)
            if extra is not None:
                still = True
                if extra > 1:
                    st.dup_keys[key] = extra - 1
                else:
                    del st.dup_keys[key]
        if st.media:
            medium = st.media.pop(h, None)
            if medium is not None and not (
                still and any(m == medium and st.blocks.get(o) == key for o, m in st.media.items())
            ):
                tier = self._tiers.get(medium)
                if tier is not None:
                    rest = tier.get(key, 0) & ~st.bit
                    if rest:
                        tier[key] = rest
                    else:
                        tier.pop(key, None)
                        if not tier:
                            del self._tiers[medium]
        if still:
            return
        v &= ~st.sbit
        if v >> CODE_BITS:
            self._table[key] = self._shared(v)
        else:
            del self._table[key]
            self._registry.blocks[ns_id] -= 1
            self._registry.tokens[ns_id] -= st.block_size or 0

    # ---------------------------------------------------------------- queries

    def add_pending(self, stream: str, namespace: Namespace, tokens: Sequence[int]) -> int:
        """Mark a routed request's full blocks as pending on `stream`; returns blocks marked."""
        st = self._streams.get(stream)
        if st is None or st.block_size is None:
            return 0
        self.pending.expire()
        ns_id = self._intern(namespace)
        keys = self._chain(self._registry.seed(ns_id, st.block_size), tokens, st.block_size, 0, -1)
        # keys the stream already holds need no pending mark (C-level passes, no per-key step;
        # a prompt nobody holds, the common case for a new prefix, skips even those)
        table = self._table
        fresh = keys
        if not table.isdisjoint(keys):
            held = map(st.sbit.__and__, table.get_many(keys, 0))
            fresh = list(compress(keys, map(not_, held)))
        return self.pending.add(fresh, st.slot, ns_id, self._registry.codes[ns_id])

    def match(
        self, namespace: Namespace, tokens: Sequence[Hashable], limit: int | None = None
    ) -> PrefixMatch:
        """Leading full blocks of `tokens` held in `namespace`, only for streams holding some.

        Only the first `limit` tokens count (None: all), so the router can leave out a
        prompt's last token without copying the list. The router's hot path: nothing is
        allocated per stream that matches nothing.
        """
        self.pending.expire()
        out = PrefixMatch({}, {}, {})
        ns_id = self._registry.find(namespace)
        if ns_id is None:
            return out
        by_slot = self._by_slot
        for block_size, bits in self._by_block_size.items():
            real, extra, tiers = walk_prefix(
                self._chain,
                self._table,
                self.pending.bits,
                self._tiers,
                self._registry.seed(ns_id, block_size),
                self._registry.codes[ns_id],
                bits,
                tokens,
                block_size,
                limit,
            )
            collect(out, real, extra, tiers, by_slot, self.default_medium)
        return out

    def query(
        self, namespace: Namespace, tokens: Sequence[Hashable], limit: int | None = None
    ) -> dict[str, StreamMatch]:
        """For every stream, the leading full blocks of `tokens` (the first `limit`) it holds."""
        found = self.match(namespace, tokens, limit)
        result = {}
        for stream, st in self._streams.items():
            blocks = found.blocks.get(stream, 0)
            by_medium = found.by_medium.get(stream)
            if by_medium is None:
                by_medium = {self.default_medium: blocks} if blocks else {}
            pending = found.pending_blocks.get(stream, 0)
            result[stream] = StreamMatch(blocks, pending, st.block_size, by_medium)
        return result
