"""The line from each `kvroute serve --processes N` child to its parent: a reload one child is
asked for (`POST /admin/reload`) reaches its siblings.

The kernel hands an admin connection to one child of the shared port. Reloaded alone, that
child ran the new limits, weights and timeouts while the others kept the old ones (only worker
changes travel through the cluster's fleet), and a second reload landing elsewhere answered
`"changed": []`: nothing said the processes disagreed. SIGHUP to the parent always reached them
all; now the HTTP reload does too.

Each child gets one end of a socket pair (`--reload-fd`). After reloading the file itself, a
child writes `{"reload": id}` (a JSON line); the parent sends SIGHUP to every other listening
child, as it does for its own SIGHUP, and answers `{"id": id, "told": {...}}`: how many it told,
and how many are still starting (each is told once it listens: signalled before its handler was
up, it died, and it may have read the file before the change). The siblings read the same file,
so they apply (or refuse) what the first one did; a child started after the reload reads it as
it starts.

Answers are matched to questions by id: a parent stalled past `RELOAD_TIMEOUT_S` answers later,
and that late answer, left in the socket, was taken for the next question's. A link closed (the
child shutting down) is never used again: its descriptor number may be another socket's by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable

import msgspec

__all__ = ["RELOAD_TIMEOUT_S", "ProcessesTold", "ReloadLink", "answer_child"]

log = logging.getLogger(__name__)

RELOAD_TIMEOUT_S = 5.0  # the parent only sends signals: it answers at once unless it is gone


class ProcessesTold(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The `processes` of a reload's answer under `--processes N`."""

    count: int | None  # N (None: the parent did not answer)
    told: int  # the other processes told to read the file now
    starting: int = 0  # others still starting: each is told once it listens
    # others exited and waiting to be restarted: each reads the file as it starts
    restarting: int = 0
    error: str | None = None  # why the others may not have been told


class _Ask(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Child to parent: reload the others."""

    reload: int  # the question's id


class _Answer(msgspec.Struct, frozen=True):
    """Parent to child: what it did for question `id`."""

    id: int
    told: ProcessesTold


_encode = msgspec.json.Encoder().encode
_decode_ask = msgspec.json.Decoder(_Ask).decode
_decode_answer = msgspec.json.Decoder(_Answer).decode


class ReloadLink:
    """The child's end: `tell_siblings` asks the parent to reload the other processes."""

    def __init__(self, fd: int, timeout_s: float = RELOAD_TIMEOUT_S) -> None:
        self._fd = fd
        self._timeout_s = timeout_s
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()  # one question at a time
        self._asked = 0  # the last question's id
        self._closed = False

    async def tell_siblings(self) -> ProcessesTold:
        """Ask the parent to SIGHUP the other processes; what it did (never raises: this
        process has reloaded already, its answer must say so whatever the parent does)."""
        async with self._lock:
            if self._closed:
                return self._shutting_down()
            self._asked += 1
            asked = self._asked
            try:
                if self._streams is None:
                    sock = socket.socket(fileno=self._fd)
                    self._streams = await asyncio.open_unix_connection(sock=sock)
                reader, writer = self._streams
                writer.write(_encode(_Ask(reload=asked)) + b"\n")
                async with asyncio.timeout(self._timeout_s):
                    await writer.drain()
                    while True:
                        line = await reader.readline()
                        if not line:
                            raise ConnectionError("the parent process closed the link")
                        answer = _decode_answer(line)
                        if answer.id == asked:
                            return answer.told
                        # a late answer to a question this process stopped waiting for
                        log.debug("stale answer of the parent dropped: %s", line)
            except (OSError, TimeoutError, ValueError) as exc:  # msgspec.DecodeError included
                if self._closed:  # closed while waiting
                    return self._shutting_down()
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.warning(
                    "config reloaded here, but the other processes could not be told (%s): "
                    "send SIGHUP to the parent",
                    why,
                )
                return ProcessesTold(count=None, told=0, error=why)

    def _shutting_down(self) -> ProcessesTold:
        # the parent is stopping every process: there is nobody to tell, nor to SIGHUP
        log.warning(
            "config reloaded here while shutting down: the other processes, stopping "
            "too, are not told"
        )
        return ProcessesTold(count=None, told=0, error="shutting down")

    def close(self) -> None:
        """Close the link for good (its descriptor too, whose number is free again)."""
        if self._closed:
            return
        self._closed = True
        if self._streams is not None:
            self._streams[1].close()
        else:
            with contextlib.suppress(OSError):
                os.close(self._fd)


async def answer_child(sock: socket.socket, tell_others: Callable[[], ProcessesTold]) -> None:
    """The parent's end for one child, until that child is gone: each question it writes is
    answered, under its id, once `tell_others()` has signalled the others."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        while line := await reader.readline():
            try:
                ask = _decode_ask(line)
            except msgspec.DecodeError:
                continue  # nothing else is spoken here; a newer child's word is ignored
            writer.write(_encode(_Answer(id=ask.reload, told=tell_others())) + b"\n")
            await writer.drain()
    except (ConnectionError, OSError):
        pass  # the child exited mid-answer: it is restarted, with a new link
    finally:
        writer.close()
