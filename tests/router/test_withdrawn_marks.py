"""A request the worker refuses stores nothing: what routing marked for it is taken back.

Before, its pending marks steered its siblings to that worker for `pending_ttl_s` (predicted
272 tokens, cached 0), and an extra_key request's shadow hid the worker's real plain pages
for an hour. A batch whose salt list does not fit it is refused by the router itself, as
SGLang refuses it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from indexer.namespace import Namespace
from tests.router.conftest import Fleet, eventually, one_worker_fleet
from workers.config import WorkerConfig as ReferenceConfig

IDS = list(("A prompt whose request the worker refuses, long enough for pages. " * 5).encode())
REFUSED = {"max_new_tokens": -5}  # the worker's 400: nothing scheduled, nothing stored


async def _pending(fleet: Fleet, body: dict[str, Any]) -> dict[str, int]:
    plan = await fleet.route(body, endpoint="/generate")
    return {c["worker"]: int(c["pending_tokens"]) for c in plan["candidates"]}


async def test_a_refused_requests_pending_marks_are_withdrawn(fleet: Fleet) -> None:
    body = {"input_ids": IDS, "cache_salt": "t", "sampling_params": REFUSED}
    status, headers, _ = await fleet.post("/generate", body)
    assert status == 400 and headers["x-kvroute-worker"] in fleet.workers
    plain = {"input_ids": IDS, "cache_salt": "t"}
    assert await _pending(fleet, plain) == {"w0": 0, "w1": 0}
    # a request the worker took is predicted to its siblings as before (marked, then stored)
    ok = {**body, "sampling_params": {"max_new_tokens": 1}}
    status, headers, _ = await fleet.post("/generate", ok)
    assert status == 200
    plan = await fleet.route(plain, endpoint="/generate")
    best = next(c for c in plan["candidates"] if c["worker"] == headers["x-kvroute-worker"])
    # (its stream state shown on failure: a stream not `synced` predicts nothing, pending marks
    # included; the fleet fixture waits for `synced`)
    assert best["matched_tokens"] + best["pending_tokens"] >= 256, best


async def test_a_refused_extra_key_request_does_not_hide_the_plain_pages() -> None:
    async with one_worker_fleet() as fleet:
        plain = {"input_ids": IDS, "cache_salt": "t", "sampling_params": {"max_new_tokens": 1}}
        assert (await fleet.post("/generate", plain))[0] == 200
        await eventually(lambda: fleet.holds(plain, "w0", 256), what="the prompt indexed")
        keyed = {**plain, "extra_key": "conv-1", "sampling_params": REFUSED}
        assert (await fleet.post("/generate", keyed))[0] == 400
        assert await fleet.holds(plain, "w0", 256)  # was 0: shadowed for an hour
        status, headers, answer = await fleet.post("/generate", plain)
        assert status == 200
        assert int(headers["x-kvroute-matched-tokens"]) == answer["meta_info"]["cached_tokens"]
        assert answer["meta_info"]["cached_tokens"] >= 256
        # one the worker took shadows its blocks as before: its copies are the key's (the
        # plain ones are there too: two copies of each page, one extra_key, once its events
        # are in, and the plain hit stands)
        keyed["sampling_params"] = {"max_new_tokens": 1}
        assert (await fleet.post("/generate", keyed))[0] == 200
        assert len(fleet.router.planner.indexer._shadowed) >= 16
        await eventually(lambda: fleet.holds(plain, "w0", 256), what="two copies indexed")
        status, headers, answer = await fleet.post("/generate", plain)
        assert int(headers["x-kvroute-matched-tokens"]) == answer["meta_info"]["cached_tokens"]


async def test_a_batch_whose_salt_list_does_not_fit_is_refused_by_the_router(
    fleet: Fleet,
) -> None:
    for field in ("cache_salt", "extra_key"):
        body = {"input_ids": [IDS, IDS], field: ["a"], "sampling_params": {"max_new_tokens": 1}}
        status, headers, error = await fleet.post("/generate", body)
        assert status == 400 and "x-kvroute-worker" not in headers  # never sent
        assert f"{field} has 1 items for a batch of 2 prompts" in error["error"]["message"]
        assert await _pending(fleet, {"input_ids": IDS, field: "a"}) == {"w0": 0, "w1": 0}
    # one per prompt, or one for all, as before
    for salts in (["a", "b"], "a"):
        body = {
            "input_ids": [IDS, IDS],
            "cache_salt": salts,
            "sampling_params": {"max_new_tokens": 1},
        }
        assert (await fleet.post("/generate", body))[0] == 200


async def test_a_request_that_can_reuse_nothing_marks_nothing_pending() -> None:
    """A request whose prompt the engine may store under other keys than the router's tokens
    (media, a cut prompt, embeddings; `reuse_limit` 0) marked its tokens pending all the same:
    while it ran, a sibling was predicted a prefix the worker was not making (vLLM's
    `truncate_prompt_tokens` keeps the prompt's end: 272 tokens predicted, none there)."""
    # a prefill of about 1.6 s: its pages are stored (and their events sent) only after it
    cfg = ReferenceConfig(page_size=16, prefill_ms_per_token=5.0)
    async with one_worker_fleet(cfg) as fleet:
        plain = {"input_ids": IDS, "cache_salt": "t"}
        # the salt's pages known to the index, so its prompts have keys there
        other = {"input_ids": [7] * 40, "cache_salt": "t"}
        assert (await fleet.post("/generate", other))[0] == 200
        await eventually(lambda: fleet.holds(other, "w0", 32), what="a page of the salt")
        # return_logprob from the first token: nothing the router predicts is reused
        capped = {
            **plain,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1},
        }
        running = asyncio.create_task(fleet.post("/generate", capped))

        async def admitted() -> bool:
            _, workers = await fleet.admin("GET", "/workers")
            return bool(workers["workers"][0]["running"] == 1)

        await eventually(admitted, what="the capped request to run")
        assert await _pending(fleet, plain) == {"w0": 0}
        # nor did it make its tokens the most recently used there (review: the forecast
        # took blocks it never touched to survive eviction)
        planner = fleet.router.planner
        (stream,) = planner.indexer.stream_ids("w0")
        keys = planner.keys.of(
            stream, Namespace(planner.pool.get("w0").cache_model, None, "t"), IDS
        )
        assert keys and all(planner.recency[stream].stamp(k) is None for k in keys)
        status, _, _ = await running
        assert status == 200
