"""What a relay says of one stream: the batches its subscriber accepted and the decisions it made.

`kvroute relay` (`router.cluster.relay`) runs the subscribers a router would run (gap repair,
epoch fence, restart detection: `indexer.subscriber`) and republishes, per (worker, dp rank)
stream and in the order they happen, everything its index took from them: each accepted batch
with the engine's seq, each clear, each state the stream entered. Replicas that follow the relay
(`indexer.fed_stream`) apply the records in order and so hold what the relay's index holds,
without a socket to any worker.

Records of one stream are numbered from 0 (`rseq`) within the relay process that wrote them
(`epoch`, random at its start): a follower that sees a number skipped, or another epoch, knows
it missed something (removals among it, maybe) and starts the stream afresh. A heartbeat takes
no number: losing one loses nothing. Pure: no I/O.
"""

from __future__ import annotations

import enum

import msgspec

from indexer.stats import StreamState

__all__ = ["RelayKind", "RelayRecord", "relay_decoder", "relay_encoder", "relay_subject"]


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


relay_encoder = msgspec.msgpack.Encoder()
relay_decoder = msgspec.msgpack.Decoder(RelayRecord)


def relay_subject(prefix: str, stream: str) -> str:
    """The NATS subject of one stream's records: `<prefix>.events.<stream, hex>` (a worker id
    may hold dots, which are NATS token separators)."""
    return f"{prefix}.events.{stream.encode().hex()}"
