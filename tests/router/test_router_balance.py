"""The learned hit/load balance end to end: only a streamed answer's first byte is a TTFT.

`policy.balance_learning` fits the time to first token against the work ahead of each request.
A whole answer's first byte arrives only once the worker has decoded it too, so its time is no
time to first token: before, every answer was a sample, and a fleet of whole answers fitted
its decode time as prefill (QA: 0.124 ms per prompt token against the streamed 0.052 on the
same workers, `decode_weight` 118 against 53). Now whole answers leave the fit alone and each
streamed one is a sample, as the plan's `balance` in `/admin/route` shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.config import PolicyConfig
from router.routing.planner import THIN_UNSAMPLED
from router.service import RouterService
from tests.router.conftest import STALL_PROOF_HEALTH, Fleet, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

ANSWERS = 6


def prompt(i: int, *, stream: bool) -> dict[str, Any]:
    """A prompt of its own (no hit: all of it is prefill), 10 output tokens."""
    ids = [(i * 41 + k * 7) % 200 + 3 for k in range(200 + 100 * i)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 10}, "stream": stream}


@contextlib.asynccontextmanager
async def _learning_fleet(*, timed: bool) -> AsyncIterator[tuple[Fleet, aiohttp.ClientSession]]:
    """A router learning its balance in front of one reference worker, warm; `timed`: the
    worker takes 0.05 ms per prompt token and 5 ms per decode step, else no time at all."""
    cfg = (
        ReferenceConfig(prefill_ms_per_token=0.05, decode_ms_per_token=5.0, time_scale=1.0)
        if timed
        else ReferenceConfig(time_scale=0.0)
    )
    async with ReferenceWorker(cfg) as w0:
        config = router_config(
            [("w0", w0.url)],
            health=STALL_PROOF_HEALTH,
            policy=PolicyConfig(balance_learning=True),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            yield fleet, session


async def _samples(fleet: Fleet) -> float:
    plan = await fleet.route(prompt(99, stream=False))
    return float(plan["balance"]["samples"])


async def test_only_streamed_answers_feed_the_balance_fit() -> None:
    async with _learning_fleet(timed=True) as (fleet, session):
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


async def _balance(fleet: Fleet) -> dict[str, Any]:
    plan = await fleet.route(prompt(99, stream=False))
    balance: dict[str, Any] = plan["balance"]
    return balance


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        await resp.read()


async def test_a_streamed_answer_behind_a_whole_one_is_no_sample() -> None:
    """A whole answer counts as queued prefill until its first byte, which comes only once it
    has decoded: a streamed answer sent meanwhile would fit its time to first token against
    prefill long done (QA: half the answers whole drove decode_weight to its floor, prior / 4).
    It is no sample now; the plan's balance counts both kinds of answer that were none."""
    async with _learning_fleet(timed=True) as (fleet, session):
        whole = prompt(0, stream=False)
        whole["sampling_params"]["max_new_tokens"] = 60  # decodes for 300 ms
        long_answer = asyncio.create_task(fleet.post("/generate", whole))
        await asyncio.sleep(0.1)  # prefilled (10 ms) and decoding, still queued for the load
        await _stream(session, fleet.url, prompt(1, stream=True))
        status, _, _ = await long_answer
        assert status == 200
        balance = await _balance(fleet)
        # before: the streamed answer was a sample (1), counted nothing as none
        assert balance["samples"] == 0
        assert (balance["whole_answers"], balance["behind_whole"]) == (1, 1)
        # with no whole answer in flight, a streamed answer is a sample again
        await _stream(session, fleet.url, prompt(2, stream=True))
        balance = await _balance(fleet)
        assert balance["samples"] == 1 and balance["behind_whole"] == 1


async def test_too_few_samples_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """A fleet whose answers are all whole learns nothing: the log says so once, after
    `THIN_UNSAMPLED` of them, and the plan's balance counts them."""
    async with _learning_fleet(timed=False) as (fleet, _):
        with caplog.at_level(logging.WARNING, logger="router.routing.planner"):
            for i in range(THIN_UNSAMPLED + 5):
                status, _, _ = await fleet.post("/generate", prompt(i % 7, stream=False))
                assert status == 200
        said = [r for r in caplog.records if "balance learning has" in r.getMessage()]
        assert len(said) == 1
        assert f"{THIN_UNSAMPLED} answers that could be none" in said[0].getMessage()
        balance = await _balance(fleet)
        assert balance["samples"] == 0
        assert balance["whole_answers"] == THIN_UNSAMPLED + 5
