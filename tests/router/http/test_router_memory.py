"""/admin/debug/memory: resident memory always, growing allocation sites when tracing."""

from __future__ import annotations

import tracemalloc

import aiohttp

from router.service import RouterService
from tests.router.conftest import AUTH, router_config

HOARD: list[bytes] = []


async def test_memory_names_the_site_that_grows_since_the_baseline() -> None:
    async with RouterService(router_config([])) as router, aiohttp.ClientSession() as session:
        url = router.url + "/admin/debug/memory"
        async with session.get(url, headers=AUTH) as resp:
            body = await resp.json()
        assert resp.status == 200 and body["rss_bytes"] > 0 and body["tracing"] is False
        async with session.post(url + "/baseline", headers=AUTH) as resp:
            assert resp.status == 409  # tracing is off: it says how to turn it on
        async with session.get(url) as resp:
            assert resp.status == 401  # admin: the token is required
        tracemalloc.start(1)
        try:
            async with session.post(url + "/baseline", headers=AUTH) as resp:
                assert resp.status == 200
            HOARD.extend(bytes(1024) + bytes([i % 256]) for i in range(4000))  # ~4 MB, one line
            async with session.get(url + "?top=5", headers=AUTH) as resp:
                body = await resp.json()
        finally:
            tracemalloc.stop()
            HOARD.clear()
        top = body["growth"][0]
        assert "test_router_memory.py:" in top["site"] and top["size_diff_bytes"] > 3e6
