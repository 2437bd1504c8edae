"""Restart candidates: signs that a stream's publisher may have restarted, and their proof.

Restart candidates make the stream UNVERIFIED (its entries predict no hit) until a replay held
to the epoch fence (`indexer.stream.replay_answers`) proves it: the event connection dropping
(a socket monitor on the SUB sees it at once), the replay connection dropping (the DEALER,
connected at all times, has a monitor too, and a heartbeat that drops a connection whose
process went silent, also behind a hop that hides its close: events through a forwarder keep
the SUB connected while the worker restarts behind it; `_replay_link`), a replay answer that
did not come (its DEALER reset). After either of those two the proof asks from an older fence
than the newest (`_owed_fence`: a drop, from a batch applied before its process may have gone
silent, `_settled_fence`; an unanswered replay, from the last whole answer's), as a new
process's batch that followed on may have been applied before the sign was seen, and no live
batch is applied while the replay connection is away; the worker's health check coming back
from down (`suspect_restart`), and a snapshot loaded at startup. A proof whose replays all
answered to their end proves the stream's tail too (SYNCED at once); one whose replay timed out
(a busy machine) clears what it could not prove, trusts nothing it brought in part, and asks
again soon, with a short bounded back-off, until an answer ends (SYNCING while nothing is
held).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import zmq
import zmq.asyncio

from indexer.fence import BatchFence
from indexer.replay_client import silence_bound_s
from indexer.sink import keeps_entries
from indexer.stats import StreamState
from indexer.stream.replay_answers import Continuity
from indexer.stream.state import SubscriberState

if TYPE_CHECKING:
    from indexer.stream.subscriber import StreamSubscriber

__all__ = ["RestartCandidates"]

log = logging.getLogger("indexer.stream")

# live messages read between two looks at the replay DEALER's monitor while the SUB has more
# queued (`_replay_link`; every time after an idle wait): a restart takes far longer than
# reading these, and a look costs a microsecond or two
_LINK_EVERY = 32
# A replay connection's drop comes up to `silence_bound_s` (1.25 x `replay_timeout_s`) after
# its process went silent (the DEALER's heartbeat), and is read by the loop a little later
# still (a look every `_LINK_EVERY` messages; a stall past `loop_watch.STALL_S` suspects every
# stream anyway), libzmq's timers a little late on a loaded host: a batch applied longer than
# the bound plus this slack before the drop was read came before the process went silent, so
# it is one of that process's (`_settled_fence`)
_SETTLE_SLACK_S = 1.0


class RestartCandidates(SubscriberState):
    """Takes the signs of a restart and proves the stream against its publisher's fence."""

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
                # (a part of a `StreamSubscriber`, the one class that combines the parts)
                self._on_siblings(cast("StreamSubscriber", self), "dropped its replay connection")
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

    def suspect_restart(self, why: str, *, sibling: bool = False, routine: bool = False) -> None:
        """A sign that the publisher may have restarted: trust nothing until a replay proves it.

        The stream turns UNVERIFIED at once (its entries predict no hit) and is checked against
        its fence as soon as it is connected (module docstring). `sibling`: the sign is that
        another rank of the worker found its own publisher restarted. `routine`: no sign, a
        snapshot's state loaded, said at INFO: every warm start did it, one WARNING per stream
        proven milliseconds later; its outcome is said once (`_loaded_outcome`), a clear
        with a WARNING, and a cluster's warm start warns of the streams still unproven.
        """
        if self.tracker.last is None and not self.sink.entries():
            return  # nothing held, nothing to prove
        if not self._unverified:
            said = (
                f"{why}: its entries predict nothing until a replay proves them"
                if keeps_entries(self.sink)
                else f"{why}: checking through the replay socket whether its publisher restarted"
            )
            if routine:
                log.info("stream %s: %s", self.stream_id, said)
            else:
                self._warn("suspect", said)
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
        mark = self._delivery_mark()
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
        if result.continuity is Continuity.NONE:
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
        if self.restarts == restarts and result.continuity is Continuity.PROVEN:
            self._loaded_outcome(f"proven at seq {last}: {self.sink.entries()} entries")
        # else the clear that dropped the snapshot's state said why (`_clear`)
        self._trust()
        self._undelivered_since(mark, "a restart's proof")  # (past the live path)
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

    @property
    def proves_restarts(self) -> bool:
        """Whether a suspected restart is proven through a replay socket (else it clears)."""
        return self._has_replay

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
