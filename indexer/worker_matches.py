"""Per-worker query answers: the index's per-stream match turned into one `WorkerMatch` each.

Every answer carries the worker's best stream in its top-level fields and every stream apart in
`ranks` (one `RankMatch` per data-parallel rank, in the order the worker's streams are given:
the service gives them in rank order), so the router can choose a (worker, rank), not just a
worker.

The router asks for every known worker on every request, but a query matches only some of
them and stream states change rarely. So `WorkerMatches` caches, per worker, its state (the
best among its streams) and an answer for "holds nothing", and a query copies that dict and
touches only the workers whose streams matched something; a matched stream's answer is reused
per (stream, matched depth) when no pending entry or tier is involved (a shared system prompt
matches the same depth on many queries).

Streams in an UNTRUSTED state (DEGRADED: batches known missing, being fetched again;
UNVERIFIED: a restart candidate not yet disproven; STALE) add nothing to their worker's
answer, whatever they hold: kvroute cannot know the worker still has those pages (fail
closed). Their rank is still listed, holding nothing, with its state.

The cache is checked on every query and rebuilt when anything it depends on moved:
- a stream's `state` attribute (SYNCING / SYNCED / DEGRADED / UNVERIFIED), compared in one
  C-level pass;
- time: a live stream goes STALE exactly `stale_after_s` after it last heard anything, so the
  cache expires at the earliest such deadline; a STALE stream that hears something again (an
  event or a probe answer) is noticed by its heard-at time moving;
- a stream whose block size was unknown applies a batch (the owner calls `on_applied`); until
  then its worker is answered uncached on every query, so a learned size shows at once;
- and at most every `REFRESH_S` regardless, as a backstop.
Workers added or removed and snapshot loads invalidate it explicitly (`IndexerService`).

The cached `WorkerMatch` and `RankMatch` objects (and their `by_medium` dicts) are shared
between queries until the cache is rebuilt: callers read them and must not mutate them.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from indexer.health import StreamHealth
from indexer.index.walk import PrefixMatch
from indexer.stats import STATE_RANK, UNTRUSTED, RankMatch, StreamState, WorkerMatch

__all__ = ["REFRESH_S", "WorkerMatches"]

REFRESH_S = 0.1  # the longest a cached per-worker view is used without being rebuilt

_MEMO_LIMIT = 1 << 14  # cached non-zero answers per kind, (stream, held) -> answer

_state_of = attrgetter("state")


class WorkerMatches:
    """Cached per-worker states and zero answers over a set of workers' subscribers."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._valid = False
        self._expires = 0.0
        self._subs: list[StreamHealth] = []  # every stream, in worker order
        self._states: list[StreamState] = []  # their `state` attributes when cached
        self._revive: list[tuple[StreamHealth, float]] = []  # STALE streams, heard at
        self._unsized: set[str] = set()  # streams whose block size is not known yet
        self._unsized_workers: set[str] = set()  # their workers: answered live, every query
        self._zeros: dict[str, WorkerMatch] = {}  # worker -> its "holds nothing" answer
        # stream -> (worker, block size, state, dp rank) for workers with exactly one stream
        self._solo: dict[str, tuple[str, int | None, StreamState, int]] = {}
        self._multi: dict[str, str] = {}  # stream -> worker, for workers with several streams
        self._worker_streams: dict[str, list[StreamHealth]] = {}
        self._worker_first: dict[str, StreamHealth | None] = {}
        self._worker_state: dict[str, StreamState] = {}
        self._stream_state: dict[str, StreamState] = {}  # each stream's own, when cached
        self._rank_zeros: dict[str, RankMatch] = {}  # stream -> its "holds nothing" rank
        self._memo: dict[tuple[str, int], WorkerMatch] = {}  # (stream, held), none pending
        self._rank_memo: dict[tuple[str, int], RankMatch] = {}  # the same, for rank answers
        # worker -> (its stream ids, as many zeros): the key of `_ranked_answers`
        self._worker_sids: dict[str, tuple[list[str], list[int]]] = {}
        # (worker, depth per stream) -> answer, none pending: for workers of several ranks
        self._ranked_answers: dict[tuple[str, tuple[int, ...]], WorkerMatch] = {}

    def invalidate(self) -> None:
        """Rebuild at the next query (workers changed, a snapshot was loaded)."""
        self._valid = False

    def on_applied(self, stream: str) -> None:
        """A stream applied a batch: its block size may just have become known."""
        if self._unsized and stream in self._unsized:
            self._valid = False

    def answer(
        self,
        workers: dict[str, list[StreamHealth]],
        found: PrefixMatch,
        default_medium: str,
    ) -> dict[str, WorkerMatch]:
        """One `WorkerMatch` per worker of `workers` for the per-stream match `found`."""
        now = self._clock()
        if (
            not self._valid
            or now > self._expires
            or list(map(_state_of, self._subs)) != self._states
            or (self._revive and any(s.heard_at() != t for s, t in self._revive))
        ):
            self._rebuild(workers, now)
        out = dict(self._zeros)  # a fresh dict: the caller may add to it or drop from it
        blocks = found.blocks
        pending = found.pending_blocks
        # workers answered by `_ranked`, which reads block sizes from the subscribers
        several = set(self._unsized_workers)
        if not blocks and not pending:
            for worker in several:
                out[worker] = self._ranked(worker, found, default_medium)
            return out
        if not pending and not found.by_medium:
            # the common case: the answer given before for this (stream, depth), if any
            get = self._memo.get
            for item in blocks.items():
                match = get(item)
                if match is None:
                    match = self._solo_answer(item[0], item[1], 0, None, default_medium, several)
                    if match is None:
                        continue
                out[match.worker] = match
            busy: set[str] = set()
        else:
            tiered = found.by_medium
            busy = set()  # workers of several ranks with a pending entry or a tier: built anew
            multi = self._multi
            for sid in blocks.keys() | pending.keys():
                match = self._solo_answer(
                    sid,
                    blocks.get(sid, 0),
                    pending.get(sid, 0),
                    tiered.get(sid),
                    default_medium,
                    several,
                )
                if match is not None:
                    out[match.worker] = match
                elif (sid in pending or sid in tiered) and sid in multi:
                    busy.add(multi[sid])
        # a worker of several ranks: the answer given before for the depths of its streams,
        # unless a block size is unknown or a pending entry or tier makes it one of a kind
        unsized = self._unsized_workers
        for worker in several:
            if worker in unsized or worker in busy:
                out[worker] = self._ranked(worker, found, default_medium)
            else:
                out[worker] = self._ranked_memo(worker, blocks, found, default_medium)
        return out

    def _solo_answer(
        self,
        sid: str,
        held: int,
        more: int,
        by_medium: dict[str, int] | None,
        default_medium: str,
        several: set[str],
    ) -> WorkerMatch | None:
        """The answer of a single-stream worker; None (and its worker in `several`) otherwise."""
        info = self._solo.get(sid)
        if info is None:
            worker = self._multi.get(sid)
            if worker is not None:  # None: a stream of no worker (left by a snapshot)
                several.add(worker)
            return None
        worker, size, state, dp_rank = info
        if size is None:  # not known when cached: `_ranked` asks the subscriber
            several.add(worker)
            return None
        if by_medium is not None or more:
            tiers = by_medium if by_medium is not None else {default_medium: held} if held else {}
            rank = RankMatch(dp_rank, held, held * size, more * size, size, tiers, state)
            return WorkerMatch(worker, held, held * size, more * size, size, tiers, state, (rank,))
        # answers repeat (a shared system prompt matches the same depth on many queries):
        # reuse them until the cache is rebuilt, like the zero answers
        memo = self._memo
        match = memo.get((sid, held))
        if match is None:
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()  # bounded: a miss only rebuilds one object
            tiers = {default_medium: held} if held else {}
            rank = RankMatch(dp_rank, held, held * size, 0, size, tiers, state)
            match = memo[(sid, held)] = WorkerMatch(
                worker, held, held * size, 0, size, tiers, state, (rank,)
            )
        return match

    def _rank_answer(self, sub: StreamHealth, found: PrefixMatch, default_medium: str) -> RankMatch:
        """What one stream of a worker answered by `_ranked` holds (block size read live)."""
        sid = sub.stream_id
        state = self._stream_state[sid]
        size = sub.block_size
        zero = self._rank_zeros[sid]
        if state in UNTRUSTED:  # its entries predict nothing
            if zero.block_size != size:
                zero = RankMatch(sub.dp_rank, 0, 0, 0, size, {}, state)
            return zero
        held = found.blocks.get(sid, 0)
        more = found.pending_blocks.get(sid, 0)
        tiers = found.by_medium.get(sid)
        if not held and not more and tiers is None:
            if zero.block_size != size:
                zero = RankMatch(sub.dp_rank, 0, 0, 0, size, {}, state)
            return zero
        bs = size or 0
        if more or tiers is not None or size is None:
            if tiers is None:
                tiers = {default_medium: held} if held else {}
            return RankMatch(sub.dp_rank, held, held * bs, more * bs, size, tiers, state)
        memo = self._rank_memo
        rank = memo.get((sid, held))
        if rank is None:
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()
            rank = memo[(sid, held)] = RankMatch(
                sub.dp_rank, held, held * bs, 0, size, {default_medium: held}, state
            )
        return rank

    def _ranked_memo(
        self, worker: str, blocks: dict[str, int], found: PrefixMatch, default_medium: str
    ) -> WorkerMatch:
        """`_ranked` for a sized worker and a match without pending entries or tiers, reused
        per (worker, depth of each of its streams) until the cache is rebuilt."""
        sids, zeros = self._worker_sids[worker]
        key = (worker, tuple(map(blocks.get, sids, zeros)))
        memo = self._ranked_answers
        match = memo.get(key)
        if match is None:
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()
            match = memo[key] = self._ranked(worker, found, default_medium)
        return match

    def _ranked(self, worker: str, found: PrefixMatch, default_medium: str) -> WorkerMatch:
        """The answer of a worker with several streams (or an unknown block size): every rank,
        and its best one (most matched tokens, then most with pending; the first on ties)."""
        blocks = found.blocks
        pending = found.pending_blocks
        ranks = []
        best: RankMatch | None = None
        best_score = (-1, -1)
        for sub in self._worker_streams[worker]:
            rank = self._rank_answer(sub, found, default_medium)
            ranks.append(rank)
            if rank.state in UNTRUSTED:
                continue
            sid = sub.stream_id
            bs = sub.block_size or 0
            held = blocks.get(sid, 0)
            score = (held * bs, (held + pending.get(sid, 0)) * bs)
            if score > best_score:
                best, best_score = rank, score
        state = self._worker_state[worker]
        if best is None:  # no stream, or none trusted: the first stream's size, as cached
            first = self._worker_first[worker]
            size = first.block_size if first is not None else None
            return WorkerMatch(worker, 0, 0, 0, size, {}, state, tuple(ranks))
        return WorkerMatch(
            worker,
            best.matched_blocks,
            best.matched_tokens,
            best.pending_tokens,
            best.block_size,
            best.by_medium,
            state,
            tuple(ranks),
        )

    def _rebuild(self, workers: dict[str, list[StreamHealth]], now: float) -> None:
        expires = now + REFRESH_S
        self._subs = []
        self._revive = []
        self._unsized = set()
        self._unsized_workers = set()
        self._zeros = {}
        self._solo = {}
        self._multi = {}
        self._worker_streams = {}
        self._worker_first = {}
        self._worker_state = {}
        self._stream_state = {}
        self._rank_zeros = {}
        self._memo = {}
        self._rank_memo = {}
        self._worker_sids = {}
        self._ranked_answers = {}
        for worker, subs in workers.items():
            state = StreamState.STALE
            trusted = []
            zeros = []
            for sub in subs:
                self._subs.append(sub)
                s_state = sub.current_state(now)
                self._stream_state[sub.stream_id] = s_state
                zero = RankMatch(sub.dp_rank, 0, 0, 0, sub.block_size, {}, s_state)
                self._rank_zeros[sub.stream_id] = zero
                zeros.append(zero)
                if s_state not in UNTRUSTED:
                    trusted.append(sub)
                if s_state is StreamState.STALE:
                    self._revive.append((sub, sub.heard_at()))
                else:
                    expires = min(expires, sub.heard_at() + sub.stale_after_s)
                if STATE_RANK[s_state] < STATE_RANK[state]:
                    state = s_state
                if sub.block_size is None:
                    self._unsized.add(sub.stream_id)
                    self._unsized_workers.add(worker)
            # with nothing matched the first trusted stream is the "best" (the rule of `_ranked`)
            first = trusted[0] if trusted else subs[0] if subs else None
            size = first.block_size if first is not None else None
            self._zeros[worker] = WorkerMatch(worker, 0, 0, 0, size, {}, state, tuple(zeros))
            self._worker_streams[worker] = list(subs)
            self._worker_sids[worker] = ([sub.stream_id for sub in subs], [0] * len(subs))
            self._worker_first[worker] = first
            self._worker_state[worker] = state
            if len(subs) == 1:
                if trusted:  # an untrusted stream's matches are left out: its zero answer
                    sub = subs[0]
                    self._solo[sub.stream_id] = (worker, size, state, sub.dp_rank)
            else:
                for sub in subs:
                    self._multi[sub.stream_id] = worker
        self._states = list(map(_state_of, self._subs))
        self._expires = expires
        self._valid = True
