"""A `--processes` child never outlives its parent, whatever its own shutdown does.

A child learns its parent died two ways: on Linux it gets SIGTERM at once
(`router.cluster.server.die_with_parent`), and everywhere its parent's pid changes (it was
handed to init or a subreaper), which `watch_parent` polls. Either starts its ordinary stop.
That stop could hang, though (a NATS connect task that lost its cancellation,
`router.cluster.tasks`): a live parent kills a child still running `STOP_TIMEOUT_S` after its
SIGTERM, but an orphan had nobody to, and served on for good. Now the watch, a thread of its
own (the event loop may be what hangs), ends the process if it still runs that long after its
parent died, said in one log line.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["ORPHAN_EXIT_CODE", "watch_parent"]

log = logging.getLogger(__name__)

ORPHAN_EXIT_CODE = 70  # EX_SOFTWARE: its stop did not end by itself
_POLL_S = 0.5  # no event says "your parent died" (but Linux's signal, which stops the child)


def watch_parent(on_gone: Callable[[], None], grace_s: float) -> threading.Thread:
    """Watch this process's parent, in a daemon thread: once it is gone, call `on_gone` (from
    that thread: it must be thread-safe, `loop.call_soon_threadsafe`), and if this process
    still runs `grace_s` later, end it (`os._exit(ORPHAN_EXIT_CODE)`).

    The parent is the one this process has now: a child whose parent died before this call
    was ended by its start already (`router.commands.replicas`)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        on_gone()
        time.sleep(grace_s)
        log.warning(
            "parent process %d gone, and this process still stopping %g s later: exiting now "
            "(what it still did is cut)",
            parent,
            grace_s,
        )
        os._exit(ORPHAN_EXIT_CODE)

    thread = threading.Thread(target=watch, name="kvroute-parent-watch", daemon=True)
    thread.start()
    return thread
