"""Applying decoded events to the index: stores and removes, the steady cases inline.

`BatchWriter` holds the algorithms that turn a `BlockStored` / `BlockRemoved` into entries of a
stream's table (`indexer.index.stream_table`) and of the shared key table (values as
`indexer.index.values` packs them). It is the index's one writer of entries: the facade
(`PrefixIndex`) owns streams, namespaces and queries and hands every event here.

The steady SGLang store (a child of a known block, a namespace already seen, fresh hashes and
keys) is a few C-level map passes per event (`store`); everything else goes through
`_store_general`, block by block where it must. Removes pop both maps in bulk. Namespaces:
SGLang names the salt per event (`cache_salt`); vLLM puts it in `extra_keys[0]` of the first
block of a request and children inherit their parent's namespace (`indexer.engines`). A block
whose parent is unknown is not indexed (fail closed) and counted.

This module is longer than the house's ~500 lines on purpose: the inline fast paths and their
general fallbacks are one algorithm, kept side by side so that each fast path can be read
against the path it must equal (`test_inline_store_path_equals_the_general_one`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import msgspec

from indexer.index.held import HeldEvents, proven_page_size
from indexer.index.media import best_medium
from indexer.index.stream_table import ApplyOutcome, IndexedStream
from indexer.index.values import CODE_BITS, CODE_MASK, NS_MASK
from indexer.namespace import Namespace, anonymous_lora, vllm_plain_blocks, vllm_salt
from indexer.protocol.events import (
    REUSABLE_SPEC_KINDS,
    BlockHash,
    Cleared,
    EventBatch,
    Removed,
    Stored,
    Unreadable,
)

if TYPE_CHECKING:
    from indexer.index.prefix_index import PrefixIndex

__all__ = ["REUSABLE_SPEC_KINDS", "BatchWriter"]

_INTERN_LIMIT = 1 << 16  # distinct table values shared as one int object each


class BatchWriter:
    """Applies events to one index's tables (see the module docstring)."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._table = index._table
        self._tiers = index._tiers
        self._registry = index._registry
        self._pending = index.pending
        self._twins = index.pending.twins
        self._chain = index.backend.chain
        self._partial = index.backend.partial
        # whether the keys each batch removes are kept for the pending TTL (`RemovalLog`): in
        # a replica of a cluster (`PrefixIndex.log_removals`), never in a router alone
        self.logs_removals = False
        # this batch so far: whether it removed pages (maybe: an event that did not decode),
        # whether some were not known (no key names them), and the keys it removed (logged)
        self._removing = False
        self._unknown = False
        self._gone: list[int] = []
        self._default_medium = index.default_medium
        self._values: dict[int, int] = {}

    def apply(self, stream: str, st: IndexedStream, batch: EventBatch) -> ApplyOutcome:
        """Apply one batch's events to stream `stream` (whose table is `st`)."""
        outcome = ApplyOutcome(skipped=batch.skipped)
        if st.held is not None:
            st.held.new_batch()  # a run of pages proves a size within one batch only
        store = self.store
        remove = self.remove
        for ev in batch.events:
            if type(ev) is Stored:
                if ev.kv_cache_spec_kind is not None and not self._reusable(st, ev):
                    outcome.skipped_group_blocks += len(ev.block_hashes)
                    continue
                if ev.lookahead > st.lookahead:
                    st.lookahead = ev.lookahead  # `PrefixIndex.match` trims by it
                store(st, ev, outcome)
            elif type(ev) is Removed:
                self._removing = True
                if ev.group_idx is not None and ev.group_idx in st.skipped_groups:
                    outcome.skipped_group_blocks += len(ev.block_hashes)
                    continue  # that group's blocks were never indexed
                remove(st, ev, outcome)
            elif type(ev) is Cleared:
                self._index.clear_stream(stream)
                outcome.cleared = True
            elif type(ev) is Unreadable:
                self._removing = self._unknown = True
                self.forget(st, ev, outcome)
            else:
                outcome.skipped += 1
        if self._removing:
            self._date_removals(st)
        return outcome

    def _date_removals(self, st: IndexedStream) -> None:
        """Date the removals `st` was just told (`add_pending` judges another replica's marks
        by them): its last of pages no key names, and the keys removed."""
        self._removing = False
        if not (self._unknown or self._gone):
            return
        now = self._index.clock()
        if self._unknown:
            self._unknown = False
            st.unknown_removed_at = now
        gone = self._gone
        if gone:
            self._gone = []
            log = st.removals
            log.add(gone, now)
            # no mark older than the TTL is taken: removals before then refuse nothing
            log.forget_before(now - self._pending.ttl_s)

    def _event_namespace(self, st: IndexedStream, ev: Stored, parent_key: int | None) -> int:
        lora = ev.lora_name if ev.lora_name else None
        if lora is None and ev.lora_id is not None and ev.lora_id != 0:
            lora = anonymous_lora(ev.lora_id)
            if not st.lora_by_id:
                self._index.names_lora_by_id(st)
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
            ns_id = self._index._intern(Namespace(st.model, lora, salt))
            if len(cache) >= 4096:
                cache.clear()  # bounded: a miss only costs building the Namespace again
            cache[(lora, salt)] = ns_id
        return ns_id

    def _token_kind(self, st: IndexedStream, bigram: bool) -> bool:
        """Whether a page of `bigram` pairs (SGLang EAGLE's (prev, next) keys) or of plain
        tokens may be kept on `st`: the stream takes the kind of its first page (it says how
        requests are keyed there, `PrefixIndex.match`), and again whenever it holds nothing
        (a restarted worker may have EAGLE turned on or off). The other kind beside held
        entries is refused (counted): a request is keyed one way per stream, and the pages
        of the other kind could never match it."""
        if st.bigram is bigram:
            return True
        if st.bigram is None or not st.entries():
            self._index._set_bigram(st, bigram)
            return True
        return False

    @staticmethod
    def _reusable(st: IndexedStream, ev: Stored) -> bool:
        """Whether the event's KV-cache group makes a reusable prefix (hybrid models).

        A request reuses a prefix only as far as its full-attention groups hold it: a
        sliding-window group keeps only its last window's blocks and a Mamba group a state,
        so their stores are not residency of a prefix (indexing them would be a false hit),
        and their removals must not take away what a full-attention group still holds.
        """
        if ev.kv_cache_spec_kind in REUSABLE_SPEC_KINDS:
            return True
        if ev.group_idx is not None:
            st.skipped_groups.add(ev.group_idx)  # its removals are skipped from now on
        return False

    def forget(self, st: IndexedStream, ev: Unreadable, outcome: ApplyOutcome) -> None:
        """An event that did not decode: index nothing of it and drop the blocks it names.

        Dropping them is the most a store or a removal could take away: a removal drops them,
        and a store may replace what a hash names (`_store_slow`), so the mapping kept would
        predict a page the worker no longer has. Whatever the event really did, the stream
        is left holding a part of what the worker holds (a missed hit, never a false one),
        and a later store chained on one of these hashes is an unknown parent (not indexed).
        Counted as a skipped event; a group whose blocks are not indexed is skipped as such.
        """
        kind = ev.kv_cache_spec_kind
        if (kind is not None and kind not in REUSABLE_SPEC_KINDS) or (
            ev.group_idx is not None and ev.group_idx in st.skipped_groups
        ):
            if kind is not None and ev.group_idx is not None:
                st.skipped_groups.add(ev.group_idx)
            outcome.skipped_group_blocks += len(ev.block_hashes)
            return
        if st.held is not None:
            outcome.skipped += st.held.hold(ev)  # itself counted when it is applied
            return
        outcome.skipped += 1
        blocks = st.blocks
        if self._twins and st.slot in self._twins:
            self._drop_twins(st, ev.block_hashes)  # a removal, maybe
        for h in ev.block_hashes:
            if st.partial.pop(h, None) is not None:
                st.refs.pop(h, None)
            key = blocks.get(h)
            if key is not None:
                self._drop_hash(st, h, key)

    def store(self, st: IndexedStream, ev: Stored, outcome: ApplyOutcome) -> None:
        """A `BlockStored`: the steady SGLang case inline, everything else in `_store_general`.

        The fast path only runs when its outcome is exactly the general path's: a known
        parent on this stream in the event's namespace, full pages of the stream's size, an
        already seen (lora, salt), the default medium, no pending or partial entries, hashes
        and keys all new.
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
            or (type(tokens[0]) is tuple) is not st.bigram
            or st.engine.salt_in_root_extra_keys
            or ev.extra_keys is not None
            or ev.lora_id is not None
            or (ev.medium is not None and ev.medium != self._default_medium)
            or self._pending.bits
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
        table = self._table
        if (table.get(prev, 0) ^ single) & CODE_MASK:
            self._store_general(st, ev, outcome)  # the parent is of another namespace
            return
        keys = self._chain(prev, tokens, block_size, 0, -1)
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
        if ev.extra_keys is not None:
            usable = vllm_plain_blocks(ev.extra_keys, ev.lora_name, root=ev.parent is None)
            if usable < min(n, len(ev.extra_keys)):
                # keyed by images or embeddings its tokens do not show: only the blocks
                # before the first such one are the prefix a plain request can reuse
                outcome.unindexable_blocks += n - usable
                if not usable:
                    return
                ev = msgspec.structs.replace(
                    ev,
                    block_hashes=hashes[:usable],
                    token_ids=tokens[: usable * page],
                    extra_keys=ev.extra_keys[:usable],
                )
                hashes, n, tokens = ev.block_hashes, usable, ev.token_ids
        if st.block_size is None and not self._sized_by(st, ev, outcome):
            return
        if tokens and not self._token_kind(st, type(tokens[0]) is tuple):
            outcome.token_kind_mismatches += 1
            return
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
        elif self._table.get(prev, 0) & NS_MASK != ns_id:
            # a chain that changes namespace (SGLang never sends one: a radix path has one
            # salt and one LoRA) goes on from the parent's key, which is the next key of the
            # parent's namespace: in the table it would take that key from another stream's
            # block of that namespace. No request of either namespace can match it, so it is
            # held as below a partial page
            self._store_partial(st, ev, prev, ns_id, outcome)
            return
        if partial:
            self._store_partial(st, ev, prev, ns_id, outcome)
            return
        keys = self._chain(prev, tokens, block_size, 0, -1)
        medium = ev.medium
        code = self._registry.codes[ns_id]
        blocks = st.blocks
        pending = self._pending.bits
        if (
            (medium is None or medium == self._default_medium)
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
            medium = self._default_medium
        self._store_slow(st, hashes, keys, medium, code, ns_id, block_size)
        outcome.stored += n

    def _sized_by(self, st: IndexedStream, ev: Stored, outcome: ApplyOutcome) -> bool:
        """Whether store `ev` on `st`, whose page size is unknown, may be applied now: it
        proves the size (the events held before it are applied first), or it is held or
        skipped (`EngineSpec.one_page_stores_held`)."""
        held = st.held
        if st.engine.one_page_stores_held:
            size = proven_page_size(ev, held)
            if size is None:
                if held is None:
                    held = st.held = HeldEvents()
                outcome.skipped += held.hold(ev)
                return False
        elif len(ev.block_hashes) == 1:
            outcome.skipped += 1  # a lone page decides nothing, and unsized is not indexed
            return False
        else:
            size = ev.block_size
        self._index._set_block_size(st, size)
        if held is not None:
            self.release(st, outcome)
        return True

    def release(self, st: IndexedStream, outcome: ApplyOutcome) -> None:
        """Apply the events `st` held while its page size was unknown (now it is known)."""
        held = st.held
        if held is None:
            return
        st.held = None
        for ev in held.events:
            if type(ev) is Stored:
                self.store(st, ev, outcome)
            elif type(ev) is Removed:
                self._removing = True
                self.remove(st, ev, outcome)
            else:
                self._removing = self._unknown = True
                self.forget(st, cast(Unreadable, ev), outcome)
        if self._removing:  # called outside a batch too (`PrefixIndex.add_stream`)
            self._date_removals(st)

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
        tiered = medium != self._default_medium
        blocks = st.blocks
        table = self._table
        sbit = st.sbit
        single = self._shared(sbit | code)
        pending = self._pending.bits
        ns_counts = st.ns_counts
        for h, key in zip(hashes, keys, strict=True):
            # counts move block by block here: a later block of this very event may undo one
            if st.partial and st.partial.pop(h, None) is not None:
                st.refs.pop(h, None)  # a partial page's hash now names a full page
            old = blocks.get(h)
            if old is not None:
                if old == key:
                    if self._holds_in(st, h, medium):
                        if not st.engine.stored_again_is_copy:
                            # vLLM: a second block of the same content (twins, each removed
                            # on its own), or the same block reported again
                            # (kv_cache_report_mode "full" sends every reused block again,
                            # and still one removal per block). The two look alike, so it
                            # counts once: a removal may drop a block a twin still holds (a
                            # missed hit), never keep one that is gone (a false hit: the
                            # re-reports had kept evicted blocks predicted for good)
                            continue
                        # SGLang: another radix node of the same page (an `extra_key`'s
                        # copy of a plain page, or the reverse), removed on its own: held
                        # until the last copy goes, and counted for `copies`
                        if medium == self._default_medium:
                            st.again[key] = st.again.get(key, 0) + 1
                    # the block copied to another tier (offload), or a copy more
                    count = st.refs.get(h, 1)
                    st.refs[h] = count + 1
                    self._add_residency(st, h, key, medium, count)
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
                self._pending.discard(key, st.slot)
            if tiered:
                st.media[h] = {medium: 1}
                self._retier(st, key, self._default_medium, medium)

    def _holds_in(self, st: IndexedStream, h: BlockHash, medium: str) -> bool:
        """Whether held block `h` has a copy in `medium` already."""
        held = st.media.get(h)
        return medium == self._default_medium if held is None else medium in held

    def _add_residency(
        self, st: IndexedStream, h: BlockHash, key: int, medium: str, count_before: int
    ) -> None:
        """One more copy of held block `h` in `medium` (the stream held `count_before`)."""
        held = st.media.get(h)
        default = self._default_medium
        if held is None:
            if medium == default:
                return  # every copy in the default tier: no side table needed
            held = st.media[h] = {default: count_before}
        old_best = best_medium(held)
        held[medium] = held.get(medium, 0) + 1
        self._retier(st, key, old_best, best_medium(held))

    def _drop_residency(
        self, st: IndexedStream, h: BlockHash, held: dict[str, int], medium: str | None
    ) -> bool:
        """A removal of `h` from `medium` (None: from every tier); False if not held there."""
        old_best = best_medium(held)
        if medium is None:
            for m in list(held):
                held[m] -= 1
        elif medium in held:
            held[medium] -= 1
        else:
            return False
        for m in [m for m, n in held.items() if n <= 0]:
            del held[m]
        key = st.blocks[h]
        if not held:
            # gone from every tier: its tier bit first, then the block itself
            self._retier(st, key, old_best, self._default_medium)
            del st.media[h]
            st.refs.pop(h, None)
            del st.blocks[h]
            self.unlink(st, h, key)
            return True
        total = sum(held.values())
        if total > 1:
            st.refs[h] = total
        else:
            st.refs.pop(h, None)
        new_best = best_medium(held)
        if held.keys() == {self._default_medium}:
            del st.media[h]  # back to default-only: no side table
        self._retier(st, key, old_best, new_best)
        return True

    def _retier(self, st: IndexedStream, key: int, old: str, new: str) -> None:
        """Move the stream's bit on `key` from tier table `old` to `new` (default: none)."""
        if old == new:
            return
        bit = st.bit
        if old != self._default_medium:
            tier = self._tiers.get(old)
            if tier is not None:
                rest = tier.get(key, 0) & ~bit
                if rest:
                    tier[key] = rest
                else:
                    tier.pop(key, None)
                    if not tier:
                        del self._tiers[old]
        if new != self._default_medium:
            tier = self._tiers.setdefault(new, {})
            tier[key] = tier.get(key, 0) | bit

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
            prev = self._partial(prev, tokens[i * page : (i + 1) * page])
            if h in st.partial:
                continue  # stored again: counted once, as a full block is (`_store_slow`)
            if h in st.blocks:
                medium = ev.medium or self._default_medium
                if not self._holds_in(st, h, medium):  # a full page's copy in another tier
                    count = st.refs.get(h, 1)
                    st.refs[h] = count + 1
                    self._add_residency(st, h, st.blocks[h], medium, count)
                continue
            st.partial[h] = (prev, ns_id)
        outcome.stored += len(ev.block_hashes)

    def remove(self, st: IndexedStream, ev: Removed, outcome: ApplyOutcome) -> None:
        if self._twins and st.slot in self._twins and st.held is None:
            self._drop_twins(st, ev.block_hashes)
        if (
            st.refs
            or st.media
            or st.dup_keys
            or st.again
            or (ev.medium not in (None, self._default_medium))
        ):
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
        if self.logs_removals:
            self._gone += keys
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

    def _drop_twins(self, st: IndexedStream, hashes: list[BlockHash]) -> None:
        """Pages an `extra_key` request may have stored went: the marks tied to them go
        (`PendingTable.twin`)."""
        gone = st.blocks.get_many(hashes, None)
        self._pending.removed(st.slot, [key for key in gone if key is not None])

    def _remove_slow(self, st: IndexedStream, ev: Removed, outcome: ApplyOutcome) -> None:
        if st.held is not None:
            # a stream holding events has no entries: its removals wait with its stores
            outcome.skipped += st.held.hold(ev)
            return
        blocks = st.blocks
        if self.logs_removals:
            # every known page it names, whichever copy or tier went: as an `extra_key`
            # request's marks go on any removal of their page (`_drop_twins`), and a copy left
            # (another radix node, the host tier) still holds the key, which needs no mark
            self._gone += [key for key in blocks.get_many(ev.block_hashes, None) if key is not None]
        refs = st.refs
        medium = ev.medium
        default = self._default_medium
        again = st.again
        for h in ev.block_hashes:
            if again:
                # a copy went, and which one is not known: the copies counted since the last
                # removal of the key count no more (`PrefixIndex.copies`: a lower bound)
                gone = blocks.get(h)
                if gone is not None:
                    again.pop(gone, None)
            held = st.media.get(h) if st.media else None
            if held is not None:
                if self._drop_residency(st, h, held, medium):
                    outcome.removed += 1
                else:
                    st.counters.unknown_removes += 1  # not held in the tier it names
                continue
            if medium is not None and medium != default and h in blocks:
                # held in the default tier only: a removal from another tier changes nothing
                st.counters.unknown_removes += 1
                continue
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
                    self._unknown = True  # pages the index never knew, or no longer does
                else:
                    outcome.removed += 1
                continue
            self.unlink(st, h, key)
            outcome.removed += 1

    def _drop_hash(self, st: IndexedStream, h: BlockHash, key: int) -> None:
        del st.blocks[h]
        st.refs.pop(h, None)
        if st.again:
            st.again.pop(key, None)
        self.unlink(st, h, key)

    def unlink(self, st: IndexedStream, h: BlockHash, key: int) -> None:
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
            held = st.media.pop(h, None)
            if held:
                best = best_medium(held)
                if not (
                    still
                    and any(
                        best_medium(hm) == best and st.blocks.get(o) == key
                        for o, hm in st.media.items()
                    )
                ):
                    self._retier(st, key, best, self._default_medium)
        if still:
            return
        v &= ~st.sbit
        if v >> CODE_BITS:
            self._table[key] = self._shared(v)
        else:
            del self._table[key]
            self._registry.blocks[ns_id] -= 1
            self._registry.tokens[ns_id] -= st.block_size or 0
