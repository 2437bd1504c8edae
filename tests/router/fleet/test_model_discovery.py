"""Which models a worker serves, when its config does not say: discovered and rediscovered.

SGLang's `/server_info` names its `served_model_name`; every OpenAI-compatible server lists
its models on `/v1/models`, where SGLang and vLLM list each loaded LoRA adapter as a card with
a `parent`. Real servers on 127.0.0.1: reference workers, and a small OpenAI-only backend.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Self

import aiohttp
import msgspec
import pytest
from aiohttp import web

from router.config import WorkerConfig
from router.fleet.discovery import models_from_model_list, models_from_server_info
from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config, serve_app
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


def test_what_the_answers_say() -> None:
    assert models_from_server_info({"served_model_name": "Qwen/Qwen3-8B"}) == ("Qwen/Qwen3-8B",)
    assert models_from_server_info({"model_path": "m"}) is None
    assert models_from_server_info({"served_model_name": None}) is None
    cards: list[Any] = [
        {"id": "base", "object": "model", "root": "base", "parent": None},
        {"id": "an-adapter", "object": "model", "root": "/loras/a", "parent": "base"},
        {"id": "alias", "object": "model"},
        {"id": "base"},
        {"id": ""},
        {"id": 5},
        "junk",
    ]
    assert models_from_model_list({"object": "list", "data": cards}) == ("base", "alias")
    assert models_from_model_list({"object": "list", "data": []}) == ()
    assert models_from_model_list({"data": "x"}) is None
    assert models_from_model_list([]) is None


class OpenAIBackend:
    """An OpenAI-compatible server with one model and its LoRA adapters, and no /server_info
    (vLLM's /v1/models: an adapter is a card whose `parent` is the base)."""

    def __init__(self, base: str = "base-x", adapters: tuple[str, ...] = ("lora-x",)) -> None:
        self.base = base
        self.adapters = adapters
        self.models_asked = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        cards = [{"id": self.base, "object": "model", "root": self.base, "parent": None}]
        cards += [
            {"id": name, "object": "model", "root": f"/adapters/{name}", "parent": self.base}
            for name in self.adapters
        ]
        return web.json_response({"object": "list", "data": cards})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"object": "text_completion", "model": body.get("model")})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def _routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)

    async def __aenter__(self) -> Self:
        app = web.Application()
        self._routes(app)
        self._runner, self.url = await serve_app(app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.asynccontextmanager
async def _router(*workers: WorkerConfig) -> AsyncIterator[Fleet]:
    config = msgspec.structs.replace(router_config([]), workers=workers)
    async with RouterService(config) as router, aiohttp.ClientSession() as session:
        yield Fleet(router, {}, session)


def _models_of(workers: dict[str, Any]) -> dict[str, list[str]]:
    return {w["id"]: w["models"] for w in workers["workers"]}


async def test_a_worker_without_a_configured_model_serves_what_its_v1_models_lists() -> None:
    reference = ReferenceConfig(model="model-a", time_scale=0.0)
    async with ReferenceWorker(reference) as worker, OpenAIBackend() as backend:
        # no events to discover, so no /server_info: the models come from /v1/models
        workers = (
            WorkerConfig(url=worker.url, id="ref", kv_events=False),
            WorkerConfig(url=backend.url, id="openai", kv_events=False),
        )
        async with _router(*workers) as fleet:
            assert backend.models_asked == 1
            status, listed = await fleet.admin("GET", "/workers")
            assert status == 200
            # the adapter card is an adapter of base-x, not a model of its own
            assert _models_of(listed) == {"ref": ["model-a"], "openai": ["base-x"]}
            for model, worker_id in [
                ("model-a", "ref"),
                ("base-x", "openai"),
                ("base-x:lora-x", "openai"),
            ]:
                body = {"model": model, "prompt": "hello", "max_tokens": 1}
                status, headers, answer = await fleet.post("/v1/completions", body)
                assert status == 200 and headers["x-kvroute-worker"] == worker_id, answer
            status, _, answer = await fleet.post(
                "/v1/completions", {"model": "lora-x", "prompt": "x"}
            )
            assert status == 404 and answer["error"]["models"] == ["model-a", "base-x"]
            async with fleet.session.get(fleet.url + "/v1/models") as resp:
                assert [c["id"] for c in (await resp.json())["data"]] == ["model-a", "base-x"]


async def test_an_sglang_worker_names_its_model_in_server_info() -> None:
    async with (
        ReferenceWorker(ReferenceConfig(model="model-a", time_scale=0.0)) as a,
        ReferenceWorker(ReferenceConfig(model="model-b", time_scale=0.0)) as b,
        _router(WorkerConfig(url=a.url, id="a")) as fleet,
    ):
        async with fleet.session.get(a.url + "/server_info") as resp:
            assert (await resp.json())["served_model_name"] == "model-a"
        # added on the admin API, discovered like the configured one
        status, added = await fleet.admin("POST", "/workers", {"url": b.url, "id": "b"})
        assert status == 201 and added["models"] == ["model-b"] and added["model"] == "model-b"
        _, workers = await fleet.admin("GET", "/workers")
        assert _models_of(workers) == {"a": ["model-a"], "b": ["model-b"]}
        _, streams = await fleet.admin("GET", "/streams")
        assert len(streams["streams"]) == 2  # its events were discovered alongside
        plan = await fleet.route({"model": "model-b", "prompt": "x"})
        assert [c["worker"] for c in plan["candidates"]] == ["b"]


async def test_a_worker_that_comes_back_serving_another_model_is_rediscovered() -> None:
    async with ReferenceWorker(ReferenceConfig(model="model-b", time_scale=0.0)) as b:
        first = ReferenceWorker(ReferenceConfig(model="model-a", time_scale=0.0))
        await first.__aenter__()
        port = int(first.url.rsplit(":", 1)[1])
        try:
            async with _router(
                WorkerConfig(url=first.url, id="w0"), WorkerConfig(url=b.url, id="w1")
            ) as fleet:
                plan = await fleet.route({"model": "model-a", "prompt": "x"})
                assert [c["worker"] for c in plan["candidates"]] == ["w0"]
                await first.__aexit__(None, None, None)

                async def down() -> bool:
                    _, workers = await fleet.admin("GET", "/workers")
                    return any(w["id"] == "w0" and not w["healthy"] for w in workers["workers"])

                await eventually(down, what="w0 out of rotation")
                again = ReferenceConfig(model="model-c", time_scale=0.0, port=port)
                first = ReferenceWorker(again)
                await first.__aenter__()

                async def serves_model_c() -> bool:
                    body = {"model": "model-c", "prompt": "x"}
                    status, answer = await fleet.admin("POST", "/route", body)
                    assert status in (200, 404), answer
                    return status == 200

                await eventually(serves_model_c, what="w0's new model to be discovered")
                plan = await fleet.route({"model": "model-c", "prompt": "x"})
                assert [c["worker"] for c in plan["candidates"]] == ["w0"]
                gone = {"model": "model-a", "prompt": "x"}
                status, answer = await fleet.admin("POST", "/route", gone)
                assert status == 404 and answer["error"]["models"] == ["model-c", "model-b"]
                request = {"model": "model-c", "prompt": "hello", "max_tokens": 1}
                status, headers, _ = await fleet.post("/v1/completions", request)
                assert status == 200 and headers["x-kvroute-worker"] == "w0"
                _, streams = await fleet.admin("GET", "/streams")
                # its cache is model-c's now: subscribed anew on the new process's endpoints
                w0 = [s for s in streams["streams"] if s["worker"] == "w0"]
                assert [s["endpoint"] for s in w0] == [first.kv_events.endpoint]
        finally:
            await first.__aexit__(None, None, None)


async def test_a_fleet_is_no_one_pool_while_a_workers_models_are_unknown() -> None:
    """w1 (model-y) is down when the router starts, its models not known: the one known
    model is not the fleet's only one. Requests naming model-y, or a name no known worker
    serves, are 503s to retry, on every endpoint; model-x's go to w0 only, as do those that
    name no model ("default", or none). Before, the fleet
    was one pool of model-x meanwhile: model-y's requests (and 'llama') were answered 200 by
    model-x, and /admin/route resolved model-y to model-x."""
    first = ReferenceWorker(ReferenceConfig(model="model-y", time_scale=0.0))
    await first.__aenter__()
    port = int(first.url.rsplit(":", 1)[1])
    y_url = first.url
    await first.__aexit__(None, None, None)  # down from the start
    async with ReferenceWorker(ReferenceConfig(model="model-x", time_scale=0.0)) as x:
        workers = (WorkerConfig(url=x.url, id="w0"), WorkerConfig(url=y_url, id="w1"))
        async with _router(*workers) as fleet:
            bodies: dict[str, dict[str, Any]] = {
                "/v1/completions": {"prompt": "which model?", "max_tokens": 1},
                "/v1/chat/completions": {
                    "messages": [{"role": "user", "content": "which model?"}],
                    "max_tokens": 1,
                },
                "/generate": {"text": "which model?", "sampling_params": {"max_new_tokens": 1}},
            }
            for endpoint, body in bodies.items():
                for model in ("model-y", "llama"):
                    status, headers, answer = await fleet.post(endpoint, {**body, "model": model})
                    assert status == 503, (endpoint, model, answer)
                    assert answer["error"]["type"] == "ModelUnavailableError", answer
                    assert headers["Retry-After"] == "1"
                # model-x's go to w0; so do those naming no model in particular (any model
                # does for them: a worker still loading must not turn them all away)
                for model in ("model-x", "default", ""):
                    named = {**body, "model": model} if model else body
                    status, headers, answer = await fleet.post(endpoint, named)
                    assert status == 200 and headers["x-kvroute-worker"] == "w0", answer
            status, answer = await fleet.admin(
                "POST", "/route", {"model": "model-y", "prompt": "x"}
            )
            assert status == 503 and answer["error"]["type"] == "ModelUnavailableError", answer
            plan = await fleet.route({"model": "model-x", "prompt": "x"})
            assert [c["worker"] for c in plan["candidates"]] == ["w0"]

            y = ReferenceWorker(ReferenceConfig(model="model-y", time_scale=0.0, port=port))
            async with y:

                async def registered() -> bool:
                    _, listed = await fleet.admin("GET", "/workers")
                    return _models_of(listed)["w1"] == ["model-y"]

                await eventually(registered, what="w1's models discovered once it is up")
                body = {"model": "model-y", "prompt": "which model?", "max_tokens": 1}
                status, headers, answer = await fleet.post("/v1/completions", body)
                assert status == 200 and headers["x-kvroute-worker"] == "w1", answer
                status, _, answer = await fleet.post("/v1/completions", {**body, "model": "llama"})
                assert status == 404 and answer["error"]["type"] == "UnknownModelError", answer
                # a wrong-typed model is the client's error, named (it read as no model: 404)
                status, _, answer = await fleet.post("/v1/completions", {**body, "model": 123})
                assert status == 400, answer
                assert answer["error"]["message"] == "model must be a string, not a number"


class StockSglang(OpenAIBackend):
    """An SGLang-like server whose `/server_info` has stock `kv_events_config` only."""

    def __init__(self, model: str, kv_events_config: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.config = kv_events_config

    async def _server_info(self, request: web.Request) -> web.Response:
        info = {"served_model_name": self.model, "kv_events_config": msgspec.json.encode(
            self.config).decode(), "page_size": 16}  # fmt: skip
        return web.json_response(info)

    def _routes(self, app: web.Application) -> None:
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)


async def test_a_worker_whose_streams_cannot_be_had_still_serves_its_model_by_load() -> None:
    """SGLang's default publisher is the null one: no events, but the worker serves its model
    (it had been left with no model, so a fleet of several sent it nothing)."""
    reference = ReferenceConfig(model="model-a", time_scale=0.0)
    async with (
        ReferenceWorker(reference) as worker,
        StockSglang("model-b", {"endpoint": "tcp://*:5557"}) as silent,
        _router(WorkerConfig(url=worker.url, id="a"), WorkerConfig(url=silent.url, id="b"))
        as fleet,
    ):  # fmt: skip
        _, workers = await fleet.admin("GET", "/workers")
        assert _models_of(workers) == {"a": ["model-a"], "b": ["model-b"]}
        status, headers, _ = await fleet.post(
            "/v1/completions", {"model": "model-b", "prompt": "x", "max_tokens": 1}
        )
        assert status == 200 and headers["x-kvroute-worker"] == "b"
        assert headers["x-kvroute-matched-tokens"] == "0"
        (entry,) = [w for w in workers["workers"] if w["id"] == "b"]
        assert entry["streams"] == [] and not entry["discovered"]
        said = fleet.router.supervisor.refusal("b")
        assert said is not None and "publisher is 'null'" in said and "worker b" not in said


async def test_configured_events_for_fewer_ranks_than_the_worker_runs_are_refused() -> None:
    """Events spelled out in the config, for one rank of a worker that advertises two: rank 1
    would go unsubscribed while the engine places requests there, predicted from rank 0's
    pages (half the repeats were false hits); refused, with dp_size given or left out."""
    async with ReferenceWorker(ReferenceConfig(dp_size=2, time_scale=0.0)) as worker:
        events = worker.kv_events
        for dp_size in (1, None):
            spelled = WorkerConfig(
                url=worker.url, id="w", events=events.endpoint, replay=events.replay_endpoint,
                block_size=events.block_size, dp_size=dp_size,
            )  # fmt: skip
            async with _router(spelled) as fleet:
                _, workers = await fleet.admin("GET", "/workers")
                assert workers["workers"][0]["streams"] == []
                said = fleet.router.supervisor.refusal("w")
                assert said is not None and "advertises dp_size 2" in said, said
        # all its ranks spelled out: taken
        whole = WorkerConfig(
            url=worker.url,
            id="w",
            events=events.endpoints,
            replay=events.replay_endpoints,
            block_size=events.block_size,
        )
        async with _router(whole) as fleet:
            _, workers = await fleet.admin("GET", "/workers")
            assert len(workers["workers"][0]["streams"]) == 2


async def test_an_adapter_listed_under_two_base_models_is_refused_not_guessed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """v1 and v3 serve base-v, v2 base-w, and all three list the adapter `shared`: the last
    worker's base won, so `shared` went to base-v until v3 was removed, then to base-w (v1
    still served it). Now: one warning when it becomes ambiguous, a 400 naming both bases on
    the proxy and on /v1/kv/query, and base-v's once only base-v lists it."""
    caplog.set_level(logging.WARNING, logger="router.fleet.registration_notes")
    async with (
        OpenAIBackend("base-v", ("sql-lora", "shared")) as v1,
        OpenAIBackend("base-w", ("shared",)) as v2,
        OpenAIBackend("base-v", ("sql-lora", "shared")) as v3,
        _router(*(
            WorkerConfig(url=b.url, id=wid, engine="vllm", kv_events=False)
            for wid, b in (("v1", v1), ("v2", v2), ("v3", v3))
        )) as fleet,
    ):  # fmt: skip
        said = [r.getMessage() for r in caplog.records if "'shared'" in r.getMessage()]
        assert len(said) == 1 and "'base-v', 'base-w'" in said[0], said
        body = {"model": "shared", "prompt": "x", "max_tokens": 1}
        for removed in ("", "v3"):
            if removed:
                assert (await fleet.admin("DELETE", f"/workers/{removed}"))[0] == 200
            status, _, answer = await fleet.post("/v1/completions", body)
            assert status == 400, answer
            error = answer["error"]
            assert (error["type"], error["bases"]) == ("AmbiguousModelError", ["base-v", "base-w"])
            assert "distinct name" in error["message"]
            query = {"model": "shared", "token_ids": [1, 2, 3]}
            async with fleet.session.post(fleet.url + "/v1/kv/query", json=query) as resp:
                refused = await resp.json()
                assert resp.status == 400 and refused["error"]["type"] == "AmbiguousModelError"
            status, headers, _ = await fleet.post("/v1/completions", {**body, "model": "sql-lora"})
            assert status == 200 and headers["x-kvroute-worker"] in ("v1", "v3")
        assert len([r for r in caplog.records if "'shared'" in r.getMessage()]) == 1
        assert (await fleet.admin("DELETE", "/workers/v2"))[0] == 200
        status, headers, _ = await fleet.post("/v1/completions", body)
        assert status == 200 and headers["x-kvroute-worker"] == "v1"


async def test_an_ambiguous_adapters_refusals_are_counted_under_its_name() -> None:
    """The 400s for an adapter that workers of two base models list were counted with an
    empty `model` label, as if no model had been read: now under the adapter's name (one the
    workers list: bounded by the fleet), on the proxy's routes and on /v1/kv/query, while a
    made-up name is still `(unknown)` and never the client's string."""
    async with (
        OpenAIBackend("base-v", ("shared",)) as v1,
        OpenAIBackend("base-w", ("shared",)) as v2,
        _router(*(
            WorkerConfig(url=b.url, id=wid, engine="vllm", kv_events=False)
            for wid, b in (("v1", v1), ("v2", v2))
        )) as fleet,
    ):  # fmt: skip
        for model in ("shared", "shared", "made-up-7"):
            body = {"model": model, "prompt": "x", "max_tokens": 1}
            assert (await fleet.post("/v1/completions", body))[0] in (400, 404)
        query = {"model": "shared", "token_ids": [1, 2, 3]}
        async with fleet.session.post(fleet.url + "/v1/kv/query", json=query) as resp:
            assert resp.status == 400
        async with fleet.session.get(fleet.url + "/metrics") as resp:
            text = await resp.text()
    rejected = "kvroute_rejected_requests_total{endpoint="
    assert f'{rejected}"/v1/completions",error="AmbiguousModelError",model="shared"}} 2.0' in text
    assert f'{rejected}"/v1/kv/query",error="AmbiguousModelError",model="shared"}} 1.0' in text
    assert f'{rejected}"/v1/completions",error="UnknownModelError",model="(unknown)"}} 1.0' in text
    assert 'error="AmbiguousModelError",model=""' not in text and "made-up" not in text


async def test_a_configured_model_the_worker_does_not_advertise_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The config's model wins over the one a worker advertises (a router-side name is
    allowed), but when none of its names is advertised the URL may point at another model's
    worker: it was taken without a word ("serves model-a" only)."""
    caplog.set_level(logging.WARNING, logger="router.fleet.registration_notes")
    reference = ReferenceConfig(model="model-s", time_scale=0.0)
    async with (
        ReferenceWorker(reference) as worker,
        OpenAIBackend("base-x", ()) as backend,
        OpenAIBackend("base-x", ()) as named_alike,
        _router() as fleet,
    ):
        added = [
            {"id": "ws", "url": worker.url, "model": "model-a"},  # SGLang: served_model_name
            {"id": "vx", "url": backend.url, "model": "base-y", "engine": "vllm",
             "kv_events": False},  # vLLM: its /v1/models
            {"id": "ok", "url": named_alike.url, "model": "base-x", "models": ["alias"],
             "engine": "vllm", "kv_events": False},
        ]  # fmt: skip
        for body in added:
            status, answer = await fleet.admin("POST", "/workers", body)
            assert status == 201, answer
        said = [r.getMessage() for r in caplog.records if "advertises" in r.getMessage()]
        assert said == [
            "worker ws: the config says it serves 'model-a', it advertises 'model-s': routed "
            "as the config says; check its url",
            "worker vx: the config says it serves 'base-y', it advertises 'base-x': routed "
            "as the config says; check its url",
        ]
        _, workers = await fleet.admin("GET", "/workers")
        assert _models_of(workers) == {
            "ws": ["model-a"],
            "vx": ["base-y"],
            "ok": ["base-x", "alias"],
        }
