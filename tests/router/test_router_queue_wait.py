"""The wait for a place in a full batch, end to end: a burst of one long prompt spreads.

Two reference workers run 2 requests at once each (`max_running_requests`, which the router
reads from their `/server_info`). A burst of one 1,024-token prompt: the first request caches
it on a worker, and its pending marks make every sibling a hit there. Before, each sibling
counted there as one more running request (`decode_weight`, 32 prefill tokens) against a hit
worth 4 x 1,008, so the whole burst queued on that worker while the other idled. A request's
run is 20 output tokens x `decode_step_weight` (200, the workers' 10 ms step over 0.05 ms per
prompt token) = 4,000 prefill tokens, so the third request of the burst would wait half a run
for a place, longer than prefilling the prompt elsewhere: it goes to the other worker, and the
burst spreads over both. `/admin/route` says the wait in words.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from router.service import RouterService
from tests.router.conftest import STALL_PROOF_HEALTH, Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 16
BURST = 8


def prompt() -> dict[str, Any]:
    """The burst's prompt: 64 pages and a token, 20 output tokens (200 ms of decode)."""
    ids = [(k * 31) % 200 + 3 for k in range(64 * PAGE + 1)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 20}}


async def test_a_burst_of_one_long_prompt_spreads_once_its_holder_s_batch_is_full() -> None:
    cfg = ReferenceConfig(
        page_size=PAGE,
        max_running_requests=2,
        prefill_ms_per_token=0.05,
        decode_ms_per_token=10.0,
        time_scale=1.0,
    )
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        config = router_config([("w0", w0.url), ("w1", w1.url)], health=STALL_PROOF_HEALTH)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            plan = await fleet.route(prompt())
            assert {c["running_cap"] for c in plan["candidates"]} == {2}  # from /server_info

            async def send() -> str:
                status, headers, _ = await fleet.post("/generate", prompt())
                assert status == 200
                return headers["x-kvroute-worker"]

            burst = [asyncio.create_task(send()) for _ in range(BURST)]
            # while it runs, the dry run says what a full batch makes the next one wait
            said: list[dict[str, Any]] = []

            async def waits() -> bool:
                plan = await fleet.route(prompt())
                said[:] = [c for c in plan["candidates"] if c["queue"] is not None]
                return bool(said)

            await eventually(waits, what="a worker's batch to fill")
            placed = await asyncio.gather(*burst)
    # before: all 8 on the worker that cached the prompt first; the even split is the
    # usual outcome, one more on either side when a loaded machine shifts a finish
    assert min(placed.count(w) for w in ("w0", "w1")) >= BURST // 2 - 1, placed
    full = said[0]
    assert full["running"] >= 2 and full["queue_wait"] > 0
    queued = full["queued_prefill_tokens"]
    assert full["load"] == queued + 32 * full["running"] + full["queue_wait"]
    ahead = full["running"] - 1
    assert full["queue"].startswith(
        f"{full['running']} requests in flight, 2 run at once: it waits for {ahead} to "
        f"finish, {ahead}/2 of a request's run (20 output tokens x decode_step_weight 200 = "
        "4000 prefill tokens)"
    )
    assert full["queue"].endswith("taken off the hit it would find there")
