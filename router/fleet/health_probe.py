"""One health check of one worker, that the router's own stall does not fail.

A check that times out says the worker did not answer in `health.timeout_s`, as long as the
router's event loop ran meanwhile. When the loop did not run (a long GC pass, a synchronous
call, a CPU-starved or paused process), the worker's answer may have been waiting in the socket
all along: asyncio handles the expired timer before the task the answer wakes, and the check
times out as the loop comes back. Every worker checked across the stall then went unhealthy at
once, and the router answered 503 "no routable worker" for a fault of its own (seen in the test
suite beside other processes: four healthy workers out of rotation together).

A timeout whose timer ran late (`router.late_timeout.LATE_S` past its deadline: the loop was held
up at the moment the check expired) is therefore no verdict: the check is made once more, at once.
The second check's verdict stands whatever its timer did (a loop too busy to tell does not keep a
hung worker in rotation), so a worker that hangs is still found, within about two timeouts; one
that is down refuses the connection, with no timeout to wait for.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.late_timeout import late_by

__all__ = ["probe_health"]

log = logging.getLogger(__name__)

# the deadline is the check's own (asyncio.timeout), not aiohttp's: aiohttp rounds a timeout
# over 5 s up to a whole second, which would read as a late timer
_NO_CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=None)


async def probe_health(
    session: aiohttp.ClientSession, url: str, timeout_s: float, *, worker: str
) -> bool:
    """Whether `url` answers 200 within `timeout_s` (checked again once when the router's loop
    was held up as the first check expired)."""
    for attempt in range(2):
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                async with session.get(url, timeout=_NO_CLIENT_TIMEOUT) as resp:
                    healthy = resp.status == 200
                    await resp.read()
            return healthy
        except aiohttp.ClientError:
            return False
        except TimeoutError:
            late = late_by(deadline)
            if late is None or attempt:
                return False
            # one line a worker: DEBUG (the stall itself is the indexer's WARNING)
            log.debug(
                "health check of %s expired while the router's loop was held up (its timer "
                "ran %.0f ms late): checked again",
                worker,
                late * 1e3,
            )
    return False  # not reached: the second attempt returns
