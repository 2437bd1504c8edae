"""What a worker will still hold when it admits a request: the match, discounted for eviction.

The index says what a worker holds *now*. A request routed there waits in the worker's queue
behind the requests already sent to it, and each of those allocates KV for the prompt tokens
it does not find cached; once the pool is full, every allocation evicts the least recently
used unlocked pages. Under KV pressure the matched prefix may be gone by the time the request
is admitted (the routing benchmark measured 82-94% index accuracy at pressure 4 without this).

The model, per (worker, dp rank) stream, with everything the router already knows:

    evict = max(0, held + queued + in_flight * reserve - capacity)

- `capacity`: the rank's KV pool in tokens (SGLang's `max_total_num_tokens` in /server_info);
  unknown capacity forecasts nothing (the raw match stands, and `/admin/route` says so);
- `held`: tokens the stream holds per its KV events;
- `queued`: uncached prompt tokens of the requests sent there that have not started answering
  (the router's own load: `router.routing.load`), which the worker must still allocate;
- `reserve`: tokens each in-flight request is assumed to allocate beyond its prompt (output,
  the rounding of its last page): `[policy] admission_reserve_tokens`.

When `evict` is positive, which blocks go is decided by LRU stack distance: a block is still
cached at admission when fewer blocks than the pool holds (less the in-flight requests'
private reserve) will have been used since it was last used; by then every request ahead of
this one has used its prompt's blocks. The recency order is the router's own
(`RecencyBook`): every decision touches the blocks of its prompt on the chosen stream, all
with one stamp, as the worker touches a request's whole path at once and evicts a leaf node
whole. A block no decision touched is as recent as the nearest touched block above it in the
prompt (a path is touched together); with none above it (stored before this router started,
or routed by another router) it is taken as the oldest. The prediction is the leading
matched blocks that survive (along a path, survival only gets rarer with depth).

A block brought by a request still on its way (pending, or held now but lost before that
request's own admission, which then computes it again) is there for this request only if
the worker admits that request in an earlier batch: a worker matches every request of a
batch against the cache as it was before the batch, and stores their prompts only when the
batch's prefill ends (`WaitingDecisions` infers which requests it has admitted); on a worker
that may batch again before that prompt is cached (SGLang's overlap scheduler forms its next
batch while a prefill runs; chunked prefill splits a prompt over batches), only once that
request has answered, whose prompt is cached by then. One sent where the KV pool had no room
for it beside the requests in flight waits until requests ending free enough pages, in a
batch the router cannot tell: until then no request routed there is predicted a block it
brings.

Pure and synchronous: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from itertools import compress
from operator import not_

import msgspec

from indexer.backend import DEFAULT
from indexer.int_map import PyIntMap

__all__ = [
    "AdmissionForecast",
    "RecencyBook",
    "WaitingDecisions",
    "forecast",
    "recency_stride",
    "stretch_keys",
    "unbooked",
    "unforecast",
]


# the recency book keeps one block per this many tokens of a path: a worker with small pages
# (SGLang's default is one token) would otherwise cost the router one book entry per token
# of every prompt it routes (an 8k-token prompt: 8,192 entries, about 20 ms to touch)
RECENCY_SAMPLE_TOKENS = 16

# the stamp `RecencyBook` reads for a key no decision touched (stamps count up from 0)
_UNSTAMPED = -1

# up to this many earlier groups a touch takes keys from, it shrinks each by set difference
_FEW_GROUPS = 8

# how soon an idle worker takes a request in: what reaches it meanwhile joins the batch
_NEXT_TURN_S = 0.001

# how long after its request answered a pending block still counts as on its way, and only
# until the stream has published an event batch since that answer: its stores were published
# before the answer left the worker, but may reach the router after it (event lag). Before,
# a prompt repeated as soon as its first copy answered was predicted no hit about a third of
# the time on a loaded router (`forecast`, `WaitingDecisions.settled`)
EVENT_GRACE_S = 0.25

# how long after its answer a request's stores not in the events count as held all the same
# (`WaitingDecisions.unseen`): event batches reach the router tens of milliseconds after the
# answer on a loaded router (hundreds at worst, QA); past this, they were evicted or never made
UNSEEN_S = 1.0
# why a block is gone at admission (`forecast`)
_EVICTED = "evicted"
_ANSWERED = "answered"
_BATCHED = "batched"


class AdmissionForecast(msgspec.Struct, gc=False):
    """The prediction for one candidate, with the numbers behind it (shown by /admin/route)."""

    raw_tokens: int  # matched + pending tokens per the index, now
    kept_tokens: int  # of those, the ones predicted to be held when the request is admitted
    capacity_tokens: int | None  # the rank's KV pool (None: unknown, no forecast)
    held_tokens: int = 0  # what its KV events say it holds now
    queued_tokens: int = 0  # what requests ahead of this one must still allocate
    # of `queued_tokens`, the prompts of requests that answered whose stores the events do not
    # show yet (`WaitingDecisions.unseen`): the forecast counts them, the room charge does not
    unseen_tokens: int = 0
    evict_tokens: int = 0  # what it must evict before admitting this request
    # the requests waiting there that were sent when the KV pool had no room for them beside
    # those in flight, and have not had room since: the worker admits them as requests end
    # and free pages, in batches the router cannot tell, so the blocks they bring are
    # predicted to no request routed meanwhile (`WaitingDecisions.sent`)
    awaiting_room: int = 0
    why: str = ""
    # why the tokens not kept are lost ("": none are): "evicted" (least recently used before
    # admission), "batched" (they come with a request the worker admits in the same batch),
    # "answered" (pending marks whose request answered without storing them: the events,
    # which would show the stores by then, do not; `WaitingDecisions.settled`)
    cause: str = ""


class RecencyBook:
    """One stream's blocks in the order the router last sent requests over them.

    Every decision gives all the blocks of its prompt one new stamp: the worker touches a
    request's whole path at once, and evicts a leaf node whole, so blocks touched together
    go together. Keys the stream no longer holds are dropped by `prune` (the caller checks
    them against the index), which keeps the book within a small multiple of the stream's
    capacity.

    A touch is on the request path of every replica, for every request of the fleet (an
    8k-token prompt is 512 blocks at page 16), so it works in bulk, not per key where it can:
    the stamps live in the indexer's int map (read and written in one C-level pass each), a
    prompt's keys come from a few earlier decisions, whose groups shrink by set difference,
    and the count of keys per stamp sits in a Fenwick tree, so `not_older` is a prefix sum.
    """

    __slots__ = ("_base", "_groups", "_next", "_stamps", "_tree")

    def __init__(self, int_map: type[PyIntMap] = DEFAULT.int_map) -> None:
        # block key -> its latest stamp << 1, | 1 once more than one decision used it here
        # (the eviction charge's hotness; a bit of the same value costs the touch nothing)
        self._stamps = int_map(True)
        # stamp -> the keys it is the latest of; stamps only grow, so this dict's order is
        # stamp order (oldest first)
        self._groups: dict[int, set[int]] = {}
        self._next = 0
        # keys per stamp, as a Fenwick tree over stamps from `_base` (1-based; grown and
        # rebased on the oldest live stamp when a stamp outgrows it)
        self._base = 0
        self._tree = [0] * 1025

    def __len__(self) -> int:
        return len(self._stamps)

    def touch(self, keys: Sequence[int]) -> int:
        """A request over `keys` goes to the stream: they become the newest, together;
        returns their stamp."""
        stamp = self._next
        self._next += 1
        if stamp - self._base + 1 >= len(self._tree):
            self._rebuild(stamp)
        group = set(keys)
        if len(group) != len(keys):  # a key twice would be counted twice below
            keys = list(dict.fromkeys(keys))
        groups = self._groups
        olds = self._stamps.get_many(keys, _UNSTAMPED)
        codes = set(olds)
        fresh = _UNSTAMPED in codes
        codes.discard(_UNSTAMPED)
        if len(codes) <= _FEW_GROUPS:  # the usual prompt: a prefix or two routed before
            moved: dict[int, int] = {}
            for code in codes:
                moved[code >> 1] = moved.get(code >> 1, 0) + olds.count(code)
            for old, n in moved.items():
                was = groups[old]
                if n == len(was):  # the whole group moves (a prompt sent again)
                    del groups[old]
                else:
                    was.difference_update(keys)
                self._add(old, -n)
        else:  # keys from many groups: one discard per key beats a pass over all per group
            counts = Counter(code >> 1 for code in olds if code != _UNSTAMPED)
            for key, code in zip(keys, olds, strict=True):
                if code != _UNSTAMPED:
                    groups[code >> 1].discard(key)
            for old, n in counts.items():
                self._add(old, -n)
                if not groups[old]:
                    del groups[old]
        again = stamp << 1 | 1
        if not fresh:
            self._stamps.assign(keys, again)
        elif not codes:
            self._stamps.assign(keys, stamp << 1)
        else:
            seen = list(map(_UNSTAMPED.__ne__, olds))
            self._stamps.assign(list(compress(keys, seen)), again)
            self._stamps.assign(list(compress(keys, map(not_, seen))), stamp << 1)
        groups[stamp] = group
        self._add(stamp, len(group))
        return stamp

    def reused(self, key: int) -> bool:
        """Whether more than one decision used the block on this stream since the book has
        known it."""
        return bool(self._stamps.get(key, 0) & 1)

    def oldest(self, n: int) -> list[int]:
        """The keys of the oldest groups, oldest first, until at least `n` (or all)."""
        out: list[int] = []
        for group in self._groups.values():
            if len(out) >= n:
                break
            out.extend(group)
        return out

    def stamp(self, key: int) -> int | None:
        """The key's latest stamp, None when no decision touched it."""
        code = self._stamps.get(key)
        return None if code is None else code >> 1

    def not_older(self, stamp: int) -> int:
        """How many keys of the book were touched at `stamp` or later."""
        i = min(stamp - self._base, len(self._tree) - 1)
        older = 0
        tree = self._tree
        while i > 0:
            older += tree[i]
            i -= i & -i
        return len(self._stamps) - older

    def prune(self, holds: Callable[[list[int]], list[bool]], keep: int) -> int:
        """Drop keys the stream no longer holds (`holds` answers per key) among all but the
        newest `keep` (those may be on their way: their stores have not arrived), then the
        oldest beyond `2 * keep`; returns how many were dropped."""
        old = len(self._stamps) - keep
        if old <= 0:
            return 0
        keys: list[int] = []  # the oldest groups' keys, until they number at least `old`
        for group in self._groups.values():  # oldest first
            if len(keys) >= old:
                break
            keys.extend(group)
        dropped = list(compress(keys, map(not_, holds(keys))))
        extra = len(self._stamps) - len(dropped) - 2 * keep
        if extra > 0:  # then the oldest of the rest
            gone = set(dropped)
            for group in self._groups.values():
                if extra <= 0:
                    break
                rest = [k for k in group if k not in gone][:extra]
                dropped.extend(rest)
                extra -= len(rest)
        for key in dropped:
            stamp = self._stamps.pop(key) >> 1
            self._add(stamp, -1)
            group = self._groups[stamp]
            group.discard(key)
            if not group:
                del self._groups[stamp]
        return len(dropped)

    def _add(self, stamp: int, delta: int) -> None:
        tree = self._tree
        i = stamp - self._base + 1
        while i < len(tree):
            tree[i] += delta
            i += i & -i

    def _rebuild(self, stamp: int) -> None:
        """Room for `stamp`: the tree restarts at the oldest live stamp, twice as wide as it
        must be (each rebuild is paid for by the touches since the last)."""
        base = next(iter(self._groups), stamp)
        size = 1024
        while size < 2 * (stamp - base + 1):
            size *= 2
        tree = [0] * (size + 1)
        for s, group in self._groups.items():
            tree[s - base + 1] += len(group)
        for i in range(1, size + 1):  # the linear Fenwick construction
            j = i + (i & -i)
            if j <= size:
                tree[j] += tree[i]
        self._base, self._tree = base, tree


class _Sent(msgspec.Struct, gc=False):
    """What `WaitingDecisions` keeps of one decision until its request answers."""

    answers: int  # first bytes seen on the stream when it was sent; -1: none was due
    by: float  # admitted from this time on at the latest (inf: at an answer or event batch)
    seq: int | None  # the stream's last event batch applied when it was sent
    kept: int  # the leading blocks of its prompt it was predicted to reuse
    held: int  # those its events showed held then
    # the pool had no room for it when it was sent, nor since: not admitted, as far as the
    # router can tell (`WaitingDecisions.room_came` ends it)
    blocked: bool = False
    # the most KV it holds once admitted (whole prompt and output), as the load counts it
    footprint: int = 0
    # the blocks of its prompt the events did not show held when it was sent (what it stores
    # once its prefill ends), and its prompt's last block (seen held: they are in the events)
    stores: int = 0
    probe: int | None = None


class WaitingDecisions:
    """One stream's decisions whose requests have not started answering, and whether the
    worker has admitted each (so a request routed now runs in a later batch than it).

    The router cannot see admissions. It sees first bytes and event batches: a worker admits
    what waits at the end of each step, a prefill step ends with the first token of each of
    its requests, and a step that stored or evicted pages publishes a batch. So a request sent
    while others on the stream had not answered (a prefill running or queued ahead) is
    admitted at the first answer, or event batch, after it was sent (a prefill/decode pair's
    prefill side answers only once the decode has its KV; its stores show sooner). One sent
    with nothing unanswered ahead is admitted on the worker's next turn when nothing runs
    there, and within one decode step (`window_s`, which the router cannot see either) when
    requests are decoding; one sent before then goes in the same batch.

    All of that holds only for a request the worker has KV room for. One sent when the pool
    could not hold it beside the requests in flight (the caller says: `sent(room=False)`),
    or behind one such, waits for requests to end and free pages: an answer or event batch
    says nothing of it, and the worker admits it with whatever else has arrived by then. It
    is not taken as admitted until the caller says the pool has room for it and everything
    in flight ahead of it (`room_came`, at a request's end); from then on as one sent at that
    moment. Before, such a request was taken as admitted at the first answer or event batch,
    or a decode step after it was sent, and a request routed behind it, admitted in its
    batch, was predicted the prefix it brings (QA: 416 tokens predicted, 0 cached, every
    round).
    """

    __slots__ = (
        "_answers",
        "_blocked",
        "_decisions",
        "_done",
        "_recomputing",
        "_unseen",
        "grace_s",
        "window_s",
    )

    def __init__(self, window_s: float, grace_s: float = EVENT_GRACE_S) -> None:
        self.window_s = window_s
        self.grace_s = grace_s
        self._answers = 0  # first bytes seen on the stream
        self._decisions: dict[int, _Sent] = {}  # by stamp, oldest first
        self._recomputing = 0  # of those, the ones predicted to lose blocks held when sent
        self._blocked = 0  # of those, the ones waiting for KV room (`_Sent.blocked`)
        # the decisions answered (or ended) within `grace_s`: stamp -> (when, the stream's
        # last event batch applied then), oldest first (`settled`)
        self._done: dict[int, tuple[float, int | None]] = {}
        # the decisions answered within `UNSEEN_S` whose stores the events may not show yet:
        # stamp -> (when, blocks stored, the prompt's last block), oldest first (`unseen`)
        self._unseen: dict[int, tuple[float, int, int]] = {}

    def __len__(self) -> int:
        return len(self._decisions)

    def __contains__(self, stamp: object) -> bool:
        return stamp in self._decisions

    @property
    def awaiting_room(self) -> int:
        """How many waiting decisions wait for KV room (`sent(room=False)`)."""
        return self._blocked

    def sent(
        self,
        stamp: int,
        *,
        kept_blocks: int,
        held_blocks: int,
        running: int,
        now: float,
        seq: int | None = None,
        room: bool = True,
        footprint_tokens: int = 0,
        stores_blocks: int = 0,
        probe: int | None = None,
    ) -> None:
        """The decision of `stamp` went out, predicted to reuse `kept_blocks` of the
        `held_blocks` its events showed; `running`: requests in flight there before it;
        `seq`: the stream's last event batch applied (None: none yet); `room`: whether the
        KV pool had room for it beside the requests in flight (True: or not known);
        `footprint_tokens`: the KV it may hold, as the caller's load counts it (`room_came`);
        `stores_blocks`: the blocks of its prompt the events did not show held, `probe` its
        prompt's last block (`unseen`)."""
        decisions = self._decisions
        if kept_blocks < held_blocks:
            self._recomputing += 1
        inf = float("inf")
        if not room or self._blocked:
            # it waits for pages to come free, behind any that waits already (first come,
            # first served): admitted at no time the router can tell yet
            sent = _Sent(-1, inf, seq, kept_blocks, held_blocks, True, footprint_tokens)
            self._blocked += 1
        elif not decisions:
            # the worker takes it on its next turn (idle), or at the end of the decode step
            by = now + (self.window_s if running else _NEXT_TURN_S)
            sent = _Sent(-1, by, seq, kept_blocks, held_blocks, False, footprint_tokens)
        else:
            last = decisions[next(reversed(decisions))]
            if last.answers < 0 and now < last.by:
                # the last one ahead is not admitted yet, but will be at a time known: this
                # one arrived before then and goes in the same batch
                by, answers = last.by, -1
            else:  # the ones ahead are in a prefill (or wait for one): admitted when it ends
                by, answers = inf, self._answers
            sent = _Sent(answers, by, seq, kept_blocks, held_blocks, False, footprint_tokens)
        sent.stores, sent.probe = stores_blocks, probe
        decisions[stamp] = sent

    def answered(
        self, stamp: int, *, first_byte: bool, now: float = 0.0, seq: int | None = None
    ) -> None:
        """The request of `stamp` answered (`first_byte`) or ended without an answer, at
        `now`, the stream's last event batch applied being `seq`."""
        sent = self._decisions.pop(stamp, None)
        if sent is not None and sent.kept < sent.held:
            self._recomputing -= 1
        if sent is not None and sent.blocked:
            self._blocked -= 1
        if first_byte:
            self._answers += 1
            if sent is not None and sent.stores and sent.probe is not None:
                unseen = self._unseen
                while unseen:  # bounded without `unseen` asked: those past their time go
                    oldest = next(iter(unseen))
                    if unseen[oldest][0] >= now - UNSEEN_S:
                        break
                    del unseen[oldest]
                unseen[stamp] = (now, sent.stores, sent.probe)
        if sent is None:
            return  # its end after its answer: the answer started the grace
        if not first_byte:
            # ended unanswered: its pending marks were taken back (failed, refused, or its
            # client left: the proxy's `Withdraw`), so one left on a block it touched last is
            # another request's, which may not have answered either: nothing says it is on
            # its way (`settled` at once). Before, it counted through this one's grace, and a
            # sibling sent right after a cancelled one was predicted the prefix that a request
            # still queued ahead brings (QA: 128 tokens predicted, 0 cached)
            return
        done = self._done
        while done:  # those past their grace need no entry: `settled` says so without one
            oldest = next(iter(done))
            if done[oldest][0] > now - self.grace_s:
                break
            del done[oldest]
        done[stamp] = (now, seq)

    def settled(self, stamp: int, now: float, seq: int | None) -> bool:
        """Whether the answered request of `stamp` would be shown by the events by now, at
        `now` with `seq` the stream's last event batch applied, had it stored its prompt:
        once `grace_s` has passed since its answer and the stream has published a batch
        since. Until then its stores may be on their way (event lag), and the blocks it
        marked pending count."""
        done = self._done.get(stamp)
        if done is None:
            return True  # answered longer ago than the grace (or never seen here)
        at, then = done
        if now - at < self.grace_s:
            return False
        return seq is not None and (then is None or seq > then)

    def unseen(self, now: float, held: Callable[[int], bool]) -> int:
        """The blocks the worker holds and the events do not show yet: the prompts of the
        requests that answered within `UNSEEN_S` and stored blocks not held when they were sent,
        until the stream's events show their last block (`held`). A worker publishes a
        prefill's stores as it ends, but they may reach the router after the answer; until
        then the prompt counts neither as queued (the load drops it at the answer) nor as held,
        and a pool forecast that short evicts nothing it will evict (QA: 320 tokens predicted,
        none cached, every round with event batches 0.3 s late)."""
        unseen = self._unseen
        if not unseen:
            return 0
        total = 0
        for stamp, (at, blocks, probe) in list(unseen.items()):
            if now - at > UNSEEN_S or held(probe):
                del unseen[stamp]
            else:
                total += blocks
        return total

    def room_came(self, over_tokens: int, now: float, seq: int | None = None) -> None:
        """A request ended there, at `now` (the stream's last event batch applied being
        `seq`), and the requests in flight may hold `over_tokens` more KV than the pool has
        (the caller's load: at most; negative: room to spare). A request waiting for room is
        admitted on the worker's next step once what is in flight less the requests waiting
        behind it (their footprints, first come, first served) fits: as if sent now with
        requests decoding (within `window_s`, or at the next event batch); one sent before
        then joins its batch."""
        if not self._blocked:
            return
        behind = 0  # the footprints of the decisions after the one looked at
        admit = False
        for sent in reversed(self._decisions.values()):
            # what waits behind only grows going back: once one fits, all ahead of it do
            admit = admit or (sent.blocked and over_tokens <= behind)
            if admit and sent.blocked:
                sent.blocked = False
                sent.answers, sent.by, sent.seq = -1, now + self.window_s, seq
                self._blocked -= 1
            behind += sent.footprint

    def admitted(self, stamp: int, now: float, seq: int | None = None) -> bool:
        """Whether the worker has (probably) admitted the waiting request of `stamp`, at
        `now`, with `seq` the stream's last event batch applied (never while it waits for KV
        room: `sent`)."""
        sent = self._decisions[stamp]
        if sent.blocked:
            return False
        if now >= sent.by or (sent.answers >= 0 and self._answers > sent.answers):
            return True
        # a batch published since: a step ended after it was sent
        return seq is not None and (sent.seq is None or seq > sent.seq)

    def joins_batch(
        self,
        stamp: int,
        *,
        now: float,
        seq: int | None,
        batch_room: int | None,
        trickles: bool = False,
        running_cap: int | None = None,
        cached_late: bool = False,
    ) -> bool:
        """Whether a request routed now is admitted in the same batch as the waiting one of
        `stamp`, or in one formed before that one's prompt is cached (so it finds nothing
        that one brings).

        On a worker whose prompts are `cached_late` (SGLang's overlap scheduler, its default,
        forms the next batch while a prefill batch runs, before its prompts are cached; chunked
        prefill splits a prompt over several batches) a request admitted right behind one
        still prefilling finds none, or only part, of its prompt. Nothing the router sees tells
        that apart from a later batch until the one of `stamp` answers (its prompt is cached by
        then), so there a request routed while it waits is taken to find nothing it brings,
        wherever it stands.

        Elsewhere: not if that one is admitted already,
        nor if the next batch (`batch_room` requests at most; None: unknown) cannot take both
        and those between them. On a worker that `trickles` (a prefill side, whose pages stay
        locked until its decode fetches them) a backlog longer than a batch is admitted a few
        requests at a time as pages come free, wherever the one of `stamp` stands in it: there
        only the request right behind it is taken to share its batch (measured at KV pressure
        4: 2-7 requests a batch; the one right behind shared it about half the time, one
        further back about a quarter of the time).

        One that waits for KV room (`sent(room=False)`) is admitted when requests end and
        free pages, with whatever has arrived by then, in a batch the router cannot tell: a
        request routed now is taken to share it unless the running cap (`running_cap`, the
        worker's `max_running_requests`; None: unknown) cannot take both and those between
        them. The room the requests decoding leave now (`batch_room`) says nothing of that
        batch: they end to make room. Before, a backlog four or more requests longer than
        the pool held was taken to be admitted one request after another, and a request
        routed behind was predicted the blocks of the one ahead: QA found that wrong more
        often than right (11 of 19, 300 requests on three 1,024-token pools)."""
        if cached_late:
            return True
        if self._decisions[stamp].blocked:
            return running_cap is None or self.behind(stamp) + 2 <= running_cap
        if trickles and batch_room is not None and len(self._decisions) + 1 > batch_room:
            # a step there admits only what the pages freed allow: an answer or event batch
            # since it was sent does not say it was among those taken in
            return self.behind(stamp) == 0
        if self.admitted(stamp, now, seq):
            return False
        if batch_room is None:
            return True
        behind = self.behind(stamp)
        return behind + 2 <= batch_room

    def recomputes_held(self) -> bool:
        """Whether a waiting request will compute again blocks the events show held (it was
        predicted to lose them before its admission): only such a request can take a held
        block from a request routed now."""
        return self._recomputing > 0

    def oldest(self) -> int | None:
        """The stamp of the oldest decision still waiting (None: none waits)."""
        return next(iter(self._decisions), None)

    def behind(self, stamp: int) -> int:
        """How many waiting decisions were sent after the one of `stamp`."""
        return sum(1 for other in self._decisions if other > stamp)

    def brings(self, stamp: int, block: int, held: bool) -> bool:
        """Whether the waiting request of `stamp` computes block `block` of its prompt (it
        was not predicted to reuse it), yet to store it: a block `held` now was held when it
        was sent already (one stored since, it stored: its prefill is over)."""
        sent = self._decisions[stamp]
        return block >= sent.kept and (not held or block < sent.held)


def recency_stride(block_size: int) -> int:
    """Every how many blocks of a path the recency book keeps one."""
    return max(1, RECENCY_SAMPLE_TOKENS // max(1, block_size))


def stretch_keys(keys: Sequence[int], stride: int) -> list[int]:
    """The keys of a path's blocks (root first) the recency book keeps: the last block of each
    stretch of `stride` blocks, and of a last, shorter one its last block. A request that uses
    a block uses every block above it, so the last block's recency is a lower bound of its
    stretch's: a stretch is never taken as more recent than any of its blocks. The first
    block stood for its stretch until 2026-12-06, an upper bound: a prompt that left a busy
    shared prefix inside a stretch had its own blocks there taken as recent as the shared
    one, and predicted held after the worker had evicted them (QA, pages of 1-8 tokens:
    matched 16, cached 8-12, every round)."""
    if stride == 1:
        return list(keys)
    kept = list(keys[stride - 1 :: stride])
    if len(keys) % stride:
        kept.append(keys[-1])
    return kept


def unforecast(raw_tokens: int, why: str, capacity_tokens: int | None = None) -> AdmissionForecast:
    """No discount: the raw match is the prediction, for the reason given."""
    return AdmissionForecast(
        raw_tokens=raw_tokens, kept_tokens=raw_tokens, capacity_tokens=capacity_tokens, why=why
    )


def unbooked(found: AdmissionForecast, matched_tokens: int) -> AdmissionForecast:
    """`found`, a raw match no book of the requests on their way could discount (`unforecast`),
    on a worker whose prompts are cached late (SGLang's overlap scheduler, chunked prefill, vLLM):
    the match's pending part is not predicted, as `WaitingDecisions.joins_batch` would drop the
    blocks a request not answered yet brings, and nothing here tells which answered. Before,
    a worker of unknown capacity (every vLLM worker) was predicted them whole (QA)."""
    lost = found.raw_tokens - matched_tokens
    if lost > 0:
        found.kept_tokens, found.cause = matched_tokens, _BATCHED
        found.why += (
            f"; its {lost} pending tokens are not predicted: the worker may batch again before "
            "a prompt it admitted is cached, and no book of the requests on their way is kept"
        )
    return found


def forecast(
    *,
    raw_tokens: int,
    matched_tokens: int,
    capacity_tokens: int | None,
    held_tokens: int,
    queued_tokens: int,
    in_flight: int,
    reserve_tokens: int,
    unseen_tokens: int = 0,
    block_size: int | None,
    keys: Callable[[], Sequence[int]],
    book: RecencyBook | None,
    waiting: WaitingDecisions | None,
    now: float = 0.0,
    seq: int | None = None,
    batch_room: int | None = None,
    stride: int = 1,
    trickles: bool = False,
    running_cap: int | None = None,
    cached_late: bool = False,
) -> AdmissionForecast:
    """The part of a `raw_tokens` match (whole blocks: the first `matched_tokens` from events,
    the rest from pending marks) still held when the request is admitted.

    `keys` gives the matched blocks' keys, root first (called only when needed); `book` is the
    stream's recency (None: nothing touched yet, all blocks oldest); `waiting` holds the
    decisions whose requests have not started answering (at `now`, the stream's last event
    batch applied being `seq`), None when no event can show the request's blocks (its
    namespace is unindexed), so pending marks stand. A pending block whose latest decision
    has answered, yet is not in the events, was evicted or never stored. A block that a
    waiting request brings is reused only if the worker admitted that request already, or if
    the next batch there (`batch_room` requests at most; None: unknown) cannot take both
    (else both run in one batch; on a worker that `trickles`, or for a request that waits
    for KV room, see `WaitingDecisions.joins_batch`, with the worker's `running_cap`; on one
    whose prompts are `cached_late`, never before that request answers). The book holds the
    last block of each stretch of `stride` blocks (`stretch_keys`), standing for the stretch it
    ends.
    """
    if capacity_tokens is None:
        found = unforecast(raw_tokens, "capacity unknown (no max_total_num_tokens): raw match used")
        return unbooked(found, matched_tokens) if cached_late else found
    queued = queued_tokens + unseen_tokens + in_flight * reserve_tokens
    evict = max(0, held_tokens + queued - capacity_tokens)
    out = AdmissionForecast(
        raw_tokens=raw_tokens,
        kept_tokens=raw_tokens,
        capacity_tokens=capacity_tokens,
        held_tokens=held_tokens,
        queued_tokens=queued,
        unseen_tokens=unseen_tokens,
        evict_tokens=evict,
        awaiting_room=0 if waiting is None else waiting.awaiting_room,
    )
    if not raw_tokens or not block_size:
        out.why = "nothing matched"
        return out
    fits = (
        f"held {held_tokens} + queued {queued} <= capacity {capacity_tokens}: nothing is "
        "evicted before admission"
    )
    matched_blocks = matched_tokens // block_size
    if (
        not evict
        and raw_tokens <= matched_tokens
        and (waiting is None or not waiting.recomputes_held())
    ):
        # all held, nothing evicted, and no request ahead to compute a held block again: the
        # prompt's keys are not needed (the common case, kept off the request path)
        out.why = fits
        return out
    blocks = list(keys())[: raw_tokens // block_size]
    pool_blocks = capacity_tokens // block_size
    # the pages in-flight requests hold privately (beyond their prompts' whole blocks, which
    # the book has): each its output and its prompt's last, partial page (half a page on
    # average), in whole pages
    private = in_flight * -(-(reserve_tokens + (block_size - 1) // 2) // block_size)

    last = len(blocks) - 1

    def sample(j: int) -> int:
        # the book keeps the last block of each stretch (`stretch_keys`): it stands for its
        # stretch; where the match ends inside one, the match's own last block
        return blocks[min(j - j % stride + stride - 1, last)]

    def stamp_of(j: int) -> int | None:
        # a block no decision touched is as recent as the nearest touched one above it (a
        # path is touched together); with none above it, it is the oldest (None). Not where
        # the match ends inside a stretch whose own last block no decision ended at: the
        # requests that used its blocks went on past it, down other paths, and left their
        # recency on keys this prompt does not have. A block above stands for nothing there,
        # and the stretch is the oldest (it may be a colder prompt's, left under a hot prefix)
        if book is None:
            return None
        end = j - j % stride + stride - 1
        if end > last:
            return book.stamp(blocks[last])
        for k in range(end, -1, -stride):
            stamp = book.stamp(blocks[k])
            if stamp is not None:
                return stamp
        return None

    def lost(j: int) -> str:
        """Why block `j` is gone when the request is admitted ("": it is not)."""
        if book is not None and waiting is not None:
            own = book.stamp(sample(j))
            if own is not None and own in waiting:
                # the request of the block's latest decision computes it (it was not to find
                # it) and has not been admitted: this request joins its batch, finds nothing
                if waiting.brings(own, j, held=j < matched_blocks) and waiting.joins_batch(
                    own,
                    now=now,
                    seq=seq,
                    batch_room=batch_room,
                    trickles=trickles,
                    running_cap=running_cap,
                    cached_late=cached_late,
                ):
                    return _BATCHED
            elif own is not None and j >= matched_blocks and waiting.settled(own, now, seq):
                # a pending block whose latest decision here has answered, yet is not in the
                # events though they would show it by now, was evicted or never stored (a
                # block only another router marked has no stamp here: its mark stands); one
                # answered within the grace may be in events still on their way
                return _ANSWERED
        if not evict:
            return ""
        # LRU stack distance: a block is still cached when fewer blocks than the pool holds
        # were used since it (by the time this request is admitted, every request ahead has
        # used its blocks); blocks touched by one decision share a stamp (a leaf node is
        # evicted whole)
        stamp = stamp_of(j)
        survives = (
            stamp is not None
            and book is not None
            and (book.not_older(stamp) * stride + private <= pool_blocks)
        )
        return "" if survives else _EVICTED

    # survival only gets rarer deeper down a path (the root is the most recent): bisect
    lo, hi = 0, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        if not lost(mid):
            lo = mid + 1
        else:
            hi = mid
    cause = lost(lo) if lo < len(blocks) else ""
    kept = min(raw_tokens, lo * block_size)
    out.kept_tokens = kept
    out.cause = cause if kept < raw_tokens else ""
    lost_tokens = raw_tokens - kept
    batched = (
        (
            f"; {lost_tokens} matched tokens come with a request that has not answered yet, "
            "and the worker may batch again before it has cached that prompt (SGLang's "
            "overlap scheduler, chunked prefill)"
            if cached_late
            else f"; {lost_tokens} matched tokens come with a request the worker has not "
            "admitted yet, and a batch finds nothing its own requests bring"
        )
        if cause == _BATCHED
        else ""
    )
    if batched and out.awaiting_room:
        batched += (
            f" (requests waiting there for KV room: {out.awaiting_room}; the worker admits "
            "them as requests end, in batches the router cannot tell)"
        )
    if not evict:
        out.why = fits + (
            f"; {lost_tokens} pending tokens are not on their way any more (the requests that "
            f"marked them answered over {EVENT_GRACE_S:g} s ago, and the events published "
            "since do not show them stored)"
            if cause == _ANSWERED
            else batched
        )
        return out
    out.why = (
        f"held {held_tokens} + queued {queued} > capacity {capacity_tokens}: {evict} tokens "
        "are evicted least recently used first before admission; "
        + (
            f"{lost_tokens} of the {raw_tokens} matched tokens are lost (more than {pool_blocks} "
            "blocks will have been used since they were)"
            if cause == _EVICTED
            else f"{lost_tokens} of the {raw_tokens} matched tokens are lost (the requests "
            f"that marked them pending answered over {EVENT_GRACE_S:g} s ago, and the events "
            "published since do not show them stored)"
            if cause == _ANSWERED
            else "the matched blocks were used more recently than those" + batched
        )
    )
    return out
