"""A worker refusing the dp rank the router told it: what tells it, and how the request goes on.

An engine that restarted with fewer data-parallel ranks refuses a rank the router's stale view
still lists with a 400 (`refuses_rank`). That is the router's fault, not the worker's nor the
client's: the worker is not blamed, its settings are read again (`Proxy.ranks_changed`) and the
request is tried again (`RankMoved`): on its new ranks when it was registered anew, else on the
same worker without a rank (`without_rank`), the engine placing it. A rank the client named keeps
its 400.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import msgspec

from indexer.log_throttle import LogThrottle
from router.routing.planner import Candidate

__all__ = ["RankMoved", "RankRetryNotices", "refuses_rank", "without_rank"]

log = logging.getLogger(__name__)

# how often a worker's rank-less retries are said at WARNING (each one at DEBUG): while its
# `/server_info` stays unreadable every request to its stale rank is retried so
_SAY_RETRY_S = 60.0


# an engine refusing a dp rank it does not have: SGLang 0.5.23's tokenizer manager
# ("routed_dp_rank=2 out of range [0, 1)") and vLLM 0.33's input processor ("data_parallel_rank
# 2 is out of range [0, 1)."). Only that refusal: any 400 saying "out of range" (a sampling
# parameter) would have the worker's settings read again for every such request
_RANK_OUT_OF_RANGE = re.compile(
    rb"(?:routed_dp_rank=|data_parallel_rank )\d+ (?:is )?out of range \[0, "
)


def refuses_rank(status: int, payload: bytes) -> bool:
    """Whether a worker's answer is an engine refusing the dp rank it was told, one it does not
    have (it restarted with fewer ranks; the router's are stale until its settings are read
    again: `Proxy.ranks_changed`)."""
    return status == 400 and _RANK_OUT_OF_RANGE.search(payload) is not None


class RankMoved(Exception):
    """The worker refused the rank the router chose: the request is tried again, the worker not
    blamed; on its new ranks when its settings, read again, registered it anew (`anew`), else
    without a rank."""

    def __init__(self, worker: str, *, anew: bool) -> None:
        super().__init__(f"worker {worker} refused the dp rank the router chose")
        self.anew = anew


def without_rank(candidate: Candidate) -> Candidate:
    """`candidate`'s worker with no rank told (the engine picks one) and no hit predicted:
    which rank the prompt lands on, and what it holds there, is the engine's to know."""
    return msgspec.structs.replace(
        candidate,
        dp_rank=None,
        matched_tokens=0,
        matched_blocks=0,
        pending_tokens=0,
        by_medium={},
        hit_tokens=0.0,
        admission=None,
        eviction=None,
    )


class RankRetryNotices:
    """When each worker's requests retried without a rank were last said, and how many went
    unsaid since."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._throttle = LogThrottle(_SAY_RETRY_S, clock=clock)  # by worker

    def say(self, worker: str, rank: int | None, why: str) -> None:
        """A request `worker` refused `rank` for goes again without one (`why`): a WARNING at
        most every `_SAY_RETRY_S` per worker, counting the ones said at DEBUG meanwhile.
        Before, one WARNING a request for as long as the worker's settings could not be read
        (QA: 11 lines in 11 s)."""
        unsaid = self._throttle.allow(worker)
        if unsaid is None:
            log.debug("worker %s refused dp rank %s, %s: retried without a rank", worker, rank, why)
            return
        log.warning(
            "worker %s refused dp rank %s, %s: retried without a rank (said at most every %g s; "
            "%d more since the last time)",
            worker,
            rank,
            why,
            _SAY_RETRY_S,
            unsaid,
        )
