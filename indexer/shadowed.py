"""Prefixes an `extra_key` request may have stored where the events cannot show it.

SGLang keys its radix cache by (`extra_key`, `cache_salt`), but its KV events (the default
format) carry only the salt (and a LoRA adapter's name): a page stored for a request with an
`extra_key` reaches the index as a page of the plain namespace (model, lora, salt), the same
event a request without one would give. A request without an `extra_key` that matches it there
is predicted a hit the worker will not give: its radix tree keeps the two apart.

No event tells the two copies apart, so the index fails closed where they can meet: when a
request with an `extra_key` is sent to a stream, the key of its prompt's first block in the
plain namespace is "shadowed" there, and a plain query that matches that block on that stream
is answered as holding nothing there. One key is enough: block keys chain, so a plain prompt
that shares any block with that prompt shares its first one. A plain prefix that both kinds of
request use (a tenant's system prompt) then predicts no hit on the streams that were sent
`extra_key` requests with it: missed hits, never false ones.

A shadow is kept at least `keep_s` after the last such request, long enough for its pages to
have been stored and their events to have arrived, and after that for as long as the stream's
entries still hold the key (a copy stored for the `extra_key` may still be there).

Pure bookkeeping: the service feeds it and asks it; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["ShadowMark", "ShadowedPrefixes"]

# one shadow made (`ShadowedPrefixes.mark`): (stream, key, the time it was kept until before,
# None: not shadowed, and the time it is kept until now)
ShadowMark = tuple[str, int, float | None, float]

# shadows kept before the next sweep for ones no longer needed (doubles with what is kept)
_FIRST_SWEEP = 4096


class ShadowedPrefixes:
    """Per stream: first-block keys (plain namespace) of prompts sent with an `extra_key`."""

    def __init__(self) -> None:
        self._by_stream: dict[str, dict[int, float]] = {}  # stream -> key -> kept until
        self._count = 0
        self._next_sweep = _FIRST_SWEEP

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def mark(self, stream: str, key: int, until: float) -> ShadowMark:
        """Shadow `key` on `stream` until at least `until`; returns what `withdraw` needs."""
        keys = self._by_stream.setdefault(stream, {})
        before = keys.get(key)
        if before is None:
            self._count += 1
        if before is None or before <= until:
            keys[key] = until
        return (stream, key, before, keys[key])

    def withdraw(self, mark: ShadowMark) -> None:
        """The request of `mark` stored nothing: the key is kept until what it was before
        (not shadowed, if it was not), unless a later shadow changed it since."""
        stream, key, before, until = mark
        keys = self._by_stream.get(stream)
        if keys is None or keys.get(key) != until or before == until:
            return
        if before is not None:
            keys[key] = before
            return
        del keys[key]
        self._count -= 1
        if not keys:
            del self._by_stream[stream]

    def shadows(self, stream: str) -> dict[int, float] | None:
        """The shadowed keys of `stream` (None: none); read, never change."""
        return self._by_stream.get(stream)

    def due(self) -> bool:
        """Whether enough shadows have been made since the last sweep to sweep again."""
        return self._count >= self._next_sweep

    def sweep(self, now: float, holds: Callable[[str, Sequence[int]], list[bool]]) -> int:
        """Drop the shadows past their time whose key their stream no longer holds
        (`holds(stream, keys)`, per key); returns how many were dropped."""
        dropped = 0
        for stream in list(self._by_stream):
            keys = self._by_stream[stream]
            old = [key for key, until in keys.items() if until < now]
            for key, held in zip(old, holds(stream, old), strict=True):
                if not held:
                    del keys[key]
                    dropped += 1
            if not keys:
                del self._by_stream[stream]
        self._count -= dropped
        self._next_sweep = max(_FIRST_SWEEP, 2 * self._count)
        return dropped
