"""Prefill/decode pairs end to end: reference workers with roles behind a real router.

Two prefill and two decode workers, their roles and bootstrap ports discovered from
`/server_info` as SGLang advertises them; SGLang-style pairs (both at once, a bootstrap room)
and vLLM-style pairs (prefill first, its kv_transfer_params to the decode); a repeated prompt's
prefill landing where the index says its prefix is cached, with the prefill side's reported
hit equal to the prediction; streams through the pair; a prefill process killed with SIGKILL
mid-transfer; and a decode whose KV never comes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from indexer.stats import StreamState
from router.config import HealthConfig, LimitsConfig, PdConfig, TimeoutsConfig, WorkerConfig
from router.http.reload import ConfigSource
from router.service import RouterService
from tests.router.conftest import (
    AUTH,
    STALL_PROOF_HEALTH,
    DiscoveryGate,
    burst_to_stale_ranks,
    check_rank_refusals,
    eventually,
    router_config,
)
from workers.config import DEFAULT_MODEL
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 16
PROMPT = [(i * 7) % 250 + 3 for i in range(6 * PAGE + 1)]  # 6 pages and a last token


def reference(role: str, **kw: Any) -> ReferenceConfig:
    fields: dict[str, Any] = {
        "page_size": PAGE,
        "time_scale": 0.0,
        "role": role,
        "kv_transfer_timeout_s": 5.0,
    }
    fields.update(kw)
    return ReferenceConfig(**fields)


async def poke(
    session: aiohttp.ClientSession, prefill: ReferenceWorker, decode: ReferenceWorker, n: int
) -> None:
    """A tiny SGLang pair sent straight to (prefill, decode): each publishes a page."""
    body = {
        "input_ids": [9, n % 250 + 3] * PAGE,
        "cache_salt": "warm-up",
        "sampling_params": {"max_new_tokens": 1},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.disagg.bootstrap_port,
        "bootstrap_room": 10_000 + n,
    }
    answers = await asyncio.gather(
        session.post(prefill.url + "/generate", json=body),
        session.post(decode.url + "/generate", json=body),
    )
    for resp in answers:
        assert resp.status == 200, await resp.text()
        resp.release()


async def warm(
    session: aiohttp.ClientSession,
    router: RouterService,
    prefills: list[ReferenceWorker],
    decodes: list[ReferenceWorker],
) -> None:
    """Until every worker's KV-event stream has reached the router's index."""
    counter = iter(range(1_000_000))
    pairs = list(zip(prefills, decodes * len(prefills), strict=False))
    pairs += [(prefills[0], d) for d in decodes]

    async def live() -> bool:
        for p, d in pairs:
            await poke(session, p, d, next(counter))
        streams = router.planner.indexer.streams()
        return len(streams) == len(prefills) + len(decodes) and all(
            s.last_seq is not None and s.state is StreamState.SYNCED for s in streams
        )

    await eventually(live, what="every stream to reach the index")


class PdFleet:
    def __init__(
        self,
        router: RouterService,
        session: aiohttp.ClientSession,
        workers: dict[str, ReferenceWorker],
    ) -> None:
        self.router, self.session, self.workers = router, session, workers

    async def route(self, body: object) -> Any:
        async with self.session.post(
            self.router.url + "/admin/route", json=body, headers=AUTH
        ) as resp:
            assert resp.status == 200
            return await resp.json()


@pytest.fixture
async def fleet() -> AsyncIterator[PdFleet]:
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode")) as d0,
        ReferenceWorker(reference("decode")) as d1,
    ):
        workers = {"p0": p0, "p1": p1, "d0": d0, "d1": d1}
        # only urls: roles, bootstrap ports and event endpoints come from /server_info
        config = router_config(
            [(name, w.url) for name, w in workers.items()], health=STALL_PROOF_HEALTH
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await warm(session, router, [p0, p1], [d0, d1])
            yield PdFleet(router, session, workers)


async def test_discovery_reads_roles_and_bootstrap_ports_from_server_info(fleet: PdFleet) -> None:
    pool = fleet.router.planner.pool
    roles = {e.id: e.role for e in pool}
    assert roles == {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    assert pool.get("p0").bootstrap_port == fleet.workers["p0"].disagg.bootstrap_port
    assert pool.disaggregated(pool.resolve("").cache_model)


async def test_health_needs_a_prefill_and_a_decode_worker_to_answer(fleet: PdFleet) -> None:
    """Decode workers alone answer nothing: with every prefill worker drained the router is
    not healthy, though workers are routable."""

    async def drain(worker: str, drain: bool) -> None:
        async with fleet.session.post(
            f"{fleet.router.url}/admin/workers/{worker}/drain", json={"drain": drain}, headers=AUTH
        ) as resp:
            assert resp.status == 200, await resp.text()

    async def health() -> tuple[int, Any]:
        async with fleet.session.get(fleet.router.url + "/health") as resp:
            return resp.status, await resp.json()

    assert await health() == (200, {"status": "ok", "workers": 4, "routable": 4})
    await drain("p0", True)
    await drain("p1", True)
    assert await health() == (503, {"status": "no_pair", "workers": 4, "routable": 2})
    await drain("p1", False)
    await drain("d0", True)
    await drain("d1", True)
    assert await health() == (503, {"status": "no_pair", "workers": 4, "routable": 1})
    await drain("d1", False)
    assert await health() == (200, {"status": "ok", "workers": 4, "routable": 2})


async def test_a_prefill_refusal_is_the_answer_named_and_counted(fleet: PdFleet) -> None:
    """A 4xx of the prefill side goes to the client as it is (no retry), named as a pair's
    answer is and counted with its status."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4},
        "return_logprob": "yes",
    }
    headers = {"x-request-id": "refused-1"}
    async with fleet.session.post(
        fleet.router.url + "/generate", json=body, headers=headers
    ) as resp:
        assert resp.status == 400, await resp.text()
        assert "return_logprob" in (await resp.json())["error"]["message"]
        assert resp.headers["x-kvroute-prefill-worker"] in {"p0", "p1"}
        assert resp.headers["x-request-id"] == "refused-1"
        worker = resp.headers["x-kvroute-prefill-worker"]
    async with fleet.session.get(fleet.router.url + "/metrics") as resp:
        text = await resp.text()
    assert (
        f'code="400",endpoint="/generate",model="kvroute/reference-byte-lm",worker="{worker}"}} 1.0'
        in text
    )


async def test_a_repeated_prompt_prefills_where_its_prefix_is_cached(fleet: PdFleet) -> None:
    body = {
        "input_ids": PROMPT,
        "cache_salt": "tenant-a",
        "sampling_params": {"max_new_tokens": 4},
    }
    url = fleet.router.url + "/generate"
    async with fleet.session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        first_prefill = resp.headers["x-kvroute-prefill-worker"]
        first = await resp.json()
    assert resp.headers["x-kvroute-worker"] in ("d0", "d1")  # the decode side answered

    async def indexed() -> bool:
        plan = await fleet.route(body)
        return bool(plan["prefill"]["candidates"][0]["matched_tokens"] >= 5 * PAGE)

    await eventually(indexed, what="the first prefill's pages to be indexed")
    plan = await fleet.route(body)
    # the dry run explains both sides: prefill workers by the kv policy, decode workers by load
    assert plan["mode"] == "prefill_decode" and plan["worker"] == first_prefill
    assert {c["worker"] for c in plan["prefill"]["candidates"]} == {"p0", "p1"}
    assert {c["worker"] for c in plan["decode"]["candidates"]} == {"d0", "d1"}
    predicted = plan["prefill"]["candidates"][0]["matched_tokens"]
    from router.http.keys import DECISIONS

    stats = fleet.router.app[DECISIONS]
    counted = len(stats.recent)
    async with fleet.session.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["x-kvroute-prefill-worker"] == first_prefill
        assert int(resp.headers["x-kvroute-matched-tokens"]) == predicted
        again = await resp.json()
    # the prefill side's own reported hit (relayed by the decode) is the prediction
    assert again["meta_info"]["cached_tokens"] == predicted == 6 * PAGE
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["text"] == first["text"]
    # the decision metrics see a pair as its prefill side: chosen, predicted and reported.
    # The client has its answer before the router counts it (the bookkeeping follows the write)

    async def answer_counted() -> bool:
        return len(stats.recent) > counted

    await eventually(answer_counted, what="the second answer to be counted")
    recent = list(stats.recent)
    assert [d.chosen.worker for d in recent[-2:]] == [first_prefill, first_prefill]
    assert [d.cached_tokens for d in recent[-2:]] == [0, predicted]
    assert recent[-1].chosen.matched_tokens == predicted and recent[-1].status == 200


async def test_streams_pass_through_the_pair_with_the_prefill_logprobs_merged(
    fleet: PdFleet,
) -> None:
    url = fleet.router.url
    chat = {
        "messages": [{"role": "user", "content": "stream me a few tokens through a pair"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with fleet.session.post(url + "/v1/chat/completions", json=chat) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
    assert len(text) == 8 and raw.rstrip().endswith("data: [DONE]")
    assert events[-1]["usage"]["completion_tokens"] == 8
    generate = {
        "input_ids": PROMPT,
        "stream": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 3},
    }
    async with fleet.session.post(url + "/generate", json=generate) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert len(chunks) == 3
    # the decode computed no prompt logprob: every chunk carries the prefill's, as SGLang merges
    for chunk in chunks:
        logprobs = chunk["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in logprobs] == PROMPT


async def test_vllm_style_pairs_go_prefill_first_and_decode_with_its_kv_transfer_params() -> None:
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        workers = [
            WorkerConfig(
                url=w.url,
                id=name,
                engine="vllm",  # vLLM advertises nothing: the role and streams are configured
                role=role,  # type: ignore[arg-type]
                events=w.kv_events.endpoint,
                replay=w.kv_events.replay_endpoint,
                block_size=PAGE,
                model=w.config.model,
            )
            for name, w, role in (("p0", p0, "prefill"), ("d0", d0, "decode"))
        ]
        config = msgspec.structs.replace(
            router_config([], health=STALL_PROOF_HEALTH), workers=tuple(workers)
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await warm(session, router, [p0], [d0])
            body = {
                "model": p0.config.model,
                "prompt": PROMPT,
                "max_tokens": 5,
                "cache_salt": "tenant-v",
            }
            url = router.url + "/v1/completions"
            async with session.post(url, json=body) as resp:
                assert resp.status == 200, await resp.text()
                first = await resp.json()
            assert first["usage"]["completion_tokens"] == 5  # the decode's, not the prefill's 1

            async def indexed() -> bool:
                async with session.post(
                    router.url + "/admin/route", json=body, headers=AUTH
                ) as resp:
                    plan = await resp.json()
                return bool(plan["prefill"]["candidates"][0]["matched_tokens"] == 6 * PAGE)

            await eventually(indexed, what="the vLLM prefill's pages to be indexed")
            async with session.post(url, json=body | {"stream": True}) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-matched-tokens"] == str(6 * PAGE)
                raw = (await resp.read()).decode()
            chunks = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert text == first["choices"][0]["text"]
            # what the decode read from the prefill's bootstrap server: the prefill's hit
            async with session.post(url, json=body) as resp:
                again = await resp.json()
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * PAGE
            assert sum(s.holding for s in p0.ranks) == 0  # every hold was read and released


async def test_a_decode_whose_kv_never_comes_is_a_clean_timeout_error() -> None:
    """The engine's own 504 is the answer when no other prefill could be tried, blamed on the
    prefill that sent no KV, not on the decode that waited for it."""
    # the prefill takes 10 s to compute (time scale 1); its decode gives up after 0.5 s
    slow = reference("prefill", time_scale=1.0, prefill_ms_per_token=100.0)
    async with (
        ReferenceWorker(slow) as p0,
        ReferenceWorker(reference("decode", kv_transfer_timeout_s=0.5)) as d0,
        ReferenceWorker(reference("decode", kv_transfer_timeout_s=0.5)) as d1,
    ):
        config = router_config(
            [("p0", p0.url), ("d0", d0.url), ("d1", d1.url)], health=STALL_PROOF_HEALTH
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            started = time.monotonic()
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
            async with session.post(router.url + "/generate", json=body) as resp:
                answer = await resp.json()
                status = resp.status
                decode = resp.headers["x-kvroute-worker"]
            elapsed = time.monotonic() - started
            pool = router.planner.pool
            # no retry on the other decode: it would wait for the same prefill. The lone
            # prefill failed what no other prefill could try: nobody is charged, as for a whole
            # request that failed on every worker it could go to (`charge`)
            assert (pool.get("p0").breaker.failures, pool.get(decode).breaker.failures) == (0, 0)
    assert status == 504, answer
    assert answer["error"]["type"] == "kv_transfer_timeout"
    assert elapsed < 5.0  # the decode's timeout, far from the 10 s prefill


async def test_a_decode_timeout_is_a_timeout_when_the_other_prefill_is_drained() -> None:
    """The decode's 504 is not the last try while another prefill worker exists (drained now,
    it could be back for the retry); when no pair is left to retry on, the client is told of a
    timeout (504), not of a broken worker (502)."""
    slow = reference("prefill", time_scale=1.0, prefill_ms_per_token=100.0)
    async with (
        ReferenceWorker(slow) as p0,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode", kv_transfer_timeout_s=0.5)) as d0,
    ):
        config = router_config(
            [("p0", p0.url), ("p1", p1.url), ("d0", d0.url)], health=STALL_PROOF_HEALTH
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            async with session.post(router.url + "/admin/workers/p1/drain", headers=AUTH) as resp:
                assert resp.status == 200, await resp.text()
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
            async with session.post(router.url + "/generate", json=body) as resp:
                answer = await resp.json()
                status = resp.status
    assert status == 504, answer
    assert "prefill p0: its decode d0 got no KV (HTTP 504)" in answer["error"]["message"]


# a prefill worker in its own process, through the CLI; its KV takes 30 ms per token to move,
# so a transfer of the prompt lasts about 3 s: long enough to kill it mid-transfer
_PREFILL_ARGS = [
    "worker", "--role", "prefill", "--port", "0", "--events", "tcp://127.0.0.1:0",
    "--page-size", str(PAGE), "--time-scale", "1", "--prefill-ms-per-token", "0",
    "--decode-ms-per-token", "0", "--transfer-ms-per-token", "30",
]  # fmt: skip


@pytest.fixture
async def doomed() -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", *_PREFILL_ARGS,
        stdout=asyncio.subprocess.PIPE, cwd=os.getcwd(),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = line.rsplit(" at ", 1)[-1].strip()
        assert url.startswith("http://"), line
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_a_prefill_killed_mid_transfer_fails_the_pair_and_another_pair_answers(
    doomed: tuple[asyncio.subprocess.Process, str],
) -> None:
    proc, doomed_url = doomed
    async with (
        ReferenceWorker(reference("prefill")) as survivor,
        ReferenceWorker(reference("decode")) as d0,
    ):
        config = router_config(
            [("doomed", doomed_url), ("survivor", survivor.url), ("d0", d0.url)],
            pd=PdConfig(),
            health=STALL_PROOF_HEALTH,
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def admin(path: str, body: object = None) -> None:
                async with session.post(
                    router.url + "/admin" + path, json=body, headers=AUTH
                ) as resp:
                    assert resp.status == 200, await resp.text()

            # steer the pair to the doomed prefill, then let the survivor take the retry
            await admin("/workers/survivor/drain")
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
            request = asyncio.create_task(session.post(router.url + "/generate", json=body))

            async def transferring() -> bool:
                return d0.disagg.fetching == 1

            await eventually(transferring, what="the decode to be fetching from the doomed one")
            await admin("/workers/survivor/drain", {"drain": False})
            proc.send_signal(signal.SIGKILL)
            async with await asyncio.wait_for(request, 30) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvroute-prefill-worker"] == "survivor"
                answer = await resp.json()
            assert answer["meta_info"]["completion_tokens"] == 4
            entry = router.planner.pool.get("doomed")
            assert not entry.routable(router.planner.clock())  # its circuit opened at once


async def test_the_prefill_side_stops_counting_as_load_once_it_has_answered() -> None:
    slow = {"time_scale": 1.0, "decode_ms_per_token": 50.0}  # 20 tokens: about a second
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode", **slow)) as d0,
    ):
        config = router_config([("p0", p0.url), ("d0", d0.url)], health=STALL_PROOF_HEALTH)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await warm(session, router, [p0], [d0])
            load = router.planner.load
            body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 20}}
            async with session.post(router.url + "/generate", json=body) as resp:
                assert resp.status == 200
                await resp.content.readany()  # the decode side streams
                # the prefill worker's part is over: it runs nothing for this request any more
                p, d = load.of("p0"), load.of("d0")
                assert (p.running, p.queued_prefill_tokens) == (0, 0)
                assert d.running == 1 and d.kv_tokens == len(PROMPT)
                await resp.read()

            async def ended() -> bool:
                return (load.of("d0").running, load.of("d0").kv_tokens) == (0, 0)

            await eventually(ended, what="the decode side to end")
            assert load.of("p0").running == 0


async def test_the_prefill_side_stops_counting_as_queued_once_its_events_show_the_prompt() -> None:
    """SGLang's prefill side answers only once its decode has fetched the KV: from its stores
    on, the request is a handoff there, no longer queued prefill
    (`router.routing.prefill_watch`)."""
    # a prefill of about 0.2 s, then a handoff of about 2 s
    slow = {"time_scale": 1.0, "prefill_ms_per_token": 2.0, "transfer_ms_per_token": 20.0}
    async with (
        ReferenceWorker(reference("prefill", **slow)) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        config = router_config([("p0", p0.url), ("d0", d0.url)], health=STALL_PROOF_HEALTH)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await warm(session, router, [p0], [d0])
            load = router.planner.load
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
            sent = asyncio.create_task(session.post(router.url + "/generate", json=body))

            async def queued() -> bool:
                return load.of("p0").queued_prefill_tokens > 0

            await eventually(queued, what="the request to be dispatched")
            # its prompt counts as queued at dispatch: the prefill has not stored it
            assert load.of("p0").running == 1
            assert load.of("p0").queued_prefill_tokens == len(PROMPT)
            # watched on the prefill side only (a decode computes no prompt)
            assert len(router.planner.prefills) == 1

            async def computed() -> bool:
                return load.of("p0").queued_prefill_tokens == 0

            await eventually(computed, what="the prefill's stores to reach the index")
            # the pair is still in flight: the decode is fetching the prefill's KV
            assert not sent.done()
            assert load.of("p0").running == 1
            resp = await sent
            assert resp.status == 200, await resp.text()
            resp.release()

            async def answered() -> bool:
                return load.of("p0").running == 0

            await eventually(answered, what="the pair to end")
            # counted down once: the answer does not take the prompt off again
            assert load.of("p0").queued_prefill_tokens == 0


async def test_a_prefill_with_two_ranks_gets_a_room_that_names_the_rank_it_was_scored_on() -> None:
    """SGLang 0.5.23's prefill runs a request on rank `bootstrap_room % dp_size` and fails the
    KV handoff of one told another rank (no `disagg_prefill_dp_rank`): the reference workers do
    the same. The router drew its rooms at random, so about half the pairs failed (502) and the
    others were scored on the rank they ran on by chance; now the room names the chosen rank,
    every pair is served there, and each repeat's reported hit is the prediction."""
    async with (
        ReferenceWorker(reference("prefill", dp_size=2)) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        config = router_config([("p0", p0.url), ("d0", d0.url)], health=STALL_PROOF_HEALTH)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            counter = iter(range(1_000_000))

            async def live() -> bool:
                await poke(session, p0, d0, next(counter))
                streams = router.planner.indexer.streams()
                return len(streams) == 3 and all(
                    s.last_seq is not None and s.state is StreamState.SYNCED for s in streams
                )

            await eventually(live, what="both prefill ranks' streams to reach the index")
            url = router.url + "/generate"
            for i in range(8):
                body = {
                    "input_ids": [i + 3, *PROMPT],
                    "cache_salt": "rooms",
                    "sampling_params": {"max_new_tokens": 2},
                }
                for attempt in range(2):
                    async with session.post(url, json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        rank = int(resp.headers["x-kvroute-prefill-dp-rank"])
                        matched = int(resp.headers["x-kvroute-matched-tokens"])
                        answer = await resp.json()
                    assert answer["meta_info"]["cached_tokens"] == matched
                    if attempt == 0:
                        first_rank = rank

                        async def indexed(body: dict[str, Any] = body) -> bool:
                            plan = await PdFleet(router, session, {}).route(body)
                            best = plan["prefill"]["candidates"][0]
                            return bool(best["matched_tokens"] == 6 * PAGE)

                        await eventually(indexed, what="the prompt indexed on its rank")
                    else:
                        assert (rank, matched) == (first_rank, 6 * PAGE)


@pytest.fixture
async def blind_prefill() -> AsyncIterator[tuple[RouterService, aiohttp.ClientSession, list[int]]]:
    """A prefill with two ranks whose events the router does not read (its ranks unknown) and
    a decode with two; yields the router, a session and the rank of every prefill submitted."""
    async with (
        ReferenceWorker(reference("prefill", dp_size=2)) as p0,
        ReferenceWorker(reference("decode", dp_size=2)) as d0,
    ):
        ranks: list[int] = []
        submit = p0.submit

        def seen(generation: Any) -> Any:  # what rank the prefill ran it on, not a fake
            job = submit(generation)
            ranks.append(job.rank)
            return job

        p0.submit = seen  # type: ignore[method-assign]
        config = router_config([("p0", p0.url), ("d0", d0.url)], health=STALL_PROOF_HEALTH)
        config = msgspec.structs.replace(
            config,
            workers=(
                WorkerConfig(id="p0", url=p0.url, kv_events=False),
                WorkerConfig(id="d0", url=d0.url),
            ),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            yield router, session, ranks


async def test_a_client_rank_on_a_prefill_of_unknown_ranks_is_handed_off_there(
    blind_prefill: tuple[RouterService, aiohttp.ClientSession, list[int]],
) -> None:
    """A client naming a rank (sgl-model-gateway's dp-aware mode) where the router does not
    know the prefill's ranks: its rank went to the prefill with a fully random room, which
    SGLang 0.5.23 fails ("follow_bootstrap_room conflict") for all but 1 in dp_size requests,
    and each failure was charged to the prefill until its breaker opened for every client.
    Now both legs are told `disagg_prefill_dp_rank`: every request is served on that rank."""
    router, session, ranks = blind_prefill
    for i in range(8):
        body = {"text": f"rank one please {i}", "routed_dp_rank": 1}
        async with session.post(router.url + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
    assert ranks == [1] * 8
    assert router.planner.pool.get("p0").routable(router.planner.clock())


async def test_a_client_rank_header_reaches_a_prefill_of_unknown_ranks(
    blind_prefill: tuple[RouterService, aiohttp.ClientSession, list[int]],
) -> None:
    """The client's X-Data-Parallel-Rank is forwarded as it wrote it on both legs; the prefill
    leg's headers were built afresh, so a prefill whose ranks the router does not know never
    got it (the engine placed the request itself)."""
    router, session, ranks = blind_prefill
    for i in range(6):
        body = {"prompt": f"rank one by header {i}", "max_tokens": 1}
        async with session.post(
            router.url + "/v1/completions", json=body, headers={"x-data-parallel-rank": "1"}
        ) as resp:
            assert resp.status == 200, await resp.text()
    assert ranks == [1] * 6


async def test_a_rank_no_worker_of_a_side_has_is_a_400(fleet: PdFleet) -> None:
    """A client's rank that no worker of one side has is the client's error, as on the
    whole-request path, in the answer and in the dry run; it was a 503 "no routable prefill
    worker among 0" (misleading: the model has two), and the dry run said 200."""
    body = {"text": "x", "routed_dp_rank": 5}
    async with fleet.session.post(fleet.router.url + "/generate", json=body) as resp:
        assert resp.status == 400, await resp.text()
        assert "no prefill worker has the dp rank 5" in await resp.text()
    async with fleet.session.post(
        fleet.router.url + "/admin/route", json=body, headers=AUTH
    ) as resp:
        assert resp.status == 400, await resp.text()


@pytest.mark.parametrize("max_retries", [2, 0])
async def test_a_prefill_refusing_a_rank_it_no_longer_has_is_read_again_and_retried(
    max_retries: int,
) -> None:
    """A prefill restarted with fewer ranks (here on other event ports, so its streams cannot
    tell) refuses a rank the router still tells it ("routed_dp_rank=1 out of range [0, 1)").
    That 400 was the client's answer, for as long as the router kept the old ranks; now the
    worker's settings are read again and the pair retried on the ranks it has, unblamed. With
    no retry left (`max_retries = 0`) the worker's 400 is the answer: it was an empty 502."""
    async with ReferenceWorker(reference("decode")) as d0:
        first = reference("prefill", dp_size=2)
        p0 = ReferenceWorker(first)
        await p0.__aenter__()
        try:
            config = router_config(
                [("p0", p0.url), ("d0", d0.url)],
                health=HealthConfig(interval_s=60, timeout_s=0.5),  # no probe sees it go
                limits=LimitsConfig(max_retries=max_retries),
            )
            async with RouterService(config) as router, aiohttp.ClientSession() as session:
                await eventually(
                    lambda: _has_streams(router, "p0", 2), what="the prefill's two ranks"
                )
                port = int(p0.url.rsplit(":", 1)[1])
                bootstrap = p0.disagg.bootstrap_port
                await p0.__aexit__(None, None, None)
                p0 = ReferenceWorker(
                    msgspec.structs.replace(first, dp_size=1, port=port, bootstrap_port=bootstrap)
                )
                await p0.__aenter__()

                check_rank_refusals(await burst_to_stale_ranks(session, router), max_retries)
                assert await _has_streams(router, "p0", 1)
                assert router.planner.pool.get("p0").routable(router.planner.clock())
        finally:
            await p0.__aexit__(None, None, None)


async def _has_streams(router: RouterService, worker: str, n: int) -> bool:
    return len(router.planner.indexer.stream_ids(worker)) == n


async def test_a_prefill_renamed_under_traffic_fails_no_request() -> None:
    """The QA run: a reload renames the prefill worker (its server under a new id) while
    requests come. Meanwhile the model has a decode worker and a new id whose role is not
    known yet, so it is no pair: its requests were planned as whole requests, waited for the
    reload, were planned again on that path and got "no routable worker among 0"; a request
    that found the pair while the new id was checked got "no routable prefill worker among 1"
    at once. Now both wait for the change's end and go to the pair."""
    async with (
        ReferenceWorker(reference("prefill")) as p,
        ReferenceWorker(reference("decode")) as d,
        DiscoveryGate(p.url) as gate,
        aiohttp.ClientSession() as session,
    ):
        gate.open.set()
        file = {"c": router_config([("p1", gate.url), ("d1", d.url)], health=STALL_PROOF_HEALTH)}
        source = ConfigSource("pd.toml", lambda: file["c"])
        async with RouterService(file["c"], config_source=source) as router:

            async def send() -> tuple[int, str | None, Any]:
                body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
                async with session.post(router.url + "/generate", json=body) as resp:
                    answer = await resp.json(content_type=None)
                    return resp.status, resp.headers.get("x-kvroute-prefill-worker"), answer

            assert (await send())[:2] == (200, "p1")
            gate.open.clear()
            asked = gate.info_asked
            file["c"] = router_config([("x1", gate.url), ("d1", d.url)], health=STALL_PROOF_HEALTH)
            reload = asyncio.create_task(admin_reload(session, router))

            async def discovering() -> bool:
                return gate.info_asked > asked

            await eventually(discovering, what="the new id's discovery")
            sent = [asyncio.create_task(send()) for _ in range(3)]
            await asyncio.sleep(0.2)
            assert not any(t.done() for t in sent), [t.result() for t in sent if t.done()]
            gate.open.set()
            for status, prefill, answer in await asyncio.gather(*sent):
                assert (status, prefill) == (200, "x1"), answer
            assert (await reload)[0] == 200


async def admin_reload(session: aiohttp.ClientSession, router: RouterService) -> tuple[int, Any]:
    """POST /admin/reload."""
    async with session.post(router.url + "/admin/reload", headers=AUTH) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_a_request_that_outlasts_a_pair_sides_rename_says_the_side_is_being_checked(
    side: str,
) -> None:
    """The QA run: a pair's side renamed while its server cannot answer (frozen): requests
    with a 1 s deadline ended at it with a 503 and Retry-After (right), but the body said "no
    routable worker among 1", as if the fleet lacked a worker, not that the renamed side was
    being checked. It says so now, as a model whose workers are not known yet does. (The
    renamed side, its models not known, is no candidate: it said "among 1" while it was.)"""
    async with (
        ReferenceWorker(reference("prefill")) as p,
        ReferenceWorker(reference("decode")) as d,
        DiscoveryGate(p.url if side == "prefill" else d.url) as gate,
        aiohttp.ClientSession() as session,
    ):
        gate.open.set()

        def fleet(renamed: str) -> Any:
            prefill = (renamed, gate.url) if side == "prefill" else ("p1", p.url)
            decode = (renamed, gate.url) if side == "decode" else ("d1", d.url)
            return router_config(
                [prefill, decode],
                health=HealthConfig(interval_s=0.2, timeout_s=3.0),
                timeouts=TimeoutsConfig(request_s=1.0),
            )

        file = {"c": fleet("old")}
        source = ConfigSource("pd.toml", lambda: file["c"])
        async with RouterService(file["c"], config_source=source) as router:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}

            async def send(model: str | None = DEFAULT_MODEL) -> tuple[int, str | None, Any]:
                named = body if model is None else {**body, "model": model}
                async with session.post(router.url + "/generate", json=named) as resp:
                    answer = await resp.json(content_type=None)
                    return resp.status, resp.headers.get("retry-after"), answer

            assert (await send())[0] == 200
            gate.open.clear()
            asked = gate.info_asked
            file["c"] = fleet("new")
            reload = asyncio.create_task(admin_reload(session, router))

            async def discovering() -> bool:
                return gate.info_asked > asked

            await eventually(discovering, what="the new id's discovery")
            status, retry_after, answer = await send()
            unnamed = await send(None)
            gate.open.set()
            assert status == 503 and retry_after is not None, answer
            assert answer["error"] == {
                "type": "NoWorkerError",
                "message": "no routable worker: worker 'new' is being checked, its "
                "side of a prefill/decode pair not known yet; the model's 1 "
                f"{'decode' if side == 'prefill' else 'prefill'} worker(s) have no pair until "
                "then",
            }
            # naming no model: the known workers' one model, hence the same answer (before,
            # 'new' was in that pool, a candidate while its models were not known)
            assert unnamed == (status, retry_after, answer)
            assert (await reload)[0] == 200
