"""Reference workers with prefill/decode roles, paired by hand the way each engine's router
pairs them: SGLang's both-at-once with a bootstrap room, vLLM's prefill-then-decode with
`kv_transfer_params`; and a decode whose KV never comes answering a clean 504 in time."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

PAGE = 4
PROMPT = list(range(10, 10 + 4 * PAGE + 1))  # 17 tokens: 4 whole pages and a last token


def config(role: str, **kw: Any) -> WorkerConfig:
    fields: dict[str, Any] = {
        "page_size": PAGE,
        "capacity_tokens": 4096,
        "time_scale": 0,
        "role": role,
        "kv_transfer_timeout_s": 1.0,
    }
    fields.update(kw)
    return WorkerConfig(**fields)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[ReferenceWorker, ReferenceWorker, ReferenceWorker]]:
    async with (
        ReferenceWorker(config("prefill")) as prefill,
        ReferenceWorker(config("decode")) as decode,
        ReferenceWorker(config("both")) as both,
    ):
        yield prefill, decode, both


async def post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def sglang_pair(prefill: ReferenceWorker, room: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 6},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.disagg.bootstrap_port,
        "bootstrap_room": room,
        **extra,
    }


async def test_server_info_advertises_the_role_and_bootstrap_port_as_sglang(
    pair: tuple[ReferenceWorker, ReferenceWorker, ReferenceWorker],
) -> None:
    prefill, decode, both = pair
    async with aiohttp.ClientSession() as session:
        modes = {}
        for worker in (prefill, decode, both):
            async with session.get(worker.url + "/server_info") as resp:
                info = await resp.json()
            modes[worker.config.role] = info["disaggregation_mode"]
            if worker is prefill:
                assert info["disaggregation_bootstrap_port"] == prefill.disagg.bootstrap_port
    assert modes == {"prefill": "prefill", "decode": "decode", "both": "null"}


async def test_an_sglang_pair_answers_as_one_worker_would_and_reports_the_prefill_hit(
    pair: tuple[ReferenceWorker, ReferenceWorker, ReferenceWorker],
) -> None:
    prefill, decode, both = pair
    async with aiohttp.ClientSession() as session:
        _, alone = await post(session, both.url + "/generate", sglang_pair(prefill, 0))
        for room, hit in ((1, 0), (2, 4 * PAGE)):  # the second time, the prefill has the pages
            # prompt logprobs from the fourth page on: the reuse stops there too (at 4 pages)
            body = sglang_pair(prefill, room, return_logprob=True, logprob_start_len=4 * PAGE)
            (ps, p_answer), (ds, d_answer) = await asyncio.gather(
                post(session, prefill.url + "/generate", body),
                post(session, decode.url + "/generate", body),
            )
            assert (ps, ds) == (200, 200), (p_answer, d_answer)
            assert p_answer["meta_info"]["cached_tokens"] == hit
            assert d_answer["meta_info"]["cached_tokens"] == hit  # the prefill side's hit
            assert d_answer["text"] == alone["text"]  # the same tokens as a whole worker's
            merged = (
                p_answer["meta_info"]["input_token_logprobs"]
                + d_answer["meta_info"]["input_token_logprobs"]
            )
            assert [t for _, t, _ in merged] == PROMPT[4 * PAGE :] and merged[0][0] is None
    # handed over: nothing held, no handoff left open
    assert len(prefill.disagg.handoffs) == 0
    assert all(sched.holding == 0 for sched in prefill.ranks)


async def test_a_vllm_pair_goes_prefill_first_then_decode_with_the_kv_transfer_params(
    pair: tuple[ReferenceWorker, ReferenceWorker, ReferenceWorker],
) -> None:
    prefill, decode, _ = pair
    request = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
    async with aiohttp.ClientSession() as session:
        first = request | {
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        }
        status, answer = await post(session, prefill.url + "/v1/completions", first)
        assert status == 200, answer
        params = answer["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_port"] == prefill.disagg.bootstrap_port
        assert params["remote_engine_id"] == prefill.disagg.engine_id
        assert sum(s.holding for s in prefill.ranks) == 1  # held until read
        second = request | {"kv_transfer_params": params}
        async with session.post(decode.url + "/v1/completions", json=second) as resp:
            assert resp.status == 200
            raw = await resp.read()
    chunks = [
        json.loads(line[6:])
        for line in raw.decode().splitlines()
        if line.startswith("data: {")  # the streamed completion, from decode
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert sum(s.holding for s in prefill.ranks) == 0  # read: the pages are free again


async def test_a_decode_whose_kv_never_comes_answers_504_within_its_timeout(
    pair: tuple[ReferenceWorker, ReferenceWorker, ReferenceWorker],
) -> None:
    prefill, decode, _ = pair
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        # the room was never sent to the prefill: its bootstrap server waits, then says so
        status, answer = await post(session, decode.url + "/generate", sglang_pair(prefill, 77))
    assert status == 504, answer
    assert answer["error"]["type"] == "kv_transfer_timeout"
    assert time.monotonic() - started < 1.0 * 2 + 1
    # the prefill's bootstrap server gives up on its own timeout, which may end just after the
    # decode's (both 1 s): it closes the room then (the check flaked 1 run in 6 right away)
    for _ in range(40):
        if not prefill.disagg.handoffs:
            break
        await asyncio.sleep(0.05)
    assert len(prefill.disagg.handoffs) == 0


async def test_pd_workers_refuse_requests_without_pd_fields(
    pair: tuple[ReferenceWorker, ReferenceWorker, ReferenceWorker],
) -> None:
    prefill, decode, _ = pair
    async with aiohttp.ClientSession() as session:
        for worker in (prefill, decode):
            status, answer = await post(session, worker.url + "/generate", {"input_ids": PROMPT})
            assert status == 400 and "bootstrap_room" in answer["error"]["message"]
        # a decode told a bootstrap server nobody runs fails fast, not after the timeout
        dead = sglang_pair(prefill, 5) | {"bootstrap_port": 9}
        status, answer = await post(session, decode.url + "/generate", dead)
    assert status == 502 and answer["error"]["type"] == "kv_transfer_failed"


async def test_a_held_prefill_released_lets_the_request_it_blocked_run() -> None:
    # room for one held prompt only: the second waits until the first one's pages are read
    # (the bug: releasing a hold did not wake the scheduler, so it waited for a new request)
    async with ReferenceWorker(config("prefill", capacity_tokens=7 * PAGE)) as prefill:
        rank = prefill.ranks[0]
        base = f"http://127.0.0.1:{prefill.disagg.bootstrap_port}/kv/"
        other = [t + 100 for t in PROMPT]

        async def until(check: Any, what: str) -> None:
            deadline = time.monotonic() + 5
            while not check():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.01)

        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(
                post(session, prefill.url + "/generate", sglang_pair(prefill, 1))
            )
            await until(lambda: rank.holding == 1, "the first prefill to hold its pages")
            blocked = sglang_pair(prefill, 2) | {"input_ids": other}
            second = asyncio.create_task(post(session, prefill.url + "/generate", blocked))
            await until(lambda: rank.load == (0, 1), "the second request to wait for room")
            async with session.get(base + "room-1") as resp:  # the first one's decode reads
                assert resp.status == 200
            await until(lambda: rank.holding == 1 and rank.load == (0, 0), "the second to run")
            async with session.get(base + "room-2") as resp:
                assert resp.status == 200
            assert (await first)[0] == (await second)[0] == 200


async def test_a_prefill_with_several_ranks_runs_a_request_on_its_rooms_rank() -> None:
    """SGLang 0.5.23's prefill resolves `load_balance_method` auto to follow_bootstrap_room:
    rank = room % dp_size, which is also where its decode side looks for the KV. Before, the
    worker took the ranks in turn, so rooms 0, 2, 4 ran on ranks 0, 1, 0. A rank named other
    than the room's, with no `disagg_prefill_dp_rank`, fails as SGLang's KV sender fails it."""
    async with (
        ReferenceWorker(config("prefill", dp_size=2)) as prefill,
        ReferenceWorker(config("decode")) as decode,
        aiohttp.ClientSession() as session,
    ):
        for room, rank in ((0, 0), (2, 0), (4, 0), (7, 1), (9, 1)):
            body = sglang_pair(prefill, room)
            (ps, p_answer), (ds, _) = await asyncio.gather(
                post(session, prefill.url + "/generate", body),
                post(session, decode.url + "/generate", body),
            )
            assert (ps, ds) == (200, 200), p_answer
            assert p_answer["meta_info"]["dp_rank"] == rank, room
        # told the room's rank, or told the decode side the rank too: served there
        for extra in ({"routed_dp_rank": 1}, {"routed_dp_rank": 0, "disagg_prefill_dp_rank": 0}):
            told = {k: v for k, v in extra.items() if k != "routed_dp_rank"}
            (ps, p_answer), (ds, _) = await asyncio.gather(
                post(session, prefill.url + "/generate", sglang_pair(prefill, 11, **extra)),
                post(session, decode.url + "/generate", sglang_pair(prefill, 11, **told)),
            )
            assert (ps, ds) == (200, 200), p_answer
            assert p_answer["meta_info"]["dp_rank"] == extra["routed_dp_rank"]
        status, answer = await post(
            session, prefill.url + "/generate", sglang_pair(prefill, 11, routed_dp_rank=0)
        )
        assert status == 502 and "follow_bootstrap_room conflict" in answer["error"]["message"]
    assert len(prefill.disagg.handoffs) == 0
