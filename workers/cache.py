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

Every mutation records the KV events SGLang would publish, in order: a `Stored` per new node
(its pages' hashes, the parent node's last hash), a `Removed` per evicted node with exactly the
hashes it stored, `Cleared` on flush. A node split emits nothing: the page hashes are sliced
between the two halves. Events are merged as SGLang 0.5.23's `KVCacheEventRecorder.enqueue`
merges them until they are taken: a `Removed` right after a `Removed` of the same medium joins
it, and a `Stored` whose parent is the last hash of the `Stored` right before it (same medium,
page size, salt and adapter) extends it. `take_events()` hands them to the publisher (one
scheduler step's batch).

Optional host tier (`host_capacity_tokens`), as SGLang 0.5.23's HiCache keeps it under its
default write-through policy (`mem_cache/unified_cache/unified_tree_core.py`): a new GPU node
is backed up to the host pool at once (`Stored` CPU_PINNED, the node staying on the GPU; SGLang
publishes it when the copy is acknowledged, a step or so later), evicting host-only leaves LRU
for room (`Removed` CPU_PINNED), or not backed up when the host pool is full of copies the GPU
still holds. A GPU leaf evicted with a host copy keeps only that copy (`Removed` GPU alone);
one without is dropped, with the host-only nodes below it. A request whose prefix reaches
host-only nodes loads them back onto the GPU (`load_back`: `Stored` GPU, the host copy kept),
at a cost the scheduler charges. So a node is on the GPU, on the host, or on both; GPU nodes
always form a prefix-closed subtree, since eviction takes GPU leaves first and loading back
takes the whole path.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
from sortedcontainers import SortedList

from indexer.protocol.events import Cleared, Event, Removed, Stored
from workers.errors import CacheBusyError
from workers.hashing import Digest, digest_to_hash, namespace_seed, page_digests

__all__ = [
    "HOST_MEDIUM",
    "MEDIUM",
    "CacheStats",
    "Match",
    "Namespace",
    "PagedRadixCache",
    "RadixNode",
]

MEDIUM = "GPU"
HOST_MEDIUM = "CPU_PINNED"  # SGLang's StorageMedium.CPU (disaggregation/kv_events.py, 0.5.23)


class Namespace(msgspec.Struct, frozen=True, gc=False):
    """The radix namespace of a request; None means none (the empty string is normalized away)."""

    extra_key: str | None = None
    cache_salt: str | None = None
    # the LoRA adapter (`lora_path`, or the OpenAI routes' `model: "base:adapter"`): its pages
    # are its own, published with its `lora_name` as SGLang does
    lora: str | None = None


_ROOT_NAMESPACE = Namespace()


class RadixNode:
    """One node of the tree: whole pages of one namespace. Opaque to callers (lock handles)."""

    __slots__ = (
        "children",
        "digests",
        "host_entry",
        "key",
        "last_access",
        "lock_ref",
        "lru_entry",
        "namespace",
        "node_id",
        "on_gpu",
        "on_host",
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
        self.lru_entry: tuple[int, int] | None = None  # in the GPU eviction order
        self.host_entry: tuple[int, int] | None = None  # in the host eviction order
        self.on_gpu = True  # its pages are in the GPU pool
        self.on_host = False  # a copy of them is in the host pool (a write-through backup)


class Match(msgspec.Struct, frozen=True):
    """A prefix match: the deepest matched GPU node (lock it to protect the prefix) and its
    length; with a host tier, the deepest host node the prefix continues into and how many
    more tokens it covers there (`load_back` brings them to the GPU)."""

    node: RadixNode
    length: int
    host_node: RadixNode | None = None
    host_length: int = 0


class CacheStats(msgspec.Struct, frozen=True):
    """Pool occupancy in pages, and how many page hashes were ever computed (memoization)."""

    total_pages: int
    tree_pages: int  # on the GPU
    reserved_pages: int
    protected_pages: int
    free_pages: int
    nodes: int
    hashed_pages: int
    host_pages: int = 0
    host_total_pages: int = 0


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
        prior = namespace_seed(node.namespace.cache_salt, node.namespace.lora)
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

    def __init__(
        self, *, page_size: int, capacity_tokens: int, host_capacity_tokens: int = 0
    ) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if capacity_tokens < page_size:
            raise ValueError("capacity_tokens must hold at least one page")
        if host_capacity_tokens < 0:
            raise ValueError("host_capacity_tokens must be >= 0")
        self.page_size = page_size
        self.total_pages = capacity_tokens // page_size
        self.host_total_pages = host_capacity_tokens // page_size
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
        self._host_lru: SortedList = SortedList()
        self._tree_pages = 0  # GPU pages in the tree
        self._host_pages = 0
        self._protected_pages = 0  # GPU tree pages a running request protects

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
            host_pages=self._host_pages,
            host_total_pages=self.host_total_pages,
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
        """Length of the cached prefix of `tokens` in `namespace` (GPU and host tiers, what a
        request would reuse), with no side effect at all."""
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

    def peek_gpu(self, namespace: Namespace, tokens: Sequence[int]) -> int:
        """Length of the prefix of `tokens` held on the GPU, with no side effect."""
        aligned = self._aligned(tokens)
        node = self._root
        at = 0
        while at < len(aligned):
            child = node.children.get(self._child_key(namespace, aligned, at))
            if child is None or not child.on_gpu:
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
        gpu_node, gpu_at = node, 0
        at = 0
        while at < len(aligned):
            child = node.children.get(self._child_key(namespace, aligned, at))
            if child is None:
                break
            self._touch(child, now)
            matched = self._matched_in_node(child, aligned, at)
            at += matched
            reached = child if matched == len(child.key) else self._split(child, matched, now)
            if reached.on_gpu:
                gpu_node, gpu_at = reached, at
            node = reached
            if reached is not child:
                break
        if node is gpu_node:
            return Match(node=gpu_node, length=gpu_at)
        return Match(node=gpu_node, length=gpu_at, host_node=node, host_length=at - gpu_at)

    # ----------------------------------------------------------------- locks

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (one reference per running request)."""
        current: RadixNode | None = node
        while current is not None and current is not self._root:
            if current.lock_ref == 0 and current.on_gpu:
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
            if current.lock_ref == 0 and current.on_gpu:
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
        prefix that fits is cached. Records a `Stored` for the new node, and with a host tier
        backs it up there (`Stored` CPU_PINNED) when the host pool has room.
        """
        aligned = self._aligned(tokens)
        found = self.match(namespace, aligned)
        used = 0
        if found.host_node is not None:
            # the prefix continues on the host: bring it back before growing the path on it
            used = self.load_back(found.host_node, reserved_pages=reserved_pages)
            reserved_pages -= used
            found = self.match(namespace, aligned)
            if found.host_node is not None:
                return found, used  # the GPU pool could not take it back: cache no more
        node, at = found.node, found.length
        if at == len(aligned):
            return found, used
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
            return found, used
        self._reserved_pages -= from_reserve
        key = aligned[at : at + pages * self.page_size]
        child = RadixNode(next(self._ids), node, key, namespace, next(self._clock))
        node.children[self._child_key(namespace, key, 0)] = child
        self._nodes[child.node_id] = child
        self._tree_pages += pages
        self._refresh(node)
        self._refresh(child)
        self._record_stored(child)
        self._back_up(child)
        return Match(node=child, length=at + len(key)), used + from_reserve

    def load_back(self, host_node: RadixNode, *, reserved_pages: int = 0) -> int:
        """Load the host-only nodes on the path to `host_node` back onto the GPU, top-down.

        Pages come from the caller's reservation first, then from the free pool (evicting
        GPU leaves). Stops where the GPU pool cannot take a node; returns the reserved pages
        used. Each loaded node records `Stored` GPU and keeps its host copy, as HiCache does.
        """
        path: list[RadixNode] = []
        current: RadixNode | None = host_node
        while current is not None and not current.on_gpu:
            path.append(current)
            current = current.parent
        used = 0
        self.lock(host_node)  # nothing on the path may be evicted while it moves
        try:
            for node in reversed(path):
                pages = len(node.key) // self.page_size
                from_reserve = min(pages, reserved_pages - used, self._reserved_pages)
                from_pool = pages - from_reserve
                if from_pool > self.free_pages:
                    self._make_free(from_pool)
                if from_pool > self.free_pages:
                    break  # the GPU is full of protected pages: the rest stays on the host
                self._reserved_pages -= from_reserve
                used += from_reserve
                self._load(node)
        finally:
            self.unlock(host_node)
        return used

    def evict(self, num_tokens: int) -> int:
        """Evict LRU unreferenced leaves until `num_tokens` are freed; returns tokens freed."""
        freed = 0
        while freed < num_tokens and self._lru:
            freed += self._evict_one()
        return freed

    def flush(self) -> int:
        """Drop the whole tree (`AllBlocksCleared`); refused while a request holds pages.
        Returns the pages it held (in both pools: a page with a host copy counts twice)."""
        if self._protected_pages or self._reserved_pages:
            raise CacheBusyError("cache not flushed: requests are running")
        held = self._tree_pages + self._host_pages
        self._reset()
        self._events.append(Cleared())
        return held

    def flush_namespace(self, cache_salt: str | None) -> int:
        """Evict every unreferenced node whose salt is `cache_salt`; returns pages removed.

        Nodes a running request protects stay (with their ancestors); each removed node gets
        a `Removed` per tier it is in, deepest first, as if it had been evicted.
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
        """Keep each LRU index equal to its tier's evictable leaves.

        A GPU node is a GPU leaf when none of its children is on the GPU (its host children
        stay where they are when it goes); a host-only node is evictable when it has no
        children (a node on both tiers never leaves the host first: write-through).
        """
        if node.lru_entry is not None:
            self._lru.remove(node.lru_entry)
            node.lru_entry = None
        if node.host_entry is not None:
            self._host_lru.remove(node.host_entry)
            node.host_entry = None
        if node is self._root or node.lock_ref:
            return
        if node.on_gpu:
            if not any(child.on_gpu for child in node.children.values()):
                node.lru_entry = (node.last_access, node.node_id)
                self._lru.add(node.lru_entry)
        elif not node.children:
            node.host_entry = (node.last_access, node.node_id)
            self._host_lru.add(node.host_entry)

    def _split(self, node: RadixNode, at: int, now: int) -> RadixNode:
        """Cut `node` after `at` tokens; the new upper half takes the first digests. No event."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = RadixNode(next(self._ids), parent, node.key[:at], node.namespace, now)
        upper.lock_ref = node.lock_ref
        upper.on_gpu, upper.on_host = node.on_gpu, node.on_host  # both halves stay put
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
        """Free the GPU pages of the LRU GPU leaf: one backed up keeps its host copy (HiCache's
        demote: `Removed` GPU alone); one not backed up is dropped, with the host-only nodes
        below it (they need their parent)."""
        _, node_id = self._lru[0]
        node = self._nodes[node_id]
        if node.on_host:
            self._demote(node)
            return len(node.key)
        if node.children:
            self._drop_subtree(node)
            return len(node.key)
        return self._remove_leaf(node)

    def _back_up(self, node: RadixNode) -> None:
        """Copy a new GPU node to the host pool (write-through), evicting host-only leaves LRU
        for room; left GPU-only when the host pool is full of copies the GPU still holds (as
        HiCache's backup gives up when its host eviction cannot make room)."""
        if not self.host_total_pages:
            return
        pages = len(node.key) // self.page_size
        while self._host_pages + pages > self.host_total_pages and self._host_lru:
            _, host_id = self._host_lru[0]
            self._remove_leaf(self._nodes[host_id])
        if self._host_pages + pages > self.host_total_pages:
            return
        node.on_host = True
        self._host_pages += pages
        self._record_stored(node, HOST_MEDIUM)

    def _demote(self, node: RadixNode) -> None:
        """Release a backed-up node's GPU pages; it stays in the tree on the host alone."""
        assert node.on_host and node.lock_ref == 0
        node.on_gpu = False
        self._tree_pages -= len(node.key) // self.page_size
        self._record_removed(node, MEDIUM)
        self._refresh(node)
        if node.parent is not None:
            self._refresh(node.parent)

    def _load(self, node: RadixNode) -> None:
        """Bring a host-only node back onto the GPU; its host copy stays."""
        pages = len(node.key) // self.page_size
        node.on_gpu = True
        self._tree_pages += pages
        if node.lock_ref:
            self._protected_pages += pages
        self._record_stored(node, MEDIUM)
        self._refresh(node)
        if node.parent is not None:
            self._refresh(node.parent)

    def _drop_subtree(self, top: RadixNode) -> None:
        """Remove `top` and its (host) descendants, deepest first."""
        stack: list[tuple[RadixNode, bool]] = [(top, False)]
        while stack:
            node, expanded = stack.pop()
            if not expanded:
                stack.append((node, True))
                stack.extend((child, False) for child in node.children.values())
            else:
                self._remove_leaf(node)

    def _remove_leaf(self, node: RadixNode) -> int:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[self._child_key(node.namespace, node.key, 0)]
        if node.lru_entry is not None:
            self._lru.remove(node.lru_entry)
            node.lru_entry = None
        if node.host_entry is not None:
            self._host_lru.remove(node.host_entry)
            node.host_entry = None
        del self._nodes[node.node_id]
        pages = len(node.key) // self.page_size
        self._refresh(parent)
        if node.on_gpu:
            self._tree_pages -= pages
            self._record_removed(node, MEDIUM)
        if node.on_host:
            self._host_pages -= pages
            self._record_removed(node, HOST_MEDIUM)
        return len(node.key)

    def _record_removed(self, node: RadixNode, tier: str) -> None:
        digests, hashed = event_digests(node, self.page_size)
        self._hashed_pages += hashed
        self._enqueue(Removed(block_hashes=[digest_to_hash(d) for d in digests], medium=tier))

    def _record_stored(self, node: RadixNode, tier: str = MEDIUM) -> None:
        digests, hashed = event_digests(node, self.page_size)
        self._hashed_pages += hashed
        parent = node.parent
        parent_hash: int | None = None
        if parent is not None and parent is not self._root:
            parent_digests, hashed = event_digests(parent, self.page_size)
            self._hashed_pages += hashed
            parent_hash = digest_to_hash(parent_digests[-1])
        self._enqueue(
            Stored(
                block_hashes=[digest_to_hash(d) for d in digests],
                parent=parent_hash,
                token_ids=list(node.key),
                block_size=self.page_size,
                medium=tier,
                cache_salt=node.namespace.cache_salt,
                lora_name=node.namespace.lora,
            )
        )

    def _enqueue(self, event: Removed | Stored) -> None:
        """Record `event`, merged into the one before it where SGLang's recorder merges them
        (so a batch carries as many events as SGLang's would)."""
        tail = self._events[-1] if self._events else None
        if isinstance(tail, Removed) and isinstance(event, Removed):
            if tail.medium == event.medium:
                tail.block_hashes.extend(event.block_hashes)
                return
        elif (
            isinstance(tail, Stored)
            and isinstance(event, Stored)
            and tail.block_hashes
            and event.parent == tail.block_hashes[-1]
            and (tail.medium, tail.block_size, tail.cache_salt, tail.lora_name)
            == (event.medium, event.block_size, event.cache_salt, event.lora_name)
        ):
            tail.block_hashes.extend(event.block_hashes)
            tail.token_ids.extend(event.token_ids)
            return
        self._events.append(event)

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
