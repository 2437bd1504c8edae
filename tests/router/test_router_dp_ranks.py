"""Data-parallel ranks behind one endpoint, end to end on 127.0.0.1.

Reference workers with two DP ranks each (one cache, one event stream, one scheduler per rank)
behind a real router: a repeated prompt must be served by the rank the index predicted, on
`/generate` (SGLang's `routed_dp_rank` body field) and the OpenAI routes (the
`X-Data-Parallel-Rank` header), so `cached_tokens` equals `x-kvroute-matched-tokens` for every
repeat. Before the router chose ranks, the engine placed each request itself: with SGLang's
load-driven DP controller about half the repeats land on the other rank (`cached_tokens` 0);
with the reference worker's strict round robin a prompt and its repeat always split, so these
tests saw 0 of 6 repeats served as predicted on every route, and now see 6 of 6.
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
async def dp_fleet(
    workers: int, dp_size: int = 2, worker: ReferenceConfig | None = None, **router: Any
) -> AsyncIterator[Fleet]:
    """`workers` reference workers with `dp_size` ranks each, discovered from /server_info."""
    cfg = worker or ReferenceConfig(time_scale=0.0, page_size=PAGE, dp_size=dp_size)
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


async def test_the_dry_run_and_the_answer_name_the_rank() -> None:
    async with dp_fleet(2) as fleet:
        body = _body("/v1/completions", 90)
        plan = await fleet.route(body)
        assert sorted((c["worker"], c["dp_rank"]) for c in plan["candidates"]) == [
            ("w0", 0),
            ("w0", 1),
            ("w1", 0),
            ("w1", 1),
        ]
        first = plan["candidates"][0]
        assert (plan["worker"], plan["dp_rank"]) == (first["worker"], first["dp_rank"])
        assert all(c["stream_state"] == "synced" for c in plan["candidates"])
        status, headers, _ = await fleet.post("/v1/completions", body)
        assert status == 200
        assert (headers["x-kvroute-worker"], headers["x-kvroute-dp-rank"]) == (
            first["worker"],
            str(first["dp_rank"]),
        )
        # none routable: counted in workers, their ranks beside (it said "among 4" of 2), and
        # why they are out
        for worker in ("w0", "w1"):
            assert (await fleet.admin("POST", f"/workers/{worker}/drain"))[0] == 200
        status, _, answer = await fleet.post("/v1/completions", body)
        assert status == 503
        assert answer["error"]["message"] == "no routable worker among 2 (4 ranks): 2 draining"


async def test_two_concurrent_requests_spread_over_the_ranks() -> None:
    # slow decoding, so the first request is still running when the second is routed
    slow = ReferenceConfig(
        time_scale=1.0, page_size=PAGE, dp_size=2, prefill_ms_per_token=0, decode_ms_per_token=20
    )
    async with dp_fleet(1, worker=slow) as fleet:
        long = {"prompt": "a first prompt " * 4, "max_tokens": 50, "stream": True}
        async with fleet.session.post(fleet.url + "/v1/completions", json=long) as streaming:
            assert streaming.status == 200
            await streaming.content.readany()  # running on its rank now
            busy = int(streaming.headers["x-kvroute-dp-rank"])
            plan = await fleet.route({"prompt": "another prompt " * 4, "max_tokens": 1})
            running = {c["dp_rank"]: c["running"] for c in plan["candidates"]}
            assert running == {busy: 1, 1 - busy: 0}
            async with fleet.session.get(fleet.url + "/metrics") as resp:
                metrics = await resp.text()
            assert f'kvroute_dp_rank_in_flight_requests{{dp_rank="{busy}",worker="w0"}} 1.0' in (
                metrics
            )
            status, headers, _ = await fleet.post(
                "/v1/completions", {"prompt": "another prompt " * 4, "max_tokens": 1}
            )
            assert status == 200 and headers["x-kvroute-dp-rank"] == str(1 - busy)


async def test_pending_marks_land_on_the_chosen_rank_only() -> None:
    async with dp_fleet(2) as fleet:
        # an extra_key request: no KV event can vouch for it, so only pending marks show
        body = {**_body("/generate", 91), "extra_key": "session-1"}
        status, headers, _ = await fleet.post("/generate", body)
        assert status == 200
        chosen = (headers["x-kvroute-worker"], int(headers["x-kvroute-dp-rank"]))
        plan = await fleet.route(body)
        pending = {(c["worker"], c["dp_rank"]): c["pending_tokens"] for c in plan["candidates"]}
        assert pending.pop(chosen) > 0
        assert set(pending.values()) == {0}
        # and a sibling follows the mark to that very rank
        status, headers, answer = await fleet.post("/generate", body)
        assert (headers["x-kvroute-worker"], int(headers["x-kvroute-dp-rank"])) == chosen
        assert answer["meta_info"]["dp_rank"] == chosen[1]


async def test_a_client_named_rank_is_honoured_with_that_ranks_match() -> None:
    async with dp_fleet(1) as fleet:
        text = {
            "text": "92 a prompt the client pins. " * 6,
            "sampling_params": {"max_new_tokens": 1},
        }
        status, headers, answer = await fleet.post("/generate", {**text, "routed_dp_rank": 1})
        assert status == 200 and answer["meta_info"]["dp_rank"] == 1
        assert headers["x-kvroute-dp-rank"] == "1"
        pinned0 = {**text, "routed_dp_rank": 0}
        await eventually(partial(fleet.holds, text, "w0", 128), what="rank 1's prefix indexed")
        # rank 0 holds none of it: the router says so, and sends it there all the same
        status, headers, answer = await fleet.post("/generate", pinned0)
        assert answer["meta_info"]["dp_rank"] == 0
        assert (
            headers["x-kvroute-matched-tokens"] == "0" == str(answer["meta_info"]["cached_tokens"])
        )
        # the deprecated spelling, back to rank 1: its own match, which the worker confirms
        status, headers, answer = await fleet.post("/generate", {**text, "data_parallel_rank": 1})
        assert answer["meta_info"]["dp_rank"] == 1
        assert int(headers["x-kvroute-matched-tokens"]) == answer["meta_info"]["cached_tokens"] > 0
        # the OpenAI routes: the header (any case) names the rank

        async def both_ranks_indexed() -> bool:
            # rank 0 computed the prefix just now: its stores trail the answer
            plan = await fleet.route(text)
            held = {c["dp_rank"]: int(c["matched_tokens"]) for c in plan["candidates"]}
            return held.get(0, 0) >= 128 and held.get(1, 0) >= 128

        await eventually(both_ranks_indexed, what="both ranks' prefixes indexed")
        prompt = {"model": "m", "prompt": text["text"], "max_tokens": 1}
        for rank in (1, 0):
            status, headers, answer = await fleet.post(
                "/v1/completions", prompt, headers={"x-data-parallel-rank": str(rank)}
            )
            assert status == 200 and headers["x-kvroute-dp-rank"] == str(rank)
            assert int(headers["x-kvroute-matched-tokens"]) == _cached("/v1/completions", answer)
        # a rank no worker has is the client's mistake, named
        status, _, answer = await fleet.post("/generate", {**text, "routed_dp_rank": 2})
        assert status == 400 and "dp rank 2" in answer["error"]["message"]
        # and the dry run says what the request would get
        status, dry = await fleet.admin("POST", "/route", {**text, "routed_dp_rank": 2})
        assert status == 400 and dry["error"]["message"] == answer["error"]["message"]
        status, _, answer = await fleet.post(
            "/v1/completions", prompt, headers={"X-Data-Parallel-Rank": "first"}
        )
        assert status == 400 and "X-Data-Parallel-Rank" in answer["error"]["message"]
