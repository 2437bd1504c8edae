"""A per-worker circuit breaker: stop sending to a worker that keeps failing, then probe it.

CLOSED counts consecutive failures; `failure_threshold` of them (or one hard failure, such as a
refused connection, which says the worker process is gone) open the circuit. OPEN admits nothing
until `cooldown_s` has passed; then HALF_OPEN admits traffic again, and the first failed
request reopens it while the first successful one closes it (health checks do not close it: a
worker can answer /health and still fail every request). Time is passed in,
so the breaker is pure and `allows` never changes state (dry runs stay side-effect free).
"""

from __future__ import annotations

import enum

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.StrEnum):
    """Where a breaker stands."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure circuit breaker with a cooldown."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0) -> None:
        self._threshold = failure_threshold
        self._cooldown_s = cooldown_s
        self._failures = 0
        self._opened_at: float | None = None

    def reconfigure(self, failure_threshold: int, cooldown_s: float) -> None:
        """New bounds (a reload); the failures counted so far and an open circuit stay."""
        self._threshold = failure_threshold
        self._cooldown_s = cooldown_s

    def state(self, now: float) -> BreakerState:
        """The state at time `now` (monotonic seconds)."""
        if self._opened_at is None:
            return BreakerState.CLOSED
        if now - self._opened_at >= self._cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self, now: float) -> bool:
        """Whether traffic may go to the worker at `now`."""
        return self.state(now) is not BreakerState.OPEN

    def admits_in(self, now: float) -> float:
        """Seconds from `now` until traffic may go to the worker again (0: it may now)."""
        if self._opened_at is None:
            return 0.0
        return max(0.0, self._opened_at + self._cooldown_s - now)

    @property
    def failures(self) -> int:
        """Consecutive failures since the last success."""
        return self._failures

    def success(self) -> None:
        """A request or health check succeeded: close the circuit."""
        self._failures = 0
        self._opened_at = None

    def failure(self, now: float, *, hard: bool = False) -> None:
        """A request failed at `now`; `hard` failures open the circuit at once."""
        self._failures += 1
        half_open = self.state(now) is BreakerState.HALF_OPEN
        if hard or half_open or self._failures >= self._threshold:
            self._opened_at = now
