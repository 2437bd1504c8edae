"""Prefixes an `extra_key` request may have stored where the events cannot show it.

SGLang keys its radix cache by (`extra_key`, `cache_salt`), but its KV events (the default
format) carry only the salt (and a LoRA adapter's name): a page stored for a request with an
`extra_key` reaches the index as a page of the plain namespace (model, lora, salt), with the
hash a plain request's copy of it has. A request without an `extra_key` that matches it there
is predicted a hit the worker will not give: its radix tree keeps the two apart.

No event tells the copies apart, but they can be counted. Each `extra_key` has a subtree of its
own, so a stream holds at most one copy of a page per `extra_key`, plus the plain one; and each
copy is a radix node of its own, stored and removed by events of its own
(`EngineSpec.stored_again_is_copy`: the index keeps a page held until its last copy goes, and
`PrefixIndex.extra_copies` says at least how many more than one it holds). So when a request
with an `extra_key` is sent to a stream, every block key of its prompt (the plain namespace's
keys) is **shadowed** there, naming that `extra_key`; the last one shadowed is its **tail**:
the pages after it (the prompt's last partial page and its output, which the worker stores too,
or the blocks past a cap) are not shadowed, so they may be its copies on any chain through the
tail (the seed, the parent of every first block, is the tail of a prompt with no full block).

A plain query that matched m blocks of a stream trusts the deepest block it can, i:
- nothing may have stored an `extra_key` copy of block i there (no `extra_key` shadows it, and
  no tail lies on the chain before it): every copy is plain; or
- the stream holds more copies of it than the `extra_key`s that may each hold one (those
  shadowing it, and those whose tail lies on the chain before it): one of them is plain.
A plain copy of block i means the plain tree holds blocks 1..i (a radix node's ancestors are
nodes too), so the prediction is i blocks (0: none trusted). Keys are distinct `extra_key`
values, so a tenant's requests under one `extra_key` count once whatever they share. Counting
errs one way only: a removal may have taken the plain copy, so the index's count of copies
drops (the copies stored again count no more once one of them is removed), and shadows are
only ever added until they lapse: fewer copies or more `extra_key`s than there are is a missed
hit, never a false one.

A shadow is kept at least `keep_s` after the last request that made it, long enough for its
pages to have been stored and their events to have arrived, and after that for as long as the
stream still holds the key (its copy may still be there; a tail on the seed: as long as the
stream holds a page of that namespace). Memory: a few dozen bytes a shadowed block (entries are
shared by the blocks one request shadowed), kept in check by sweeps of what lapsed.

A shadow is of the server's cache, not of the worker's id: a worker that leaves (removed,
renamed, its id swapped with another's, registered anew) leaves its streams' shadows **parked**
under what identifies the server's stream (`park`; the service names it by its events endpoint,
topic and dp rank), and a stream added on that server's stream again takes them (`adopt`): its
replay brings back the pages they cover, as plain ones. Parked, a shadow is kept until its time
is past (no stream holds its key), and at least `MOVE_GRACE_S` after it moved, as it is once
taken, so the new stream's replay can bring back the keys that keep it. A move costs O(1):
the stream's table goes whole (keys are joined only where two tables meet). A stream that only
may be the server's gets a copy (`adopt` without `take`). Until its publisher shows whether it
is the process the shadows were made on, the keys marked on a stream that took them are told
apart (`watch`): a new process's stream drops what it took (`disown`), the same one's keeps it
(`settle`).

Pure bookkeeping: the service feeds it and asks it; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

__all__ = ["MOVE_GRACE_S", "Shadow", "ShadowMark", "ShadowedPrefixes", "trusted_blocks"]

_NONE: frozenset[str] = frozenset()

# one key's shadow: (kept until, the extra_keys whose prompt has the key, those whose tail it
# is); one such tuple is shared by the keys one request shadowed alike
Shadow = tuple[float, frozenset[str], frozenset[str]]

# the shadows one request made on one stream (`ShadowedPrefixes.mark`): (stream, keys, each
# key's shadow before, None: not shadowed, and after)
ShadowMark = tuple[str, tuple[int, ...], tuple[Shadow | None, ...], tuple[Shadow, ...]]

# shadows kept before the next sweep for ones no longer needed (doubles with what is kept)
_FIRST_SWEEP = 4096
# the least a shadow is kept after it was parked or adopted (`park`, `adopt`): past its time, a
# shadow is kept by its stream holding its key, which a stream that is gone, or that a worker
# just took and whose replay has not come yet, does not
MOVE_GRACE_S = 300.0


class ShadowedPrefixes:
    """Per stream: block keys (plain namespace) of prompts sent with an `extra_key`."""

    def __init__(self) -> None:
        self._by_stream: dict[str, dict[int, Shadow]] = {}  # stream -> key -> its shadow
        # the shadows of streams whose worker left, by the server's stream they were made on:
        # (when they moved, key -> shadow)
        self._parked: dict[Hashable, tuple[float, dict[int, Shadow]]] = {}
        # streams that took parked shadows, and when (`adopt`)
        self._moved_at: dict[str, float] = {}
        # streams whose adopted shadows may yet turn out another process's (`watch`): the keys
        # marked there since, which `disown` keeps
        self._since: dict[str, set[int]] = {}
        self._count = 0
        self._next_sweep = _FIRST_SWEEP

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def mark(
        self, stream: str, keys: Sequence[int], tail: int, extra_key: str, until: float
    ) -> ShadowMark:
        """A prompt sent with `extra_key` shadows `keys` (its block keys, a chain) on `stream`
        until at least `until`, and `tail` (the last of them, or the seed when there are none)
        is its tail; returns what `withdraw` needs."""
        shadows = self._by_stream.setdefault(stream, {})
        since = self._since.get(stream)
        made: dict[int, Shadow] = {}  # id(before) -> after: one tuple for alike keys
        befores: list[Shadow | None] = []
        afters: list[Shadow] = []
        marked = list(keys)
        if not marked or marked[-1] != tail:
            marked.append(tail)
        last = len(marked) - 1
        for i, key in enumerate(marked):
            before = shadows.get(key)
            is_tail = i == last
            after = None if is_tail else made.get(id(before))
            if after is None:
                after = _merged(before, extra_key, until, has_key=bool(keys), is_tail=is_tail)
                if not is_tail:
                    made[id(before)] = after
            if before is None:
                self._count += 1
            shadows[key] = after
            befores.append(before)
            afters.append(after)
        if since is not None:
            since.update(marked)
        return (stream, tuple(marked), tuple(befores), tuple(afters))

    def withdraw(self, mark: ShadowMark) -> None:
        """The request of `mark` stored nothing: each key goes back to what it was before (not
        shadowed, if it was not), unless a later shadow changed it since."""
        stream, keys, befores, afters = mark
        shadows = self._by_stream.get(stream)
        if shadows is None:
            return
        for key, before, after in zip(keys, befores, afters, strict=True):
            if shadows.get(key) is not after:
                continue
            if before is not None:
                shadows[key] = before
                continue
            del shadows[key]
            self._count -= 1
        if not shadows:
            del self._by_stream[stream]

    def park(self, stream: str, server: Hashable, now: float) -> None:
        """`stream`'s worker left: its shadows are kept for `server` (what identifies the
        server's stream), for a stream added on it again (`adopt`), until they lapse."""
        self._moved_at.pop(stream, None)
        self._since.pop(stream, None)
        shadows = self._by_stream.pop(stream, None)
        if shadows:
            parked = self._parked.get(server)
            self._parked[server] = (now, self._joined(parked[1], shadows) if parked else shadows)

    def parked(self) -> list[Hashable]:
        """The servers' streams shadows are parked for (`park`)."""
        return list(self._parked)

    def adopt(self, server: Hashable, stream: str, now: float, *, take: bool = True) -> int:
        """`stream` follows `server`'s stream: it takes the shadows parked for it (`park`);
        returns how many. Without `take` it gets a copy, and they stay parked (`stream` only
        may be that server's: another stream added later may be it instead)."""
        parked = self._parked.pop(server, None) if take else self._parked.get(server)
        if parked is None:
            return 0
        shadows = parked[1]
        if not take:
            shadows = dict(shadows)
            self._count += len(shadows)  # `_joined` takes back the keys `stream` has
        mine = self._by_stream.get(stream)
        self._by_stream[stream] = self._joined(mine, shadows) if mine else shadows
        self._moved_at[stream] = now
        return len(shadows)

    def watch(self, stream: str, mine: Iterable[int] = ()) -> None:
        """`stream` took parked shadows (`adopt`) that a new process's would not keep: the
        keys marked there from now on, and `mine` (its own from before), are told apart
        (`disown`, `settle`)."""
        self._since[stream] = set(mine)

    def settle(self, stream: str) -> None:
        """`stream`'s publisher is the process its adopted shadows were made on (or may be):
        they stay, and nothing is told apart any longer."""
        self._since.pop(stream, None)

    def disown(self, stream: str) -> int:
        """`stream`'s publisher is a new process (`watch`): the shadows it adopted covered a
        cache that is gone. Only the keys marked there since `watch` stay (shadowed as they
        are now: one an adopted shadow also named keeps its extra_keys, fail closed); returns
        how many went."""
        since = self._since.pop(stream, None)
        shadows = self._by_stream.get(stream)
        if since is None or shadows is None:
            return 0
        kept = {key: shadows[key] for key in since if key in shadows}
        dropped = len(shadows) - len(kept)
        self._count -= dropped
        self._moved_at.pop(stream, None)
        if kept:
            self._by_stream[stream] = kept
        else:
            del self._by_stream[stream]
        return dropped

    def _joined(self, into: dict[int, Shadow], shadows: dict[int, Shadow]) -> dict[int, Shadow]:
        """`shadows` added to `into` (a key both have: shadowed by the extra_keys of either);
        keys alike share their tuple still."""
        # (id(mine), id(theirs)) -> (joined, mine, theirs): the two kept, so no id is reused
        made: dict[tuple[int, int], tuple[Shadow, Shadow | None, Shadow]] = {}
        for key, shadow in shadows.items():
            mine = into.get(key)
            if mine is None:
                into[key] = shadow
                continue
            found = made.get((id(mine), id(shadow)))
            if found is None:
                joined = (max(shadow[0], mine[0]), shadow[1] | mine[1], shadow[2] | mine[2])
                found = made[(id(mine), id(shadow))] = (joined, mine, shadow)
            into[key] = found[0]
            self._count -= 1  # one key, counted twice until now
        return into

    def by_stream(self) -> dict[str, dict[int, Shadow]]:
        """Every stream's shadowed keys (a copy of the mapping; the tuples are shared: read,
        never change): what a snapshot keeps (`indexer.snapshot`)."""
        return {stream: dict(shadows) for stream, shadows in self._by_stream.items()}

    def by_server(self) -> dict[Hashable, dict[int, Shadow]]:
        """The shadows parked for each server's stream (`park`; copies of the mappings, the
        tuples shared): what a snapshot keeps of them."""
        return {server: dict(shadows) for server, (_, shadows) in self._parked.items()}

    def include(self, stream: str, shadows: Mapping[int, Shadow]) -> None:
        """Add `shadows` (a loaded snapshot's, `by_stream`) to `stream`'s: a key both have is
        shadowed by the extra_keys of either, until the later time. Only ever hides more."""
        if shadows:
            self._by_stream[stream] = self._added(self._by_stream.get(stream), shadows)

    def park_loaded(self, server: Hashable, shadows: Mapping[int, Shadow], now: float) -> None:
        """Park `shadows` (a loaded snapshot's) for `server`, beside any parked there, as if
        its stream had just left (`park`): a stream that follows it takes them (`adopt`)."""
        if shadows:
            parked = self._parked.get(server)
            self._parked[server] = (now, self._added(parked[1] if parked else None, shadows))

    def _added(
        self, into: dict[int, Shadow] | None, shadows: Mapping[int, Shadow]
    ) -> dict[int, Shadow]:
        """A copy of `shadows`, counted, joined into `into` (`_joined` takes back the keys
        `into` has)."""
        taken = dict(shadows)
        self._count += len(taken)
        return self._joined(into, taken) if into else taken

    def has_key(self, key: int) -> bool:
        """Whether any stream, or any parked server's stream, shadows `key` (a seed's tail)."""
        return any(key in shadows for shadows in self._by_stream.values()) or any(
            key in shadows for _, shadows in self._parked.values()
        )

    def shadows(self, stream: str) -> dict[int, Shadow] | None:
        """The shadowed keys of `stream` (None: none); read, never change."""
        return self._by_stream.get(stream)

    def due(self) -> bool:
        """Whether enough shadows have been made since the last sweep to sweep again."""
        return self._count >= self._next_sweep

    def sweep(self, now: float, holds: Callable[[str, Sequence[int]], list[bool]]) -> int:
        """Drop the shadows past their time whose key their stream no longer holds
        (`holds(stream, keys)`, per key); returns how many were dropped."""
        dropped = 0
        moved = now - MOVE_GRACE_S
        self._moved_at = {s: at for s, at in self._moved_at.items() if at >= moved}
        for stream in list(self._by_stream):
            if stream in self._moved_at:
                continue  # its replay may not have brought back the keys that keep them yet
            shadows = self._by_stream[stream]
            old = [key for key, shadow in shadows.items() if shadow[0] < now]
            for key, held in zip(old, holds(stream, old), strict=True):
                if not held:
                    del shadows[key]
                    dropped += 1
            if not shadows:
                del self._by_stream[stream]
        for server in list(self._parked):
            # no stream holds a parked key: past its time, it goes
            at, shadows = self._parked[server]
            if at >= moved:
                continue
            old = [key for key, shadow in shadows.items() if shadow[0] < now]
            for key in old:
                del shadows[key]
            dropped += len(old)
            if not shadows:
                del self._parked[server]
        self._count -= dropped
        self._next_sweep = max(_FIRST_SWEEP, 2 * self._count)
        return dropped


def _merged(
    before: Shadow | None, extra_key: str, until: float, *, has_key: bool, is_tail: bool
) -> Shadow:
    """`before` with `extra_key` shadowing the key (`has_key`; a seed holds tails only) and,
    with `is_tail`, its tail there. Always a tuple of its own, even when that changes nothing:
    `withdraw` takes a key back only while it still holds the mark's own tuple, so a later
    request's mark, however alike, keeps its shadow when an earlier one is withdrawn."""
    if before is None:
        one = frozenset((extra_key,))
        return (until, one if has_key else _NONE, one if is_tail else _NONE)
    kept, named, tails = before
    if has_key and extra_key not in named:
        named = named | {extra_key}
    if is_tail and extra_key not in tails:
        tails = tails | {extra_key}
    return (max(kept, until), named, tails)


def trusted_blocks(
    shadows: dict[int, Shadow], seed: int, keys: Sequence[int], again: Mapping[int, int]
) -> int:
    """How many of the leading blocks `keys` (a plain query's match on a stream, its chain from
    `seed`) the plain tree surely holds there (see the module docstring). The stream holds
    every one of them, at least 1 + `again[key]` copies (`PrefixIndex.extra_copies`).

    Between two shadowed blocks the bound is the tails before them, so the chain is walked as
    runs: one pass to find its shadowed blocks, then back from the deepest run."""
    root = shadows.get(seed)
    tails = root[2] if root is not None else _NONE
    n = len(keys)
    # (start, end, bound): blocks start..end-1 may each be held by `bound` extra_keys
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in [i for i, key in enumerate(keys) if key in shadows]:
        if i > start:
            runs.append((start, i, len(tails)))
        _, named, ends = shadows[keys[i]]
        runs.append((i, i + 1, len(named | tails) if tails else len(named)))
        if ends:
            tails = tails | ends
        start = i + 1
    if start < n:
        runs.append((start, n, len(tails)))
    for start, end, bound in reversed(runs):
        if not bound:
            return end
        if not again:
            continue  # one copy of each: none surely plain
        for i in range(end - 1, start - 1, -1):
            if again.get(keys[i], 0) >= bound:
                return i + 1
    return 0
