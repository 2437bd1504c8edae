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
  entries in a non-default medium (`media` + per-tier tables), partial trailing pages and
  blocks that can never match (below a partial page or a namespace change, or on a key
  another namespace holds: `partial`).
- pending entries (`indexer.index.pending`) have the same value shape, with their namespace's code.

Applying: the steady SGLang store (a child of a known block, a namespace already seen, fresh
hashes and keys) is a few C-level map passes per event (`_store`); everything else goes
through `_store_general`, block by block where it must. Removes pop both maps in bulk.

Streams whose pages are SGLang EAGLE (prev, next) pairs (learned from their events, like the
block size) are matched by the request's pairs (`indexer.namespace.Bigrams`): a query walks
each (block size, bigram) group of streams once.

Namespaces: SGLang names the salt per event (`cache_salt`); vLLM puts it in `extra_keys[0]` of
the first block of a request (`["salt"]`, or `[lora_name, salt]`) and children inherit their
parent's namespace. A block whose parent is unknown is not indexed (fail closed) and counted.
Namespace ids, codes, seeds and per-namespace sizes live in `indexer.index.registry`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from itertools import compress
from operator import not_

import msgspec

from indexer.backend import DEFAULT, Backend
from indexer.engines import EngineName, EngineSpec, engine_spec
from indexer.fence import BatchFence
from indexer.index.media import MEDIUM_ORDER
from indexer.index.pending import PendingTable
from indexer.index.registry import NamespaceRegistry, NamespaceSize
from indexer.index.stream_table import ApplyOutcome, IndexedStream, StreamCounters
from indexer.index.values import CODE_BITS, NS_MASK
from indexer.index.walk import PrefixMatch, StreamMatch, collect, walk_prefix
from indexer.index.writer import BatchWriter
from indexer.namespace import Bigrams, Namespace, blocks_within, namespace_seed
from indexer.protocol.events import EventBatch

__all__ = ["DEFAULT_MEDIUM", "LATE_MARK_S", "PrefixIndex"]

DEFAULT_MEDIUM = "GPU"
# another replica's decision older than this came late (NATS held it up: decisions propagate
# in well under a millisecond on loopback), so a removal since of pages no key names (unknown
# to the index, or an event that did not decode) may have taken pages it marks
LATE_MARK_S = 0.05


def _medium_rank(medium: str) -> int:
    """A tier's place from the best (`MEDIUM_ORDER`); a tier not listed comes last."""
    return MEDIUM_ORDER.index(medium) if medium in MEDIUM_ORDER else len(MEDIUM_ORDER)


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
        # streams whose engine hashes blocks with the tokens after them (`_trim_lookahead`)
        self._lookahead_streams: dict[str, IndexedStream] = {}
        self._free_slots: list[int] = []
        # (block size, bigram pages) -> stream bits (unshifted): a query walks each such group
        # once, with the request's tokens or its (prev, next) pairs (`indexer.namespace.Bigrams`)
        self._by_shape: dict[tuple[int, bool], int] = {}
        self._registry = NamespaceRegistry()
        # namespace ids are swept for reuse once this many are in use (then at twice the
        # number left), so the registry stays within ~2x the live namespaces
        self._sweep_floor = max(namespace_sweep, 1)
        self._next_sweep = self._sweep_floor
        self.pending = PendingTable(clock, pending_ttl_s, shift=CODE_BITS, int_map=backend.int_map)
        # another replica's decisions not marked, or not wholly, on a stream because they came
        # late (one per stream): past the TTL, made before the stream was last cleared, held
        # past `LATE_MARK_S` across a removal there of unknown pages, or made before a removal
        # of some of its blocks (`add_pending`)
        self.late_marks = 0
        # when the writer began logging the keys of removals (`log_removals`; None: not)
        self._removals_since: float | None = None
        self._writer = BatchWriter(self)  # after every table it writes to exists

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
                if st.held is not None:
                    # told the size (configured, or advertised) while waiting for a proof
                    outcome = ApplyOutcome()
                    self._writer.release(st, outcome)
                    self._count(st, outcome)
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
        self._join_shape(st)

    def _set_bigram(self, st: IndexedStream, bigram: bool) -> None:
        """The stream's pages are (`True`) or are not SGLang EAGLE (prev, next) pairs."""
        if st.block_size is not None:
            self._leave_shape(st)
        st.bigram = bigram
        if st.block_size is not None:
            self._join_shape(st)

    def _join_shape(self, st: IndexedStream) -> None:
        assert st.block_size is not None
        shape = (st.block_size, bool(st.bigram))
        self._by_shape[shape] = self._by_shape.get(shape, 0) | 1 << st.slot

    def _leave_shape(self, st: IndexedStream) -> None:
        assert st.block_size is not None
        shape = (st.block_size, bool(st.bigram))
        rest = self._by_shape.get(shape, 0) & ~(1 << st.slot)
        if rest:
            self._by_shape[shape] = rest
        else:
            self._by_shape.pop(shape, None)

    def drop_stream(self, stream: str) -> int:
        """Forget a stream and all its entries; returns how many entries were dropped."""
        st = self._streams.get(stream)
        if st is None:
            return 0
        dropped = self.clear_stream(stream, count=False)
        if st.block_size is not None:
            self._leave_shape(st)
        del self._streams[stream]
        self._lookahead_streams.pop(stream, None)
        del self._by_slot[st.slot]
        self._free_slots.append(st.slot)
        return dropped

    def clear_stream(self, stream: str, *, count: bool = True) -> int:
        """Drop exactly one stream's entries (AllBlocksCleared, restart, lost gap), and its
        pending marks.

        A mark says a request routed there will store those blocks. Across a clear nothing
        tells whether it did before (its blocks gone with the rest) or will after: a plain
        request's mark goes when its stores arrive, but an `extra_key` request's never does
        (no event shows its pages), and after a restart the request died with the old process.
        Kept, they were predicted for up to `pending_ttl_s` (QA: 256 tokens pending after a
        flush and after a restart, 0 cached). Dropped: at worst a sibling of a request still
        queued across a clear is predicted no reuse, a missed hit."""
        st = self._streams.get(stream)
        if st is None:
            return 0
        dropped = st.entries()
        for h, key in st.blocks.items():
            self._writer.unlink(st, h, key)
        st.forget_entries()
        self.pending.discard_slot(st.slot)
        st.cleared_at = self.clock()
        st.removals.clear()  # every mark made before now is refused whole (`add_pending`)
        if count:
            st.counters.clears += 1
        return dropped

    def streams(self) -> list[str]:
        """Ids of every registered stream."""
        return list(self._streams)

    def has_stream(self, stream: str) -> bool:
        """Whether `stream` is registered."""
        return stream in self._streams

    def stream_model(self, stream: str) -> tuple[str, EngineName]:
        """The model and engine a stream's entries are keyed under."""
        st = self._streams[stream]
        return st.model, st.engine.name

    def block_size(self, stream: str) -> int | None:
        """The stream's block size (configured or learned), None while unknown."""
        return self._streams[stream].block_size

    def bigram(self, stream: str) -> bool | None:
        """Whether the stream's pages are SGLang EAGLE (prev, next) pairs, so a request is
        keyed there by its pairs (`indexer.namespace.Bigrams`); None while no page was seen."""
        return self._streams[stream].bigram

    def lookahead(self, stream: str) -> int:
        """How many tokens after a block the stream's engine hashes with it (vLLM's lookahead
        hashing), as its events showed; a match there is cut by as many blocks (0: none)."""
        return self._streams[stream].lookahead

    def key_shape(self, stream: str) -> tuple[int, bool] | None:
        """(block size, bigram pages) of the stream: streams of one shape share a prompt's
        block keys (`block_keys`); None while the block size is unknown."""
        st = self._streams.get(stream)
        if st is None or st.block_size is None:
            return None
        return st.block_size, bool(st.bigram)

    def entries(self, stream: str) -> int:
        """Blocks the stream holds now (partial pages included)."""
        return self._streams[stream].entries()

    def held_events(self, stream: str) -> int:
        """Events the stream holds back while its page size is unknown (`indexer.index.held`):
        not entries, yet a clear drops them too."""
        held = self._streams[stream].held
        return 0 if held is None else held.dropped()

    def counters(self, stream: str) -> StreamCounters:
        """The stream's cumulative counters (a live object: read, do not keep)."""
        return self._streams[stream].counters

    def set_counters(self, stream: str, counters: StreamCounters) -> None:
        """Continue the stream's counters from `counters` (a copy is kept): a snapshot loaded
        into a running process keeps that process's counts, which metrics export."""
        self._streams[stream].counters = msgspec.structs.replace(counters)

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
        return sum(st.entries() for st in self._streams.values())

    # ------------------------------------------------------------- namespaces

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
        live = self._live_ids()
        idle = [i for i in registry.ids() if i not in live]
        registry.release(idle)
        if idle:
            for st in self._streams.values():
                st.ns_cache.clear()
                st.singles.clear()
                for ns_id in idle:
                    st.ns_counts.pop(ns_id, None)
        self._next_sweep = max(self._sweep_floor, 2 * len(registry))
        return len(idle)

    def _live_ids(self) -> set[int]:
        """Ids of the namespaces with an entry of any kind: unique keys in the table, pending
        entries (expired ones are dropped first) or partial pages."""
        registry = self._registry
        self.pending.expire()
        live = self.pending.namespaces()
        for st in self._streams.values():
            live.update(ns_id for _, ns_id in st.partial.values())
        live.update(i for i in registry.ids() if registry.blocks[i])
        return live

    def held_namespaces(self) -> list[Namespace]:
        """Every namespace with an entry of any kind, blocks or not: an eviction must reach the
        ones that hold only pending marks (an extra_key's, whose pages no event shows, or one
        whose events are still on their way), which `namespaces` does not list."""
        names = self._registry.names
        return [ns for i in sorted(self._live_ids()) if (ns := names[i]) is not None]

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
        pending = self.pending
        for slot, twins in list(pending.twins.items()):
            # the index no longer follows these pages: their removal would drop no marks of
            # an extra_key's request tied to them (`PendingTable.twin`), so they go now
            pending.removed(slot, [p for p in twins if p in doomed])
        table.pop_many(keys, None)
        for tier_medium, tier in list(self._tiers.items()):
            for k in [k for k in tier if k in doomed]:
                del tier[k]
            if not tier:
                del self._tiers[tier_medium]
        self._registry.blocks[ns_id] = 0
        self._registry.tokens[ns_id] = 0
        return sum(st.evict(doomed, ns_id) for st in self._streams.values())

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
        outcome = self._writer.apply(stream, st, batch)
        if st.lookahead and stream not in self._lookahead_streams:
            self._lookahead_streams[stream] = st
        self._count(st, outcome)
        if seq is not None:
            st.last_seq = seq
            st.fence = None if payload is None else BatchFence.of(seq, payload)
        return outcome

    @staticmethod
    def _count(st: IndexedStream, outcome: ApplyOutcome) -> None:
        c = st.counters
        c.blocks_stored += outcome.stored
        c.blocks_removed += outcome.removed
        c.unknown_parents += outcome.unknown_parents
        c.block_size_mismatches += outcome.block_size_mismatches
        c.skipped_events += outcome.skipped
        c.skipped_group_blocks += outcome.skipped_group_blocks
        c.unindexable_blocks += outcome.unindexable_blocks
        c.token_kind_mismatches += outcome.token_kind_mismatches

    # ---------------------------------------------------------------- queries

    def add_pending(
        self,
        stream: str,
        namespace: Namespace,
        tokens: Sequence[int],
        keys: Sequence[int] | None = None,
        *,
        age_s: float = 0.0,
    ) -> int:
        """Mark a routed request's full blocks as pending on `stream`; returns blocks marked.

        `keys`: the blocks' keys on `stream` as `block_keys` gives them, when the caller has
        them (the router made them for its forecast); None: made here. `age_s`: how long ago
        the request was routed (another replica's decision): the mark lives what is left of
        the TTL (`PendingTable.add`); one routed before the stream was last cleared marks
        nothing (the clear dropped the marks of its time: `clear_stream`; taken after it, a
        mark held up on its way, by NATS or a stalled loop, would be predicted on a worker
        that flushed or restarted since the request reached it), and a block whose page left
        the stream since the request was routed is not marked (the request may have stored it
        and the worker evicted it meanwhile: `RemovalLog`)."""
        st = self._streams.get(stream)
        if st is None or st.block_size is None:
            return 0
        made_at = 0.0
        if age_s:
            now = self.clock()
            made_at = now - age_s
            if self._removals_since is None:
                self.log_removals()  # no replica said it would be told (`log_removals`)
            since = self._removals_since
            if (
                0 < self.pending.ttl_s <= age_s  # (no TTL: no marks at all, none late)
                or (st.cleared_at is not None and made_at < st.cleared_at)
                or (
                    age_s > LATE_MARK_S
                    and st.unknown_removed_at is not None
                    and made_at < st.unknown_removed_at
                )
                # made before the log began (this index's start, or its load): what was
                # removed since is not known, nor what removed before this index was built
                or (since is not None and made_at < since)
            ):
                self.late_marks += 1
                return 0
        if namespace.lora is not None and st.lora_by_id:
            # its pages come under the adapter's number, not its name: no store of them takes
            # the marks back, no removal of them drops them (`PendingTable.twin`), so none is
            # made (`names_lora_by_id`)
            return 0
        self.pending.expire()
        ns_id = self._intern(namespace)
        paged: Sequence[Hashable] = Bigrams(tokens) if st.bigram else tokens
        if keys is None:
            seed = self._registry.seed(ns_id, st.block_size)
            keys = self._chain(seed, paged, st.block_size, 0, -1)
        plain: Sequence[int] | None = None
        if namespace.extra_key is not None:
            # its pages come as plain pages of the salt: their keys stand for its blocks
            plain_ns = msgspec.structs.replace(namespace, extra_key=None)
            seed = self._seed(plain_ns, st.block_size)
            plain = self._chain(seed, paged, st.block_size, 0, len(keys))
        if age_s and st.removals:
            gone = st.removals.gone_since(plain if plain is not None else keys, made_at)
            if gone is not None:
                # blocks whose pages left the stream since the request was routed: it may
                # have stored them and the worker evicted them meanwhile (flushed, or LRU)
                self.late_marks += 1
                kept = list(map(not_, gone))
                keys = list(compress(keys, kept))
                if plain is not None:
                    plain = list(compress(plain, kept))
                if not keys:
                    return 0
        # keys the stream already holds need no pending mark (C-level passes, no per-key step;
        # a prompt nobody holds, the common case for a new prefix, skips even those)
        table = self._table
        fresh = keys
        if not table.isdisjoint(keys):
            held = map(st.sbit.__and__, table.get_many(keys, 0))
            fresh = list(compress(keys, map(not_, held)))
        pending = self.pending
        marked = pending.add(fresh, st.slot, ns_id, self._registry.codes[ns_id], age_s=age_s)
        if marked and plain is not None:
            # no store ever takes these marks back: a removal of the pages they stand for,
            # which events show as plain ones of the salt, does (`PendingTable.twin`)
            pending.twin(st.slot, plain, keys)
        return marked

    def log_removals(self) -> None:
        """Keep the keys each batch removes, for the pending TTL, from now on: other
        replicas' marks will come (`add_pending` judges them by what was removed since they
        were made). A router alone never calls it and pays nothing for them; the first mark
        of another replica calls it when nothing did before."""
        if self._removals_since is None and self.pending.ttl_s > 0:
            self._removals_since = self.clock()
            self._writer.logs_removals = True

    def names_lora_by_id(self, st: IndexedStream) -> None:
        """Stream `st`'s events name a LoRA adapter by number only: a request's marks of a
        named adapter there stand for pages of the name's namespace, which its events never
        show, so no store of the pages takes them back and no removal drops them (an
        `extra_key` request's are tied to them: `PendingTable.twin`). They go now, and no
        more are made (`add_pending`): such siblings are not steered together there."""
        st.lora_by_id = True
        names = self._registry.names
        doomed = set()
        for ns_id in self.pending.namespaces():
            ns = names[ns_id]
            if ns is not None and ns.lora is not None:
                doomed.add(ns_id)
        if doomed:
            self.pending.discard_slot_namespaces(st.slot, doomed)

    def withdraw_pending(self, stream: str, generation: int) -> int:
        """Take back the pending mark `generation` (`PendingTable.generation` right after the
        `add_pending` that made it) on `stream`: its request stores nothing there after all;
        returns how many keys were dropped."""
        st = self._streams.get(stream)
        return 0 if st is None else self.pending.withdraw(st.slot, generation)

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
        pairs = None
        for (block_size, bigram), bits in self._by_shape.items():
            keyed, upto = tokens, limit
            if bigram:
                # what SGLang keys the request by on EAGLE pages: its pairs, made once (lazily)
                if pairs is None:
                    pairs = Bigrams(tokens, limit)
                keyed, upto = pairs, None
            real, extra, tiers = walk_prefix(
                self._chain,
                self._table,
                self.pending.bits,
                self._tiers,
                self._registry.seed(ns_id, block_size),
                self._registry.codes[ns_id],
                bits,
                keyed,
                block_size,
                upto,
            )
            collect(out, real, extra, tiers, by_slot, self.default_medium)
        if self._lookahead_streams:
            self._trim_lookahead(out)
        return out

    def _trim_lookahead(self, out: PrefixMatch) -> None:
        """Take the last blocks off a match on streams whose engine hashes each block with the
        tokens after it (vLLM's lookahead hashing, beside a speculative drafter): the blocks'
        tokens matching does not say the following tokens do, so the engine may not reuse the
        last block(s) a query matched (a prompt that diverges right after a block boundary
        was predicted that block). Fail closed: ceil(lookahead / block size) blocks fewer."""
        for stream, st in self._lookahead_streams.items():
            total = out.blocks.get(stream, 0) + out.pending_blocks.get(stream, 0)
            if not total or not st.block_size:
                continue
            cut = -(-st.lookahead // st.block_size)
            pending = out.pending_blocks.get(stream, 0)
            from_pending = min(cut, pending)
            if from_pending:
                if pending == from_pending:
                    del out.pending_blocks[stream]
                else:
                    out.pending_blocks[stream] = pending - from_pending
            from_real = min(cut - from_pending, out.blocks.get(stream, 0))
            if from_real:
                self.cut(out, stream, out.blocks[stream] - from_real)

    def cut(self, out: PrefixMatch, stream: str, blocks: int) -> None:
        """Cut `stream`'s real blocks in `out` to its first `blocks` (fewer than it has)."""
        drop = out.blocks[stream] - blocks
        if blocks:
            out.blocks[stream] = blocks
        else:
            del out.blocks[stream]
        tiered = out.by_medium.get(stream)
        if tiered is not None:
            # the cut blocks' tiers are not known: the best tier goes first (a tier that earns
            # less is never overstated)
            for medium in sorted(tiered, key=_medium_rank):
                take = min(drop, tiered[medium])
                tiered[medium] -= take
                drop -= take
                if not tiered[medium]:
                    del tiered[medium]
            if not blocks or set(tiered) <= {self.default_medium}:
                out.by_medium.pop(stream, None)  # all in the default tier: not listed

    def block_keys(
        self,
        stream: str,
        namespace: Namespace,
        tokens: Sequence[Hashable],
        limit: int | None = None,
    ) -> list[int]:
        """The router's keys of the full blocks of `tokens` (the first `limit`) on `stream`.

        The same keys the stream's entries and pending marks have, root first, so a caller can
        keep its own per-key bookkeeping (the router's recency of a worker's blocks). Empty
        while the stream's block size or the namespace is unknown (nothing can be held then).
        On a stream of bigram pages they are the keys of the request's pairs (`Bigrams`):
        n tokens make `blocks_within(n, size, True)` blocks. Streams of one `key_shape` have
        the same keys.
        """
        st = self._streams.get(stream)
        ns_id = self._registry.find(namespace)
        if st is None or st.block_size is None or ns_id is None:
            return []
        size = st.block_size
        n = len(tokens) if limit is None else min(limit, len(tokens))
        count = blocks_within(n, size, bool(st.bigram))
        if not count:
            return []
        keyed: Sequence[Hashable] = Bigrams(tokens, n) if st.bigram else tokens
        return self._chain(self._registry.seed(ns_id, size), keyed, size, 0, count)

    def chain_keys(
        self, stream: str, namespace: Namespace, tokens: Sequence[Hashable], blocks: int
    ) -> tuple[int, list[list[int]]] | None:
        """The parent of the first block of `tokens` in `namespace` on `stream` (its seed),
        and the keys of up to `blocks` full blocks of them, whether or not the index has met
        the namespace: one chain once the stream's pages showed their kind, else the chains of
        the tokens and of their pairs (`Bigrams`), as either may be what its pages turn out to
        be (a chain may be empty: no full block). None: the block size is unknown."""
        st = self._streams.get(stream)
        if st is None or st.block_size is None:
            return None
        size = st.block_size
        seed = self._seed(namespace, size)
        kinds = (False, True) if st.bigram is None else (st.bigram,)
        chains = []
        for bigram in kinds:
            count = min(blocks, blocks_within(len(tokens), size, bigram))
            keyed: Sequence[Hashable] = Bigrams(tokens, count * size + 1) if bigram else tokens
            chains.append(self._chain(seed, keyed, size, 0, count) if count else [])
        return seed, chains

    def _seed(self, namespace: Namespace, size: int) -> int:
        """The parent key of a first block of `namespace` in `size`-token pages, whether or
        not the index has met the namespace (nothing is interned)."""
        ns_id = self._registry.find(namespace)
        return (
            namespace_seed(namespace, size) if ns_id is None else self._registry.seed(ns_id, size)
        )

    def holds_namespace(self, stream: str, namespace: Namespace) -> bool:
        """Whether `stream` holds any block of `namespace` per its events."""
        st = self._streams.get(stream)
        ns_id = self._registry.find(namespace)
        return st is not None and ns_id is not None and st.ns_counts.get(ns_id, 0) > 0

    def extra_copies(self, stream: str) -> Mapping[int, int]:
        """Per key `stream` holds more than once: at least how many copies more (read, never
        change). Only where its engine stores a page again as another copy
        (`EngineSpec.stored_again_is_copy`): those stored in the default tier since the key's
        last removal, which took a copy no one can tell (they count no more then)."""
        st = self._streams.get(stream)
        return st.again if st is not None else {}

    def copies(self, stream: str, keys: Sequence[int]) -> list[int]:
        """For each key, at least how many copies of it `stream` holds (0: none; see
        `extra_copies`)."""
        st = self._streams.get(stream)
        if st is None or not keys:
            return [0] * len(keys)
        held = map(st.sbit.__and__, self._table.get_many(list(keys), 0))
        again = st.again
        return [1 + again.get(key, 0) if h else 0 for key, h in zip(keys, held, strict=True)]

    def holder_counts(self, keys: Sequence[int]) -> list[int]:
        """For each key, how many streams hold it per their events."""
        shift = CODE_BITS
        return [(v >> shift).bit_count() for v in self._table.get_many(list(keys), 0)]

    def default_medium_entries(self, stream: str) -> int:
        """Blocks the stream holds in the default tier (the GPU): what its KV pool holds.

        Blocks held only in other tiers (offloaded to the host) are in the `media` side table,
        so this costs a pass over the offloaded blocks only."""
        st = self._streams[stream]
        default = self.default_medium
        elsewhere = sum(1 for copies in st.media.values() if not copies.get(default))
        return st.entries() - elsewhere

    def holds(self, stream: str, keys: Sequence[int]) -> list[bool]:
        """For each key, whether `stream` holds it per its events (pending marks do not count)."""
        st = self._streams.get(stream)
        if st is None or not keys:
            return [False] * len(keys)
        return list(map(bool, map(st.sbit.__and__, self._table.get_many(list(keys), 0))))

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
