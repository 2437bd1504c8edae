"""SIGINT and SIGTERM in a verb that starts other processes (`kvroute up`, `serve --processes`),
from the event loop's first instant to its last.

The handlers came once everything was up (`await until()`, after every replica listened): a
SIGTERM in the first second or so of `kvroute up --replicas 2` ended the parent by its default
action (exit -15) while its replica children, still starting, lived on until their own exit
check, each printing a BrokenPipeError traceback as it said where it listened. And `up` removed
them at the first signal, so Ctrl-C again in the shutdown grace aborted it with two tracebacks,
cutting the requests it was letting finish. Now `stoppable(body)` installs them before `body`
starts anything:

- a signal while `body` starts (before it waits on `until()`) cancels it, said in one stderr
  line: it unwinds as on any error, stopping what it started (the children get SIGTERM, the
  in-process workers close), and the verb exits 0;
- the first once it waits makes `until()` return: the verb stops as it always did;
- any later one is said once and ignored (as `kvroute serve` ignores it): the grace goes on.

The handlers stay until the loop closes. Only the instant before the loop runs (the interpreter
starting, the config read) is left: nothing has been started then.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine

__all__ = ["stoppable"]

Until = Callable[[], Awaitable[None]]


class _Stopping:
    """The handlers' state: whether the body waits yet, and what was said."""

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.stop = asyncio.Event()
        self.waiting = False  # the body awaits `until()`: it is up
        self.cancelled = False  # a signal cancelled the body while it started
        self._said_again = False

    async def until(self) -> None:
        """Return at the first SIGINT or SIGTERM."""
        self.waiting = True
        await self.stop.wait()

    def on_signal(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            self.stop.set()
            if not self.waiting:
                self.cancelled = True
                _say(f"{sig.name} while starting: stopping what has started")
                self.task.cancel()
        elif not self._said_again:
            self._said_again = True
            _say(f"{sig.name} again: already stopping (requests in flight are let finish); ignored")


def _say(text: str) -> None:
    print(f"kvroute: {text}", file=sys.stderr, flush=True)


async def stoppable(body: Callable[[Until], Coroutine[object, object, None]]) -> None:
    """Run `body(until)` with SIGINT and SIGTERM handled from now on (module docstring):
    `until()` returns at the first signal once `body` waits on it; one before cancels `body`,
    which then returns here as a stop."""
    task = asyncio.current_task()
    assert task is not None
    state = _Stopping(task)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, state.on_signal, sig)
    try:
        await body(state.until)
    except asyncio.CancelledError:
        # ours (a signal while starting) ends here; another cancellation goes on
        if not state.cancelled or task.uncancel() > 0:
            raise
