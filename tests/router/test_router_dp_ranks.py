"""Data-parallel ranks behind one endpoint, end to end on 127.0.0.1.

Reference workers with two DP ranks each (one cache, one event stream, one scheduler per rank)
behind a real router: a repeated prompt must be served by the rank the index predicted, on
`/generate` (SGLang's `routed_dp_rank` body field) and the OpenAI routes (the
`X-Data-Parallel-Rank` header), so `cached_tokens` equals `x-kvroute-matched-tokens` for every
repeat. Before the router chose ranks, the engine's own round robin served about half the
repeats from the other rank (`cached_tokens` 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp

from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 16
PROMPTS = 6  # per endpoint: enough that a coin flip per repeat would fail (0.5**6 < 2%)


@contextlib.asynccontextmanager
async def dp_fleet(workers: int, dp_size: int = 2, **router: Any) -> AsyncIterator[Fleet]:
    """`workers` reference workers with `dp_size` ranks each, discovered from /server_info."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=PAGE, dp_size=dp_size)
    async with contextlib.AsyncExitStack() as stack:
        refs = {
            f"w{i}": await stack.enter_async_context(ReferenceWorker(cfg)) for i in range(workers)
        }
        config = router_config([(wid, w.url) for wid, w in refs.items()], **router)
        service = await stack.enter_async_context(RouterService(config))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        fleet = Fleet(service, refs, session)
        await fleet.warm()
        yield fleet


def _body(endpoint: str, i: int) -> dict[str, Any]:
    # distinct from the first bytes on, across endpoints too: no prompt shares a page with
    # another (chat's template adds a few tokens in front, less than a page)
    text = f"{i:02d} {endpoint} prompt {i}. " + "Lorem ipsum dolor sit amet. " * 6
    if endpoint == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": 2}}
    if endpoint == "/v1/completions":
        return {"model": "m", "prompt": text, "max_tokens": 2}
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def _cached(endpoint: str, answer: dict[str, Any]) -> int:
    if endpoint == "/generate":
        return int(answer["meta_info"]["cached_tokens"])
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _repeats_served_as_predicted(fleet: Fleet, endpoint: str) -> list[tuple[int, int]]:
    """(predicted, cached) of each repeated prompt, once the first one's events are indexed."""
    seen = []
    for i in range(PROMPTS):
        body = _body(endpoint, i)
        status, headers, answer = await fleet.post(endpoint, body)
        assert status == 200, answer
        holder = headers["x-kvroute-worker"]
        await eventually(partial(fleet.holds, body, holder, 128), what=f"prompt {i} indexed")
        status, headers, answer = await fleet.post(endpoint, body)
        assert status == 200, answer
        seen.append((int(headers["x-kvroute-matched-tokens"]), _cached(endpoint, answer)))
    return seen


def _hit_rate(seen: list[tuple[int, int]]) -> float:
    return sum(predicted == cached > 0 for predicted, cached in seen) / len(seen)


async def test_every_repeat_is_served_by_the_predicted_rank_of_one_dp2_worker() -> None:
    async with dp_fleet(1) as fleet:
        for endpoint in ("/generate", "/v1/completions", "/v1/chat/completions"):
            seen = await _repeats_served_as_predicted(fleet, endpoint)
            print(endpoint, f"repeat hits {_hit_rate(seen):.0%}", seen)
            assert _hit_rate(seen) == 1.0, (endpoint, seen)


async def test_every_repeat_is_served_by_the_predicted_rank_of_a_2x2_fleet() -> None:
    async with dp_fleet(2) as fleet:
        for endpoint in ("/generate", "/v1/completions", "/v1/chat/completions"):
            seen = await _repeats_served_as_predicted(fleet, endpoint)
            print(endpoint, f"repeat hits {_hit_rate(seen):.0%}", seen)
            assert _hit_rate(seen) == 1.0, (endpoint, seen)
