"""ZMQ frame layouts of the KV-event transport: live messages and the replay exchange.

Live (PUB -> SUB): `[topic, seq (8 bytes big-endian), payload]`.
Replay (DEALER -> ROUTER): request `[b"", start_seq]`; replies, after the empty delimiter,
`[seq, payload]` (SGLang <= 0.5.21, vLLM <= 0.25) or `[topic, seq, payload]` (newer), then an
end marker whose seq is END_SEQ: `[END, b""]` or `[b"", END, b""]`. With an empty topic a data
reply and the newer end marker have the same frame count; only the seq frame tells them apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from indexer.errors import ProtocolError

__all__ = [
    "END_SEQ",
    "LiveMessage",
    "ReplayData",
    "ReplayEnd",
    "build_live",
    "build_replay_end",
    "build_replay_reply",
    "build_replay_request",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "topic_matches",
]

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
_SEQ_LEN = 8


class LiveMessage(msgspec.Struct, frozen=True, gc=False):
    """One live message as a SUB socket receives it."""

    topic: bytes
    seq: int
    payload: bytes


class ReplayData(msgspec.Struct, frozen=True, gc=False):
    """One replayed batch; `topic` is None in the old layout that has no topic frame."""

    topic: bytes | None
    seq: int
    payload: bytes


class ReplayEnd(msgspec.Struct, frozen=True, gc=False):
    """The end marker: the publisher has sent everything it still buffers."""


def pack_seq(seq: int) -> bytes:
    """Encode a sequence number as the 8-byte big-endian frame."""
    if not 0 <= seq <= END_SEQ:
        raise ProtocolError(f"seq {seq} does not fit in 64 unsigned bits")
    return seq.to_bytes(_SEQ_LEN, "big")


def _unpack_seq(frame: bytes, what: str) -> int:
    if len(frame) != _SEQ_LEN:
        raise ProtocolError(f"{what} seq frame has {len(frame)} bytes, expected {_SEQ_LEN}")
    return int.from_bytes(frame, "big")


def topic_matches(topic: bytes, prefix: bytes) -> bool:
    """ZMQ subscription semantics: a topic matches when it starts with the prefix."""
    return topic.startswith(prefix)


def build_live(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """Frames of one live message."""
    return [topic, pack_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """Parse the 3 frames a SUB socket received."""
    if len(frames) != 3:
        raise ProtocolError(f"live message has {len(frames)} frames, expected 3")
    topic, seq, payload = frames
    return LiveMessage(topic=bytes(topic), seq=_unpack_seq(seq, "live"), payload=bytes(payload))


def build_replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to ask for every buffered batch with seq >= start_seq."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> int:
    """The start seq of a request as a ROUTER receives it, identity frame already removed."""
    if len(frames) != 2 or frames[0] != b"":
        raise ProtocolError(f"replay request must be [b'', seq], got {len(frames)} frames")
    return _unpack_seq(frames[1], "replay request")


def build_replay_reply(topic: bytes | None, seq: int, payload: bytes) -> list[bytes]:
    """Frames of one replayed batch after the delimiter (topic layout unless topic is None)."""
    head = [b""] if topic is None else [b"", topic]
    return [*head, pack_seq(seq), payload]


def build_replay_end(*, with_topic: bool = True) -> list[bytes]:
    """Frames of the end marker, in the layout matching `build_replay_reply`."""
    return [b"", b"", pack_seq(END_SEQ), b""] if with_topic else [b"", pack_seq(END_SEQ), b""]


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayData | ReplayEnd:
    """Parse one reply as a DEALER receives it (leading empty delimiter included)."""
    if not frames or frames[0] != b"":
        raise ProtocolError("replay reply does not start with the empty delimiter")
    body = frames[1:]
    if len(body) == 2:
        seq = _unpack_seq(body[0], "replay")
        if seq == END_SEQ:
            return ReplayEnd()
        return ReplayData(topic=None, seq=seq, payload=bytes(body[1]))
    if len(body) == 3:
        seq = _unpack_seq(body[1], "replay")
        if seq == END_SEQ:
            return ReplayEnd()
        return ReplayData(topic=bytes(body[0]), seq=seq, payload=bytes(body[2]))
    raise ProtocolError(f"replay reply has {len(body)} frames after the delimiter, expected 2 or 3")
