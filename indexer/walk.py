"""The query walk: one pass over a request's blocks against the shared table.

Pure and allocation-light: block tuples, chain keys, table lookups and the running AND are
C-level iterators over chunks of `_WALK_CHUNK` blocks (small chunks stay in the CPU cache and
let the walk stop early once no stream still matches). See `indexer.index` for the layout of
table values: `(stream bits << CODE_BITS) | namespace code`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable, Iterable, Sequence
from itertools import accumulate, islice, repeat
from operator import and_, neg, or_

from indexer.namespace import block_tuples

__all__ = ["CODE_BITS", "CODE_MASK", "NS_BITS", "NS_MASK", "ns_code", "walk_prefix"]

NS_BITS = 24
NS_MASK = (1 << NS_BITS) - 1
CODE_BITS = 2 * NS_BITS
CODE_MASK = (1 << CODE_BITS) - 1
_WALK_CHUNK = 64  # request blocks hashed and looked up per C-level pass


def ns_code(ns_id: int) -> int:
    """Namespace id x as `x | ~x << NS_BITS`: ANDing two different codes changes both."""
    return ns_id | ((~ns_id & NS_MASK) << NS_BITS)


def _bits(mask: int) -> Iterable[int]:
    """Slot numbers of the set bits of `mask`."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def walk_prefix(
    table: dict[int, int],
    pending: dict[int, int],
    tiers_table: dict[str, dict[int, int]],
    seed: int,
    code: int,
    bits: int,
    tokens: Sequence[Hashable],
    block_size: int,
) -> tuple[dict[int, int], dict[int, int], dict[str, dict[int, int]]]:
    """One pass over the request blocks: leading depth per slot (real, real+pending, tiers).

    `bits` are the slots of the streams with this block size; `seed` and `code` are the
    namespace's. Blocks are hashed, looked up and ANDed in chunks by C-level iterators; Python
    only looks at the few places where the running AND changes (a stream stops matching).
    """
    key = seed
    alive = (bits << CODE_BITS) | code
    table_get = table.get
    blocks = block_tuples(tokens, block_size)
    keep_keys = bool(tiers_table)
    all_keys: list[int] = []
    real: dict[int, int] = {}
    extra: dict[int, int] = {}
    done = 0
    alive_any = alive
    while True:
        chunk = list(islice(blocks, _WALK_CHUNK))
        if not chunk:
            break
        keys = [key := hash((key, block)) for block in chunk]
        if keep_keys:
            all_keys.extend(keys)
        values = list(map(table_get, keys, repeat(0)))
        if alive >> CODE_BITS:
            acc = list(accumulate(values, and_, initial=alive))
            alive = _record_drops(acc, code, done, real)
        if pending:
            # pending values carry every code bit: they neither break nor prove a namespace
            # (their keys are namespace-seeded); real entries of another namespace still do
            held = map(pending.get, keys, repeat(0))
            acc = list(accumulate(map(or_, values, held), and_, initial=alive_any))
            alive_any = _record_drops(acc, code, done, extra)
        else:
            alive_any = alive
        done += len(chunk)
        if not alive_any >> CODE_BITS:
            break
    for slot in _bits(alive >> CODE_BITS):
        real[slot] = done
    for slot in _bits(alive_any >> CODE_BITS):
        extra[slot] = done
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


def _record_drops(acc: list[int], code: int, done: int, depths: dict[int, int]) -> int:
    """Record where streams stop matching in one chunk's running AND; returns the last value.

    `acc[j]` is the AND of the entering mask and the chunk's first j values; it only loses
    bits, so it is numerically non-increasing and each distinct value's first position is a
    C-level bisection. A value whose code part is not `code` means a missing key or another
    namespace's entry: everything still matching stops there.
    """
    last = acc[-1]
    first = acc[0]
    if last == first:
        return last
    prev = first
    for value in sorted(set(acc), reverse=True)[1:]:
        j = bisect_left(acc, -value, key=neg)
        if value & CODE_MASK != code:
            value = code
        dropped = (prev & ~value) >> CODE_BITS
        for slot in _bits(dropped):
            depths[slot] = done + j - 1
        prev = value
        if value == code:
            return code
    return prev
