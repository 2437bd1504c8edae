"""Cache namespaces of requests; their public fingerprints come from `indexer.fingerprint`."""

from __future__ import annotations

from collections.abc import Container

from indexer.fingerprint import Fingerprinter
from indexer.service import Namespace

__all__ = ["Fingerprinter", "request_namespace"]


def request_namespace(
    salt: str | None,
    lora: str | None,
    model: str,
    fleet_models: Container[str],
    extra_key: str | None = None,
) -> Namespace:
    """The namespace a request is cached in: the fleet model it names (else ""), lora, salt,
    and the caller's extra_key (which no event carries: see `indexer.namespace.Namespace`)."""
    return Namespace(
        model=model if model in fleet_models else "",
        lora=lora,
        cache_salt=salt or None,
        extra_key=extra_key or None,
    )
