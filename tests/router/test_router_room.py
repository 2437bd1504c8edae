"""Room before reuse, end to end: an idle fleet fills its free pools before it evicts.

Prompts that share only their first page, sent one after another, each find that page on the
worker that got the first of them. Its pool fills after a few; from then on, the page is worth
less than what the next prompt would evict there while the other worker has room
(`[policy] room_weight`), so the prompts spread and all of them stay cached, where before they
all went to the first worker, which evicted each for the next: the second pass found one page.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import aiohttp

from router.config import PolicyConfig
from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 4
HEAD = [7] * PAGE  # the one page every prompt shares
PROMPTS = 4
PROMPT_PAGES = 24  # 4 prompts of 24 pages: 96 pages, room for 52 per worker


def prompt(i: int) -> dict[str, Any]:
    ids = HEAD + [(i * 53 + k) % 190 + 10 for k in range((PROMPT_PAGES - 1) * PAGE)]
    return {"input_ids": [*ids, 5], "sampling_params": {"max_new_tokens": 1}}


async def _fleet_run(room_weight: float) -> tuple[set[str], list[int]]:
    """Where the first pass went, and what each prompt of the second found cached."""
    cfg = ReferenceConfig(page_size=PAGE, capacity_tokens=52 * PAGE, time_scale=0.01)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        config = router_config(
            [("w0", w0.url), ("w1", w1.url)], policy=PolicyConfig(room_weight=room_weight)
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            w0.flush_all()  # the warm-up pokes went around the router: start empty
            w1.flush_all()
            await eventually(lambda: _empty(fleet), what="the flushes to reach the index")
            placed: set[str] = set()
            for i in range(PROMPTS):
                status, headers, _ = await fleet.post("/generate", prompt(i))
                assert status == 200
                worker = headers["x-kvroute-worker"]
                placed.add(worker)
                body = prompt(i)
                await eventually(
                    partial(fleet.holds, body, worker, PROMPT_PAGES * PAGE),
                    what=f"prompt {i} indexed",
                )
            cached = []
            for i in range(PROMPTS):
                status, headers, answer = await fleet.post("/generate", prompt(i))
                assert status == 200
                found = int(answer["meta_info"]["cached_tokens"])
                assert int(headers["x-kvroute-matched-tokens"]) <= found  # never a false hit
                cached.append(found)
            return placed, cached


async def _empty(fleet: Fleet) -> bool:
    plan = await fleet.route(prompt(0))
    return all(c["matched_tokens"] == 0 for c in plan["candidates"])


async def test_an_idle_fleet_fills_its_free_pools_before_it_evicts_for_one_shared_page() -> None:
    placed, cached = await _fleet_run(room_weight=PolicyConfig().room_weight)
    assert placed == {"w0", "w1"}
    # every prompt kept: all its pages but the last, partly filled one
    assert cached == [PROMPT_PAGES * PAGE] * PROMPTS


async def test_without_room_weight_the_shared_page_pulls_every_prompt_to_one_pool() -> None:
    placed, cached = await _fleet_run(room_weight=0.0)
    assert len(placed) == 1  # the page's holder wins every time: the other pool stays empty
    assert min(cached) <= PAGE  # and evicted what the fleet had room for


async def test_a_prompt_too_big_for_one_pool_goes_to_the_pool_that_holds_it() -> None:
    small = ReferenceConfig(page_size=16, capacity_tokens=1024, time_scale=0.01)
    big = ReferenceConfig(page_size=16, capacity_tokens=8192, time_scale=0.01)
    async with ReferenceWorker(small) as w0, ReferenceWorker(big) as w1:
        config = router_config([("w0", w0.url), ("w1", w1.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            # 2,000 prompt tokens and 4 out: w0's pool cannot hold them. Before, w0 was
            # chosen for 8 of 12 such prompts (QA) and its 400 went to the client
            for i in range(6):
                ids = [(i * 31 + k) % 200 + 3 for k in range(2000)]
                body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}
                plan = await fleet.route(body)
                (unfit,) = [c for c in plan["candidates"] if c["worker"] == "w0"]
                assert plan["worker"] == "w1" and not unfit["healthy"]
                assert "KV pool holds 1024 tokens" in unfit["unfit"]
                status, headers, _ = await fleet.post("/generate", body)
                assert status == 200 and headers["x-kvroute-worker"] == "w1"
            # too big for both: the worker it goes to refuses it, as before
            body = {"input_ids": [9] * 9000, "sampling_params": {"max_new_tokens": 4}}
            status, _, answer = await fleet.post("/generate", body)
            assert status == 400 and "do not fit" in answer["error"]["message"], answer
