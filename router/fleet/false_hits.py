"""The router's own evidence that it follows the wrong cache: answers that reuse far less than
predicted, again and again, on one worker.

A pod replaced behind a stable URL while the old one still runs (a rolling update's
termination grace period) leaves the router subscribed to the old pod's sockets: they answer
every replay probe, so the stream never goes STALE or UNVERIFIED, and the health check never
fails. Only the answers tell: the worker reports `cached_tokens` far below what the index
predicted for it, request after request. `FalseHitWatch` counts those per worker and, at
`STREAK` of its last `WINDOW` answers that predicted enough, hands the worker to the supervisor
(`Supervisor.mispredicted`), which has `router.fleet.false_hit_response` subscribe its
streams anew and read its settings again.

It runs on every answered request with usage (`Observation.finish`): an answer that is not a
gross over-prediction, on a worker with none lately, costs a compare and a dict lookup.

What the false-hit response says it does about a streak is worded here (`resubscribed_why`,
`unfollowed_why`): a replica fed by `kvroute relay` has no sockets of its own, and what it
follows, and whose fault a streak may be, is the relay's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

__all__ = [
    "GROSS_PAGES",
    "GROSS_RATIO",
    "STREAK",
    "WATCH_ACTIONS",
    "WINDOW",
    "FalseHitWatch",
    "WatchAction",
    "resubscribed_why",
    "unfollowed_why",
]

# What makes one answer a gross over-prediction: it reused less than 1/GROSS_RATIO of the
# predicted tokens and fell short of them by at least GROSS_PAGES pages. KV pressure between
# routing and admission evicts least recently used leaves first: a prefix loses its tail and
# keeps its head, so its answer still reuses a good part of the prediction. A follower of the
# wrong cache reuses nothing of it (or only a common system prompt). The pages keep short
# prompts, where a page or two is the whole prediction, out of it.
GROSS_RATIO = 4
GROSS_PAGES = 4
# Of the last WINDOW answers of a worker that predicted GROSS_PAGES pages or more, STREAK gross
# ones have it checked. Not "in a row": a fleet's shared system prompt is a true hit on the old
# pod and the new one alike, and its answers, between the false ones, kept a streak from ever
# forming (QA: 20 of 20 false hits on the unique prefixes, no WARNING). KV pressure does not
# get there: a QA run of about 1,600 answers under pressure had 13 gross ones, never 4 close
# together, while a replaced pod fails every prediction but the shared ones (QA: 12 of 12).
# A check subscribes the worker anew (its entries dropped): a false alarm costs hits, never
# makes a false one.
STREAK = 4
WINDOW = 8

# What the false-hit response did about a streak (`kvroute_false_hit_actions`): subscribed the
# worker's streams anew, or, a second streak soon after, left it unfollowed a while
WatchAction = Literal["resubscribed", "unfollowed"]
WATCH_ACTIONS: tuple[WatchAction, ...] = ("resubscribed", "unfollowed")


class FalseHitWatch:
    """Per worker, whether its last answers that predicted enough were gross over-predictions
    (module docstring)."""

    __slots__ = ("_block_size", "_on_streak", "_recent")

    def __init__(
        self,
        block_size: Callable[[str], int | None],
        on_streak: Callable[[str, int, int], None],
    ) -> None:
        # a worker's page size (the indexer's): how many tokens "a page short" is
        self._block_size = block_size
        # called with (worker, predicted, cached) of the answer that made STREAK of WINDOW
        self._on_streak = on_streak
        # per worker with a gross answer among its last WINDOW: each one's, oldest first
        self._recent: dict[str, list[bool]] = {}

    def answered(self, worker: str, predicted: int, cached: int) -> None:
        """An answer of `worker` reused `cached` tokens where `predicted` were predicted (as
        x-kvroute-matched-tokens said: `min(matched_tokens, predicted_tokens)`)."""
        confirmed = cached * GROSS_RATIO >= predicted
        recent = self._recent.get(worker)
        if confirmed and recent is None:
            return  # the usual answer: nothing gross lately
        block = self._block_size(worker) or 1
        if predicted < GROSS_PAGES * block or (
            not confirmed and predicted - cached < GROSS_PAGES * block
        ):
            return  # a short prompt: too few pages to tell a wrong cache from an eviction
        if recent is None:
            if len(self._recent) >= 4096:
                self._recent.clear()  # bounded: workers come and go
            recent = self._recent[worker] = []
        recent.append(not confirmed)
        if len(recent) > WINDOW:
            del recent[0]
        if sum(recent) < STREAK:
            if not any(recent):
                del self._recent[worker]
            return
        del self._recent[worker]
        self._on_streak(worker, predicted, cached)

    def forget(self, worker: str) -> None:
        """`worker` left the pool (or was registered anew): its answers go with it."""
        self._recent.pop(worker, None)


# a fed worker's relay, as `indexer.fed_stream.FedStreams.relay_of` tells it: the relay process
# (epoch; None: no record of it taken as written now) whose records its streams follow, and
# whether that relay is heard alive now; None: a worker followed through its own sockets
RelaySource = tuple[int | None, bool] | None


def _relay_named(epoch: int | None) -> str:
    return "the relay" if epoch is None else f"the relay (epoch {epoch:x})"


def resubscribed_why(relay: RelaySource) -> str:
    """What a first streak does, and why it may have come (`FalseHitResponse.respond`)."""
    if relay is None:
        return (
            "its KV-event streams are subscribed anew, their entries dropped, and its settings "
            "read again (another process may be serving its URL)"
        )
    epoch, heard = relay
    if not heard:
        return (
            f"{_relay_named(epoch)} whose records it follows is not heard alive (it stopped, or "
            "it or this replica lost NATS): its streams predict nothing until the relay's "
            "records come again, and are read anew from the relay's stream, their entries "
            "dropped; its settings read again"
        )
    return (
        f"its streams are read anew from {_relay_named(epoch)}'s stream, their entries "
        "dropped, and its settings read again (the relay may follow another process than the "
        "one serving its URL)"
    )


def unfollowed_why(relay: RelaySource, quarantine_s: float) -> str:
    """What a streak soon after the first does (`FalseHitResponse.respond`)."""
    if relay is None:
        return (
            "again since it was subscribed anew: its KV-event sockets reach a process that does "
            f"not serve its URL; not followed for {quarantine_s:g} s (routed by load, no hit "
            "predicted), its settings read again"
        )
    return (
        f"again since its streams were read anew from {_relay_named(relay[0])}'s stream: the "
        "relay's records of it keep disagreeing with its answers (the relay may follow a "
        f"process that does not serve its URL); not followed for {quarantine_s:g} s, or until "
        "another relay process writes it (routed by load, no hit predicted), its settings "
        "read again"
    )
