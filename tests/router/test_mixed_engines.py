"""A model served by SGLang and vLLM workers together: an adapter one engine reads from the
request, the other does not (vLLM names it by `model` alone and ignores `lora_path`; SGLang
reads `lora_path` and takes a model it does not serve for its own). The pages each engine
cached under that adapter's name are not what the other serves the request from: the router
predicts no hit on the other engine's workers (shown in /admin/route), where it predicted
their adapter pages before (QA: 96 tokens predicted on a vLLM worker, 0 cached)."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from router.service import RouterService
from tests.router.conftest import AUTH, eventually, router_config
from tests.router.ops.test_kv_query import _adapter_pages
from tests.router.vllm_stub import vllm_payload, vllm_stub
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

BASE, ADAPTER = "base-v", "sql-lora"


async def test_an_adapter_one_engine_reads_is_predicted_on_that_engines_workers_only() -> None:
    tokens = list(range(1, 17))  # 4 pages of 4
    prompt = [*tokens, 99]
    cards = [{"id": BASE, "object": "model"}, {"id": ADAPTER, "object": "model", "parent": BASE}]
    async with (
        vllm_stub(cards=cards) as (vllm, pub),
        ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=4, model=BASE)) as sgl,
    ):
        (reference,) = router_config([("s", sgl.url)]).workers
        config = msgspec.structs.replace(router_config([]), workers=(reference, vllm))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def route(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
                async with session.post(
                    router.url + "/admin/route", json=body, headers=AUTH
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    plan = await resp.json()
                return {c["worker"]: c for c in plan["candidates"]}

            async def live() -> bool:
                await pub.publish_payload(vllm_payload())
                stream = next(s for s in router.indexer.streams() if s.worker == "v")
                models = router.planner.pool.get("v").models
                return stream.state == "synced" and models is not None

            await eventually(live, what="the vLLM stream live and its models read")
            # vLLM cached the adapter's pages (a request naming it by `model`)
            await pub.publish_payload(vllm_payload(_adapter_pages(tokens, ADAPTER)))
            # SGLang cached the adapter's pages too (a request naming it by lora_path)
            sent = {"input_ids": prompt, "lora_path": ADAPTER}
            async with session.post(sgl.url + "/generate", json=sent) as resp:
                assert resp.status == 200, await resp.text()
            by_model = {"model": ADAPTER, "prompt": prompt}  # vLLM's reading
            by_path = {"model": BASE, "prompt": prompt, "lora_path": ADAPTER}  # SGLang's

            async def indexed() -> bool:
                on_v = (await route(by_model))["v"]["matched_tokens"]
                on_s = (await route(by_path))["s"]["matched_tokens"]
                return bool(on_v == on_s == 16)

            await eventually(indexed, what="both engines' adapter pages indexed")
            named, pathed = await route(by_model), await route(by_path)
            # each engine's pages predicted where that engine reads the request's adapter
            assert named["v"]["unpredicted"] is None
            assert pathed["s"]["unpredicted"] is None
            # and never on the other engine's worker, which serves it from other pages
            assert named["s"]["matched_tokens"] == 0
            assert "sglang" in named["s"]["unpredicted"]
            assert pathed["v"]["matched_tokens"] == 0
            assert "ignores lora_path" in pathed["v"]["unpredicted"]
            # both read `model` naming the adapter with lora_path naming it too alike
            both = await route({**by_model, "lora_path": ADAPTER})
            assert both["v"]["matched_tokens"] == both["s"]["matched_tokens"] == 16
