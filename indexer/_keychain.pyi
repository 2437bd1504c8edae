"""Typed stub for the compiled `indexer._keychain` extension (source: `_keychain.c`).

The block-key chain of `indexer.namespace` in C; every key equals the Python one.
"""

from collections.abc import Hashable, Sequence

def chain(
    prev: int,
    tokens: Sequence[Hashable],
    block_size: int,
    start: int = 0,
    count: int = -1,
    /,
) -> list[int]:
    """Keys of full blocks `start`, `start + 1`, ... (at most `count`; -1: all) after `prev`."""

def partial(prev: int, tokens: Sequence[Hashable], /) -> int:
    """Key of a trailing partial page: `hash((prev, tuple(tokens), len(tokens)))`."""

def int_hash(x: int, /) -> int:
    """CPython's `hash` of the int `x` (computed by the extension's own int64 path; for tests)."""
