"""Cache namespaces of requests, and the keyed fingerprints that stand for them in public.

A salt is a tenant's secret: logs, metric labels and the admin API show only a fingerprint,
HMAC-SHA256 over the namespace under a key (configured, or random per process), truncated to 16
hex digits. Without the key a fingerprint cannot be tested against guessed salts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

from indexer.service import Namespace

__all__ = ["Fingerprinter", "request_namespace"]

_pack = msgspec.msgpack.Encoder()


class Fingerprinter:
    """Keyed, stable-per-key fingerprints of namespaces."""

    def __init__(self, key: str = "") -> None:
        self._key = key.encode() if key else secrets.token_bytes(32)
        self._cache: dict[Namespace, str] = {}

    def __call__(self, namespace: Namespace) -> str:
        """The fingerprint of `namespace` (16 hex digits)."""
        cached = self._cache.get(namespace)
        if cached is None:
            msg = _pack.encode((namespace.model, namespace.lora, namespace.cache_salt))
            cached = hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:16]
            if len(self._cache) < 65_536:  # bounded: salts are unbounded user input
                self._cache[namespace] = cached
        return cached


def request_namespace(
    salt: str | None, lora: str | None, model: str, fleet_models: set[str]
) -> Namespace:
    """The namespace a request is cached in: the fleet model it names (else ""), lora, salt."""
    return Namespace(
        model=model if model in fleet_models else "",
        lora=lora,
        cache_salt=salt or None,
    )
