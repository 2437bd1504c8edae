"""What both chat-template test files share: the golden fixtures (their frozen clock is the
`frozen_now` fixture of conftest.py) and the end-to-end check that a chat request matches the
pages a reference worker cached for the same prompt sent as rendered text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from router.config import IndexerSection, TokenizerConfig
from router.service import RouterService
from tests.router.conftest import AUTH, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat-templates"
MODELS = sorted(p.name for p in FIXTURES.iterdir() if (p / "goldens.json").is_file())


def goldens(model: str) -> dict[str, Any]:
    """One model's goldens (made with the real transformers; see the fixtures' README)."""
    data: dict[str, Any] = json.loads((FIXTURES / model / "goldens.json").read_text("utf-8"))
    return data


async def check_chat_matches_rendered_text(
    template: Path, body: dict[str, Any], rendered: str, bad: dict[str, Any], bad_field: str
) -> None:
    """Route `body` before and after a worker caches `rendered`; `bad` must be a 400 naming
    `bad_field`. The reference workers tokenize text byte by byte, like the router's byte
    tokenizer, so after warming the chat request matches every full page of `rendered`."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as worker:
        tokenizer = TokenizerConfig(chat_template=str(template))
        config = router_config(
            [("w0", worker.url)], tokenizer=tokenizer, indexer=IndexerSection(pending_ttl_s=0.05)
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def matched() -> int:
                url = router.url + "/admin/route?endpoint=/v1/chat/completions"
                async with session.post(url, json=body, headers=AUTH) as resp:
                    assert resp.status == 200, await resp.text()
                    plan = await resp.json()
                return int(plan["candidates"][0]["matched_tokens"])

            assert await matched() == 0
            warm = {"text": rendered, "sampling_params": {"max_new_tokens": 1}}
            async with session.post(router.url + "/generate", json=warm) as resp:
                assert resp.status == 200, await resp.text()
            full_pages = len(rendered.encode()) // 16 * 16

            async def indexed() -> bool:
                return await matched() == full_pages

            await eventually(indexed, what="the rendered chat prompt to be indexed")
            async with session.post(router.url + "/v1/chat/completions", json=bad) as resp:
                assert resp.status == 400
                assert bad_field in (await resp.text())
