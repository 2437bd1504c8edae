"""Pending entries: a request's prefix marked "on its way to stream S" at routing time.

A burst of sibling requests should follow the first one to the worker that is about to cache
the shared prefix, before that worker's `BlockStored` arrives. The router marks the prefix as
pending on the chosen stream; entries expire after a TTL (the clock is injected so tests control
time) and a real store of the same key on the same stream replaces them.

Layout, built for bulk work (every routed request marks its whole prefix, ~512 keys for an
8k-token prompt, so per-key Python steps would cost more than the query itself):
- `bits` (an int map of the backend) maps a block key to `(stream-slot bitmask << shift) |
  fill`, the same shape as the index's table values (the index fills in the namespace code), so
  the query ORs and ANDs both in the same C-level pass;
- per slot, a packed map key -> generation of the latest `add` that marked it there;
- a FIFO of marks `(deadline, slot, generation, ns id, keys, earlier)`, one per `add`, in
  deadline order; expiring a mark drops its keys that no later mark refreshed (their
  generation is still the mark's), in C-level passes. A mark made here lives the whole TTL and
  goes at the end. Another replica's decision (`add(..., age_s=)`) lives what is left of the
  TTL since it was made, and goes where its deadline falls (near the end: it is milliseconds
  old, unless NATS held it up; one older than the TTL marks nothing). Before, a decision NATS
  held up for 2.6 s was marked for a whole TTL on arrival, on a worker flushed since: QA saw
  `pending 560` predicted there. Expiring such a shorter mark drops the keys it refreshed even
  where an earlier mark on them stands (fail closed: a pending key lost early, never kept late).

A mark is withdrawn (`withdraw`) when its request failed (the worker refused it, or it never
reached the worker): nothing is on its way. Its keys go back to the mark before it that made
them pending there (`earlier`: the generations they had, kept only when some had one), as
long as that one stands; else they are dropped.

A mark of a namespace no event shows (an `extra_key`'s: the engine publishes its pages as
plain pages of its salt) is never replaced by a store, so nothing but its deadline would take
it back once its pages are gone: a worker that evicted them (or flushed its salt) within the
TTL was predicted them pending, 0 cached (QA: 144 tokens). Its keys are **twinned** with the
plain keys of the same blocks (`twin`), and a removal of a plain key's page on the stream drops
the twins' marks there (`removed`): which copy went no event says, so the keyed one is taken
for gone (a missed hit at worst). The engine evicts leaves first, so a removal drops a prefix's
marks from the block it took on, as the match stops at the first key not marked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from itertools import compress
from operator import not_

from indexer.int_map import PyIntMap

__all__ = ["PendingTable"]

# deadline, slot, generation, ns id, keys, the keys' generations before it (None: all 0)
_Mark = tuple[float, int, int, int, list[int], list[int] | None]

# a stream's twins (`PendingTable.twin`) are swept of the keys no longer marked once they are
# this many, then at twice what is left: they stay within ~2x the stream's marks
_FIRST_TWIN_SWEEP = 4096


class PendingTable:
    """Block key -> stream-slot bitmask with per-(key, slot) deadlines."""

    __slots__ = (
        "_clock",
        "_fifo",
        "_fill",
        "_generation",
        "_gens",
        "_int_map",
        "_live",
        "_shift",
        "_twin_sweep",
        "bits",
        "max_entries",
        "ttl_s",
        "twins",
    )

    def __init__(
        self,
        clock: Callable[[], float],
        ttl_s: float,
        max_entries: int = 1_000_000,
        *,
        shift: int = 0,
        fill: int = 0,
        int_map: type[PyIntMap] = PyIntMap,
    ) -> None:
        self._clock = clock
        self._shift = shift
        self._fill = fill
        self._int_map = int_map
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.bits = int_map(False)  # the backend's map: queries read it like the table
        self._gens: dict[int, PyIntMap] = {}  # slot -> key -> generation of its latest mark
        self._fifo: deque[_Mark] = deque()
        self._generation = 0
        # the generations of the marks standing (in `_fifo`): the keys a withdrawn mark took
        # over go back to the ones among them (deadlines do not follow generations)
        self._live: set[int] = set()
        # slot -> plain key -> the key(s) marked there of the same block in namespaces no event
        # shows (`twin`); one int, or a tuple where several extra_keys have one. Read outside
        # (the writer asks it before a removal), never replaced
        self.twins: dict[int, dict[int, int | tuple[int, ...]]] = {}
        self._twin_sweep: dict[int, int] = {}  # slot -> its twins' size that sweeps them

    @property
    def generation(self) -> int:
        """The latest mark's generation: what `withdraw` takes back (0: none made yet)."""
        return self._generation

    def __len__(self) -> int:
        return sum(map(len, self._gens.values()))

    def add(
        self,
        keys: Iterable[int],
        slot: int,
        ns_id: int,
        fill: int | None = None,
        *,
        age_s: float = 0.0,
    ) -> int:
        """Mark `keys` pending on stream `slot` until now + TTL - `age_s`; returns how many
        were marked.

        `fill` (default: the table's) is ORed into the low bits of each key's value; the index
        passes the namespace's code so a query can tell another namespace's pending entry.
        `age_s`: how long ago the routing decision was made (another replica's, delivered
        late); one the TTL old or older marks nothing.
        """
        left_s = self.ttl_s - max(age_s, 0.0)
        if self.ttl_s <= 0 or left_s <= 0:
            return 0
        marked = list(keys)
        room = self.max_entries - len(self)
        if len(marked) > room:
            marked = marked[: max(room, 0)]
        if not marked:
            return 0
        self._generation += 1
        gens = self._gens.get(slot)
        if gens is None:
            gens = self._gens[slot] = self._int_map(True)
        earlier: list[int] | None = None
        if not gens.isdisjoint(marked):  # a sibling's mark: kept for a withdrawal
            earlier = gens.get_many(marked, 0)
        gens.assign(marked, self._generation)
        bit = (1 << (slot + self._shift)) | (self._fill if fill is None else fill)
        bits = self.bits
        if bits.isdisjoint(marked):
            bits.assign(marked, bit)  # a new prefix: one shared value object for all its keys
        else:
            bits.or_many(marked, bit)
        deadline = self._clock() + left_s
        mark = (deadline, slot, self._generation, ns_id, marked, earlier)
        fifo = self._fifo
        if not fifo or fifo[-1][0] <= deadline:
            fifo.append(mark)  # a whole TTL, or the marks after it all end before it
        else:
            at = len(fifo) - 1  # a shorter mark: before the marks that end after it
            while at > 0 and fifo[at - 1][0] > deadline:
                at -= 1
            fifo.insert(at, mark)
        self._live.add(self._generation)
        return len(marked)

    def withdraw(self, slot: int, generation: int) -> int:
        """The request of mark `generation` on `slot` stores nothing there after all: drop
        its keys that no later mark refreshed, or give them back to the standing mark before
        it; returns how many were dropped (0: the mark expired or is not there)."""
        self.expire()
        live = self._live
        if generation not in live:
            return 0
        fifo = self._fifo
        # a failure comes soon after its mark: look from the newest (it is there)
        for i in range(len(fifo) - 1, -1, -1):
            mark = fifo[i]
            if mark[2] == generation:
                break
        else:
            return 0
        if mark[1] != slot:
            return 0
        del fifo[i]
        live.discard(generation)
        gens = self._gens.get(slot)
        if gens is None:
            return 0
        _, _, _, _, keys, earlier = mark
        current = gens.get_many(keys, 0)
        mine = list(map(generation.__eq__, current))
        back: list[tuple[int, int]] = []
        if earlier is not None:
            back = [
                (key, old)
                for key, old, own in zip(keys, earlier, mine, strict=True)
                if own and old in live
            ]
            gens.update(back)
        restored = {key for key, _ in back}
        dropped = [key for key, own in zip(keys, mine, strict=True) if own and key not in restored]
        self._drop(slot, dropped)
        return len(dropped)

    def expire(self) -> None:
        """Drop every entry whose deadline has passed."""
        fifo = self._fifo
        if not fifo:
            return
        now = self._clock()
        while fifo and fifo[0][0] <= now:
            self._retire(fifo.popleft())

    def _retire(self, mark: _Mark) -> None:
        """Drop the keys of `mark` that no later mark refreshed."""
        _, slot, generation, _, keys, _ = mark
        self._live.discard(generation)
        gens = self._gens.get(slot)
        if gens is not None:
            current = gens.get_many(keys, 0)
            self._drop(slot, list(compress(keys, map(generation.__eq__, current))))

    def _drop(self, slot: int, keys: list[int]) -> None:
        """Forget (key, slot) for every key of `keys` (each one held on `slot`)."""
        if not keys:
            return
        gens = self._gens.get(slot)
        if gens is not None:
            gens.pop_many(keys, None)
            if not gens:
                del self._gens[slot]
                self.twins.pop(slot, None)  # twins of nothing marked
                self._twin_sweep.pop(slot, None)
        bits = self.bits
        rest = list(map((~(1 << (slot + self._shift))).__and__, bits.get_many(keys, 0)))
        held = list(map(bool, map(self._shift.__rrshift__, rest)))  # any stream bit left
        bits.update(compress(zip(keys, rest, strict=True), held))
        bits.pop_many(list(compress(keys, map(not_, held))), None)

    def twin(self, slot: int, plain: Iterable[int], keys: Iterable[int]) -> None:
        """`keys`, marked on `slot` in a namespace no event shows, are the blocks whose pages
        events show under `plain` (the same blocks' keys in the namespace the engine publishes
        them in, one for one): a removal of one of those pages there drops its twin's marks
        (`removed`)."""
        twins = self.twins.get(slot)
        if twins is None:
            twins = self.twins[slot] = {}
        pairs = list(zip(plain, keys, strict=False))  # fewer plain keys: those blocks only
        if twins.keys().isdisjoint(p for p, _ in pairs):
            twins.update(pairs)  # the common case, in C: a new prefix
        else:
            for p, k in pairs:
                had = twins.get(p)
                if had is None:
                    twins[p] = k
                elif isinstance(had, int):
                    if had != k:
                        twins[p] = (had, k)  # another extra_key's copy of the same block
                elif k not in had:
                    twins[p] = (*had, k)
        if len(twins) >= self._twin_sweep.get(slot, _FIRST_TWIN_SWEEP):
            self._sweep_twins(slot, twins)

    def removed(self, slot: int, plain: Iterable[int]) -> int:
        """Pages of `plain` keys went from `slot`: their twins' marks there go (`twin`);
        returns how many were marked."""
        twins = self.twins.get(slot)
        gens = self._gens.get(slot)
        if not twins or gens is None:
            return 0
        gone: list[int] = []
        for p in plain:
            t = twins.pop(p, None)
            if t is None:
                continue
            if isinstance(t, int):
                gone.append(t)
            else:
                gone.extend(t)
        if not gone:
            return 0
        marked = list(compress(gone, map((0).__ne__, gens.get_many(gone, 0))))
        self._drop(slot, marked)
        return len(marked)

    def _sweep_twins(self, slot: int, twins: dict[int, int | tuple[int, ...]]) -> None:
        """Forget the twins of keys no longer marked on `slot`."""
        gens = self._gens.get(slot)
        if gens is None:
            kept: dict[int, int | tuple[int, ...]] = {}
        else:
            kept = {}
            for p, t in twins.items():
                if isinstance(t, int):
                    if t in gens:
                        kept[p] = t
                else:
                    left = tuple(k for k in t if k in gens)
                    if left:
                        kept[p] = left[0] if len(left) == 1 else left
        if kept:
            self.twins[slot] = kept
            self._twin_sweep[slot] = max(2 * len(kept), _FIRST_TWIN_SWEEP)
        else:
            self.twins.pop(slot, None)
            self._twin_sweep.pop(slot, None)

    def discard(self, key: int, slot: int) -> None:
        """Forget one (key, slot) entry, e.g. because the real block arrived."""
        gens = self._gens.get(slot)
        if gens is not None and key in gens:
            self._drop(slot, [key])

    def discard_slot(self, slot: int) -> None:
        """Forget every entry of one stream slot (the slot is being dropped or reused)."""
        self.twins.pop(slot, None)
        self._twin_sweep.pop(slot, None)
        gens = self._gens.get(slot)
        if gens is not None:
            self._drop(slot, [k for k in gens if isinstance(k, int)])

    def namespaces(self) -> set[int]:
        """Ids of the namespaces that may have entries (every unexpired mark's)."""
        return {mark[3] for mark in self._fifo}

    def discard_slot_namespaces(self, slot: int, ns_ids: set[int]) -> None:
        """Forget every entry of these namespaces on one slot."""
        self._retire_where(lambda mark: mark[1] == slot and mark[3] in ns_ids)

    def discard_namespace(self, ns_id: int) -> None:
        """Forget every entry of one namespace (it is being evicted)."""
        self._retire_where(lambda mark: mark[3] == ns_id)

    def _retire_where(self, doomed: Callable[[_Mark], bool]) -> None:
        """Retire every standing mark `doomed` says, keeping the others in order."""
        kept: deque[_Mark] = deque()
        for mark in self._fifo:
            if doomed(mark):
                self._retire(mark)
            else:
                kept.append(mark)
        self._fifo = kept

    def clear(self) -> None:
        """Forget everything."""
        self.bits.clear()
        self._gens.clear()
        self._fifo.clear()
        self._live.clear()
        self.twins.clear()
        self._twin_sweep.clear()
