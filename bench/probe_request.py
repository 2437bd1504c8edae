"""One request of a probe run after a workload (`bench.isolation`, `bench.affinity`): its
decoded answer, or why there is none, so a probe counts a failed request instead of raising."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

__all__ = ["post_probe"]


async def post_probe(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float
) -> tuple[Any, str]:
    """POST `body` to `url`; (the decoded JSON answer, "") or (None, what went wrong)."""
    try:
        async with asyncio.timeout(timeout_s), session.post(url, json=body) as resp:
            if resp.status != 200:
                return None, f"HTTP {resp.status}: {(await resp.text())[:120]}"
            return await resp.json(content_type=None), ""
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:160]
