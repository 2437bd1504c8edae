"""Whose the sockets are: a replay socket trusted only once its bytes agree with the live
stream's, found out when it is another publisher's, and the two sockets disagreeing.

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
  both sockets and, by what the worker advertises, the suspect.
"""

from __future__ import annotations

from indexer.config import shown_endpoint
from indexer.stats import StreamState
from indexer.stream.state import SubscriberState, batch_digest, log, undecodable

__all__ = ["Disagreement"]

# while a stream's event and replay sockets disagree (`_disagree`), a live batch is asked
# of the replay socket at most this often as batches come (an answer from a seq far below its
# newest is its whole buffer); a quiet stream asks for its newest at each probe
_AGREE_EVERY_S = 1.0


class Disagreement(SubscriberState):
    """Finds a replay socket out, or the two sockets disagreeing, and their agreement again."""

    async def _followed_on(self, seq: int, payload: bytes) -> None:
        """Live batch `seq` follows on what a replay socket not yet trusted brought:
        following on in seq proves nothing (another worker's buffer ending at `seq` - 1 is
        followed on too), so the socket is asked for `seq` once: a publisher buffers what it
        sent, so its own socket gives this very batch back."""
        if not self._replay_unconfirmed or self._proof_asked or not self._has_replay:
            return
        self._proof_asked = True
        answered, copy = await self._replayed_copy(seq)
        if copy is not None and batch_digest(copy) == batch_digest(payload):
            self._trust_replay()
        elif answered:
            self._disagree(
                f"live batch {seq} is not in what the replay socket gives back at that seq"
                if copy is None
                else f"the replay socket gives another batch than live batch {seq} at that seq"
            )

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
        if undecodable(payload):
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
        if self._disagreeing is None or copy is None or batch_digest(copy) != batch_digest(payload):
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
