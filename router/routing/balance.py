"""The hit/load balance of the `kv` score, learned from the time to first token it observes.

The `kv` score counts load in prefill tokens: `queued_prefill_tokens + decode_weight *
running`, where `decode_weight` says how many prefill tokens one running request costs. The
config's value is a guess about the engine's speeds; the router can measure it. Each streamed
answer gives one sample of

    ttft_ms ~ prefill_ms_per_token * tokens + running_ms * running

(`tokens`: the prefill queued on its rank when it was sent, its own uncached part included;
`running`: the requests in flight there), fitted by ridge regression with exponential
forgetting, pulled toward the prior `decode_weight` (`[policy] balance_prior_samples`
samples' worth), so `decode_weight = running_ms / prefill_ms_per_token` follows the fleet,
bounded to [prior / 4, prior * 4]. `[policy] balance_learning` turns it on; `/admin/route`
shows the fit.

Only a streamed answer's first chunk is its first token (`Planner.first_byte`): a whole answer's
first byte comes once it has decoded too, and is no sample (before, it was one, and a fleet of
whole answers fitted its decode as prefill); nor is a request sent behind a full batch, whose
first token waits for the queue to drain (`router.routing.policy`, `queue_wait`).
A streamed answer sent while a whole one counts as queued prefill on its rank is no sample
either: the whole one counts so until its first byte, after its decode, so the queue ahead may
hold prompts prefilled long ago (before, it was a sample: half the answers whole drove
decode_weight to its floor). The estimate counts the answers that were none.

Pure and synchronous: no I/O.
"""

from __future__ import annotations

import msgspec

__all__ = ["BalanceEstimate", "BalanceModel"]

_FORGET = 0.995  # weight of the past per sample: about the last 200 requests count


class BalanceEstimate(msgspec.Struct, frozen=True, gc=False):
    """The fit as the planner uses it (shown by /admin/route)."""

    decode_weight: float  # what the score uses
    prior_decode_weight: float
    prefill_ms_per_token: float | None  # None until a sample arrived
    running_ms: float | None
    samples: float  # the forgetting-weighted number of samples
    # answers that could be no sample since the start: whole ones (their first byte comes
    # after their decode), and streamed ones sent while a whole answer was counted as queued
    # prefill on their rank (it may have been prefilled long ago: `WorkerLoad.blind`)
    whole_answers: int = 0
    behind_whole: int = 0


class BalanceModel:
    """Online ridge fit of TTFT against queued prefill tokens and running requests."""

    __slots__ = ("_n", "_prior", "_prior_n", "_sxx", "_sxy", "behind_whole", "whole_answers")

    def __init__(self, prior_decode_weight: float, prior_samples: float = 20.0) -> None:
        self._prior = prior_decode_weight
        self._prior_n = prior_samples
        self._n = 0.0
        # sums of x x^T and x y for x = (tokens, running), y = ttft_ms
        self._sxx = [0.0, 0.0, 0.0]  # tt, tr, rr
        self._sxy = [0.0, 0.0]
        # answers that were no sample (`BalanceEstimate`), counted by the planner
        self.whole_answers = 0
        self.behind_whole = 0

    def observe(self, ttft_ms: float, tokens: int, running: int) -> None:
        """One answered request: its TTFT and what was ahead of it when it was sent."""
        if ttft_ms < 0 or (tokens <= 0 and running <= 0):
            return
        f = _FORGET
        sxx, sxy = self._sxx, self._sxy
        sxx[0] = sxx[0] * f + tokens * tokens
        sxx[1] = sxx[1] * f + tokens * running
        sxx[2] = sxx[2] * f + running * running
        sxy[0] = sxy[0] * f + tokens * ttft_ms
        sxy[1] = sxy[1] * f + running * ttft_ms
        self._n = self._n * f + 1.0

    @property
    def samples(self) -> float:
        """The forgetting-weighted number of samples so far."""
        return self._n

    def estimate(self) -> BalanceEstimate:
        """The current fit; the prior alone until samples arrive."""
        prior, n = self._prior, self._n
        tt, tr, rr = self._sxx
        unsampled = {"whole_answers": self.whole_answers, "behind_whole": self.behind_whole}
        if n <= 0 or tt <= 0:
            return BalanceEstimate(prior, prior, None, None, n, **unsampled)
        # the prior's prefill cost: the one-parameter fit with the prior decode weight
        p0 = (self._sxy[0] + prior * self._sxy[1]) / (tt + 2 * prior * tr + prior * prior * rr)
        q0 = prior * p0
        # ridge toward (p0, q0), `prior_n` mean samples' worth on each coordinate
        lam_t = self._prior_n * tt / self._n
        lam_r = self._prior_n * max(rr, 1e-9) / self._n
        a, b, d = tt + lam_t, tr, rr + lam_r
        y0 = self._sxy[0] + lam_t * p0
        y1 = self._sxy[1] + lam_r * q0
        det = a * d - b * b
        if det <= 0:
            return BalanceEstimate(prior, prior, p0, q0, n, **unsampled)
        p = (d * y0 - b * y1) / det
        q = (a * y1 - b * y0) / det
        if p <= 0:
            return BalanceEstimate(prior, prior, p, q, n, **unsampled)
        weight = min(max(q / p, prior / 4), prior * 4) if prior > 0 else 0.0
        return BalanceEstimate(weight, prior, p, q, n, **unsampled)
