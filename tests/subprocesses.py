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
    """`proc` for the block; after it, SIGINT must stop it with exit status 0 (asserted), what
    it still writes to a pipe read meanwhile (a full pipe would stall its exit). A block that
    fails leaves no process behind: it is killed."""
    try:
        yield proc
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
