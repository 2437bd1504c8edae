"""/admin/debug/memory: resident memory always, growing allocation sites when tracing."""

from __future__ import annotations

import logging
import tracemalloc

import aiohttp
import pytest

from router.http.memory import TRACEMALLOC_ENV, start_tracing
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


@pytest.mark.parametrize(
    ("value", "frames", "warned"),
    [
        *[("", 0, False), ("0", 0, False), (" 0 ", 0, False), ("-2", 0, False), ("3", 3, False)],
        *[("abc", 0, True), ("1.5", 0, True), ("70000", 0, True)],
    ],
)
def test_tracemalloc_is_on_only_for_a_number_of_frames(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str,
    frames: int,
    warned: bool,
) -> None:
    assert not tracemalloc.is_tracing()
    monkeypatch.setenv(TRACEMALLOC_ENV, value)
    try:
        with caplog.at_level(logging.WARNING, logger="router.http.memory"):
            assert start_tracing() is (frames > 0)
        assert tracemalloc.is_tracing() is (frames > 0)
        if frames:
            assert tracemalloc.get_traceback_limit() == frames
    finally:
        tracemalloc.stop()
    said = [r.getMessage() for r in caplog.records]
    assert bool(said) is warned, said
    if warned:
        assert f"{TRACEMALLOC_ENV}={value!r} is not a number of frames" in said[0]
