"""The query walk: one pass over a request's blocks against the shared table.

Pure and allocation-light: chain keys (`indexer.namespace.chain_keys`, the very function the
event side uses) and table lookups are C-level passes over chunks of blocks (64, then doubling
up to 256: a prompt that shares only a system prompt stops after the first chunk, one held to
the end takes four passes); the running AND only visits the few distinct holder sets. See
`indexer.index` for the layout of table values: `(stream bits << CODE_BITS) | namespace code`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from itertools import repeat
from operator import or_

from indexer.namespace import chain_keys

__all__ = ["CODE_BITS", "CODE_MASK", "NS_BITS", "NS_MASK", "ns_code", "walk_prefix"]

NS_BITS = 24
NS_MASK = (1 << NS_BITS) - 1
CODE_BITS = 2 * NS_BITS
CODE_MASK = (1 << CODE_BITS) - 1
# request blocks hashed and looked up per C-level pass: small first (a prompt sharing only a
# system prompt stops early), then growing (fewer passes for a prompt held to the end)
_FIRST_CHUNK = 64
_MAX_CHUNK = 256


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
    keep_keys = bool(tiers_table)
    all_keys: list[int] = []
    real: dict[int, int] = {}
    extra: dict[int, int] = {}
    done = 0
    alive_any = alive
    size = _FIRST_CHUNK
    while True:
        # the very function the event side uses (one key scheme), a chunk of tokens at a time
        keys = chain_keys(key, tokens[done * block_size : (done + size) * block_size], block_size)
        if not keys:
            break
        key = keys[-1]
        if keep_keys:
            all_keys.extend(keys)
        values = list(map(table_get, keys, repeat(0)))
        if alive >> CODE_BITS:
            alive = _record_drops(values, alive, code, done, real)
        if pending:
            # pending values carry every code bit: they neither break nor prove a namespace
            # (their keys are namespace-seeded); real entries of another namespace still do
            held = list(map(or_, values, map(pending.get, keys, repeat(0))))
            alive_any = _record_drops(held, alive_any, code, done, extra)
        else:
            alive_any = alive
        done += len(keys)
        if not alive_any >> CODE_BITS:
            break
        size = min(2 * size, _MAX_CHUNK)
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
        for slot in _bits((alive & ~now) >> CODE_BITS):
            depths[slot] = done + j
        alive = now
        if alive == code:
            break
    return alive
