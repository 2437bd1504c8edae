"""Gaps repaired from the replay socket, idle probes, and the catch-up of a stream rebuilt from
its publisher's buffer.

- GAP (a message was dropped, or we joined mid-way): ask the replay socket for everything from
  the first missing seq, apply the replies in order, then continue with live messages (those
  already covered by the replay are duplicates and skipped);
- the replay cannot cover the gap (first replayed seq later than asked), no replay endpoint, or
  the replay times out: clear the stream and rebuild from what comes next;
- a live seq beyond everything the replay just listed cannot be real (a corrupt seq frame):
  skipped and counted, unless the next seq follows it (a publisher that buffers nothing);
  as it may have been real (an empty or stale answer), the stream predicts nothing
  (DEGRADED) until a later live batch or a probe shows which;
- a replay read onto a stream that holds nothing of the present (a join, a rebuild after a
  clear or a restart, a proof) is a catch-up: each batch it applies is a past state of the
  worker's cache (a page stored early in the buffer and evicted later is held until its
  eviction is read), so the stream is SYNCING, which predicts nothing, until the answer ended
  (or a live batch followed on it) and the loop found no live batch left queued (`_catch_up`);
  an answer asked before the SUB connected does not end it: once connected, the replay is
  read once more (`_hear_end`), as what was published in between reached nobody;
- an idle probe, asked with the SUB connected and the stream caught up, that brings batches
  the SUB never delivered: the live path may be deaf (a forwarder that lost its upstream, its
  SUB connection up), so the stream predicts nothing (UNVERIFIED) until a live batch follows
  on (`_found_undelivered`).

A replay whose answer did not come to its end leaves the stream's tail unproven
(`_tail_proven`); a restart's proof or rebuild is then asked again soon (`_retry_soon`), a
probe at its doubling back-off.
"""

from __future__ import annotations

from indexer.sequence import SeqVerdict
from indexer.sink import keeps_entries
from indexer.stats import StreamState
from indexer.stream.replay_answers import Continuity
from indexer.stream.restarts import DEAD
from indexer.stream.state import (
    REBUILD_FIRST_S,
    REBUILD_MAX_S,
    CatchUp,
    DeliveryMark,
    SubscriberState,
)

__all__ = ["Repair"]

# a restart's rebuild whose replay did not answer to its end is asked again after this wait,
# doubling up to the cap (or the probe interval, when shorter): the stream holds nothing of the
# new process, or an unproven part, so asking often stalls nothing worth protecting, while the
# probe's back-off (to 60 s) would leave a quiet worker's new cache unpredicted for that long
_RETRY_FIRST_MS = 100
_RETRY_MAX_MS = 2_000


class Repair(SubscriberState):
    """Repairs gaps and probes the replay socket; says when a catch-up reached the present."""

    async def _repair(
        self,
        start: int,
        topic: bytes,
        seq: int,
        payload: bytes,
        prev_live: int | None,
        *,
        joining: bool,
    ) -> None:
        """Fill seqs start..seq-1 from the replay socket, then apply live message `seq`."""
        # taken before the replay's wait: a batch that came inside the window after a restart
        # is judged as one, however long the answer took (QA: judged after it, a dead batch
        # met near the window's end was applied, predicted)
        within = self._after_restart and not self._window_over()
        if not joining:
            self.gaps += 1
        if not joining or self.tracker.last is not None:
            # what it holds may be gone on the worker (a missing batch may have removed it):
            # it predicts nothing until the repair ends (`UNTRUSTED`)
            self._set_phase(StreamState.DEGRADED)
        answered, newest = False, None
        # (a replay found unusable may clear the stream itself)
        held, clears = self.tracker.last is not None, self._clears
        if self._has_replay:
            self.replays += 1
            # from the last applied seq, not `start`: its batch proves the epoch (fence)
            last = self.tracker.last
            self._run_open = True
            try:
                result = await self._replay(start if last is None else last)
            finally:
                self._run_open = False
            answered, newest = result.answered, result.newest
            if held and not answered and self._clears > clears:
                # an answer that proves nothing cleared the stream (one that starts after its
                # last batch, then shows itself no buffer): an answer that never came, whose
                # gap the cleared stream no longer sees below. Before, no rebuild was owed: the
                # pages from before the gap were never predicted again (QA)
                self._owe_rebuild(seq)
        decision = await self._checked(self.tracker.on_live(seq), seq, payload)
        if (
            decision.verdict is SeqVerdict.GAP
            and answered
            and (newest is None or seq > newest + 1)
            and (self._suspect is None or seq != self._suspect + 1 or self._after_restart)
        ):
            # the publisher just listed everything it has and this seq is not among it: a
            # corrupt seq frame, skipped. (If the next seq follows it, it was real after all:
            # a publisher that buffers nothing; then we clear below instead.) Right after a
            # restart it is a batch of the process before it, still queued on our socket
            # (the new process's next batch is the one after its buffer): skipped, every one
            self._suspect = seq
            self.tracker.live = prev_live  # live order continues from before the bogus seq
            if self._after_restart:
                self.dead_batches += 1
                self._warn(
                    "stale",
                    f"live seq {seq} is not in the restarted publisher's buffer: a batch of "
                    "the process before it, skipped",
                )
                self._set_phase(StreamState.SYNCED)
            else:
                # or the seq was real and the answer empty or stale (a publisher that buffers
                # nothing, a replay behind its PUB): then the batches before it are missing,
                # and one may have removed blocks the stream holds. It predicts nothing
                # until the next live batch, or a probe bringing them, says which
                self._malformed(
                    f"live seq {seq} is beyond everything the publisher buffers: skipped, and "
                    "the stream predicts nothing until the next batch shows whether it was real"
                )
                self._set_phase(StreamState.DEGRADED)
            self._notify_last()
            return
        if (
            answered
            and newest is not None
            and self._suspect is not None
            and seq == self._suspect + 1
            and newest < self._suspect
            and not self._after_restart
        ):
            # the seq before this one was real after all, yet the replay socket's buffer ends
            # below it: a publisher buffers what it just sent, so that socket is not this
            # publisher's, or the live stream is not (another worker's cache either way)
            self._disagree(
                f"the replay socket does not buffer the live stream's seqs: its buffer ends "
                f"at {newest}, the live stream is at {seq}"
            )
            return  # this batch is not taken either
        self._suspect = None
        if decision.verdict is SeqVerdict.GAP:
            # the replay did not reach this message (none configured, timed out, or too short)
            if self.tracker.last is not None:
                self._clear(f"gap before seq {seq} could not be repaired")
                if not answered:
                    # unanswered (timed out, dropped): its buffer may answer later with
                    # pages from before the gap the worker still holds
                    self._owe_rebuild(seq)
            if within:
                # in the window after a restart a batch past a gap may be a dead process's
                # queued one (QA: a middle process's seq 7 after the newest one's 0..3, its
                # page predicted): applied, it predicts nothing until the window ends
                proof = "no replay socket" if not self._has_replay else "the replay did not answer"
                self._set_tainted(f"a batch past a gap nothing repaired was applied ({proof})")
            self.tracker.restart_at(seq)
            decision = self.tracker.on_live(seq)
        if decision.verdict is SeqVerdict.APPLY:
            doubt = None
            if within and self._dead_seq is not None and seq <= self._dead_seq:
                # following on what the replay filled proves nothing of it: a dead middle
                # process's batch there was applied, the new one's own then skipped (QA)
                doubt = await self._window_proof(seq, payload)
                if doubt == DEAD:
                    self.tracker.last, self.tracker.live = seq - 1, prev_live
                    self._skip_collided(seq)
                    self._set_phase(StreamState.SYNCED)
                    self._notify_last()
                    return
            if not await self._live_check(seq, payload):
                return  # another publisher's (the sockets disagree): not taken
            await self._followed_on(seq, payload)  # (before it is applied, as in `_on_live`)
            await self._apply_live(topic, seq, payload)
            if doubt is not None:
                self._set_tainted(f"a batch at a seq the dead run used too was applied ({doubt})")
            self._reached_end()  # (a catch-up's: the live stream carries it on)
        self._live_delivered(seq, payload)  # (applied, or the repair ran ahead to it)
        self._set_phase(StreamState.SYNCED)
        self._notify_last()  # replayed messages notify only once repaired

    async def _probe(self) -> None:
        """Ask the replay socket for anything newer than what we applied (see probe_interval_s)."""
        if self._disagreeing is not None:
            await self._agree_check()  # (nothing is taken from it while they disagree)
            return
        if self._replay_foreign:
            return
        self._say_undelivered()  # (no live copy came since the last probe found them)
        if self._owed_wait:
            self._owed_wait = False
            await self._verify()  # the proof owed, asked again (`_owe_again`)
            return
        before = self.tracker.last
        joining = not self._joined
        rebinds = self._rebinds
        # the SUB connected and the stream caught up when asked: every batch published since
        # the last answer or live batch should have reached the SUB, so one this brings it
        # did not deliver (`_found_undelivered`)
        watched = self._connected and self._catch_up is None and not self._unverified
        mark = self._delivery_mark()
        self.probes += 1
        # Ask from the last applied seq, not the one after it: its batch must come back
        # unchanged (the fence), and an answer without it means the seqs went back (a restart
        # whose startup batch we missed while reconnecting; see _check_restart).
        restarts = self.restarts
        self._run_open = True
        self._probing = True
        try:
            result = await self._replay(0 if before is None else before)
            answered = result.answered  # (a restart found by the fence: its rebuild's answer)
            if result.answered and before is not None and result.newest is None:
                rebuilt = await self._check_restart(before)
                answered = answered if rebuilt is None else rebuilt
        finally:
            self._run_open = False
            self._probing = False
        if self._rebinds != rebinds:
            return  # a snapshot loaded meanwhile: this answer judged the sink it replaced
        if self._replay_foreign:
            return  # found out meanwhile: the stream is one without a replay socket now
        # Not while the SUB is disconnected: what the answer brought is applied, but it proves
        # the stream only up to now, and a SUB that is not connected hears none of the batches
        # published after it (an eviction among them): it stays unproven until it reconnects
        # and `_verify` runs. Before, the idle probe trusted it while its event connection was
        # down (QA: a forwarder's PUB closed 8 s, a flush at +3 s: 288 matched, 0 cached)
        if (
            self._unverified
            and self._connected
            and result.continuity is not Continuity.NONE
            and not self._proof_owed  # (asked from the newest batch: `_verify` owes it)
        ):
            if result.continuity is Continuity.PROVEN and self.restarts == restarts:
                self._loaded_outcome(f"proven at seq {before}: {self.sink.entries()} entries")
            # else the clear that dropped the snapshot's state said why (`_clear`)
            self._trust()  # proven, or rebuilt: either way nothing unproven is left
        after = self.tracker.last
        if self._suspect is not None and after is not None and after >= self._suspect:
            # the probe brought the batches up to the skipped seq: it was real, none is missing
            self._suspect = None
            if self._phase is StreamState.DEGRADED:
                self._set_phase(StreamState.SYNCED)
        if after != before and after is not None:
            # Batches the live path had not delivered (a dropped last batch, or ones published
            # before we subscribed): a gap repaired by a replay run, unless we were joining.
            # The offline replayer counts the same run of replayed records the same way; a
            # probe that merely ran ahead of a live copy in flight is counted alike on both sides.
            # (Also when the answer timed out midway: what it brought is applied.)
            self.replays += 1
            if not joining:
                self.gaps += 1
            if self.restarts != restarts or mark.restarts != restarts:
                # a rebuild after a restart: found by this probe, or before it with no live
                # batch of the new run heard since (CI: a proof cut as the process died, then
                # the new process's buffer, by replay only, was trusted whole)
                self._undelivered_since(mark, "the idle probe's rebuild after a restart")
            elif watched:
                self._found_undelivered(before, after, "the idle probe")
            self._notify(after)
        if not answered:
            if self._retry_ms is not None or self.restarts != restarts:
                self._retry_soon()  # a restart's rebuild is still to be read
                return
            # a replay socket that does not answer must not stall the live stream every
            # interval: back off (capped), and say so once in a while
            base_ms = int(self.settings.probe_interval_s * 1000)
            self._probe_wait_ms = min(self._probe_wait_ms * 2, max(base_ms, 60_000))
            self._tail_proven(False)
            return
        self._heard_whole()

    def _found_undelivered(self, before: int | None, after: int, by: str) -> None:
        """A replay (`by`: an idle probe asked with the SUB connected and the stream caught
        up, a restart's proof, a rebuild: `_undelivered_since`) brought batches up to `after`
        that the SUB has not delivered. A PUB at its high-water mark drops some; a live
        path that is deaf drops all (a ZMQ forwarder that lost its upstream, a
        TCP hop swallowing bytes: the SUB's connection to it stays up, so nothing else tells),
        and each eviction would be a false hit until the next probe. Nothing tells the two
        apart but the next live batch: until one follows on, the stream predicts nothing
        (UNVERIFIED), however many probes find nothing more (an idle worker stays untrusted
        until it publishes; a busy one's next batch, milliseconds away, trusts it again). Or
        the probe ran ahead of a live batch in flight, whose copy comes next: so it is said
        only once a later live batch comes without the copies, or at the next probe
        (`_undelivered_unsaid`, `_say_undelivered`)."""
        self._undelivered_unsaid = (before, after, by)
        if not self._live_unproven:
            self._live_unproven = True
            self._show_state()

    def _say_undelivered(self) -> None:
        """Count and say the batches a replay found undelivered, if still unsaid."""
        unsaid, self._undelivered_unsaid = self._undelivered_unsaid, None
        if unsaid is None:
            return
        before, after, by = unsaid
        self.undelivered_tails += 1
        first = 0 if before is None else before + 1
        self._warn(
            "undelivered",
            f"{by} found batches {first}..{after} the connected event socket never "
            f"delivered (undelivered_tails {self.undelivered_tails}): the event path may be "
            "deaf (a forwarder that lost its upstream, a hop dropping bytes) or the publisher "
            "dropped them at its high-water mark; the stream predicts nothing until a live "
            "batch follows on",
        )

    def _live_delivered(self, seq: int, payload: bytes) -> None:
        """Live batch `seq` came and the stream stands at it: applied (it followed on), or
        the same bytes a replay applied last (a probe or a repair ran ahead to it while it was
        in flight). The live path delivers up to the present: trusted again. (A live copy
        below the last applied seq proves nothing yet: the copies after it are to come.)"""
        unsaid = self._undelivered_unsaid
        if unsaid is not None and seq >= unsaid[1]:
            if seq > unsaid[1] or not self._is_replayed(seq, payload):
                self._say_undelivered()  # a later batch came, the probe's newest never did
            else:
                self._undelivered_unsaid = None  # its copy came: it was in flight
        if not self._live_unproven or seq != self.tracker.last:
            return
        if self._last_live != seq and not self._is_replayed(seq, payload):
            return
        self._live_unproven = False
        self._show_state()

    def _catching_up(self) -> None:
        """A replay is about to rebuild the stream from its publisher's buffer (what it holds
        now is nothing, or a state not proven the present): each batch it applies is a past
        state of the worker's cache, so the stream predicts nothing until it is caught up."""
        if self._catch_up is not CatchUp.READING:
            self._catch_up = CatchUp.READING
            self._show_state()

    def _reached_end(self, *, heard: bool = True) -> None:
        """The catch-up's answer ended, or a live batch followed on what it gave: the live
        batches queued meanwhile are all that is left of the past (`_caught_up`). `heard`:
        the answer was asked with the SUB connected (a live batch: it is), so every batch
        published after it reaches the SUB; else one more replay is read once it is
        connected (`_hear_end`)."""
        if self._catch_up is None:
            return
        self._catch_up = CatchUp.DRAINING
        self._end_unheard = not heard

    async def _hear_end(self) -> None:
        """The SUB connected after the catch-up's answer was asked: what was published
        between that answer and the connection reached nobody, so the replay is read once
        more from the last applied seq (a probe: the fence, a restart checked). Its answer,
        asked with the SUB connected, ends the catch-up; anything after it arrives live. One
        replay round trip more at a join (the catch-up probe runs as the SUB connects)."""
        if self._has_replay:
            await self._probe()
        if not self._has_replay:
            self._end_unheard = False  # none to ask (found another's): the live batches only
        elif self._end_unheard and self._retry_ms is None:
            self._retry_soon()  # no answer: asked again after a wait, not at once

    def _caught_up(self) -> None:
        """The SUB holds no live batch more: the stream is the publisher's present again."""
        self._catch_up = None
        self._end_unheard = False
        self._show_state()

    def _tail_proven(self, proven: bool) -> None:
        """Whether the stream's tail is known whole (see `_tail_unproven`)."""
        if proven:
            self._retry_ms = None  # no rebuild is pending once nothing is missing
        if self._tail_unproven == (not proven):
            return
        self._tail_unproven = not proven
        if not proven:
            self._warn(
                "tail",
                "the replay socket did not answer to its end: batches dropped at the stream's "
                "end would go unseen, so its entries predict nothing until it answers or the "
                "next batch follows on"
                if keeps_entries(self.sink)
                else "the replay socket did not answer to its end: batches dropped at the "
                "stream's end would go unseen until it answers or the next batch follows on",
            )
        self._show_state()

    def _heard_whole(self) -> None:
        """The replay socket answered to its end from where the stream stands (a probe, a
        proof): nothing is missing at its tail, and the socket is asked at the base interval."""
        self._probe_wait_ms = int(self.settings.probe_interval_s * 1000)
        self._tail_proven(True)
        self.health.last_heard_at = self._clock()
        if self._phase is StreamState.SYNCING:
            self._set_phase(StreamState.SYNCED)

    def _retry_soon(self) -> None:
        """A restart's proof or rebuild got no whole answer: what the stream holds (nothing of
        the publisher's, or a part) predicts nothing, and the replay socket is asked again
        after `_retry_ms` (doubling, capped), not at the probe's back-off."""
        if not self._has_replay:
            return  # found another publisher's meanwhile: nothing is asked again
        base_ms = int(self.settings.probe_interval_s * 1000)
        cap_ms = min(base_ms, _RETRY_MAX_MS) if base_ms > 0 else _RETRY_MAX_MS
        if self._retry_ms is None:
            self._retry_ms = min(_RETRY_FIRST_MS, cap_ms)
        else:
            self._retry_ms = min(self._retry_ms * 2, cap_ms)
        if self.tracker.last is None:
            self._set_phase(StreamState.SYNCING)  # nothing of the publisher's is held yet
        self._tail_proven(False)

    def _owe_rebuild(self, held_from: int) -> None:
        """The stream was cleared and holds only what it applied from seq `held_from` on, while
        the worker may still hold pages stored before (an engine never announces a page it
        keeps again): rebuild it from the replay socket's buffer `_rebuild_wait_s` from now
        (`_rebuild_cleared`), busy or quiet. Before, nothing did: those pages were predicted nothing
        until stored again (QA v20x: a busy stream, 12 s and counting)."""
        if not self._has_replay or not keeps_entries(self.sink):
            return  # (a recording keeps the gap as the events showed it)
        self._rebuild_from = held_from
        self._rebuild_at = self._clock() + self._rebuild_wait_s

    def _rebuild_left_ms(self) -> int | None:
        """How long until the owed rebuild is asked (0: now), or None: none owed, or not
        askable yet (the replay connection away, the SUB not connected, a proof or a catch-up
        under way, the window after a restart open: each ends by itself or says so)."""
        at = self._rebuild_at
        if at is None:
            return None
        if not self._has_replay:
            self._rebuild_at = self._rebuild_from = None  # found another's: nothing to ask
            return None
        if (
            not self._connected
            or self._replay_away
            or self._unverified
            or self._disagreeing is not None
            or self._catch_up is not None
            or (self._after_restart and not self._window_over())
        ):
            return None
        left = at - self._clock()
        return int(left * 1000) + 1 if left > 0 else 0

    async def _rebuild_cleared(self) -> None:
        """Ask the replay socket for its whole buffer (`_rebuild_from`): one that starts before
        the first seq the stream holds since its clear clears it again and rebuilds it from
        the whole answer (the stream `syncing`, predicting nothing, until caught up, as at a
        join); one that starts later has nothing more to give, and the answer is read as a
        probe's. An answer that does not come to its end is asked again after twice the wait
        (to `REBUILD_MAX_S`)."""
        self._rebuild_at = None
        # a rebuild runs on a stream proven since its SUB connected: every batch past the one
        # it stands at was published to that connection (QA: read behind a forwarder the SUB
        # reconnected to, deaf, before any live batch came: trusted, a flush predicted)
        mark = self._delivery_mark(fallback=self.tracker.last)
        restarts, rebinds = self.restarts, self._rebinds
        fence = self._rebuild_fence = self.sink.fence()
        unproven = fence is not None and self._unproven_against_live(fence.seq)
        self._rebuild_broke = False
        self._rebuilding = True
        # what it applies is the past until the answer ended and the live batches queued
        # meanwhile are read (`_take_reply`), whether it cleared the stream or not
        self._probing = True
        try:
            result = await self._replay(0)
        finally:
            self._rebuilding = self._probing = False
            self._rebuild_fence = None
        if fence is not None and self.restarts == restarts and self._rebinds == rebinds:
            newest = result.newest
            if self._rebuild_broke or (
                result.answered and newest is not None and newest < fence.seq
            ):
                # a new process's buffer: what it rebuilt is that process's cache, yet the
                # restart is counted and said, the worker's settings read again and its
                # other ranks suspected, as any restart (QA: absorbed unsaid, `restarts` 0)
                where = (
                    f"another batch at seq {fence.seq}"
                    if self._rebuild_broke
                    else f"seqs up to {newest} only, below ours ({fence.seq})"
                )
                self._restart(
                    f"the rebuild's buffer holds {where}: {self._another_run()}",
                    unproven=unproven,
                )
                result = await self._replay(0)
        self._undelivered_since(mark, "the rebuild")
        if result.answered:
            self._rebuild_from = None
            self._rebuild_wait_s = REBUILD_FIRST_S
            if self._phase is StreamState.SYNCING:
                # a stream that held nothing (a snapshot did not know it: `rebind`) read the
                # worker's whole buffer, as a join's probe does (its catch-up, if any, still
                # shows it `syncing` until the live batches queued meanwhile are read)
                self._heard_whole()
            self._notify_last()  # (what it applied: the waiters of a seq it brought)
            return
        self._rebuild_wait_s = min(self._rebuild_wait_s * 2, REBUILD_MAX_S)
        if self._catch_up is not None:
            # cleared and rebuilt in part, or its answer applied in part proved nothing (the
            # stream rebuilt as at a join): the rest is asked for soon, as a join's would be
            # (before, nothing asked again: `syncing` until a live batch or a probe)
            self._retry_soon()
        elif self._rebuild_from is not None and self.tracker.last is not None:
            self._owe_rebuild(self._rebuild_from)  # nothing came: asked again later

    def _delivery_mark(self, fallback: int | None = None) -> DeliveryMark:
        """Where the live path stands as a replay is asked: the newest seq the SUB delivered
        on its connection, else `fallback` (a seq every later batch is known published after,
        to the same connection)."""
        if self._live_heard is not None:
            return DeliveryMark(
                self._live_heard,
                self._live_heard_payload,
                self._live_heard_restarts,
                self._sub_links,
            )
        fence = self.sink.fence() if fallback is not None else None
        payload = fence.payload if fence is not None and fence.seq == fallback else None
        return DeliveryMark(fallback, payload, self.restarts, self._sub_links)

    def _undelivered_since(self, mark: DeliveryMark, by: str) -> None:
        """A replay asked at `mark` (`by` found it) left the stream at a later seq: those
        batches were published to the SUB's connection, so either the live path delivers them
        next (the replay ran ahead of them) or it is deaf (`_found_undelivered`: the stream
        predicts nothing until a live batch follows on). A rebuild or a proof read while a
        forwarder's upstream was gone, its SUB connection up, was otherwise trusted whole:
        each eviction after it a false hit until the next probe (QA: 4.7 s). A restart found
        meanwhile leaves `heard` the new run's only if the new buffer holds the very batch
        there; else it was the dead run's, and every batch of the new one was published to the
        SUB's connection after it (a hop between them outlived the dead process: before, QA,
        a restart a proof found behind a deaf forwarder was trusted whole, the new process's
        pages predicted after a flush it swallowed, 6 s and more). A SUB that reconnected
        judges by nothing (what was published before its handshake reached nobody)."""
        heard, after = mark.heard, self.tracker.last
        if self._sub_links != mark.links or heard is None or after is None:
            return
        if self.restarts != mark.restarts and (
            mark.payload is None or not self._is_replayed(heard, mark.payload)
        ):
            # every batch of the new run came by replay only. A healthy hop loses the new
            # process's first batches too (a forwarder reaches its new PUB only after it has
            # published them): no sign of a deaf path, so nothing is counted or said (QA:
            # every restart behind a healthy forwarder warned of one), yet the stream predicts
            # nothing until a live batch follows on
            if not self._live_unproven:
                self._live_unproven = True
                self._show_state()
        elif after > heard:
            self._found_undelivered(heard, after, by)
