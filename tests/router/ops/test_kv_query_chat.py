"""`/v1/kv/query` renders what a chat request adds to its messages (tools, template kwargs,
reasoning effort, documents, continuation) as the proxy does: its answer is `/admin/route`'s."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from indexer.engines import EngineName
from router.config import QueryConfig, TokenizerConfig
from router.prompt.conventions import CHAT_REQUEST_FIELDS
from router.prompt.request import chat_tokens
from router.prompt.tokenizer import build_tokenizer
from router.service import RouterService
from tests.router.chat_routing import FIXTURES
from tests.router.conftest import AUTH, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

pytest.importorskip("jinja2")

QAUTH = {"Authorization": "Bearer gateway-token"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
MESSAGES = [
    {"role": "system", "content": "You are the support agent of ACME. " * 6},
    {"role": "user", "content": "Where is my order?"},
]
TOOLS = {
    "messages": MESSAGES,
    "tools": [WEATHER],
    "chat_template_kwargs": {"enable_thinking": False},
}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Let me check"}]
# each alone changes the prompt for some engine (or is its 400), rendered as the proxy renders it
BODIES: list[dict[str, Any]] = [
    {"messages": MESSAGES},
    TOOLS,
    {**TOOLS, "tool_choice": "none"},
    {**TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"messages": MESSAGES, "reasoning_effort": "low"},
    {"messages": MESSAGES, "reasoning": {"effort": "none"}},
    {"messages": MESSAGES, "documents": [{"title": "faq", "text": "Orders ship in a day."}]},
    {"messages": MESSAGES, "add_generation_prompt": False},
    {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False},
    {"messages": CONTINUED, "continue_final_message": True},
    # media parts: the engine's tokens are not the router's, so no hit is predicted
    {
        "messages": [
            *MESSAGES[:1],
            {"role": "user", "content": [IMAGE, {"type": "text", "text": "?"}]},
        ]
    },
    # the proxy's 400s, the same
    {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": 3}}]},
    {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
    {"messages": MESSAGES, "reasoning_effort": "extreme"},
]


def _rows(answer: dict[str, Any], key: str) -> list[tuple[object, ...]]:
    return [(c["worker"], c["dp_rank"], c["matched_tokens"]) for c in answer[key]]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_chats_rendered_fields_are_queried_as_the_proxy_routes_them(
    engine: EngineName,
) -> None:
    """Before, the query API refused `tools`, `chat_template_kwargs`, `reasoning_effort` and
    `documents` as unknown fields: a gateway could only ask with the messages alone, and a chat
    with tools was matched by a prompt 100 tokens long where the proxy routed 671."""
    tokenizer = TokenizerConfig(
        chat_template=str(FIXTURES / "qwen3-0.6b" / "tokenizer_config.json"), chat_engine=engine
    )
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        config = router_config(
            [("w0", w0.url), ("w1", w1.url)],
            tokenizer=tokenizer,
            query=QueryConfig(token="gateway-token"),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def ask(path: str, body: object, headers: dict[str, str]) -> tuple[int, Any]:
                async with session.post(router.url + path, json=body, headers=headers) as r:
                    return r.status, await r.json()

            # the tools chat's prompt cached by one worker (its ids as the router renders them)
            ids = chat_tokens(TOOLS, build_tokenizer(tokenizer))
            warm = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
            async with session.post(router.url + "/generate", json=warm) as resp:
                assert resp.status == 200, await resp.text()

            async def indexed() -> bool:
                status, answer = await ask("/v1/kv/query", TOOLS, QAUTH)
                assert status == 200, answer
                return bool(answer["workers"][0]["matched_tokens"] == len(ids) // 16 * 16)

            await eventually(indexed, what="the tools chat's prompt indexed")
            seen = set()
            for body in BODIES:
                route = await ask("/admin/route?endpoint=/v1/chat/completions", body, AUTH)
                query = await ask("/v1/kv/query", body, QAUTH)
                print(
                    "DBG",
                    engine,
                    list(body)[1:],
                    route[0],
                    route[1].get("prompt_tokens"),
                    route[1].get("error"),
                    _rows(route[1], "candidates") if route[0] == 200 else "",
                    _rows(query[1], "workers") if query[0] == 200 else "",
                )
                assert route[0] == query[0], (body, route, query)
                if route[0] != 200:
                    assert query[1]["error"] == route[1]["error"], (body, route, query)
                    continue
                assert query[1]["prompt_tokens"] == route[1]["prompt_tokens"], body
                assert _rows(query[1], "workers") == _rows(route[1], "candidates"), body
                assert query[1]["best"]["worker"] == route[1]["worker"], body
                seen.add(query[1]["prompt_tokens"])
            # the fields changed the prompt; the tools chat matched what the worker cached
            _, plain = await ask("/v1/kv/query", {"messages": MESSAGES}, QAUTH)
            _, tools = await ask("/v1/kv/query", TOOLS, QAUTH)
            assert tools["prompt_tokens"] == len(ids) > plain["prompt_tokens"] + 100
            assert len(seen) >= 4, seen
            # they go with messages alone (the other prompts are rendered already)
            for field in CHAT_REQUEST_FIELDS:
                status, error = await ask("/v1/kv/query", {"text": "hi", field: []}, QAUTH)
                assert status == 400, error
                assert f"{field} go with messages only" in error["error"]["message"]
