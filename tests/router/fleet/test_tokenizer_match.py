"""A router whose tokenizer cannot be its workers' says so, once per worker, at registration.

It predicts nothing anywhere otherwise (the ids it looks up are not the ones the workers cache),
with every stream `synced` and no counter rising: QA saw 0 predicted against 500-696 cached,
and nothing in the log. Only what can honestly be compared is: the reference workers' byte
tokenizer against a Hugging Face one, either way round; two Hugging Face tokenizers named by
paths on two hosts are not.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.config import TokenizerConfig
from router.fleet.tokenizer_match import tokenizer_mismatch
from router.service import RouterService
from tests.router.conftest import AUTH, WorkerPassThrough, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

QWEN = Path(__file__).parents[2] / "fixtures" / "chat-templates" / "qwen3-0.6b" / "tokenizer.json"
HF = TokenizerConfig(kind="hf", path=str(QWEN))
BYTE = TokenizerConfig()
# SGLang 0.5.23's /server_info carries its resolved server args: these are the ones said here
SGLANG: dict[str, Any] = {"model_path": "Qwen/Qwen3-0.6B", "tokenizer_path": "Qwen/Qwen3-0.6B"}


def test_only_a_byte_tokenizer_against_a_hugging_face_one_is_a_mismatch() -> None:
    hf_router = tokenizer_mismatch(HF, {"tokenizer": "byte"})
    assert hf_router is not None and "byte" in hf_router and str(QWEN) in hf_router
    byte_router = tokenizer_mismatch(BYTE, SGLANG)
    assert byte_router is not None and "'Qwen/Qwen3-0.6B'" in byte_router
    # the same kind: a path on the worker's host says nothing of the router's file
    assert tokenizer_mismatch(HF, SGLANG) is None
    assert tokenizer_mismatch(BYTE, {"tokenizer": "byte"}) is None
    # tokenizes nothing (token ids in), says nothing, or was not read: not judged
    assert tokenizer_mismatch(BYTE, {**SGLANG, "skip_tokenizer_init": True}) is None
    assert tokenizer_mismatch(BYTE, {"model_path": "m", "tokenizer_path": None}) is None
    assert tokenizer_mismatch(HF, None) is None


async def _workers(router: RouterService, session: aiohttp.ClientSession) -> dict[str, Any]:
    async with session.get(router.url + "/admin/workers", headers=AUTH) as resp:
        assert resp.status == 200
        body = await resp.json()
    return {w["id"]: w for w in body["workers"]}


@pytest.mark.parametrize("tokenizer", [HF, BYTE], ids=["hf", "byte"])
async def test_a_router_tokenizing_otherwise_than_its_worker_says_so_once(
    tokenizer: TokenizerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(config) as w0, aiohttp.ClientSession() as session:
        with caplog.at_level(logging.WARNING, logger="router.fleet"):
            async with RouterService(
                router_config([("w0", w0.url)], tokenizer=tokenizer)
            ) as router:
                shown = (await _workers(router, session))["w0"]["tokenizer_mismatch"]
                # read again (a restart, the settings cadence): nothing new, nothing said
                await router.supervisor.reread("w0", 5.0)
        said = [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("router.fleet") and "tokenizer" in r.getMessage()
        ]
    if tokenizer is BYTE:
        assert said == [] and shown is None
        return
    assert len(said) == 1, said
    assert said[0].startswith("worker w0: ") and "byte" in said[0] and str(QWEN) in said[0]
    assert shown is not None and "byte" in shown


class TokenizerSwap(WorkerPassThrough):
    """A reference worker's HTTP API passed through, its server info saying the tokenizer
    `says` (None: the worker's own, byte): an SGLang worker restarted with another tokenizer,
    which a reference worker cannot be."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.says: dict[str, Any] | None = None

    async def _answer(
        self, request: web.Request, resp: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        if self.says is None or request.path not in ("/server_info", "/get_server_info"):
            return await super()._answer(request, resp)
        info = await resp.json()
        info.pop("tokenizer", None)
        return web.json_response({**info, **self.says})


async def test_a_tokenizer_mismatch_that_ends_is_said_once_and_one_that_comes_back_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, an ended mismatch was dropped silently: the WARNING stood last in the log while
    /admin/workers no longer showed it (QA: byte, then hf, then byte again across restarts)."""
    config = ReferenceConfig(time_scale=0.0, page_size=16)
    async with (
        ReferenceWorker(config) as w0,
        TokenizerSwap(w0.url) as swap,
        aiohttp.ClientSession() as session,
    ):
        with caplog.at_level(logging.INFO, logger="router.fleet"):
            async with RouterService(router_config([("w0", swap.url)], tokenizer=HF)) as router:
                shown = [(await _workers(router, session))["w0"]["tokenizer_mismatch"]]
                for says in ({"tokenizer_path": str(QWEN)}, None):
                    swap.says = says  # restarted with a Hugging Face tokenizer, then byte
                    for _ in range(2):  # the same finding read twice is said once
                        await router.supervisor.reread("w0", 5.0)
                    shown.append((await _workers(router, session))["w0"]["tokenizer_mismatch"])
        said = [
            (r.levelno, r.getMessage())
            for r in caplog.records
            if r.name.startswith("router.fleet") and "tokenizer" in r.getMessage()
        ]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO, logging.WARNING], said
    assert "mismatch is over" in said[1][1] and said[1][1].startswith("worker w0: ")
    assert [s is not None for s in shown] == [True, False, True]
