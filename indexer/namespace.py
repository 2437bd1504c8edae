"""Cache namespaces and the router's own block keys.

A namespace is (model, lora, cache_salt, extra_key): two requests share cached KV only inside
one. Block keys are a chain over (namespace seed, block tokens), computed the same way from the
`token_ids` of a `BlockStored` and from a request's tokens, so matching never depends on
reproducing any engine's hash.

Key scheme (stable across processes and runs, documented because snapshots persist it):

    seed  = BLAKE2b-64(msgpack([model, lora, salt, block_size] (+ [extra_key] when set)))
            as a signed big-endian int
    key_0 = seed
    key_i = hash((key_{i-1}, tuple(block_i_tokens)))

On a stream of SGLang EAGLE bigram pages the block tokens are (prev, next) pairs, from its
events and from a request (`Bigrams`) alike.

CPython's `hash` of ints and of tuples of ints is NOT salted by PYTHONHASHSEED (only str and
bytes are): ints hash to themselves modulo 2**61 - 1 and tuples use the xxHash-derived mix
unchanged since CPython 3.8, so keys are identical in every 64-bit CPython >= 3.8 process. It is
the fastest stable mix reachable from Python (a block costs one C-level tuple hash, ~0.2 us for
16 tokens; BLAKE2b per block was 5-8x slower). Snapshots carry `HASH_PROBE` so a runtime with
another mix refuses them instead of silently mismatching.

Collision odds: chain states are ~61-bit (int hashes are reduced modulo 2**61 - 1), so a request
block falsely matching one of N unrelated keys of its namespace has probability about
N / 2**61 (~1e-12 for N = 2 million). The mix is not cryptographic; a collision can only cost a
routing decision (a worker isolates its own cache by salt), and cross-namespace matches are
excluded structurally by the index (every entry carries its namespace id), not by odds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Iterator, Sequence
from itertools import islice, pairwise
from typing import overload

import msgspec

__all__ = [
    "HASH_PROBE",
    "Bigrams",
    "Namespace",
    "anonymous_lora",
    "block_tuples",
    "blocks_within",
    "chain_block_keys",
    "chain_keys",
    "names_no_adapter",
    "namespace_seed",
    "partial_key",
    "py_chain",
    "request_keys",
    "vllm_plain_blocks",
    "vllm_salt",
]


class Namespace(msgspec.Struct, frozen=True):
    """A cache namespace: KV computed in one is never reused in another.

    `extra_key` is the caller's own SGLang `extra_key`: the worker keys its radix cache by it
    too, but publishes no event that shows it. So no event-fed entry ever lives in a namespace
    with an extra_key (the index predicts no event-based hit for such a request: fail closed);
    only the router's own pending marks, made under the full key, do.
    """

    model: str = ""  # the worker's served model name as configured for its stream
    lora: str | None = None  # lora_name (or `anonymous_lora` when only an id is on the wire)
    cache_salt: str | None = None  # "" is normalized to None
    extra_key: str | None = None  # "" is normalized to None; never on the wire (see above)

    def __post_init__(self) -> None:
        # Struct is frozen; normalizing "" here keeps ("m", None, "") and ("m", None, None) equal.
        if self.cache_salt == "":
            msgspec.structs.force_setattr(self, "cache_salt", None)
        if self.lora == "":
            msgspec.structs.force_setattr(self, "lora", None)
        if self.extra_key == "":
            msgspec.structs.force_setattr(self, "extra_key", None)


def names_no_adapter(name: str) -> bool:
    """Whether a LoRA adapter name a request gives is one no engine loads: it holds a NUL, as
    every `anonymous_lora` does. Taken as a namespace's `lora`, it could name the pages of
    another adapter's id (a false hit, and a probe of that adapter's cache): the router
    refuses it (`router.prompt.request`)."""
    return "\x00" in name


def anonymous_lora(lora_id: int) -> str:
    """The namespace's `lora` for pages an event names by adapter id alone (SGLang's layouts
    up to 0.5.17 carry no `lora_name`). A request names an adapter by name, and the id is the
    engine's own number for it, so no request may match these pages: the NUL in front is in no
    adapter name an engine has loaded (an adapter literally named "7" was predicted adapter
    7's pages before)."""
    return f"\x00lora_id:{lora_id}"


_seed_encoder = msgspec.msgpack.Encoder()


def namespace_seed(namespace: Namespace, block_size: int) -> int:
    """The chain's starting value for one namespace and block size."""
    fields: list[object] = [namespace.model, namespace.lora, namespace.cache_salt, block_size]
    if namespace.extra_key is not None:
        # appended only when set, so every key without one is what it was before it existed
        fields.append(namespace.extra_key)
    packed = _seed_encoder.encode(fields)
    digest = hashlib.blake2b(packed, digest_size=8, person=b"kvroute-ns-v1").digest()
    return int.from_bytes(digest, "big", signed=True)


def _beyond_lora(keys: list[object], lora_name: str | None) -> list[object]:
    return keys[1:] if lora_name is not None and keys and keys[0] == lora_name else keys


def vllm_salt(extra_keys: list[list[object] | None] | None, lora_name: str | None) -> str | None:
    """vLLM's cache_salt: the one string of the first block's extra keys after the LoRA name
    (`vllm_plain_blocks` has checked that nothing else is there)."""
    if not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list) or not first:
        return None
    items = _beyond_lora(first, lora_name)
    last = items[-1] if items else None
    return last if isinstance(last, str) and last else None


def vllm_plain_blocks(
    extra_keys: list[list[object] | None], lora_name: str | None, *, root: bool
) -> int:
    """How many leading blocks of a vLLM `BlockStored` are keyed by their tokens, LoRA and salt
    alone: what the index can key them by.

    vLLM (0.33, `generate_block_hash_extra_keys`, published untagged by `to_event_extra_keys`)
    hashes a block with its extra keys: the LoRA name, `(mm_identifier, offset)` pairs of the
    multimodal inputs it overlaps, the `cache_salt` (a request's first block only: `root`, the
    event's first block with no parent) and a digest (bytes) of prompt embeddings. A block with
    multimodal pairs or a digest is reused only by a request with the same images or
    embeddings, which its tokens do not show (a placeholder's ids are the same for every
    image): such blocks, and every block after them, are not indexed (fail closed). So is a
    first block with anything but one salt string beside the LoRA name (a layout not
    understood)."""
    for i, keys in enumerate(extra_keys):
        if keys is None:
            continue
        if not isinstance(keys, list):
            return i
        items = _beyond_lora(keys, lora_name)
        if not items:
            continue
        if root and i == 0 and len(items) == 1 and isinstance(items[0], str):
            continue  # the salt
        return i
    return len(extra_keys)


def block_tuples(tokens: Sequence[Hashable], block_size: int) -> Iterator[tuple[Hashable, ...]]:
    """Lazy tuple of every FULL block of `tokens` (a trailing partial block is dropped)."""
    # zip over one shared iterator builds the block tuples in C
    return zip(*[iter(tokens)] * block_size, strict=False)


def chain_keys(prev: int, tokens: Sequence[Hashable], block_size: int) -> list[int]:
    """Keys of the full blocks of `tokens` chained after key `prev` (or a namespace seed)."""
    return chain_block_keys(prev, zip(*[iter(tokens)] * block_size, strict=False))


def chain_block_keys(
    prev: int, blocks: Iterable[tuple[Hashable, ...]], *, many: bool = False
) -> list[int]:
    """THE key function: keys of `blocks` (token tuples) chained after key `prev`.

    Stores (`chain_keys`) and queries (`indexer.index.walk`, a chunk of a lazy block iterator at a
    time) both go through here, so the two sides can never drift apart. `many=True` (a query
    chunk of 64+ blocks) takes an all-C pass; both passes give the same keys (checked below).
    """
    if many and _SELF_FEEDING:
        # `zip` reads the list while `extend` appends to it: each 2-tuple pairs the previous
        # key with the next block, hashed in C with no Python step per block (~12% faster on
        # a 512-block prompt; slower below ~8 blocks, hence only for query chunks)
        keys = [prev]
        keys.extend(map(hash, zip(keys, blocks, strict=False)))
        del keys[0]
        return keys
    # A plain loop, not a comprehension with `:=`: the walrus would make `prev` a closure cell
    # and the comprehension a function call, together ~1.3 us per 8-block event (40% of it).
    keys = []
    append = keys.append
    for block in blocks:
        prev = hash((prev, block))
        append(prev)
    return keys


def py_chain(
    prev: int, tokens: Sequence[Hashable], block_size: int, start: int = 0, count: int = -1
) -> list[int]:
    """Keys of full blocks `start`, `start + 1`, ... (at most `count`; -1: all) of `tokens`.

    The pure-Python twin of `indexer._keychain.chain`: same signature, same keys (the C one
    also insists on an int `prev`, which every caller passes).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    full = len(tokens) // block_size
    stop = full if count < 0 else min(full, start + count)
    if start >= stop:
        return []
    part = tokens[start * block_size : stop * block_size]
    return chain_block_keys(
        prev, zip(*[iter(part)] * block_size, strict=False), many=stop - start >= 8
    )


class Bigrams(Sequence[tuple[Hashable, Hashable]]):
    """A request's tokens as SGLang keys them with EAGLE on: its `(prev, next)` pairs.

    With EAGLE speculative decoding SGLang's radix cache (0.5.23 `RadixKey.is_bigram`) keys
    position i by the pair `(t_i, t_{i+1})`, so n tokens are n - 1 positions and a page of
    `page_size` positions ends with a pair that reaches the next page's first token; its
    events publish exactly those pairs as a page's `token_ids`. A request is matched against
    such pages by this view of the first `limit` tokens (the router's limit leaves out the
    prompt's last token, as SGLang's own `max_prefix_len` does before making the pairs), so a
    page matches only when the request has every token its pairs name.

    Lazy: a slice makes only the pairs it covers (the key chain takes a chunk of blocks at a
    time, and a walk usually stops at its first chunk).
    """

    __slots__ = ("_len", "_tokens")

    def __init__(self, tokens: Sequence[Hashable], limit: int | None = None) -> None:
        n = len(tokens) if limit is None else max(0, min(limit, len(tokens)))
        self._tokens = tokens
        self._len = max(n - 1, 0)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[tuple[Hashable, Hashable]]:
        t = self._tokens
        return pairwise(islice(t, 0, self._len + 1))

    @overload
    def __getitem__(self, index: int) -> tuple[Hashable, Hashable]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[Hashable, Hashable]]: ...
    def __getitem__(
        self, index: int | slice
    ) -> tuple[Hashable, Hashable] | list[tuple[Hashable, Hashable]]:
        t = self._tokens
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                raise ValueError("Bigrams slice step must be 1")
            if stop <= start:
                return []
            return list(pairwise(t[start : stop + 1]))
        i = index + self._len if index < 0 else index
        if not 0 <= i < self._len:
            raise IndexError(f"bigram index out of range: {index}")
        return (t[i], t[i + 1])


def blocks_within(tokens: int, block_size: int, bigram: bool) -> int:
    """How many full blocks `tokens` tokens make: n tokens are n - 1 positions on bigram pages."""
    positions = max(tokens - 1, 0) if bigram else tokens
    return positions // block_size


def request_keys(
    namespace: Namespace, tokens: Sequence[Hashable], block_size: int, *, bigram: bool = False
) -> list[int]:
    """Keys of a request's full blocks in `namespace`: what the index is queried with.

    `bigram`: for a stream whose pages are SGLang EAGLE `(prev, next)` pairs (`Bigrams`)."""
    keyed: Sequence[Hashable] = Bigrams(tokens) if bigram else tokens
    return chain_keys(namespace_seed(namespace, block_size), keyed, block_size)


def partial_key(prev: int, tokens: Sequence[Hashable]) -> int:
    """Key of a trailing partial page; never equal to a full block's key except by collision."""
    return hash((prev, tuple(tokens), len(tokens)))


# The all-C pass relies on `list.extend` publishing each item before it pulls the next one
# (CPython does); where it does not, every caller silently gets the plain loop instead.
_SELF_FEEDING = False
_SELF_FEEDING = chain_block_keys(7, block_tuples(range(64), 2), many=True) == chain_block_keys(
    7, block_tuples(range(64), 2)
)

# Probe value recorded in snapshots: equal only where `hash` mixes exactly as when they were made.
HASH_PROBE = chain_keys(namespace_seed(Namespace("probe"), 4), list(range(1, 17)), 4)[-1]
