"""The NATS client kvroute connects with: it never sends CONNECT in plain text to a `tls://` server.

Replicas (`router.cluster.service`) and the relay (`router.cluster.relay_publisher`) both use it:
the relay connected with nats-py's own client, so a `tls://` URL whose server answered in plain
text got the URL's user and password in clear."""

from __future__ import annotations

import asyncio

import nats.errors
from nats.aio.client import Client as NATS

__all__ = ["TlsGuardedClient", "TlsNotOffered"]


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
