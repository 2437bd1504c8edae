"""Cache namespaces of requests, and the fingerprints that show them outside the router.

`Fingerprinter` computes the same ids as `indexer.fingerprint.Fingerprinter` (so `/admin`
and `kvroute replay` name a namespace alike), with a memo that cannot hold a salt: it is keyed
by a BLAKE2b digest of the namespace. A memo keyed by the namespace itself would keep every
salt any client ever sent (even in a request the worker then rejected) for the life of the
process; keyed by digest, an entry costs the same few bytes whatever the salt.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Container

import msgspec

from indexer.fingerprint import fingerprint_key
from indexer.service import Namespace

__all__ = ["Fingerprinter", "request_namespace"]

_pack = msgspec.msgpack.Encoder()


class Fingerprinter:
    """Namespace fingerprints (16 hex digits), memoized for the hot path by digest."""

    def __init__(self, key: str = "", *, memo_entries: int = 65_536) -> None:
        self._key = fingerprint_key(key)
        self._memo: dict[bytes, str] = {}
        self._memo_entries = memo_entries

    def __call__(self, namespace: Namespace) -> str:
        """The fingerprint of `namespace`."""
        # the message indexer.fingerprint signs; the digest of it is ~3x cheaper than the HMAC
        msg = _pack.encode((namespace.model, namespace.lora, namespace.cache_salt))
        digest = hashlib.blake2b(msg, digest_size=16).digest()
        cached = self._memo.get(digest)
        if cached is None:
            cached = hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:16]
            if len(self._memo) >= self._memo_entries:
                self._memo.clear()  # a flood of new namespaces must not pin the memo forever
            self._memo[digest] = cached
        return cached


def request_namespace(
    salt: str | None, lora: str | None, model: str, fleet_models: Container[str]
) -> Namespace:
    """The namespace a request is cached in: the fleet model it names (else ""), lora, salt."""
    return Namespace(
        model=model if model in fleet_models else "",
        lora=lora,
        cache_salt=salt or None,
    )
