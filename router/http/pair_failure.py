"""How a prefill/decode pair's attempt fails, and how its failures are charged.

```
Exception
├── PrefillFailed           the prefill side failed before the client got a byte: retried
│   └── BootstrapUnreachable    its decode could not reach its bootstrap server
│                               (`router.http.bootstrap_unreachable`)
├── HandoffFailed           the prefill gave up handing its KV to a decode that had not
│                           answered: the decode's failure, or either side's
│                           (`router.http.pair_handoff`): retried
└── PrefillRefused          the prefill side refused the request (a 4xx): the client's answer
```
A failure of the decode side is the proxy's `router.http.outcome.AttemptFailed`.

Failures are charged to the workers blamed as a whole request's are
(`router.http.outcome.charge`), side by side, once the request ended (`PairCharges`): a prompt
every prefill fails opens no circuit. A failed attempt takes back what routing marked for each
side (`withdraw_at_least`).
"""

from __future__ import annotations

from router.http.outcome import charge
from router.http.pair_handoff import HandoffFault
from router.routing.load import Ticket, Withdraw
from router.routing.pd import PdPlan
from router.routing.planner import Planner

__all__ = [
    "HandoffFailed",
    "PairCharges",
    "PrefillFailed",
    "PrefillRefused",
    "withdraw_at_least",
]


class PrefillFailed(Exception):
    """The prefill side of a pair failed before the client got a byte (the pair is retried)."""

    def __init__(
        self,
        message: str,
        *,
        hard: bool,
        status: int | None = None,
        sent: bool = True,
        timed_out: bool = False,
        handoff: HandoffFault | None = None,
    ) -> None:
        super().__init__(message)
        self.hard = hard
        self.status = status  # the worker's HTTP status, or 504 for the deadline passing
        self.sent = sent  # whether the worker got the request (`AttemptFailed.sent`)
        # no answer within the request deadline: charged at once, as the proxy charges it
        self.timed_out = timed_out
        # its 5xx says its KV handoff failed, and whose failure that is (`handoff_fault`)
        self.handoff = handoff


class HandoffFailed(Exception):
    """The prefill of a pair gave up handing its KV over while its decode had not answered:
    `fault` DECODE, the decode's failure by the prefill's word; EITHER, a side it does not
    tell. What the two workers did since may tell otherwise (`router.http.pair_faults`).
    `said`: the prefill's failure, worded for it."""

    def __init__(
        self, message: str, *, fault: HandoffFault, status: int | None, said: str = ""
    ) -> None:
        super().__init__(message)
        self.fault = fault
        self.status = status  # the prefill's HTTP status
        self.said = said or message


class PrefillRefused(Exception):
    """The prefill side refused the request (a 4xx): the client's answer, no retry."""

    def __init__(self, status: int, payload: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.payload = payload


class PairCharges:
    """A pair request's failures after their worker got the request, per side, charged once
    the request ended (`charge`, as a whole request's): an engine that fails one prompt fails
    it on every prefill (or decode) the retry carries it to, and charged at once that one
    prompt opened every circuit of the side."""

    def __init__(self, planner: Planner) -> None:
        self._planner = planner
        self.sent: dict[str, list[tuple[str, bool]]] = {"prefill": [], "decode": []}
        self.tried: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        self.plan: PdPlan | None = None  # the request's last plan
        self._settled = False

    def failed(self, side: str, worker: str, hard: bool) -> None:
        self.sent[side].append((worker, hard))

    def retract(self, side: str, worker: str) -> None:
        """A failure charged to `worker` turned out another's: one of its charges goes."""
        sent = self.sent[side]
        for i, (charged, _) in enumerate(sent):
            if charged == worker:
                del sent[i]
                return

    def settle(self, answered: bool, served: tuple[str, str] = ("", "")) -> None:
        """The request ended: `answered` (a worker answered it below 500), by the `served`
        (prefill, decode) pair: a failure charged on the word of another worker to one that
        then answered it was not its own, and is dropped."""
        if self._settled or self.plan is None:
            return
        self._settled = True
        for side, worker in zip(("prefill", "decode"), served, strict=True):
            self.sent[side] = [(w, hard) for w, hard in self.sent[side] if w != worker]
        for side, plan in (("prefill", self.plan.prefill), ("decode", self.plan.decode)):
            tried = self.tried[side]
            untried = any(c.worker not in tried for c in plan.ranked())
            charge(self._planner, self.sent[side], answered, untried)


def withdraw_at_least(ticket: Ticket, least: Withdraw) -> None:
    """A failed attempt takes back at least `least` of what routing marked for `ticket`, at
    its end (`Planner.finish`); a side that already answered is ended and keeps its marks."""
    ticket.withdraw = max(ticket.withdraw, least)
