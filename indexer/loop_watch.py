"""Whether this process's event loop ran lately: what a stall leaves unread is not yet known.

The subscribers learn of a worker's restart from their sockets (a dropped connection on the
SUB's monitor, a live batch, a replay answer), read by tasks on the event loop. When the loop
does not run (the process stopped by SIGSTOP, a paused VM, swapped out; or a long synchronous
call), those sockets keep queueing, and when it runs again the router's request handlers may
run before the subscriber tasks have read what queued: a worker that restarted meanwhile was
routed on its dead process's cache (QA: 288 tokens predicted, 0 cached, on the first requests
after SIGCONT).

`LoopWatch` keeps the time its ticker task last ran (every `TICK_S`); `check`, on the request
path, and the ticker itself tell `on_stall` when more than `STALL_S` passed since: whichever
runs first after a stall. The streams are then proven again through their replay sockets
(`IndexerService._stalled`). The clock is the process's monotonic one (`time.monotonic`, what
asyncio's loop counts in), not an injected one: a stall is real time the loop did not run.

Why the process and not each stream's silence: a stream not heard from for longer than its
probes take (`probe_interval_s` + `replay_timeout_s`) finds only stalls longer than that, and a
worker restarts well within two seconds when its model is small (the QA case: a stall of about
two seconds, its last probe less than two seconds before it). The loop's own ticker sees every
stall past `STALL_S`, whatever the streams were doing, and costs a request one clock read and
one comparison.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["STALL_S", "TICK_S", "LoopWatch"]

# how often the ticker runs: far below STALL_S, so a loop that runs is never taken for stalled
TICK_S = 0.1
# a loop that did not run for this long may have left a worker's restart unread. Above the
# loop's usual hiccups (a GC pass, a namespace eviction: 0.5-0.75 s at 2M entries); a stall
# it misses is shorter than any engine's restart with a model worth routing on
STALL_S = 1.0


class LoopWatch:
    """Tells `on_stall(seconds)` when the event loop did not run for more than `STALL_S`."""

    __slots__ = ("_alive_at", "_on_stall", "_task", "bound_s")

    def __init__(self, on_stall: Callable[[float], None], *, bound_s: float = STALL_S) -> None:
        self._on_stall = on_stall
        self.bound_s = bound_s
        self._alive_at = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def check(self) -> None:
        """On the request path: a stall not told yet is told now, before the request is
        answered (after a stall, handlers may run before the ticker)."""
        now = time.monotonic()
        if now - self._alive_at > self.bound_s and self._task is not None:
            self._stalled(now)

    def start(self) -> None:
        """Run the ticker (on the running loop) until `stop`."""
        if self._task is None:
            self._alive_at = time.monotonic()
            self._task = asyncio.create_task(self._tick(), name="kvroute-loop-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            if now - self._alive_at > self.bound_s:
                self._stalled(now)
            else:
                self._alive_at = now

    def _stalled(self, now: float) -> None:
        gap = now - self._alive_at
        self._alive_at = now  # told once
        self._on_stall(gap)
