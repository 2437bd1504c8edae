"""A prefix tree of past routing decisions, without KV events: the `approx_tree` baseline's memory.

It mirrors the approximate tree of sglang-router's `cache_aware` policy (0.3.2): one radix tree
shared by every worker ("tenant"), each node remembering which workers were sent its prefix and
when each last used it. SGLang's tree is over the characters of the request text; this one is
over the token ids the policy is handed, which with the built-in byte tokenizer are the bytes
of the text, so a match fraction here is SGLang's character fraction.

What is mirrored, since the baseline is only honest if it behaves like the real router:
- `prefix_match` walks the tree as far as the prompt matches (into the middle of a node too),
  whichever workers hold the nodes, and names one worker of the deepest node reached: SGLang
  takes the first key of that node's map, an order that is arbitrary but fixed per node; here
  a stable hash of (node, worker) fixes it, inherited by the upper half of a split node as
  SGLang's split clones the map;
- a worker's size is the tokens of the nodes it holds (SGLang's `tenant_char_count`), the
  "smallest tree" that takes new prefixes;
- `evict_by_size` cuts every worker larger than the bound down to it, least recently used
  leaves of that worker first (its own access time per node), and drops nodes nobody holds.
  SGLang runs it every `eviction_interval_secs` on a thread; the policy runs it on the same
  interval when it records a decision.
Access times are a logical clock (one tick per insert or match), which orders as SGLang's
millisecond stamps do without their ties. Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from collections.abc import Sequence

__all__ = ["ApproxTree"]

_MASK = (1 << 64) - 1


def _shared(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class _Node:
    __slots__ = ("children", "key", "order", "parent", "tenants")

    def __init__(self, key: list[int], parent: _Node | None, order: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.tenants: dict[str, int] = {}  # worker -> its last access tick
        self.order = order  # fixes which worker `prefix_match` names for this node


class ApproxTree:
    """Multi-worker radix tree of routed prompts, with SGLang's size-bounded LRU eviction."""

    def __init__(self) -> None:
        self._root = _Node([], None, 0)
        self._orders = itertools.count(1)
        self._ticks = itertools.count(1)
        self._sizes: dict[str, int] = {}  # worker -> tokens of the nodes it holds
        self._nodes = 1

    def _path(self, tokens: Sequence[int]) -> tuple[list[_Node], int]:
        """The nodes the prompt walks through (root excluded) and the tokens matched."""
        path: list[_Node] = []
        node, at = self._root, 0
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                break
            shared = _shared(child.key, tokens, at)
            at += shared
            path.append(child)
            if shared < len(child.key):
                break  # a partial match into the node counts, and ends the walk
            node = child
        return path, at

    @staticmethod
    def _first(node: _Node) -> str | None:
        if not node.tenants:
            return None
        return min(
            node.tenants,
            key=lambda w: ((node.order * 0x9E3779B97F4A7C15) ^ zlib.crc32(w.encode())) & _MASK,
        )

    def prefix_match(self, tokens: Sequence[int]) -> tuple[int, str | None]:
        """Tokens matched anywhere in the tree, and the worker SGLang would name for them (None
        when nothing matched); no side effect (`touch` records the access)."""
        path, at = self._path(tokens)
        if not path:
            return 0, None
        return at, self._first(path[-1])

    def matches(self, tokens: Sequence[int]) -> dict[str, int]:
        """Tokens of the prompt each worker was sent as a prefix (absent = 0), as SGLang's
        `prefix_match_tenant` counts them; for explaining decisions."""
        out: dict[str, int] = {}
        node, at = self._root, 0
        alive: set[str] | None = None
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                break
            alive = set(child.tenants) if alive is None else alive & child.tenants.keys()
            if not alive:
                break
            shared = _shared(child.key, tokens, at)
            at += shared
            for worker in alive:
                out[worker] = at
            if shared < len(child.key):
                break
            node = child
        return out

    def touch(self, tokens: Sequence[int], worker: str) -> None:
        """`worker` used the prefix it holds of `tokens` (SGLang's `prefix_match` side effect)."""
        tick = next(self._ticks)
        path, _ = self._path(tokens)
        for node in path:
            if worker not in node.tenants:
                break
            node.tenants[worker] = tick

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens; the upper half keeps its workers (and their order)."""
        assert node.parent is not None
        upper = _Node(node.key[:at], node.parent, node.order)
        upper.tenants = dict(node.tenants)
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        self._nodes += 1
        return upper

    def insert(self, tokens: Sequence[int], worker: str) -> None:
        """Remember that `tokens` were routed to `worker`."""
        tick = next(self._ticks)
        self._root.tenants[worker] = tick
        self._sizes.setdefault(worker, 0)
        node, at = self._root, 0
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                child = _Node(list(tokens[at:]), node, next(self._orders))
                node.children[child.key[0]] = child
                self._nodes += 1
                at = len(tokens)
            else:
                shared = _shared(child.key, tokens, at)
                if shared < len(child.key):
                    child = self._split(child, shared)
                at += shared
            if worker not in child.tenants:
                self._sizes[worker] += len(child.key)
            child.tenants[worker] = tick
            node = child

    def _is_leaf_of(self, node: _Node, worker: str) -> bool:
        return worker in node.tenants and not any(
            worker in c.tenants for c in node.children.values()
        )

    def _drop(self, node: _Node, worker: str) -> None:
        """Take `worker` off `node`; a node nobody holds and with no children goes."""
        if node.tenants.pop(worker, None) is None:
            return
        self._sizes[worker] -= len(node.key)
        if not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.key[0]]
            self._nodes -= 1

    def evict_by_size(self, max_size: int) -> None:
        """Cut every worker above `max_size` tokens down to it, its least recently used
        leaves first (SGLang's `evict_tenant_by_size`)."""
        over = {w for w, size in self._sizes.items() if size > max_size}
        if not over:
            return
        heap: list[tuple[int, int, str, _Node]] = []
        serial = itertools.count()
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for worker in over:
                if self._is_leaf_of(node, worker):
                    heap.append((node.tenants[worker], next(serial), worker, node))
        heapq.heapify(heap)
        while heap:
            _, _, worker, node = heapq.heappop(heap)
            if self._sizes[worker] <= max_size or worker not in node.tenants:
                continue
            parent = node.parent
            self._drop(node, worker)
            if parent is not None and parent is not self._root and self._is_leaf_of(parent, worker):
                heapq.heappush(heap, (parent.tenants[worker], next(serial), worker, parent))

    def remove_worker(self, worker: str) -> None:
        """Forget everything routed to `worker` (it left the pool)."""
        stack = list(self._root.children.values())
        order: list[_Node] = []
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before their parents
            self._drop(node, worker)
        self._root.tenants.pop(worker, None)
        self._sizes.pop(worker, None)

    def workers(self) -> list[str]:
        """Every name anything was ever routed to and not removed since."""
        return list(self._sizes)

    def size(self, worker: str) -> int:
        """Tokens of the tree `worker` holds (SGLang's 'smallest tree' tie-break)."""
        return self._sizes.get(worker, 0)

    def __len__(self) -> int:
        """Nodes in the tree, the root included."""
        return self._nodes
