"""The soft descriptor limit raised to the hard one when a verb starts.

Each proxied request holds two descriptors, each KV-event stream of a DP rank three or four zmq
sockets, and the router keeps the streams' whole share beside its connections
(`router.http.listener.connection_cap`): under the soft limit of 1,024 that shells and systemd
services start with, the connection cap came to 80. The hard limit is what the operator (or
the service manager) allows; raising the soft one to it is what Go's runtime does for every
program. Capped at 2^20: a hard limit of "unlimited" would size tables to it.

`KVROUTE_RLIMIT_TUNING=off` leaves the limit as it is.
"""

from __future__ import annotations

import logging
import os
import resource

__all__ = ["CEILING", "raise_descriptor_limit"]

CEILING = 1 << 20

log = logging.getLogger(__name__)


def raise_descriptor_limit(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """Raise the soft RLIMIT_NOFILE towards the hard one (at most `CEILING`); the (old, new)
    soft limit when it was raised, else None."""
    env = os.environ if environ is None else environ
    if env.get("KVROUTE_RLIMIT_TUNING", "").lower() == "off":
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return None  # a limit the kernel will not take (nr_open below it): left as it was
    log.debug("descriptor limit raised from %d to %d (the hard limit)", soft, target)
    return soft, target
