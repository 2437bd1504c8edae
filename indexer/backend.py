"""Which implementation of the index's hot parts runs: compiled (default) or pure Python.

Two C extensions, both optional at install time (`setup.py`): `indexer._intmap.IntMap`, the
index's int-keyed maps, and `indexer._keychain`, the block-key chain. Each has a pure-Python
twin giving identical results (`indexer.int_map.PyIntMap`, `indexer.namespace.py_chain` /
`partial_key`); tests run the index on both. `KVROUTE_PURE_PYTHON=1` forces the Python ones
(and makes the test suite accept their absence, which it otherwise reports as a failure).

The compiled chain is only used after it reproduced the Python keys on a probe input at import,
so keys can never silently differ between the two (snapshots and recordings persist them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple, cast

from indexer.int_map import PyIntMap
from indexer.namespace import partial_key, py_chain

__all__ = ["DEFAULT", "NATIVE", "NATIVE_ERROR", "PURE", "PURE_REQUESTED", "Backend"]

log = logging.getLogger(__name__)


class Backend(NamedTuple):
    """One consistent set of implementations for the index's hot parts."""

    name: str
    int_map: type[PyIntMap]  # IntMap(packed: bool) -> map; see indexer.int_map
    # chain(prev, tokens, block_size, start=0, count=-1) -> keys; see indexer.namespace
    chain: Callable[[int, Sequence[Hashable], int, int, int], list[int]]
    partial: Callable[[int, Sequence[Hashable]], int]


PURE = Backend("python", PyIntMap, py_chain, partial_key)

PURE_REQUESTED = os.environ.get("KVROUTE_PURE_PYTHON", "") not in ("", "0")


def _load_native() -> tuple[Backend | None, str | None]:
    try:
        from indexer import _intmap, _keychain
    except ImportError as exc:
        return None, f"C extensions not built ({exc})"
    tokens = [*range(-3, 70), 2**61 - 1, 2**64 + 5, True]
    try:
        for prev in (0, -1, 2**63 - 1, -(2**63), 12345678901234567):
            for start, count in ((0, -1), (1, 2)):
                want = py_chain(prev, tokens, 7, start, count)
                if _keychain.chain(prev, tokens, 7, start, count) != want:
                    return None, "compiled key chain disagrees with the Python one"
            if _keychain.partial(prev, tokens[:5]) != partial_key(prev, tokens[:5]):
                return None, "compiled partial-page key disagrees with the Python one"
        probe = _intmap.IntMap(True)
        probe.update([(1, 2), (b"h", -(2**63))])
        if probe.get_many([1, b"h", 3], 0) != [2, -(2**63), 0]:
            return None, "compiled int map gives wrong results"
    except Exception as exc:  # a stale or broken build must not take the index down
        return None, f"C extensions unusable ({type(exc).__name__}: {exc})"
    return Backend(
        "native", cast(type[PyIntMap], _intmap.IntMap), _keychain.chain, _keychain.partial
    ), None


NATIVE, NATIVE_ERROR = _load_native()
if NATIVE is None and not PURE_REQUESTED:
    log.warning("indexer runs on its pure-Python fallbacks: %s", NATIVE_ERROR)

DEFAULT = PURE if PURE_REQUESTED or NATIVE is None else NATIVE
