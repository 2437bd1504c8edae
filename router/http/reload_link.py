"""The line from each `kvroute serve --processes N` child to its parent: a reload one child is
asked for (`POST /admin/reload`) reaches its siblings.

The kernel hands an admin connection to one child of the shared port. Reloaded alone, that
child ran the new limits, weights and timeouts while the others kept the old ones (only worker
changes travel through the cluster's fleet), and a second reload landing elsewhere answered
`"changed": []`: nothing said the processes disagreed. SIGHUP to the parent always reached them
all; now the HTTP reload does too.

Each child gets one end of a socket pair (`--reload-fd`). After reloading the file itself, a
child writes `reload`; the parent sends SIGHUP to every other running child, as it does for its
own SIGHUP, and answers `told K of N`. The siblings read the same file, so they apply (or
refuse) what the first one did; a child restarting meanwhile reads it as it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

import msgspec

__all__ = ["RELOAD_TIMEOUT_S", "ProcessesTold", "ReloadLink", "answer_child"]

log = logging.getLogger(__name__)

RELOAD_TIMEOUT_S = 5.0  # the parent only sends signals: it answers at once unless it is gone


class ProcessesTold(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The `processes` of a reload's answer under `--processes N`."""

    count: int | None  # N (None: the parent did not answer)
    told: int  # the other processes told to read the file (a restarting one is not counted)
    error: str | None = None  # why the others may not have been told


class ReloadLink:
    """The child's end: `tell_siblings` asks the parent to reload the other processes."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()  # one question at a time: answers come back in order

    async def tell_siblings(self) -> ProcessesTold:
        """Ask the parent to SIGHUP the other processes; what it did (never raises: this
        process has reloaded already, its answer must say so whatever the parent does)."""
        async with self._lock:
            try:
                if self._streams is None:
                    sock = socket.socket(fileno=self._fd)
                    self._streams = await asyncio.open_unix_connection(sock=sock)
                reader, writer = self._streams
                writer.write(b"reload\n")
                async with asyncio.timeout(RELOAD_TIMEOUT_S):
                    await writer.drain()
                    words = (await reader.readline()).split()
                # b"told", K, b"of", N
                if len(words) != 4 or words[0] != b"told":
                    raise ConnectionError("the parent process closed the link")
                return ProcessesTold(count=int(words[3]), told=int(words[1]))
            except (OSError, TimeoutError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.warning(
                    "config reloaded here, but the other processes could not be told (%s): "
                    "send SIGHUP to the parent",
                    why,
                )
                return ProcessesTold(count=None, told=0, error=why)

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
        else:
            with contextlib.suppress(OSError):
                socket.socket(fileno=self._fd).close()


async def answer_child(sock: socket.socket, tell_others: Callable[[], tuple[int, int]]) -> None:
    """The parent's end for one child, until that child is gone: each `reload` it writes is
    answered once `tell_others()` has signalled the others ((told, of processes))."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        while line := await reader.readline():
            if line.strip() != b"reload":
                continue  # nothing else is spoken here; a newer child's word is ignored
            told, count = tell_others()
            writer.write(f"told {told} of {count}\n".encode())
            await writer.drain()
    except (ConnectionError, OSError):
        pass  # the child exited mid-answer: it is restarted, with a new link
    finally:
        writer.close()
