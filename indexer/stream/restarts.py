"""Restarts found, and the window after one, when the dead process's batches may still arrive.

- RESTART (seq went backwards): asked of the replay socket first (`_went_back`): a new
  process's socket gives the batch back: clear the stream and start over from the new seq;
  one whose process still holds what it gave back before never went back: the live stream
  is another publisher's (the sockets disagree, `indexer.stream.disagreement`); no answer: a
  restart that predicts nothing until its window ends;
- after any restart, live batches that continue the run before it are the dead process's, still
  queued on our socket: skipped, unless the new process's replay socket gives them back, for
  `DEAD_RUN_S`; one nothing proves (no socket, no answer) taints the stream (it predicts
  nothing, and is cleared when that window ends). Past it such a batch is asked for too: an
  unproven socket that showed the restart, was never confirmed by a live batch and does not
  give it back disagrees with the live stream (`indexer.stream.disagreement`); otherwise it is
  a late queued one (`_dead_batch`), the stream UNVERIFIED until a live batch follows on, and
  one still coming past a second window disagrees too; a restart found inside that window
  taints the stream the same way unless the replay socket gives back the batch that showed it
  (`_window_proof`; answered without it, the batch is a dead one's, skipped): a middle
  process's queued batch goes back in seq just as a third process would; so does, in that
  window, a batch past a gap nothing repaired (`_repair`), and a batch at the new run's next
  seq that the dead run used too (`_window_proof`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from indexer.stream.state import SubscriberState, batch_digest, undecodable

if TYPE_CHECKING:
    from indexer.stream.subscriber import StreamSubscriber

__all__ = ["DEAD", "DEAD_RUN_S", "ELSEWHERE", "Restarts"]

# how long after a restart is found batches of the process before it may still arrive: what
# was queued on our socket when it died (thousands of batches of a busy worker), read at the
# stream's pace. Within it a live batch that continues the old run and is not the new
# process's is skipped; past it, one is no queued batch: a replay socket that showed the
# restart and was never confirmed by a live batch since is another worker's (`_dead_batch`)
DEAD_RUN_S = 5.0
DEAD = "dead"  # `_window_proof`'s answer for a batch the replay socket answered without
# `_went_back`'s answer for a live seq going back that the replay socket shows is no restart
# (the two sockets disagree: `_disagree` was called)
ELSEWHERE = "elsewhere"


class Restarts(SubscriberState):
    """Rebuilds a restarted stream and tells the dead process's batches from the new one's."""

    def _restart(self, reason: str, *, unproven: bool = False, outcome: str | None = None) -> None:
        """The publisher restarted (or may have): drop the stream's state, rebuild from 0.

        `unproven`: found by a replay socket never proven to be the publisher's, contradicting
        a batch the live stream delivered. That is a restart of this publisher or another
        worker's socket (a `replay` typo), and nothing tells which yet: it is counted and
        rebuilt as a restart, but what the socket gives predicts nothing until a live batch
        agrees with it (as at a join), and a live batch that contradicts what it gave finds
        it out (`_live_disagrees`, `_followed_on`, a live seq beyond its buffer in `_repair`),
        or the run before the restart still coming past `DEAD_RUN_S` while no live batch
        confirmed the socket (`_dead_batch`). Flagging it foreign at once wrote off an
        honest worker's own socket at its first restart: never asked again, every later gap
        cleared the stream."""
        self._restarted()
        # live batches of the process before it may still arrive (queued on our socket before
        # it died): never applied (`_dead_batch`)
        live = self.tracker.live
        self._after_restart_of(self.tracker.last if live is None else live, unproven=unproven)
        if unproven:
            reason += (
                " (or its replay socket, never proven the publisher's, is another worker's: "
                "what it gives predicts nothing until a live batch agrees with it)"
            )
        # (said apart from the clears: one a moment before, a gap's, would swallow it)
        self._clear(reason, kind="restart", outcome=outcome)
        self._rebuild_at = self._rebuild_from = None  # (rebuilt from 0 now)
        self.tracker.reset()
        self.sink.forget_seq()
        self._last_live = None

    def _restarted(self) -> None:
        """Count a restart and say so (`on_restart`): a new process on the same ports may run
        other settings (dp ranks, page size) than the one its worker was registered with, and
        no health probe need have seen it down (a quick restart, a pod behind a stable URL)."""
        self.restarts += 1
        if self._on_restart is not None:
            self._on_restart(self.worker, self.stream_id)
        if self._on_siblings is not None and not (self._unverified and self._by_sibling):
            # its other ranks (one server's) restarted too: before, a rank whose connection
            # did not drop (behind a forwarder) and that was quiet predicted the dead process's
            # pages until its own probe found out (QA: 288 tokens for about 1.2 s)
            # (a part of a `StreamSubscriber`, the one class that combines the parts)
            self._on_siblings(cast("StreamSubscriber", self), "restarted")

    def _after_restart_of(self, old: int | None, *, unproven: bool) -> None:
        """A restart was found now; `old` is the newest seq the run before it showed live.
        (Both callers clear the stream next: nothing tainted is left.)"""
        self._after_restart = old is not None
        self._dead_seq = old
        self._window_copies = {}  # another process's buffer now
        self._live_unchecked = None  # the dead process's: the new one's socket lacks it
        self._live_agreed = None
        self._restart_found_at = self._clock()
        self._restart_unproven = unproven
        self._reopened = False
        self._set_tainted(None)

    def _set_tainted(self, why: str | None) -> None:
        """Whether the stream holds a batch of the window after a restart that nothing proved
        the new process's (`why`: what it was): it predicts nothing (DEGRADED) until the
        window ends, and is cleared then (`_end_window`)."""
        if (why is None) == (self._tainted is None):
            return
        self._tainted = why
        self._show_state()

    def _end_window(self) -> None:
        """The window after a restart is over: a stream tainted in it is cleared, once."""
        if not self._after_restart:
            return
        self._after_restart = False
        self._window_copies = {}
        why = self._tainted
        if why is None:
            return
        self._set_tainted(None)
        if self.tracker.last is not None or self.sink.entries():
            self._clear(
                f"in the {DEAD_RUN_S:g} s after the restart, {why}: the dead process's batches "
                "cannot be told from the new one's, so the stream starts cold from the next batch",
                kind="window",  # said once per window, apart from the restart's own clear
            )
            if self.tracker.last is not None:
                # the new process's buffer holds what it stored in the window: given back
                self._owe_rebuild(self.tracker.last + 1)

    def _window_over(self) -> bool:
        return self._clock() - self._restart_found_at > DEAD_RUN_S

    def _window_left_ms(self) -> int | None:
        """How long until a tainted stream's window ends (None: no such window)."""
        if self._tainted is None or not self._after_restart:
            return None
        left = self._restart_found_at + DEAD_RUN_S - self._clock()
        return max(int(left * 1000) + 1, 0)

    def _collides(self, seq: int) -> bool:
        """Whether live batch `seq`, the stream's next, comes in the window after a restart
        at a seq the dead run used too (its queued batches, or a middle process's, there)."""
        last = self.tracker.last
        return (
            self._after_restart
            and self._dead_seq is not None
            and last is not None
            and seq == last + 1
            and seq <= self._dead_seq
            and not self._window_over()
        )

    async def _window_proof(self, seq: int, payload: bytes) -> str | None:
        """Whether live batch `seq` in the window after a restart is the new process's: None
        (its replay socket gives it back, or gave it in its last answer), `DEAD` (answered
        without it: a dead process's queued batch), or why nothing proves it."""
        digest = batch_digest(payload)
        if self._is_replayed(seq, payload) or self._window_copies.get(seq) == digest:
            return None
        if not self._has_replay:
            return "no replay socket"
        answered, copy = await self._replayed_copy(seq)
        if copy is not None and batch_digest(copy) == digest:
            self._trust_replay()
            return None
        return DEAD if answered else "the replay did not answer"

    async def _went_back(self, seq: int, payload: bytes, prev_live: int | None) -> str | None:
        """Whether live batch `seq`, whose seq goes back (below the newest live one,
        `prev_live`; None: below what a replay gave before any live batch), shows a restart:
        None (the replay socket gives it back: its process is new; or there is nothing to
        ask, as ever), `ELSEWHERE` (the socket's process never went back: it still holds
        the newest live batch it gave back, `_live_agreed`, or with nothing to tell by, it
        does not give this one back; so the live stream is another publisher's and
        `_disagree` was called), or why nothing proves either (no answer, or a socket whose
        process is new too and lacks the batch, a dead middle process's: taken for a
        restart, which predicts nothing until its window ends).

        A publisher buffers what it sends before it answers, so a new process's socket gives
        its batch back. Before, a seq going back was a restart on its own: a forwarder
        re-pointed at a worker whose seqs were behind this one's cleared the stream, rebuilt
        it from this worker's buffer and then skipped the other worker's batches as the dead
        process's while `synced`, deaf to this worker's own evictions (QA: 191 false hits in
        15 s, no ERROR)."""
        if not self._has_replay or undecodable(payload):
            return None  # no socket to ask (or garbage, no batch to ask for): as ever
        if self._replay_away:
            return "the replay connection is away"
        anchor = self._live_agreed
        at = None if anchor is None else anchor[0]
        copy = await self._replay_at(seq, seq if at is None else min(seq, at), at)
        if not copy.answered:
            return "the replay did not answer"
        if copy.payload is not None and batch_digest(copy.payload) == batch_digest(payload):
            self._trust_replay()  # it gives back the batch that showed the restart
            return None
        if copy.first is None and not self._replay_buffers:
            return None  # a socket that never gave a batch may buffer none: as without one
        held = self._anchor_held(copy, anchor)
        if held is False:
            return "the replay socket's process is new too and does not give it back"
        if copy.payload is not None:
            gives = "another batch at that seq"
        elif copy.first is None:
            gives = f"nothing from seq {seq} on"
        else:
            gives = f"its batches {copy.first}..{copy.newest} and not that one"
        if held and anchor is not None:
            gives += f", and still batch {anchor[0]}, which it gave back before"
        where = (
            f"from {prev_live}"
            if prev_live is not None
            else "below the batches a replay gave before it"
        )
        self._disagree(
            f"live seq {seq} goes back {where} as after a restart, yet the replay socket gives "
            f"{gives}: a new process's socket gives back the batch it sent"
        )
        return ELSEWHERE

    def _skip_collided(self, seq: int) -> None:
        self.dead_batches += 1
        self._warn(
            "stale",
            f"live seq {seq} is not in the new process's buffer: a dead process's queued batch "
            "at the new run's next seq, skipped",
        )

    def _skip_dead(self, seq: int, how: str) -> bool:
        self._dead_seq = seq
        self.dead_batches += 1
        self._warn("stale", f"live seq {seq} continues the run before the restart: {how}")
        return True

    async def _dead_batch(self, seq: int, payload: bytes) -> bool:
        """Whether live batch `seq`, arriving after a restart was found, is the dead process's
        (skipped, counted) rather than the new one's.

        The dead process's queued batches continue its run: seqs beyond `_dead_seq`, in order;
        the new process's are told apart only by its replay socket (it buffers what it sends,
        so it gives back each of its live batches). Without that proof (no socket, or no
        answer) nothing tells them apart, as seqs of both runs collide: within `DEAD_RUN_S`
        the new process's next seq is applied but taints the stream (predicts nothing, cleared
        when the window ends), and any other is skipped. Past it a run that still continues
        the old one is asked for the same way, the new run's next seq included (a late queued
        batch may sit at it): a batch the socket does not give back is a late queued one
        (skipped), or, if only a replay socket never confirmed said there was a restart, that
        socket is another worker's. A late one nothing proves clears the stream (it may be the
        new process's after a gap) and opens the window once more; a run that still goes on
        past that second window is taken as the live one."""
        dead = self._dead_seq
        if dead is None or seq <= dead or self._is_replayed(seq, payload):
            return False  # not the old run's next, or a live copy of the new buffer's batch
        within = not self._window_over()
        if not within:
            self._end_window()
        last = self.tracker.last
        nxt = 0 if last is None else last + 1
        # past the window, the new run's next seq is no proof either: a late queued batch of
        # the dead run may sit at that very seq (QA: its page predicted for good, without a
        # replay socket); it is asked for, or taken as late, below
        answered, copy = False, None
        if self._has_replay:
            digest = batch_digest(payload)
            if self._window_copies.get(seq) == digest:
                # the buffer the new process gave back last holds this very batch: its own
                self._trust_replay()
                if not within:
                    self._dead_seq = None
                return False
            # (one round trip per batch the last answer did not hold, for the window only)
            answered, copy = await self._replayed_copy(seq)
            if copy is not None and batch_digest(copy) == digest:
                self._trust_replay()  # the new process's: it gives this batch back
                if not within:
                    self._dead_seq = None
                return False
        if answered and not within:
            if self._restart_unproven and not self._replay_trusted:
                self._disagree(
                    f"the replay socket showed a restart over {DEAD_RUN_S:g} s ago, yet the "
                    f"run before it goes on (live seq {seq}, which it does not give back) and "
                    "no live batch followed on its buffer since"
                )
                return True  # not taken: nothing is while they disagree
            late_s = self._clock() - self._restart_found_at
            if late_s > 2 * DEAD_RUN_S:
                # no queue lasts that long: the live stream is another publisher's (a forwarder
                # re-pointed after the restart), and this worker's own batches go unheard.
                # Before, such batches were skipped as late queued ones for good while the
                # stream was `synced` (QA: each flush of the worker a false hit)
                self._disagree(
                    f"live batches continuing the run before the restart still come "
                    f"{late_s:.1f} s after it (live seq {seq}, which the replay socket does "
                    "not give back)"
                )
                return True
            # a late queued batch, or another publisher's (and this worker's own batches go
            # unheard): the stream predicts nothing until a live batch follows on it
            if not self._live_unproven:
                self._live_unproven = True
                self._show_state()
            return self._skip_dead(
                seq,
                "not in the new process's buffer, a late queued batch; the stream predicts "
                "nothing until a live batch follows on",
            )
        if answered:
            return self._skip_dead(seq, "not in the new process's buffer, a queued batch")
        # nothing says whose it is
        proof = "no replay socket" if not self._has_replay else "the replay did not answer"
        if within:
            self._set_tainted(f"a batch not proven the new process's ({proof}) was applied")
            if seq == nxt:
                self._warn(
                    "stale",
                    f"live seq {seq} may be the dead process's or the new one's ({proof}): "
                    "applied, the stream predicts nothing until the window after the restart ends",
                )
                return False
            return self._skip_dead(
                seq, f"skipped ({proof}); the stream predicts nothing until the window ends"
            )
        if self._reopened:
            self._dead_seq = None  # the old run goes on 10 s on: it is the live one
            return False
        # late: a long queue, or the new process's after a gap (which may have removed pages)
        self._reopened = True
        self._after_restart = True
        self._restart_found_at = self._clock()
        if self.tracker.last is not None or self.sink.entries():
            self._clear(f"live seq {seq} may be a late queued batch of the dead process ({proof})")
        self._set_tainted(f"a batch of the old run's seqs came late ({proof})")
        return self._skip_dead(seq, f"skipped ({proof}); the window after the restart reopens")
