"""Per-stream sequence tracking: what to do with the message numbered `seq`.

Pure (no I/O), shared by the live subscriber and the offline replayer so both repair streams
the same way. The publisher numbers batches 0, 1, 2, ... from process start; PUB drops messages
for slow subscribers silently, so gaps are normal; a decrease means the engine restarted.

Verdicts for a LIVE message (`on_live`), given the last applied seq `last` and the previous
live seq `live` (live seqs only grow on a healthy PUB; replays may run ahead of them):
- nothing applied yet: seq 0 -> APPLY; seq > 0 -> GAP from 0 (we joined mid-way: replay what
  the worker still buffers, so a late router starts warm);
- seq == last + 1 -> APPLY;
- seq > last + 1  -> GAP from last + 1 (ask the replay socket for the missing range);
- seq <= last and seq >= live -> DUPLICATE (a replay already applied it: live messages queued
  during the replay arrive afterwards);
- seq <= last with no live seq seen yet, but within the run of seqs a replay just applied ->
  DUPLICATE (the catch-up replay at subscription time ran ahead of the first live message);
- seq < live, or seq <= last with no live seq seen yet and not within that run (below it;
  or since a snapshot load, no run at all) -> RESTART: the caller clears the stream; the
  tracker forgets both, so observing the same seq again gives APPLY (seq 0) or GAP from 0.
  A publisher counts from 0 per process, so a first live seq below the replayed run is
  either a new process or a replay answer that was not its buffer (a corrupt seq far ahead
  would otherwise make every later live seq a duplicate, for good): both clear the stream.
  (The subscriber skips, before asking, a late live copy of a batch a replay applied whose
  bytes are the same: it is not a restart; seqs alone cannot tell, so the tracker does not.)

Verdicts for a REPLAYED message (`on_replay`), which fills a gap:
- seq <= last     -> DUPLICATE (already applied: replay overlaps what we have);
- seq == last + 1 -> APPLY;
- seq > last + 1  -> GAP: the buffer no longer holds the missing range (the worker's state is
  unknown): the caller clears the stream and calls `restart_at(seq)` to apply from there.

The tracker advances `last` itself on every APPLY; the caller applies exactly those messages,
in order.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = ["SeqDecision", "SeqVerdict", "SequenceTracker"]


class SeqVerdict(enum.StrEnum):
    """What the caller must do with one message."""

    APPLY = "apply"
    GAP = "gap"
    RESTART = "restart"
    DUPLICATE = "duplicate"


class SeqDecision(msgspec.Struct, frozen=True, gc=False):
    """A verdict, and for GAP the first missing seq to ask the replay socket for."""

    verdict: SeqVerdict
    replay_from: int | None = None


_APPLY = SeqDecision(SeqVerdict.APPLY)
_DUPLICATE = SeqDecision(SeqVerdict.DUPLICATE)
_RESTART = SeqDecision(SeqVerdict.RESTART)


class SequenceTracker:
    """Tracks the last applied seq of one stream and classifies the next message."""

    __slots__ = ("last", "live", "replayed_from", "replayed_to")

    def __init__(self, last: int | None = None) -> None:
        self.last = last
        self.live: int | None = None
        # the run of consecutive seqs replays applied last (None: none since the last restart)
        self.replayed_from: int | None = None
        self.replayed_to: int | None = None

    def on_live(self, seq: int) -> SeqDecision:
        """Classify a live message; advances on APPLY, forgets on RESTART."""
        prev_live, self.live = self.live, seq
        last = self.last
        if last is None:
            if seq == 0:
                self.last = 0
                return _APPLY
            return SeqDecision(SeqVerdict.GAP, 0)
        if seq == last + 1:
            self.last = seq
            return _APPLY
        if seq > last:
            return SeqDecision(SeqVerdict.GAP, last + 1)
        if prev_live is not None and seq >= prev_live:
            return _DUPLICATE
        if (
            prev_live is None
            and self.replayed_from is not None
            and self.replayed_to is not None
            and self.replayed_from <= seq <= self.replayed_to
        ):
            return _DUPLICATE
        self.reset()
        return _RESTART

    def on_replay(self, seq: int) -> SeqDecision:
        """Classify a replayed message; GAP means the replay cannot cover what is missing."""
        expected = 0 if self.last is None else self.last + 1
        if seq < expected:
            return _DUPLICATE
        if seq == expected:
            self.last = seq
            if self.replayed_to is None or seq != self.replayed_to + 1:
                self.replayed_from = seq  # a new run
            self.replayed_to = seq
            return _APPLY
        return SeqDecision(SeqVerdict.GAP, expected)

    def restart_at(self, seq: int) -> None:
        """After a clear: treat `seq` as the next message to apply (live order is kept)."""
        self.last = seq - 1 if seq > 0 else None
        self.replayed_from = self.replayed_to = None  # what was replayed before is gone

    def reset(self) -> None:
        """Forget everything (the stream was cleared and will be rebuilt from seq 0)."""
        self.last = None
        self.live = None
        self.replayed_from = self.replayed_to = None
