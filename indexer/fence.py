"""The epoch fence: proof that a publisher's seq L is still the batch we applied as seq L.

Seqs alone cannot tell two processes apart. A worker that restarts numbers its batches from 0
again; if the router misses the new process's first batches (it was reconnecting), then asks
the replay socket "from L", the new process answers with its own seq L and the stream looks in
sync while the dead process's cache stays indexed (false hits) and the new batches up to L are
never applied. So every stream remembers the last batch it applied (`BatchFence`), and every
replay that continues a stream asks from that seq, not the one after it: the publisher must
send the same bytes back (engines buffer the exact payload they published). A different
payload at that seq is a restart; an answer that no longer holds that seq proves nothing, and
an unproven continuation is treated as a restart too (fail closed: the stream is rebuilt).

Pure: no I/O. The payload is kept by reference (no hashing on the apply path); a digest is
computed only when a snapshot is written, and a stream loaded from a snapshot compares
digests.
"""

from __future__ import annotations

import hashlib

__all__ = ["DIGEST_BYTES", "BatchFence", "payload_digest"]

# the size of every fence digest (a snapshot's fence of another size is no digest of ours)
DIGEST_BYTES = 16


def payload_digest(payload: bytes) -> bytes:
    """The digest snapshots store for a batch payload (BLAKE2b, 128 bits)."""
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest()


class BatchFence:
    """The seq of a stream's last applied batch and what identifies that batch."""

    __slots__ = ("_digest", "_payload", "seq")

    def __init__(self, seq: int, payload: bytes | None = None, digest: bytes | None = None) -> None:
        if payload is None and digest is None:
            raise ValueError("a fence needs the payload or its digest")
        self.seq = seq
        self._payload = payload
        self._digest = digest

    @classmethod
    def of(cls, seq: int, payload: bytes) -> BatchFence:
        """The fence of the batch `payload` just applied as `seq`."""
        return cls(seq, payload=payload)

    @property
    def payload(self) -> bytes | None:
        """The batch's bytes (None: a fence loaded from a snapshot keeps the digest only)."""
        return self._payload

    def digest(self) -> bytes:
        """The payload's digest (computed once, when first asked: snapshots only)."""
        if self._digest is None:
            assert self._payload is not None
            self._digest = payload_digest(self._payload)
        return self._digest

    def matches(self, seq: int, payload: bytes) -> bool:
        """Whether (`seq`, `payload`) is the batch this fence remembers."""
        if seq != self.seq:
            return False
        if self._payload is not None:
            return payload == self._payload
        return payload_digest(payload) == self._digest

    def __repr__(self) -> str:
        return f"BatchFence(seq={self.seq})"
