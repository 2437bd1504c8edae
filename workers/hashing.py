"""SGLang's KV-event block hashes, computed exactly as SGLang's recorder does.

Each page of a radix node gets a SHA-256 digest chained on the previous page's full digest:

    d_i = SHA256(d_{i-1} || page bytes)      d_{-1} = none, or SHA256(SALT_PREFIX + salt)

and the published hash is the first 8 bytes of d_i read big-endian as a signed int64. Page bytes
are every token as 4-byte little-endian unsigned; a page holding a token wider than 32 bits is
hashed as 0xff followed by every token as 8-byte little-endian (SGLang >= 0.5.23). EAGLE bigram
pages hash each (prev, next) pair as two u32. `extra_key` is not part of the default hash.

The dynamo format (`dynamo_format=True` in SGLang) re-namespaces every hash of a salted node
with a length-prefixed (extra_key, cache_salt) seed; the reference worker publishes the default
format, but both are here so the golden vectors pin them down.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Sequence

__all__ = [
    "DYNAMO_NAMESPACE_PREFIX",
    "SALT_PREFIX",
    "Digest",
    "digest_to_hash",
    "dynamo_hash",
    "dynamo_namespace_seed",
    "namespace_seed",
    "page_digests",
    "salt_seed",
]

# A page digest: the full 32 bytes, on which the next page chains.
Digest = bytes

SALT_PREFIX = b"sglang-cache-salt-v1\x00"
DYNAMO_NAMESPACE_PREFIX = b"sglang-kv-event-namespace-v1"
_U32_MAX = 0xFFFF_FFFF
_WIDE_MARKER = b"\xff"


def salt_seed(cache_salt: str | None) -> Digest | None:
    """The chain's prior for a node's first page under the root: none, or the salt's seed."""
    if cache_salt is None:
        return None
    return hashlib.sha256(SALT_PREFIX + cache_salt.encode("utf-8")).digest()


def namespace_seed(cache_salt: str | None, lora: str | None) -> Digest | None:
    """The prior of a namespace's first page: the salt's (`salt_seed`), and for a LoRA adapter
    one of its own over it, so an adapter's pages are never another's hashes (SGLang
    namespaces an adapter's hashes as well)."""
    seed = salt_seed(cache_salt)
    if lora is None:
        return seed
    return hashlib.sha256(b"lora\x00" + lora.encode("utf-8") + b"\x00" + (seed or b"")).digest()


def _page_bytes(tokens: Sequence[int]) -> bytes:
    if any(t > _U32_MAX for t in tokens):
        return _WIDE_MARKER + struct.pack(f"<{len(tokens)}Q", *tokens)
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _bigram_page_bytes(pairs: Sequence[tuple[int, int]]) -> bytes:
    flat = [t for pair in pairs for t in pair]
    return struct.pack(f"<{len(flat)}I", *flat)


def page_digests(
    tokens: Sequence[int],
    page_size: int,
    prior: Digest | None,
    *,
    bigram: bool = False,
) -> list[Digest]:
    """Digests of each page of `tokens` (the last page may be short), chained on `prior`.

    With `bigram`, `tokens` are raw ids and each page hashes `page_size` (prev, next) pairs,
    as SGLang's EAGLE bigram keys do (n raw tokens give n - 1 pairs).
    """
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    pages: list[bytes]
    if bigram:
        pairs = list(itertools.pairwise(tokens))
        pages = [
            _bigram_page_bytes(pairs[i : i + page_size]) for i in range(0, len(pairs), page_size)
        ]
    else:
        pages = [_page_bytes(tokens[i : i + page_size]) for i in range(0, len(tokens), page_size)]
    digests: list[Digest] = []
    for page in pages:
        hasher = hashlib.sha256()
        if prior is not None:
            hasher.update(prior)
        hasher.update(page)
        prior = hasher.digest()
        digests.append(prior)
    return digests


def digest_to_hash(digest: Digest) -> int:
    """The published block hash: the digest's first 8 bytes as a big-endian signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def dynamo_namespace_seed(extra_key: str | None, cache_salt: str | None) -> Digest:
    """Seed of the dynamo format: length-prefixed parts, so ("a", "bc") != ("ab", "c")."""
    hasher = hashlib.sha256(DYNAMO_NAMESPACE_PREFIX)
    for part in (extra_key, cache_salt):
        if part is None:
            hasher.update(b"\x00")
        else:
            raw = part.encode("utf-8")
            hasher.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return hasher.digest()


def dynamo_hash(seed: Digest, block_hash: int) -> int:
    """A default-format hash re-namespaced for the dynamo format."""
    raw = block_hash.to_bytes(8, "big", signed=True)
    return digest_to_hash(hashlib.sha256(seed + raw).digest())
