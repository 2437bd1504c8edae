"""Configuration of the indexer service and of each subscribed stream (frozen, validated)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from indexer.engines import EngineName
from indexer.protocol.wire import MAX_BLOCK_SIZE

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_DP_SIZE",
    "IndexerConfig",
    "StreamConfig",
    "endpoint_problem",
    "ranks_problem",
    "shown_endpoint",
]

# The most data-parallel ranks one worker may have. The largest DP deployments run a few
# hundred ranks per engine (wide expert parallelism, one attention DP rank per GPU); each rank
# is a stream of its own, on a PUB port and a replay port of its own (rank r on the base port
# + r), so 1024 leaves room past any of them while its ports fit in 1-65535 from most bases.
# Checked before any per-rank list is built: a dp_size of 10**9 took the router's memory
# building one endpoint per rank before a port was looked at.
MAX_DP_SIZE = 1024


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a ZMQ endpoint a subscriber would connect to, None when it is one:
    `tcp://HOST:PORT` (a port 1-65535; `*` as the host, as engines advertise what they bound,
    is read as the worker's own host) or `ipc://PATH`. Checked where it is configured, since
    zmq refuses a bad one only inside the subscriber, which retries it forever."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc"):
        return "expected tcp://HOST:PORT or ipc://PATH"
    if scheme == "tcp" and "@" in rest:
        return "carries credentials (user:password@), which ZMQ never sends"
    if scheme == "ipc":
        return None if rest else "ipc:// names no path"
    host, _, port = rest.rpartition(":")
    if not host:
        return "expected tcp://HOST:PORT"
    # ASCII digits only, at most 5 of them: str.isdigit takes "²" (which int() refuses) and
    # other scripts' digits, and int() refuses a string of over 4300 digits
    if not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 < int(port) < 65536:
        return f"the port must be 1-65535, got {port[:16]!r}"
    return None


def ranks_problem(endpoint: str, dp_size: int) -> str | None:
    """What is wrong with `dp_size` data-parallel ranks on `endpoint` (a sound one:
    `endpoint_problem`), rank r on its port + r, None when nothing is: more ranks than
    `MAX_DP_SIZE`, or ports past 65535."""
    if dp_size > MAX_DP_SIZE:
        return f"dp_size {dp_size} is over {MAX_DP_SIZE}, the most ranks a worker may have"
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None  # an ipc:// path has no port to offset (`dp_size` 1 only: discovery)
    port = int(rest.rpartition(":")[2])
    if port + dp_size - 1 > 65535:
        return (
            f"{dp_size} ranks from port {port} (rank r on port + r) run to port "
            f"{port + dp_size - 1}, past 65535"
        )
    return None


def shown_endpoint(endpoint: str) -> str:
    """`endpoint` (or any URL) as a message may show it: everything before its last `@` after
    the scheme hidden (`tcp://***@host:5557`), a password holding a `/` or an `@` too."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        scheme, rest = "", endpoint
    at = rest.rfind("@")
    if at < 0:
        return endpoint
    return f"{scheme}{sep}***@{rest[at + 1 :]}"


class StreamConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One (worker, dp rank) KV-event stream to subscribe to."""

    endpoint: str  # "tcp://127.0.0.1:5557", the PUB of this (worker, dp rank)
    replay_endpoint: str | None = None  # ROUTER replay socket, or None (gaps then clear the stream)
    topic: str = ""  # subscription PREFIX (never compared for equality)
    # None: learned from the wire
    block_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)] | None = None
    engine: EngineName = "sglang"  # its wire rules: indexer.engines
    dp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_DP_SIZE)] = 0
    model: str = ""
    # whether the replay socket is known to be this stream's publisher's (the worker
    # advertises both sockets as these): when not, what a replay brings predicts nothing until
    # the socket's bytes agree with the live stream's (a `replay` behind mapped ports, or of
    # an engine that advertises nothing, may be another worker's)
    replay_proven: bool = True
    # the event and replay sockets the worker advertises for this rank (None: it advertises
    # none, or was not asked): when the two configured ones disagree about the publisher, they
    # say which of them is likely the wrong one (`indexer.stream.disagreement`'s `_disagree`)
    advertised_endpoint: str | None = None
    advertised_replay: str | None = None


class IndexerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Tuning of the indexer service; every field has a working default."""

    pending_ttl_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    stale_after_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    replay_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    rcv_hwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000  # SUB queue; overflow shows as gaps
    log_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0  # per stream and kind of problem
    yield_every: Annotated[int, msgspec.Meta(gt=0)] = 64  # messages before yielding the loop
    restart_backoff_max_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # When a stream has been quiet this long, ask its replay socket for anything newer than
    # what was applied. PUB drops silently, so a batch published before our SUB connected, or
    # a dropped last batch, would otherwise stay unknown until the worker publishes again
    # (which an idle worker may never do). A publisher that answers is alive, so this also
    # keeps an idle but healthy stream from going STALE. 0 disables it.
    probe_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    # How often a busy stream asks its replay socket for a live batch it applied (each batch
    # of a quiet one, up to 4 in 4 intervals): the one check that a live stream which follows
    # on in seq is its own worker's (a forwarder re-pointed at another worker predicts that
    # worker's cache for up to this long). Each check is a replay round trip carrying the
    # interval's batches: a fleet of many busy ranks may trade a longer window for less
    # replay traffic. There is no off: without checks nothing shows a re-pointed forwarder
    live_check_interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 1.0
