"""A hybrid model's event stream end to end: real ZMQ into a real router, read by the dry run.

A scripted vLLM 0.33 publisher (real PUB and replay ROUTER on 127.0.0.1) plays a model with a
full-attention group and a sliding-window group; the router's plan counts only what the
full-attention group holds, so the window sliding past a prefix takes nothing away and the
sliding-window group holding pages the full-attention group lost predicts nothing.
"""

from __future__ import annotations

import aiohttp
import msgspec

from router.service import RouterService
from tests.indexer.test_hybrid_groups import removed, stored
from tests.router.conftest import AUTH, eventually, router_config
from tests.router.vllm_stub import vllm_payload as payload
from tests.router.vllm_stub import vllm_stub

TOKENS = list(range(1, 17))  # 4 pages of 4


async def test_only_the_full_attention_group_makes_a_predicted_prefix() -> None:
    async with vllm_stub() as (worker, pub):
        config = msgspec.structs.replace(router_config([]), workers=(worker,))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def matched() -> int:
                body = {"input_ids": [*TOKENS, 99], "cache_salt": "tenant-a"}
                async with session.post(
                    router.url + "/admin/route", json=body, headers=AUTH
                ) as resp:
                    plan = await resp.json()
                return int(plan["candidates"][0]["matched_tokens"])

            # empty batches until one arrives live: vLLM advertises no sockets, so what
            # the SUB missed and the join took from the replay waits for a live batch
            async def live() -> bool:
                await pub.publish_payload(payload())
                (stream,) = router.indexer.streams()
                return stream.state == "synced" and stream.last_seq is not None

            await eventually(live, what="the stream to be live")
            await pub.publish_payload(
                payload(
                    stored([11, 12, 13, 14], None, TOKENS, 0, "full_attention"),
                    stored([11, 12, 13, 14], None, TOKENS, 1, "sliding_window"),
                )
            )

            async def full() -> bool:
                return await matched() == 16

            await eventually(full, what="the full-attention pages indexed")
            # the window slides past the first pages: the full-attention copy stays
            await pub.publish_payload(payload(removed([11, 12], 1)))
            await pub.publish_payload(payload(removed([13, 14], 0)))

            async def half() -> bool:
                return await matched() == 8

            # only the full-attention group's eviction shortens the predicted prefix
            await eventually(half, what="the full-attention eviction applied")
            streams = router.indexer.streams()
            assert streams[0].skipped_group_blocks == 4 + 2
