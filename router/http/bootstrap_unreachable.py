"""A decode that cannot reach its prefill's bootstrap server (SGLang pairs): what tells it, and
how the pair goes on.

The decode says so in its error (`says_unreachable`): the prefill's side of the pair failed
(gone, or the router names a stale bootstrap port), not the decode's. Such a 5xx is never passed
through (`router.http.pair_hooks.PairHooks.passes_through`): the attempt fails with
`BootstrapUnreachable`, the prefill's settings are read again (`bootstrap_moved`, through
`Proxy.ranks_changed`) and the pair retried where its port or role changed (a restart the
router missed), else it is charged at once. Every pair through such a prefill fails until it is
back or its circuit opens: it is said at most once a minute per prefill, with how many failed
pairs went unsaid since (`UnreachableNotices`). A prefill whose config's `bootstrap_port` is not
the one it advertises is said so (`advertised_otherwise`): the config's port is what its decodes
are told, so reading its settings again moves nothing (before, the line said its settings "give
no other bootstrap port", which sent the operator to the worker, not to the config).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from indexer.log_throttle import LogThrottle
from router.http.pair_failure import PrefillFailed
from router.http.proxy import Proxy
from router.routing.planner import Planner

__all__ = [
    "BootstrapUnreachable",
    "UnreachableNotices",
    "advertised_otherwise",
    "bootstrap_moved",
    "says_unreachable",
]

log = logging.getLogger(__name__)

# a decode that could not reach its prefill's bootstrap server, as SGLang's decode says it
# ("Could not fetch prefill parallel info from bootstrap_addr: host:port") and the reference
# worker's (502 `kv_transfer_failed`, "cannot reach the prefill's bootstrap server host:port"):
# the prefill's side of the pair failed (gone, or the router names a stale bootstrap port), not
# the decode, which would else be blamed and the 5xx passed through for good, logged nowhere
_BOOTSTRAP_UNREACHABLE = re.compile(
    rb"Could not fetch prefill parallel info|cannot reach the prefill's bootstrap server"
)
# a prefill whose bootstrap server its decodes cannot reach is said at most this often
_SAY_UNREACHABLE_S = 60.0


def says_unreachable(payload: bytes) -> bool:
    """Whether a decode's error answer says it could not reach its prefill's bootstrap server
    (looked for in its first 4 KiB)."""
    return _BOOTSTRAP_UNREACHABLE.search(payload[:4096]) is not None


class BootstrapUnreachable(PrefillFailed):
    """The decode could not reach the prefill's bootstrap server at `port` (the one the pair
    was told): the prefill's failure, charged at once unless its settings, read again, give
    another port or role (then retried there, not blamed)."""

    def __init__(self, message: str, *, port: int | None, status: int | None) -> None:
        super().__init__(message, hard=False, status=status)
        self.port = port


async def bootstrap_moved(
    proxy: Proxy, planner: Planner, worker: str, told: int | None, deadline: float
) -> str | None:
    """What changed of prefill `worker`'s side of the pairs since it was told to a pair as
    bootstrap port `told`, its settings read again now (`Proxy.ranks_changed`, bounded by
    the request `deadline`); None: nothing."""
    await proxy.ranks_changed(worker, deadline)
    entry = planner.pool.find(worker)
    if entry is None:
        return "left the pool"
    if entry.role != "prefill":
        return f"is a {entry.role} worker now"
    if entry.bootstrap_port != told:
        return f"has bootstrap port {entry.bootstrap_port} now, not {told}"
    return None


def advertised_otherwise(planner: Planner, worker: str) -> int | None:
    """The bootstrap port prefill `worker` advertises when its config's `bootstrap_port`,
    the one its decodes are told, is another (None: the same, none advertised, or gone)."""
    entry = planner.pool.find(worker)
    if entry is None or entry.advertised_bootstrap_port in (None, entry.bootstrap_port):
        return None
    return entry.advertised_bootstrap_port


class UnreachableNotices:
    """When each prefill whose bootstrap server its decodes could not reach was last said, and
    how many of its failed pairs went unsaid since."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._throttle = LogThrottle(_SAY_UNREACHABLE_S, clock=clock)  # by prefill worker

    def say(self, worker: str, reason: str, *, advertised: int | None = None) -> None:
        """Say that decodes cannot reach prefill `worker`'s bootstrap server: at most once per
        `_SAY_UNREACHABLE_S` (each failed pair says it at DEBUG), with how many were said at
        DEBUG since: every pair through it fails until it is back or its circuit opens.
        `advertised`: the bootstrap port it advertises, which its config's overrides
        (`advertised_otherwise`)."""
        unsaid = self._throttle.allow(worker)
        if unsaid is None:
            log.debug("prefill worker %s failed before answering: %s", worker, reason)
            return
        why = (
            "its settings read again give no other bootstrap port"
            if advertised is None
            else f"it advertises bootstrap port {advertised}, but its config's bootstrap_port "
            "overrides it (fix `bootstrap_port` in its config, or leave it out to take the "
            "worker's)"
        )
        log.warning(
            "prefill worker %s failed before answering: %s; %s: charged to it (said at most "
            "every %g s; %d more since the last time)",
            worker,
            reason,
            why,
            _SAY_UNREACHABLE_S,
            unsaid,
        )
