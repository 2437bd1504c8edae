"""The outbox and the peers' bookkeeping, without a server: a fake clock, a real tracker."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from indexer.namespace import Namespace
from indexer.service import IndexerService
from router.cluster.outbox import LAZY_S, Outbox
from router.cluster.peers import Peers
from router.cluster.wire import (
    Batch,
    Begin,
    Decision,
    End,
    FirstByte,
    Goodbye,
    Heartbeat,
    OpenTicket,
    Pending,
    Shadow,
    batch_decoder,
    encoder,
)
from router.routing.load import LoadTracker, Ticket, Withdraw
from router.routing.planner import SHADOW_KEEP_S

NS = Namespace("m", None, "salt")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_the_outbox_buffers_decisions_only_while_sending_and_heartbeats_list_the_open() -> (
    None
):
    load = LoadTracker()
    outbox = Outbox()
    quiet = load.begin("w0", 10)
    outbox.committed(NS, [1, 2, 3], quiet, marked=True)  # NATS away: nothing buffered
    assert outbox.take() == []
    outbox.sending = True
    ticket = load.begin("w1", 5, 1, output_tokens=30, prompt_tokens=7)
    outbox.committed(NS, (4, 5), ticket, marked=True)
    outbox.first_byte(ticket)
    outbox.first_byte(ticket)  # once only
    outbox.finished(quiet)
    outbox.heartbeat()
    sent = outbox.take()
    assert sent[:4] == [
        Pending("w1", 1, NS, [4, 5], 2, output_tokens=30),
        Begin(2, "w1", 1, 5, output_tokens=30, prompt_tokens=7),
        FirstByte(2),
        End(1),
    ]
    assert sent[4] == Heartbeat(
        [OpenTicket(2, "w1", 1, 5, True, output_tokens=30, prompt_tokens=7)]
    )
    assert outbox.in_flight() == 1


async def test_a_routing_decision_wakes_the_publisher_an_end_waits_for_company_or_a_while() -> None:
    load = LoadTracker()
    outbox = Outbox()
    outbox.sending = True
    ticket = load.begin("w0", 5)
    outbox.committed(NS, [1, 2], ticket, marked=True)
    assert outbox.wakeup.is_set()  # a pending mark and its begin go at once
    outbox.take()
    outbox.first_byte(ticket)
    outbox.finished(ticket)
    assert not outbox.wakeup.is_set()  # both wait in the buffer (taken below)
    # a routing decision meanwhile takes them along, and the lazy wake is called off
    other = load.begin("w1", 3)
    outbox.committed(NS, [3], other, marked=False)
    assert outbox.wakeup.is_set()
    assert [type(d) for d in outbox.take()] == [FirstByte, End, Begin]
    await asyncio.sleep(LAZY_S * 2)
    assert not outbox.wakeup.is_set()
    # alone, they go within LAZY_S
    outbox.finished(other)
    started = time.monotonic()
    await asyncio.wait_for(outbox.wakeup.wait(), timeout=1.0)
    assert time.monotonic() - started >= LAZY_S * 0.5
    assert outbox.take() == [End(2)]


async def test_the_outbox_is_bounded_but_always_takes_a_heartbeat() -> None:
    load = LoadTracker()
    outbox = Outbox(max_decisions=2)
    outbox.sending = True
    for _ in range(3):
        outbox.committed(NS, [1], load.begin("w0", 1), marked=False)
    assert outbox.dropped == 1
    outbox.heartbeat()
    assert isinstance(outbox.take()[-1], Heartbeat)


async def test_peers_apply_load_heal_it_from_heartbeats_and_expire_silent_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    load = LoadTracker()
    async with IndexerService() as indexer:
        peers = Peers("me", indexer, load, timeout_s=1.0, clock=clock)
        for ticket in (1, 2):  # our id from NATS, which echoes nothing: a twin, ignored
            peers.apply(Batch("me", time.time(), [Begin(ticket, "w0", None, 10)]))
        assert load.of("w0").running == 0
        twins = [r for r in caplog.records if "another replica uses this replica_id" in r.message]
        assert len(twins) == 1  # said once, not per batch
        peers.apply(Batch("b", time.time(), [Begin(1, "w0", None, 10), Begin(2, "w0", None, 7)]))
        assert (load.of("w0").running, load.of("w0").queued_prefill_tokens) == (2, 17)
        # End(1) was lost, a Begin(3) too: the heartbeat lists what is really in flight
        lost = OpenTicket(3, "w1", 0, 4, False, 0, output_tokens=300, prompt_tokens=500)
        peers.apply(
            Batch("b", time.time(), [Heartbeat([OpenTicket(2, "w0", None, 7, True), lost])])
        )
        assert (load.of("w0").running, load.of("w0").queued_prefill_tokens) == (1, 0)
        assert (load.of("w1", 0).running, load.of("w1", 0).queued_prefill_tokens) == (1, 4)
        # the rebuilt ticket holds its whole prompt and output in the pool (before: its
        # uncached 4 tokens and the reserve, as if it had named no output)
        assert load.of("w1", 0).footprint_tokens(16) == 800
        clock.now += 0.5
        assert peers.sweep() == []
        clock.now += 0.6
        assert peers.sweep() == ["b"]
        assert load.running() == {"w0": 0, "w1": 0}
        assert peers.live() == []


class _BatchBeforeGoodbye(msgspec.Struct, array_like=True, frozen=True):
    """`Batch` as a replica from before `Goodbye` decodes it."""

    replica: str
    sent_at: float
    decisions: list[Pending | Begin | Shadow | FirstByte | End | Heartbeat]
    instance: str = ""


async def test_a_goodbye_drops_the_peer_at_once_and_an_older_replica_drops_only_its_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    load = LoadTracker()
    async with IndexerService() as indexer:
        peers = Peers("me", indexer, load, timeout_s=60.0)
        peers.apply(Batch("b", time.time(), [Begin(1, "w0", None, 10)]))
        assert (peers.live(), load.of("w0").running) == (["b"], 1)
        with caplog.at_level("INFO", logger="router.cluster.peers"):
            peers.apply(Batch("b", time.time(), [Goodbye()]))
        assert (peers.live(), load.of("w0").running) == ([], 0)  # not after 60 s
        said = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert said == [("INFO", "replica b stopped: its 1 requests in flight no longer count")]
    # a replica from before it refuses the batch (dropped and counted by `_on_message`): the
    # goodbye goes alone in its own, so nothing else is lost with it
    old = msgspec.msgpack.Decoder(_BatchBeforeGoodbye)
    with pytest.raises(msgspec.ValidationError):
        old.decode(encoder.encode(Batch("b", 1.0, [Goodbye()])))
    assert old.decode(encoder.encode(Batch("b", 1.0, [End(1)]))).decisions == [End(1)]


def test_batches_round_trip_with_the_namespace_whole() -> None:
    batch = Batch("a", 1.5, [Pending("w0", None, NS, [1, 2]), End(3)])
    assert batch_decoder.decode(encoder.encode(batch)) == batch


async def test_a_begin_carries_the_output_limit_and_one_without_it_still_decodes() -> None:
    load = LoadTracker()
    outbox = Outbox()
    outbox.sending = True
    outbox.committed(NS, [1], load.begin("w0", 3, output_tokens=64), marked=False)
    (sent,) = outbox.take()
    assert sent == Begin(1, "w0", None, 3, 64)
    wire = encoder.encode(Batch("a", time.time(), [sent]))
    assert batch_decoder.decode(wire).decisions == [Begin(1, "w0", None, 3, 64)]
    # a replica from before the field sends four slots: the limit is unknown there
    old = msgspec.msgpack.encode(["a", 0.0, [["begin", 1, "w0", None, 3]]])
    (begin,) = batch_decoder.decode(old).decisions
    assert begin == Begin(1, "w0", None, 3) and begin.output_tokens is None
    # the other replicas count it in their load as the sender does
    theirs = LoadTracker()
    async with IndexerService() as indexer:
        peers = Peers("me", indexer, theirs, timeout_s=1.0, clock=Clock())
        peers.apply(Batch("b", time.time(), [Begin(1, "w0", None, 3, 64), Begin(2, "w0", None, 3)]))
        # and its whole prompt, where it says it (the KV it may hold: 9 beside its output)
        peers.apply(Batch("b", time.time(), [Begin(3, "w0", None, 3, 64, prompt_tokens=9)]))
    mine = theirs.of("w0")
    assert (mine.running, mine.output_tokens, mine.sized) == (3, 128, 2)
    assert mine.prompt_tokens == 3 + 3 + 9  # the uncached prompt where it is not said


async def test_shadows_outlive_an_outage_and_are_sent_again_until_they_lapse() -> None:
    clock = Clock()
    outbox = Outbox(clock=clock)
    keyed = Namespace("m", None, "salt", "view-1")
    long_prompt = list(range(1000))
    outbox.shadowed(keyed, long_prompt, "w0", None)  # made while NATS was away: kept, unsent
    assert outbox.take() == []
    clock.now += SHADOW_KEEP_S - 10
    outbox.shadowed(keyed, [7, 8, 9], "w1", 1)
    outbox.sending = True  # back: both sent, each with what is left of its hour
    sent = outbox.take()
    assert [
        (d.worker, d.dp_rank, d.tokens[:3], d.keep_s) for d in sent if isinstance(d, Shadow)
    ] == [
        ("w0", None, [0, 1, 2], 10.0),
        ("w1", 1, [7, 8, 9], SHADOW_KEEP_S),
    ]
    assert isinstance(sent[0], Shadow)
    assert len(sent[0].tokens) == 256  # the head, enough for any page it is keyed on
    outbox.shadowed(keyed, [7, 8, 9], "w1", 1)  # while sending: at once, once
    assert len(outbox.take()) == 1
    clock.now += 11  # the first lapsed: a replica that joins now gets the second only
    outbox.resend_shadows()
    assert [d.worker for d in outbox.take() if isinstance(d, Shadow)] == ["w1"]
    # what the wire carries comes back whole
    again = batch_decoder.decode(encoder.encode(Batch("r", time.time(), sent)))
    assert again.decisions == sent


async def test_a_withdrawn_shadow_is_not_sent_again() -> None:
    """Review: a request the worker refused took its shadow back on every replica, yet the
    outbox kept it and sent it again (for up to an hour) when NATS came back or a replica
    joined. A shadow another request renewed since stays."""
    clock = Clock()
    load = LoadTracker()
    outbox = Outbox(clock=clock)
    outbox.sending = True
    keyed = Namespace("m", None, "salt", "view-1")

    def shadowed(tokens: list[int]) -> Ticket:
        ticket = load.begin("w0", 10)
        outbox.committed(keyed, tokens, ticket, marked=False)
        outbox.shadowed(keyed, tokens, "w0", None, ticket)
        return ticket

    def resent() -> list[list[int]]:
        outbox.take()
        outbox.resend_shadows()
        return [d.tokens for d in outbox.take() if isinstance(d, Shadow)]

    refused = shadowed([1, 2, 3])
    first, second = shadowed([4, 5, 6]), shadowed([4, 5, 6])
    for ticket in (refused, first):
        ticket.withdraw = Withdraw.ALL
        outbox.finished(ticket)
    assert resent() == [[4, 5, 6]]  # the refused one's gone; the second renewed the other
    second.withdraw = Withdraw.ALL
    outbox.finished(second)
    assert resent() == [[4, 5, 6]]  # back to the first's (withdrawn: kept, fails closed)


async def test_a_shadow_another_replica_withdrew_is_not_sent_again_here() -> None:
    """A peer's request refused by the worker took its shadow back from this replica's index,
    yet the copy kept to send again stayed, and a replica joining later was sent it (for up to
    an hour): the withdrawn shadow came back. Its End now takes the keeping back too, by the
    peer and its number for the request; one of another request, or of another peer, stays."""
    clock = Clock()
    outbox = Outbox(clock=clock)
    outbox.sending = True
    keyed = Namespace("m", None, "salt", "view-1")

    def resent() -> list[tuple[str, list[int]]]:
        outbox.take()
        outbox.resend_shadows()
        return [(d.worker, d.tokens) for d in outbox.take() if isinstance(d, Shadow)]

    def shadow(tokens: list[int], number: int, worker: str = "w0") -> Shadow:
        return Shadow(worker, None, keyed, tokens, SHADOW_KEEP_S, number)

    async with IndexerService() as indexer:
        peers = Peers("me", indexer, LoadTracker(), timeout_s=60.0, clock=clock)
        peers.shadow_seen = outbox.remember  # as `ClusterService` wires them
        peers.apply(Batch("b", time.time(), [Begin(1, "w0", None, 3), shadow([1, 2, 3], 1)]))
        peers.apply(Batch("c", time.time(), [Begin(1, "w1", None, 3), shadow([1, 2, 3], 1, "w1")]))
        peers.apply(Batch("b", time.time(), [Begin(2, "w0", None, 3), shadow([4, 5, 6], 2)]))
        clock.now += 1  # a later shadow of the same head, by another request: it renews it
        peers.apply(Batch("b", time.time(), [Begin(3, "w0", None, 3), shadow([4, 5, 6], 3)]))
        assert len(resent()) == 3
        # b's requests 1 and 2 are refused (withdraw everything), its request 3 simply ends
        ends: list[Decision] = [End(1, int(Withdraw.ALL)), End(2, int(Withdraw.ALL)), End(3)]
        peers.apply(Batch("b", time.time(), ends))
        # 1's is gone; 2's was renewed by 3 (which stored): kept; c's number 1 is not b's
        assert sorted(resent()) == [("w0", [4, 5, 6]), ("w1", [1, 2, 3])]
        assert peers._peers["b"].kept == {}
        # c's End was lost: its heartbeat lists nothing open, and the record goes, the shadow
        # stays (fail closed)
        peers.apply(Batch("c", time.time(), [Heartbeat([])]))
        assert peers._peers["c"].kept == {}
        assert ("w1", [1, 2, 3]) in resent()
