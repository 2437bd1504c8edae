"""The KV-event wire protocol: what workers put on ZMQ and what kvroute reads back.

- `events`: the normalized model (`EventBatch`, `Stored`, `Removed`, `Cleared`, `Unreadable`);
- `decode`: any SGLang/vLLM payload into that model;
- `encode`: SGLang's array and map layouts, for the reference workers;
- `frames`: live and replay frame layouts;
- `tokens`: the byte tokenizer and chat template the router and reference workers share.

`workers` may import this package and nothing else of ours.
"""

from __future__ import annotations

from indexer.errors import ProtocolError
from indexer.protocol.decode import decode_batch
from indexer.protocol.encode import WireLayout, encode_batch
from indexer.protocol.events import (
    BlockHash,
    Cleared,
    Event,
    EventBatch,
    Removed,
    Stored,
    TokenId,
    Unreadable,
)
from indexer.protocol.frames import (
    END_SEQ,
    LiveMessage,
    ReplayData,
    ReplayEnd,
    build_live,
    build_replay_end,
    build_replay_reply,
    build_replay_request,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    topic_matches,
)
from indexer.protocol.tokens import ByteTokenizer, ChatTemplateError, render_chat

__all__ = [
    "END_SEQ",
    "BlockHash",
    "ByteTokenizer",
    "ChatTemplateError",
    "Cleared",
    "Event",
    "EventBatch",
    "LiveMessage",
    "ProtocolError",
    "Removed",
    "ReplayData",
    "ReplayEnd",
    "Stored",
    "TokenId",
    "Unreadable",
    "WireLayout",
    "build_live",
    "build_replay_end",
    "build_replay_reply",
    "build_replay_request",
    "decode_batch",
    "encode_batch",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "render_chat",
    "topic_matches",
]
