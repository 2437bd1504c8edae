"""The planner over the real IndexerService: pending entries, load accounting, namespaces."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator

import msgspec
import pytest

from indexer.protocol.events import EventBatch
from indexer.service import IndexerService, Namespace, StreamConfig
from router.config import BreakerConfig, PolicyConfig, TokenizerConfig, WorkerConfig
from router.errors import UnknownModelError
from router.prompt.request import Endpoint, parse_request
from router.prompt.tokenizer import build_tokenizer
from router.routing.admission import (
    EVENT_GRACE_S,
    UNSEEN_S,
    AdmissionForecast,
    WaitingDecisions,
)
from router.routing.load import LoadTracker
from router.routing.namespace import Fingerprinter
from router.routing.planner import Planner
from router.routing.policy import build_policy
from router.routing.pool import WorkerPool

TOK = build_tokenizer(TokenizerConfig())


def _silent_endpoint() -> str:
    """A tcp endpoint nobody publishes on (the stream stays empty)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def _planner(
    indexer: IndexerService, policy: str, models: tuple[str, ...] = ("", "")
) -> Planner:
    config = PolicyConfig(name=policy)  # type: ignore[arg-type]
    pool = WorkerPool(BreakerConfig())
    for i, model in enumerate(models):
        entry = pool.add(WorkerConfig(url=f"http://127.0.0.1:{i + 1}", id=f"w{i}", model=model))
        if not model:  # registered, advertising none: routed as one pool
            pool.set_models(entry, ())
        stream = StreamConfig(endpoint=_silent_endpoint(), block_size=16, model=model)
        await indexer.add_worker(f"w{i}", [stream])
    return Planner(config, build_policy(config), pool, indexer, LoadTracker(), Fingerprinter("k"))


@pytest.fixture
async def indexer() -> AsyncIterator[IndexerService]:
    async with IndexerService() as service:
        yield service


def _request(prompt: str, salt: str | None = None, model: str = "m"):  # type: ignore[no-untyped-def]
    body = {"prompt": prompt, "model": model, **({"cache_salt": salt} if salt else {})}
    return parse_request(Endpoint.COMPLETIONS, json.dumps(body).encode(), TOK)


def _admission_on(planner: Planner, ns: Namespace, worker: str, prompt: str) -> AdmissionForecast:
    """The admission forecast on `worker` for a request of `prompt`."""
    plan = planner.plan(_request(prompt), ns)
    there = next(c for c in plan.candidates if c.worker == worker)
    assert there.admission is not None
    return there.admission


def _queued_on(planner: Planner, ns: Namespace, worker: str, prompt: str) -> int:
    """The admission forecast's queued tokens on `worker` for a request of `prompt`."""
    return _admission_on(planner, ns, worker, prompt).queued_tokens


async def test_kv_decisions_add_pending_entries_that_siblings_follow(
    indexer: IndexerService,
) -> None:
    planner = await _planner(indexer, "kv")
    first = _request("S" * 200 + "first question", salt="t")
    ns = planner.namespace(first)
    plan = planner.plan(first, ns)
    assert all(c.matched_tokens == c.pending_tokens == 0 for c in plan.candidates)
    chosen = plan.ranked()[0]
    ticket = planner.commit(ns, first.tokens, chosen, first_try=True)
    planner.load.end(ticket)  # finished: only the pending entry keeps attracting

    sibling = _request("S" * 200 + "second question", salt="t")
    plan = planner.plan(sibling)
    best = plan.candidates[0]
    assert best.worker == chosen.worker and best.matched_tokens == 0
    assert best.pending_tokens == 192  # the 12 full 16-token pages of the shared 200 tokens
    # another tenant sees none of it
    other = planner.plan(_request("S" * 200 + "second question", salt="u"))
    assert all(c.pending_tokens == 0 for c in other.candidates)


async def test_baselines_add_no_pending_entries(indexer: IndexerService) -> None:
    planner = await _planner(indexer, "round_robin")
    req = _request("P" * 100)
    ns = planner.namespace(req)
    planner.commit(ns, req.tokens, planner.plan(req, ns).ranked()[0], first_try=True)
    assert all(c.pending_tokens == 0 for c in planner.plan(req, ns).candidates)


async def test_commit_tracks_uncached_prefill_and_running(indexer: IndexerService) -> None:
    planner = await _planner(indexer, "kv")
    req = _request("x" * 64)
    ns = planner.namespace(req)
    chosen = planner.plan(req, ns).ranked()[0]
    ticket = planner.commit(ns, req.tokens, chosen, first_try=True)
    load = planner.load.of(chosen.worker)
    assert (load.queued_prefill_tokens, load.running) == (64, 1)
    # a second identical request now sees the pending prefix and the load on that worker
    plan = planner.plan(req, ns)
    again = next(c for c in plan.candidates if c.worker == chosen.worker)
    # the prompt's last token is never a hit: 63 tokens -> 3 whole 16-token blocks
    assert again.pending_tokens == 48 and again.load == 64 + 32.0
    planner.load.end(ticket)
    assert (load.queued_prefill_tokens, load.running) == (0, 0)


async def test_request_model_selects_the_pool_and_its_namespace(indexer: IndexerService) -> None:
    planner = await _planner(indexer, "kv", models=("llama", "qwen"))
    assert planner.namespace(_request("x", model="qwen")) == Namespace(model="qwen")
    assert [c.worker for c in planner.plan(_request("x", model="qwen")).candidates] == ["w1"]
    with pytest.raises(UnknownModelError) as refused:
        planner.namespace(_request("x", model="other"))
    assert refused.value.served == ("llama", "qwen") and refused.value.status == 404
    salted = planner.namespace(_request("x", salt="s", model="llama"))
    assert salted == Namespace(model="llama", cache_salt="s")
    salted_plan = planner.plan(_request("x", salt="s", model="llama"))
    assert salted_plan.namespace != planner.plan(_request("x", model="llama")).namespace
    # the fleet's models follow membership: one model left takes every name but the one gone
    planner.pool.remove("w1")
    assert planner.namespace(_request("x", model="default")) == Namespace(model="llama")
    with pytest.raises(UnknownModelError):
        planner.namespace(_request("x", model="qwen"))
    planner.pool.add(WorkerConfig(url="http://127.0.0.1:9", id="w9", model="qwen"))
    assert planner.namespace(_request("x", model="qwen")) == Namespace(model="qwen")
    assert [c.worker for c in planner.plan(_request("x", model="qwen")).candidates] == ["w9"]


async def test_unknown_capacity_keeps_the_raw_match_and_the_plan_says_so(
    indexer: IndexerService,
) -> None:
    planner = await _planner(indexer, "kv")
    for entry in planner.pool:
        entry.caches_prompts_late = False  # it caches a prefill's prompts, then batches again
    first = _request("S" * 200 + "first question", salt="t")
    ns = planner.namespace(first)
    chosen = planner.plan(first, ns).ranked()[0]
    planner.commit(ns, first.tokens, chosen, first_try=True)
    second = _request("S" * 200 + "second question", salt="t")
    best = planner.plan(second).candidates[0]
    assert best.admission is not None and "capacity unknown" in best.admission.why
    assert best.predicted_tokens == best.pending_tokens == 192
    # one that may batch again before a prompt is cached (vLLM's, every one of unknown
    # settings): no book tells whether the first answered, so its pending part is not
    # predicted (before, it was: QA)
    for entry in planner.pool:
        entry.caches_prompts_late = True
    best = next(c for c in planner.plan(second).candidates if c.worker == chosen.worker)
    assert best.pending_tokens == 192 and best.predicted_tokens == 0
    assert best.admission is not None and "pending tokens are not predicted" in best.admission.why


async def test_a_pending_mark_whose_request_answered_without_storing_predicts_nothing(
    indexer: IndexerService,
) -> None:
    planner = await _planner(indexer, "kv")
    clock = [100.0]
    planner.clock = lambda: clock[0]
    for entry in planner.pool:
        entry.capacity_tokens = 4096
        entry.caches_prompts_late = False  # it caches a prefill's prompts, then batches again
    first = _request("S" * 200 + "first question", salt="t")
    ns = planner.namespace(first)
    chosen = planner.plan(first, ns).ranked()[0]
    ticket = planner.commit(ns, first.tokens, chosen, first_try=True)
    sibling = _request("S" * 200 + "second question", salt="t")
    # sent on the idle worker's same turn, the sibling would be admitted in the first's batch
    best = planner.plan(sibling).candidates[0]
    assert best.worker == chosen.worker and best.pending_tokens == 192
    assert best.predicted_tokens == 0
    assert best.admission is not None and "not admitted" in best.admission.why
    # on its way, taken in by the worker: the sibling is predicted to reuse the marked prefix
    clock[0] += 0.01
    best = planner.plan(sibling).candidates[0]
    assert best.worker == chosen.worker and best.predicted_tokens == 192
    # a worker that forms its next batch while that prefill runs (SGLang's overlap
    # scheduler) gives the sibling none of it until it answers
    for entry in planner.pool:
        entry.caches_prompts_late = True
    best = next(c for c in planner.plan(sibling).candidates if c.worker == chosen.worker)
    assert best.pending_tokens == 192 and best.predicted_tokens == 0
    assert best.admission is not None and "overlap scheduler" in best.admission.why
    # it answered: its stores may still be on their way (event lag), and count meanwhile
    planner.first_byte(ticket)
    planner.finish(ticket)
    best = next(c for c in planner.plan(sibling).candidates if c.worker == chosen.worker)
    assert best.pending_tokens == 192 and best.predicted_tokens == 192
    # the stream published since and the grace passed, and no event ever showed the prefix
    # stored: the mark predicts nothing
    stream = indexer.stream_ids(chosen.worker)[0]
    indexer.index.apply(stream, EventBatch(ts=0.0, events=[]), seq=1)
    clock[0] += EVENT_GRACE_S
    best = next(c for c in planner.plan(sibling).candidates if c.worker == chosen.worker)
    assert best.pending_tokens == 192 and best.predicted_tokens == 0
    assert best.admission is not None and "not on their way" in best.admission.why


async def test_the_output_a_running_request_names_counts_against_the_pool(
    indexer: IndexerService,
) -> None:
    planner = await _planner(indexer, "kv")
    for entry in planner.pool:
        entry.capacity_tokens = 4096
    first = _request("x" * 64)
    ns = planner.namespace(first)
    chosen = planner.plan(first, ns).ranked()[0]
    ticket = planner.commit(ns, first.tokens, chosen, first_try=True, output_tokens=300)
    load = planner.load.of(chosen.worker)
    assert (load.output_tokens, load.sized) == (300, 1)

    def queued() -> int:
        return _queued_on(planner, ns, chosen.worker, "x" * 64)

    # its uncached prompt, and the 300 tokens its output may take beside it
    assert queued() == 64 + 300
    # one that names no limit counts as `admission_reserve_tokens` (16): 316 on average
    other = planner.commit(ns, first.tokens, chosen, first_try=False)
    assert load.output_per_request(16) == 158.0
    assert queued() == load.queued_prefill_tokens + 2 * 158
    planner.finish(ticket)
    planner.finish(other)
    assert (load.output_tokens, load.sized, load.running) == (0, 0, 0)


async def test_a_rank_has_room_while_what_its_requests_allocate_fits_its_pool(
    indexer: IndexerService,
) -> None:
    """`policy.hold_until_room`'s test: uncached prompts and outputs of the requests in flight,
    and the new one's, against the rank's capacity; an idle rank or an unknown capacity always
    has room."""
    planner = await _planner(indexer, "kv")
    req = _request("x" * 400)  # 400 tokens (byte tokenizer), nothing cached anywhere
    ns = planner.namespace(req)
    chosen = planner.plan(req, ns).ranked()[0]
    entry = planner.pool.find(chosen.worker)
    assert entry is not None
    prompt = len(req.tokens)
    assert planner.has_room(chosen, prompt, 100)  # capacity unknown: never held
    entry.capacity_tokens = 1000
    assert planner.has_room(chosen, 5000, 100)  # idle: larger than the pool, it still goes
    first = planner.commit(ns, req.tokens, chosen, first_try=True, output_tokens=100)
    load = planner.load.of(chosen.worker)
    assert load.allocated_tokens(0) == prompt + 100
    # 500 allocated + 500 more fits 1000; one token more does not
    assert planner.has_room(chosen, prompt, 100)
    assert not planner.has_room(chosen, prompt, 101)
    # the answer's first byte does not free the pages: they stay until the request ends
    planner.first_byte(first)
    assert load.allocated_tokens(0) == prompt + 100 and not planner.has_room(chosen, prompt, 101)
    # a request that named no output counts the configured reserve
    second = planner.commit(ns, req.tokens, chosen, first_try=True)
    reserve = PolicyConfig().admission_reserve_tokens
    assert load.allocated_tokens(0) == 2 * prompt + 100
    assert load.allocated_tokens(reserve) == 2 * prompt + 100 + reserve
    assert planner.has_room(chosen, 0, 1000 - 2 * prompt - 100 - reserve)
    assert not planner.has_room(chosen, 0, 1000 - 2 * prompt - 100 - reserve + 1)
    planner.finish(first)
    planner.finish(second)
    assert load.allocated_tokens(reserve) == 0 and planner.has_room(chosen, 5000, 100)


async def test_a_match_on_a_host_tier_needs_gpu_room_as_an_uncached_prompt_does(
    indexer: IndexerService,
) -> None:
    """Blocks the index shows on a host tier (e.g. SGLang's CPU_PINNED) are loaded back into
    new GPU pages before the request runs: `has_room` counts them with the uncached prompt
    (it counted them as reused, and said room for a request the worker then queued)."""
    planner = await _planner(indexer, "kv")
    req = _request("x" * 400)
    ns = planner.namespace(req)
    chosen = planner.plan(req, ns).ranked()[0]
    entry = planner.pool.find(chosen.worker)
    assert entry is not None
    entry.capacity_tokens = 1000
    planner.commit(ns, req.tokens, chosen, first_try=True, output_tokens=100)  # 500 allocated
    prompt = len(req.tokens)
    # 24 blocks matched (no forecast: the raw match is the prediction)
    on_gpu = msgspec.structs.replace(
        chosen, matched_tokens=384, matched_blocks=24, by_medium={"GPU": 24}, admission=None
    )
    # 16 tokens to compute and 101 of output fit beside the 500
    assert on_gpu.uncached_tokens(prompt) == 16 and planner.has_room(on_gpu, prompt, 101)
    on_host = msgspec.structs.replace(on_gpu, by_medium={"CPU_PINNED": 24})
    assert on_host.uncached_tokens(prompt) == 16  # reused, not computed: scored as a hit
    # but 400 GPU pages to allocate: with 100 of output exactly the 1000, with 101 over it
    assert planner.has_room(on_host, prompt, 100)
    assert not planner.has_room(on_host, prompt, 101)
    # half on each: the GPU half is reused in place, the host half allocates
    split = msgspec.structs.replace(on_gpu, by_medium={"GPU": 12, "CPU_PINNED": 12})
    assert planner.has_room(split, prompt, 1000 - 500 - (prompt - 192))
    assert not planner.has_room(split, prompt, 1000 - 500 - (prompt - 192) + 1)


async def test_answers_and_ends_tell_the_held_requests(indexer: IndexerService) -> None:
    planner = await _planner(indexer, "kv")
    told: list[str] = []
    planner.on_progress = lambda ticket: told.append(ticket.worker)
    req = _request("hello")
    ns = planner.namespace(req)
    ticket = planner.commit(ns, req.tokens, planner.plan(req, ns).ranked()[0], first_try=True)
    planner.first_byte(ticket)
    planner.finish(ticket)
    planner.finish(ticket)  # a second end changes nothing, and says nothing
    assert told == [ticket.worker, ticket.worker]  # the held requests of its rank look again


async def test_with_holding_on_a_plan_says_whether_its_first_choice_has_room(
    indexer: IndexerService,
) -> None:
    planner = await _planner(indexer, "kv", models=("",))  # one worker: always the first choice
    req = _request("x" * 400)
    ns = planner.namespace(req)
    assert planner.plan(req, ns).candidates[0].room is None  # not asked: holding is off
    planner.reconfigure(PolicyConfig(hold_until_room=True))
    first = planner.plan(req, ns).candidates[0]
    assert first.room is True  # idle
    entry = planner.pool.find(first.worker)
    assert entry is not None
    entry.capacity_tokens = 600
    planner.commit(ns, req.tokens, first, first_try=True, output_tokens=100)
    # 500 in flight there: another 400 and the default output reserve do not fit in 600
    assert planner.plan(req, ns).candidates[0].room is False
    entry.capacity_tokens = 1000
    assert planner.plan(req, ns).candidates[0].room is True


async def test_a_held_request_weighs_on_its_rank_like_a_queued_one(
    indexer: IndexerService,
) -> None:
    """A request `policy.hold_until_room` holds for a rank counts as queued prefill there
    until released: the other requests' scores see it, as if it waited in the worker's
    queue, and turn to the other worker."""
    planner = await _planner(indexer, "kv")
    req = _request("x" * 400)
    ns = planner.namespace(req)
    before = planner.plan(req, ns).ranked()
    first, second = before[0], before[1]
    planner.load.hold(first.worker, first.dp_rank, 400)
    planner.load.hold(first.worker, first.dp_rank, 100)
    after = planner.plan(req, ns)
    held = next(c for c in after.candidates if c.worker == first.worker)
    assert held.queued_prefill_tokens == 500
    assert planner.load.total(first.worker).held_tokens == 500
    assert after.ranked()[0].worker == second.worker  # the idle one wins now
    # it is not in flight: it allocates nothing yet, and nothing runs
    load = planner.load.of(first.worker, first.dp_rank)
    assert (load.running, load.allocated_tokens(0)) == (0, 0)
    planner.load.release(first.worker, first.dp_rank, 400)
    planner.load.release(first.worker, first.dp_rank, 400)  # more than is held: floors at 0
    planner.load.release("gone", None, 10)  # a worker removed meanwhile: nothing to release
    assert load.held_tokens == 0
    again = next(c for c in planner.plan(req, ns).candidates if c.worker == first.worker)
    assert again.queued_prefill_tokens == 0


async def test_hold_output_ratio_counts_a_share_of_the_outputs_in_flight(
    indexer: IndexerService,
) -> None:
    """An engine that reserves a share of a running request's output (SGLang's
    new_token_ratio): the in-flight outputs count at `hold_output_ratio`, the new request's
    own in full."""
    planner = await _planner(indexer, "kv")
    req = _request("x" * 400)
    ns = planner.namespace(req)
    chosen = planner.plan(req, ns).ranked()[0]
    entry = planner.pool.find(chosen.worker)
    assert entry is not None
    entry.capacity_tokens = 1500
    prompt = len(req.tokens)
    planner.commit(ns, req.tokens, chosen, first_try=True, output_tokens=1000)
    # in flight: 400 + 1000 of output; another 400 + 100 does not fit 1500
    assert not planner.has_room(chosen, prompt, 100)
    planner.reconfigure(PolicyConfig(hold_output_ratio=0.1))
    load = planner.load.of(chosen.worker)
    assert load.allocated_tokens(16, 0.1) == prompt + 100
    # 400 + 100 in flight, 400 + 600 new: exactly 1500 fits; the new output counts whole
    assert planner.has_room(chosen, prompt, 600)
    assert not planner.has_room(chosen, prompt, 601)
    planner.reconfigure(PolicyConfig(hold_output_ratio=0.0))
    assert load.allocated_tokens(16, 0.0) == prompt


async def test_the_book_keeps_a_backlogs_prompts_however_deep(
    indexer: IndexerService,
) -> None:
    """The forecast's LRU stack distance counts the blocks used since a block's last use,
    and a backlog's prompts are used before a request routed now is admitted, held or not:
    the recency book keeps the keys of the decisions still waiting, up to eight pools, where
    it kept only the newest pool's worth of keys not held. Once they have answered without
    anything storing them, their keys go."""
    planner = await _planner(indexer, "kv")
    for entry in planner.pool:
        entry.capacity_tokens = 16 * 16  # a pool of 16 blocks
    stream = indexer.stream_ids("w0", None)[0]

    def send(i: int):  # type: ignore[no-untyped-def]
        request = _request(f"{i:03d}" + chr(65 + i) * 125)  # 128 tokens: 8 blocks each
        ns = planner.namespace(request)
        chosen = next(c for c in planner.plan(request, ns).candidates if c.worker == "w0")
        ticket = planner.commit(ns, request.tokens, chosen, first_try=True)
        return ticket, planner.keys.of(stream, ns, request.tokens)

    def kept(keys: list[int]) -> bool:
        stamped = {book.stamp(key) is not None for key in keys}
        assert len(stamped) == 1  # a prompt's keys go together here
        return stamped.pop()

    backlog = [send(i) for i in range(32)]  # 256 blocks waiting: sixteen pools
    book = planner.recency[stream]
    assert all(len(keys) == 8 for _, keys in backlog)
    # nothing is held (no events), yet every waiting prompt's blocks stay in the book
    assert len(book) == 256 and all(kept(keys) for _, keys in backlog)
    assert book.not_older(book.stamp(backlog[0][1][0]) or 0) == 256
    # one more, and the book prunes: the backlog beyond eight pools goes, oldest first
    backlog.append(send(32))
    assert len(book) == 128
    assert [kept(keys) for _, keys in backlog] == [False] * 17 + [True] * 16
    # they answer without any event storing their blocks: the next decision keeps its own
    # prompt and the pool's worth of the newest, and drops the rest
    for ticket, _ in backlog:
        planner.first_byte(ticket)
        planner.finish(ticket)
    _, last = send(33)
    assert len(book) == 16
    assert [kept(keys) for _, keys in backlog] == [False] * 32 + [True]
    assert kept(last)


async def test_a_pool_too_small_for_the_request_is_not_routable_while_another_holds_it(
    indexer: IndexerService,
) -> None:
    planner = await _planner(indexer, "kv")
    small, big = planner.pool.find("w0"), planner.pool.find("w1")
    assert small is not None and big is not None
    small.capacity_tokens, big.capacity_tokens = 1024, 8192
    # 2,000 prompt tokens and 4 out: only the big pool holds them. Before, the small one was
    # chosen as often as not (its charge for evicting was only what overflowed its pool)
    # and its worker's 400 went to the client
    req = parse_request(
        Endpoint.COMPLETIONS, json.dumps({"prompt": "x" * 2000, "max_tokens": 4}).encode(), TOK
    )
    ns = planner.namespace(req)
    plan = planner.plan(req, ns)
    assert plan.worker == "w1" and [c.worker for c in plan.ranked()] == ["w1"]
    (unfit,) = [c for c in plan.candidates if c.worker == "w0"]
    assert not unfit.healthy and unfit.status == "ready"
    assert unfit.unfit is not None and "holds 1024 tokens" in unfit.unfit
    assert "2000-token prompt and the 4 tokens it may generate" in unfit.unfit
    # a capacity not known is no reason: the worker may hold it
    small.capacity_tokens = None
    assert {c.worker for c in planner.plan(req, ns).ranked()} == {"w0", "w1"}
    # none can hold it: both stay routable, and the worker refuses it (a 400), as before
    small.capacity_tokens, big.capacity_tokens = 1024, 1500
    plan = planner.plan(req, ns)
    assert len(plan.ranked()) == 2 and all(c.unfit is not None for c in plan.candidates)
    # a request that names no output limit (chat) counts its first token only here; a
    # prefill side of a pair generates that token only
    big.capacity_tokens = 8192
    chat = parse_request(
        Endpoint.CHAT,
        json.dumps({"messages": [{"role": "user", "content": "x" * 1900}]}).encode(),
        TOK,
    )
    assert chat.output_tokens is None
    tight = len(chat.tokens) + 1
    small.capacity_tokens = tight
    assert {c.worker for c in planner.plan(chat, ns).ranked()} == {"w0", "w1"}
    small.capacity_tokens = tight - 1
    assert [c.worker for c in planner.plan(chat, ns).ranked()] == ["w1"]


async def test_an_answered_prompt_counts_against_the_pool_until_the_events_show_it(
    indexer: IndexerService,
) -> None:
    """A request that answered has stored its prompt, but the events saying so may reach the
    router later: meanwhile the prompt counts as queued (allocated, not in `held`). Before,
    the load dropped it at the answer and `held` gained it only with the events: the pool
    looked a prompt emptier, and a forecast of no eviction predicted a prefix the worker
    then evicted (QA: 320 tokens predicted, none cached, with events 0.3 s late)."""
    planner = await _planner(indexer, "kv")
    clock = [100.0]
    planner.clock = lambda: clock[0]
    for entry in planner.pool:
        entry.capacity_tokens = 4096
    first = _request("x" * 1600)
    ns = planner.namespace(first)
    chosen = planner.plan(first, ns).ranked()[0]
    ticket = planner.commit(ns, first.tokens, chosen, first_try=True, output_tokens=10)

    def queued() -> tuple[int, int]:
        found = _admission_on(planner, ns, chosen.worker, "y" * 64)
        return found.queued_tokens, found.unseen_tokens  # (shown by /admin/route)

    prompt = len(first.tokens)
    assert queued() == (prompt + 10, 0)  # its uncached prompt, and its output beside it
    planner.first_byte(ticket)
    stored = prompt // 16 * 16  # its whole blocks: what its events will show
    # no longer queued prefill: stored, not in the events yet
    assert queued() == (stored + 10, stored)
    clock[0] += UNSEEN_S + 0.01  # no event in a second: evicted or never made
    assert queued() == (10, 0)
    planner.finish(ticket)


def test_stores_not_in_the_events_count_until_their_last_block_is_held() -> None:
    waiting = WaitingDecisions(0.0)
    for stamp, probe in ((0, 100), (1, 200)):
        waiting.sent(
            stamp, kept_blocks=0, held_blocks=0, running=0, now=0.0, stores_blocks=5, probe=probe
        )
    held: set[int] = set()
    assert waiting.unseen(0.0, held.__contains__) == 0  # none answered yet: queued
    waiting.answered(0, first_byte=True, now=0.1)
    waiting.answered(1, first_byte=True, now=0.2)
    assert waiting.unseen(0.3, held.__contains__) == 10
    held.add(100)  # the first one's stores reached the index
    assert waiting.unseen(0.3, held.__contains__) == 5
    assert waiting.unseen(0.2 + UNSEEN_S + 0.01, held.__contains__) == 0
