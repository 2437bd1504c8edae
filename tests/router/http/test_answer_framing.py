"""Whole answer or stream: the client's request decides, not the worker's framing.

A proxy or sidecar between the router and a worker may re-send any answer with
`Transfer-Encoding: chunked`. The router took every chunked answer for a stream: a whole JSON
answer cut midway reached the client as a cut 200 (a `Content-Length` one is retried), and a
batched `/generate` answer had its last item's `cached_tokens` held against its first item's
prediction (a false hit every time, and the false-hit watch dropped a healthy worker's index
entries after four). Real workers on 127.0.0.1: aiohttp servers and the reference worker,
behind a pass-through that re-chunks every answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from router.config import PolicyConfig, RouterConfig
from router.http.decisions import Decision
from router.http.keys import DECISIONS
from router.service import RouterService
from tests.router.conftest import Fleet, WorkerPassThrough, eventually, router_config, serve_app
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

_ANSWER = {"id": "c", "choices": [{"index": 0, "text": "ok"}]}


class Worker:
    """An aiohttp worker whose answers each test sets (`mode`); it counts what it was sent."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.asked = 0
        self.release = asyncio.Event()  # "sse-held": the rest of the stream waits for it
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.asked += 1
        if self.mode == "whole":
            return web.json_response(_ANSWER)
        if self.mode == "chunked-cut":  # a whole JSON answer, chunked, its connection lost
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(json.dumps(_ANSWER).encode()[:12])
            assert request.transport is not None
            request.transport.close()  # no last chunk: the answer is unended
            await asyncio.sleep(30)  # cancelled: its connection is closed
        if self.mode == "sse-held":  # a stream, to a request that did not ask for one
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"n": 1}\n\n')
            await self.release.wait()
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if self.mode == "batch-sse":  # SGLang streams a batch: each event one item's, `index`
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for index, cached in ((0, 48), (1, 0)):
                event = {"text": "o", "index": index, "meta_info": {"cached_tokens": cached}}
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        # "batch-usage": OpenAI's usage of a list of prompts sums every prompt's
        usage = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
        return web.json_response(_ANSWER | {"usage": usage})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def __aenter__(self) -> Worker:
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/generate", self._answer)
        app.router.add_get("/health", self._health)
        self._runner, self.url = await serve_app(app, handler_cancellation=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


class Rechunking(WorkerPassThrough):
    """A worker's API passed through a server of its own (`url`), every answer re-sent with
    `Transfer-Encoding: chunked` as a streaming sidecar or proxy sends it."""

    async def _answer(
        self, request: web.Request, resp: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.content_type})
        out.enable_chunked_encoding()
        await out.prepare(request)
        async for data in resp.content.iter_any():
            await out.write(data)
        await out.write_eof()
        return out


def _plain(workers: list[tuple[str, str]], **overrides: Any) -> RouterConfig:
    config = router_config(workers, **overrides)
    plain = tuple(msgspec.structs.replace(w, kv_events=False, model="m") for w in config.workers)
    return msgspec.structs.replace(config, workers=plain)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_a_whole_answer_sent_chunked_and_cut_is_retried_on_the_next_worker(
    session: aiohttp.ClientSession,
) -> None:
    """Before, the cut answer's status line had gone out already: the client got a 200 and a
    cut body (IncompleteRead) where the same cut with a `Content-Length` is retried."""
    async with Worker("chunked-cut") as cut, Worker("whole") as whole:
        # round robin: the first request goes to the first worker, the one that cuts
        config = _plain(
            [("cut", cut.url), ("whole", whole.url)], policy=PolicyConfig(name="round_robin")
        )
        async with (
            RouterService(config) as router,
            session.post(router.url + "/v1/completions", json={"prompt": "x"}) as resp,
        ):
            assert resp.status == 200
            assert await resp.json() == _ANSWER  # whole, from the next worker
            assert resp.headers["x-kvroute-worker"] == "whole"
    assert cut.asked == 1 and whole.asked == 1


async def test_an_sse_answer_is_a_stream_whoever_asked_for_it(
    session: aiohttp.ClientSession,
) -> None:
    """A worker that streams to a request whose `stream` the router did not read as true (an
    engine that takes `"stream": 1` for true) is passed through as a stream still: chunk by
    chunk, not held until its end (nor to the whole answer's bound)."""
    async with (
        Worker("sse-held") as worker,
        RouterService(_plain([("w", worker.url)])) as router,
        session.post(router.url + "/v1/completions", json={"prompt": "x", "stream": 1}) as resp,
    ):
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readline(), 5)
        assert first == b'data: {"n": 1}\n'  # before the worker's stream ended
        worker.release.set()
        assert (await resp.read()).strip() == b"data: [DONE]"


async def _the_decision(router: RouterService) -> Decision:
    """The one request's decision, once its answer is counted."""
    stats = router.app[DECISIONS]

    async def counted() -> bool:
        return len(stats.recent) == 1

    await eventually(counted, what="the answer counted")
    (decision,) = stats.recent
    return decision


@pytest.mark.parametrize(
    ("mode", "path", "body"),
    [
        ("batch-sse", "/generate", {"text": ["a", "b"], "stream": True}),
        ("batch-usage", "/v1/completions", {"prompt": ["a", "b"]}),
    ],
)
async def test_a_batched_answers_usage_is_no_one_predictions(
    session: aiohttp.ClientSession, mode: str, path: str, body: dict[str, Any]
) -> None:
    """A batch is routed by its first item, but its answer's usage is every item's: SGLang's
    batched stream gives each event one item's `cached_tokens` (the last event's is any
    item's), OpenAI's usage of a list of prompts is their sum. Neither is held against the
    first item's prediction: the answer counts as one without usage."""
    async with Worker(mode) as worker, RouterService(_plain([("w", worker.url)])) as router:
        async with session.post(router.url + path, json=body) as resp:
            assert resp.status == 200
            await resp.read()
        decision = await _the_decision(router)
    assert decision.status == 200 and decision.cached_tokens is None


async def test_a_one_prompt_lists_usage_is_its_prompts(session: aiohttp.ClientSession) -> None:
    """A list of one prompt (clients that always send lists) has one prediction, its only
    item's: its answer's usage is read as a single prompt's (the batch fix counted it as
    missing, so such clients had no accuracy metric and no false-hit watch)."""
    async with (
        Worker("batch-usage") as worker,
        RouterService(_plain([("w", worker.url)])) as router,
    ):
        async with session.post(router.url + "/v1/completions", json={"prompt": ["a"]}) as resp:
            assert resp.status == 200
            await resp.read()
        decision = await _the_decision(router)
    assert decision.status == 200 and decision.cached_tokens == 32


async def test_a_batched_generate_answer_sent_chunked_is_no_false_hit(
    session: aiohttp.ClientSession,
) -> None:
    """QA: `{"text": [cached prompt, fresh prompt]}` through a proxy that re-chunks answers went
    down the stream path, whose usage reader took the last item's `cached_tokens` (0) for the
    first item's (predicted a hit): `over` every time, and after four the false-hit watch
    subscribed the healthy worker's streams anew and dropped its index entries."""
    shared = "batched generate shared prefix " + "the quick brown fox " * 12
    params = {"max_new_tokens": 1}
    async with (
        ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as w0,
        Rechunking(w0.url) as front,
        RouterService(router_config([("w0", front.url)])) as router,
    ):
        fleet = Fleet(router, {"w0": w0}, session)
        await fleet.warm()
        status, _, _ = await fleet.post("/generate", {"text": shared, "sampling_params": params})
        assert status == 200
        await eventually(
            lambda: fleet.holds({"text": shared}, "w0", 160), what="the shared prompt indexed"
        )
        for i in range(5):
            batch = {"text": [shared, f"fresh {i} " + "zz" * 60], "sampling_params": params}
            async with session.post(router.url + "/generate", json=batch) as resp:
                assert resp.status == 200
                assert int(resp.headers["x-kvroute-matched-tokens"]) >= 160
                items = await resp.json()
            cached = [item["meta_info"]["cached_tokens"] for item in items]
            assert cached[0] >= 160 and cached[1] == 0
        async with session.get(router.url + "/metrics") as resp:
            metrics = await resp.text()
        assert router.indexer.has_worker("w0")  # its streams never dropped
    over = [
        line
        for line in metrics.splitlines()
        if line.startswith("kvroute_prediction_outcomes_total{") and 'outcome="over"' in line
    ]
    assert over and all(line.endswith(" 0.0") for line in over), over
    assert 'kvroute_false_hit_actions_total{action="resubscribed",worker="w0"} 0.0' in metrics
