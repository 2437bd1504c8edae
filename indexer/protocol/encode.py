"""Payload encoder for the reference workers: SGLang's array and map layouts.

(Implementation lands with the protocol issue.)
"""

from __future__ import annotations

from typing import Literal, TypeAlias

from indexer.protocol.events import EventBatch

__all__ = ["WireLayout", "encode_batch"]

WireLayout: TypeAlias = Literal["array", "map"]


def encode_batch(batch: EventBatch, layout: WireLayout = "array") -> bytes:
    """Encode a batch exactly as SGLang's publisher does (byte-identical)."""
    raise NotImplementedError
