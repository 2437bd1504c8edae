"""A peer's decisions join the admission forecast as the sender's own planner took them in."""

from __future__ import annotations

import json
import logging
import socket
import time
from contextlib import AsyncExitStack
from typing import Any

import pytest

from indexer.protocol.events import EventBatch
from indexer.service import IndexerService, Namespace, StreamConfig
from router.cluster.outbox import Outbox
from router.cluster.peers import Peers
from router.cluster.sender_clock import WINDOW_S, SenderClock
from router.cluster.wire import Batch, Pending
from router.config import BreakerConfig, PolicyConfig, TokenizerConfig, WorkerConfig
from router.prompt.request import Endpoint, parse_request
from router.prompt.tokenizer import build_tokenizer
from router.routing.admission import EVENT_GRACE_S
from router.routing.load import LoadTracker, Ticket, Withdraw
from router.routing.namespace import Fingerprinter
from router.routing.planner import Planner
from router.routing.policy import Candidate, build_policy
from router.routing.pool import WorkerPool

TOK = build_tokenizer(TokenizerConfig())


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def _replica(
    stack: AsyncExitStack, endpoints: list[str], clock: list[float], block_size: int = 16
) -> Planner:
    """A kv planner over two workers with a 4,096-token pool each (silent streams), neither
    overlapping its batches with a prefill."""
    indexer = await stack.enter_async_context(IndexerService())
    config = PolicyConfig(name="kv")
    pool = WorkerPool(BreakerConfig())
    for i, endpoint in enumerate(endpoints):
        # registered, advertising no model: one pool
        pool.set_models(pool.add(WorkerConfig(url=f"http://127.0.0.1:{i + 1}", id=f"w{i}")), ())
        await indexer.add_worker(f"w{i}", [StreamConfig(endpoint=endpoint, block_size=block_size)])
    for entry in pool:
        entry.capacity_tokens = 4096
        # it caches a prefill's prompts before it forms its next batch: the batch rule's case
        entry.caches_prompts_late = False
    planner = Planner(
        config, build_policy(config), pool, indexer, LoadTracker(), Fingerprinter("k")
    )
    planner.clock = lambda: clock[0]
    return planner


def _publishing(planner: Planner) -> Outbox:
    """The outbox `planner` tells its decisions to, sending (as with NATS up)."""
    outbox = Outbox()
    outbox.sending = True
    planner.decisions = outbox
    return outbox


def _applying(planner: Planner, clock: list[float]) -> Peers:
    """Replica b's view of its peers: their decisions join `planner`'s book and load."""
    return Peers("b", planner.indexer, planner.load, 5.0, clock=lambda: clock[0], book=planner)


async def _sender_and_receiver(
    stack: AsyncExitStack, clock: list[float]
) -> tuple[Planner, Outbox, Planner, Peers]:
    """Two replicas over the same two workers: the sender's decisions go to its outbox, the
    receiver takes in what the outbox sends (`peers.apply`)."""
    endpoints = [_endpoint(), _endpoint()]
    sender = await _replica(stack, endpoints, clock)
    receiver = await _replica(stack, endpoints, clock)
    return sender, _publishing(sender), receiver, _applying(receiver, clock)


def _request(question: str):  # type: ignore[no-untyped-def]
    body = {"prompt": "S" * 200 + question, "model": "m", "cache_salt": "t"}
    return parse_request(Endpoint.COMPLETIONS, json.dumps(body).encode(), TOK)


def _sent(sender: Planner, request: Any, **commit: Any) -> tuple[Namespace, Candidate, Ticket]:
    """`request` planned and committed by `sender` to its first choice: (namespace, chosen
    candidate, ticket)."""
    ns = sender.namespace(request)
    chosen = sender.plan(request, ns).ranked()[0]
    return ns, chosen, sender.commit(ns, request.tokens, chosen, first_try=True, **commit)


async def test_a_sibling_of_a_peers_request_meets_the_same_batch_rule_as_on_the_sender() -> None:
    clock = [100.0]
    async with AsyncExitStack() as stack:
        sender, outbox, receiver, peers = await _sender_and_receiver(stack, clock)

        first = _request("first question")
        _, chosen, ticket = _sent(sender, first)
        peers.apply(Batch("a", time.time(), outbox.take()))

        def sibling(planner: Planner) -> tuple[int, int, str]:
            plan = planner.plan(_request("second question"), receiver.namespace(first))
            best = next(c for c in plan.candidates if c.worker == chosen.worker)
            assert best.admission is not None
            return best.pending_tokens, best.predicted_tokens, best.admission.why

        # sent on the idle worker's same turn: both replicas put the sibling in its batch
        for planner in (sender, receiver):
            pending, predicted, why = sibling(planner)
            assert (pending, predicted) == (192, 0) and "not admitted" in why
        # it answered, and no event ever showed the prefix stored (the streams published
        # since, and the grace for events on their way passed): neither predicts it
        sender.first_byte(ticket)
        sender.finish(ticket)
        peers.apply(Batch("a", time.time(), outbox.take()))
        clock[0] += EVENT_GRACE_S
        for planner in (sender, receiver):
            for stream in planner.indexer.stream_ids(chosen.worker):
                planner.indexer.index.apply(stream, EventBatch(ts=0.0, events=[]), seq=1)
        for planner in (sender, receiver):
            pending, predicted, why = sibling(planner)
            assert (pending, predicted) == (192, 0) and "not on their way" in why
        assert receiver.load.of(chosen.worker).running == 0


def _marks(
    planner: Planner, keys: list[int]
) -> tuple[dict[int | bytes, int], dict[str, list[int | None]]]:
    """What a planner holds of a routed prompt: pending bits, and its keys' stamps per book."""
    books = {stream: [book.stamp(k) for k in keys] for stream, book in planner.recency.items()}
    return dict(planner.indexer.index.pending.bits.items()), books


async def test_a_peers_decision_carries_block_keys_and_marks_what_its_tokens_would(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = [100.0]
    endpoints = [_endpoint(), _endpoint()]
    async with AsyncExitStack() as stack:
        sender = await _replica(stack, endpoints, clock)
        outbox = _publishing(sender)
        by_keys = await _replica(stack, endpoints, clock)
        by_tokens = await _replica(stack, endpoints, clock)
        other_pages = await _replica(stack, endpoints, clock, block_size=8)
        first = _request("first question")
        ns, chosen, _ = _sent(sender, first)
        sent = outbox.take()
        pending = sent[0]
        assert isinstance(pending, Pending)
        stream = sender.indexer.stream_ids(chosen.worker)[0]
        want = sender.indexer.block_keys(stream, ns, first.tokens)
        # 512 token ids would be 8 times as many numbers to decode and hash again
        assert (pending.tokens, pending.block_size, pending.keys) == ([], 16, want)
        assert len(want) == len(first.tokens) // 16 > 0
        # a sender from before the keys sends the tokens: both must leave the same marks
        old = Pending(pending.worker, pending.dp_rank, ns, list(first.tokens), pending.ticket,
                      pending.kept_tokens, pending.held_tokens)  # fmt: skip
        for planner, decision in ((by_keys, pending), (by_tokens, old)):
            _applying(planner, clock).apply(Batch("a", time.time(), [decision, *sent[1:]]))
        bits, books = _marks(by_keys, want)
        assert (bits, books) == _marks(by_tokens, want) == _marks(sender, want)
        assert bits and books == {stream: [0] * len(want)}  # marked, and touched by decision 0
        # keys for 16-token pages say nothing of 8-token ones: nothing marked, nothing touched,
        # and the lost sharing is counted and said once, not silently or per decision
        mismatched = _applying(other_pages, clock)
        with caplog.at_level(logging.WARNING, logger="router.cluster.peers"):
            for _ in range(3):
                mismatched.apply(Batch("a", time.time(), [pending]))
        assert _marks(other_pages, want) == ({}, {})
        assert mismatched.unmatched_pages == 3  # 3 decisions on the one stream
        (warning,) = [r.getMessage() for r in caplog.records]
        assert f"{stream} come with block keys for 16-token pages" in warning
        assert "8-token pages" in warning


async def test_a_peers_decision_held_up_past_the_pending_ttl_marks_nothing() -> None:
    """A decision NATS delivers late (a stalled server, shorter than the heartbeat timeout)
    marks what is left of the TTL since it was sent: one older than the TTL marks nothing.
    Before, each mark lived a whole TTL from its arrival: QA stopped NATS 2.6 s while one
    replica routed prompts and the workers were flushed; the other then predicted `pending
    560` on a worker holding nothing (3 of 3 rounds). Its load and book still count."""
    clock = [100.0]
    async with AsyncExitStack() as stack:
        sender, outbox, receiver, peers = await _sender_and_receiver(stack, clock)
        first = _request("first question")
        _, chosen, _ = _sent(sender, first)
        sent = outbox.take()
        ttl = receiver.indexer.config.pending_ttl_s

        def pending() -> int:
            plan = receiver.plan(_request("second question"), receiver.namespace(first))
            return max(c.pending_tokens for c in plan.candidates)

        peers.apply(Batch("a", time.time() - ttl - 0.6, sent))
        assert pending() == 0
        assert receiver.indexer.index.late_marks == 1  # counted (its one stream)
        assert receiver.load.of(chosen.worker).running == 1  # its request counts all the same
        peers.apply(Batch("a", time.time(), sent))  # sent just now: marked
        assert pending() == 192


async def test_a_held_decision_of_a_peer_whose_clock_runs_ahead_is_aged_by_the_lead() -> None:
    """A sender whose wall clock runs ahead made its decisions look younger than they were:
    one held up past the TTL (by 2.6 s here) read as sent just now, with the sender 3 s ahead,
    and was marked for a whole TTL on pages its worker may have flushed since. A message of its
    that reads as arriving 3 s before it was sent shows the lead, and the peer's later ages
    count it: the held decision marks nothing, an on-time one as before."""
    clock = [100.0]
    async with AsyncExitStack() as stack:
        sender, outbox, receiver, peers = await _sender_and_receiver(stack, clock)
        first = _request("first question")
        _sent(sender, first)
        sent = outbox.take()
        ttl = receiver.indexer.config.pending_ttl_s

        def pending() -> int:
            plan = receiver.plan(_request("second question"), receiver.namespace(first))
            return max(c.pending_tokens for c in plan.candidates)

        lead = 3.0
        peers.apply(Batch("a", time.time() + lead, []))  # on time: its clock is 3 s ahead
        peers.apply(Batch("a", time.time() + lead - ttl - 0.6, sent))
        assert pending() == 0 and receiver.indexer.index.late_marks == 1
        peers.apply(Batch("a", time.time() + lead, sent))  # on time: marked
        assert pending() == 192


def test_a_senders_lead_is_the_least_reading_of_the_last_minute() -> None:
    clock = SenderClock()
    assert clock.ahead_s(0.002, now=0.0) == 0.0  # behind or on time: no lead shown
    assert clock.ahead_s(-1.5, now=1.0) == 1.5
    assert clock.ahead_s(-0.5, now=2.0) == 1.5  # a later, larger reading: the least stands
    assert clock.ahead_s(0.8, now=WINDOW_S + 1.5) == 0.5  # the -1.5 went out of the window
    assert clock.ahead_s(0.8, now=WINDOW_S + 2.5) == 0.0  # and the -0.5: its clock stepped back


@pytest.mark.parametrize("withdraw", [Withdraw.PENDING, Withdraw.ALL])
async def test_a_failed_requests_marks_are_withdrawn_on_every_replica(withdraw: Withdraw) -> None:
    """A request the worker refused (or that never reached it) stores nothing: its end takes
    its pending marks back on the sender and on the replicas it told (its `End` says so), and
    its shadows too when the worker stored nothing for sure (before, a refused request's marks
    steered the siblings of every replica to a worker that held nothing for them)."""
    clock = [100.0]
    async with AsyncExitStack() as stack:
        sender, outbox, receiver, peers = await _sender_and_receiver(stack, clock)
        body = {"prompt": "S" * 200 + "q", "model": "m", "cache_salt": "t", "extra_key": "k"}
        keyed = parse_request(Endpoint.COMPLETIONS, json.dumps(body).encode(), TOK)
        first = _request("first question")
        tickets = []
        for request in (first, keyed):
            ns = sender.namespace(request)
            chosen = sender.plan(request, ns).ranked()[0]
            tickets.append(sender.commit(ns, request.tokens, chosen, first_try=True))
        peers.apply(Batch("a", time.time(), outbox.take()))

        def pending(planner: Planner) -> int:
            plan = planner.plan(_request("second question"), planner.namespace(first))
            return max(c.pending_tokens for c in plan.candidates)

        def shadows(planner: Planner) -> int:
            return len(planner.indexer._shadowed)

        assert [pending(p) for p in (sender, receiver)] == [192, 192]
        made = shadows(sender)
        assert made > 0 and shadows(receiver) == made
        for ticket in tickets:
            ticket.withdraw = withdraw
            sender.finish(ticket)
        peers.apply(Batch("a", time.time(), outbox.take()))
        assert [pending(p) for p in (sender, receiver)] == [0, 0]
        kept = 0 if withdraw is Withdraw.ALL else made  # a 5xx may have stored: fail closed
        assert [shadows(p) for p in (sender, receiver)] == [kept, kept]


async def test_a_peers_request_waiting_for_room_is_waiting_on_every_replica() -> None:
    """The sender's request P cannot fit beside a long one decoding (its output counted): it
    waits for room, and a request behind it is predicted none of P's prefix. The receiver
    booked P with the reserve (16 tokens) for its output, as the `Pending` carried none: P fit
    there, was taken as admitted, and the request behind it, routed by that replica, was
    predicted P's prefix, which the worker admitted in the same batch (QA: 4 of 4 rounds,
    176 tokens predicted, 0 cached)."""
    clock = [100.0]
    async with AsyncExitStack() as stack:
        sender, outbox, receiver, peers = await _sender_and_receiver(stack, clock)
        long = _request("a long answer")
        ns = sender.namespace(long)
        chosen = sender.plan(long, ns).ranked()[0]
        # with its prompt, 3,727 tokens of the 4,096-token pool: P's 232 fit beside it with
        # the reserve's 16 for its output, not with its 300
        decoding = sender.commit(ns, long.tokens, chosen, first_try=True, output_tokens=3500)
        sender.first_byte(decoding)  # admitted, decoding
        waiting = _request("P, a question of its own")
        sender.commit(ns, waiting.tokens, chosen, first_try=True, output_tokens=300)
        peers.apply(Batch("a", time.time(), outbox.take()))
        # time passes and the worker publishes: a request with room would be admitted by now
        clock[0] += 1.0
        for planner in (sender, receiver):
            for stream in planner.indexer.stream_ids(chosen.worker):
                planner.indexer.index.apply(stream, EventBatch(ts=0.0, events=[]), seq=1)

        for planner in (sender, receiver):
            plan = planner.plan(_request("R, behind it"), planner.namespace(long))
            best = next(c for c in plan.candidates if c.worker == chosen.worker)
            assert best.admission is not None
            assert best.admission.awaiting_room == 1, best.admission.why
            assert (best.pending_tokens, best.predicted_tokens) == (192, 0), best.admission.why
