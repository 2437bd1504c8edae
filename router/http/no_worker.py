"""Why a request has no worker to go to: the message of the proxy's 503 (`NoWorkerError`), for a
whole request and for a pair's side, as the `/admin/route` dry run says it too.

Each worker out is counted by why (draining, unhealthy, being checked, a duplicate stream, an
open circuit and until when), so an operator tells a forgotten drain from a dead fleet, and the
dry run answers with the same sentence the request would get.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from indexer.engines import PdRole
from router.errors import RequestError
from router.prompt.request import ParsedRequest
from router.routing.pd import PdPlan
from router.routing.planner import Candidate, Plan
from router.routing.pool import WorkerEntry, WorkerPool, WorkerStatus

__all__ = ["no_pair", "no_worker", "none_routable"]

# how each status but an open circuit is counted (that one says until when, last)
_OUT = {
    WorkerStatus.DRAINING: "draining",
    WorkerStatus.UNHEALTHY: "unhealthy (failed its last health check)",
    WorkerStatus.CHECKING: "being checked (added, not registered yet)",
    WorkerStatus.DUPLICATE: "refused as another worker's KV-event stream",
}


def _unpaired(roles: Counter[PdRole]) -> str:
    """Why a model whose workers are all of one side of a pair takes no request: the side it
    lacks, and the workers it has (it said "among 0", as if it had no worker at all)."""
    ((role, count),) = roles.items()
    side = "decode" if role == "prefill" else "prefill"
    return f"no routable {side} worker among 0 (its {count} {role} worker(s) have no pair)"


def _side_checked(entries: Sequence[WorkerEntry]) -> str | None:
    """Why a model of pairs takes no request while a worker whose role is not known yet is
    checked (a pair's side renamed or added, its server slow to answer): the pair waits for
    that side, and the worker is no whole-request worker either. None: no such worker, or no
    pair side for it to complete. (It said "no routable worker among 1", as if a worker were
    missing, not being checked.)"""
    checking = [e.id for e in entries if e.config.role is None and not e.discovered]
    sides = Counter(e.role for e in entries if e.role != "both" and e.id not in checking)
    if not checking or not sides:
        return None
    named = ", ".join(repr(w) for w in checking[:3]) + (" ..." if len(checking) > 3 else "")
    have = ", ".join(f"{n} {role}" for role, n in sorted(sides.items()))
    one = len(checking) == 1
    return (
        f"{'worker' if one else 'workers'} {named} {'is' if one else 'are'} being checked, "
        f"{'its' if one else 'their'} side of a prefill/decode pair not known yet; the "
        f"model's {have} worker(s) have no pair until then"
    )


def none_routable(
    candidates: Sequence[Candidate], pool: WorkerPool, now: float, side: str = ""
) -> str:
    """Why a plan (of a pair's `side`: "prefill", "decode") has no worker to send to,
    counted as an operator counts: workers, and their ranks where they have several (each rank
    is a candidate); then how many are out for each reason: draining, unhealthy, ..., and with
    an open circuit, until when (a client told only "no routable worker" cannot tell a fleet
    that is gone from one that failed and is back in seconds, nor from a forgotten drain).
    Before, only open circuits were counted: a drained or dead fleet read "among 1" alone."""
    status = {c.worker: c.status for c in candidates}  # a worker's ranks share its status
    why = f"no routable {side + ' ' if side else ''}worker among {len(status)}"
    if len(status) != len(candidates):
        why += f" ({len(candidates)} ranks)"
    counts = Counter(status.values())
    out = [f"{counts[s]} {said}" for s, said in _OUT.items() if counts[s]]
    opened = [w for w, s in status.items() if s == WorkerStatus.CIRCUIT_OPEN]
    waits = [e.breaker.admits_in(now) for w in opened if (e := pool.find(w)) is not None]
    if waits:
        out.append(
            f"{len(waits)} with an open circuit after failures (breaker.cooldown_s), the "
            f"first tried again in {min(waits):.1f} s"
        )
    return f"{why}: {', '.join(out)}" if out else why


def no_worker(plan: Plan, parsed: ParsedRequest, model: str, pool: WorkerPool, now: float) -> str:
    """Why a whole request of `model` (its cache model) whose `plan` has no routable worker
    goes nowhere: the proxy's 503 message. RequestError: the client named a dp rank no worker
    has (its own error)."""
    if not plan.candidates and parsed.dp_rank is not None:
        raise RequestError(f"no worker has the dp rank {parsed.dp_rank} asked for")
    serving = pool.serving(model)
    # a worker whose models are not known yet is in no model's pool (`WorkerPool.resolve`),
    # but it may be this model's side of a pair, being checked
    checking = _side_checked([*serving, *(e for e in pool if e.models is None)])
    if not plan.candidates and checking is not None:
        return f"no routable worker: {checking}"
    if not plan.candidates:
        # a model of pairs that lost one side (removed): it takes no whole requests
        roles = Counter(e.role for e in serving)
        if roles and "both" not in roles:
            return _unpaired(roles)
    why = none_routable(plan.candidates, pool, now)
    return why if checking is None else f"{why}; {checking}"


def no_pair(plan: PdPlan, pool: WorkerPool, now: float) -> str | None:
    """Why a pair's request has no pair to go to, as the pair dispatcher's first attempt
    answers it (the prefill side named first); None when both sides have a routable worker."""
    for side, leg in (("prefill", plan.prefill), ("decode", plan.decode)):
        if leg.worker is None:
            return none_routable(leg.candidates, pool, now, side)
    return None
