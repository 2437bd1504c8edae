"""The paged radix KV cache of one SGLang worker (one DP rank), pure and synchronous.

A fixed pool of `capacity_tokens // page_size` pages is shared between the radix tree (cached
prefixes) and the private pages that running requests reserve for what they have not cached
yet. Every tree node holds whole pages: keys are rounded down to a page multiple, as SGLang's
paged `RadixCache` does, so no partial page is ever stored.

Nodes live in namespaces `(extra_key, cache_salt)`, kept as two fields so that `("a:b", None)`
and `("a", "b")` never meet; the namespace is part of every child key, so requests that differ
in either field never share a node. Reference counts (`lock`/`unlock`, propagated to the root)
protect the nodes of running requests; unreferenced leaves are evicted least recently used
first through a sorted index (O(log n) per eviction).

Every mutation records the KV events SGLang would publish, in order: one coalesced `Stored`
per new node (its pages' hashes, the parent node's last hash), one `Removed` per evicted node
with exactly the hashes it stored, `Cleared` on flush. A node split emits nothing: the page
hashes are sliced between the two halves. `take_events()` hands them to the publisher.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
from sortedcontainers import SortedList

from indexer.protocol.events import Cleared, Event, Removed, Stored
from workers.errors import CacheBusyError
from workers.hashing import Digest, digest_to_hash, page_digests, salt_seed

__all__ = ["MEDIUM", "CacheStats", "Match", "Namespace", "PagedRadixCache", "RadixNode"]

MEDIUM = "GPU"


class Namespace(msgspec.Struct, frozen=True, gc=False):
    """The radix namespace of a request; None means none (the empty string is normalized away)."""

    extra_key: str | None = None
    cache_salt: str | None = None


_ROOT_NAMESPACE = Namespace()


class RadixNode:
    """One node of the tree: whole pages of one namespace. Opaque to callers (lock handles)."""

    __slots__ = (
        "children",
        "digests",
        "key",
        "last_access",
        "lock_ref",
        "lru_entry",
        "namespace",
        "node_id",
        "parent",
    )

    def __init__(
        self,
        node_id: int,
        parent: RadixNode | None,
        key: list[int],
        namespace: Namespace,
        last_access: int,
    ) -> None:
        self.node_id = node_id
        self.parent = parent
        self.key = key
        self.namespace = namespace
        self.children: dict[tuple[Namespace, tuple[int, ...]], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = last_access
        # Memoized page digests (SGLang's event_hash_value): computed once, sliced on split.
        self.digests: list[Digest] | None = None
        self.lru_entry: tuple[int, int] | None = None


class Match(msgspec.Struct, frozen=True):
    """A prefix match: the deepest matched node (lock it to protect the prefix) and its length."""

    node: RadixNode
    length: int


class CacheStats(msgspec.Struct, frozen=True):
    """Pool occupancy in pages, and how many page hashes were ever computed (memoization)."""

    total_pages: int
    tree_pages: int
    reserved_pages: int
    protected_pages: int
    free_pages: int
    nodes: int
    hashed_pages: int


def event_digests(node: RadixNode, page_size: int) -> tuple[list[Digest], int]:
    """The node's page digests, filling every missing one on its path without recursion.

    Returns the digests and how many pages had to be hashed (0 when memoized). Walks up to the
    first ancestor that already has digests (or the root), then fills top-down, so a path of
    thousands of single-page nodes costs one pass and no stack depth.
    """
    if node.digests is not None:
        return node.digests, 0
    missing: list[RadixNode] = []
    current: RadixNode | None = node
    while current is not None and current.parent is not None and current.digests is None:
        missing.append(current)
        current = current.parent
    prior: Digest | None
    if current is not None and current.parent is not None and current.digests:
        prior = current.digests[-1]
    else:
        prior = salt_seed(node.namespace.cache_salt)
    hashed = 0
    for missing_node in reversed(missing):
        digests = page_digests(missing_node.key, page_size, prior)
        missing_node.digests = digests
        hashed += len(digests)
        if digests:
            prior = digests[-1]
    assert node.digests is not None
    return node.digests, hashed


class PagedRadixCache:
    """SGLang's paged radix cache with cache_salt namespaces, LRU eviction and KV events."""

    def __init__(self, *, page_size: int, capacity_tokens: int) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if capacity_tokens < page_size:
            raise ValueError("capacity_tokens must hold at least one page")
        self.page_size = page_size
        self.total_pages = capacity_tokens // page_size
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._events: list[Event] = []
        self._hashed_pages = 0
        self._reserved_pages = 0
        self._reset()
        # SGLang's cache records AllBlocksCleared when it is constructed (its reset()), so an
        # engine's first published batch tells every subscriber to start from nothing.
        self._events.append(Cleared())

    def _reset(self) -> None:
        self._root = RadixNode(0, None, [], _ROOT_NAMESPACE, 0)
        self._root.lock_ref = 1  # the root is never evicted
        self._nodes: dict[int, RadixNode] = {}
        self._lru: SortedList = SortedList()
        self._tree_pages = 0
        self._protected_pages = 0

    # ----------------------------------------------------------------- accounting

    @property
    def free_pages(self) -> int:
        """Pages neither in the tree nor reserved by a running request."""
        return self.total_pages - self._tree_pages - self._reserved_pages

    @property
    def evictable_pages(self) -> int:
        """Tree pages that no running request protects (all of them can be evicted in turn)."""
        return self._tree_pages - self._protected_pages

    def stats(self) -> CacheStats:
        """A snapshot of the pool's occupancy."""
        return CacheStats(
            total_pages=self.total_pages,
            tree_pages=self._tree_pages,
            reserved_pages=self._reserved_pages,
            protected_pages=self._protected_pages,
            free_pages=self.free_pages,
            nodes=len(self._nodes),
            hashed_pages=self._hashed_pages,
        )

    def take_events(self) -> list[Event]:
        """The events recorded since the last call, in order (one scheduler step's batch)."""
        events, self._events = self._events, []
        return events

    def reserve(self, pages: int) -> bool:
        """Reserve private pages for a request, evicting LRU leaves if needed; False if full."""
        if pages < 0:
            raise ValueError("pages must be >= 0")
        if self.free_pages + self.evictable_pages < pages:
            return False
        self._make_free(pages)
        self._reserved_pages += pages
        return True

    def release(self, pages: int) -> None:
        """Give back private pages a request reserved and did not turn into tree pages."""
        if not 0 <= pages <= self._reserved_pages:
            raise ValueError(f"cannot release {pages} of {self._reserved_pages} reserved pages")
        self._reserved_pages -= pages

    # ----------------------------------------------------------------- lookups

    def _aligned(self, tokens: Sequence[int]) -> list[int]:
        return list(tokens[: len(tokens) - len(tokens) % self.page_size])

    def _child_key(
        self, namespace: Namespace, tokens: Sequence[int], at: int
    ) -> tuple[Namespace, tuple[int, ...]]:
        return namespace, tuple(tokens[at : at + self.page_size])

    def _matched_in_node(self, node: RadixNode, tokens: list[int], at: int) -> int:
        """Tokens of `node.key` matched by the page-aligned `tokens[at:]`, in whole pages.

        The caller found `node` by its first page (the child key), so comparing starts at
        the second page.
        """
        page = self.page_size
        limit = min(len(node.key), len(tokens) - at)
        matched = page
        while matched + page <= limit:
            if node.key[matched : matched + page] != tokens[at + matched : at + matched + page]:
                break
            matched += page
        return matched

    def peek(self, namespace: Namespace, tokens: Sequence[int]) -> int:
        """Length of the cached prefix of `tokens` in `namespace`, with no side effect at all."""
        aligned = self._aligned(tokens)
        node = self._root
        at = 0
        while at < len(aligned):
            child = node.children.get(self._child_key(namespace, aligned, at))
            if child is None:
                break
            matched = self._matched_in_node(child, aligned, at)
            at += matched
            if matched < len(child.key):
                break
            node = child
        return at

    def match(self, namespace: Namespace, tokens: Sequence[int]) -> Match:
        """Longest cached prefix; touches the path (LRU) and splits a partly matched node."""
        aligned = self._aligned(tokens)
        now = next(self._clock)
        node = self._root
        at = 0
        while at < len(aligned):
            child = node.children.get(self._child_key(namespace, aligned, at))
            if child is None:
                break
            self._touch(child, now)
            matched = self._matched_in_node(child, aligned, at)
            at += matched
            if matched < len(child.key):
                node = self._split(child, matched, now)
                break
            node = child
        return Match(node=node, length=at)

    # ----------------------------------------------------------------- locks

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (one reference per running request)."""
        current: RadixNode | None = node
        while current is not None and current is not self._root:
            if current.lock_ref == 0:
                self._protected_pages += len(current.key) // self.page_size
            current.lock_ref += 1
            self._refresh(current)
            current = current.parent

    def unlock(self, node: RadixNode) -> None:
        """Drop one reference taken by `lock`."""
        current: RadixNode | None = node
        while current is not None and current is not self._root:
            if current.lock_ref <= 0:
                raise ValueError("unlock without a matching lock")
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self._protected_pages -= len(current.key) // self.page_size
            self._refresh(current)
            current = current.parent

    # ----------------------------------------------------------------- mutations

    def insert(
        self, namespace: Namespace, tokens: Sequence[int], *, reserved_pages: int = 0
    ) -> tuple[Match, int]:
        """Cache the page-aligned prefix of `tokens`; returns the match and reserved pages used.

        New pages come first from the caller's reservation (`reserved_pages`), then from the
        free pool, evicting LRU leaves if needed; if the pool cannot hold them all, only the
        prefix that fits is cached. Records one coalesced `Stored` for the new node.
        """
        aligned = self._aligned(tokens)
        found = self.match(namespace, aligned)
        node, at = found.node, found.length
        if at == len(aligned):
            return found, 0
        want = (len(aligned) - at) // self.page_size
        from_reserve = min(want, reserved_pages, self._reserved_pages)
        from_pool = want - from_reserve
        if from_pool > self.free_pages:
            # The attachment point must survive the eviction that makes room for its child.
            self.lock(node)
            self._make_free(from_pool)
            self.unlock(node)
            from_pool = min(from_pool, self.free_pages)
        pages = from_reserve + from_pool
        if pages == 0:
            return found, 0
        self._reserved_pages -= from_reserve
        key = aligned[at : at + pages * self.page_size]
        child = RadixNode(next(self._ids), node, key, namespace, next(self._clock))
        node.children[self._child_key(namespace, key, 0)] = child
        self._nodes[child.node_id] = child
        self._tree_pages += pages
        self._refresh(node)
        self._refresh(child)
        self._record_stored(child)
        return Match(node=child, length=at + len(key)), from_reserve

    def evict(self, num_tokens: int) -> int:
        """Evict LRU unreferenced leaves until `num_tokens` are freed; returns tokens freed."""
        freed = 0
        while freed < num_tokens and self._lru:
            freed += self._evict_one()
        return freed

    def flush(self) -> None:
        """Drop the whole tree (`AllBlocksCleared`); refused while a request holds pages."""
        if self._protected_pages or self._reserved_pages:
            raise CacheBusyError("cache not flushed: requests are running")
        self._reset()
        self._events.append(Cleared())

    def flush_namespace(self, cache_salt: str | None) -> int:
        """Evict every unreferenced node whose salt is `cache_salt`; returns pages removed.

        Nodes a running request protects stay (with their ancestors); each removed node gets
        its own `Removed`, deepest first, as if it had been evicted.
        """
        removed = 0
        roots = [c for c in self._root.children.values() if c.namespace.cache_salt == cache_salt]
        for top in roots:
            # Post-order without recursion: a page_size 1 path can be thousands of nodes deep.
            stack: list[tuple[RadixNode, bool]] = [(top, False)]
            while stack:
                node, expanded = stack.pop()
                if not expanded:
                    stack.append((node, True))
                    stack.extend((child, False) for child in node.children.values())
                elif not node.children and node.lock_ref == 0:
                    removed += self._remove_leaf(node) // self.page_size
        return removed

    # ----------------------------------------------------------------- internals

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        self._refresh(node)

    def _refresh(self, node: RadixNode) -> None:
        """Keep the LRU index equal to the set of evictable leaves."""
        if node.lru_entry is not None:
            self._lru.remove(node.lru_entry)
            node.lru_entry = None
        if node is not self._root and not node.children and node.lock_ref == 0:
            node.lru_entry = (node.last_access, node.node_id)
            self._lru.add(node.lru_entry)

    def _split(self, node: RadixNode, at: int, now: int) -> RadixNode:
        """Cut `node` after `at` tokens; the new upper half takes the first digests. No event."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = RadixNode(next(self._ids), parent, node.key[:at], node.namespace, now)
        upper.lock_ref = node.lock_ref
        if node.digests is not None:
            pages = at // self.page_size
            upper.digests, node.digests = node.digests[:pages], node.digests[pages:]
        parent.children[self._child_key(node.namespace, node.key, 0)] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[self._child_key(node.namespace, node.key, 0)] = node
        self._nodes[upper.node_id] = upper
        self._refresh(upper)
        return upper

    def _make_free(self, pages: int) -> None:
        while self.free_pages < pages and self._lru:
            self._evict_one()

    def _evict_one(self) -> int:
        _, node_id = self._lru[0]
        return self._remove_leaf(self._nodes[node_id])

    def _remove_leaf(self, node: RadixNode) -> int:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        digests, hashed = event_digests(node, self.page_size)
        self._hashed_pages += hashed
        del parent.children[self._child_key(node.namespace, node.key, 0)]
        if node.lru_entry is not None:
            self._lru.remove(node.lru_entry)
            node.lru_entry = None
        del self._nodes[node.node_id]
        self._tree_pages -= len(node.key) // self.page_size
        self._refresh(parent)
        self._events.append(
            Removed(block_hashes=[digest_to_hash(d) for d in digests], medium=MEDIUM)
        )
        return len(node.key)

    def _record_stored(self, node: RadixNode) -> None:
        digests, hashed = event_digests(node, self.page_size)
        self._hashed_pages += hashed
        parent = node.parent
        parent_hash: int | None = None
        if parent is not None and parent is not self._root:
            parent_digests, hashed = event_digests(parent, self.page_size)
            self._hashed_pages += hashed
            parent_hash = digest_to_hash(parent_digests[-1])
        self._events.append(
            Stored(
                block_hashes=[digest_to_hash(d) for d in digests],
                parent=parent_hash,
                token_ids=list(node.key),
                block_size=self.page_size,
                medium=MEDIUM,
                cache_salt=node.namespace.cache_salt,
            )
        )

    def cached_pages(self) -> set[tuple[Namespace, tuple[int, ...]]]:
        """Every cached page as (namespace, token prefix up to and including it); for tests."""
        pages: set[tuple[Namespace, tuple[int, ...]]] = set()
        stack: list[tuple[RadixNode, tuple[int, ...]]] = [
            (child, ()) for child in self._root.children.values()
        ]
        while stack:
            node, prefix = stack.pop()
            for end in range(self.page_size, len(node.key) + 1, self.page_size):
                pages.add((node.namespace, prefix + tuple(node.key[:end])))
            full = prefix + tuple(node.key)
            stack.extend((child, full) for child in node.children.values())
        return pages
