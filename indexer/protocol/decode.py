"""Payload decoder: every SGLang and vLLM KV-event layout into `EventBatch`.

(Implementation lands with the protocol issue.)
"""

from __future__ import annotations

from indexer.protocol.events import EventBatch

__all__ = ["decode_batch"]


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload; raises ProtocolError (and nothing else) on bad input."""
    raise NotImplementedError
