"""The namespaced prefix index: pure and synchronous (no asyncio, no zmq).

- `prefix_index`: `PrefixIndex`, the facade: streams, namespaces, applying batches, queries;
- `stream_table`: `IndexedStream`, what the index keeps per (worker, dp rank) stream, with
  its own bookkeeping (counts, side tables, eviction), and its counters;
- `values`: how a table value packs holders and namespace (`CODE_BITS`, `ns_code`);
- `walk`: the query's one pass over a request's blocks; `PrefixMatch`, `StreamMatch`;
- `held`: a stream's events held while its page size is unknown and no page proved it;
- `pending`: routing-time pending marks with a TTL;
- `registry`: namespace ids, codes, chain seeds and per-namespace sizes.

The public surface is re-exported here, so callers write `from indexer.index import PrefixIndex`.
"""

from __future__ import annotations

from indexer.index.prefix_index import DEFAULT_MEDIUM, PrefixIndex
from indexer.index.registry import NamespaceSize
from indexer.index.stream_table import ApplyOutcome, StreamCounters
from indexer.index.values import CODE_BITS, CODE_MASK, NS_BITS, NS_MASK, ns_code
from indexer.index.walk import PrefixMatch, StreamMatch

__all__ = [
    "CODE_BITS",
    "CODE_MASK",
    "DEFAULT_MEDIUM",
    "NS_BITS",
    "NS_MASK",
    "ApplyOutcome",
    "NamespaceSize",
    "PrefixIndex",
    "PrefixMatch",
    "StreamCounters",
    "StreamMatch",
    "ns_code",
]
