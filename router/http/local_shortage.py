"""The router's own shortage on a connection to a worker: out of descriptors or socket memory.

A connection to a worker that fails with EMFILE (the process's descriptor limit), ENFILE (the
system's), ENOBUFS or ENOMEM (the kernel's memory for sockets) never reached the worker: the
router could not make a socket. It is the router's failure, not the worker's: a 503
`OutOfResourcesError` naming the limit, no retry (every worker would fail alike), no failure
charged to the worker, and one WARNING line per `limits.refusal_log_interval_s`
(`ShortageLog`), counting the ones it held back. Before, it was a connection the worker
refused: a 502 charged to the healthy worker, whose circuit it opened at once (QA: a router
short of descriptors took its only worker out of rotation for `breaker.cooldown_s`).
"""

from __future__ import annotations

import errno
import logging
import resource

from indexer.log_throttle import LogThrottle
from router.errors import OutOfResourcesError

__all__ = ["SHORTAGE_ERRNOS", "ShortageLog", "local_shortage"]

log = logging.getLogger(__name__)

SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def local_shortage(exc: BaseException) -> OSError | None:
    """The error of the router's own shortage that `exc` is, or was raised from; else None.
    (aiohttp's connection errors are OSErrors with their cause's errno.)"""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in SHORTAGE_ERRNOS:
            return seen
        seen = seen.__cause__
    return None


def _what_ran_out(exc: OSError) -> str:
    """Which limit `exc` says ran out, and what raises it."""
    if exc.errno == errno.EMFILE:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        return (
            f"the router's own file descriptor limit (RLIMIT_NOFILE {limit}; raise it with "
            "`ulimit -n`, or lower limits.max_connections)"
        )
    if exc.errno == errno.ENFILE:
        return "the system's file descriptor table (fs.file-max)"
    return "the kernel's memory for sockets"


class ShortageLog:
    """Turns the router's shortage into its 503, said in one WARNING line per interval."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        # one key: every such failure is the same story, whichever worker it was for
        self._throttle = LogThrottle(interval_s, max_keys=1)

    def refuse(self, worker: str, exc: OSError) -> OutOfResourcesError:
        """The 503 of a request whose connection to `worker` failed with `exc` (a shortage:
        `local_shortage`), logged unless a line went out less than an interval ago."""
        what = _what_ran_out(exc)
        reason = exc.strerror or str(exc)
        held_back = self._throttle.allow("shortage")
        if held_back is not None:
            log.warning(
                "cannot open a connection to worker %s: %s, out of %s: answered 503, the worker "
                "not charged%s",
                worker,
                reason,
                what,
                f" ({held_back} such lines held back)" if held_back else "",
            )
        return OutOfResourcesError(
            f"the router cannot open a connection to worker {worker}: {reason}, out of {what}; "
            "no fault of the worker: retry shortly"
        )
