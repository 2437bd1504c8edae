"""Errors raised by the indexer package.

IndexerError
├── ProtocolError      a frame or payload that is not a valid KV-event message
├── ReplayError        a replay answer that proves nothing (not this stream's, or endless)
└── SnapshotError      an index snapshot that cannot be loaded
"""

from __future__ import annotations

__all__ = ["IndexerError", "ProtocolError", "ReplayError", "SnapshotError"]


class IndexerError(Exception):
    """Base of every error the indexer raises on purpose."""


class ProtocolError(IndexerError):
    """Bytes on the wire that do not decode into a KV-event message; the reason says why."""


class ReplayError(IndexerError):
    """A replay answer that cannot be this stream's buffer (frames that do not parse, another
    topic's batches, seqs that do not follow each other) or that never ends: like an answer
    that never came, it proves nothing (the reason says which)."""


class SnapshotError(IndexerError):
    """An index snapshot with the wrong version or a damaged body."""
