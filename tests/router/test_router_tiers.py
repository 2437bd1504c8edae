"""Storage tiers end to end: a reference worker with a host tier behind a real router.

A cached prompt pushed off the GPU by other traffic stays on the worker's host tier; the
router learns it from the events (`BlockStored` CPU_PINNED, then `BlockRemoved` GPU), so its
affinity drops to the host tier's weight, the prediction still equals what the worker reuses
(`cached_tokens` counts the loaded-back pages), and once loaded back it is worth a GPU hit again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from router.config import PolicyConfig
from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 16


def prompt(i: int) -> dict[str, Any]:
    """A prompt of 8 pages and a bit, sharing no page with the others."""
    return {"input_ids": [(i * 7 + k) % 200 + 3 for k in range(8 * PAGE + 1)], "max_new_tokens": 1}


async def test_an_offloaded_prefix_scores_at_the_host_weight_and_recovers_on_a_hit() -> None:
    # room for ~2 prompts on the GPU, 8 on the host
    cfg = ReferenceConfig(
        time_scale=0.0, page_size=PAGE, capacity_tokens=20 * PAGE, host_capacity_tokens=64 * PAGE
    )
    async with ReferenceWorker(cfg) as w0:
        config = router_config([("w0", w0.url)], policy=PolicyConfig(hit_weight=1.0))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()

            async def candidate(body: dict[str, Any]) -> dict[str, Any]:
                plan = await fleet.route(body)
                (only,) = plan["candidates"]
                return only  # type: ignore[no-any-return]

            first = prompt(0)
            async with session.post(w0.url + "/generate", json=first) as resp:
                assert resp.status == 200

            async def on_gpu() -> bool:
                c = await candidate(first)
                return bool(c["matched_tokens"] == 8 * PAGE and c["hit_tokens"] == 8 * PAGE)

            await eventually(on_gpu, what="the prompt indexed on the GPU")
            # other prompts push it off the GPU: the worker moves it to its host tier
            for i in range(1, 4):
                async with session.post(w0.url + "/generate", json=prompt(i)) as resp:
                    assert resp.status == 200
            weight = PolicyConfig().medium_weights["CPU_PINNED"]

            async def on_host() -> bool:
                c = await candidate(first)
                return bool(
                    c["matched_tokens"] == 8 * PAGE and c["hit_tokens"] == weight * 8 * PAGE
                )

            await eventually(on_host, what="the prompt's pages to score at the host weight")
            # the worker reuses it from the host (loading it back), as predicted
            async with session.post(router.url + "/generate", json=first) as resp:
                assert resp.status == 200
                matched = int(resp.headers["x-kvroute-matched-tokens"])
                answer = await resp.json()
            assert matched == answer["meta_info"]["cached_tokens"] == 8 * PAGE
            await eventually(on_gpu, what="the loaded-back pages to score as GPU pages again")


async def test_a_host_tier_prefix_the_queue_ahead_will_push_out_is_forecast_lost() -> None:
    """The admission forecast covers a match on the host tier too: before, the raw match was
    used, and a host-tier prefix the worker dropped meanwhile was predicted whole."""
    cfg = ReferenceConfig(
        time_scale=1.0, prefill_ms_per_token=1.0, decode_ms_per_token=0.0, page_size=PAGE,
        capacity_tokens=20 * PAGE, host_capacity_tokens=24 * PAGE, max_running_requests=1,
    )  # fmt: skip
    async with ReferenceWorker(cfg) as w0:
        config = router_config([("w0", w0.url)], policy=PolicyConfig(hit_weight=1.0))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            first = prompt(0)
            for i in range(2):  # the first pushed off the GPU onto the host tier
                async with session.post(w0.url + "/generate", json=prompt(i)) as resp:
                    assert resp.status == 200

            async def on_host() -> bool:
                (c,) = (await fleet.route(first))["candidates"]
                return bool(c["matched_tokens"] == 8 * PAGE and "GPU" not in c["by_medium"])

            await eventually(on_host, what="the first prompt on the host tier alone")
            # six more prompts on their way, far beyond both tiers: the first's pages go
            ahead = [
                asyncio.create_task(session.post(router.url + "/generate", json=prompt(i)))
                for i in range(10, 16)
            ]
            try:

                async def queued() -> bool:
                    (c,) = (await fleet.route(first))["candidates"]
                    return bool(c["admission"]["queued_tokens"] >= 4 * 8 * PAGE)

                await eventually(queued, what="the prompts ahead counted as queued")
                (c,) = (await fleet.route(first))["candidates"]
                assert c["matched_tokens"] == 8 * PAGE
                admission = c["admission"]
                assert admission["raw_tokens"] == 8 * PAGE
                assert admission["kept_tokens"] < admission["raw_tokens"], admission
                assert "offload tier" not in admission["why"]
            finally:
                for task in ahead:
                    (await task).release()
