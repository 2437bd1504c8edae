"""What a relay says of one stream: the batches its subscriber accepted and the decisions it made.

`kvroute relay` (`router.cluster.relay`) runs the subscribers a router would run (gap repair,
epoch fence, restart detection: `indexer.stream`) and republishes, per (worker, dp rank)
stream and in the order they happen, everything its index took from them: each accepted batch
with the engine's seq, each clear, each state the stream entered. Replicas that follow the relay
(`indexer.fed_stream`) apply the records in order and so hold what the relay's index holds,
without a socket to any worker.

Records of one stream are numbered from 0 (`rseq`) within the relay process that wrote them
(`epoch`, random at its start): a follower that sees a number skipped, or another epoch, knows
it missed something (removals among it, maybe) and starts the stream afresh. A heartbeat takes
no number: losing one loses nothing.

Besides, the relay says it is alive on `<prefix>.relay.presence` (`RelayPresence`, core NATS,
not kept by the stream) several times a heartbeat interval, numbering what it says: NATS tells
a subscriber nothing of a publisher's death, and a stream's heartbeats come too seldom to bound
how long a follower trusts a dead relay's records (`heartbeat_timeout_s`, 3 s: QA saw 16 false
hits in it). Every record says how often its relay does that (`presence_s`; 0: a relay of the
version before, which does not) and how many it had said when it wrote the record
(`presence_n`): a record written after a presence the follower heard comes, in its stream,
after every record of that stream the relay wrote before. Every record also says which
KV-event endpoint the relay reads the stream from (`source`): the stream's id names only the
worker, and a replica whose worker of that id is another server (re-pointed through one side's
admin API) must not take the old server's pages for the new one's. Pure: no I/O.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from indexer.stats import StreamState

__all__ = [
    "PRESENCE_MISSES",
    "RelayKind",
    "RelayPresence",
    "RelayRecord",
    "presence_decoder",
    "presence_subject",
    "relay_decoder",
    "relay_encoder",
    "relay_subject",
]

# a relay whose presence has not come for this many of its intervals is taken for gone
PRESENCE_MISSES = 3


class RelayKind(enum.IntEnum):
    """What a record says."""

    BATCH = 0  # a batch the relay's subscriber accepted: `seq`, `payload`, `replayed`
    CLEAR = 1  # the relay dropped the stream's entries (restart, lost gap, lost batch)
    FORGET_SEQ = 2  # the stream will be rebuilt from 0: no seq and no fence known
    STATE = 3  # the stream entered `state`
    # unnumbered, every heartbeat interval: the relay is alive, stands at `rseq` with `state`
    # (STALE: it has not heard the worker for its stale_after_s; `heard_age_s` since it did),
    # its last batch is `seq` (digest `digest`), it has checked the stream for restarts
    # `checks` times and seen its publisher restart `restarts` times
    HEARTBEAT = 4


class RelayRecord(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One record of one stream (see the module docstring)."""

    kind: RelayKind
    stream: str  # "<worker>#dp<rank>" (`indexer.subscriptions.stream_id`)
    epoch: int
    rseq: int  # this record's number (a heartbeat: the last numbered record's; -1: none yet)
    state: StreamState  # the stream's state once this record is applied
    seq: int | None = None
    payload: bytes = b""
    replayed: bool = False
    digest: bytes = b""  # a heartbeat's: the last batch's `indexer.fence.payload_digest`
    heard_age_s: float = 0.0
    checks: int = 0
    # a heartbeat's: the publisher restarts the relay counted on the stream while it followed
    # its worker (a follower reads the worker's settings again when it rises: another process
    # may run another page size, ranks or role); appended last, so a relay or a follower of
    # the version before reads records of this one and the reverse (0: not said)
    restarts: int = 0
    # how often the relay that wrote it says it is alive (`RelayPresence`), in seconds: a
    # follower trusts the records of such a relay only while that word keeps coming (0: the
    # relay does not say it, a relay of the version before: its records' ages alone tell)
    presence_s: float = 0.0
    presence_n: int = 0  # how many presences the relay had said when it wrote this record
    # the KV-event endpoint the relay's subscriber of the stream reads (its
    # `StreamConfig.endpoint`): a follower whose worker of that id publishes elsewhere (the id
    # re-pointed at another server on one side only) takes none of its records
    # (`FedStream.take`). Appended last: "" is a relay of the version before, which does not
    # say it (its records are taken by the stream's id alone, as they were)
    source: str = ""


class RelayPresence(msgspec.Struct, frozen=True, array_like=True):
    """The relay process `epoch` is alive and writing; it says so again within `every_s`.
    `n`: how many it said before this one (records written after it say more)."""

    epoch: int
    every_s: Annotated[float, msgspec.Meta(gt=0.0)]
    n: int


relay_encoder = msgspec.msgpack.Encoder()
relay_decoder = msgspec.msgpack.Decoder(RelayRecord)
presence_decoder = msgspec.msgpack.Decoder(RelayPresence)


def relay_subject(prefix: str, stream: str) -> str:
    """The NATS subject of one stream's records: `<prefix>.events.<stream, hex>` (a worker id
    may hold dots, which are NATS token separators)."""
    return f"{prefix}.events.{stream.encode().hex()}"


def presence_subject(prefix: str) -> str:
    """The NATS subject of the relay's presence (outside `<prefix>.events.>`: not kept)."""
    return f"{prefix}.relay.presence"
