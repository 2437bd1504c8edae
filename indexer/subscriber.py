"""One ZMQ subscription per (worker, dp rank): live events in, gaps repaired, index updated.

The subscriber owns a SUB socket (topic prefix subscription) and, when configured, a DEALER to
the worker's replay ROUTER. Every live message goes through the `SequenceTracker`:
- APPLY: decode and apply to the index;
- GAP (a message was dropped, or we joined mid-way): ask the replay socket for everything from
  the first missing seq, apply the replies in order, then continue with live messages (those
  already covered by the replay are duplicates and skipped);
- the replay cannot cover the gap (first replayed seq later than asked), no replay endpoint, or
  the replay times out: clear the stream and rebuild from what comes next;
- RESTART (seq went backwards): asked of the replay socket first (`_went_back`): a new
  process's socket gives the batch back: clear the stream and start over from the new seq;
  one whose process still holds what it gave back before never went back: the live stream
  is another publisher's (the sockets disagree, below); no answer: a restart that predicts
  nothing until its window ends;
- a live batch that follows on is another publisher's all the same when the replay socket
  lacks it (a forwarder re-pointed at a worker whose seqs follow on): each is asked for
  before it is applied while few were asked lately, else the newest applied about once a
  second (`_live_check`, `_LIVE_CHECK_S`): lacking it while it still holds the live batch
  it gave back before (its process never restarted), the sockets disagree (below); lacking
  that too, its process may be new (a restart racing the check): a restart candidate;
- a live seq beyond everything the replay just listed cannot be real (a corrupt seq frame):
  skipped and counted, unless the next seq follows it (a publisher that buffers nothing);
  as it may have been real (an empty or stale answer), the stream predicts nothing
  (DEGRADED) until a later live batch or a probe shows which;
- a replay socket not known to be the publisher's (`StreamConfig.replay_proven`) is trusted
  only once its bytes agree with the live stream's (`_trust_replay`); what it brought
  before predicts nothing, and when it contradicts a batch applied live (a restart, or
  another worker's socket: nothing tells which) the stream is rebuilt from it as after a
  restart, predicting nothing until a live batch agrees (`_restart(unproven=True)`);
  a batch it gives that names another dp rank finds it out at once (per-rank lists swapped);
- the live stream and the replay socket disagree about the publisher (a live batch the
  socket does not give back, another batch than the one applied at a seq, a buffer that
  ends below seqs the live stream proved real, a seq going back that it shows is no
  restart, a run continuing the one before a restart two windows after it): either may be
  another worker's, so the stream is cleared and takes and predicts nothing until the
  socket gives back a live batch (`_disagree`, `_agree_check`), said in one ERROR naming
  both sockets and, by what the worker advertises, the suspect;
- after any restart, live batches that continue the run before it are the dead process's, still
  queued on our socket: skipped, unless the new process's replay socket gives them back, for
  `_DEAD_RUN_S`; one nothing proves (no socket, no answer) taints the stream (it predicts
  nothing, and is cleared when that window ends). Past it such a batch is asked for too: an
  unproven socket that showed the restart, was never confirmed by a live batch and does not
  give it back disagrees with the live stream (above); otherwise it is a late queued one
  (`_dead_batch`), the stream UNVERIFIED until a live batch follows on, and one still coming
  past a second window disagrees too; a restart found inside that window taints the stream
  the same way unless the replay socket gives back the batch that showed it
  (`_window_proof`; answered without it, the batch is a dead one's, skipped): a middle
  process's queued batch goes back in seq just as a third process would; so does, in that
  window, a batch past a gap nothing repaired (`_repair`), and a batch at the new run's next
  seq that the dead run used too (`_window_proof`);
- a payload that does not decode although its seq is intact: a gap of one batch, fetched
  again through the replay once; a copy that does not decode either clears the stream
  (a lost batch may have held removals: keeping the entries could be a false hit);
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

Epoch fence (`indexer.fence`): seqs cannot tell a restarted publisher from the old one, so
every replay that continues the stream asks from the last applied seq, not the one after
it, and the batch the publisher returns at that seq must be the one applied. A different
batch is a restart (clear, replay from 0); an answer without it proves nothing and is
treated the same (fail closed). Restart candidates make the stream UNVERIFIED (its entries
predict no hit) until such a replay proves it: the event connection dropping (a socket
monitor on the SUB sees it at once), the replay connection dropping (the DEALER, connected at
all times, has a monitor too, and a heartbeat that drops a connection whose process went
silent, also behind a hop that hides its close: events through a forwarder keep the SUB
connected while the worker restarts behind it; `_replay_link`), a replay answer that did not
come (its DEALER reset). After either of those two the proof asks from an older fence than the
newest (`_owed_fence`: a drop, from a batch applied before its process may have gone silent,
`_settled_fence`; an unanswered replay, from the last whole answer's), as a new process's batch
that followed on may have been applied before the sign was seen, and no live batch is applied
while the replay connection is away; the worker's health check coming back from down
(`suspect_restart`), and a snapshot loaded at startup. A proof whose replays all answered to
their end proves the stream's tail too (SYNCED at once); one whose replay timed out (a busy
machine) clears what it could not prove, trusts nothing it brought in part, and asks again
soon, with a short bounded back-off, until an answer ends (SYNCING while nothing is held).

Malformed frames are counted and skipped; problems are logged at most once per
`log_interval_s` per stream and kind. The task never blocks the loop: sockets are
`zmq.asyncio`, and it yields every `yield_every` messages so a flooding stream cannot starve
the others (a consumer that falls behind overflows its SUB queue, which shows up as gaps that
the replay repairs, never as silent drift).

Sink (`indexer.sink`): every message the subscriber accepts, live or replayed, goes to its
`StreamSink` in the order it is accepted, malformed payloads included (frames whose seq cannot
be read are not messages and are not passed on): an `IndexSink` applies it to the index, a
`RecordingSink` writes it to a recording (`kvroute record`). The sink must not block.

Longer than the house's ~500 lines on purpose: sequence tracking, the epoch fence, refetches
and restart candidates are one state machine over one stream, read in the order they act; the
socket work that is not a decision lives in `indexer.replay_client` and `indexer.sink`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.config import IndexerConfig, StreamConfig, shown_endpoint
from indexer.errors import ProtocolError, ReplayError
from indexer.fence import BatchFence
from indexer.health import StreamHealth
from indexer.log_throttle import LogThrottle
from indexer.protocol.decode import batch_dp_rank, decode_batch
from indexer.protocol.frames import (
    ReplayData,
    parse_live,
    topic_matches,
)
from indexer.replay_client import ReplayClient, silence_bound_s
from indexer.sequence import SeqDecision, SequenceTracker, SeqVerdict
from indexer.sink import StreamSink, keeps_entries
from indexer.stats import StreamState, StreamStats, stream_stats

__all__ = ["StreamSubscriber"]

log = logging.getLogger(__name__)

# what the SUB's monitor reports: a connection made (handshake done) or lost
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# the furthest a replay answer may start beyond the newest seq the live stream has shown: a
# publisher does not publish a million batches between two of our messages (a corrupt seq, or
# a foreign socket, would otherwise carry the stream past every real seq to come)
_MAX_AHEAD = 1 << 20
# replayed batches remembered by seq, to check the live copies that arrive after them
_REPLAYED_KEPT = 4096
# kinds of session failure logged with their traceback; more (a session failing anew each
# time) are said in one line each
_TRACED_FAILURES = 8
# a restart's rebuild whose replay did not answer to its end is asked again after this wait,
# doubling up to the cap (or the probe interval, when shorter): the stream holds nothing of the
# new process, or an unproven part, so asking often stalls nothing worth protecting, while the
# probe's back-off (to 60 s) would leave a quiet worker's new cache unpredicted for that long
_RETRY_FIRST_MS = 100
_RETRY_MAX_MS = 2_000
# how long after a restart is found batches of the process before it may still arrive: what
# was queued on our socket when it died (thousands of batches of a busy worker), read at the
# stream's pace. Within it a live batch that continues the old run and is not the new
# process's is skipped; past it, one is no queued batch: a replay socket that showed the
# restart and was never confirmed by a live batch since is another worker's (`_dead_batch`)
_DEAD_RUN_S = 5.0
_DEAD = "dead"  # `_window_proof`'s answer for a batch the replay socket answered without
# digests kept of one replay answer in that window (a buffer's worth: SGLang keeps 10,000
# batches by default)
_WINDOW_COPIES = 16384


# live messages read between two looks at the replay DEALER's monitor while the SUB has more
# queued (`_replay_link`; every time after an idle wait): a restart takes far longer than
# reading these, and a look costs a microsecond or two
_LINK_EVERY = 32
# while a stream's event and replay sockets disagree (`_disagree`), a live batch is asked
# of the replay socket at most this often as batches come (an answer from a seq far below its
# newest is its whole buffer); a quiet stream asks for its newest at each probe
_AGREE_EVERY_S = 1.0
# A replay connection's drop comes up to `silence_bound_s` (1.25 x `replay_timeout_s`) after
# its process went silent (the DEALER's heartbeat), and is read by the loop a little later
# still (a look every `_LINK_EVERY` messages; a stall past `loop_watch.STALL_S` suspects every
# stream anyway), libzmq's timers a little late on a loaded host: a batch applied longer than
# the bound plus this slack before the drop was read came before the process went silent, so
# it is one of that process's (`_settled_fence`)
_SETTLE_SLACK_S = 1.0
# how often the fence is noted with its time for that (one note per interval, not per batch)
_FENCE_NOTE_S = 0.1
# a live batch applied is asked of the replay socket (`_live_check`): before it is applied
# while fewer than `_LIVE_CHECK_BURST` were asked for in the last `_LIVE_CHECK_BURST` x
# `_LIVE_CHECK_S` (a stream that publishes now and then: each batch), else at most once per
# `_LIVE_CHECK_S` on average, the newest applied since being asked for when that is due. Its
# publisher buffers what it sends before it answers, so another batch at that seq, or none,
# means the live stream is another publisher's: a forwarder re-pointed at a worker whose seqs
# follow on this one's, which no seq shows. So such a stream predicts the other worker's
# cache for less than `_LIVE_CHECK_S`, if at all. A busy stream pays a round trip a second
# (an answer from the seq asked for to the publisher's newest: a few batches, unless the
# router lags); an unanswered one is asked again after a back-off, doubling to the cap
_LIVE_CHECK_S = 1.0
_LIVE_CHECK_BURST = 4
_LIVE_CHECK_MAX_S = 60.0
# `_went_back`'s answer for a live seq going back that the replay socket shows is no restart
# (the two sockets disagree: `_disagree` was called)
_ELSEWHERE = "elsewhere"

_SKIP = SeqDecision(SeqVerdict.DUPLICATE)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


def _undecodable(payload: bytes) -> bool:
    """Whether `payload` is no batch at all: garbage on the wire, never another publisher's
    batch (a publisher sends batches), so it says nothing about which publisher is heard."""
    try:
        decode_batch(payload)
    except ProtocolError:
        return True
    return False


class _Continuity(enum.Enum):
    """What a continuing replay (asked from the last applied seq) said about the epoch."""

    NONE = "none"  # not a continuing replay, or no batch came back
    PROVEN = "proven"  # the batch at our last seq is the one we applied
    BROKEN = "broken"  # a different batch at that seq: the publisher restarted
    UNPROVEN = "unproven"  # the answer started after our last seq: nothing proves it


class _CatchUp(enum.Enum):
    """How far a stream rebuilt from its publisher's replay buffer is (`_catch_up`)."""

    # reading the buffer: what the stream holds is the publisher's past (pages stored early in
    # it and evicted later are held until the batch that evicts them is read)
    READING = "reading"
    # the answer ended, or a live batch followed on what it gave: the live batches queued on
    # the SUB meanwhile are the last of the past, applied once the loop reads them
    DRAINING = "draining"


class _Copy(NamedTuple):
    """What the replay socket gave when asked from one seq (`_replay_at`)."""

    answered: bool  # it answered to its end marker
    payload: bytes | None  # its batch at the seq asked about (None: none, or no answer)
    first: int | None  # the first seq it gave (None: none)
    newest: int | None  # the newest seq it gave (None: none)
    anchor: bytes | None = None  # its batch at the anchor seq asked about too (None: none)


class _ReplayResult(NamedTuple):
    answered: bool  # the publisher answered to the end marker
    newest: int | None  # the newest seq it sent (None: none)
    continuity: _Continuity


class StreamSubscriber:
    """Subscribes to one stream and keeps its part of the index in sync; `run` is its task."""

    def __init__(
        self,
        stream_id: str,
        worker: str,
        config: StreamConfig,
        sink: StreamSink,
        ctx: zmq.asyncio.Context,
        settings: IndexerConfig | None = None,
        *,
        on_applied: Callable[[str, int], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
        on_state: Callable[[str, StreamState], None] | None = None,
        on_siblings: Callable[[StreamSubscriber, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream_id = stream_id
        self.worker = worker
        self.config = config
        self.sink = sink
        self.settings = settings or IndexerConfig()
        self._ctx = ctx
        self._on_applied = on_applied
        self._on_restart = on_restart  # told the worker when its publisher restarted
        # told this subscriber and the sign when it found its publisher restarted on evidence
        # of its own (not a check a sibling rank's restart asked for), or its event connection
        # dropped: the ranks of one server restart together, so the worker's other streams are
        # to be suspected (`Subscriptions`)
        self._on_siblings = on_siblings
        # told the stream and its new state whenever it changes (a relay republishes it)
        self._on_state = on_state
        self._clock = clock
        self._topic = config.topic.encode()
        self._limiter = LogThrottle(self.settings.log_interval_s, clock=clock)  # by kind
        self._failures_traced: set[str] = set()  # the session failures logged with traceback
        self._replayer: ReplayClient | None = None  # the replay socket, made on first use
        self._suspect: int | None = None  # a live seq skipped as corrupt (see _repair)
        # a counted replay run (a repair, a probe) has begun and applied nothing yet: its first
        # batch tells the sink so (a recording keeps the mark; see `Record.run_start`)
        self._run_open = False
        # an idle probe's replay is being read: a batch it applies is one the live stream never
        # delivered (a tail dropped with the connection up), the past (`_take_reply`)
        self._probing = False
        # Until the SUB delivers its first message we are joining: what replay brings then
        # (the catch-up probe, or a repair of what the SUB missed while it connected) is the
        # worker's history, not a gap.
        self._joined = False
        self.tracker = SequenceTracker(sink.last_seq())
        # a restart candidate is pending: entries predict nothing until a replay proves them
        self._unverified = self.tracker.last is not None or bool(sink.entries())
        self._why_unverified = "state from a snapshot"
        # the pending check was asked for by a sibling rank's restart only: a restart it finds
        # is that one, which the siblings were told of (telling them again would suspect the
        # rank that found it; without a replay socket each suspicion clears, back and forth)
        self._by_sibling = False
        # the state came from a snapshot and its proof is still to come: its outcome is logged
        # once, unlimited (`_loaded_outcome`), since an operator who loaded it asks about it
        self._from_snapshot = self._unverified
        # a quiet stream whose probe went unanswered: batches the PUB dropped at its tail would
        # go unnoticed, so its entries predict nothing until a probe answers or the next live
        # batch follows on (fail closed; the entries are kept)
        self._tail_unproven = False
        # the wait before asking a replay socket again for a restart's rebuild that did not
        # answer to its end (None: no rebuild pending); cleared once the tail is proven
        self._retry_ms: int | None = None
        # the replay socket answered with a buffer that ends below seqs the live stream has
        # proven real: it is not this publisher's (another worker's, by a config typo). What
        # it gave is cleared and it is never asked again: gaps clear, as without one
        self._replay_foreign = False
        # whether the replay socket is known to be this stream's publisher's: said by the
        # config (`StreamConfig.replay_proven`: the worker advertises it), or proven by its
        # bytes (`_trust_replay`): a batch it gave is the one the live stream delivered, or
        # it gives back a batch applied live. Seqs alone prove nothing: another worker's
        # buffer ending at seq n is "followed on" by this worker's live seq n + 1
        self._replay_trusted = config.replay_proven
        # what a replay socket not trusted yet brought predicts nothing until it is proven
        # (`_confirm`), and a live batch that follows on it asks it for that batch (once)
        self._replay_unconfirmed = False
        self._proof_asked = False
        # the seq of the last batch applied from the live stream (None: the last one came
        # through a replay, or none since a clear): a replay's bytes at it prove the socket
        self._last_live: int | None = None
        # a restart was found less than `_DEAD_RUN_S` ago: live batches that continue the run
        # before it (seqs beyond `_dead_seq`) and are not the new process's are the dead
        # one's, still queued on our socket (`_dead_batch`; also `_checked`, `_repair`)
        self._after_restart = False
        self._dead_seq: int | None = None  # the newest seq of that run seen live
        # why the stream holds a batch applied in that window that nothing proved the new
        # process's (None: it does not): it predicts nothing, and is cleared at the window's end
        self._tainted: str | None = None
        self._reopened = False  # a late batch of the old run opened the window once more
        self._restart_found_at = 0.0
        # that restart was found by a replay socket not proven the publisher's: a run before
        # it that still comes past `_DEAD_RUN_S`, no live batch having confirmed the socket,
        # is no dead queue but this worker's own stream, and the socket another worker's
        self._restart_unproven = False
        # the digests of the batches replays applied, by seq (the newest `_REPLAYED_KEPT`): a
        # live copy that arrives after its replayed one must be the same batch, or the replay
        # socket is not this publisher's (or the publisher restarted): see `_live_disagrees`
        self._replayed: OrderedDict[int, bytes] = OrderedDict()
        # in the window after a restart: digests of the batches the new process's replay
        # socket gave back when last asked (its buffer from the seq asked for on), so a burst
        # of its live batches is proven by one answer, not one round trip each (`_dead_batch`)
        self._window_copies: dict[int, bytes] = {}
        # bumped by `rebind`: a check that awaited across it judged the sink it replaced
        self._rebinds = 0
        # the stream is being rebuilt from the replay buffer (a join, a restart's rebuild, a
        # clear mid-answer, a proof): it predicts nothing (SYNCING) until it reached the
        # present, its answer read to its end (or the live stream followed on) and the live
        # batches queued meanwhile applied. Before, SYNCING was trusted and each state of the
        # buffer was predicted as it was read: a page stored early and evicted later in it
        # was a false hit (QA: 288 tokens matched, 0 cached) for as long as the reading took
        self._catch_up: _CatchUp | None = None
        # the catch-up's answer that ended it was asked before the SUB was connected: batches
        # published after it and before the connection were never delivered (a PUB drops for a
        # subscriber not connected yet), so once connected the replay is read once more
        # (`_hear_end`) before the catch-up ends. Before, it ended at the connect: a flush in
        # that window was predicted until the next probe (QA: 288 tokens matched, 0 cached)
        self._end_unheard = False
        # an idle probe, asked with the SUB connected and the stream caught up, found batches
        # the SUB never delivered: the live path may be deaf (a forwarder that lost its
        # upstream, a hop swallowing bytes, the connection up), so the stream predicts nothing
        # (UNVERIFIED) until a live batch follows on what it holds (`_found_undelivered`).
        # Before, it was trusted again once the probe's batches were applied: each eviction
        # since was a false hit until the next probe, for good (QA: 4 of 4 rounds, 2 s each).
        # Also set by a batch continuing the run before a restart past its window, which the
        # replay socket does not give back (`_dead_batch`): the live path may be another's
        self._live_unproven = False
        self._wake: asyncio.Future[None] | None = None  # resolves when a check is requested
        self._connected = False  # the SUB's connection is up (per its monitor)
        # the replay DEALER's connection dropped and has not come back (`_replay_link`): a
        # proof waits for it, as one waits for the SUB's
        self._replay_lost = False
        # the stream's fence when a replay answer last came to its end: what the publisher was
        # last proven to hold (None: nothing since the stream was cleared or started)
        self._answered_fence: BatchFence | None = None
        # the stream's fence, noted with the time it was applied at most every `_FENCE_NOTE_S`
        # and one kept older than a drop's bound (`_settled_fence`), oldest first
        self._noted_fences: deque[tuple[float, BatchFence]] = deque()
        # a replay answer did not come, or the replay connection dropped (`_replay_link`): the
        # publisher may have restarted unseen at any time since the last answer, and a live
        # batch of the new process that followed on in seq may be the stream's newest batch,
        # which it would prove. So the proof owed asks from this fence, the last answered
        # one, not the newest (None: no such proof is owed). Before, it asked from the
        # newest: through a TCP hop that hid the restart, the new process's batch proved
        # itself (QA: 288 tokens, 0 cached)
        self._owed_fence: BatchFence | None = None
        self._proof_owed = False  # (set with `_owed_fence`, cleared by a proof or a clear)
        # that owed proof went unanswered too (the worker still slow, or away): nothing is
        # cleared for it (the stream predicts nothing meanwhile), and it is asked again at the
        # probe's back-off, or on a new sign (`suspect_restart`), not at every loop pass
        self._owed_wait = False
        # the poller the DEALER's monitor is registered with, and that monitor (`_idle`)
        self._link_polled: tuple[zmq.asyncio.Poller, zmq.asyncio.Socket] | None = None
        self._link_due = 0  # loop passes until the next look at it (`_LINK_EVERY`)
        # why the event and replay sockets disagree about the publisher (`_disagree`; None:
        # they do not): the stream holds and predicts nothing until they agree
        self._disagreeing: str | None = None
        self._agree_asked_at: float | None = None  # when a live batch was last asked for
        self._disagree_last: tuple[int, bytes] | None = None  # the newest live batch since
        # the newest live batch applied and not yet asked of the replay socket, and when the
        # next may be asked (`_live_check`): a live stream whose batches follow on in seq may
        # be another publisher's all the same (a forwarder re-pointed), which only the replay
        # socket's bytes show. Before, nothing asked while batches came: that worker's
        # prompts were predicted here for good (QA: 1,960 false hits in 15 s)
        self._live_unchecked: tuple[int, bytes, BatchFence | None] | None = None
        # the newest live batch the replay socket gave back (seq, digest): while its answers
        # still hold it, its process is the one the stream followed (it never restarted), so a
        # live batch it lacks is another publisher's; one that no longer holds it is a new
        # process (`_anchor_held`). None: none since the stream began, restarted or disagreed
        self._live_agreed: tuple[int, bytes] | None = None
        # the checks' schedule (a generic cell rate: due once the clock is past this less
        # the burst allowance) and the back-off after one that was not answered
        self._live_check_at = 0.0
        self._live_check_wait_s = _LIVE_CHECK_S
        # the replay socket has given a batch: it buffers, so an answer without the seq asked
        # about means it lacks it (one that never gave any may buffer nothing: it proves
        # nothing either way)
        self._replay_buffers = False
        # SYNCED while it holds nothing: nothing of the past to distrust, and the router's
        # pending marks on it count. A stream that will read its replay buffer at once (the
        # catch-up probe at connect) is SYNCING from the start, so nothing reads it caught up
        # before it is; one without (no replay socket, or the probe off) catches up, if ever,
        # when its first live batch shows a gap (`_replay`)
        self._phase = StreamState.SYNCED
        if not self._unverified and self._probes_at_connect:
            self._catch_up = _CatchUp.READING
        # what the per-worker answers read (indexer.worker_matches): state, heard-at times
        self.health = StreamHealth(
            stream_id,
            started_at=clock(),
            stale_after_s=self.settings.stale_after_s,
            block_size=self._known_block_size(),
            state=StreamState.UNVERIFIED
            if self._unverified
            else StreamState.SYNCING
            if self._catch_up is not None
            else StreamState.SYNCED,
            dp_rank=config.dp_rank,
        )
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.replays = 0
        self.restarts = 0
        self.decode_errors = 0
        self.probes = 0
        self.refetches = 0
        self.lost_batches = 0
        # replay requests whose answer never came to its end (timed out, or proved nothing):
        # counted apart from the rate-limited warnings, which show one a `log_interval_s`
        self.unanswered_replays = 0
        self.verifications = 0
        self.rank_mismatches = 0  # batches that said another dp rank than the stream's
        self.dead_batches = 0  # live batches of a restarted publisher's dead process, skipped
        self.undelivered_tails = 0  # idle probes that found batches the connected SUB missed
        self.live_checks = 0  # live batches asked of the replay socket (`_live_check`)
        self._clears = 0  # for sinks that keep no counters of their own
        self._probe_wait_ms = int(self.settings.probe_interval_s * 1000)

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
        # first sign of a restart (see the module docstring)
        monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        sub.connect(self.config.endpoint)  # non-blocking: zmq connects and reconnects itself
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
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
                # The async poll costs a poller, futures and a timer: only pay for it when
                # nothing is queued (a busy stream then reads at the probe-free rate).
                if not cast(int, sub.get(zmq.EVENTS)) & zmq.POLLIN:
                    if self._catch_up is _CatchUp.DRAINING and self._connected:
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
                        elif probing or retrying:
                            await self._probe()
                    continue
                frames = await sub.recv_multipart()
                await self._on_live(frames)
                handled += 1
                if handled % self.settings.yield_every == 0:
                    await asyncio.sleep(0)
        finally:
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

    def _replay_link(self) -> bool:
        """Take what the replay DEALER's monitor says (True: it said something).

        The DEALER is connected to the publisher's process itself, where the SUB may hear it
        through a forwarder that stays connected while the process restarts behind it: its
        connection dropping is a restart candidate, as the SUB's is (`_on_monitor`). Before,
        a restart behind a forwarder was found only by a later batch or probe, and never when
        the new process's first batches were lost and its next one followed on the dead run's
        last seq: that batch became the fence every later probe proved (QA: the dead
        process's 288 tokens predicted for good, 0 cached)."""
        if not self._has_replay:
            return False
        if self._link_due > 0:
            self._link_due -= 1
            return False
        self._link_due = _LINK_EVERY
        client = self._replay_client()
        client.connect()  # connected at all times: a process that ends drops it
        news = client.link()
        if news is None:
            return False
        broke = news.dropped
        if news.dropped:
            self.suspect_restart("the replay connection dropped")
            if self._on_siblings is not None:
                self._on_siblings(self, "dropped its replay connection")
        elif news.unanswered and self._answered_fence is not None and not self._proof_owed:
            # the DEALER was reset for an answer that never came: its new connection may never
            # be made with a hung process, or be made with a new one through a hop that kept
            # our side open, so no drop would tell of a restart meanwhile. Before, a probe's
            # timeout only left the tail unproven, and the next live batch that followed on
            # in seq trusted it again: a worker killed and restarted while hung, its first
            # batches lost behind a forwarder, had its dead cache predicted for good (QA: 288
            # tokens matched, 0 cached). Its siblings are not suspected: each asks its own.
            # Only once the socket answered whole since the stream's state began: one that
            # never did (silent, or not this stream's) proves nothing to go back to, and the
            # stream runs on its live batches as before (a gap it cannot repair clears). The
            # owed proof's own timeouts are no news
            self.suspect_restart("a replay answer did not come (its connection was reset)")
            broke = True
        if broke and self._unverified and not self._proof_owed:
            # A drop may be seen late: through a hop that hides the process's close, only the
            # heartbeat finds it, up to 1.25 x `replay_timeout_s` after the process went
            # silent, and a new process's batch that followed on the dead run's seqs may have
            # been applied meanwhile: proven from the newest fence, it gives itself back. So
            # the proof asks from a fence applied before the process may have gone silent
            # (`_settled_fence`: a busy stream re-proves its last seconds, not everything since
            # its last whole answer, which its buffer may no longer hold), else from the last
            # answered one. Before, a drop's proof asked from the newest batch (QA v3/v13 with
            # the heartbeat: the dead process's 288 tokens proven, for good)
            fence = self._settled_fence() if news.dropped else None
            fence = fence or self._answered_fence
            self._proof_owed = fence is not None
            self._owed_fence = fence
        # the proof is asked once it is back: asked before, it waits on a socket that is
        # down, times out and clears a worker that was only unreachable a moment
        self._replay_lost = not news.up and (
            self._replay_lost or news.dropped or (news.unanswered and self._proof_owed)
        )
        return True

    @property
    def _replay_away(self) -> bool:
        """Whether a proof waits for the replay DEALER's connection to come back."""
        return self._replay_lost and self._has_replay

    def _poll_link(self, poller: zmq.asyncio.Poller) -> None:
        """Keep the replay DEALER's monitor in `poller`, so that its news wakes an idle
        stream: the DEALER (and its monitor) is a new socket after each reset."""
        replayer = self._replayer if self._has_replay else None
        monitor = replayer.link_socket if replayer is not None else None
        polled = self._link_polled
        if polled is not None and polled[0] is poller:
            if polled[1] is monitor:
                return
            poller.unregister(polled[1])
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        self._link_polled = None if monitor is None else (poller, monitor)

    def suspect_restart(self, why: str, *, sibling: bool = False) -> None:
        """A sign that the publisher may have restarted: trust nothing until a replay proves it.

        The stream turns UNVERIFIED at once (its entries predict no hit) and is checked against
        its fence as soon as it is connected (module docstring). `sibling`: the sign is that
        another rank of the worker found its own publisher restarted.
        """
        if self.tracker.last is None and not self.sink.entries():
            return  # nothing held, nothing to prove
        if not self._unverified:
            self._warn(
                "suspect",
                f"{why}: its entries predict nothing until a replay proves them"
                if keeps_entries(self.sink)
                else f"{why}: checking through the replay socket whether its publisher restarted",
            )
            self._by_sibling = sibling
        else:
            self._by_sibling = self._by_sibling and sibling  # a sign of its own counts
        self._unverified = True
        self._why_unverified = why
        self._owed_wait = False  # a new sign: an owed proof is asked now
        self._enter(StreamState.UNVERIFIED)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _verify(self) -> None:
        """Prove that the publisher is the process our state follows, or rebuild the stream.

        A proof whose replays all answered to their end proves the stream's tail too: it is
        trusted whole, and probed at the base interval again. One that did not (a replay timed
        out) leaves the stream cleared, rebuilt in part, or proven without its newest batches:
        what it holds predicts nothing and the replay socket is asked again soon
        (`_retry_soon`), never trusted on the strength of an answer that did not come.
        """
        self.verifications += 1
        last = self.tracker.last
        why = self._why_unverified
        rebinds = self._rebinds
        if last is None:
            if not self.sink.entries():
                self._trust()
                return
            # entries no seq stands for (a snapshot without one, a `replay --from` dump's
            # part of a stream): nothing can prove them
            self._clear(
                f"{why}, with entries but no seq to prove them by",
                outcome="it has entries but no seq to prove them by",
            )
            await self._rebuild(rebinds)
            return
        if not self._has_replay:
            self._restart(
                f"{why} and without a replay socket nothing proves it did not restart",
                outcome="no replay socket to prove it by",
            )
            self._trust()  # `synced`: a restarted process holds nothing either
            return
        restarts = self.restarts
        owed = self._owed_fence
        if owed is not None and owed.seq < last:
            last = owed.seq  # (a proof owed for a broken replay link: see `_owed_fence`)
        result = await self._replay(last)
        answered = result.answered  # (a restart found by the fence: its rebuild's answer)
        if (
            self._proof_owed
            and not result.answered
            and self.restarts == restarts
            and self._rebinds == rebinds
        ):
            self._owe_again()
            return
        if result.continuity is _Continuity.NONE:
            if result.answered and result.newest is None:
                # the publisher's seqs may have gone back
                rebuilt = await self._check_restart(last)
                answered = answered if rebuilt is None else rebuilt
            if self._rebinds != rebinds:
                return  # another sink's state now: its own check follows
            if self.restarts == restarts:
                # no answer, or nothing at or after our seq and no older verdict: unproven
                detail = (
                    f"its replay from seq {last} did not answer to its end"
                    if not result.answered
                    else f"its replay holds nothing at or after seq {last}"
                )
                self._restart(
                    f"{why}, and {detail}: nothing proves the publisher unchanged",
                    outcome=detail,
                )
                # a socket that just timed out is asked again after a wait, not at once
                answered = result.answered and (await self._replay(0)).answered
        if self._rebinds != rebinds:
            return  # a snapshot loaded meanwhile: what was proven was the sink it replaced
        if self.restarts == restarts and result.continuity is _Continuity.PROVEN:
            self._loaded_outcome(f"proven at seq {last}: {self.sink.entries()} entries")
        # else the clear that dropped the snapshot's state said why (`_clear`)
        self._trust()
        if answered:
            self._heard_whole()
        else:
            self._retry_soon()
        self._notify_last()

    async def _rebuild(self, rebinds: int) -> None:
        """The stream's entries were cleared while the worker still holds its cache (no seq
        proves them): `syncing` until its replay's answer from 0, or its next live batch
        without a replay socket, is applied, as at a join. Before, it read `synced` with 0
        entries and no seq until the next probe rebuilt it, seconds later (the streams of a
        partial dump, `kvroute replay --from`)."""
        self._set_phase(StreamState.SYNCING)
        self._trust()
        if not self._has_replay:
            return
        answered = (await self._replay(0)).answered
        if self._rebinds != rebinds:
            return  # a snapshot loaded meanwhile: its own check follows
        if answered:
            self._heard_whole()
        else:
            self._retry_soon()
        self._notify_last()

    def _loaded_outcome(self, outcome: str) -> None:
        """Say once what became of a snapshot's state (not rate-limited: once per load): proven
        here, or cleared (`_clear`, with the reason of the clear that dropped it, whichever
        path found it: a proof, a probe that found the seqs gone back, a gap)."""
        if self._from_snapshot:
            self._from_snapshot = False
            log.info("stream %s: state loaded from a snapshot %s", self.stream_id, outcome)

    @property
    def proves_restarts(self) -> bool:
        """Whether a suspected restart is proven through a replay socket (else it clears)."""
        return self._has_replay

    @property
    def _probes_at_connect(self) -> bool:
        """Whether a session starts by reading the replay socket (and probes it when quiet)."""
        return self.config.replay_endpoint is not None and self.settings.probe_interval_s > 0

    @property
    def _has_replay(self) -> bool:
        """A replay socket to ask (configured, and not found to be another publisher's)."""
        return self.config.replay_endpoint is not None and not self._replay_foreign

    def _owe_again(self) -> None:
        """The proof owed for an unanswered replay went unanswered too: a worker still slow
        (or hung, or away) is not cleared for it, as it would be on a proof that found
        something. What it holds predicts nothing (`unverified`), and the proof is asked again
        at the probe's back-off (or soon, without the probe), from the same fence."""
        self._owed_wait = True
        if self._probes_at_connect:
            base_ms = int(self.settings.probe_interval_s * 1000)
            self._probe_wait_ms = min(self._probe_wait_ms * 2, max(base_ms, 60_000))
            self._tail_proven(False)
        else:
            self._retry_soon()

    def _trust(self) -> None:
        self._owed_fence = None  # proven (or cleared): nothing is owed
        self._proof_owed = self._owed_wait = False
        if self._unverified:
            self._unverified = False
            self._by_sibling = False
            self._show_state()

    def _set_phase(self, phase: StreamState) -> None:
        self._phase = phase
        self._show_state()

    def _trust_replay(self) -> None:
        """The replay socket gave (or gives back) a batch the live stream delivered, byte for
        byte: it is this publisher's, and what it brought is the stream's."""
        self._replay_trusted = True
        if self._replay_unconfirmed:
            self._replay_unconfirmed = False
            self._show_state()

    async def _followed_on(self, seq: int, payload: bytes) -> None:
        """Live batch `seq` follows on what a replay socket not yet trusted brought:
        following on in seq proves nothing (another worker's buffer ending at `seq` - 1 is
        followed on too), so the socket is asked for `seq` once: a publisher buffers what it
        sent, so its own socket gives this very batch back."""
        if not self._replay_unconfirmed or self._proof_asked or not self._has_replay:
            return
        self._proof_asked = True
        answered, copy = await self._replayed_copy(seq)
        if copy is not None and _digest(copy) == _digest(payload):
            self._trust_replay()
        elif answered:
            self._disagree(
                f"live batch {seq} is not in what the replay socket gives back at that seq"
                if copy is None
                else f"the replay socket gives another batch than live batch {seq} at that seq"
            )
        # no usable answer: still unconfirmed; a probe's fence at a batch applied live, or a
        # live copy of a batch it gave, proves it later

    def _found_foreign(self, why: str, *, keep: bool = False) -> None:
        """The replay socket is not this publisher's: the stream is cleared (unless `keep`:
        it holds nothing the socket gave), the socket is not asked again, and the stream goes
        on as one without a replay socket (live batches only, a gap clears it): no probe, so
        no tail left unproven and no rebuild pending."""
        self._replay_foreign = True
        self._suspect = None
        self._end_window()  # a stream tainted in it is cleared now, not left predicting nothing
        self._dead_seq = None
        log.error(
            "stream %s: the replay socket %s is another publisher's (%s; check `replay` in the "
            "config): it is not asked again, and %s; the stream goes on from the live "
            "batches, and a gap clears it",
            self.stream_id,
            self.config.replay_endpoint,
            why,
            "the stream holds nothing it gave: its live batches are kept"
            if keep
            else "what it gave is cleared (with any live batch applied on top of it: they "
            "cannot be told apart)",
        )
        if not keep:
            self._clear(
                "the replay socket is another publisher's: what it gave, and any live batch "
                "applied on top of it"
            )
        self._tail_proven(True)  # nothing to ask about the tail: as without a replay socket
        self._live_unproven = False  # the tails it showed are no evidence: it is another's
        self._catch_up = None  # what it gave is gone, or it gave nothing: no past is held
        if self.tracker.last is not None:
            self._set_phase(StreamState.SYNCED)
        else:
            self._show_state()

    def _disagree(self, why: str) -> None:
        """The event socket and the replay socket disagree about the publisher (`why`): one
        of them, or both, reach another publisher than this worker's (a typo in `events` or
        `replay`, a forwarder or proxy re-pointed, ports mapped to another worker), and the
        bytes cannot tell which. The stream is cleared and takes and predicts nothing
        (UNVERIFIED) until they agree (`_while_disagreeing`, `_agree_check`); the replay
        socket is asked for nothing else meanwhile (no repair; a probe asks for the newest
        live batch instead). Before, the replay socket was taken for the wrong one (an ERROR
        said so) and the stream went on from the live batches: with the events on another
        worker's PUB, that worker's cache was predicted here for good (QA: 288 tokens, 0
        cached)."""
        self._disagreeing = why
        self._agree_asked_at = None  # the next live batch is asked for at once
        self._disagree_last = None
        self._live_unchecked = None  # (each live batch is asked for until they agree)
        self._live_agreed = None
        self._suspect = None
        self._end_window()
        self._dead_seq = None
        log.error(
            "stream %s: its event socket %s and its replay socket %s disagree about the "
            "publisher (%s): either may reach another publisher than this worker's, or both "
            "(a typo in `events` or `replay`, a forwarder or proxy re-pointed, ports mapped "
            "to another worker); %s. The stream is cleared and predicts nothing until they "
            "agree (a live batch the replay socket gives back)",
            self.stream_id,
            shown_endpoint(self.config.endpoint),
            shown_endpoint(self.config.replay_endpoint or ""),
            why,
            self._which_disagrees(),
        )
        if self.tracker.last is not None or self.sink.entries():
            self._clear("its event and replay sockets disagree about the publisher")
        self.tracker.reset()
        self.sink.forget_seq()
        self._last_live = None
        self._replayed.clear()
        self._trust()  # nothing is held to prove
        self._tail_proven(True)
        self._retry_ms = None
        self._catch_up = None
        # nothing is held: rebuilt as at a join once they agree (`_agree_check`). A DEGRADED
        # phase left by a skipped seq (`_suspect`, dropped above) outlived it before: the
        # rebuild's live batches were all duplicates, and the stream never left DEGRADED
        self._phase = StreamState.SYNCING
        self._show_state()

    def _which_disagrees(self) -> str:
        """Which of the two sockets the worker's advertised ones point at (`_disagree`)."""
        cfg = self.config
        events, replay = cfg.advertised_endpoint, cfg.advertised_replay
        if events is None:
            return "the worker advertises no sockets to tell which"
        right_events = events == cfg.endpoint
        right_replay = replay is not None and replay == cfg.replay_endpoint
        if right_events and right_replay:
            return (
                "both are the sockets the worker advertises: something on the way to one "
                "of them (a forwarder, a proxy, a port mapping) reaches another publisher"
            )
        if right_replay:
            return (
                "the replay socket is the one the worker advertises and the event socket is "
                f"not (it advertises {shown_endpoint(events)}): check `events`, or the "
                "forwarder in front of it"
            )
        if right_events:
            return (
                "the event socket is the one the worker advertises and the replay socket is "
                f"not (it advertises {shown_endpoint(replay or 'none')}): check `replay`"
            )
        return (
            f"neither is what the worker advertises ({shown_endpoint(events)}, "
            f"{shown_endpoint(replay or 'no replay socket')}): check both, unless ports are "
            "mapped on the way"
        )

    async def _while_disagreeing(self, seq: int, payload: bytes) -> None:
        """A live batch while the sockets disagree (`_disagree`): not taken, but kept as the
        newest to ask the replay socket for (`_agree_check`); garbage is skipped and counted
        (no replay socket gives it back: asked for, it would only delay their agreement)."""
        self.health.last_event_at = self._clock()  # heard from, though nothing is taken
        if _undecodable(payload):
            self._malformed(f"undecodable payload at live seq {seq}: skipped")
            return
        self._disagree_last = (seq, payload)
        await self._agree_check()

    async def _agree_check(self) -> None:
        """Ask the replay socket for the newest live batch seen while the sockets disagree
        and not asked for yet, unless one was asked for less than `_AGREE_EVERY_S` ago (a
        probe asks for one that came meanwhile): giving it back byte for byte is their
        agreement (the live stream's publisher is the replay socket's), and the stream is
        rebuilt from that buffer, as at a join (SYNCING until caught up)."""
        newest = self._disagree_last
        asked = self._agree_asked_at
        if self._disagreeing is None or newest is None:
            return
        if asked is not None and self._clock() - asked < _AGREE_EVERY_S:
            return
        self._agree_asked_at = self._clock()
        self._disagree_last = None
        seq, payload = newest
        _, copy = await self._replayed_copy(seq)
        if self._disagreeing is None or copy is None or _digest(copy) != _digest(payload):
            return
        log.warning(
            "stream %s: its event and replay sockets agree again (live batch %d is the one the "
            "replay socket gives): rebuilt from the replay socket",
            self.stream_id,
            seq,
        )
        self._disagreeing = None
        self._disagree_last = None
        self._live_unproven = False  # a live batch it gives back: the live path is its own
        self._trust_replay()
        self.tracker.reset()
        answered = (await self._replay(0)).answered
        if answered:
            self._heard_whole()
        else:
            self._retry_soon()
        self._show_state()
        self._notify_last()

    async def _live_check(self, seq: int, payload: bytes) -> bool:
        """Live batch `seq` is about to be applied (it follows on, or the gap before it was
        repaired): asked of the replay socket now when a check is due (`_LIVE_CHECK_S`,
        `_LIVE_CHECK_BURST`), else kept as the newest to ask for once one is
        (`_check_pending`). False: the replay socket shows it is another publisher's
        (`_disagree` was called: it is not taken)."""
        if not self._has_replay:
            return True
        before = self.sink.fence()  # the batch applied before it (a fallback anchor)
        if self._clock() < self._live_check_due or self._replay_away:
            self._live_unchecked = (seq, payload, before)
            return True
        self._live_unchecked = None
        if _undecodable(payload):
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
        """When the next live check may be asked (`_LIVE_CHECK_S`, `_LIVE_CHECK_BURST`)."""
        return self._live_check_at - (_LIVE_CHECK_BURST - 1) * _LIVE_CHECK_S

    async def _check_pending(self) -> None:
        """Ask the replay socket for the newest live batch applied since the last check, now
        that one is due: it was applied less than `_LIVE_CHECK_S` ago."""
        pending, self._live_unchecked = self._live_unchecked, None
        if pending is None or _undecodable(pending[1]):
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
            return before.seq, _digest(before.payload)
        return None

    @staticmethod
    def _anchor_held(copy: _Copy, anchor: tuple[int, bytes] | None) -> bool | None:
        """Whether the answer `copy` (asked from at or below `anchor`'s seq) still holds the
        anchor batch: True (its process is the one the stream followed: it never restarted
        since), False (another batch there, or none: a new process), None (no anchor, or its
        buffer rolled past it: nothing shown)."""
        if anchor is None or (copy.first is not None and copy.first > anchor[0]):
            return None
        return copy.anchor is not None and _digest(copy.anchor) == anchor[1]

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
            self._live_check_wait_s = min(self._live_check_wait_s * 2, _LIVE_CHECK_MAX_S)
            # (no burst after it: the first check asked is due after the wait)
            burst_s = (_LIVE_CHECK_BURST - 1) * _LIVE_CHECK_S
            self._live_check_at = now + self._live_check_wait_s + burst_s
            return True
        self._live_check_wait_s = _LIVE_CHECK_S
        self._live_check_at = max(self._live_check_at, now) + _LIVE_CHECK_S
        digest = _digest(payload)
        if copy.payload is not None and _digest(copy.payload) == digest:
            self._trust_replay()
            self._live_agreed = seq, digest
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

    def _show_state(self) -> None:
        # a tail not known whole taints what the stream holds: also a part of a buffer that a
        # catch-up or a rebuild (SYNCING) applied before its answer stopped
        holds = self._phase is StreamState.SYNCED or (
            self._phase is StreamState.SYNCING and self.tracker.last is not None
        )
        unproven = (
            self._unverified
            or self._replay_unconfirmed
            or ((self._tail_unproven or self._live_unproven) and holds)
            or self._disagreeing is not None
        )
        if unproven:
            self._enter(StreamState.UNVERIFIED)
        elif self._tainted is not None:
            self._enter(StreamState.DEGRADED)  # may hold a dead process's batch (`_tainted`)
        elif self._catch_up is not None and self._phase is StreamState.SYNCED:
            self._enter(StreamState.SYNCING)  # the publisher's past (`_catch_up`)
        else:
            self._enter(self._phase)

    def _catching_up(self) -> None:
        """A replay is about to rebuild the stream from its publisher's buffer (what it holds
        now is nothing, or a state not proven the present): each batch it applies is a past
        state of the worker's cache, so the stream predicts nothing until it is caught up."""
        if self._catch_up is not _CatchUp.READING:
            self._catch_up = _CatchUp.READING
            self._show_state()

    def _reached_end(self, *, heard: bool = True) -> None:
        """The catch-up's answer ended, or a live batch followed on what it gave: the live
        batches queued meanwhile are all that is left of the past (`_caught_up`). `heard`:
        the answer was asked with the SUB connected (a live batch: it is), so every batch
        published after it reaches the SUB; else one more replay is read once it is
        connected (`_hear_end`)."""
        if self._catch_up is None:
            return
        self._catch_up = _CatchUp.DRAINING
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

    def _enter(self, state: StreamState) -> None:
        if state is self.health.state:
            return
        self.health.state = state
        if self._on_state is not None:
            self._on_state(self.stream_id, state)

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

    # ------------------------------------------------------------- messages

    async def _on_live(self, frames: list[bytes]) -> None:
        try:
            msg = parse_live(frames)
        except ProtocolError as exc:
            self._malformed(f"bad live frames: {exc}")
            return
        if not topic_matches(msg.topic, self._topic):
            return
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
            if doubt == _DEAD:
                self._skip_collided(msg.seq)
                return
        replayed = self.tracker.replayed_from, self.tracker.replayed_to
        decision = await self._checked(self.tracker.on_live(msg.seq), msg.seq, msg.payload)
        storm: str | None = None
        unproven: str | None = None  # why nothing proved a restart shown by the seq alone
        if decision.verdict is SeqVerdict.RESTART:
            if not self._after_restart or self._window_over():
                unproven = await self._went_back(msg.seq, msg.payload, prev_live)
                if unproven == _ELSEWHERE:
                    return  # not taken: nothing is while the sockets disagree
            else:
                # a restart inside the window of another: the batch that shows it may be a
                # queued batch of the run before the last, its seq now below the newest (QA:
                # two restarts within a second, the middle process's page predicted)
                storm = await self._window_proof(msg.seq, msg.payload)
                if storm == _DEAD:
                    # the replay socket answered without it: not the newest process's (nor a
                    # newer one's, whose socket would give it back), a dead one's queued batch.
                    # Applied, it cleared the newest process's proven pages (QA)
                    self.dead_batches += 1
                    self._warn(
                        "stale",
                        f"live seq {msg.seq} goes back within {_DEAD_RUN_S:g} s of a restart and "
                        "is not in the replay socket's buffer: a dead process's queued batch, "
                        "skipped",
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
                    f"live seq {msg.seq} shows a second restart within {_DEAD_RUN_S:g} s and "
                    f"may be a queued batch of a dead process ({storm}): applied, the stream "
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

    async def _checked(self, decision: SeqDecision, seq: int, payload: bytes) -> SeqDecision:
        """`decision` on live batch `seq`, unless it is a duplicate of a replayed batch that
        is not the same batch (`_live_disagrees`)."""
        if decision.verdict is not SeqVerdict.DUPLICATE:
            return decision
        replayed = self._replayed.get(seq) if self._replayed else None
        if replayed is not None:
            if replayed == _digest(payload):
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
        if _undecodable(payload):
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
        if again is not None and _digest(again) == _digest(payload):
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
    ) -> _Copy:
        """What the replay socket gives from `start` (default `seq`): its batch at `seq` (and
        at `anchor`) and the seqs its answer spans (nothing when it gave no usable answer)."""
        found: bytes | None = None
        at_anchor: bytes | None = None
        first: int | None = None
        newest: int | None = None
        seen: dict[int, bytes] = {}
        try:
            asked = seq if start is None else start
            async with contextlib.aclosing(self._replay_client().replies(asked)) as replies:
                async for reply in replies:
                    if reply.seq == seq:
                        found = reply.payload
                    if reply.seq == anchor:
                        at_anchor = reply.payload
                    first = reply.seq if first is None else first
                    newest = reply.seq
                    if self._after_restart and len(seen) < _WINDOW_COPIES:
                        seen[reply.seq] = _digest(reply.payload)
        except (TimeoutError, ReplayError):
            return _Copy(False, None, None, None)
        if self._after_restart:
            self._window_copies = seen  # the buffer as it stands now (it only grows)
        if first is not None:
            self._replay_buffers = True
        return _Copy(True, found, first, newest, at_anchor)

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
                if doubt == _DEAD:
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
            and result.continuity is not _Continuity.NONE
            and not self._proof_owed  # (asked from the newest batch: `_verify` owes it)
        ):
            if result.continuity is _Continuity.PROVEN and self.restarts == restarts:
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
            if watched and self.restarts == restarts:
                self._found_undelivered(before, after)
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

    def _found_undelivered(self, before: int | None, after: int) -> None:
        """An idle probe, asked with the SUB connected and the stream caught up, brought
        batches up to `after` that the SUB never delivered. A PUB at its high-water mark drops
        some; a live path that is deaf drops all (a ZMQ forwarder that lost its upstream, a
        TCP hop swallowing bytes: the SUB's connection to it stays up, so nothing else tells),
        and each eviction would be a false hit until the next probe. Nothing tells the two
        apart but the next live batch: until one follows on, the stream predicts nothing
        (UNVERIFIED), however many probes find nothing more (an idle worker stays untrusted
        until it publishes; a busy one's next batch, milliseconds away, trusts it again)."""
        self.undelivered_tails += 1
        first = 0 if before is None else before + 1
        self._warn(
            "undelivered",
            f"the idle probe found batches {first}..{after} the connected event socket never "
            f"delivered (undelivered_tails {self.undelivered_tails}): the event path may be "
            "deaf (a forwarder that lost its upstream, a hop dropping bytes) or the publisher "
            "dropped them at its high-water mark; the stream predicts nothing until a live "
            "batch follows on",
        )
        if not self._live_unproven:
            self._live_unproven = True
            self._show_state()

    def _live_delivered(self, seq: int, payload: bytes) -> None:
        """Live batch `seq` came and the stream stands at it: applied (it followed on), or
        the same bytes a replay applied last (a probe or a repair ran ahead to it while it was
        in flight). The live path delivers up to the present: trusted again. (A live copy
        below the last applied seq proves nothing yet: the copies after it are to come.)"""
        if not self._live_unproven or seq != self.tracker.last:
            return
        if self._last_live != seq and not self._is_replayed(seq, payload):
            return
        self._live_unproven = False
        self._show_state()

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

    async def _replay(self, start: int) -> _ReplayResult:
        """Ask for every buffered batch from `start` and apply the ones we lack, in order.

        Asked from the last applied seq, the publisher's batch at that seq is checked against
        the stream's fence first: a different batch is a restart (the stream is cleared and
        replayed from 0 at once); an answer that starts later proves nothing, so the stream is
        cleared and rebuilt from what it holds (`continuity` says which).
        """
        if not self._has_replay:
            return _ReplayResult(False, None, _Continuity.NONE)  # found out: not asked again
        newest: int | None = None
        last = self.tracker.last
        owed = self._owed_fence
        continuing = last is not None and (
            start == last or (owed is not None and start == owed.seq)
        )
        continuity = _Continuity.NONE
        rebinds = self._rebinds
        live = self.tracker.live
        heard = self._connected  # what is published after its answer reaches the SUB
        if last is None or self._unverified:
            # a rebuild from the buffer (a join, after a clear), or a proof that may bring a
            # snapshot's stream forward by thousands of batches: the past until caught up
            self._catching_up()
        try:
            async with contextlib.aclosing(self._replay_client().replies(start)) as replies:
                async for reply in replies:
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
                        return _ReplayResult(False, None, _Continuity.NONE)
                    newest = reply.seq if newest is None else max(newest, reply.seq)
        except TimeoutError:
            timeout_s = self.settings.replay_timeout_s
            self._warn("replay-timeout", f"replay from {start} timed out after {timeout_s}s")
            return _ReplayResult(False, None, continuity)
        except ReplayError as exc:
            self._warn("replay-unusable", f"replay from {start} proves nothing: {exc}")
            if newest is not None:
                # batches applied from an answer found out to be no buffer of this stream
                self._clear(f"a replay answer applied in part was not this stream's: {exc}")
            return _ReplayResult(False, None, continuity)
        if continuity is _Continuity.BROKEN:
            self._restart(
                f"the publisher's batch {start} is not the one applied: {self._another_run()}",
                unproven=self._unproven_against_live(start),
            )
            rebuilt = await self._replay(0)
            return _ReplayResult(rebuilt.answered, rebuilt.newest, continuity)
        self._reached_end(heard=heard)  # (a catch-up's: its buffer is read to the end)
        if not self._proof_owed or continuity is _Continuity.PROVEN:
            # what the publisher was last proven to hold, unless a proof still owed is
            # unmet: an answer that did not ask from the owed fence proves nothing of it
            self._answered_fence = self.sink.fence()
        return _ReplayResult(True, newest, continuity)

    def _take_reply(
        self, reply: ReplayData, start: int, continuing: bool, continuity: _Continuity
    ) -> _Continuity:
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
        if continuing and continuity is _Continuity.NONE:
            continuity = self._check_fence(start, reply.seq, reply.payload)
            if continuity is _Continuity.PROVEN:
                if self._last_live == start:
                    # it gave back, byte for byte, the batch the live stream delivered there
                    self._trust_replay()
                return continuity  # the fence batch itself is applied already
            if continuity is _Continuity.UNPROVEN:
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
        if continuity is _Continuity.BROKEN:
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

    def _note_fence(self, now: float) -> None:
        """Note the stream's fence as of `now` (`_noted_fences`), keeping one older than a
        drop's bound and the ones since."""
        fence = self.sink.fence()
        if fence is None:
            return
        noted = self._noted_fences
        noted.append((now, fence))
        settled = now - self._settle_s
        while len(noted) > 1 and noted[1][0] <= settled:
            noted.popleft()

    @property
    def _settle_s(self) -> float:
        """How long before a replay connection's drop is read its process may have gone
        silent, at most (`_SETTLE_SLACK_S`)."""
        return silence_bound_s(self.settings.replay_timeout_s) + _SETTLE_SLACK_S

    def _settled_fence(self) -> BatchFence | None:
        """The newest fence applied before the process behind a replay connection that
        dropped now may have gone silent (`_SETTLE_SLACK_S`): that process's batch, whatever
        was applied since (None: the stream's state is all younger than that)."""
        settled = self._clock() - self._settle_s
        for at, fence in reversed(self._noted_fences):
            if at <= settled:
                return fence
        return None

    def _is_replayed(self, seq: int, payload: bytes) -> bool:
        """Whether `payload` is the batch a replay applied at `seq` (of the newest kept)."""
        replayed = self._replayed.get(seq) if self._replayed else None
        return replayed is not None and replayed == _digest(payload)

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
        replayed[seq] = _digest(payload)
        if len(replayed) > _REPLAYED_KEPT:
            replayed.popitem(last=False)

    def _check_fence(self, start: int, seq: int, payload: bytes) -> _Continuity:
        """The verdict on the first batch a continuing replay returned (asked from `start`)."""
        if seq != start:
            return _Continuity.UNPROVEN  # the buffer starts after our last batch
        fence = self._owed_fence
        if fence is None or fence.seq != start:
            fence = self.sink.fence()
        if fence is not None and fence.matches(seq, payload):
            return _Continuity.PROVEN
        return _Continuity.BROKEN

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

    def _restart(self, reason: str, *, unproven: bool = False, outcome: str | None = None) -> None:
        """The publisher restarted (or may have): drop the stream's state, rebuild from 0.

        `unproven`: found by a replay socket never proven to be the publisher's, contradicting
        a batch the live stream delivered. That is a restart of this publisher or another
        worker's socket (a `replay` typo), and nothing tells which yet: it is counted and
        rebuilt as a restart, but what the socket gives predicts nothing until a live batch
        agrees with it (as at a join), and a live batch that contradicts what it gave finds
        it out (`_live_disagrees`, `_followed_on`, a live seq beyond its buffer in `_repair`),
        or the run before the restart still coming past `_DEAD_RUN_S` while no live batch
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
        self._clear(reason, outcome=outcome)
        self.tracker.reset()
        self.sink.forget_seq()
        self._last_live = None

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
                f"in the {_DEAD_RUN_S:g} s after the restart, {why}: the dead process's batches "
                "cannot be told from the new one's, so the stream starts cold from the next batch",
                kind="window",  # said once per window, apart from the restart's own clear
            )

    def _window_over(self) -> bool:
        return self._clock() - self._restart_found_at > _DEAD_RUN_S

    def _window_left_ms(self) -> int | None:
        """How long until a tainted stream's window ends (None: no such window)."""
        if self._tainted is None or not self._after_restart:
            return None
        left = self._restart_found_at + _DEAD_RUN_S - self._clock()
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
        (its replay socket gives it back, or gave it in its last answer), `_DEAD` (answered
        without it: a dead process's queued batch), or why nothing proves it."""
        digest = _digest(payload)
        if self._is_replayed(seq, payload) or self._window_copies.get(seq) == digest:
            return None
        if not self._has_replay:
            return "no replay socket"
        answered, copy = await self._replayed_copy(seq)
        if copy is not None and _digest(copy) == digest:
            self._trust_replay()
            return None
        return _DEAD if answered else "the replay did not answer"

    async def _went_back(self, seq: int, payload: bytes, prev_live: int | None) -> str | None:
        """Whether live batch `seq`, whose seq goes back (below the newest live one,
        `prev_live`; None: below what a replay gave before any live batch), shows a restart:
        None (the replay socket gives it back: its process is new; or there is nothing to
        ask, as ever), `_ELSEWHERE` (the socket's process never went back: it still holds
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
        if not self._has_replay or _undecodable(payload):
            return None  # no socket to ask (or garbage, no batch to ask for): as ever
        if self._replay_away:
            return "the replay connection is away"
        anchor = self._live_agreed
        at = None if anchor is None else anchor[0]
        copy = await self._replay_at(seq, seq if at is None else min(seq, at), at)
        if not copy.answered:
            return "the replay did not answer"
        if copy.payload is not None and _digest(copy.payload) == _digest(payload):
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
        return _ELSEWHERE

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
        answer) nothing tells them apart, as seqs of both runs collide: within `_DEAD_RUN_S`
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
            digest = _digest(payload)
            if self._window_copies.get(seq) == digest:
                # the buffer the new process gave back last holds this very batch: its own
                self._trust_replay()
                if not within:
                    self._dead_seq = None
                return False
            # (one round trip per batch the last answer did not hold, for the window only)
            answered, copy = await self._replayed_copy(seq)
            if copy is not None and _digest(copy) == digest:
                self._trust_replay()  # the new process's: it gives this batch back
                if not within:
                    self._dead_seq = None
                return False
        if answered and not within:
            if self._restart_unproven and not self._replay_trusted:
                self._disagree(
                    f"the replay socket showed a restart over {_DEAD_RUN_S:g} s ago, yet the "
                    f"run before it goes on (live seq {seq}, which it does not give back) and "
                    "no live batch followed on its buffer since"
                )
                return True  # not taken: nothing is while they disagree
            late_s = self._clock() - self._restart_found_at
            if late_s > 2 * _DEAD_RUN_S:
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

    def _restarted(self) -> None:
        """Count a restart and say so (`on_restart`): a new process on the same ports may run
        other settings (dp ranks, page size) than the one its worker was registered with, and
        no health probe need have seen it down (a quick restart, a pod behind a stable URL)."""
        self.restarts += 1
        if self._on_restart is not None:
            self._on_restart(self.worker)
        if self._on_siblings is not None and not (self._unverified and self._by_sibling):
            # its other ranks (one server's) restarted too: before, a rank whose connection
            # did not drop (behind a forwarder) and that was quiet predicted the dead process's
            # pages until its own probe found out (QA: 288 tokens for about 1.2 s)
            self._on_siblings(self, "restarted")

    def _lose(self, seq: int, why: str) -> None:
        """Give up on batch `seq`: it may have removed blocks, so its stream's entries go."""
        self.lost_batches += 1
        self._clear(f"batch {seq} does not decode and is lost ({why})")

    def _notify_last(self) -> None:
        if self.tracker.last is not None:
            self._notify(self.tracker.last)

    def _notify(self, seq: int) -> None:
        if self._on_applied is not None:
            self._on_applied(self.stream_id, seq)

    def _clear(self, reason: str, *, kind: str = "clear", outcome: str | None = None) -> None:
        """Drop the stream's entries. A snapshot's state dropped before anything proved it
        says so once, with `outcome` (default: `reason`): the true reason, wherever found
        (before, a proof after it said "proven" of what was rebuilt since)."""
        self._replayed.clear()  # batches of the state dropped: nothing to check live ones by
        self._answered_fence = self._owed_fence = None  # nothing held is left to prove
        self._noted_fences.clear()
        # (an owed proof that went unanswered is still asked at its back-off, not at every
        # live batch: the socket is as silent as it was)
        self._proof_owed = False
        if self._replay_unconfirmed:
            self._replay_unconfirmed = False  # nothing unconfirmed is left
            self._show_state()
        held = self.sink.held_events()
        dropped = self.sink.clear()
        self._clears += 1
        if keeps_entries(self.sink):
            # events held while the page size is unknown are no entries, yet go with them
            also = f" and {held} held events (page size still unknown)" if held else ""
            self._warn(kind, f"cleared {dropped} entries{also}: {reason}")
        else:  # a recording: nothing held, the file keeps the decision for a replay to repeat
            self._warn(kind, f"stream reset (a router drops its entries here): {reason}")
        self._loaded_outcome(f"not proven, cleared: {outcome or reason}")

    def _malformed(self, what: str) -> None:
        self.decode_errors += 1
        self._warn("malformed", what)

    def _warn(self, kind: str, message: str) -> None:
        suppressed = self._limiter.allow(kind)
        if suppressed is None:
            return
        more = f" ({suppressed} similar suppressed)" if suppressed else ""
        log.warning("stream %s: %s%s", self.stream_id, message, more)

    # --------------------------------------------------------------- sockets

    def _replay_client(self) -> ReplayClient:
        if self._replayer is None:
            assert self.config.replay_endpoint is not None
            self._replayer = ReplayClient(
                self._ctx,
                self.config.replay_endpoint,
                self._topic,
                timeout_s=self.settings.replay_timeout_s,
                yield_every=self.settings.yield_every,
                on_malformed=self._malformed,
                on_unanswered=self._unanswered,
            )
        return self._replayer

    def _unanswered(self) -> None:
        self.unanswered_replays += 1
        # its reset is a restart candidate (`_replay_link`): taken before any live batch is
        self._link_due = 0

    def _close_replay(self) -> None:
        if self._replayer is not None:
            self._replayer.close()

    # ----------------------------------------------------------------- stats

    @property
    def state(self) -> StreamState:
        """What the subscriber last decided (`current_state` adds STALE, which is time)."""
        return self.health.state

    @property
    def block_size(self) -> int | None:
        """The stream's block size, None until configured or learned."""
        return self.health.block_size

    def _known_block_size(self) -> int | None:
        if self.config.block_size is not None:
            return self.config.block_size
        return self.sink.block_size()

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
        self._set_tainted(None)
        self.health.block_size = self._known_block_size()
        last_seq = sink.last_seq()
        self.tracker = SequenceTracker(last_seq)
        self._from_snapshot = last_seq is not None or bool(sink.entries())
        if self._from_snapshot:
            # the snapshot's state is unproven until the publisher's fence matches it
            self.suspect_restart("state loaded from a snapshot")

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
        )
