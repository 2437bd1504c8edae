"""What identifies a server's KV-event stream whatever worker id follows it, or spells it.

An `extra_key` request's shadows (`indexer.shadowed`) are of the server's cache: a worker that
leaves parks them for its server's stream, and a worker added on that stream again takes them
(`IndexerService`). The stream is its events endpoint's port (an `ipc://` path), topic and dp
rank, and its host compared by what the spelling shows (`indexer.hosts`): `tcp://localhost:P`
and `tcp://127.0.0.1:P` are one stream, a Service name and a pod IP may be. A publisher is
one engine's cache (`IndexerService.sharing` refuses a second worker on one endpoint), so two
streams that may be one server's are taken for one where that errs safe: a stream added on
one that surely is the parked one takes its shadows; on one that only may be, it gets a copy
(another stream may be the server too), and over-adopting only hides pages.
"""

from __future__ import annotations

import os.path
from typing import NamedTuple

from indexer.config import StreamConfig
from indexer.hosts import may_be_one_host, one_host

__all__ = ["ServerStream", "same_endpoint", "server_stream"]


class ServerStream(NamedTuple):
    """A server's stream as its config spells it (`server_stream`)."""

    scheme: str  # "tcp" or "ipc"
    host: str  # as spelled ("" for ipc)
    where: str  # the port (tcp), the normalized path (ipc)
    topic: str
    dp_rank: int

    def same(self, other: ServerStream) -> bool:
        """Whether `other` is surely this stream (its host is surely this one's)."""
        return self._alike(other) and one_host(self.host, other.host)

    def may_be(self, other: ServerStream) -> bool:
        """Whether `other` may be this stream: it is not surely another (`indexer.hosts`)."""
        return self._alike(other) and may_be_one_host(self.host, other.host)

    def _alike(self, other: ServerStream) -> bool:
        return (self.scheme, self.where, self.topic, self.dp_rank) == (
            other.scheme,
            other.where,
            other.topic,
            other.dp_rank,
        )


def server_stream(cfg: StreamConfig) -> ServerStream:
    """The server's stream `cfg` subscribes to (`tcp://HOST:PORT`, `ipc://PATH`: as
    `indexer.config.endpoint_problem` accepts them)."""
    scheme, host, where = _endpoint(cfg.endpoint)
    return ServerStream(scheme, host, where, cfg.topic, cfg.dp_rank)


def same_endpoint(a: str, b: str) -> bool:
    """Whether two spellings of a KV-event endpoint surely name one socket (a relay's and a
    replica's of one worker: `indexer.fed_stream`): one scheme, port or path, and hosts that
    are surely one (`indexer.hosts.one_host`). Two that only may be one are not: taking
    another server's events for this one's would predict pages it does not hold."""
    one, other = _endpoint(a), _endpoint(b)
    return one[0::2] == other[0::2] and one_host(one[1], other[1])


def _endpoint(endpoint: str) -> tuple[str, str, str]:
    """(scheme, host as spelled, port or normalized path) of `endpoint`."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc":
        return scheme, "", os.path.normpath(rest)
    host, _, port = rest.rpartition(":")
    return scheme, host, str(int(port)) if port.isdigit() else port
