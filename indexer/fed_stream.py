"""Streams fed by a relay: the index of a replica that follows `kvroute relay`, not the workers.

A `FedStream` stands where a `StreamSubscriber` would (the indexer service asks both the same
things), but owns no socket: the relay's records (`indexer.relay_record`) are handed to it in
order (`take`) and it applies them as the relay's index applied them. What it holds is the
relay's state, or a part of it, never more:
- records are numbered per relay process; a number skipped (the follower fell behind what the
  relay stream keeps, or NATS lost some) or a new relay process drops the stream's entries and
  it goes on from the record at hand, as a subscriber joining mid-stream would (removals it
  missed cannot name entries it no longer holds);
- the stream's state is the relay's (a stream the relay is repairing or proving predicts
  nothing here either; one the relay has not heard from is STALE here too), and STALE when
  neither a record nor a heartbeat came from the relay within `stale_after_s`;
- it is STALE as well while the relay that wrote it is not known alive now (`relay_lost`):
  this replica's connection to NATS dropped (nothing the relay writes can reach it, as a
  subscriber's socket that dropped), or the relay's presence (`RelayPresence`, several times
  a heartbeat interval) stopped coming, which NATS tells of no other way: its process died,
  or lost NATS. It is trusted again at a record it takes as written now (of known age), which
  its relay, heard alive, wrote after the first presence heard of it since (`presence_n`):
  the records of the stream the relay wrote before come first, so that record shows it caught
  up (what the relay queued while NATS was away among them). Until then a record read back
  (a resubscription after a reconnect, the false-hit watch reading the stream anew) trusts
  nothing by its age alone.
  Before, only silence made it STALE (`stale_after_s`, 3 s): a replica that had said it lost
  NATS, or followed a killed relay, went on predicting pages the worker had flushed since
  (QA: 8 and 16 false hits of 34 answers), and a dead relay's last records, read back under
  3 s old, restored them. A relay of the version before, which says no presence (its
  records' `presence_s` is 0), is trusted again at any record of known age;
- while the follower reads it from the relay's stored records (`catching_up`: a worker
  followed after the relay wrote them, registered anew, or the follower reading what it
  missed), it is SYNCING, which predicts nothing: each record read is the worker's past, a
  page stored early and removed later among them. Before, each record set the relay's state
  as written (`synced`), and such a page was predicted until its removal was read;
- a loaded snapshot's state is UNVERIFIED until the relay shows the batch the snapshot ended on
  (its seq and digest, in a record or a heartbeat), which proves the snapshot is the relay's
  past; anything else (a later batch first, a clear, another relay process) starts afresh,
  from the relay's records the proof skipped (read from before the snapshot's last batch)
  when they run unbroken to the record that failed it;
- a restart this replica suspects (the worker's health check came back from down) is
  UNVERIFIED until the relay has checked the stream again since (its heartbeat counts its
  checks), or the stream held nothing here at a record the relay wrote after the worker was last
  seen down (a clear, a new relay process, a stream the relay made anew: what it holds came
  later, so from the process that came back); a relay that does neither within
  `verify_window_s` leaves the stream cleared (fail closed). A stream that held nothing at such
  a record already when the suspicion comes (the relay registered the worker anew before this
  replica saw it come back) is not suspected at all.
- a restart of the worker's process the relay saw (its heartbeats count them), or a batch of
  pages that do not fit the stream's block size, tells `on_restart` (the router reads the
  worker's settings again, as a subscriber's restart does: another process may run another
  page size, other ranks or another role); a mismatch is said as a subscriber says it, the
  stream's state being the relay's (`synced` while the relay's own stream is). Only what the
  relay wrote after the stream was followed tells: what came before is its registration's past
  (read back after the worker was registered anew: the old process's pages), and its pages
  that do not fit count as `skipped_events`, not `block_size_mismatches` (a counter alerted
  on, which counts only the mismatches said);
- a record names the KV-event endpoint the relay reads the stream from (`source`): one that
  is not surely where this replica's worker of that id publishes (the id re-pointed at another
  server on one side only) is not taken; the stream drops what it holds and is STALE, said in
  one WARNING per worker, until the relay's records name its endpoint again, where it joins
  afresh. Before, the stream's id alone matched records to it, and the old server's pages were
  predicted on the new one. A relay of the version before names none: its records are taken
  by the id, as they were.
Pure and synchronous: the relay follower (`router.cluster.relay`) does the I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from indexer.config import IndexerConfig, StreamConfig, shown_endpoint
from indexer.fence import BatchFence
from indexer.health import StreamHealth
from indexer.log_throttle import LogThrottle
from indexer.relay_record import RelayKind, RelayRecord
from indexer.server_stream import same_endpoint
from indexer.sink import StreamSink
from indexer.stats import StreamState, StreamStats, stream_stats
from indexer.subscriptions import stream_id

__all__ = ["FedStream", "FedStreams", "LiveRelays"]

_ANOTHER_RELAY = "records of another relay process (a restart, or a second relay of this stream)"
# a record's time here is its age as the follower reads it (`take`), which may be short by the
# delivery delay of the record the server's now was last known from (milliseconds, unless this
# host's loop stalled): a stream counts as made anew after the worker was seen down only with
# this much to spare
ANEW_MARGIN_S = 0.5
# a stream whose batches keep not fitting its block size tells `on_restart` at most this often
# (a worker whose settings read again are unchanged, e.g. a configured block_size that is wrong,
# would otherwise have its server info asked on every batch)
MISMATCH_REREAD_S = 10.0
# the records a loaded snapshot's proof skips that are kept, to apply should the proof fail
# (`FedStream._skipped`): a read-back from a little before the snapshot is a few heartbeats'
# worth; past this many, the stream joins afresh at the failing record as before
MAX_SKIPPED = 4096

log = logging.getLogger(__name__)


class LiveRelays:
    """The relay processes (epochs) heard alive lately: until when (this host's clock), and
    the number of the first presence heard since each was last taken for gone. The follower
    tells it what their presence says, the fed streams ask it. Pure."""

    __slots__ = ("_heard",)

    def __init__(self) -> None:
        self._heard: dict[int, tuple[float, int]] = {}

    def heard(self, epoch: int, n: int, *, now: float, until: float) -> None:
        """`epoch` said its presence number `n` at `now`: taken for alive until `until`."""
        known = self._heard.get(epoch)
        first = n if known is None or known[0] < now else known[1]
        self._heard[epoch] = (until, first)

    def live(self, epoch: int, now: float) -> bool:
        """Whether `epoch` was heard alive and its word has not run out at `now`."""
        known = self._heard.get(epoch)
        return known is not None and known[0] >= now

    def vouches(self, record: RelayRecord, now: float) -> bool:
        """Whether `record` was written by a relay alive now, after the first presence heard
        of it since it was last taken for gone: every record of its stream written before that
        came first, so the stream is caught up with the relay at it."""
        known = self._heard.get(record.epoch)
        return known is not None and known[0] >= now and record.presence_n > known[1]

    def others_live(self, epoch: int | None, now: float) -> bool:
        """Whether a relay process other than `epoch` is alive at `now` (a relay restarted)."""
        return any(e != epoch and until >= now for e, (until, _) in self._heard.items())

    def forget(self, epoch: int | None = None) -> None:
        """`epoch` is gone (None: every relay: this replica's NATS connection dropped)."""
        if epoch is None:
            self._heard.clear()
        else:
            self._heard.pop(epoch, None)


class _Position:
    """The engine seq the stream stands at (what a subscriber's tracker says as `last`)."""

    __slots__ = ("last",)

    def __init__(self, last: int | None) -> None:
        self.last = last


class FedStream:
    """One (worker, dp rank) stream applied from a relay's records (module docstring)."""

    def __init__(
        self,
        stream_id: str,
        worker: str,
        config: StreamConfig,
        sink: StreamSink,
        settings: IndexerConfig,
        *,
        clock: Callable[[], float],
        on_applied: Callable[[str, int], None] | None = None,
        on_restart: Callable[[str, str], None] | None = None,
        verify_window_s: float = 10.0,
        silent_after_s: float | None = None,
        relays: LiveRelays | None = None,
        elsewhere_said: set[str] | None = None,
    ) -> None:
        self.stream_id = stream_id
        self.worker = worker
        self.config = config
        self.sink = sink
        self._clock = clock
        self._on_applied = on_applied
        self._on_restart = on_restart  # told the worker when it may run other settings
        self._limiter = LogThrottle(settings.log_interval_s, clock=clock)
        # the relay's epoch and its count of the worker's restarts, as its last heartbeat said
        self._relay_restarts: tuple[int, int] | None = None
        self._mismatch_told_at = float("-inf")
        # the relays heard alive (the follower's); a relay that says its presence is trusted
        # only while it is among them
        self._relays = LiveRelays() if relays is None else relays
        # the endpoint the relay reads the stream from, while it is not this replica's
        # worker's (`_elsewhere`): no record taken, STALE; and the workers said so (one line
        # per worker, shared by its streams)
        self._elsewhere: str | None = None
        self._elsewhere_said = set() if elsewhere_said is None else elsewhere_said
        # no record taken as written now from a relay known alive since the stream began or
        # its relay was last lost (`relay_lost`): STALE, whatever the records' ages say
        self._unheard = True
        self._heard_epoch: int | None = None  # the relay of the last record taken as written now
        self.verify_window_s = verify_window_s
        # STALE once the relay said nothing for this long (its heartbeats come every
        # cluster.heartbeat_interval_s): the follower passes cluster.heartbeat_timeout_s
        self.added_at = clock()
        # never fresh by default: until a record arrives as the relay writes it, nothing says
        # the relay is alive (a subscriber's grace from its start would trust a dead relay's
        # records read back from the stream)
        self.health = StreamHealth(
            stream_id,
            started_at=float("-inf"),
            stale_after_s=settings.stale_after_s if silent_after_s is None else silent_after_s,
            block_size=config.block_size,
            dp_rank=config.dp_rank,
        )
        self.tracker = _Position(None)
        self._epoch: int | None = None  # the relay process followed, and its last record
        self._rseq = -1
        self._relay_state = StreamState.SYNCING
        self._catching_up = False  # read from the relay's stored records (`catching_up`)
        self._proof: BatchFence | None = None  # a loaded snapshot's last batch, to be shown
        self._proof_since = 0.0  # when it began waiting for it
        self._proof_cleared = False  # a clear or forgotten seq came meanwhile
        # the numbered records the proof skipped (the relay's past before the snapshot's last
        # batch), with when the relay wrote each (None: not known): applied should the proof
        # fail, so the stream holds what they stored instead of only what follows the failing
        # record. Before, a prompt stored in them was predicted nothing until stored again
        # (QA: a snapshot loaded into a running follower, from another fleet or too old). None:
        # more than `MAX_SKIPPED` came, not kept
        self._skipped: list[tuple[RelayRecord, float | None]] | None = []
        self._suspected_at: float | None = None  # a restart suspected here, not yet checked
        self._down_at = 0.0  # when the worker was last seen down before it
        # when the relay wrote the last record at which the stream held no entry here: all it
        # holds came from later records (-inf: not known, a snapshot's or records of unknown
        # age; None: no record taken yet)
        self._anew_at: float | None = None
        self._at = float("-inf")  # when the relay wrote the record at hand (`take`)
        self._checks_then = 0
        self._checks = 0  # the relay's count of checks, as its last heartbeat said
        self.batches = 0
        self.events = 0
        self.gaps = 0  # records skipped (fell behind, or lost): the stream started afresh
        self.restarts = 0  # relay processes changed under the stream: started afresh
        self.verifications = 0  # snapshots and suspected restarts proven or refused
        self.decode_errors = 0
        self.rank_mismatches = 0
        # events of records written before the stream was followed (read back: another
        # registration's, likely another process's pages) that do not fit its block size: not
        # indexed, and counted as skipped, not as mismatches (`stats`). Before, each
        # re-registration read the old process's records back and counted them again: QA saw
        # 97 mismatches on a stream that never logged one
        self.past_mismatches = 0
        if sink.last_seq() is not None or sink.entries():
            # a snapshot loaded before this worker was followed left its stream to the sink
            self._hold_unproven()

    # ------------------------------------------------------------ records

    def take(self, record: RelayRecord, *, age_s: float | None = 0.0) -> None:
        """Apply one record of this stream, in the order the relay wrote them. `age_s`: how
        long ago the relay wrote it, as the follower can tell (None: it cannot, a record read
        back from the stream's past: it builds the state but says nothing of now, and keeps
        nothing from going STALE)."""
        if record.source and not same_endpoint(record.source, self.config.endpoint):
            self._from_elsewhere(record.source)
            return
        if self._elsewhere is not None:
            self._agreed(record.source)
        now = self._clock()
        fresh_at = None if age_s is None else now - max(0.0, age_s)
        # when the relay wrote it, on this replica's clock (-inf: not known)
        self._at = float("-inf") if fresh_at is None else fresh_at
        if fresh_at is not None and (record.presence_s <= 0 or self._relays.vouches(record, now)):
            # written now by a relay alive now: what it wrote of this stream before came first
            self._unheard = False
            self._heard_epoch = record.epoch
        if record.kind is RelayKind.HEARTBEAT:
            self._heartbeat(record, now, fresh_at)
            self._held_since()
            self._show()
            return
        if self._proof is not None:
            if not self._prove_by_record(record, fresh_at):
                if fresh_at is not None:
                    self._heard(fresh_at)  # the relay was alive then
                self._held_since()
                self._show()
                return  # older than the snapshot, or the snapshot's own last batch
        elif self._epoch is None:
            self._epoch = record.epoch  # joined: from this record on
        elif record.epoch != self._epoch:
            self._afresh(record.epoch, _ANOTHER_RELAY, restart=True)
        elif record.rseq <= self._rseq:
            return  # seen already (a redelivery)
        elif record.rseq > self._rseq + 1:
            self._afresh(record.epoch, f"{record.rseq - self._rseq - 1} relay record(s) missed")
        self._rseq = record.rseq
        self._apply(record, fresh_at)
        self._held_since()
        self._relay_state = record.state
        self._show()

    def _from_elsewhere(self, source: str) -> None:
        """A record of the relay's subscriber reading `source`, which is not where this
        replica's worker of that id publishes (the id re-pointed at another server through one
        side's admin API or reload, not the other's): its pages are another server's. The
        stream drops what it holds, takes none of those records and is STALE (nothing
        predicted) until the relay's records name its endpoint again; then it joins afresh at
        that record, as a stream followed anew. Before, records were matched by the stream's
        id alone: QA saw the old server's prompt predicted on the new one (320 tokens, 0
        cached, 8 of 12 answers), the stream `synced`, until the false-hit watch acted."""
        if self._elsewhere is None:
            # what it held, and what it waited to prove, was the other server's
            self.sink.clear()
            self.sink.forget_seq()
            self.tracker.last = None
            self._epoch, self._rseq = None, -1
            self._proof = None
            self._skipped = []
            self._suspected_at = None
            self._anew_at = None
            self._relay_restarts = None
            self._relay_state = StreamState.SYNCING
        self._elsewhere = source
        if not self._catching_up and self.worker not in self._elsewhere_said:
            # read back, it may be the stream's past only (the relay re-pointed since)
            self._elsewhere_said.add(self.worker)
            log.warning(
                "worker %s: the relay reads its KV events (stream %s) from %s, but this "
                "replica's %s publishes them at %s: the id names another server here than on "
                "the relay (changed on one side only?); the relay's records of it are not "
                "taken and nothing of it is predicted until both name one server",
                self.worker,
                self.stream_id,
                shown_endpoint(source),
                self.worker,
                shown_endpoint(self.config.endpoint),
            )
        self._show()

    def _agreed(self, source: str) -> None:
        """The relay's records name this replica's endpoint again (or no endpoint: a relay of
        the version before): followed afresh from the record at hand."""
        self._elsewhere = None
        if self.worker in self._elsewhere_said:
            self._elsewhere_said.discard(self.worker)
            log.info(
                "stream %s: the relay reads it from %s again, where this replica's %s "
                "publishes: followed afresh from its next records",
                self.stream_id,
                shown_endpoint(source) if source else "(an endpoint it does not say)",
                self.worker,
            )

    def _apply(self, record: RelayRecord, fresh_at: float | None) -> None:
        kind = record.kind
        if kind is RelayKind.BATCH and record.seq is not None:
            if not self.sink.entries():
                self._anew_at = self._at  # all it will hold comes from this batch on
            applied = self.sink.apply(b"", record.seq, record.payload, replayed=record.replayed)
            self.tracker.last = record.seq
            if fresh_at is not None:
                self.health.last_event_at = max(fresh_at, self.health.last_event_at or fresh_at)
            self.batches += 1
            if applied is None:
                self.decode_errors += 1
            else:
                self.events += applied.events
                if applied.dp_rank is not None and applied.dp_rank != self.config.dp_rank:
                    self.rank_mismatches += 1
                mismatches = applied.block_size_mismatches
                if mismatches and self._since_followed(fresh_at):
                    self._mismatched(mismatches, record.seq)
                else:
                    self.past_mismatches += mismatches
            if self.health.block_size is None:
                self.health.block_size = self.sink.block_size()
            if self._on_applied is not None:
                self._on_applied(self.stream_id, record.seq)
        elif kind is RelayKind.CLEAR:
            self.sink.clear()  # `_held_since` decides what that proves
        elif kind is RelayKind.FORGET_SEQ:
            self.sink.forget_seq()
            self.tracker.last = None

    def _since_followed(self, fresh_at: float | None) -> bool:
        """Whether a record the relay wrote at `fresh_at` came since the stream was followed
        (None, a record of unknown age: not known to)."""
        return fresh_at is not None and fresh_at >= self.added_at

    def _mismatched(self, events: int, seq: int) -> None:
        """Pages of batch `seq` do not fit the stream's block size: said as a subscriber says
        it, and the worker's settings read again (a new process with another page size, whose
        restart this replica heard of no other way). Before, nothing told: the stream said
        `synced` and predicted nothing of the worker until the slow settings cadence (60 s)."""
        now = self._clock()
        suppressed = self._limiter.allow("block-size")
        if suppressed is not None:
            log.warning(
                "stream %s: BLOCK SIZE MISMATCH: %d event(s) at seq %d have pages that do not "
                "fit the stream's block size %s; they are NOT indexed and KV routing for this "
                "worker will miss until its settings, read again now, say its page size%s",
                self.stream_id,
                events,
                seq,
                self.sink.block_size(),
                f" ({suppressed} similar suppressed)" if suppressed else "",
            )
        if now - self._mismatch_told_at >= MISMATCH_REREAD_S:
            self._mismatch_told_at = now
            self._tell_restart()

    def _tell_restart(self) -> None:
        if self._on_restart is not None:
            self._on_restart(self.worker, self.stream_id)

    def _held_since(self) -> None:
        """After a record: a stream that holds no entry now holds nothing older than it, and
        a restart suspected here before it was written has nothing left to prove."""
        if not self.sink.entries():
            self._anew_at = self._at
        if self._suspected_at is not None and self._anew_since(self._down_at):
            self._suspected_at = None
            self.verifications += 1
            log.info(
                "stream %s: the relay's records since the worker came back left nothing older "
                "here: trusted again",
                self.stream_id,
            )

    def _anew_since(self, down_at: float) -> bool:
        """Whether all the stream holds came from records the relay wrote after `down_at`."""
        return self._anew_at is not None and self._anew_at > down_at + ANEW_MARGIN_S

    def _heard(self, at: float) -> None:
        self.health.last_heard_at = max(at, self.health.last_heard_at or at)

    def _heartbeat(self, record: RelayRecord, now: float, fresh_at: float | None) -> None:
        if fresh_at is not None:
            # the relay was alive then; whether it hears the worker is its state (STALE when
            # it has not lately: `IndexerService.stream_heads`)
            self._heard(fresh_at)
        if self._proof is not None:
            proof = self._proof
            if record.seq == proof.seq and record.digest == proof.digest():
                self._proven(record, "its last batch is the relay's")
            elif now - self._proof_since > self.verify_window_s:
                self._fail_proof(f"the relay did not show it within {self.verify_window_s:g} s")
                self._apply_skipped(record.epoch, record.rseq)
            elif record.seq is None or record.seq > proof.seq or self._proof_cleared:
                self._fail_proof("the relay's last batch is not the snapshot's")
                self._apply_skipped(record.epoch, record.rseq)
            # else: older than the snapshot (read from before it was taken): wait on
        elif self._epoch is None:
            self._epoch, self._rseq = record.epoch, record.rseq  # joined, holding nothing
        elif record.epoch != self._epoch:
            self._afresh(record.epoch, _ANOTHER_RELAY, restart=True)
            self._rseq = record.rseq
        elif record.rseq > self._rseq:
            # the heartbeat follows every record it counts: those were lost
            self._afresh(record.epoch, f"{record.rseq - self._rseq} relay record(s) missed")
            self._rseq = record.rseq
        self._checks = record.checks
        self._relay_restarted(record, fresh_at)
        if self._suspected_at is not None:
            # risen: checked since; fallen: a new subscriber of the relay's (the worker
            # registered anew there), which joined from the worker's replay: as good
            if record.checks != self._checks_then:
                self._suspected_at = None
                self.verifications += 1
            elif now - self._suspected_at > self.verify_window_s:
                self._suspected_at = None
                self._restart_here(
                    f"the relay did not check it within {self.verify_window_s:g} s of a "
                    "restart suspected here"
                )
        self._relay_state = record.state
        self._show()

    def _relay_restarted(self, record: RelayRecord, fresh_at: float | None) -> None:
        """Tell `on_restart` when the relay's count of the worker's restarts rose since its
        last heartbeat (of the same relay process: another counts from 0), in a heartbeat
        written since the stream was followed. Before, a restart reached only the relay's own
        router: a replica followed the worker's old settings (page size, ranks, role) until
        its health check saw it down or the slow settings cadence, 60 s."""
        before = self._relay_restarts
        self._relay_restarts = (record.epoch, record.restarts)
        if (
            before is not None
            and before[0] == record.epoch
            and record.restarts > before[1]
            and self._since_followed(fresh_at)
        ):
            log.info(
                "stream %s: the relay saw its publisher restart: the worker's settings are "
                "read again",
                self.stream_id,
            )
            self._tell_restart()

    def _prove_by_record(self, record: RelayRecord, fresh_at: float | None) -> bool:
        """A numbered record while a loaded snapshot waits for its proof: whether to apply it.

        The follower reads from a little before the snapshot was taken, so the relay's
        records of the time before it come first: batches older than the snapshot's last one,
        and clears and forgotten seqs that may be older too. Those are skipped, until the
        snapshot's last batch proves it. After a clear or a forgotten seq, an older seq may be
        a new publisher's, so it proves nothing either: the snapshot is dropped (fail closed)."""
        proof = self._proof
        assert proof is not None
        kind = record.kind
        if kind is RelayKind.BATCH and record.seq is not None:
            if proof.matches(record.seq, record.payload):
                self._proven(record, "the relay showed its last batch")
                self._rseq = record.rseq
                self._relay_state = record.state
                return False  # the snapshot holds it already
            if record.seq < proof.seq and not self._proof_cleared:
                # the relay's past before the snapshot: the snapshot holds it
                return self._skip(record, fresh_at)
        elif kind in (RelayKind.CLEAR, RelayKind.FORGET_SEQ):
            self._proof_cleared = True
            return self._skip(record, fresh_at)
        elif kind is RelayKind.STATE:
            self._relay_state = record.state
            return self._skip(record, fresh_at)
        # a later batch, or an older one after a clear: not the snapshot's future
        self._fail_proof("the relay went past the snapshot's last batch unseen")
        self._apply_skipped(record.epoch, record.rseq - 1)
        return True

    def _skip(self, record: RelayRecord, fresh_at: float | None) -> bool:
        """Keep a record the proof skips (`_skipped`); False: not applied now."""
        skipped = self._skipped
        if skipped is not None:
            if len(skipped) < MAX_SKIPPED:
                skipped.append((record, fresh_at))
            else:
                self._skipped = None
        return False

    def _apply_skipped(self, epoch: int, last: int) -> None:
        """The proof failed at a record of relay `epoch` that follows record `last`: apply the
        records it skipped, when they run unbroken up to `last` in that relay's numbering (the
        stream joins at the first of them, as at any record); else the stream joins at the
        record at hand. Either way it follows `epoch` from `last` on."""
        skipped, self._skipped = self._skipped, []
        self._epoch, self._rseq = epoch, last
        if not skipped:
            return
        first = skipped[0][0].rseq
        unbroken = all(r.epoch == epoch and r.rseq == first + i for i, (r, _) in enumerate(skipped))
        if not unbroken or skipped[-1][0].rseq != last:
            return
        at_hand = self._at  # (the failing record's, for what follows it)
        for record, fresh_at in skipped:
            self._at = float("-inf") if fresh_at is None else fresh_at
            if record.kind is RelayKind.STATE:
                self._relay_state = record.state
            else:
                self._apply(record, fresh_at)
        self._at = at_hand
        log.info(
            "stream %s: the %d relay record(s) read before the failed proof are applied",
            self.stream_id,
            len(skipped),
        )

    def _fail_proof(self, why: str) -> None:
        self.verifications += 1
        self._proof = None
        self._restart_here(why)

    def _proven(self, record: RelayRecord, how: str) -> None:
        self.verifications += 1
        self._proof = None
        self._skipped = []  # the snapshot holds what they did
        self._epoch, self._rseq = record.epoch, record.rseq
        log.debug("stream %s: the loaded snapshot is proven (%s)", self.stream_id, how)

    def _afresh(self, epoch: int, why: str, *, restart: bool = False) -> None:
        """Drop what the stream holds and follow `epoch` from the record at hand."""
        if restart:
            self.restarts += 1
        else:
            self.gaps += 1
        self._restart_here(why)
        self._epoch = epoch

    def _restart_here(self, why: str) -> None:
        # a restart suspected here ends only if this record came after it (`_held_since`)
        dropped = self.sink.clear()
        self.sink.forget_seq()
        self.tracker.last = None
        if dropped:
            log.warning(
                "stream %s: %s; its %d entries dropped, rebuilt from the relay's next records",
                self.stream_id,
                why,
                dropped,
            )

    # ------------------------------------------------------------ state

    def _show(self) -> None:
        unproven = self._proof is not None or self._suspected_at is not None
        state = StreamState.UNVERIFIED if unproven else self._relay_state
        if self._catching_up and state is StreamState.SYNCED:
            state = StreamState.SYNCING  # the relay's past, read back: predicts nothing
        if self._unheard or self._elsewhere is not None:
            # its relay not known alive now (`relay_lost`), or reading another server
            state = StreamState.STALE
        self.health.state = state

    def relay_lost(self, epoch: int | None = None) -> bool:
        """The relay process `epoch` is not heard alive any more (None: no relay can be heard,
        this replica's connection to NATS dropped): a stream whose last record taken as
        written now was that relay's predicts nothing (STALE) until a record of a relay alive
        now comes (`take`). Returns whether the stream was trusted to be heard until now."""
        if self._unheard or (epoch is not None and epoch != self._heard_epoch):
            return False
        self._unheard = True
        self._show()
        return True

    @property
    def relay_epoch(self) -> int | None:
        """The relay process whose records the stream last took as written now (None: none)."""
        return self._heard_epoch

    @property
    def heard(self) -> bool:
        """Whether the relay of the last record taken as written now is known alive: a record
        of it came since the stream began or its relay was last lost (`relay_lost`)."""
        return not self._unheard

    def catching_up(self, reading: bool) -> None:
        """Whether the follower is reading the stream from the relay's stored records (its
        read-back, or the relay's stream read to its end after a start or a reconnect): what
        it holds meanwhile is the worker's past, so it predicts nothing (SYNCING) until the
        follower says it reached the records written now."""
        if self._catching_up != reading:
            self._catching_up = reading
            self._show()

    def suspect_restart(self, why: str, *, down_at: float | None = None) -> None:
        """A restart suspected here (the worker's health check came back from down).
        `down_at`: when a health check last found the worker down (None: not known, now)."""
        now = self._clock()
        down_at = now if down_at is None else min(down_at, now)
        if self.tracker.last is None and not self.sink.entries():
            return  # nothing held, nothing to prove
        if self._anew_since(down_at):
            # the relay made the stream anew since (registered the worker anew before this
            # replica saw it come back): what it holds is the new process's, and the relay
            # has nothing left to check
            log.info(
                "stream %s: %s, but all it holds came from the relay's records since: trusted",
                self.stream_id,
                why,
            )
            return
        if self._suspected_at is not None:
            self._down_at = max(self._down_at, down_at)  # down again: only what came since
        else:
            self._suspected_at = now
            self._down_at = down_at
            self._checks_then = self._checks
            log.warning(
                "stream %s: %s: its entries predict nothing until the relay has checked it",
                self.stream_id,
                why,
            )
        self._show()

    def rebind(self, sink: StreamSink) -> None:
        """Switch to a loaded snapshot's sink: UNVERIFIED until the relay proves it (what the
        relay's stream keeps of it is read back: `FedStreams.on_rebound`). One the snapshot
        does not know holds nothing: it joins again at the first record read."""
        self.sink = sink
        self._hold_unproven()
        if self._proof is None:
            self._epoch, self._rseq = None, -1

    def _hold_unproven(self) -> None:
        """What the sink holds came from a snapshot: UNVERIFIED until the relay proves it."""
        sink = self.sink
        self.health.block_size = self.config.block_size or sink.block_size()
        self.tracker.last = sink.last_seq()
        fence = sink.fence()
        if fence is not None:
            self._proof = fence
            self._proof_since = self._clock()
            self._skipped = []
            self._proof_cleared = False
        elif sink.entries():
            sink.clear()  # entries no seq stands for: nothing can prove them
        # a snapshot's entries came from records of unknown time
        self._anew_at = float("-inf") if sink.entries() else self._anew_at
        self._show()

    @property
    def state(self) -> StreamState:
        """The state last decided (`current_state` adds STALE)."""
        return self.health.state

    @property
    def block_size(self) -> int | None:
        """The stream's block size, None until configured or learned."""
        return self.health.block_size

    def current_state(self, now: float | None = None) -> StreamState:
        """The state, STALE when the relay (or the worker, as the relay hears it) is silent."""
        return self.health.current_state(self._clock() if now is None else now)

    def stats(self) -> StreamStats:
        """A snapshot of this stream's state and counters (`StreamSubscriber.stats`'s shape:
        its socket fields are the worker's, as this replica discovered them)."""
        now = self._clock()
        last_event_at = self.health.last_event_at
        stats = stream_stats(
            self.stream_id,
            self.worker,
            self.config,
            self.sink.counters(),
            state=self.current_state(now),
            last_seq=self.tracker.last,
            block_size=self.sink.block_size(),
            entries=self.sink.entries(),
            last_event_age_s=None if last_event_at is None else now - last_event_at,
            batches=self.batches,
            events=self.events,
            gaps=self.gaps,
            restarts=self.restarts,
            decode_errors=self.decode_errors,
            verifications=self.verifications,
            rank_mismatches=self.rank_mismatches,
        )
        if not self.past_mismatches:
            return stats
        # the index counted them as it counts any: what alerts on the counter sees only the
        # mismatches this stream says (`_mismatched`)
        return msgspec.structs.replace(
            stats,
            block_size_mismatches=stats.block_size_mismatches - self.past_mismatches,
            skipped_events=stats.skipped_events + self.past_mismatches,
        )


class FedStreams:
    """The fed streams of a process, by worker: `indexer.subscriptions.Subscriptions`' place
    when a relay feeds the index (`IndexerService(fed=True)`). No tasks, no sockets."""

    def __init__(
        self,
        settings: IndexerConfig,
        *,
        on_applied: Callable[[str, int], None] | None = None,
        on_restart: Callable[[str, str], None] | None = None,
        clock: Callable[[], float],
        silent_after_s: float | None = None,
    ) -> None:
        self.settings = settings
        self.silent_after_s = silent_after_s  # `FedStream`'s
        # the relays heard alive: the follower tells it, every stream asks it
        self.relays = LiveRelays()
        # the workers whose relay records name another endpoint than theirs, said
        self.elsewhere_said: set[str] = set()
        self._on_applied = on_applied
        self._on_restart = on_restart
        self._clock = clock
        self.by_worker: dict[str, list[FedStream]] = {}
        self.by_stream: dict[str, FedStream] = {}
        # told each stream started (the relay follower reads back what the relay's stream
        # keeps of it, for one followed after its records were written)
        self.on_added: Callable[[FedStream], None] | None = None
        # told each stream a snapshot loaded into the running index replaced the state of
        # (the follower reads back what the relay's stream keeps of it: the batch the snapshot
        # ended on, and what follows)
        self.on_rebound: Callable[[FedStream], None] | None = None

    async def __aenter__(self) -> FedStreams:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.by_worker.clear()
        self.by_stream.clear()

    def start(
        self,
        worker: str,
        streams: Sequence[StreamConfig],
        sink_for: Callable[[str, StreamConfig], StreamSink],
    ) -> list[FedStream]:
        """Follow a worker's streams, each into `sink_for(stream id, config)`."""
        if worker in self.by_worker:
            raise ValueError(f"worker {worker!r} is followed already")
        fed = []
        for cfg in streams:
            sid = stream_id(worker, cfg.dp_rank)
            stream = FedStream(
                sid,
                worker,
                cfg,
                sink_for(sid, cfg),
                self.settings,
                clock=self._clock,
                on_applied=self._on_applied,
                on_restart=self._on_restart,
                silent_after_s=self.silent_after_s,
                relays=self.relays,
                elsewhere_said=self.elsewhere_said,
            )
            fed.append(stream)
            self.by_stream[sid] = stream
        self.by_worker[worker] = fed
        if self.on_added is not None:
            for stream in fed:
                self.on_added(stream)
        return fed

    async def stop(self, worker: str) -> list[FedStream]:
        """Stop following a worker's streams; returns them (none if unknown)."""
        fed = self.by_worker.pop(worker, [])
        for stream in fed:
            self.by_stream.pop(stream.stream_id, None)
        return fed

    def all(self) -> list[FedStream]:
        """Every fed stream, in worker order."""
        return [s for fed in self.by_worker.values() for s in fed]

    def relay_of(self, worker: str) -> tuple[int | None, bool]:
        """The relay process whose records `worker`'s streams last took as written now (None:
        none yet, or a stream not followed), and whether every one of its streams has it heard
        alive now (`FedStream.heard`): what the false-hit watch tells apart (a relay gone is
        no fault of the worker's)."""
        fed = self.by_worker.get(worker, [])
        epochs = [s.relay_epoch for s in fed if s.relay_epoch is not None]
        return (epochs[0] if epochs else None), bool(fed) and all(s.heard for s in fed)

    def other_relay_live(self, epoch: int | None) -> bool:
        """Whether a relay process other than `epoch` is heard alive now (the relay restarted:
        it subscribed to the workers anew, and its streams start afresh here)."""
        return self.relays.others_live(epoch, self._clock())
