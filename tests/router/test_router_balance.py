"""The learned hit/load balance end to end: only a streamed answer's first byte is a TTFT.

`policy.balance_learning` fits the time to first token against the work ahead of each request.
A whole answer's first byte arrives only once the worker has decoded it too, so its time is no
time to first token: before, every answer was a sample, and a fleet of whole answers fitted
its decode time as prefill (QA: 0.124 ms per prompt token against the streamed 0.052 on the
same workers, `decode_weight` 118 against 53). Now whole answers leave the fit alone and each
streamed one is a sample, as the plan's `balance` in `/admin/route` shows.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from router.config import PolicyConfig
from router.service import RouterService
from tests.router.conftest import STALL_PROOF_HEALTH, Fleet, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

ANSWERS = 6


def prompt(i: int, *, stream: bool) -> dict[str, Any]:
    """A prompt of its own (no hit: all of it is prefill), 10 output tokens."""
    ids = [(i * 41 + k * 7) % 200 + 3 for k in range(200 + 100 * i)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 10}, "stream": stream}


async def _samples(fleet: Fleet) -> float:
    plan = await fleet.route(prompt(99, stream=False))
    return float(plan["balance"]["samples"])


async def test_only_streamed_answers_feed_the_balance_fit() -> None:
    cfg = ReferenceConfig(prefill_ms_per_token=0.05, decode_ms_per_token=5.0, time_scale=1.0)
    async with ReferenceWorker(cfg) as w0:
        config = router_config(
            [("w0", w0.url)],
            health=STALL_PROOF_HEALTH,
            policy=PolicyConfig(balance_learning=True),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            for i in range(ANSWERS):
                status, _, answer = await fleet.post("/generate", prompt(i, stream=False))
                assert status == 200 and answer["meta_info"]["completion_tokens"] == 10
            # whole answers: their first byte came after their decode, no sample (before: 6)
            assert await _samples(fleet) == 0
            for i in range(ANSWERS, 2 * ANSWERS):
                body = prompt(i, stream=True)
                async with session.post(fleet.url + "/generate", json=body) as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    await resp.read()
            # each streamed answer is one (the fit forgets 0.5% of the past per sample)
            assert 0.97 * ANSWERS < await _samples(fleet) <= ANSWERS
