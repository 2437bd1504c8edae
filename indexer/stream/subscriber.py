"""One ZMQ subscription per (worker, dp rank): live events in, gaps repaired, index updated.

The subscriber owns a SUB socket (topic prefix subscription) and, when configured, a DEALER to
the worker's replay ROUTER. Every live message goes through the `SequenceTracker`:
- APPLY: decode and apply to the index;
- GAP, and a live seq beyond everything the replay socket buffers: repaired from the replay
  socket (`indexer.stream.repair`);
- RESTART (seq went backwards), and live batches of the process before a restart still
  queued on the SUB: `indexer.stream.restarts`;
- a live batch that follows on, asked of the replay socket all the same
  (`indexer.stream.live_checks`), and the two sockets found to disagree about the publisher
  (`indexer.stream.disagreement`);
- a payload that does not decode although its seq is intact: a gap of one batch, fetched
  again through the replay once; a copy that does not decode either clears the stream
  (a lost batch may have held removals: keeping the entries could be a false hit).

Restart candidates (a dropped connection, an unanswered replay, a worker's health back from
down, a snapshot) make the stream predict nothing until a replay held to the epoch fence
proves it (`indexer.stream.restart_candidates`, `indexer.stream.replay_answers`).

Malformed frames are counted and skipped; problems are logged at most once per
`log_interval_s` per stream and kind. The task never blocks the loop: sockets are
`zmq.asyncio`, and it yields every `yield_every` messages so a flooding stream cannot starve
the others (a consumer that falls behind overflows its SUB queue, which shows up as gaps that
the replay repairs, never as silent drift).

Sink (`indexer.sink`): every message the subscriber accepts, live or replayed, goes to its
`StreamSink` in the order it is accepted, malformed payloads included (frames whose seq cannot
be read are not messages and are not passed on): an `IndexSink` applies it to the index, a
`RecordingSink` writes it to a recording (`kvroute record`). The sink must not block.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.errors import ProtocolError
from indexer.protocol.frames import parse_live, topic_matches
from indexer.sequence import SequenceTracker, SeqVerdict
from indexer.sink import StreamSink, keeps_entries
from indexer.stats import StreamState, StreamStats, stream_stats
from indexer.stream import restarts  # (`restarts.DEAD_RUN_S` read when said: one setting)
from indexer.stream.disagreement import Disagreement
from indexer.stream.live_checks import LiveChecks
from indexer.stream.repair import Repair
from indexer.stream.replay_answers import ReplayAnswers
from indexer.stream.restart_candidates import RestartCandidates
from indexer.stream.restarts import DEAD, ELSEWHERE, Restarts
from indexer.stream.state import CatchUp, log

__all__ = ["StreamSubscriber"]

# what the SUB's monitor reports: a connection made (handshake done) or lost
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# kinds of session failure logged with their traceback; more (a session failing anew each
# time) are said in one line each
_TRACED_FAILURES = 8
# how often `_apply` notes the fence with its time, for `_settled_fence`
# (`indexer.stream.restart_candidates`): one note per interval, not per batch
_FENCE_NOTE_S = 0.1


class StreamSubscriber(
    RestartCandidates, Repair, ReplayAnswers, LiveChecks, Disagreement, Restarts
):
    """Subscribes to one stream and keeps its part of the index in sync; `run` is its task."""

    # ------------------------------------------------------------------ task

    async def run(self) -> None:
        """Subscribe until cancelled; unexpected errors restart the session with backoff."""
        backoff_s = 0.05
        while True:
            began = self._clock()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._say_failure(exc)
                if self._clock() - began > self.settings.restart_backoff_max_s:
                    backoff_s = 0.05  # a failure after a long healthy session starts over
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.restart_backoff_max_s)

    def _say_failure(self, exc: Exception) -> None:
        """A session's failure: the first of its kind with its traceback, the same again at
        most once a `log_interval_s`, in one line counting those held back. A session failing
        in a loop (the process out of descriptors) logged a traceback at every restart, 20 a
        second."""
        kind = f"{type(exc).__name__}: {exc}"
        held_back = self._limiter.allow(f"failed {kind}")
        if held_back is None:
            return
        if kind not in self._failures_traced and len(self._failures_traced) < _TRACED_FAILURES:
            self._failures_traced.add(kind)
            log.exception("stream %s: subscriber failed; restarting", self.stream_id)
            return
        log.error(
            "stream %s: subscriber failed again (%s; %d more since the last line); restarting",
            self.stream_id,
            kind,
            held_back,
        )

    async def _session(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.settings.rcv_hwm)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        # before connecting, so no connection event is missed: a dropped connection is the
        # first sign of a restart (`indexer.stream.restart_candidates`)
        monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        sub.connect(self.config.endpoint)  # non-blocking: zmq connects and reconnects itself
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self._sub_queued = lambda: bool(cast(int, sub.get(zmq.EVENTS)) & zmq.POLLIN)
        self._connected = False
        probing = self._probes_at_connect
        try:
            if probing:
                # catch up on what was published before we subscribed (and, when the state
                # came from a snapshot, prove it against the publisher's fence)
                await self._probe()
            handled = 0
            while True:
                if cast(int, monitor.get(zmq.EVENTS)) & zmq.POLLIN:
                    await self._on_monitor(monitor)
                    continue
                if self._replay_link():
                    continue
                if (
                    self._unverified
                    and self._connected
                    and not self._replay_away
                    and not self._owed_wait
                ):
                    await self._verify()
                    continue
                if self._rebuild_at is not None and self._rebuild_left_ms() == 0:
                    # (looked at before each live batch too: a busy stream is never idle)
                    await self._rebuild_cleared()
                    continue
                # The async poll costs a poller, futures and a timer: only pay for it when
                # nothing is queued (a busy stream then reads at the probe-free rate).
                if not cast(int, sub.get(zmq.EVENTS)) & zmq.POLLIN:
                    self._caught_up_live()  # (nothing waits behind a replay answer now)
                    if self._catch_up is CatchUp.DRAINING and self._connected:
                        # nothing queued: the live batches are all applied. Not before the SUB
                        # is connected: one that is not hears nothing published after the
                        # answer (an events port wrong or unreachable, the replay socket
                        # right), and the catch-up would be trusted, each eviction since a
                        # false hit until the next probe; nor, once connected, before a
                        # replay asked since has answered (`_end_unheard`)
                        if not self._end_unheard:
                            self._caught_up()
                        elif self._retry_ms is None:
                            await self._hear_end()
                            continue
                        # else its answer did not come: asked again on the retry's timer
                    probing = probing and not self._replay_foreign
                    # a pending rebuild is asked for again sooner than a probe, and even when
                    # probing is off: nothing else reads a quiet new process's buffer
                    retrying = self._retry_ms is not None and self._has_replay
                    timeout_ms = self._probe_wait_ms if probing else None
                    if retrying:
                        timeout_ms = self._retry_ms
                    rebuild_ms = self._rebuild_left_ms()
                    rebuilding = rebuild_ms is not None and (
                        timeout_ms is None or rebuild_ms < timeout_ms
                    )
                    if rebuilding:  # (the loop's top asks for it once due)
                        timeout_ms = rebuild_ms
                    window_ms = self._window_left_ms()
                    if window_ms is not None:  # a quiet tainted stream is cleared on time
                        timeout_ms = window_ms if timeout_ms is None else min(timeout_ms, window_ms)
                    check_ms = self._live_check_left_ms()
                    checking = check_ms is not None and (
                        timeout_ms is None or check_ms < timeout_ms
                    )
                    if checking:  # the newest live batch applied is asked for on time
                        timeout_ms = check_ms
                    if not await self._idle(poller, timeout_ms):
                        if window_ms is not None and self._window_over():
                            self._end_window()
                        elif checking:
                            if self._live_check_left_ms() == 0:
                                await self._check_pending()
                        elif rebuilding:
                            pass  # due: asked at the loop's top
                        elif probing or retrying:
                            await self._probe()
                    continue
                frames = await sub.recv_multipart()
                await self._on_live(frames)
                handled += 1
                if handled % self.settings.yield_every == 0:
                    await asyncio.sleep(0)
        finally:
            self._sub_queued = lambda: False  # (its socket is closed below)
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._close_replay()

    async def _idle(self, poller: zmq.asyncio.Poller, timeout_ms: int | None) -> bool:
        """Wait for a readable socket (True), a requested check or the timeout (False)."""
        self._poll_link(poller)
        self._link_due = 0  # whatever woke it, the monitor is looked at next
        wake = self._wake
        if wake is None or wake.done():
            wake = self._wake = asyncio.get_running_loop().create_future()
        # zmq.asyncio's poll returns a Future (typed as a plain Awaitable)
        poll = cast("asyncio.Future[list[tuple[object, int]]]", poller.poll(timeout_ms))
        try:
            await asyncio.wait((poll, wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not poll.done():
                poll.cancel()  # woken, or the session ends: no poll outlives its sockets
        # woken by suspect_restart: True, so the loop looks at the stream again
        return poll.cancelled() or bool(poll.result())

    async def _on_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        self._live_heard = None  # (a new connection, or none: nothing heard on it yet)
        self._sub_links += 1
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            self._connected = False
            self.suspect_restart("the event connection dropped")
            if self._on_siblings is not None:
                # a candidate restart of the whole server: its other ranks are suspected now,
                # held or not here (this stream's proof waits for the reconnect, and one that
                # holds nothing has none). Before, they were told only once a proof found the
                # restart: the new process served first, and with rank 0 quiet, never (QA:
                # rank 1 predicted the dead process's 304 tokens, 0 cached)
                self._on_siblings(self, "dropped its event connection")

    # ------------------------------------------------------------- messages

    async def _on_live(self, frames: list[bytes]) -> None:
        try:
            msg = parse_live(frames)
        except ProtocolError as exc:
            self._malformed(f"bad live frames: {exc}")
            return
        if not topic_matches(msg.topic, self._topic):
            return
        self._live_heard, self._live_heard_payload = msg.seq, msg.payload
        self._live_heard_restarts = self.restarts
        if self._disagreeing is not None:
            await self._while_disagreeing(msg.seq, msg.payload)
            return
        if self._has_replay and not self._unverified and self._clock() >= self._live_check_due:
            # a live check may be asked for this batch: the replay link's news first (a busy
            # stream reads it every `_LINK_EVERY` batches). A drop already seen is a restart
            # candidate, proven below before the batch is applied; asked on the DEALER's new
            # connection instead, the check may meet a new process, which gives its own batch
            self._link_due = 0
            self._replay_link()
        if self._unverified:
            # a live message proves we are connected: check before it is applied
            self._connected = True
            self._link_due = 0
            self._replay_link()  # (the link's news first: the check waits while it is away)
            if self._replay_away:
                # no proof while the replay connection is away: asked now, it would time out
                # and clear a worker that is only unreachable. Nor is the batch applied: it
                # would become the fence the proof is asked from, and a new process's batch
                # that follows on the dead run's seqs would prove itself. Skipped (the stream
                # predicts nothing meanwhile): the proof, once the connection is back, asks
                # from the old fence, and its answer brings this batch. Before, the proof was
                # asked at once, timed out, and cleared the stream; the live batches after it
                # were skipped as the dead run's and the window's end cleared it again: never
                # rebuilt (QA: 0 predicted of 288 cached, 15 s after the path healed)
                return
            if not self._owed_wait:
                await self._verify()
            # else an owed proof went unanswered (the socket connected, silent): not asked
            # at every batch (each would wait out the timeout). The batch is applied and
            # trusts nothing: the proof, asked again later, is asked from its own fence
            # (`_owed_fence`), which no live batch moves
        joining, self._joined = not self._joined, True
        prev_live = self.tracker.live
        if (
            prev_live is not None
            and msg.seq < prev_live
            and self._is_replayed(msg.seq, msg.payload)
        ):
            # a live copy of a batch a replay applied, arriving behind newer live batches (the
            # PUB queued it late, the replay ran ahead of it): the same bytes, nothing new.
            # Any other batch below the newest live seq is a restart (`SequenceTracker`)
            self._trust_replay()
            return
        if self._after_restart and self._window_over():
            self._end_window()
        if self._dead_seq is not None and await self._dead_batch(msg.seq, msg.payload):
            return
        doubt = None
        if self._collides(msg.seq):
            # the new run's next seq, where the dead runs' seqs were too: a middle process's
            # queued batch there was kept for good, the new one's own skipped as dead (QA)
            doubt = await self._window_proof(msg.seq, msg.payload)
            if doubt == DEAD:
                self._skip_collided(msg.seq)
                return
        replayed = self.tracker.replayed_from, self.tracker.replayed_to
        decision = await self._checked(self.tracker.on_live(msg.seq), msg.seq, msg.payload)
        storm: str | None = None
        unproven: str | None = None  # why nothing proved a restart shown by the seq alone
        if decision.verdict is SeqVerdict.RESTART:
            if not self._after_restart or self._window_over():
                unproven = await self._went_back(msg.seq, msg.payload, prev_live)
                if unproven == ELSEWHERE:
                    return  # not taken: nothing is while the sockets disagree
            else:
                # a restart inside the window of another: the batch that shows it may be a
                # queued batch of the run before the last, its seq now below the newest (QA:
                # two restarts within a second, the middle process's page predicted)
                storm = await self._window_proof(msg.seq, msg.payload)
                if storm == DEAD:
                    # the replay socket answered without it: not the newest process's (nor a
                    # newer one's, whose socket would give it back), a dead one's queued batch.
                    # Applied, it cleared the newest process's proven pages (QA)
                    self.dead_batches += 1
                    self._warn(
                        "stale",
                        f"live seq {msg.seq} goes back within {restarts.DEAD_RUN_S:g} s of a "
                        "restart and is not in the replay socket's buffer: a dead process's "
                        "queued batch, skipped",
                    )
                    return
            self._restarted()
            # the process before it may have left batches queued behind this one
            self._after_restart_of(prev_live, unproven=False)
            if prev_live is None and replayed[1] is not None:
                # below what a replay gave before any live batch: a new process, or a replay
                # answer that was not the publisher's buffer (a corrupt seq far ahead, which
                # would otherwise class every later live batch a duplicate): rebuilt, and the
                # replay asked again is now held to the live seq (`_MAX_AHEAD`)
                self._clear(
                    f"live seq {msg.seq} is below the batches {replayed[0]}..{replayed[1]} a "
                    "replay gave before it: the publisher restarted, or that answer was not "
                    "its buffer"
                )
            else:
                self._clear(f"seq went back to {msg.seq}: publisher restarted")
            decision = self.tracker.on_live(msg.seq)
            if storm is not None:  # applied now, or after a gap's repair below
                self._set_tainted(f"a batch that showed a second restart was applied ({storm})")
                self._warn(
                    "stale",
                    f"live seq {msg.seq} shows a second restart within {restarts.DEAD_RUN_S:g} s "
                    f"and may be a queued batch of a dead process ({storm}): applied, the stream "
                    "predicts nothing until the window after this restart ends",
                )
            elif unproven is not None and self._after_restart:
                # another publisher's batch (a forwarder re-pointed) goes back in seq too
                self._set_tainted(f"a seq going back that nothing proved a restart ({unproven})")
                self._warn(
                    "stale",
                    f"live seq {msg.seq} goes back and nothing proves its publisher restarted "
                    f"({unproven}): taken for a restart, the stream predicts nothing until the "
                    "window after it ends",
                )
        if decision.verdict is SeqVerdict.APPLY:
            if not await self._live_check(msg.seq, msg.payload):
                return  # another publisher's (the sockets disagree): not taken
            # asked before it is applied: a socket found out takes what it gave with it, and
            # this batch, the worker's own, is kept (applied to the cleared stream)
            await self._followed_on(msg.seq, msg.payload)
            await self._apply_live(msg.topic, msg.seq, msg.payload)
            if doubt is not None:
                self._set_tainted(f"a batch at a seq the dead run used too was applied ({doubt})")
            if self._tail_unproven:  # it follows on: nothing was dropped before it
                self._tail_proven(True)
            self._live_delivered(msg.seq, msg.payload)
            self._reached_end()  # (a catch-up's: the live stream carries it on)
            self._suspect = None  # (a live seq skipped before this one was not real)
            self._set_phase(StreamState.SYNCED)
        elif decision.verdict is SeqVerdict.DUPLICATE:
            self._live_delivered(msg.seq, msg.payload)
            if self._suspect is not None and msg.seq < self._suspect:
                # a live batch below the skipped seq, after it: live seqs only grow, so that
                # one was not real (the repair that skipped it had read past this batch)
                self._suspect = None
                if self._phase is StreamState.DEGRADED:
                    self._set_phase(StreamState.SYNCED)
        elif decision.verdict is SeqVerdict.GAP:
            assert decision.replay_from is not None
            await self._repair(
                decision.replay_from, msg.topic, msg.seq, msg.payload, prev_live, joining=joining
            )

    async def _apply_live(self, topic: bytes, seq: int, payload: bytes) -> None:
        """Apply a live batch; one that does not decode is fetched again (module docstring)."""
        if self._apply(topic, seq, payload, replayed=False):
            return
        if not self._has_replay:
            self._lose(seq, "no replay socket to fetch it again")
        else:
            self.refetches += 1
            # a batch is missing until its copy comes (the caller sets the phase after it)
            self._set_phase(StreamState.DEGRADED)
            self.tracker.restart_at(seq)  # the replay's copy of `seq` is the next to apply
            await self._replay(seq)
            if self.tracker.last is None or self.tracker.last < seq:
                # not brought back (timed out, or no longer buffered): lost
                self.tracker.restart_at(seq + 1)
                self._lose(seq, "the replay did not bring it again")
        self._notify_last()

    def _apply(self, topic: bytes, seq: int, payload: bytes, *, replayed: bool) -> bool:
        """Hand one batch to the sink; False when the payload does not decode."""
        now = self.health.last_event_at = self._clock()
        if self._disagreeing is not None:
            return True  # the batch that showed the disagreement: nothing is taken now
        run_start = replayed and self._run_open
        self._run_open = self._run_open and not replayed
        applied = self.sink.apply(topic, seq, payload, replayed=replayed, run_start=run_start)
        if applied is None:
            self._malformed(f"undecodable payload at seq {seq}")
            return False  # not applied: waiters hear of it once refetched or given up
        if not replayed:
            self._last_live = seq
        else:
            self._last_live = None
            if not self._replay_trusted and not self._replay_unconfirmed:
                self._replay_unconfirmed = True  # predicts nothing until the socket is proven
                self._proof_asked = False
                self._show_state()
        noted = self._noted_fences
        if not noted or now - noted[-1][0] >= _FENCE_NOTE_S:
            self._note_fence(now)
        if self.health.block_size is None:
            self.health.block_size = self.sink.block_size()  # learned from the first store
        self.batches += 1
        self.events += applied.events
        if applied.block_size_mismatches:
            self._warn(
                "block-size",
                f"BLOCK SIZE MISMATCH: {applied.block_size_mismatches} event(s) at seq {seq} "
                f"have pages that do not fit the stream's block size "
                f"{self.sink.block_size()}; they are NOT indexed and KV routing "
                f"for this worker will miss. Check the worker's page size and the configured "
                f"block_size.",
            )
        if applied.dp_rank is not None and applied.dp_rank != self.config.dp_rank:
            # engines number a rank's publisher port from the base by its rank: a batch of
            # another rank here means the ports are mapped wrong, and its prefixes would be
            # predicted on a rank the router then sends requests to in vain: the stream keeps
            # nothing while it says another rank (fail closed)
            self.rank_mismatches += 1
            self._warn(
                "dp-rank",
                f"DP RANK MISMATCH: batch {seq} says dp rank {applied.dp_rank}, this stream is "
                f"rank {self.config.dp_rank} (its events port is the rank-0 port + the rank): "
                + (
                    "its entries are dropped and nothing is predicted here"
                    if keeps_entries(self.sink)
                    else "the stream is reset (a router drops its entries here)"
                )
                + (
                    # the rank's events socket is right if its live batches say its rank:
                    # this one came through the replay socket, so that is the one mapped wrong
                    f"; it came through the replay socket {self.config.replay_endpoint}: check "
                    "the worker's `replay` endpoints (one per rank, in rank order)"
                    if replayed
                    else "; check the worker's events endpoints and dp_size"
                ),
            )
            self._clear(f"batch {seq} is dp rank {applied.dp_rank}'s, not this stream's")
        if not replayed:
            self._notify(seq)
        return True

    # ----------------------------------------------------------------- stats

    @property
    def state(self) -> StreamState:
        """What the subscriber last decided (`current_state` adds STALE, which is time)."""
        return self.health.state

    @property
    def block_size(self) -> int | None:
        """The stream's block size, None until configured or learned."""
        return self.health.block_size

    def rebind(self, sink: StreamSink) -> None:
        """Switch to another sink (a loaded snapshot's index), continuing from its seq."""
        self.sink = sink
        self._rebinds += 1
        self._replayed.clear()
        self._last_live = None
        self._answered_fence = self._owed_fence = None  # the fences of the state it replaced
        self._noted_fences.clear()
        self._proof_owed = self._owed_wait = False
        self._after_restart = False  # the run it follows now is the snapshot's
        self._dead_seq = None
        self._live_unchecked = self._live_agreed = None
        self._catch_up = None  # its proof (`_verify`) catches the loaded state up, if any
        self._rebuild_at = self._rebuild_from = None  # (a rebuild of the state it replaced)
        self._set_tainted(None)
        self.health.block_size = self._known_block_size()
        last_seq = sink.last_seq()
        self.tracker = SequenceTracker(last_seq)
        self._from_snapshot = last_seq is not None or bool(sink.entries())
        if self._from_snapshot:
            # the snapshot's state is unproven until the publisher's fence matches it
            self.suspect_restart("state loaded from a snapshot", routine=True)
        elif self._has_replay and keeps_entries(sink):
            # a stream the snapshot does not know holds none of what its worker keeps: the
            # whole buffer is read at once, `syncing` until then, as at a join. Before, it
            # read `synced`, empty, until the next probe (which took the buffer for batches a
            # deaf path had lost) or, the probe off, the worker's next batch (QA)
            self._set_phase(StreamState.SYNCING)
            self._rebuild_from = 0
            self._rebuild_at = self._clock()
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)  # (a quiet stream's poll waits for no timer)

    def current_state(self, now: float | None = None) -> StreamState:
        """The state, STALE when nothing (event or probe answer) arrived for stale_after_s."""
        return self.health.current_state(self._clock() if now is None else now)

    def stats(self) -> StreamStats:
        """A snapshot of this stream's state and counters."""
        now = self._clock()
        last_event_at = self.health.last_event_at
        age = None if last_event_at is None else now - last_event_at
        state = self.current_state(now)
        return stream_stats(
            self.stream_id,
            self.worker,
            self.config,
            self.sink.counters(),
            state=state,
            last_seq=self.tracker.last,
            block_size=self.sink.block_size(),
            entries=self.sink.entries(),
            last_event_age_s=age,
            batches=self.batches,
            events=self.events,
            gaps=self.gaps,
            restarts=self.restarts,
            decode_errors=self.decode_errors,
            verifications=self.verifications,
            rank_mismatches=self.rank_mismatches,
            clears=self._clears,
            replays=self.replays,
            probes=self.probes,
            refetches=self.refetches,
            lost_batches=self.lost_batches,
            unanswered_replays=self.unanswered_replays,
            dead_batches=self.dead_batches,
            undelivered_tails=self.undelivered_tails,
            live_checks=self.live_checks,
            rebuilds=self.rebuilds,
        )
