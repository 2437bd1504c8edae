"""One prompt's block keys, made once per block size for everything its decision asks.

Routing a prompt asks for its block keys (the chain of block hashes the index keys its entries
by) several times: the admission forecast of every candidate, the pending marks on the chosen
stream, and the recency book's touch. For one namespace and key shape (block size, and whether
the stream's pages are SGLang EAGLE bigrams: `PrefixIndex.key_shape`) they are the same chain
whatever the stream, and each is a C-level pass over the whole prompt (about 20 us for 8k
tokens). `PromptKeys` keeps the chains of the prompt being routed, so a decision makes each
once.

A request's token list is never changed once parsed, so the list's identity and the namespace
say it is the same prompt. The list is held (a strong reference), so a freed list's address
can never come back as another prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence

from indexer.namespace import Namespace, blocks_within
from indexer.service import IndexerService

__all__ = ["PromptKeys"]


class PromptKeys:
    """The block keys of the latest prompt asked about, per key shape."""

    __slots__ = ("_by_size", "_indexer", "_ns", "_tokens")

    def __init__(self, indexer: IndexerService) -> None:
        self._indexer = indexer
        self._tokens: Sequence[int] | None = None
        self._ns: Namespace | None = None
        self._by_size: dict[tuple[int, bool], list[int]] = {}

    def of(
        self, stream: str, ns: Namespace, tokens: Sequence[int], limit: int | None = None
    ) -> list[int]:
        """The keys of the full blocks of `tokens` (the first `limit`) on `stream`, root first;
        empty while its block size or the namespace is unknown to the index. Shared with the
        next caller: read it, never change it."""
        index = self._indexer.index
        shape = index.key_shape(stream) if index.has_stream(stream) else None
        if shape is None or not shape[0]:
            return []
        if tokens is not self._tokens or ns != self._ns:
            self._tokens, self._ns, self._by_size = tokens, ns, {}
        keys = self._by_size.get(shape)
        if keys is None:
            keys = self._indexer.block_keys(stream, ns, tokens)
            if not keys:  # a namespace the index meets first when this prompt is marked
                return keys
            self._by_size[shape] = keys
        if limit is None or limit >= len(tokens):
            return keys
        return keys[: blocks_within(limit, *shape)]
