"""A vLLM worker as the router sees it, for tests: its HTTP side (health, and its models when
given) and a scripted ZMQ publisher of its KV events, with the worker's config."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.config import WorkerConfig
from tests.indexer.scripted import ScriptedPublisher


def vllm_payload(*events: dict[str, Any]) -> bytes:
    """One vLLM 0.33 event batch (tagged-map events) as its publisher sends it."""
    return msgspec.msgpack.encode([1767225600.25, list(events), 0])


@asynccontextmanager
async def vllm_stub(
    worker_id: str = "v", model: str = "", cards: list[dict[str, Any]] | None = None
) -> AsyncIterator[tuple[WorkerConfig, ScriptedPublisher]]:
    """A vLLM worker `worker_id` (its page size 4, its topic "kv"), serving `model` as the
    config names it, and listing `cards` at /v1/models when given: its config, and the
    publisher of its events."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": cards})

    app = web.Application()
    app.router.add_get("/health", health)
    if cards is not None:
        app.router.add_get("/v1/models", models)
    ctx = zmq.asyncio.Context()
    try:
        async with TestServer(app, host="127.0.0.1") as server, ScriptedPublisher(ctx) as pub:
            config = WorkerConfig(
                url=str(server.make_url("")),
                id=worker_id,
                engine="vllm",
                model=model,
                events=pub.endpoint,
                replay=pub.replay_endpoint,
                block_size=4,
                topic="kv",
            )
            yield config, pub
    finally:
        ctx.destroy(linger=0)
