"""The router's own evidence that it follows the wrong cache: answers that reuse far less than
predicted, again and again, on one worker.

A pod replaced behind a stable URL while the old one still runs (a rolling update's
termination grace period) leaves the router subscribed to the old pod's sockets: they answer
every replay probe, so the stream never goes STALE or UNVERIFIED, and the health check never
fails. Only the answers tell: the worker reports `cached_tokens` far below what the index
predicted for it, request after request. `FalseHitWatch` counts those per worker and, after
`STREAK` in a row, hands the worker to the supervisor (`Supervisor.mispredicted`), which reads
its settings again and, when they are unchanged, puts its streams in doubt.

It runs on every answered request with usage (`Observation.finish`): an answer that is not a
gross over-prediction costs two int compares.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["GROSS_PAGES", "GROSS_RATIO", "STREAK", "FalseHitWatch"]

# What makes one answer a gross over-prediction: it reused less than 1/GROSS_RATIO of the
# predicted tokens and fell short of them by at least GROSS_PAGES pages. KV pressure between
# routing and admission evicts least recently used leaves first: a prefix loses its tail and
# keeps its head, so its answer still reuses a good part of the prediction. A follower of the
# wrong cache reuses nothing of it (or only a common system prompt). The pages keep short
# prompts, where a page or two is the whole prediction, out of it.
GROSS_RATIO = 4
GROSS_PAGES = 4
# Gross answers in a row, with none in between that confirmed a prediction (reused at least a
# quarter of one), before the worker is checked: one eviction storm can wipe a few prefixes
# whole, but it does not spare none of the worker's predictions for this many answers, while a
# replaced pod fails every one (QA: 12 of 12 over 33 s). A check is a `/server_info` read,
# rate-limited per worker by the supervisor, so a rare false alarm costs little.
STREAK = 4


class FalseHitWatch:
    """Per worker, the gross over-predictions in a row (module docstring)."""

    __slots__ = ("_block_size", "_on_streak", "_streaks")

    def __init__(
        self,
        block_size: Callable[[str], int | None],
        on_streak: Callable[[str, int, int], None],
    ) -> None:
        # a worker's page size (the indexer's): how many tokens "a page short" is
        self._block_size = block_size
        # called with (worker, predicted, cached) of the answer that completed a streak
        self._on_streak = on_streak
        self._streaks: dict[str, int] = {}

    def answered(self, worker: str, predicted: int, cached: int) -> None:
        """An answer of `worker` reused `cached` tokens where `predicted` were predicted (as
        x-kvroute-matched-tokens said: `min(matched_tokens, predicted_tokens)`)."""
        if cached * GROSS_RATIO >= predicted:
            # a prediction confirmed (nothing predicted: tells nothing either way)
            if predicted and self._streaks:
                self._streaks.pop(worker, None)
            return
        block = self._block_size(worker) or 1
        if predicted - cached < GROSS_PAGES * block:
            return  # a short prompt: too few pages to tell a wrong cache from an eviction
        streak = self._streaks.get(worker, 0) + 1
        if streak < STREAK:
            if len(self._streaks) >= 4096:
                self._streaks.clear()  # bounded: workers come and go
            self._streaks[worker] = streak
            return
        self._streaks.pop(worker, None)
        self._on_streak(worker, predicted, cached)

    def forget(self, worker: str) -> None:
        """`worker` left the pool (or was registered anew): its streak goes with it."""
        self._streaks.pop(worker, None)
