"""The NATS client kvroute connects with: it never sends CONNECT in plain text to a `tls://` server;
how a client closed for good is replaced; and how one is told to stop retrying.

Replicas (`router.cluster.service`) and the relay (`router.cluster.relay_publisher`) both use it:
the relay connected with nats-py's own client, so a `tls://` URL whose server answered in plain
text got the URL's user and password in clear."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from urllib.parse import unquote

import nats.errors
from nats.aio.client import Client as NATS

__all__ = [
    "Replacements",
    "TlsGuardedClient",
    "TlsNotOffered",
    "attempt_error",
    "close_client",
    "stop_retrying",
]

log = logging.getLogger(__name__)


class TlsNotOffered(nats.errors.Error):
    """A `tls://` server answered in plain text: CONNECT (and the credentials) not sent."""

    def __str__(self) -> str:
        return "the NATS server did not offer TLS"


def _encrypted(nc: NATS) -> bool:
    """Whether the client's socket speaks TLS now (nats-py has no public accessor for it)."""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    if not isinstance(writer, asyncio.StreamWriter):
        return False  # a transport this check does not know: taken as plain text
    return writer.get_extra_info("ssl_object") is not None


class TlsGuardedClient(NATS):
    """nats-py's client, refusing to write CONNECT in plain text to a `tls://` server.

    nats-py (2.16) upgrades to TLS only when the server's INFO says `tls_required`, whatever
    the URL's scheme or a `tls=` context, then writes CONNECT, with the URL's user and password
    or token, on whatever socket it has. CONNECT is built between the two, on the first connect
    and on every reconnect: refusing there drops the socket before a byte of ours is on it,
    and the client counts a failed attempt (`error_cb`) and tries again later."""

    def _connect_command(self) -> bytes:
        server = self._current_server
        if server is not None and server.uri.scheme == "tls" and not _encrypted(self):
            raise TlsNotOffered
        return super()._connect_command()


def stop_retrying(nc: NATS) -> None:
    """Have `nc`'s connect and reconnect loops end at their next failed attempts (nats-py's
    NoServersError), for a replica or relay that stops: with `max_reconnect_attempts=-1` they
    retry forever, and a cancellation landing as an attempt fails is lost
    (`router.cluster.tasks`). The client's own limit of attempts per server, read at each one,
    is lowered to 1: a server that failed twice is dropped at once (one that failed less, after
    one or two more attempts), and the client, out of servers, gives up (a limit of 0 would
    drop none)."""
    nc.options["max_reconnect_attempts"] = 1


def attempt_error(exc: BaseException, servers: Sequence[str]) -> str:
    """A failed connect attempt as a log line may show it (`ConnectionRefusedError: [Errno
    111] ...`): the type and the text, with the password or token of each of `servers` (as
    written, and %-decoded, as the client sends it) hidden, should the text ever hold one."""
    text = str(exc)
    if not text and isinstance(exc, TimeoutError):
        # nats-py's connect timeout says nothing: the TCP connect, or the server's INFO line
        text = "no answer within the client's connect timeout (a server that is not NATS?)"
    said = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    for url in servers:
        rest = url.partition("://")[2]
        at = rest.rfind("@")
        if at < 0:
            continue
        info = rest[:at]
        user, colon, password = info.partition(":")
        secret = password if colon else user  # a token stands in the user's place
        for text in sorted({info, secret, unquote(secret)} - {""}, key=len, reverse=True):
            said = said.replace(text, "***")
    return said


async def close_client(nc: NATS, within_s: float) -> None:
    """Close `nc` for a replica or relay that stops, within `within_s`, raising nothing.

    nats-py's close writes what the client buffered to its transport before closing it. While
    NATS is away (reconnecting) that transport is the connection that dropped: uvloop refuses
    the write (`RuntimeError: unable to perform operation on <TCPTransport closed=True ...>`),
    the close stops there (its subscriptions' tasks and callbacks left) and the error ended the
    process with status 1 and a traceback (QA: a replica stopped after NATS was down ~20 s,
    when its heartbeats had filled the buffer). What the client buffered then can reach no
    server (it would go first on a new connection, which a stopping client never makes): it is
    dropped first, and the close runs to its end. Connected, it is written as before."""
    if not nc.is_connected:
        # nats-py has no public way to drop it: its close writes `_pending` when its size says
        nc._pending = []
        nc._pending_data_size = 0
    try:
        async with asyncio.timeout(within_s):
            await nc.close()
    except (nats.errors.Error, TimeoutError, OSError, RuntimeError) as exc:
        # a transport that refuses in some other way: the connection goes with the process
        log.debug("NATS client not closed cleanly (%s: %s)", type(exc).__name__, exc)


class Replacements:
    """The pauses between NATS clients that replace one closed for good, and which closings are
    news.

    nats-py closes its client for good, and reconnects no more, on a server's `-ERR` other than
    a stale connection or a permissions violation (a line past the server's control line limit,
    credentials revoked while connected). A replica or the relay then connects a new client
    after a pause: `first_s`, doubling up to `longest_s` while each new client closes before it
    did its work (a server refusing each at once). Within one such incident, a closing is said
    once per reason; a client that did its work (`worked`) ends the incident."""

    def __init__(self, first_s: float = 0.5, longest_s: float = 10.0) -> None:
        self._first_s = first_s
        self._longest_s = longest_s
        self.pause_s = first_s
        self._said: set[str] = set()

    def worked(self) -> None:
        """The client did its work (resynced, wrote): its closing, if any, is a new incident."""
        self.pause_s = self._first_s
        self._said.clear()

    def closed(self, nc: NATS) -> str | None:
        """Why nats-py closed `nc` for good ("" when it kept no error), or None when this
        incident said that reason already."""
        error = nc.last_error
        reason = f"{type(error).__name__}: {error}" if error else ""
        if reason in self._said:
            return None
        self._said.add(reason)
        return reason

    def say_closed(self, nc: NATS, log: logging.Logger, who: str, meanwhile: str = "") -> None:
        """One WARNING that `who`'s client `nc` was closed for good and a new one connects
        (`meanwhile`: what waits for it), unless this incident said its reason already."""
        reason = self.closed(nc)
        if reason is not None:
            log.warning(
                "%s: the NATS client was closed for good%s; connecting again with a new one%s",
                who,
                f" ({reason})" if reason else "",
                f", {meanwhile}" if meanwhile else "",
            )

    async def pause(self) -> None:
        """Wait before the next client; the wait after it is twice as long (up to the cap)."""
        await asyncio.sleep(self.pause_s)
        self.pause_s = min(self.pause_s * 2, self._longest_s)
