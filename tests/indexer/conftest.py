"""The `backend` fixture: index tests that take it run on the compiled and the Python backend."""

from __future__ import annotations

import pytest

from indexer.backend import PURE, Backend
from tests.indexer.backends import native_or_skip


@pytest.fixture(params=["native", "python"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend in turn."""
    return native_or_skip() if request.param == "native" else PURE
