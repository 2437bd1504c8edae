"""SIGHUP in a kvroute router process, from its first instant to its last: never the default
action, which ends the process.

SIGHUP killed whatever had no handler yet or any more: a `kvroute serve` still starting (its
handler came once the router was up), a `--processes` child its parent passed a reload to while
it started or restarted (at first start, the whole router exited 2), and every process in its
shutdown grace (the handler went as the grace began: the requests it was letting finish were
cut). Now:

- `hold`, the first thing `kvroute serve`, `indexer`, `relay` and `up` do, catches SIGHUP and
  keeps that one came;
- `install` hands SIGHUP to the verb's handler, which decides in each phase what it does (reload,
  reload once up, or one line saying it is ignored), and calls it once for a SIGHUP held until
  then: a reload asked for during startup is done once the router is up, since the file may
  have changed after it was read;
- `ignore`, once the event loop is closed (closing it restores the default action), until the
  process exits.

Only the instant between exec and `hold` (the interpreter starting) is left, as for any program.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from types import FrameType

__all__ = ["hold", "ignore", "install"]

_held = False  # a SIGHUP came while held, not handed to a handler yet


def _remember(signum: int, frame: FrameType | None) -> None:
    global _held
    _held = True


def hold() -> None:
    """Catch SIGHUP from now on, keeping that one came (for `install`'s handler)."""
    signal.signal(signal.SIGHUP, _remember)


def install(loop: asyncio.AbstractEventLoop, handler: Callable[[], None]) -> None:
    """SIGHUP calls `handler` on `loop` from now on; called once now if one came while held."""
    global _held
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGHUP, handler)
    if _held:
        _held = False
        handler()


def ignore() -> None:
    """Ignore SIGHUP from now on: after the event loop, whose closing restored the default."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
