"""Whether the fleet is being changed by a reload, and a wait for the change's end.

A reload changes the pool with awaits in between (`router.http.reload`): a worker renamed (the
same server under a new id) is removed before its new id is added, registered and checked, and
a worker whose settings changed is removed and added again. With `[cluster]` every other
replica makes the same changes as it reads the reload's records
(`router.cluster.fleet_state`). A request planned in between finds its model served by nobody,
or by a worker still `checking`, though the change is about to serve it. The proxy, the pair
dispatcher and `/v1/kv/query` wait for the change's end (`FleetChange.waited`, bounded by the
request's deadline) before refusing such a request: it is served by the new id instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

__all__ = ["FleetChange"]


class FleetChange:
    """A change of the workers under way (`changing`: a reload's, or the fleet records of
    another replica's), and `settled` / `waited` to wait for its end."""

    __slots__ = ("_depth", "_done")

    def __init__(self) -> None:
        self._done = asyncio.Event()
        self._done.set()
        self._depth = 0  # a reload and a peer's record may overlap: counted, not flagged

    @property
    def under_way(self) -> bool:
        """Whether workers are being removed, added or checked by a change now."""
        return self._depth > 0

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """A change of the workers: entered before its first removal or add, left after its
        last (a reload's and a fleet record's may overlap: the count keeps them apart)."""
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

    async def waited(self, deadline: float) -> bool:
        """Whether a change was under way and has ended, so a request that found no worker
        for its model meanwhile is planned again; waits no longer than `deadline` (a
        `time.monotonic()` instant; False then, and at once when no change is under way: the
        request is refused as it was)."""
        if not self.under_way:
            return False
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self.settled()
        except TimeoutError:
            return False
        return True
