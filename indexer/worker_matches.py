"""Per-worker query answers: the index's per-stream match turned into one `WorkerMatch` each.

The router asks for every known worker on every request, but a query matches only some of
them and stream states change rarely. So `WorkerMatches` caches, per worker, its state (the
best among its streams) and an answer for "holds nothing", and a query copies that dict and
touches only the workers whose streams matched something; a single-stream worker's answer is
reused per (stream, matched depth) when no pending entry or tier is involved (a shared system
prompt matches the same depth on many queries).

Streams in an UNTRUSTED state (UNVERIFIED: a restart candidate not yet disproven; STALE) add
nothing to their worker's answer, whatever they hold: kvroute cannot know the worker still has
those pages (fail closed).

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

The cached `WorkerMatch` objects (and their `by_medium` dicts) are shared between queries
until the cache is rebuilt: callers read them and must not mutate them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from indexer.health import StreamHealth
from indexer.index.walk import PrefixMatch
from indexer.stats import STATE_RANK, UNTRUSTED, StreamState, WorkerMatch

__all__ = ["REFRESH_S", "WorkerMatches"]

REFRESH_S = 0.1  # the longest a cached per-worker view is used without being rebuilt

_MEMO_LIMIT = 1 << 14  # cached non-zero answers, (stream, held) -> WorkerMatch

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
        # stream -> (worker, block size, state) for workers with exactly one stream (the rule)
        self._solo: dict[str, tuple[str, int | None, StreamState]] = {}
        self._multi: dict[str, str] = {}  # stream -> worker, for workers with several streams
        # per worker, the streams whose entries may be used: not UNVERIFIED or STALE, so a
        # worker whose other rank is fine never scores on a rank that may have restarted
        self._worker_trusted: dict[str, Sequence[StreamHealth]] = {}
        self._worker_first: dict[str, StreamHealth | None] = {}
        self._worker_state: dict[str, StreamState] = {}
        self._memo: dict[tuple[str, int], WorkerMatch] = {}  # (stream, held), none pending

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
        # workers answered by `_best`, which reads block sizes from the subscribers
        several = set(self._unsized_workers)
        if not blocks and not pending:
            for worker in several:
                out[worker] = self._best(worker, found, default_medium)
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
        else:
            tiered = found.by_medium
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
        for worker in several:
            out[worker] = self._best(worker, found, default_medium)
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
        worker, size, state = info
        if size is None:  # not known when cached: `_best` asks the subscriber
            several.add(worker)
            return None
        if by_medium is not None or more:
            return WorkerMatch(
                worker,
                held,
                held * size,
                more * size,
                size,
                by_medium if by_medium is not None else {default_medium: held} if held else {},
                state,
            )
        # answers repeat (a shared system prompt matches the same depth on many queries):
        # reuse them until the cache is rebuilt, like the zero answers
        memo = self._memo
        match = memo.get((sid, held))
        if match is None:
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()  # bounded: a miss only rebuilds one object
            match = memo[(sid, held)] = WorkerMatch(
                worker, held, held * size, 0, size, {default_medium: held} if held else {}, state
            )
        return match

    def _best(self, worker: str, found: PrefixMatch, default_medium: str) -> WorkerMatch:
        """The answer of a worker with several streams (or an unknown block size): its best."""
        blocks = found.blocks
        pending = found.pending_blocks
        best: StreamHealth | None = None
        best_score = (-1, -1)
        for sub in self._worker_trusted[worker]:
            sid = sub.stream_id
            bs = sub.block_size or 0
            held = blocks.get(sid, 0)
            score = (held * bs, (held + pending.get(sid, 0)) * bs)
            if score > best_score:
                best, best_score = sub, score
        state = self._worker_state[worker]
        if best is None:  # no stream, or none trusted: the first stream's size, as cached
            first = self._worker_first[worker]
            size = first.block_size if first is not None else None
            return WorkerMatch(worker, 0, 0, 0, size, {}, state)
        sid = best.stream_id
        size = best.block_size
        held = blocks.get(sid, 0)
        by_medium = found.by_medium.get(sid)
        if by_medium is None:
            by_medium = {default_medium: held} if held else {}
        return WorkerMatch(
            worker,
            held,
            held * (size or 0),
            pending.get(sid, 0) * (size or 0),
            size,
            by_medium,
            state,
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
        self._worker_trusted = {}
        self._worker_first = {}
        self._worker_state = {}
        self._memo = {}
        for worker, subs in workers.items():
            state = StreamState.STALE
            trusted = []
            for sub in subs:
                self._subs.append(sub)
                s_state = sub.current_state(now)
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
            # with nothing matched the first trusted stream is the "best" (the rule of `_best`)
            first = trusted[0] if trusted else subs[0] if subs else None
            size = first.block_size if first is not None else None
            self._zeros[worker] = WorkerMatch(worker, 0, 0, 0, size, {}, state)
            self._worker_trusted[worker] = trusted
            self._worker_first[worker] = first
            self._worker_state[worker] = state
            if len(subs) == 1:
                if trusted:  # an untrusted stream's matches are left out: its zero answer
                    self._solo[subs[0].stream_id] = (worker, size, state)
            else:
                for sub in subs:
                    self._multi[sub.stream_id] = worker
        self._states = list(map(_state_of, self._subs))
        self._expires = expires
        self._valid = True
