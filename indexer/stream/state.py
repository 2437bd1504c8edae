"""The state of one stream's subscriber, which all its parts read and write, and the pieces
they all use.

`SubscriberState` holds every attribute of a `StreamSubscriber`, each with the reason it is
kept; the subscriber's parts (`indexer.stream`) are mixins over it, and what one part calls of
another is declared here, abstract, under the module that defines it. Also here: the log (one
logger for the package, `indexer.stream`), a problem said at most once per `log_interval_s`
(`_warn`), the state the stream shows (`_show_state`), a clear of its entries (`_clear`), trust
in the replay socket, the replay DEALER itself, a batch's digest and whether it decodes at all,
and the phases of a catch-up (`CatchUp`, `indexer.stream.repair`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import zmq
import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.errors import ProtocolError
from indexer.fence import BatchFence
from indexer.health import StreamHealth
from indexer.log_throttle import LogThrottle
from indexer.protocol.decode import decode_batch
from indexer.replay_client import ReplayClient
from indexer.sequence import SeqDecision, SequenceTracker
from indexer.sink import StreamSink, keeps_entries
from indexer.stats import StreamState

if TYPE_CHECKING:
    from indexer.stream.live_checks import Copy
    from indexer.stream.replay_answers import ReplayResult
    from indexer.stream.subscriber import StreamSubscriber

__all__ = [
    "LIVE_CHECK_BURST",
    "LIVE_CHECK_MAX_S",
    "CatchUp",
    "DeliveryMark",
    "SubscriberState",
    "batch_digest",
    "log",
    "undecodable",
]

# one logger for every module of the package, so one name filters a stream's lines (it was
# `indexer.subscriber` while the package was one module)
log = logging.getLogger("indexer.stream")

# (the live checks' schedule, `indexer.stream.live_checks`'s: here, as the state starts their
# back-off at the interval)
# a live batch applied is asked of the replay socket (`_live_check`): before it is applied
# while fewer than `LIVE_CHECK_BURST` were asked for in the last `LIVE_CHECK_BURST` x
# `IndexerConfig.live_check_interval_s` (a stream that publishes now and then: each batch),
# else at most once per interval on average, the newest applied since being asked for when
# that is due. Its publisher buffers what it sends before it answers, so another batch at that
# seq, or none, means the live stream is another publisher's: a forwarder re-pointed at a
# worker whose seqs follow on this one's, which no seq shows. So such a stream predicts the
# other worker's cache for less than the interval, if at all. A busy stream pays a round trip
# an interval (an answer from the seq asked for to the publisher's newest: an interval's
# batches, unless the router lags); an unanswered one is asked again after a back-off,
# doubling to the cap
LIVE_CHECK_BURST = 4
LIVE_CHECK_MAX_S = 60.0
# how long the stream's task may wait for a replay answer with live batches queued behind it
# before the stream predicts nothing (`_holding_live`): a healthy answer takes a millisecond
# or two on a LAN; the queued batches may evict what the stream predicts. With the replay
# socket far away, `HELD_ANSWERS_X` times its usual answer (the median of the last
# `HELD_ANSWERS` live checks'), as a healthy answer holds the live batches that long too (QA:
# at a 200 ms round trip every check made the stream `degraded`, 12% of a held prompt's hits
# lost), up to `replay_timeout_s`
HELD_BEHIND_S = 0.1
HELD_ANSWERS = 8
HELD_ANSWERS_X = 3.0
# a stream cleared by a gap its replay left unrepaired (the answer timed out or dropped) holds
# only what followed the gap, though the worker still holds pages stored before it, which it
# never announces again: the stream is rebuilt from the replay socket's buffer this long
# after the clear (`Repair._rebuild_cleared`), busy or quiet, the wait doubling to the cap
# while the socket does not answer to the end
REBUILD_FIRST_S = 1.0
REBUILD_MAX_S = 60.0


def batch_digest(payload: bytes) -> bytes:
    """What two copies of a batch are compared by, and kept as per seq: 8 bytes of blake2b."""
    return hashlib.blake2b(payload, digest_size=8).digest()


def undecodable(payload: bytes) -> bool:
    """Whether `payload` is no batch at all: garbage on the wire, never another publisher's
    batch (a publisher sends batches), so it says nothing about which publisher is heard."""
    try:
        decode_batch(payload)
    except ProtocolError:
        return True
    return False


class CatchUp(enum.Enum):
    """How far a stream rebuilt from its publisher's replay buffer is (`_catch_up`)."""

    # reading the buffer: what the stream holds is the publisher's past (pages stored early in
    # it and evicted later are held until the batch that evicts them is read)
    READING = "reading"
    # the answer ended, or a live batch followed on what it gave: the live batches queued on
    # the SUB meanwhile are the last of the past, applied once the loop reads them
    DRAINING = "draining"


class DeliveryMark(NamedTuple):
    """Where the live path stood as a replay was asked (`Repair._delivery_mark`)."""

    heard: int | None  # the newest seq it delivered on its connection (or known published)
    payload: bytes | None  # the batch at `heard` (None: not known)
    restarts: int  # `restarts` as `heard` was heard (a restart since: it was the dead run's)
    links: int  # `_sub_links` then


class SubscriberState(abc.ABC):
    """What a stream's subscriber keeps, and the pieces each of its parts uses."""

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
        on_restart: Callable[[str, str], None] | None = None,
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
        self._on_restart = on_restart  # told the worker and stream when its publisher restarted
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
        # a rebuild is owed (`Repair._owe_rebuild`): when to ask for it (`_clock`; None:
        # none owed), the first seq the stream holds since its clear (a buffer that starts
        # after it has nothing to give back), and the wait before the next one owed
        self._rebuild_at: float | None = None
        self._rebuild_from: int | None = None
        self._rebuild_wait_s = REBUILD_FIRST_S
        # the rebuild's replay is being read: its first batch older than `_rebuild_from`
        # clears the stream, which the rest of the answer rebuilds (`_take_reply`)
        self._rebuilding = False
        # the fence of what the stream held when the rebuild was asked: the buffer's batch at
        # its seq must be the same (else, or a buffer ending below it, the publisher
        # restarted: `_rebuild_broke`), as a probe's first batch must be
        self._rebuild_fence: BatchFence | None = None
        self._rebuild_broke = False
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
        # a restart was found less than `DEAD_RUN_S` ago: live batches that continue the run
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
        # it that still comes past `DEAD_RUN_S`, no live batch having confirmed the socket,
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
        self._catch_up: CatchUp | None = None
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
        # the newest live seq the SUB delivered on its present connection (None: none since
        # it connected) and that batch: a batch past it was published to that connection, so
        # a replay that brings one the live path has not delivered found it deaf, or ran
        # ahead of it (`Repair._undelivered_since`)
        self._live_heard: int | None = None
        self._live_heard_payload: bytes | None = None
        # `restarts` when it was heard: a restart found since (a proof cut as the process
        # died, before the new one was up) leaves it the dead run's, and a mark taken after
        # that restart must judge it so (CI: the new process's buffer, by replay only, was
        # trusted whole, though nothing showed the live path reached the new process)
        self._live_heard_restarts = 0
        # the SUB's connection events seen (a handshake, a drop): a replay read across one
        # judges nothing by `_live_heard`
        self._sub_links = 0
        # the batches (after the seq, up to the seq) such a probe found, not yet said: said
        # (counted in `undelivered_tails`, one WARNING) once a later live batch comes without
        # their live copies, or at the next probe; unsaid when the copy of the newest comes
        # (the probe only ran ahead of a live batch in flight). Before, said at once: a probe
        # racing a healthy stream's live batch warned of a deaf path (QA, 1 in a 60 s run)
        self._undelivered_unsaid: tuple[int | None, int, str] | None = None
        # the stream's task has waited `HELD_BEHIND_S` for a replay answer (a live check, a
        # probe) while live batches queued behind it on the SUB (`_holding_live`): it is
        # behind the worker, so it predicts nothing (`degraded`) until the session has read
        # the SUB empty again. Before, it stayed
        # `synced` for the whole wait: a flush queued behind a check asked of a silent replay
        # path was a false hit until the heartbeat dropped it (QA v4: 0.85 s, 288 tokens)
        self._held_behind = False
        # how long the last live checks took to be answered, newest last (`HELD_ANSWERS`)
        self._answer_times: deque[float] = deque(maxlen=HELD_ANSWERS)
        # `_answer_times` holds only the time to a replay answer's first frame, the socket's
        # usual answer until the first live check's is known (`_first_answer`)
        self._answer_seeded = False
        # whether the SUB holds live messages not read yet (the session's socket; none before)
        self._sub_queued: Callable[[], bool] = lambda: False
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
        self._live_check_s = self.settings.live_check_interval_s
        self._live_check_wait_s = self._live_check_s
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
            self._catch_up = CatchUp.READING
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
        self.rebuilds = 0  # streams a gap cleared, rebuilt from the buffer (`_rebuild_begins`)
        self._clears = 0  # for sinks that keep no counters of their own
        self._probe_wait_ms = int(self.settings.probe_interval_s * 1000)

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
        # behind the live stream: batches it has not read may evict what it predicts
        behind = self._held_behind and self._phase is StreamState.SYNCED
        if unproven:
            self._enter(StreamState.UNVERIFIED)
        elif self._tainted is not None or (behind and self._catch_up is None):
            # may hold a dead process's batch (`_tainted`), or be behind (`_held_behind`)
            self._enter(StreamState.DEGRADED)
        elif self._catch_up is not None and self._phase is StreamState.SYNCED:
            self._enter(StreamState.SYNCING)  # the publisher's past (`_catch_up`)
        else:
            self._enter(self._phase)

    def _held_wait_s(self) -> float:
        """How long live batches may wait behind a replay answer before the stream is behind
        (`HELD_BEHIND_S`, or the socket's usual answer times `HELD_ANSWERS_X`)."""
        times = self._answer_times
        if not times:
            return HELD_BEHIND_S
        usual = sorted(times)[len(times) // 2]
        return min(max(HELD_BEHIND_S, HELD_ANSWERS_X * usual), self.settings.replay_timeout_s)

    @contextlib.contextmanager
    def _holding_live(self, *, timed: bool = False) -> Iterator[None]:
        """Around a replay answer awaited by the stream's task (the live path waits for it):
        looked at after `_held_wait_s`, then every `HELD_BEHIND_S`, the stream predicts nothing
        (`_held_behind`) once live batches are queued behind it, until the session has read
        the SUB empty again (`_caught_up_live`). `timed`: the answer's time counts among the
        socket's usual ones."""
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None

        def look() -> None:
            nonlocal timer
            if not self._sub_queued():
                timer = loop.call_later(HELD_BEHIND_S, look)
            elif not self._held_behind:
                timer = None
                self._held_behind = True
                self._show_state()

        asked = loop.time()
        timer = loop.call_later(self._held_wait_s(), look)
        try:
            yield
            if timed:  # (answered: `timed` answers are one check's, a few batches)
                if self._answer_seeded:  # a check's own time replaces the first answer's
                    self._answer_seeded = False
                    self._answer_times.clear()
                self._answer_times.append(loop.time() - asked)
        finally:
            if timer is not None:
                timer.cancel()

    def _first_answer(self, seconds: float) -> None:
        """A replay answer's first frame (a reply, or the end of an empty one) came `seconds`
        after it was asked: the socket's usual answer while no live check has been timed
        (`_held_wait_s`). Before, the first check of a far replay socket (a join's catch-up
        answered 0.2 s late) was allowed `HELD_BEHIND_S`, and made a healthy stream
        `degraded` for 0.26-0.6 s (QA)."""
        if not self._answer_times:
            self._answer_times.append(seconds)
            self._answer_seeded = True

    def _caught_up_live(self) -> None:
        """The session found the SUB empty: no live batch waits behind anything."""
        if self._held_behind:
            self._held_behind = False
            self._show_state()

    def _enter(self, state: StreamState) -> None:
        if state is self.health.state:
            return
        self.health.state = state
        if self._on_state is not None:
            self._on_state(self.stream_id, state)

    def _set_phase(self, phase: StreamState) -> None:
        self._phase = phase
        self._show_state()

    def _trust(self) -> None:
        self._owed_fence = None  # proven (or cleared): nothing is owed
        self._proof_owed = self._owed_wait = False
        if self._unverified:
            self._unverified = False
            self._by_sibling = False
            self._show_state()

    def _trust_replay(self) -> None:
        """The replay socket gave (or gives back) a batch the live stream delivered, byte for
        byte: it is this publisher's, and what it brought is the stream's."""
        self._replay_trusted = True
        if self._replay_unconfirmed:
            self._replay_unconfirmed = False
            self._show_state()

    def _is_replayed(self, seq: int, payload: bytes) -> bool:
        """Whether `payload` is the batch a replay applied at `seq` (of the newest kept)."""
        replayed = self._replayed.get(seq) if self._replayed else None
        return replayed is not None and replayed == batch_digest(payload)

    def _loaded_outcome(self, outcome: str) -> None:
        """Say once what became of a snapshot's state (not rate-limited: once per load): proven
        here, or cleared (`_clear`, with the reason of the clear that dropped it, whichever
        path found it: a proof, a probe that found the seqs gone back, a gap)."""
        if self._from_snapshot:
            self._from_snapshot = False
            log.info("stream %s: state loaded from a snapshot %s", self.stream_id, outcome)

    @property
    def _has_replay(self) -> bool:
        """A replay socket to ask (configured, and not found to be another publisher's)."""
        return self.config.replay_endpoint is not None and not self._replay_foreign

    @property
    def _probes_at_connect(self) -> bool:
        """Whether a session starts by reading the replay socket (and probes it when quiet)."""
        return self.config.replay_endpoint is not None and self.settings.probe_interval_s > 0

    @property
    def _replay_away(self) -> bool:
        """Whether a proof waits for the replay DEALER's connection to come back."""
        return self._replay_lost and self._has_replay

    def _known_block_size(self) -> int | None:
        if self.config.block_size is not None:
            return self.config.block_size
        return self.sink.block_size()

    def _notify_last(self) -> None:
        if self.tracker.last is not None:
            self._notify(self.tracker.last)

    def _notify(self, seq: int) -> None:
        if self._on_applied is not None:
            self._on_applied(self.stream_id, seq)

    def _lose(self, seq: int, why: str) -> None:
        """Give up on batch `seq`: it may have removed blocks, so its stream's entries go."""
        self.lost_batches += 1
        self._clear(f"batch {seq} does not decode and is lost ({why})")

    def _clear(self, reason: str, *, kind: str = "clear", outcome: str | None = None) -> None:
        """Drop the stream's entries. A snapshot's state dropped before anything proved it
        says so once, with `outcome` (default: `reason`): the true reason, wherever found
        (before, a proof after it said "proven" of what was rebuilt since)."""
        self._replayed.clear()  # batches of the state dropped: nothing to check live ones by
        self._answered_fence = self._owed_fence = None  # nothing held is left to prove
        self._undelivered_unsaid = None  # (what was missing is moot: nothing is held)
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

    # What one part calls of another, each defined in the module named above it: declared here
    # so that each part type-checks on its own, and abstract so that a class combining the
    # parts cannot be made while one is missing.

    # indexer.stream.subscriber
    @abc.abstractmethod
    async def _apply_live(self, topic: bytes, seq: int, payload: bytes) -> None: ...
    @abc.abstractmethod
    def _apply(self, topic: bytes, seq: int, payload: bytes, *, replayed: bool) -> bool: ...

    # indexer.stream.restart_candidates
    @abc.abstractmethod
    def _replay_link(self) -> bool: ...
    @abc.abstractmethod
    def suspect_restart(
        self, why: str, *, sibling: bool = False, routine: bool = False
    ) -> None: ...
    @abc.abstractmethod
    async def _verify(self) -> None: ...

    # indexer.stream.repair
    @abc.abstractmethod
    def _catching_up(self) -> None: ...
    @abc.abstractmethod
    def _reached_end(self, *, heard: bool = True) -> None: ...
    @abc.abstractmethod
    def _tail_proven(self, proven: bool) -> None: ...
    @abc.abstractmethod
    def _heard_whole(self) -> None: ...
    @abc.abstractmethod
    def _retry_soon(self) -> None: ...
    @abc.abstractmethod
    def _owe_rebuild(self, held_from: int) -> None: ...
    @abc.abstractmethod
    def _rebuild_left_ms(self) -> int | None: ...
    @abc.abstractmethod
    async def _rebuild_cleared(self) -> None: ...
    @abc.abstractmethod
    def _delivery_mark(self, fallback: int | None = None) -> DeliveryMark: ...
    @abc.abstractmethod
    def _undelivered_since(self, mark: DeliveryMark, by: str) -> None: ...

    # indexer.stream.replay_answers
    @abc.abstractmethod
    async def _replay(self, start: int) -> ReplayResult: ...
    @abc.abstractmethod
    async def _check_restart(self, last: int) -> bool | None: ...
    @abc.abstractmethod
    def _unproven_against_live(self, seq: int) -> bool: ...
    @abc.abstractmethod
    def _another_run(self) -> str: ...

    # indexer.stream.live_checks
    @abc.abstractmethod
    async def _live_check(self, seq: int, payload: bytes) -> bool: ...
    @staticmethod
    @abc.abstractmethod
    def _anchor_held(copy: Copy, anchor: tuple[int, bytes] | None) -> bool | None: ...
    @abc.abstractmethod
    async def _checked(self, decision: SeqDecision, seq: int, payload: bytes) -> SeqDecision: ...
    @abc.abstractmethod
    async def _replayed_copy(self, seq: int) -> tuple[bool, bytes | None]: ...
    @abc.abstractmethod
    async def _replay_at(
        self, seq: int, start: int | None = None, anchor: int | None = None
    ) -> Copy: ...

    # indexer.stream.disagreement
    @abc.abstractmethod
    async def _followed_on(self, seq: int, payload: bytes) -> None: ...
    @abc.abstractmethod
    def _found_foreign(self, why: str, *, keep: bool = False) -> None: ...
    @abc.abstractmethod
    def _disagree(self, why: str) -> None: ...
    @abc.abstractmethod
    async def _agree_check(self) -> None: ...

    # indexer.stream.restarts
    @abc.abstractmethod
    def _restart(
        self, reason: str, *, unproven: bool = False, outcome: str | None = None
    ) -> None: ...
    @abc.abstractmethod
    def _set_tainted(self, why: str | None) -> None: ...
    @abc.abstractmethod
    def _end_window(self) -> None: ...
    @abc.abstractmethod
    def _window_over(self) -> bool: ...
    @abc.abstractmethod
    async def _window_proof(self, seq: int, payload: bytes) -> str | None: ...
    @abc.abstractmethod
    def _skip_collided(self, seq: int) -> None: ...
