"""The namespace registry of one index: namespace ids and codes, chain seeds, sizes.

Every namespace an index holds entries of gets a small integer id (1, 2, ...; 0 means "none").
Table values carry the id's code (`indexer.index.values.ns_code`) so a lookup says which
namespace an entry belongs to and a query walk stops at another namespace's entry. The index
releases the ids that nothing refers to any more (no table key, pending or partial entry), so
salt churn (a salt per user, or per request) cannot grow the registry without bound; an id is
only handed out again after that, so an id found in a value always names the namespace that
stored it. Snapshots persist ids (`place`).

The registry also keeps, per id, the unique blocks and tokens indexed in the namespace (the
index updates them as it links and unlinks keys), and caches chain seeds per (id, block
size): a seed is a BLAKE2b over the namespace, too slow to compute per event or query.
"""

from __future__ import annotations

import msgspec

from indexer.index.values import NS_MASK, ns_code
from indexer.namespace import Namespace, namespace_seed

__all__ = ["NamespaceRegistry", "NamespaceSize"]

_SEED_LIMIT = 1 << 16  # cached (id, block size) -> seed entries


class NamespaceSize(msgspec.Struct):
    """Size of one namespace: unique blocks, their tokens, and blocks per holding stream."""

    namespace: Namespace
    blocks: int
    tokens: int
    holders: dict[str, int]


class NamespaceRegistry:
    """Namespace <-> id, the id's code, cached seeds, unique blocks and tokens per id.

    The lists are indexed by id and only ever grow in place, so hot paths may read them
    directly (`codes[ns_id]`, `blocks[ns_id] += n`).
    """

    __slots__ = ("_free", "_ids", "_seeds", "blocks", "codes", "names", "tokens")

    def __init__(self) -> None:
        self._ids: dict[Namespace, int] = {}
        self.names: list[Namespace | None] = [None]  # id 0 is never used: 0 means "none"
        self.codes: list[int] = [ns_code(0)]  # id -> ns_code(id), precomputed
        self.blocks: list[int] = [0]  # id -> unique block keys indexed
        self.tokens: list[int] = [0]  # id -> tokens of those blocks
        self._seeds: dict[tuple[int, int], int] = {}
        self._free: set[int] = set()  # released ids (and holes left by `place`), reused first

    def __len__(self) -> int:
        return len(self._ids)

    def find(self, namespace: Namespace) -> int | None:
        """The id of `namespace`, None when this index never saw it."""
        return self._ids.get(namespace)

    def intern(self, namespace: Namespace) -> int:
        """The id of `namespace`, assigning the next one on first sight."""
        ns_id = self._ids.get(namespace)
        if ns_id is not None:
            return ns_id
        if self._free:
            ns_id = self._free.pop()
            self.names[ns_id] = namespace
        else:
            ns_id = len(self.names)
            if ns_id > NS_MASK:
                raise OverflowError("more than 16M live namespaces in one index")
            self.names.append(namespace)
            self.codes.append(ns_code(ns_id))
            self.blocks.append(0)
            self.tokens.append(0)
        self._ids[namespace] = ns_id
        return ns_id

    def ids(self) -> list[int]:
        """Every id in use."""
        return list(self._ids.values())

    def release(self, ns_ids: list[int]) -> None:
        """Forget namespaces nothing refers to any more; their ids become free for reuse."""
        for ns_id in ns_ids:
            namespace = self.names[ns_id]
            if namespace is None or self.blocks[ns_id]:
                raise ValueError(f"namespace id {ns_id} is not releasable")
            del self._ids[namespace]
            self.names[ns_id] = None
            self.tokens[ns_id] = 0
            self._free.add(ns_id)
        if ns_ids:
            self._seeds.clear()  # keyed by id: a reused id must not find the old seed

    def place(self, ns_id: int, namespace: Namespace) -> None:
        """Give `namespace` exactly id `ns_id` (loading a snapshot); ValueError if taken."""
        if not 0 < ns_id <= NS_MASK:
            raise ValueError(f"namespace id {ns_id} out of range")
        if namespace in self._ids or (ns_id < len(self.names) and self.names[ns_id] is not None):
            raise ValueError(f"bad or repeated namespace id {ns_id}")
        grow = ns_id + 1 - len(self.names)
        if grow > 0:
            self._free.update(range(len(self.names), ns_id))
            self.names.extend([None] * grow)
            self.codes.extend(ns_code(i) for i in range(len(self.codes), ns_id + 1))
            self.blocks.extend([0] * grow)
            self.tokens.extend([0] * grow)
        self.names[ns_id] = namespace
        self._ids[namespace] = ns_id
        self._free.discard(ns_id)

    def known(self, ns_id: int) -> bool:
        """Whether `ns_id` names a namespace of this registry."""
        return 0 < ns_id < len(self.names) and self.names[ns_id] is not None

    def seed(self, ns_id: int, block_size: int) -> int:
        """The chain seed of namespace `ns_id` for pages of `block_size` tokens (cached)."""
        seed = self._seeds.get((ns_id, block_size))
        if seed is None:
            namespace = self.names[ns_id]
            assert namespace is not None
            seed = namespace_seed(namespace, block_size)
            if len(self._seeds) >= _SEED_LIMIT:
                self._seeds.clear()  # bounded: a miss only recomputes one BLAKE2b
            self._seeds[(ns_id, block_size)] = seed
        return seed

    def sizes(self, holders: dict[int, dict[str, int]]) -> list[NamespaceSize]:
        """Every namespace holding blocks, with `holders` (id -> stream -> blocks) attached."""
        out = []
        for ns_id, namespace in enumerate(self.names):
            if namespace is None or not self.blocks[ns_id]:
                continue
            out.append(
                NamespaceSize(
                    namespace=namespace,
                    blocks=self.blocks[ns_id],
                    tokens=self.tokens[ns_id],
                    holders=holders.get(ns_id, {}),
                )
            )
        return out
