"""The query walk: one pass over a request's blocks against the shared table.

Pure and allocation-light: block keys (the backend's `chain`, the very function the event side
uses) and table lookups (`get_many`, prefetched in the compiled map) are C-level passes over
chunks of blocks (64, then doubling up to 256: a prompt that shares only a system prompt stops
after the first chunk, one held to the end takes four passes); the running AND only visits the
few distinct holder sets. See
`indexer.index.values` for the layout of table values: `(stream bits << CODE_BITS) | code`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import repeat
from operator import or_

import msgspec

from indexer.index.values import CODE_BITS, CODE_MASK
from indexer.int_map import PyIntMap

__all__ = ["PrefixMatch", "StreamMatch", "collect", "walk_prefix"]

# request blocks hashed and looked up per C-level pass: small first (a prompt sharing only a
# system prompt stops early), then growing (fewer passes for a prompt held to the end)
_FIRST_CHUNK = 64
_MAX_CHUNK = 256


class StreamMatch(msgspec.Struct, gc=False):
    """Leading blocks of a request that one stream holds."""

    blocks: int
    pending_blocks: int  # extra leading blocks covered only by pending entries
    block_size: int | None
    by_medium: dict[str, int]


class PrefixMatch(msgspec.Struct, gc=False):
    """Per-stream results of one query, listing only streams with something to report."""

    blocks: dict[str, int]  # stream -> leading blocks held (real events)
    pending_blocks: dict[str, int]  # stream -> extra leading blocks covered only by pending
    by_medium: dict[str, dict[str, int]]  # stream -> tier -> blocks, when not all default tier


def _bits(mask: int) -> Iterable[int]:
    """Slot numbers of the set bits of `mask`."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


# slot mask -> its slots. The masks a walk meets are holder sets and their differences, which
# recur from query to query, so a walk turns "these 60 streams stop here" into one lookup and
# one C-level dict update instead of a Python step per stream.
_SLOTS: dict[int, tuple[int, ...]] = {}
_SLOTS_LIMIT = 1 << 12


def _slots(mask: int) -> tuple[int, ...]:
    """Slot numbers of the set bits of `mask` (memoized, bounded)."""
    slots = _SLOTS.get(mask)
    if slots is None:
        if len(_SLOTS) >= _SLOTS_LIMIT:
            _SLOTS.clear()  # bounded: a miss only recomputes one tuple
        slots = _SLOTS[mask] = tuple(_bits(mask))
    return slots


def walk_prefix(
    chain: Callable[[int, Sequence[Hashable], int, int, int], list[int]],
    table: PyIntMap,
    pending: PyIntMap,
    tiers_table: dict[str, dict[int, int]],
    seed: int,
    code: int,
    bits: int,
    tokens: Sequence[Hashable],
    block_size: int,
    limit: int | None = None,
) -> tuple[dict[int, int], dict[int, int], dict[str, dict[int, int]]]:
    """One pass over the request blocks: depth per slot holding any (real, real+pending, tiers).

    `bits` are the slots of the streams with this block size; `seed` and `code` are the
    namespace's; only the full blocks of the first `limit` tokens count (None: all). Blocks
    are hashed, looked up and ANDed in chunks by C-level calls; Python only looks at the few
    places where the running AND changes (a stream stops matching).
    """
    key = seed
    alive = (bits << CODE_BITS) | code
    get_many = table.get_many
    keep_keys = bool(tiers_table)
    all_keys: list[int] = []
    real: dict[int, int] = {}
    extra: dict[int, int] = {}
    done = 0
    alive_any = alive
    size = _FIRST_CHUNK
    total = (len(tokens) if limit is None else min(limit, len(tokens))) // block_size
    while done < total:
        # the very function the event side uses (one key scheme), a chunk of blocks at a time
        keys = chain(key, tokens, block_size, done, min(size, total - done))
        if not keys:
            break
        key = keys[-1]
        if keep_keys:
            all_keys.extend(keys)
        values = get_many(keys, 0)
        before = alive
        if alive >> CODE_BITS:
            alive = _record_drops(values, alive, code, done, real)
        if not pending:
            alive_any = alive
        elif not alive_any >> CODE_BITS:
            pass  # the pending walk has ended (the real one may go on)
        elif pending.isdisjoint(keys):
            if alive_any == before:
                # no pending entry so far nor in this chunk: the pending walk is the real one
                alive_any = alive
            else:
                # it diverged earlier, but this chunk has no pending entry: real values only
                alive_any = _record_drops(values, alive_any, code, done, extra)
        else:
            # pending values carry their namespace's code like real ones; ORing two values
            # would hide a foreign code, so the first foreign entry (real or pending) is
            # found first and ends the pending walk there
            marks = pending.get_many(keys, 0)
            held = list(map(or_, values, marks))
            cut = _first_foreign(values, marks, code)
            if cut is not None:
                held[cut] = 0
            alive_any = _record_drops(held, alive_any, code, done, extra)
        done += len(keys)
        # a foreign pending entry can end the pending walk before the real one: stop when both
        if not (alive | alive_any) >> CODE_BITS:
            break
        size = min(2 * size, _MAX_CHUNK)
    if done:
        real.update(zip(_slots(alive >> CODE_BITS), repeat(done)))
        extra.update(zip(_slots(alive_any >> CODE_BITS), repeat(done)))
    if not pending:
        extra = real
    tiers: dict[str, dict[int, int]] = {}
    if all_keys:
        for medium, tier in tiers_table.items():
            counts: dict[int, int] = {}
            for i, k in enumerate(all_keys):
                for slot in _bits(tier.get(k, 0)):
                    if real.get(slot, 0) > i:
                        counts[slot] = counts.get(slot, 0) + 1
            if counts:
                tiers[medium] = counts
    return real, extra, tiers


def _record_drops(
    values: list[int], alive: int, code: int, done: int, depths: dict[int, int]
) -> int:
    """Record where streams stop matching in one chunk of table values; returns the new mask.

    The running AND of `alive` and the values only changes at the first occurrence of a value,
    so only distinct values (few: holder sets are shared) are visited, in first-occurrence
    order, and positions are found by C-level `list.index` scans that together cover the
    chunk once. A value whose code part is not `code` means a missing key or another
    namespace's entry: everything still matching stops there.
    """
    first = values[0]
    if values.count(first) == len(values):
        distinct: Iterable[int] = (first,)  # one holder set for the whole chunk
    else:
        distinct = dict.fromkeys(values)
    j = 0
    for value in distinct:
        now = alive & value
        if now == alive:
            continue
        j = values.index(value, j)
        if now & CODE_MASK != code:
            now = code
        if done + j:  # streams that stop at block 0 matched nothing: no entry
            depths.update(zip(_slots((alive & ~now) >> CODE_BITS), repeat(done + j)))
        alive = now
        if alive == code:
            break
    return alive


def _first_foreign(values: list[int], marks: list[int], code: int) -> int | None:
    """First position holding an entry (real or pending) of another namespace, if any."""
    # distinct values are few (holder sets are shared), so this is two C-level set builds
    foreign = [v for v in {*values, *marks} if v & CODE_MASK not in (0, code)]
    if not foreign:
        return None
    return min(seq.index(v) for v in foreign for seq in (values, marks) if v in seq)


def collect(
    out: PrefixMatch,
    real: dict[int, int],
    extra: dict[int, int],
    tiers: dict[str, dict[int, int]],
    by_slot: dict[int, str],
    default_medium: str,
) -> None:
    """Add one `walk_prefix` result (per slot, positive depths only) to `out` (per stream)."""
    if real:
        out.blocks.update(zip(map(by_slot.__getitem__, real), real.values(), strict=True))
    if extra is not real:  # without pending entries there is nothing extra to report
        for slot, depth in extra.items():
            more = depth - real.get(slot, 0)
            if more > 0:
                out.pending_blocks[by_slot[slot]] = more
    for medium, counts in tiers.items():
        for slot, n in counts.items():
            stream = by_slot[slot]
            tiered = out.by_medium.setdefault(stream, {})
            tiered[medium] = n
            left = out.blocks[stream] - sum(tiered.values())
            tiered.pop(default_medium, None)
            if left:
                tiered[default_medium] = left
