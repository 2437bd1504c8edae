"""Getting the compiled backend in a test: its absence is a failure unless asked for."""

from __future__ import annotations

import pytest

from indexer.backend import NATIVE, NATIVE_ERROR, PURE_REQUESTED, Backend


def native_or_skip() -> Backend:
    """The compiled backend; its absence fails the test unless KVROUTE_PURE_PYTHON=1."""
    if NATIVE is None:
        if PURE_REQUESTED:
            pytest.skip(f"KVROUTE_PURE_PYTHON=1: {NATIVE_ERROR}")
        pytest.fail(
            f"{NATIVE_ERROR}: install with a C compiler (pip install -e .), "
            "or set KVROUTE_PURE_PYTHON=1 to test the fallbacks alone"
        )
    return NATIVE
