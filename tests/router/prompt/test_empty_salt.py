"""An empty `cache_salt` per engine: SGLang 0.5.23 reads it as none (`_normalize_cache_salt`),
vLLM 0.33 refuses it (`validate_cache_salt`: "must be a non-empty string if provided").

The router reads `""` as the unsalted namespace and forwards the body unchanged, so a vLLM
worker's own 400, naming the field, is the client's answer. That refusal stores nothing and is
the client's fault: it is not retried on another worker, nothing of it stays predicted, and no
worker is charged a failure, however many such requests come (else a client could open every
circuit of the model).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.config import BreakerConfig, WorkerConfig
from router.service import RouterService
from tests.router.conftest import router_config

PROMPT = "An empty salt is no salt to SGLang and a refusal to vLLM. " * 4


def _vllm_like(seen: list[object]) -> web.Application:
    """vLLM 0.33's OpenAI completions as far as the salt goes: its validation and its 400;
    `seen` gets each request's salt."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def completions(request: web.Request) -> web.Response:
        salt = (await request.json()).get("cache_salt")
        seen.append(salt)
        if salt is not None and (not isinstance(salt, str) or not salt):
            message = "Parameter 'cache_salt' must be a non-empty string if provided."
            error = {"message": message, "type": "BadRequestError", "param": "cache_salt"}
            return web.json_response({"error": {**error, "code": 400}}, status=400)
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response({"id": "c", "object": "text_completion", "usage": usage})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_a_vllm_workers_refusal_of_an_empty_salt_is_the_clients_answer() -> None:
    seen: list[object] = []
    async with (
        TestServer(_vllm_like(seen), host="127.0.0.1") as s0,
        TestServer(_vllm_like(seen), host="127.0.0.1") as s1,
    ):
        workers = tuple(
            WorkerConfig(url=str(s.make_url("")), id=f"v{i}", engine="vllm", kv_events=False)
            for i, s in enumerate((s0, s1))
        )
        # one failure charged would open a worker's circuit: three refusals would open both
        config = msgspec.structs.replace(
            router_config([]), workers=workers, breaker=BreakerConfig(failure_threshold=1)
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def complete(salt: object) -> tuple[int, Any]:
                body = {"prompt": PROMPT, "max_tokens": 1, "cache_salt": salt}
                async with session.post(router.url + "/v1/completions", json=body) as resp:
                    return resp.status, await resp.json()

            for _ in range(3):
                status, answer = await complete("")
                assert status == 400 and answer["error"]["param"] == "cache_salt", answer
            assert seen == ["", "", ""]  # each sent once: no retry of the client's fault
            body = {"text": PROMPT}  # "" or null: the unsalted namespace
            async with session.post(router.url + "/v1/kv/query", json=body) as resp:
                rows = (await resp.json())["workers"]
            assert all(r["pending_tokens"] == 0 and r["routable"] for r in rows), rows
            for _ in range(2):
                status, _ = await complete(None)
                assert status == 200
