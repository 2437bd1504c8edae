"""Fixtures of the indexer tests: `backend` (index tests that take it run on the compiled and the
Python backend) and `ctx` (a zmq context for the tests on real sockets)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from indexer.backend import PURE, Backend
from tests.indexer.backends import native_or_skip


@pytest.fixture(params=["native", "python"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend in turn."""
    return native_or_skip() if request.param == "native" else PURE


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A zmq context for a test's sockets, destroyed without lingering after it."""
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)
