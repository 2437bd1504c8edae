"""Whether the fleet is being changed by a reload, and a wait for the change's end.

A reload changes the pool with awaits in between (`router.http.reload`): a worker renamed (the
same server under a new id) is removed before its new id is added, registered and checked, and
a worker whose settings changed is removed and added again. A request planned in between finds
its model served by nobody, or by a worker still `checking`, though the change is about to
serve it. The proxy waits for the change's end before refusing such a request
(`Proxy._plan_after_change`): it is served by the new id instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

__all__ = ["FleetChange"]


class FleetChange:
    """A reload's fleet step under way (`changing`), and `settled` to wait for its end."""

    __slots__ = ("_depth", "_done")

    def __init__(self) -> None:
        self._done = asyncio.Event()
        self._done.set()
        self._depth = 0  # one reload at a time, but a count cannot be unbalanced by nesting

    @property
    def under_way(self) -> bool:
        """Whether workers are being removed, added or checked by a reload now."""
        return self._depth > 0

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """The fleet step of a reload: entered before its first change, left after its last."""
        self._depth += 1
        self._done.clear()
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self._done.set()

    async def settled(self) -> None:
        """Return once no change is under way (at once when none is)."""
        await self._done.wait()
