"""`PyIntMap`: the pure-Python stand-in for the compiled `indexer._intmap.IntMap`.

The index's two big maps (block key -> holder value, and per stream engine hash -> block key)
are int-keyed. The compiled map stores them in a flat open-addressing array of 16-byte slots,
which is what brings an indexed entry under ~120 bytes and lets a query prefetch its lookups;
this dict subclass has the same methods and results, for machines that could not build it
(`indexer.backend` picks one). Only what the index uses is part of the contract:

- the mapping basics: `len`, `in`, `[]`, `get`, `pop`, `setdefault`, `update`, `clear`,
  iteration, `keys` / `values` / `items` (the compiled map returns lists: callers only iterate);
- `isdisjoint(keys)`: no element of `keys` is a key (dict only has it on its keys view);
- `get_many(keys, default)`: one value (or `default`) per key, in order: the query's lookups;
- an event's bulk operations: `assign(keys, value)`, `pop_many(keys, default)` and
  `insert_new(keys, values)` (all or nothing: inserts only when no key is present or repeats);
- `or_many(keys, mask)`: each key's value (0 when absent) ORed with `mask` (pending marks);
- `pop_by_value(other)`: remove the entries whose value is a key of `other` (evicting a
  namespace: a stream's entries of a set of block keys);
- `packed`: the compiled map stores values inline as int64 when True (per-stream maps, whose
  values are block keys) and as shared int objects otherwise (the table, whose values are wide
  holder bit sets). Here it changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from typing import TypeVar

__all__ = ["PyIntMap"]

_T = TypeVar("_T")


class PyIntMap(dict[int | bytes, int]):
    """A dict with the compiled map's extra methods (keys are ints or bytes, values ints)."""

    __slots__ = ()

    def __init__(self, packed: bool = False) -> None:
        super().__init__()

    def isdisjoint(self, keys: Iterable[int | bytes], /) -> bool:
        """True when no element of `keys` is a key of this map."""
        return self.keys().isdisjoint(keys)

    def get_many(self, keys: Iterable[int | bytes], default: _T, /) -> list[int | _T]:
        """The value of every key of `keys` (`default` when absent), in order."""
        return list(map(self.get, keys, repeat(default)))

    def assign(self, keys: Iterable[int | bytes], value: int, /) -> None:
        """Set every key of `keys` to `value`."""
        self.update(zip(keys, repeat(value)))

    def pop_many(self, keys: Iterable[int | bytes], default: _T, /) -> list[int | _T]:
        """Remove each key; the values (`default` for absent keys), in order."""
        return list(map(self.pop, keys, repeat(default)))

    def insert_new(self, keys: Iterable[int | bytes], values: Iterable[int], /) -> bool:
        """Insert every pair when no key is present and none repeats; else change nothing."""
        keys = tuple(keys)
        values = tuple(values)
        if len(keys) != len(values):
            raise ValueError(f"insert_new got {len(keys)} keys and {len(values)} values")
        if not self.keys().isdisjoint(keys):
            return False
        before = len(self)
        self.update(zip(keys, values, strict=True))
        if len(self) - before != len(keys):
            for key in keys:
                self.pop(key, None)
            return False
        return True

    def pop_by_value(self, other: PyIntMap, /) -> list[tuple[int | bytes, int]]:
        """Remove every entry whose value is a key of `other`; the removed (key, value) pairs."""
        gone = [(k, v) for k, v in self.items() if v in other]
        for k, _ in gone:
            del self[k]
        return gone

    def or_many(self, keys: Iterable[int | bytes], mask: int, /) -> None:
        """Set every key to its value (0 when absent) ORed with `mask`."""
        for key in keys:
            self[key] = self.get(key, 0) | mask
