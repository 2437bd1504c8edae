"""The planner over data-parallel workers: one candidate per rank, per-rank load and marks.

A real IndexerService with real (silent) ZMQ subscriptions: the streams stay empty, so hits
come only from the pending marks the planner's own decisions leave.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator

import pytest

from indexer.service import IndexerService, StreamConfig
from router.config import BreakerConfig, PolicyConfig, TokenizerConfig, WorkerConfig
from router.prompt.request import Endpoint, ParsedRequest, parse_request
from router.prompt.tokenizer import build_tokenizer
from router.routing.load import LoadTracker
from router.routing.namespace import Fingerprinter
from router.routing.planner import Planner
from router.routing.policy import build_policy
from router.routing.pool import WorkerPool

TOK = build_tokenizer(TokenizerConfig())


def _silent_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def _planner(indexer: IndexerService, policy: str, fleet: dict[str, int]) -> Planner:
    """A planner over workers named by their dp size (0: a worker without KV events)."""
    config = PolicyConfig(name=policy)  # type: ignore[arg-type]
    pool = WorkerPool(BreakerConfig())
    for i, (worker, dp_size) in enumerate(fleet.items()):
        worker_config = WorkerConfig(
            url=f"http://127.0.0.1:{i + 1}", id=worker, kv_events=dp_size > 0
        )
        pool.set_models(pool.add(worker_config), ())  # registered, advertising no model: one pool
        streams = [
            StreamConfig(endpoint=_silent_endpoint(), block_size=16, dp_rank=rank)
            for rank in range(dp_size)
        ]
        if streams:
            await indexer.add_worker(worker, streams)
    return Planner(config, build_policy(config), pool, indexer, LoadTracker(), Fingerprinter("k"))


@pytest.fixture
async def indexer() -> AsyncIterator[IndexerService]:
    async with IndexerService() as service:
        yield service


def _request(prompt: str, **fields: object) -> ParsedRequest:
    body = {"prompt": prompt, "model": "m", **fields}
    return parse_request(Endpoint.COMPLETIONS, json.dumps(body).encode(), TOK)


async def test_a_candidate_per_rank_and_one_for_single_rank_or_eventless_workers(
    indexer: IndexerService,
) -> None:
    planner = await _planner(indexer, "kv", {"dp2": 2, "dp1": 1, "plain": 0})
    plan = planner.plan(_request("x" * 40))
    got = sorted((c.worker, c.dp_rank) for c in plan.candidates)
    assert got == [("dp1", None), ("dp2", 0), ("dp2", 1), ("plain", None)]
    states = {(c.worker, c.dp_rank): c.stream_state for c in plan.candidates}
    # (a stream that heard nothing and has no replay buffer to catch up from holds nothing:
    # synced, its pending marks trusted)
    assert states[("dp2", 1)] == "synced" and states[("plain", None)] is None


async def test_concurrent_requests_spread_over_ranks_when_hits_are_equal(
    indexer: IndexerService,
) -> None:
    planner = await _planner(indexer, "kv", {"w": 2})
    chosen = []
    tickets = []
    for i in range(2):  # different prompts: nothing cached, nothing pending in common
        req = _request(f"{i} " + "y" * 60)
        ns = planner.namespace(req)
        best = planner.plan(req, ns).ranked()[0]
        tickets.append(planner.commit(ns, req.tokens, best, first_try=True))
        chosen.append(best.dp_rank)
    assert set(chosen) == {0, 1}  # the second saw the first's load on its rank
    loads = [planner.load.of("w", rank) for rank in (0, 1)]
    assert [load.running for load in loads] == [1, 1]
    assert planner.load.total("w").running == 2
    for ticket in tickets:
        planner.finish(ticket)
    assert planner.load.total("w").running == 0


async def test_pending_marks_land_on_the_chosen_rank_only(indexer: IndexerService) -> None:
    planner = await _planner(indexer, "kv", {"w": 2, "v": 2})
    first = _request("S" * 200 + "first question", cache_salt="t")
    ns = planner.namespace(first)
    chosen = planner.plan(first, ns).ranked()[0]
    planner.finish(planner.commit(ns, first.tokens, chosen, first_try=True))

    sibling = planner.plan(_request("S" * 200 + "second question", cache_salt="t"))
    pending = {(c.worker, c.dp_rank): c.pending_tokens for c in sibling.candidates}
    assert pending.pop((chosen.worker, chosen.dp_rank)) == 192  # 12 whole pages of 200 tokens
    assert set(pending.values()) == {0}  # the other rank of that worker is another cache
    best = sibling.candidates[0]
    assert (best.worker, best.dp_rank) == (chosen.worker, chosen.dp_rank)


async def test_a_client_named_rank_is_the_only_rank_offered(indexer: IndexerService) -> None:
    planner = await _planner(indexer, "kv", {"dp2": 2, "dp1": 1, "plain": 0})
    one = planner.plan(_request("z" * 40, routed_dp_rank=1))
    # a single-rank worker refuses rank 1; a worker whose ranks are unknown is left to decide
    assert sorted((c.worker, c.dp_rank) for c in one.candidates) == [
        ("dp2", 1),
        ("plain", None),
    ]
    zero = planner.plan(_request("z" * 40, data_parallel_rank=0))
    assert sorted((c.worker, c.dp_rank) for c in zero.candidates) == [
        ("dp1", None),  # its one rank: the request (naming rank 0) goes as it is
        ("dp2", 0),
        ("plain", None),
    ]
    five = planner.plan(_request("z" * 40, routed_dp_rank=5))
    assert [(c.worker, c.dp_rank) for c in five.candidates] == [("plain", None)]


async def test_approx_tree_remembers_each_rank_apart(indexer: IndexerService) -> None:
    planner = await _planner(indexer, "approx_tree", {"w": 2})
    req = _request("q" * 64)
    ns = planner.namespace(req)
    chosen = planner.plan(req, ns).ranked()[0]
    planner.finish(planner.commit(ns, req.tokens, chosen, first_try=True))
    hits = {c.dp_rank: c.hit_tokens for c in planner.plan(req, ns).candidates}
    assert hits[chosen.dp_rank] == len(req.tokens) and hits[1 - (chosen.dp_rank or 0)] == 0
    planner.policy.forget("w")  # every rank's part of the tree goes with the worker
    assert all(c.hit_tokens == 0 for c in planner.plan(req, ns).candidates)
