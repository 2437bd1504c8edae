"""What one stream shadowed within `RESTART_DOUBT_S`: the block keys, and the prompt heads.

A restart of the stream's publisher (`IndexerService._judge_own_shadows`), or the worker
registered again under its id (`IndexerService._carry_recent`), must not judge the shadows of
requests that may have reached the new process before the router knew of it. The keys tell
which shadows those are while the page size stays. A worker restarted with another page size
stores those requests' pages in blocks the old keys never match: the heads (each prompt's first
`head_tokens` tokens, its namespace and `extra_key`) shadow them again in the new size. QA: a
plain request was predicted an `extra_key` request's pages, stored by a worker restarted from
page size 16 to 8, until they were evicted.

Bounded: past `most_keys` keys, `most_heads` heads or `most_namespaces` namespaces, the oldest
go, and the record says when the newest it had to forget was marked. A head forgotten while
doubtful leaves its namespace (its seed shadowed instead hides every plain page of it there:
fail closed); a namespace forgotten too leaves only the time, which blankets the stream.

Pure bookkeeping: the service feeds it and asks it; no I/O.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator, Sequence
from typing import TypeVar, cast

from indexer.namespace import Namespace

__all__ = ["RecentMarks"]

# a head kept: (plain namespace, extra_key, the tokens as packed unsigned 32-bit ids)
_HeadKey = tuple[Namespace, str, bytes]
# when it was last shadowed, and until when its shadow is kept
_When = tuple[float, float]
_K = TypeVar("_K")


class RecentMarks:
    """The keys and prompt heads shadowed on one stream lately, oldest first."""

    __slots__ = (
        "_most_heads",
        "_most_keys",
        "_most_namespaces",
        "forgot_at",
        "forgot_heads_at",
        "head_tokens",
        "heads",
        "keys",
        "marks",
        "namespaces",
        "newest",
    )

    def __init__(
        self, *, most_keys: int, most_heads: int, most_namespaces: int, head_tokens: int
    ) -> None:
        self._most_keys = most_keys
        self._most_heads = most_heads
        self._most_namespaces = most_namespaces
        self.head_tokens = head_tokens
        self.marks: deque[tuple[float, list[int]]] = deque()
        self.keys = 0
        self.forgot_at: float | None = None  # the newest keys forgotten while doubtful
        self.heads: OrderedDict[_HeadKey, _When] = OrderedDict()
        # the namespaces (and extra_key) of heads forgotten, or not token ids
        self.namespaces: OrderedDict[tuple[Namespace, str], _When] = OrderedDict()
        self.forgot_heads_at: float | None = None  # a namespace forgotten while doubtful
        self.newest: float | None = None  # the newest mark ever made here

    def remember_keys(self, now: float, marked: list[int], horizon: float) -> None:
        """`marked` were shadowed at `now`; what was marked before `horizon` goes."""
        self.marks.append((now, marked))
        self.keys += len(marked)
        self.newest = _later(self.newest, now)
        while self.marks and (self.marks[0][0] < horizon or self.keys > self._most_keys):
            at, old = self.marks.popleft()
            self.keys -= len(old)
            if at >= horizon:
                self.forgot_at = at

    def remember_head(
        self,
        now: float,
        plain: Namespace,
        tokens: Sequence[Hashable],
        extra_key: str,
        until: float,
        horizon: float,
    ) -> None:
        """A prompt of `tokens` was shadowed at `now` in `plain` for `extra_key`, kept until
        `until`; heads marked before `horizon` go."""
        self.newest = _later(self.newest, now)
        try:
            packed = array("I", cast("Sequence[int]", tokens[: self.head_tokens])).tobytes()
        except (TypeError, OverflowError):
            # not plain token ids (nothing to key them by): its namespace stands for it
            self._remember_namespace(now, plain, extra_key, until, horizon)
            return
        key = (plain, extra_key, packed)
        was = self.heads.pop(key, None)
        self.heads[key] = (now, until if was is None else max(until, was[1]))
        for (forgot, forgot_key, _), (at, kept) in _trimmed(self.heads, self._most_heads, horizon):
            self._remember_namespace(at, forgot, forgot_key, kept, horizon)

    def _remember_namespace(
        self, at: float, plain: Namespace, extra_key: str, until: float, horizon: float
    ) -> None:
        key = (plain, extra_key)
        was = self.namespaces.pop(key, None)
        self.namespaces[key] = (at, until) if was is None else (max(at, was[0]), max(until, was[1]))
        for _, (when, _) in _trimmed(self.namespaces, self._most_namespaces, horizon):
            self.forgot_heads_at = _later(self.forgot_heads_at, when)

    def absorb(self, other: RecentMarks) -> None:
        """Add `other`'s record to this one (a new stream taking those of several), in time
        order; its bounds apply from the next mark on."""
        self.marks = deque(sorted([*self.marks, *other.marks], key=lambda mark: mark[0]))
        self.keys += other.keys
        self.forgot_at = _later(self.forgot_at, other.forgot_at)
        self.heads = _merged(self.heads, other.heads)
        self.namespaces = _merged(self.namespaces, other.namespaces)
        self.forgot_heads_at = _later(self.forgot_heads_at, other.forgot_heads_at)
        self.newest = _later(self.newest, other.newest)

    def keys_since(self, horizon: float) -> set[int]:
        """The keys marked at `horizon` or after (those it still keeps)."""
        return {key for at, marked in self.marks if at >= horizon for key in marked}

    def forgot_keys_since(self, horizon: float) -> bool:
        """Whether keys marked at `horizon` or after were forgotten: no shadow of the stream
        can be told older than that."""
        return self.forgot_at is not None and self.forgot_at >= horizon

    def heads_since(self, horizon: float) -> Iterator[tuple[Namespace, str, Sequence[int], float]]:
        """(plain namespace, extra_key, head tokens, kept until) of each prompt shadowed at
        `horizon` or after; a namespace whose heads were forgotten has empty tokens."""
        for (plain, extra_key, packed), (at, until) in self.heads.items():
            if at >= horizon:
                tokens = array("I")
                tokens.frombytes(packed)
                yield plain, extra_key, tokens, until
        for (plain, extra_key), (at, until) in self.namespaces.items():
            if at >= horizon:
                yield plain, extra_key, (), until

    def forgot_heads_since(self, horizon: float) -> bool:
        """Whether a namespace shadowed at `horizon` or after was forgotten."""
        return self.forgot_heads_at is not None and self.forgot_heads_at >= horizon

    def since(self, horizon: float) -> bool:
        """Whether a mark was made here at `horizon` or after (kept or forgotten since)."""
        return self.newest is not None and self.newest >= horizon


def _trimmed(entries: OrderedDict[_K, _When], most: int, horizon: float) -> list[tuple[_K, _When]]:
    """Drop the oldest of `entries` (oldest first) marked before `horizon`, and those past
    `most`; returns the ones dropped that were marked at `horizon` or after (forgotten while
    still doubtful)."""
    forgotten = []
    while entries:
        first, when = next(iter(entries.items()))
        if when[0] >= horizon and len(entries) <= most:
            break
        del entries[first]
        if when[0] >= horizon:
            forgotten.append((first, when))
    return forgotten


def _later(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _merged(a: OrderedDict[_K, _When], b: OrderedDict[_K, _When]) -> OrderedDict[_K, _When]:
    """`a` and `b` in one, oldest first: an entry both have, at its latest time and until."""
    joined = dict(a)
    for key, (at, until) in b.items():
        was = joined.get(key)
        joined[key] = (at, until) if was is None else (max(at, was[0]), max(until, was[1]))
    return OrderedDict(sorted(joined.items(), key=lambda item: item[1][0]))
