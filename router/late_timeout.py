"""A timeout the router's own stall expired, told from one the other side caused.

A wait bounded by `asyncio.timeout` (a health check, a connection to a worker) that was in
flight while the router's event loop stalled (a long GC pass, a synchronous call, a CPU-starved
or paused process) times out as the loop comes back, even when the answer was waiting in the
socket all along: the loop runs the expired timer before the task the answer wakes. Such a
timeout is the router's fault, not the worker's, and the timer says so: it ran well after its
deadline. A running loop runs its timers within about a millisecond.
"""

from __future__ import annotations

import asyncio

__all__ = ["LATE_S", "late_by"]

# how late an expired timer may run and still be the other side's timeout. Far above a running
# loop's timer jitter, below the stalls that fail checks and connections
LATE_S = 0.05


def late_by(scope: asyncio.Timeout) -> float | None:
    """How long after its deadline the expired `scope`'s timer ran, when past `LATE_S` (the
    loop was held up as it expired: no verdict on the other side); None otherwise."""
    expired_at = scope.when()
    if expired_at is None:
        return None
    late = asyncio.get_running_loop().time() - expired_at
    return late if late >= LATE_S else None
