"""How a forwarded request ended, as the metrics and the circuit breakers take it.

Whose fault a failed attempt was (the worker's, for its circuit breaker, or the request's) is
decided once the request has ended (`charge`): an attempt that failed before any byte reached
the client is an `AttemptFailed`, retried while a retry is legal. A client that disconnects
cancels the handler (aiohttp's handler cancellation), which closes the upstream connection,
which makes the worker abort; the request counts as 499 in the metrics. A stream cut once it
began cannot be retried: its client's connection is closed (a cut body, not a clean end) and
the request counts as a failure (`answer_code`): 502 when its worker broke it off, 504 when the
request deadline cut it. The single-worker proxy (`router.http.proxy`) and the pair dispatcher
(`router.http.pd`) count and charge alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from aiohttp import web

from router.http.metrics import CLIENT_CLOSED, WORKER_BROKE_OFF
from router.routing.planner import Planner

__all__ = [
    "AttemptFailed",
    "BrokenOff",
    "answer_code",
    "broken_off",
    "charge",
    "client_left",
    "mark_broken_off",
]


# set on a request whose client left while its answer was written (`answer_code`)
_CLIENT_LEFT = web.RequestKey("kvroute_client_left", bool)


def client_left(request: web.Request) -> None:
    """`request`'s client left (or was cut) while its answer was written: it counts as 499."""
    request[_CLIENT_LEFT] = True


class BrokenOff(msgspec.Struct, frozen=True):
    """Why a streamed answer was cut after its status line went out to the client."""

    error: str  # the upstream error's class name (the spans' `error.type`)
    code: int  # what the request counts as (`answer_code`): its status line said the worker's


# set on a request whose streamed answer was cut once bytes had reached the client (`broken_off`)
_BROKEN_OFF = web.RequestKey("kvroute_broken_off", BrokenOff)


def mark_broken_off(request: web.Request, error: str, code: int = WORKER_BROKE_OFF) -> None:
    """`request`'s streamed answer was cut with `error` (the upstream error's class name) once
    its status had gone out: it counts as `code` (502: its worker broke it off; 504: the
    request deadline passed)."""
    request[_BROKEN_OFF] = BrokenOff(error, code)


def broken_off(request: web.Request) -> BrokenOff | None:
    """Why `request`'s streamed answer was cut after its status went out to the client, or
    None."""
    return request.get(_BROKEN_OFF)


def answer_code(request: web.Request, status: int) -> int:
    """The code a forwarded answer counts as in the metrics: the worker's `status`, 499
    (CLIENT_CLOSED) when the client left before it had all of it, or the code of a stream
    cut after it began (`broken_off`: 502 by its worker, 504 by the request deadline). A
    client leaving shows as the handler's cancellation or, when the router was writing to it
    then (or cut a client that stopped reading: `ClientStalledError`), as ConnectionResetError;
    both are 499."""
    if request.get(_CLIENT_LEFT, False):
        return CLIENT_CLOSED
    cut = request.get(_BROKEN_OFF)
    return status if cut is None else cut.code


class AttemptFailed(Exception):
    """An attempt that failed before any byte reached the client."""

    def __init__(
        self, message: str, *, hard: bool, status: int | None = None, sent: bool = True
    ) -> None:
        super().__init__(message)
        self.hard = hard
        self.status = status  # the worker's HTTP status, when it answered one
        # whether the worker got the request: a failure after it may be the request's own
        # (`charge`); one before it (no connection) is the worker's
        self.sent = sent


def charge(
    planner: Planner,
    sent_failures: Sequence[tuple[str, bool]],
    answered: bool,
    routable_untried: bool,
) -> None:
    """Charge the circuit breakers with one request's failures after its workers got it
    (`sent_failures`: worker, hard), once the request ended: `answered` (a worker answered
    it below 500); `routable_untried` whether a routable worker it was never sent to remains
    (a pair: of the side the failures are of).

    A 5xx, a dropped connection or an answer that is not HTTP may be the request's fault
    as much as the worker's: an engine that crashes on one prompt crashes on it on every
    worker, and the retry carries it to each. Charged at once, one such request (a dropped
    connection is a hard failure) would open every circuit of the model and the fleet
    would answer 503 for `breaker.cooldown_s`. So:
    - another worker answered it: the failures were the workers', each charged (a dropped
      connection opens the circuit at once, a 5xx counts toward the threshold);
    - it failed on every routable worker it could go to: the request's; nobody is charged
      (one request never takes the last workers out of rotation);
    - else (the retries ran out with routable workers untried, `max_retries = 0`): nobody
      can tell, so its first worker is charged one ordinary failure, never a hard one. A
      worker that fails every request still reaches the threshold over consecutive ones
      (with too few retries to reach a healthy worker, nothing else would take it out); a
      burst of such requests can at worst leave `max_retries + 1` workers in rotation.
    A worker that is really gone refuses the connection: that is charged at once, the
    request never reached it (`AttemptFailed.sent`). So is a worker that did not answer
    within the request deadline (`Proxy.forward`: one ordinary failure, and no retry).
    """
    if not sent_failures:
        return
    if answered:
        for worker, hard in sent_failures:
            planner.record_failure(worker, hard=hard)
    elif routable_untried:
        planner.record_failure(sent_failures[0][0], hard=False)
