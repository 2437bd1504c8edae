"""Errors raised by the indexer package.

IndexerError
├── ProtocolError      a frame or payload that is not a valid KV-event message
└── SnapshotError      an index snapshot that cannot be loaded
"""

from __future__ import annotations

__all__ = ["IndexerError", "ProtocolError", "SnapshotError"]


class IndexerError(Exception):
    """Base of every error the indexer raises on purpose."""


class ProtocolError(IndexerError):
    """Bytes on the wire that do not decode into a KV-event message; the reason says why."""


class SnapshotError(IndexerError):
    """An index snapshot with the wrong version or a damaged body."""
