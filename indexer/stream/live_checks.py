"""Live checks: a live batch asked of the replay socket, though it follows on in seq.

A live batch that follows on is another publisher's all the same when the replay socket
lacks it (a forwarder re-pointed at a worker whose seqs follow on): each is asked for before
it is applied while few were asked lately, else the newest applied about once a second
(`_live_check`, `IndexerConfig.live_check_interval_s`): lacking it while it still holds
the live batch it gave back before (its process never restarted), the sockets disagree
(`indexer.stream.disagreement`); lacking that too, its process may be new (a restart racing
the check): a restart candidate (`indexer.stream.restart_candidates`). A live batch at a seq
the stream applied that is another batch than the one applied there is asked for the same way
(`_checked`, `_live_disagrees`).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

from indexer.errors import ReplayError
from indexer.fence import BatchFence
from indexer.sequence import SeqDecision, SeqVerdict
from indexer.stream.state import (
    LIVE_CHECK_BURST,
    LIVE_CHECK_MAX_S,
    SubscriberState,
    batch_digest,
    undecodable,
)

__all__ = ["Copy", "LiveChecks"]

# digests kept of one replay answer in the window after a restart (`indexer.stream.restarts`;
# a buffer's worth: SGLang keeps 10,000 batches by default)
_WINDOW_COPIES = 16384

# the verdict on a live batch that is not taken: skipped, as a duplicate is
_SKIP = SeqDecision(SeqVerdict.DUPLICATE)


class Copy(NamedTuple):
    """What the replay socket gave when asked from one seq (`_replay_at`)."""

    answered: bool  # it answered to its end marker
    payload: bytes | None  # its batch at the seq asked about (None: none, or no answer)
    first: int | None  # the first seq it gave (None: none)
    newest: int | None  # the newest seq it gave (None: none)
    anchor: bytes | None = None  # its batch at the anchor seq asked about too (None: none)


class LiveChecks(SubscriberState):
    """Asks the replay socket for the live batches it should hold, on a schedule."""

    async def _live_check(self, seq: int, payload: bytes) -> bool:
        """Live batch `seq` is about to be applied (it follows on, or the gap before it was
        repaired): asked of the replay socket now when a check is due (`_live_check_s`,
        `LIVE_CHECK_BURST`), else kept as the newest to ask for once one is
        (`_check_pending`). False: the replay socket shows it is another publisher's
        (`_disagree` was called: it is not taken)."""
        if not self._has_replay:
            return True
        before = self.sink.fence()  # the batch applied before it (a fallback anchor)
        if self._clock() < self._live_check_due or self._replay_away:
            self._live_unchecked = (seq, payload, before)
            return True
        self._live_unchecked = None
        if undecodable(payload):
            return True  # garbage, no publisher's batch: fetched again as it is applied
        return await self._ask_live(seq, payload, before, applied=False)

    def _live_check_left_ms(self) -> int | None:
        """How long until the newest live batch applied is asked for (None: none is to be;
        nor while a proof is pending, which asks first, or the replay connection is away)."""
        if (
            self._live_unchecked is None
            or not self._has_replay
            or self._unverified
            or self._replay_away
            or self._disagreeing is not None
        ):
            return None
        return max(math.ceil((self._live_check_due - self._clock()) * 1000), 0)

    @property
    def _live_check_due(self) -> float:
        """When the next live check may be asked (`_live_check_s`, `LIVE_CHECK_BURST`)."""
        return self._live_check_at - (LIVE_CHECK_BURST - 1) * self._live_check_s

    async def _check_pending(self) -> None:
        """Ask the replay socket for the newest live batch applied since the last check, now
        that one is due: it was applied less than `_live_check_s` ago."""
        pending, self._live_unchecked = self._live_unchecked, None
        if pending is None or undecodable(pending[1]):
            return  # (garbage is no publisher's batch: its copy was fetched again, or lost)
        await self._ask_live(*pending, applied=True)

    def _anchor(self, seq: int, before: BatchFence | None) -> tuple[int, bytes] | None:
        """What the replay socket must still hold if its process is the one the stream
        followed up to live batch `seq`: the newest live batch it gave back, else the batch
        applied right before `seq` (None: neither)."""
        agreed = self._live_agreed
        if agreed is not None and agreed[0] < seq:
            return agreed
        if before is not None and before.seq == seq - 1 and before.payload is not None:
            return before.seq, batch_digest(before.payload)
        return None

    @staticmethod
    def _anchor_held(copy: Copy, anchor: tuple[int, bytes] | None) -> bool | None:
        """Whether the answer `copy` (asked from at or below `anchor`'s seq) still holds the
        anchor batch: True (its process is the one the stream followed: it never restarted
        since), False (another batch there, or none: a new process), None (no anchor, or its
        buffer rolled past it: nothing shown)."""
        if anchor is None or (copy.first is not None and copy.first > anchor[0]):
            return None
        return copy.anchor is not None and batch_digest(copy.anchor) == anchor[1]

    async def _ask_live(
        self, seq: int, payload: bytes, before: BatchFence | None, *, applied: bool
    ) -> bool:
        """Whether the replay socket gives back live batch `seq` (`_live_check`), asked from
        its anchor (`_anchor`) on. A publisher buffers what it sends before it answers, so
        its own socket gives it back. When it does not, its answer says whose it is: still
        holding the anchor, the socket's process is the one the stream followed, and the live
        batch is another publisher's (the two sockets disagree: False); not holding it, its
        process may be a new one (a restart racing the check: the batch applied is the dead
        one's), a restart candidate for the epoch fence to prove (`suspect_restart`). No
        answer, or a buffer that rolled past `seq` (the router lags), shows nothing: asked
        again later."""
        anchor = self._anchor(seq, before)
        start = max(seq - 1, 0) if anchor is None else anchor[0]
        self.live_checks += 1
        copy = await self._replay_at(seq, start, None if anchor is None else anchor[0])
        now = self._clock()
        if not copy.answered:
            # a drop that ended the wait (the heartbeat's, of a process gone behind a hop) is
            # taken now, before the batch is applied: the stream predicts nothing from here
            self._replay_link()
            # each wait stalls the live stream: not asked again at once (an unanswered request
            # is a restart candidate of its own: `_replay_link`)
            self._live_check_wait_s = min(
                self._live_check_wait_s * 2, max(LIVE_CHECK_MAX_S, self._live_check_s)
            )
            # (no burst after it: the first check asked is due after the wait)
            burst_s = (LIVE_CHECK_BURST - 1) * self._live_check_s
            self._live_check_at = now + self._live_check_wait_s + burst_s
            return True
        self._live_check_wait_s = self._live_check_s
        self._live_check_at = max(self._live_check_at, now) + self._live_check_s
        digest = batch_digest(payload)
        if copy.payload is not None and batch_digest(copy.payload) == digest:
            self._trust_replay()
            self._live_agreed = seq, digest
            if self._anchor_held(copy, anchor) and not self._proof_owed:
                # its process holds the anchor too: the one the stream followed, holding
                # its batches up to `seq`, which is what it was last proven to hold. Before,
                # only a whole replay answer said so, and a stream too busy for an idle probe
                # kept its join's: a request left unanswered later (a worker slow a moment)
                # owed a proof from a fence long out of the buffer, and the stream was
                # cleared and rebuilt, forgetting pages stored before the buffer's start
                self._answered_fence = BatchFence.of(seq, payload)
            return True
        if copy.payload is None and copy.first is not None and copy.first > seq:
            return True  # its buffer no longer reaches back to `seq`: nothing shown
        if copy.first is None and not self._replay_buffers:
            return True  # a socket that never gave a batch may buffer none: nothing shown
        held = self._anchor_held(copy, anchor)
        lacks = f"live batch {seq} is not in what the replay socket gives back at that seq"
        if copy.payload is not None:
            why = f"the replay socket gives another batch than live batch {seq} at that seq"
        elif copy.newest is not None:
            why = f"{lacks} (its newest is {copy.newest})"
        else:
            why = f"{lacks} (it holds nothing from seq {start} on)"
        when = "after it was applied" if applied else "before it is applied"
        if held and anchor is not None:
            self._disagree(
                f"{why}, yet it still gives back batch {anchor[0]}, which the stream holds from "
                f"it (asked {when}): its process never restarted, and the live stream's seqs "
                "prove nothing"
            )
            return False
        # (the batch is applied: the proof runs before anything is predicted again)
        if held is None or anchor is None:
            since = "nothing tells whether its process is a new one"
        else:
            since = f"nor does it give back batch {anchor[0]}: its process may be a new one"
        self.suspect_restart(f"{why} (asked {when}), and {since}")
        return True

    async def _checked(self, decision: SeqDecision, seq: int, payload: bytes) -> SeqDecision:
        """`decision` on live batch `seq`, unless it is a duplicate of a replayed batch that
        is not the same batch (`_live_disagrees`)."""
        if decision.verdict is not SeqVerdict.DUPLICATE:
            return decision
        replayed = self._replayed.get(seq) if self._replayed else None
        if replayed is not None:
            if replayed == batch_digest(payload):
                self._trust_replay()  # the live copy of a batch the replay gave: the same
                return decision
        else:
            # the batch applied last, sent again: its fence says whether it is the same
            fence = self.sink.fence() if seq == self.tracker.last else None
            if fence is None or fence.seq != seq or fence.matches(seq, payload):
                return decision
        # another batch at a seq this stream applied
        if self._after_restart:
            # a batch of the process before the restart, still queued on our socket
            self.dead_batches += 1
            self._warn("stale", f"live seq {seq} is the dead process's: skipped")
            return decision
        if undecodable(payload):
            # garbage, not another publisher's batch: skipped and counted, as before the
            # sockets could disagree. Taken for a disagreement, each such frame cost the
            # stream a clear and a rebuild (the fuzz test's garbage)
            self._malformed(f"undecodable payload at live seq {seq}, already applied: skipped")
            return _SKIP
        return await self._live_disagrees(seq, payload)

    async def _live_disagrees(self, seq: int, payload: bytes) -> SeqDecision:
        """The live batch `seq` is not the batch applied at that seq: the replay socket is
        another publisher's (a `replay` pointing at another worker), this publisher restarted
        since, or this live frame is the odd one. Its replay socket is asked for `seq` again:
        the live batch there is a restart (rebuilt from its buffer); the batch applied there
        from the live stream means the socket holds this publisher's batches and the live
        frame is the odd one (skipped, counted); anything else is a foreign socket, whose
        batches are cleared and which is never asked again. (Giving back a batch that it gave
        itself proves nothing: only agreement with what the live stream delivered does.)
        Returns the verdict on the live batch now."""
        _, again = await self._replayed_copy(seq)
        if again is not None and batch_digest(again) == batch_digest(payload):
            self._trust_replay()  # it gives this live batch back: this publisher's
            self._restart(f"live batch {seq} is not the one replayed before: it restarted")
            await self._replay(0)
            self._notify_last()
            return self.tracker.on_live(seq)
        fence = self.sink.fence() if self._last_live == seq else None
        if again is not None and fence is not None and fence.matches(seq, again):
            self._trust_replay()
            # Before, this live frame was skipped as an odd one, and the next live batch,
            # following on, was applied: events re-pointed at another worker's PUB had that
            # worker's cache predicted here (QA)
            self._disagree(
                f"live seq {seq} came again as another batch than the one applied, which the "
                "replay socket gives at that seq"
            )
            return _SKIP
        self._disagree(f"live batch {seq} is not the batch the replay socket gives at that seq")
        return _SKIP

    async def _replayed_copy(self, seq: int) -> tuple[bool, bytes | None]:
        """Whether the replay socket answered to its end, and its batch at `seq` now (None: it
        has none there, or gave no usable answer)."""
        copy = await self._replay_at(seq)
        return copy.answered, copy.payload

    async def _replay_at(
        self, seq: int, start: int | None = None, anchor: int | None = None
    ) -> Copy:
        """What the replay socket gives from `start` (default `seq`): its batch at `seq` (and
        at `anchor`) and the seqs its answer spans (nothing when it gave no usable answer)."""
        found: bytes | None = None
        at_anchor: bytes | None = None
        first: int | None = None
        newest: int | None = None
        seen: dict[int, bytes] = {}
        try:
            asked = seq if start is None else start
            replies_from = self._replay_client().replies(asked)
            with self._holding_live(timed=True):
                async with contextlib.aclosing(replies_from) as replies:
                    async for reply in replies:
                        if reply.seq == seq:
                            found = reply.payload
                        if reply.seq == anchor:
                            at_anchor = reply.payload
                        first = reply.seq if first is None else first
                        newest = reply.seq
                        if self._after_restart and len(seen) < _WINDOW_COPIES:
                            seen[reply.seq] = batch_digest(reply.payload)
        except (TimeoutError, ReplayError):
            return Copy(False, None, None, None)
        if self._after_restart:
            self._window_copies = seen  # the buffer as it stands now (it only grows)
        if first is not None:
            self._replay_buffers = True
        return Copy(True, found, first, newest, at_anchor)
