"""A replay answer read onto the stream, held to the epoch fence.

Epoch fence (`indexer.fence`): seqs cannot tell a restarted publisher from the old one, so
every replay that continues the stream asks from the last applied seq, not the one after
it, and the batch the publisher returns at that seq must be the one applied. A different
batch is a restart (clear, replay from 0); an answer without it proves nothing and is
treated the same (fail closed). An answer that starts far beyond the live stream's newest seq
(`_MAX_AHEAD`) proves nothing; the batches an answer applies are remembered by digest
(`_REPLAYED_KEPT`), so that a live copy arriving after its replayed one is held to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from typing import NamedTuple

from indexer.errors import ReplayError
from indexer.protocol.decode import batch_dp_rank
from indexer.protocol.frames import ReplayData
from indexer.sequence import SeqVerdict
from indexer.stream.state import SubscriberState, batch_digest

__all__ = ["Continuity", "ReplayAnswers", "ReplayResult"]

# the furthest a replay answer may start beyond the newest seq the live stream has shown: a
# publisher does not publish a million batches between two of our messages (a corrupt seq, or
# a foreign socket, would otherwise carry the stream past every real seq to come)
_MAX_AHEAD = 1 << 20
# replayed batches remembered by seq, to check the live copies that arrive after them
_REPLAYED_KEPT = 4096


class Continuity(enum.Enum):
    """What a continuing replay (asked from the last applied seq) said about the epoch."""

    NONE = "none"  # not a continuing replay, or no batch came back
    PROVEN = "proven"  # the batch at our last seq is the one we applied
    BROKEN = "broken"  # a different batch at that seq: the publisher restarted
    UNPROVEN = "unproven"  # the answer started after our last seq: nothing proves it


class ReplayResult(NamedTuple):
    """What a replay asked of the replay socket came to (`_replay`)."""

    answered: bool  # the publisher answered to the end marker
    newest: int | None  # the newest seq it sent (None: none)
    continuity: Continuity


class ReplayAnswers(SubscriberState):
    """Asks the replay socket for buffered batches and applies the ones the stream lacks."""

    async def _replay(self, start: int) -> ReplayResult:
        """Ask for every buffered batch from `start` and apply the ones we lack, in order.

        Asked from the last applied seq, the publisher's batch at that seq is checked against
        the stream's fence first: a different batch is a restart (the stream is cleared and
        replayed from 0 at once); an answer that starts later proves nothing, so the stream is
        cleared and rebuilt from what it holds (`continuity` says which).
        """
        if not self._has_replay:
            return ReplayResult(False, None, Continuity.NONE)  # found out: not asked again
        newest: int | None = None
        last = self.tracker.last
        owed = self._owed_fence
        continuing = last is not None and (
            start == last or (owed is not None and start == owed.seq)
        )
        continuity = Continuity.NONE
        rebinds = self._rebinds
        live = self.tracker.live
        heard = self._connected  # what is published after its answer reaches the SUB
        if last is None or self._unverified:
            # a rebuild from the buffer (a join, after a clear), or a proof that may bring a
            # snapshot's stream forward by thousands of batches: the past until caught up
            self._catching_up()
        loop = asyncio.get_running_loop()
        timed = False  # the answer's first frame timed (`_first_answer`)
        try:
            replies_from = self._replay_client().replies(start)
            with self._holding_live():
                asked = loop.time()
                async with contextlib.aclosing(replies_from) as replies:
                    async for reply in replies:
                        if not timed:
                            timed = True
                            self._first_answer(loop.time() - asked)
                        # (joining, no live seq is known: any start is believable)
                        far = live is not None and reply.seq > max(start, live) + _MAX_AHEAD
                        if newest is None and far:
                            self._unanswered()  # given up here: the client never learns it
                            raise ReplayError(
                                f"its answer starts at seq {reply.seq}, far beyond the live "
                                f"stream's {live}"
                            )
                        if self._rebinds != rebinds:
                            self._unanswered()
                            raise ReplayError("a snapshot was loaded while it answered")
                        continuity = self._take_reply(reply, start, continuing, continuity)
                        if self._replay_foreign:
                            # found out by this reply: nothing more of it is read or applied
                            return ReplayResult(False, None, Continuity.NONE)
                        newest = reply.seq if newest is None else max(newest, reply.seq)
                if not timed:  # an empty buffer's answer: its end is its first frame
                    self._first_answer(loop.time() - asked)
        except TimeoutError as exc:
            # (the wait, which the client knows: `replay_timeout_s`, longer on a connection
            # made, until its heartbeat can have dropped it)
            self._warn("replay-timeout", f"replay from {start} timed out after {exc}")
            return ReplayResult(False, None, continuity)
        except ReplayError as exc:
            self._warn("replay-unusable", f"replay from {start} proves nothing: {exc}")
            if newest is not None:
                # batches applied from an answer found out to be no buffer of this stream,
                # and the seq they brought it to: nothing of either stands, so the stream is
                # rebuilt from the buffer as at a join (a rebuild's answer: asked again soon).
                # Before, the tracker stayed at the answer's seq, the stream `synced` and
                # empty: the live batch the answer had applied was skipped as its duplicate,
                # and a rebuild's own such answer used up the rebuild owed (QA: missed hits)
                self._clear(f"a replay answer applied in part was not this stream's: {exc}")
                self.tracker.restart_at(0)
                self._catching_up()
            return ReplayResult(False, None, continuity)
        if continuity is Continuity.BROKEN:
            self._restart(
                f"the publisher's batch {start} is not the one applied: {self._another_run()}",
                unproven=self._unproven_against_live(start),
            )
            rebuilt = await self._replay(0)
            return ReplayResult(rebuilt.answered, rebuilt.newest, continuity)
        self._reached_end(heard=heard)  # (a catch-up's: its buffer is read to the end)
        if not self._proof_owed or continuity is Continuity.PROVEN:
            # what the publisher was last proven to hold, unless a proof still owed is
            # unmet: an answer that did not ask from the owed fence proves nothing of it
            self._answered_fence = self.sink.fence()
        return ReplayResult(True, newest, continuity)

    def _take_reply(
        self, reply: ReplayData, start: int, continuing: bool, continuity: Continuity
    ) -> Continuity:
        """Apply one reply of a replay asked from `start` (`_replay`); returns the continuity
        known after it."""
        self._replay_buffers = True  # (an empty answer from it now means it lacks the seq)
        rank = batch_dp_rank(reply.payload)
        if rank is not None and rank != self.config.dp_rank and not self._replay_trusted:
            # a socket not proven this rank's giving another rank's batch: the per-rank
            # `replay` lists are mapped wrong (swapped), and it is found out before its
            # batch is applied. (Taken for a restart, it rebuilt and wiped the stream at
            # every probe.) A socket proven the publisher's is its own: `_apply` clears
            self.rank_mismatches += 1
            self._found_foreign(
                f"it gave batch {reply.seq} of dp rank {rank}, this stream is rank "
                f"{self.config.dp_rank}: check the worker's `replay` endpoints (one per rank, "
                "in rank order)",
                keep=not self._replay_unconfirmed,
            )
            return continuity
        if self._rebuilding:
            self._rebuild_begins(reply.seq)
        fence = self._rebuild_fence
        if (
            fence is not None
            and reply.seq == fence.seq
            and not fence.matches(reply.seq, reply.payload)
        ):
            self._rebuild_broke = True  # (applied all the same: `_rebuild_cleared` restarts)
        if continuing and continuity is Continuity.NONE:
            continuity = self._check_fence(start, reply.seq, reply.payload)
            if continuity is Continuity.PROVEN:
                if self._last_live == start:
                    # it gave back, byte for byte, the batch the live stream delivered there
                    self._trust_replay()
                return continuity  # the fence batch itself is applied already
            if continuity is Continuity.UNPROVEN:
                # the buffer starts after our last batch: whether or not it follows it,
                # nothing proves that it does, so our state is unknown (an answer from
                # before the seq asked is no buffer we know how to hold to the fence either)
                where = "after" if reply.seq > start else "before"
                self._clear(
                    f"replay asked from our last batch {start} starts at {reply.seq}, {where} "
                    "it: nothing proves the publisher unchanged"
                )
                self.tracker.restart_at(reply.seq)
                self._catching_up()  # rebuilt from the rest of this answer: the past
        if continuity is Continuity.BROKEN:
            return continuity  # read to the end marker: the answer belongs to this request
        decision = self.tracker.on_replay(reply.seq)
        if decision.verdict is SeqVerdict.GAP:
            # the buffer no longer holds what we miss: the worker's state is unknown
            # (nothing to clear when we have nothing yet: joining mid-way, restarted)
            if self.tracker.last is not None:
                self._clear(f"replay starts at {reply.seq}, needed {decision.replay_from}")
                self._catching_up()  # rebuilt from the rest of this answer: the past
            self.tracker.restart_at(reply.seq)
            decision = self.tracker.on_replay(reply.seq)
        if decision.verdict is SeqVerdict.APPLY:
            if self._probing:
                # a probe found batches the live stream never delivered (a tail PUB dropped,
                # the connection up): the worker's cache moved on past them, so the stream is
                # the past until the answer ended and the live batches queued meanwhile are
                # applied, as a catch-up (SYNCING). A probe finding nothing missing (its fence
                # batch only) leaves the stream's trust as it was. Before, each was applied
                # while `synced`: a page stored and evicted in the tail was predicted while
                # the probe read it (QA: 304 tokens, 0 cached)
                self._catching_up()
            if self._apply(reply.topic or b"", reply.seq, reply.payload, replayed=True):
                self._remember(reply.seq, reply.payload)
            else:
                self._lose(reply.seq, "its replayed copy does not decode either")
        return continuity

    def _rebuild_begins(self, first: int) -> None:
        """The first batch of a rebuild's answer (`Repair._rebuild_cleared`) is `first`: a buffer
        that holds batches from before the first seq the stream holds since its clear gives
        those pages back, so the stream is cleared and rebuilt from the whole answer; a later
        one has nothing to give, and the answer is read as a probe's."""
        self._rebuilding = False
        held_from, self._rebuild_from = self._rebuild_from, None
        last = self.tracker.last
        if held_from is None or last is None or first >= held_from or first > last:
            return
        self.rebuilds += 1
        self._clear(
            f"rebuilt from the replay buffer (seqs {first}..): the gap before seq {held_from} "
            "cleared it, and the worker may still hold pages stored before it",
            kind="rebuild",  # (said apart from the gap's clear, a second before)
        )
        self.tracker.restart_at(first)
        self._catching_up()  # rebuilt from this answer: the past until caught up

    def _unproven_against_live(self, seq: int) -> bool:
        """Whether a replay socket never proven contradicts batch `seq` that the live stream
        delivered (applied last). A publisher buffers what it sent, so its own socket would
        hold it unless the publisher restarted: a restart of this publisher (its startup
        batches lost while the SUB reconnected) and another worker's socket look alike here.
        Either way the stream's entries are not the worker's (`_restart(unproven=True)`)."""
        return not self._replay_trusted and self._last_live == seq

    def _remember(self, seq: int, payload: bytes) -> None:
        """Keep the digest of a replayed batch, to check its live copy against (`_on_live`)."""
        replayed = self._replayed
        replayed[seq] = batch_digest(payload)
        if len(replayed) > _REPLAYED_KEPT:
            replayed.popitem(last=False)

    def _check_fence(self, start: int, seq: int, payload: bytes) -> Continuity:
        """The verdict on the first batch a continuing replay returned (asked from `start`)."""
        if seq != start:
            return Continuity.UNPROVEN  # the buffer starts after our last batch
        fence = self._owed_fence
        if fence is None or fence.seq != start:
            fence = self.sink.fence()
        if fence is not None and fence.matches(seq, payload):
            return Continuity.PROVEN
        return Continuity.BROKEN

    async def _check_restart(self, last: int) -> bool | None:
        """Clear and rebuild the stream when the publisher's newest buffered seq is below ours;
        whether the rebuild's answer came to its end (None: no restart found).

        Without this, a worker that restarted while our SUB was reconnecting (its startup
        AllBlocksCleared lost like any early message) and then stayed idle would keep its old
        entries in the index until it published again: the first request would be routed on them.
        """
        newest = await self._replay_client().newest()
        if newest is None or newest >= last:
            return None  # the publisher buffers nothing, or a race with new batches: no verdict
        self._restart(
            f"the publisher's newest seq is {newest}, below ours ({last}): {self._another_run()}",
            unproven=self._unproven_against_live(last),
        )
        return (await self._replay(0)).answered

    def _another_run(self) -> str:
        """What a publisher whose seqs or batch disagree with ours is. State taken from
        elsewhere (a snapshot, an earlier recording session) and not proven yet need not have
        come from this very worker: one added under an orphan stream's id never restarted."""
        if self._from_snapshot:
            return (
                "it is not the process this state was taken from (it restarted since, or "
                "another one took its place)"
            )
        return "it restarted"
