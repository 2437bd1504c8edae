"""Commands the tests start as real processes, and how they must end."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def ends_on_sigint(
    proc: asyncio.subprocess.Process,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`proc` for the block; after it, SIGINT must stop it with exit status 0 (asserted). A
    block that fails leaves no process behind: it is killed. What it writes to a pipe is left
    unread for the caller (a test reads its log after)."""
    try:
        yield proc
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
