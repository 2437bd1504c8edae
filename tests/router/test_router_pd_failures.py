"""Prefill/decode pairs when a side misbehaves, and what the workers and the metrics see.

A prefill that takes a request and never answers nor hands its KV over cannot be made with the
reference worker short of stopping its process, so `FakePdWorker` (a small aiohttp server on
127.0.0.1, advertising its role as SGLang does) plays it, and records the headers each leg gets.
Everything else is reference workers behind a real router: whom a decode's timeout is charged
to, where the retry goes, the engine's error passed through when no retry is left, a pair's
answer counted when the client closes its connection right after it, the request's id and
trace context on both legs (and no header the client's `Connection` names on either), and what
a request is told when one side of the pairs is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
import msgspec
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from router.config import (
    RouterConfig,
    TimeoutsConfig,
    TracingConfig,
    WorkerConfig,
)
from router.http import pair_faults
from router.http.keys import DECISIONS
from router.http.pair_handoff import HandoffFault, handoff_fault
from router.http.reload import ConfigSource
from router.service import RouterService
from tests.router.conftest import AUTH, STALL_PROOF_HEALTH, eventually, router_config
from tests.router.test_router_pd import PAGE, PROMPT, reference, warm
from workers.worker import ReferenceWorker

MODEL = "kvroute/reference-byte-lm"  # the reference workers' model: one pool with the fakes
BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}


class FakePdWorker:
    """One side of a pair on 127.0.0.1: it advertises `role` (and itself as the bootstrap
    server) as SGLang does, keeps the headers of every generation request, and answers them at
    once (with `status`: an engine's error; `held`: each error once the test calls `release`)
    or never, nor the decode fetching KV from it (`hang`), or streams a few events and closes
    the connection (`cut`: the engine died mid-stream). Without `keep_alive`, every answer
    closes its connection (a client never reuses one: each request connects anew).

    A held error is let go when the test has put the retry's workers in rotation: an error
    after a fixed delay raced the test's admin calls, and a stall of this process longer
    than the delay (a loaded host) made the retry find them drained (502)."""

    def __init__(
        self,
        role: Literal["prefill", "decode"],
        *,
        hang: bool = False,
        status: int = 200,
        cut: bool = False,
        message: str = "",
        held: bool = False,
        keep_alive: bool = True,
    ) -> None:
        self.role, self.hang, self.status, self.cut = role, hang, status, cut
        self.keep_alive = keep_alive
        self.held = held
        self._releases = asyncio.Semaphore(0)  # one a held error answer: `release`
        self.message = message  # its error's (else "engine says <status>")
        self.seen: list[dict[str, str]] = []
        self.arrived = asyncio.Event()  # a generation request came
        self.url, self.port = "", 0
        self._runner: web.AppRunner | None = None

    async def _info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {
            "served_model_name": MODEL,
            "page_size": PAGE,
            "dp_size": 1,
            "disaggregation_mode": self.role,
        }
        if self.role == "prefill":
            info["disaggregation_bootstrap_port"] = self.port
        return web.json_response(info)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        self.arrived.set()
        if self.hang:
            await asyncio.sleep(3600)  # cancelled when the router lets go, or at cleanup
        if self.cut:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"text": "o", "meta_info": {"cached_tokens": 0}}\n\n' * 2)
            assert request.transport is not None
            request.transport.close()  # no last chunk: the answer is unended
            await asyncio.sleep(3600)  # cancelled at cleanup
        if self.status != 200:
            if self.held:
                await self._releases.acquire()
            error = {
                "type": "engine_error",
                "message": self.message or f"engine says {self.status}",
            }
            return web.json_response({"error": error}, status=self.status)
        answer: dict[str, Any] = {"text": "ok", "meta_info": {"cached_tokens": 0}}
        if request.path != "/generate":
            answer = {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}
            params = body.get("kv_transfer_params")
            if isinstance(params, dict) and params.get("do_remote_decode"):
                answer["kv_transfer_params"] = {"remote_engine_id": "fake", "remote_block_ids": []}
        return web.json_response(answer)

    def release(self) -> None:
        """Let one held error answer go (the first request's first)."""
        self._releases.release()

    async def _kv(self, request: web.Request) -> web.Response:
        await asyncio.sleep(3600)  # the KV never comes: the decode's own timeout answers
        return web.Response(status=500)

    async def __aenter__(self) -> FakePdWorker:
        app = web.Application()
        app.router.add_get("/server_info", self._info)
        app.router.add_get("/get_server_info", self._info)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/v1/models", self._models)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._generate)
        app.router.add_get("/kv/{key}", self._kv)
        if not self.keep_alive:
            app.on_response_prepare.append(self._close_after)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    @staticmethod
    async def _close_after(request: web.Request, response: web.StreamResponse) -> None:
        response.force_close()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def _fake(
    wid: str, fake: FakePdWorker, engine: Literal["sglang", "vllm"] = "sglang"
) -> WorkerConfig:
    return WorkerConfig(
        url=fake.url,
        id=wid,
        engine=engine,
        role=fake.role,
        model=MODEL,
        kv_events=False,
        bootstrap_port=fake.port if fake.role == "prefill" and engine == "sglang" else None,
    )


def _config(**fields: Any) -> RouterConfig:
    """A loopback router (admin token, quick health rounds that a stall does not fail) with
    `fields` set. A worker taken for unhealthy in a stall changed which side a test's error
    named or who was charged, or left a retry no worker: no test here is about the health
    check itself."""
    return msgspec.structs.replace(router_config([]), **{"health": STALL_PROOF_HEALTH, **fields})


def _failures(router: RouterService) -> dict[str, int]:
    return {e.id: e.breaker.failures for e in router.planner.pool}


async def _admin(
    session: aiohttp.ClientSession, router: RouterService, path: str, body: object = None
) -> None:
    async with session.post(router.url + "/admin" + path, json=body, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()


async def _answered_past(
    session: aiohttp.ClientSession, router: RouterService, hung: FakePdWorker
) -> CIMultiDictProxy[str]:
    """Send `BODY`; once the `hung` worker has it, the answer, a 200 (its headers)."""
    sent = asyncio.create_task(session.post(router.url + "/generate", json=BODY))
    await asyncio.wait_for(hung.arrived.wait(), 10)
    async with await asyncio.wait_for(sent, 10) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers


async def test_a_prefill_that_never_sends_its_kv_is_blamed_and_the_retry_takes_another() -> None:
    """The decode's 504 (its KV never came) while its prefill has not answered is the prefill's
    failure: the retry goes to the other prefill, and no decode is charged."""
    async with (
        FakePdWorker("prefill", hang=True) as hung,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode", kv_transfer_timeout_s=0.5)) as d0,
        ReferenceWorker(reference("decode", kv_transfer_timeout_s=0.5)) as d1,
    ):
        workers = router_config([("p1", p1.url), ("d0", d0.url), ("d1", d1.url)]).workers
        config = _config(workers=(_fake("hung", hung), *workers))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            # the first pair is the hung prefill's: the other is drained until it has the request
            await _in_rotation(router)
            await _admin(session, router, "/workers/p1/drain")
            async with _back_once_paired(router, "hung", "p1"):
                headers = await _answered_past(session, router, hung)
                assert headers["x-kvroute-prefill-worker"] == "p1"
            assert _failures(router) == {"hung": 1, "p1": 0, "d0": 0, "d1": 0}


async def test_a_decode_that_never_takes_the_kv_is_blamed_and_the_retry_takes_another() -> None:
    """A prefill that gave up waiting for its decode to take the KV (the reference worker's 504
    "no decode worker fetched the KV") while the decode has not answered: the decode is hung,
    so it is blamed and charged, and the retry goes to the other decode. Before, the prefill was
    blamed and charged, and the retry paired the other prefill with the same hung decode: a
    wedged decode took the healthy prefills out one after another."""
    async with (
        ReferenceWorker(reference("prefill", kv_transfer_timeout_s=0.5)) as p0,
        ReferenceWorker(reference("prefill", kv_transfer_timeout_s=0.5)) as p1,
        FakePdWorker("decode", hang=True) as hung,
        ReferenceWorker(reference("decode")) as d1,
    ):
        workers = router_config([("p0", p0.url), ("p1", p1.url), ("d1", d1.url)]).workers
        config = _config(workers=(*workers, _fake("hung", hung)))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            # the first pair is the hung decode's: the other decode is drained until it has the
            # request, the other prefill all along (the old blame left the retry no prefill).
            # The retry is p0's: ranked first only while the index trusted its prefix, it was
            # p1's after a stall of this process over a second (a loaded host; the index then
            # trusts nothing until a replay proves it, `indexer.loop_watch`), and p1 with the
            # hung decode is a pair that the prefill's word alone does not rule out
            await _in_rotation(router)
            await _admin(session, router, "/workers/p1/drain")
            await _admin(session, router, "/workers/d1/drain")
            async with _back_once_paired(router, "hung", "d1"):
                headers = await _answered_past(session, router, hung)
                assert headers["x-kvroute-worker"] == "d1"
            assert len(hung.seen) == 1
            assert _failures(router) == {"p0": 0, "p1": 0, "hung": 1, "d1": 0}


async def test_a_lone_decode_that_never_takes_the_kv_is_named_in_the_error() -> None:
    """With no other decode to retry on, the client's error names the decode that never took
    the KV, not its prefill (the request failed on every decode it could go to: nobody
    charged, as a whole request's)."""
    async with (
        ReferenceWorker(reference("prefill", kv_transfer_timeout_s=0.5)) as p0,
        FakePdWorker("decode", hang=True) as hung,
    ):
        config = _config(workers=(WorkerConfig(url=p0.url, id="p0"), _fake("hung", hung)))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            async with session.post(router.url + "/generate", json=BODY) as resp:
                assert resp.status == 504, await resp.text()
                message = (await resp.json())["error"]["message"]
            assert "decode hung: it never took the KV of prefill p0" in message
            assert "no decode worker fetched the KV" in message
            assert _failures(router) == {"p0": 0, "hung": 0}


async def test_a_503_for_a_side_whose_circuits_are_open_says_so_and_until_when() -> None:
    """A pair's side with no routable worker because its circuits opened: the 503 says so and
    when the first is tried again, as on the whole-request path (it said only "no routable
    decode worker among 1", as if the fleet were gone, not back in seconds)."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        # the prefill taken for unhealthy in a stall made the 503 name the prefill side (CI):
        # `_config`'s health checks
        config = _config(workers=tuple(router_config([("p0", p0.url), ("d0", d0.url)]).workers))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            await _in_rotation(router)
            router.planner.record_failure("d0", hard=True)  # what a refused connection does
            async with session.post(router.url + "/generate", json=BODY) as resp:
                assert resp.status == 503, await resp.text()
                message = (await resp.json())["error"]["message"]
            assert message.startswith("no routable decode worker among 1: 1 with an open circuit")
            assert "tried again in" in message


# what SGLang 0.5.23's prefill answers (500) when its KV handoff failed (`prefill.py`,
# `disaggregation/common/conn.py`)
_SGLANG_NO_DECODE = (
    "Prefill bootstrap failed for request rank=0 req.rid='r1' req.bootstrap_room=7 with "
    "exception KVTransferError(bootstrap_room=7): Request 7 timed out after 300.0s in "
    "KVPoll.Bootstrapping"
)
_SGLANG_TRANSFER = (
    "Prefill transfer failed for request rank=0 req.rid='r1' req.bootstrap_room=7 with "
    "exception KVTransferError(bootstrap_room=7): Failed due to an unknown reason from another "
    "rank"
)


def test_a_prefills_error_says_whose_failure_its_kv_handoff_was() -> None:
    """No decode came for the KV: the decode's; the handoff failed in other words: either
    side's; any other error: the prefill's own."""
    no_decode = b'{"error": {"type": "kv_transfer_timeout", "message": "no decode worker '
    assert handoff_fault(no_decode + b'fetched the KV within 2 s"}}') is HandoffFault.DECODE
    assert handoff_fault(_SGLANG_NO_DECODE.encode()) is HandoffFault.DECODE
    assert handoff_fault(_SGLANG_TRANSFER.encode()) is HandoffFault.EITHER
    assert handoff_fault(b'{"error": {"type": "kv_transfer_failed"}}') is HandoffFault.EITHER
    assert handoff_fault(b'{"error": {"message": "CUDA out of memory"}}') is None
    assert handoff_fault(b"") is None


@pytest.mark.parametrize(
    ("said", "charged"),
    [(_SGLANG_NO_DECODE, {"hung": 1}), (_SGLANG_TRANSFER, {})],
    ids=["no-decode", "transfer-failed"],
)
async def test_sglangs_prefill_whose_kv_handoff_failed_is_blamed_by_what_it_says(
    said: str, charged: dict[str, int]
) -> None:
    """SGLang's prefill that says no decode came for its KV (its 500, "timed out ... in
    KVPoll.Bootstrapping"), while its decode has not answered: the decode is blamed and
    charged. One that says its handoff failed in other words cannot tell whose failure it
    was: the retry leaves out both, and neither is charged. Either way the prefill is not."""
    async with (
        FakePdWorker("prefill", status=500, message=said, held=True) as fake,
        FakePdWorker("decode", hang=True) as hung,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode")) as d1,
    ):
        workers = router_config([("p1", p1.url), ("d1", d1.url)]).workers
        config = _config(workers=(_fake("fake", fake), _fake("hung", hung), *workers))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            # the first pair is the two fakes': the others are drained until they have it
            await _in_rotation(router)
            await _admin(session, router, "/workers/p1/drain")
            await _admin(session, router, "/workers/d1/drain")
            sent = asyncio.create_task(session.post(router.url + "/generate", json=BODY))
            await asyncio.wait_for(asyncio.gather(fake.arrived.wait(), hung.arrived.wait()), 10)
            # the retry's prefill is p1 whether or not the fake is left out of it: the fake
            # keeps failing, which would blame whichever decode it went with
            await _admin(session, router, "/workers/fake/drain")
            await _admin(session, router, "/workers/p1/drain", {"drain": False})
            await _admin(session, router, "/workers/d1/drain", {"drain": False})
            fake.release()  # its error, the others in rotation
            async with await asyncio.wait_for(sent, 10) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvroute-worker"] == "d1"
            assert len(fake.seen) == len(hung.seen) == 1
            assert _failures(router) == {"fake": 0, "hung": 0, "p1": 0, "d1": 0, **charged}


@pytest.mark.parametrize("said", [_SGLANG_TRANSFER, _SGLANG_NO_DECODE], ids=["either", "no-decode"])
async def test_a_failed_handoff_retries_another_pair_with_the_only_decode(said: str) -> None:
    """A prefill that says its KV handoff failed, on a side it does not tell, or on its
    decode's ("no decode came", which its own broken bootstrap says as well): the retry
    avoids the pair, not the decode. Leaving the decode out failed the request with 502
    while a healthy pair (the other prefill with the only decode) was untried; the decode,
    which then answers it, is not charged on the prefill's word."""
    async with (
        FakePdWorker("prefill", status=500, message=said, held=True) as fake,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode")) as d0,
    ):
        workers = router_config([("p1", p1.url), ("d0", d0.url)]).workers
        config = _config(workers=(_fake("fake", fake), *workers))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _in_rotation(router)
            await _admin(session, router, "/workers/p1/drain")  # the first pair is the fake's
            sent = asyncio.create_task(session.post(router.url + "/generate", json=BODY))
            await asyncio.wait_for(fake.arrived.wait(), 10)
            await _admin(session, router, "/workers/p1/drain", {"drain": False})
            fake.release()  # its error, p1 in rotation
            async with await asyncio.wait_for(sent, 10) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvroute-prefill-worker"] == "p1"
                assert resp.headers["x-kvroute-worker"] == "d0"
            assert _failures(router) == {"fake": 0, "p1": 0, "d0": 0}


async def test_a_prefill_saying_no_decode_came_with_two_decodes_is_blamed_itself() -> None:
    """A prefill whose own bootstrap is broken says no decode came for its KV, with every
    decode: the first failure is its decode's on its word (the retry avoids the pair), the
    second, with another decode, is the prefill's (`PairFaults`): it leaves the retry, the
    decode charged on its word is not, and the request is served by a healthy pair. Before,
    each decode it went with was blamed in turn, and the request failed once the decodes ran
    out."""
    async with (
        FakePdWorker("prefill", status=500, message=_SGLANG_NO_DECODE, held=True) as fake,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode")) as d0,
        ReferenceWorker(reference("decode")) as d1,
    ):
        workers = router_config([("p1", p1.url), ("d0", d0.url), ("d1", d1.url)]).workers
        config = _config(workers=(_fake("fake", fake), *workers))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _in_rotation(router)
            await _admin(session, router, "/workers/p1/drain")  # first (fake, d0), then d1
            await _admin(session, router, "/workers/d1/drain")
            sent = asyncio.create_task(session.post(router.url + "/generate", json=BODY))
            await asyncio.wait_for(fake.arrived.wait(), 10)
            await _admin(session, router, "/workers/d1/drain", {"drain": False})
            fake.release()  # its first error, d1 in rotation

            async def second() -> bool:
                return len(fake.seen) == 2

            await eventually(second, what="the retry with the other decode")
            await _admin(session, router, "/workers/p1/drain", {"drain": False})
            fake.release()  # its second, p1 in rotation
            async with await asyncio.wait_for(sent, 10) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvroute-prefill-worker"] == "p1"
            assert len(fake.seen) == 2
            # charged as the request ended: the prefill itself; the first decode, blamed on
            # its word, no longer
            assert _failures(router) == {"fake": 1, "p1": 0, "d0": 0, "d1": 0}


async def test_a_pair_failing_at_the_deadline_is_avoided_by_the_next_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One prefill, a hung decode and a healthy one, at the request deadline: nothing tells
    which side is wedged (with one prefill, the decode never fails with another partner), so
    neither is charged; the next requests avoid that pair for a while, its prefill answering
    them with the other decode. Before, a planner picking the same pair each time sent every
    client to it, each waiting the whole deadline.

    The window is ended by the test (`AVOID_S` 0), not waited out, and the request it steers
    has a long deadline (a reload): a stall of this process (a loaded host) ended a window of
    0.5 s before that request, or outlasted its deadline of 1 s."""
    async with (
        ReferenceWorker(reference("prefill", kv_transfer_timeout_s=30.0)) as p0,
        FakePdWorker("decode", hang=True) as hung,
        ReferenceWorker(reference("decode")) as d1,
    ):
        workers = router_config([("p0", p0.url), ("d1", d1.url)]).workers
        configs = [_one_second_deadline(_config(workers=(*workers, _fake("hung", hung))))]
        source = ConfigSource("test", lambda: configs[-1])
        async with (
            RouterService(configs[0], config_source=source) as router,
            aiohttp.ClientSession() as session,
        ):

            async def deadline(request_s: float) -> None:
                timeouts = TimeoutsConfig(request_s=request_s)
                configs.append(msgspec.structs.replace(configs[0], timeouts=timeouts))
                await router.reload()

            await _admin(session, router, "/workers/d1/drain")
            assert "(neither charged)" in await _stalled(session, router)
            await _admin(session, router, "/workers/d1/drain", {"drain": False})
            await deadline(60.0)
            await _in_rotation(router)
            async with session.post(router.url + "/generate", json=BODY) as resp:
                assert resp.status == 200, await resp.text()  # the pair avoided: p0 with d1
            assert len(hung.seen) == 1
            monkeypatch.setattr(pair_faults, "AVOID_S", 0.0)  # the window over
            await deadline(1.0)
            await _admin(session, router, "/workers/d1/drain")
            # met again: still untold
            assert "(neither charged)" in await _stalled(session, router)
            assert _failures(router) == {"p0": 0, "d1": 0, "hung": 0}


async def test_the_deadline_of_a_hung_prefill_is_its_own_once_another_decode_tells() -> None:
    """Both sides waiting past the request deadline look alike whichever is wedged (the decode
    waits for the KV, SGLang's prefill for its decode to take it): the first such 504 charges
    neither and says so. Paired with another decode, the prefill stalls again: it is the one
    that fails with every partner, and is charged."""
    async with (
        FakePdWorker("prefill", hang=True) as hung,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode", kv_transfer_timeout_s=30.0)) as d0,
        ReferenceWorker(reference("decode", kv_transfer_timeout_s=30.0)) as d1,
    ):
        others = router_config([("p1", p1.url), ("d0", d0.url), ("d1", d1.url)]).workers
        config = _config(workers=(_fake("hung", hung), *others))
        config = _one_second_deadline(config)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            messages = []
            for decode, other in (("d0", "d1"), ("d1", "d0")):
                await _admin(session, router, f"/workers/{other}/drain")
                await _admin(session, router, f"/workers/{decode}/drain", {"drain": False})
                messages.append(await _stalled_with_a_spare(session, router, "hung", "p1"))
                if decode == "d0":
                    assert _failures(router) == {"hung": 0, "p1": 0, "d0": 0, "d1": 0}
            assert "neither prefill hung nor decode d0 answered" in messages[0]
            assert "(neither charged)" in messages[0]
            assert "prefill hung sent decode d1 no KV" in messages[1]
            assert "failed so with another decode before" in messages[1]
            assert _failures(router) == {"hung": 1, "p1": 0, "d0": 0, "d1": 0}


async def test_a_decode_stalling_with_two_prefills_at_the_deadline_is_charged_the_second_time() -> (
    None
):
    """Both legs waiting past the deadline look alike whichever side is wedged (SGLang's
    prefill waits for its decode to take the KV): charged to the prefill alone, a wedged
    decode took every healthy prefill out in turn. The first such stall charges neither; the
    second of that decode, with another prefill, is charged to the decode, and its client is
    told so."""
    async with (
        ReferenceWorker(reference("prefill", kv_transfer_timeout_s=30.0)) as p0,
        ReferenceWorker(reference("prefill", kv_transfer_timeout_s=30.0)) as p1,
        FakePdWorker("decode", hang=True) as hung,
        ReferenceWorker(reference("decode")) as d1,
    ):
        workers = router_config([("p0", p0.url), ("p1", p1.url), ("d1", d1.url)]).workers
        config = _config(workers=(*workers, _fake("hung", hung)))
        config = _one_second_deadline(config)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            messages = []
            for prefill, other in (("p0", "p1"), ("p1", "p0")):
                await _admin(session, router, f"/workers/{other}/drain")
                await _admin(session, router, f"/workers/{prefill}/drain", {"drain": False})
                messages.append(await _stalled_with_a_spare(session, router, "hung", "d1"))
            assert "neither prefill p0 nor decode hung answered" in messages[0]
            assert "decode hung took no KV from prefill p1" in messages[1]
            assert _failures(router) == {"p0": 0, "p1": 0, "d1": 0, "hung": 1}


async def test_the_last_worker_of_a_side_is_never_charged_on_its_partners_word() -> None:
    """A transient handoff failure of the only prefill with one decode, then the other decode
    wedges: the prefill failed before with another partner, so its partners point at it, and
    charged it took the model out for the cooldown (QA: every request a 503). The last worker
    of its side is not charged on that word; the 504 says nobody was."""
    async with (
        ReferenceWorker(reference("prefill", kv_transfer_timeout_s=30.0)) as p0,
        FakePdWorker("decode", hang=True) as hung,
        FakePdWorker("decode", hang=True) as other,
    ):
        workers = router_config([("p0", p0.url)]).workers
        config = _config(workers=(*workers, _fake("other", other), _fake("hung", hung)))
        config = _one_second_deadline(config)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            for decode, drained in (("other", "hung"), ("hung", "other")):
                await _admin(session, router, f"/workers/{drained}/drain")
                await _admin(session, router, f"/workers/{decode}/drain", {"drain": False})
                message = await _stalled(session, router)
            assert "(neither charged)" in message
            assert _failures(router) == {"p0": 0, "other": 0, "hung": 0}


@pytest.mark.parametrize(("engine", "status"), [("vllm", 504), ("sglang", 500)])
async def test_a_lone_decodes_error_is_passed_through_with_the_engines_body(
    engine: Literal["sglang", "vllm"], status: int
) -> None:
    """The only decode worker's own 5xx is the client's answer as the engine wrote it, though
    another prefill worker is left: a retry would find the same decode."""
    async with (
        FakePdWorker("prefill") as p0,
        FakePdWorker("prefill") as p1,
        FakePdWorker("decode", status=status) as d0,
    ):
        workers = (_fake("p0", p0, engine), _fake("p1", p1, engine), _fake("d0", d0, engine))
        async with (
            RouterService(_config(workers=workers)) as router,
            aiohttp.ClientSession() as session,
        ):
            body = {"model": MODEL, "prompt": "one decode", "max_tokens": 4}
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                answer = await resp.json()
                assert resp.status == status, answer
                assert resp.headers["x-kvroute-worker"] == "d0"
            assert answer == {"error": {"type": "engine_error", "message": f"engine says {status}"}}
            # the request failed on every decode it could go to: its own failure, as a whole
            # request's (`charge`), nobody charged
            assert _failures(router) == {"p0": 0, "p1": 0, "d0": 0}


@pytest.mark.parametrize("status", [500, 400])
@pytest.mark.parametrize("logprobs", [True, False])
async def test_a_decodes_error_is_answered_at_once_with_return_logprob(
    status: int, logprobs: bool
) -> None:
    """A decode's error has no logprobs to merge: it is the client's answer at once, blamed as
    without `return_logprob`. Before, with it the router waited for the prefill, which
    (SGLang's) answers only once a decode fetched its KV: the decode's 500 came after the
    prefill's own KV timeout (with the reference workers: a 504 blaming the prefill)."""
    async with (
        FakePdWorker("prefill", hang=True) as p0,
        FakePdWorker("decode", status=status) as d0,
    ):
        config = _config(workers=(_fake("p0", p0), _fake("d0", d0)))
        config = msgspec.structs.replace(config, timeouts=TimeoutsConfig(request_s=60.0))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            body = {**BODY, "return_logprob": logprobs}
            async with asyncio.timeout(10):  # the prefill never answers: the deadline is 60 s
                async with session.post(router.url + "/generate", json=body) as resp:
                    answer = await resp.json()
            assert resp.status == status, answer
            assert resp.headers["x-kvroute-worker"] == "d0"
            assert answer == {"error": {"type": "engine_error", "message": f"engine says {status}"}}
            assert p0.seen  # the prefill had the request: its leg was cut, not waited for
            # the request failed on every decode it could go to: nobody charged (`charge`)
            assert _failures(router) == {"p0": 0, "d0": 0}


async def test_sglangs_decode_that_cannot_reach_the_bootstrap_server_is_the_prefills_failure() -> (
    None
):
    """SGLang's decode says in its error that it could not reach its prefill's bootstrap server
    ("Could not fetch prefill parallel info from bootstrap_addr"): the prefill is blamed and
    charged at once. Before, the decode was blamed (a 500 while its prefill had not answered)
    and, alone, its error passed through: nobody charged, the prefill chosen again for ever."""
    said = "Could not fetch prefill parallel info from bootstrap_addr: 127.0.0.1:1"
    async with (
        FakePdWorker("prefill", hang=True) as p0,
        FakePdWorker("decode", status=500, message=said) as d0,
    ):
        config = _config(workers=(_fake("p0", p0), _fake("d0", d0)))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            async with session.post(router.url + "/generate", json=BODY) as resp:
                answer = await resp.json()
            assert resp.status == 502, answer
            assert "prefill p0: its decode d0 could not reach" in answer["error"]["message"]
            assert _failures(router) == {"p0": 1, "d0": 0}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_prompt_every_prefill_fails_opens_no_prefill_circuit(
    engine: Literal["sglang", "vllm"],
) -> None:
    """A prompt that crashes the engine crashes it on every prefill the retry carries it to:
    the request's failure, as on the whole-request path. Each such request used to charge
    every prefill it went to at once, and three of them opened every prefill circuit: the
    model answered 503 to everyone for `breaker.cooldown_s`."""
    async with (
        FakePdWorker("prefill", status=500) as p0,
        FakePdWorker("prefill", status=500) as p1,
        ReferenceWorker(reference("decode")) as d0,
    ):
        decode = WorkerConfig(url=d0.url, id="d0", engine=engine, role="decode", model=MODEL)
        workers = (_fake("p0", p0, engine), _fake("p1", p1, engine), decode)
        async with (
            RouterService(_config(workers=workers)) as router,
            aiohttp.ClientSession() as session,
        ):
            body = {"model": MODEL, "prompt": "a prompt that crashes", "max_tokens": 4}
            for _ in range(3):  # `breaker.failure_threshold`
                async with session.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 502, await resp.text()
            assert len(p0.seen) == len(p1.seen) == 3  # each was retried on the other
            assert _failures(router) == {"p0": 0, "p1": 0, "d0": 0}
            clock = router.planner.clock()
            assert all(e.routable(clock) for e in router.planner.pool)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_prefill_failing_what_another_answers_leaves_rotation_at_the_threshold(
    engine: Literal["sglang", "vllm"],
) -> None:
    """The other side: when another prefill answers the request, the failure was the first
    prefill's, charged when the request ends; at the threshold it leaves rotation."""
    async with (
        FakePdWorker("prefill", status=500) as bad,
        FakePdWorker("prefill") as fake_good,
        FakePdWorker("decode") as fake_d0,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode")) as d1,
    ):
        others: tuple[WorkerConfig, ...]
        if engine == "vllm":
            others = (_fake("good", fake_good, engine), _fake("d0", fake_d0, engine))
        else:  # SGLang's decode waits for the KV: a fake one would answer before its prefill
            others = router_config([("good", p1.url), ("d0", d1.url)]).workers
        workers = (_fake("bad", bad, engine), *others)
        async with (
            RouterService(_config(workers=workers)) as router,
            aiohttp.ClientSession() as session,
        ):
            body = {"model": MODEL, "prompt": "a sound prompt", "max_tokens": 4}
            for _ in range(60):  # ties are broken at random: until the bad one was tried 3 times
                async with session.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                if len(bad.seen) == 3:
                    break
            assert len(bad.seen) == 3
            assert not router.planner.pool.get("bad").routable(router.planner.clock())
            assert _failures(router)["good"] == 0


def _ask_and_hang_up(port: int, body: bytes) -> int:
    """One request on its own connection, `Connection: close`, from a thread of its own (as
    curl would, not waiting for the router's event loop): closed the moment the answer is in."""
    head = (
        b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        headers, _, rest = data.partition(b"\r\n\r\n")
        length = int(
            next(
                line.split(b":", 1)[1]
                for line in headers.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
        )
        while len(rest) < length:
            rest += sock.recv(65536)
        return int(headers.split(b" ", 2)[1])


async def test_a_pairs_answer_is_counted_when_the_client_closes_right_after_it() -> None:
    """The bookkeeping of an answer (metrics, decisions, the prefill's success) does not
    depend on the client staying after it: a close cancels the router's handler."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        config = router_config([("p0", p0.url), ("d0", d0.url)], health=STALL_PROOF_HEALTH)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await warm(session, router, [p0], [d0])
            port = int(router.url.rsplit(":", 1)[1])
            sent = 6
            for i in range(sent):
                body = {"text": f"close {i}", "sampling_params": {"max_new_tokens": 2}}
                status = await asyncio.to_thread(_ask_and_hang_up, port, msgspec.json.encode(body))
                assert status == 200

            async def counted() -> float:
                async with session.get(router.url + "/metrics") as resp:
                    text = await resp.text()
                return sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("kvroute_requests_total{") and 'code="200"' in line
                )

            async def all_counted() -> bool:
                return await counted() == sent

            await eventually(all_counted, timeout_s=3.0, what="every answer to be counted")


CLIENT_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_both_legs_carry_the_request_id_and_the_trace_context() -> None:
    """Each leg of a pair gets the request's id (the client's untouched, else the router's,
    echoed back) and the `traceparent` the other gets: the attempt's span when the router
    traces, else the client's; vLLM's legs are paired by that id."""
    async with (
        FakePdWorker("prefill") as sp,
        FakePdWorker("decode") as sd,
        FakePdWorker("prefill") as vp,
        FakePdWorker("decode") as vd,
    ):
        tracing = TracingConfig(enabled=True, exporter="memory")
        sglang = (_fake("sp", sp), _fake("sd", sd))
        vllm = (_fake("vp", vp, "vllm"), _fake("vd", vd, "vllm"))
        body = {"model": MODEL, "prompt": "both legs", "max_tokens": 2}
        for workers, traced in ((sglang, True), (vllm, True), (sglang, False), (vllm, False)):
            config = _config(workers=workers, tracing=tracing if traced else TracingConfig())
            prefill, decode = (sp, sd) if workers is sglang else (vp, vd)
            async with RouterService(config) as router, aiohttp.ClientSession() as session:
                for sent in ({"x-request-id": "client-id-7"}, {}):
                    sent = sent | {"traceparent": CLIENT_TRACEPARENT}
                    url = router.url + "/v1/completions"
                    async with session.post(url, json=body, headers=sent) as resp:
                        assert resp.status == 200, await resp.text()
                        echoed = resp.headers["x-request-id"]
                    assert echoed == sent.get("x-request-id", echoed)
                    legs = (prefill.seen[-1], decode.seen[-1])
                    assert [leg.get("x-request-id") for leg in legs] == [echoed, echoed]
                    parents = [leg.get("traceparent") for leg in legs]
                    assert parents[0] == parents[1]
                    # the trace continues: the client's trace id, the router's span if traced
                    assert parents[0] is not None and parents[0][3:35] == CLIENT_TRACEPARENT[3:35]
                    assert (parents[0] == CLIENT_TRACEPARENT) is not traced


async def test_neither_leg_gets_a_header_the_client_named_in_connection() -> None:
    """RFC 9110 7.6.1: what the client's `Connection` names is its hop's only. The decode leg
    dropped it already; the prefill leg, which copies a few headers by name, passed on an
    Authorization or a trace context named there. A request id named there is not adopted:
    both legs and the answer carry the router's own (before, the router took it as its own and
    set it on both legs again)."""
    async with (
        FakePdWorker("prefill") as sp,
        FakePdWorker("decode") as sd,
        FakePdWorker("prefill") as vp,
        FakePdWorker("decode") as vd,
    ):
        body = {"model": MODEL, "prompt": "named", "max_tokens": 2}
        sent = {
            "Connection": "keep-alive, Authorization, TraceParent, X-Secret, X-Request-Id",
            "Authorization": "Bearer for-the-router-only",
            "X-Request-Id": "cid-123",
            "traceparent": CLIENT_TRACEPARENT,
            "X-Secret": "hop",
            "X-Public": "end-to-end",
        }
        unnamed = {k: v for k, v in sent.items() if k != "Connection"}
        for engine in ("sglang", "vllm"):
            prefill, decode = (sp, sd) if engine == "sglang" else (vp, vd)
            workers = (_fake("p", prefill, engine), _fake("d", decode, engine))
            # named, then the same request without the names: both legs get them then
            for headers in (sent, unnamed):
                async with (
                    RouterService(_config(workers=workers)) as router,
                    aiohttp.ClientSession() as session,
                    session.post(
                        router.url + "/v1/completions", json=body, headers=headers
                    ) as resp,
                ):
                    assert resp.status == 200, await resp.text()
                    echoed = resp.headers["x-request-id"]
                assert decode.seen[-1]["x-public"] == "end-to-end"
                assert (echoed == "cid-123") is (headers is unnamed), (engine, echoed)
                for leg in (prefill.seen[-1], decode.seen[-1]):
                    assert leg["x-request-id"] == echoed, (engine, leg)
                    if headers is sent:
                        assert not {"authorization", "traceparent", "x-secret"} & set(leg), leg
                    else:
                        assert leg["authorization"] == "Bearer for-the-router-only", leg
                        assert leg["traceparent"] == CLIENT_TRACEPARENT


async def test_a_model_whose_decode_workers_are_all_removed_says_so() -> None:
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        config = router_config([("p0", p0.url), ("d0", d0.url)], health=STALL_PROOF_HEALTH)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            async with session.delete(router.url + "/admin/workers/d0", headers=AUTH) as resp:
                assert resp.status == 200, await resp.text()
            async with session.post(router.url + "/generate", json=BODY) as resp:
                assert resp.status == 503
                message = (await resp.json())["error"]["message"]
            assert (
                message
                == "no routable decode worker among 0 (its 1 prefill worker(s) have no pair)"
            )


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracing test sets what it means; no OTEL_* variable leaks in from the shell."""
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)


PLAIN = {"input_ids": PROMPT}


async def _pending(session: aiohttp.ClientSession, router: RouterService) -> dict[str, int]:
    """What /admin/route predicts a plain request of PROMPT pending on each worker of a pair."""
    async with session.post(router.url + "/admin/route", json=PLAIN, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        plan = await resp.json()
    return {
        c["worker"]: int(c["pending_tokens"])
        for side in ("prefill", "decode")
        for c in plan[side]["candidates"]
    }


# how often a request whose deadline passed before its pair was asked is sent again
_SENDS = 5


async def _to_the_deadline(session: aiohttp.ClientSession, router: RouterService) -> str | None:
    """One request of BODY once every worker not drained is in rotation, answered 504 at its
    deadline: the error message; None when the deadline passed before the router asked the
    pair (this process stalled, a loaded host: such a 504 charges and remembers nothing, and
    the caller sends the request again)."""
    await _in_rotation(router)
    async with session.post(router.url + "/generate", json=BODY) as resp:
        status, text = resp.status, await resp.text()
    assert status == 504, text
    message = str(msgspec.json.decode(text)["error"]["message"])
    return None if "deadline passed before" in message else message


async def _stalled(session: aiohttp.ClientSession, router: RouterService) -> str:
    """`_to_the_deadline`'s message, the request sent again while its deadline passed before
    the pair was asked (a stall of this process: the test failed on that 504's message)."""
    for _ in range(_SENDS):
        if (message := await _to_the_deadline(session, router)) is not None:
            return message
    raise AssertionError(f"the request deadline passed before the pair was asked, {_SENDS} times")


@contextlib.asynccontextmanager
async def _back_once_paired(
    router: RouterService, paired: str, *drained: str
) -> AsyncIterator[None]:
    """Within the block, the `drained` workers are put back in rotation (as POST
    /admin/workers/{id}/drain {"drain": false} does it) once the router has paired the
    `paired` worker for a request: its load counts the leg from the pair's choice on, before
    either leg is sent. Polled from before the request, so after a stall of this process (a
    loaded host) the poll's timer falls due before any the request armed (its deadline, a
    worker's KV wait), and the workers are back before those fire. Put back by an admin call
    once the test saw the request, they came back after such a stall and the retry found none
    of them; put back as the fake got the request, the same when the stall came before it did
    (the hung worker then the last of its side at the deadline, spared)."""
    load = router.planner.load
    entries = [router.planner.pool.get(wid) for wid in drained]
    before = load.total(paired).running

    async def back() -> None:
        while load.total(paired).running <= before:  # noqa: ASYNC110 (no event tells a pair)
            await asyncio.sleep(0.01)
        for entry in entries:
            entry.draining = False

    task = asyncio.create_task(back())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _stalled_with_a_spare(
    session: aiohttp.ClientSession, router: RouterService, hung: str, spare: str
) -> str:
    """One request to the `hung` worker's pair, past its deadline (504): the error message.
    The `spare` worker of the hung one's side is drained until the hung one is paired for the
    request, then back in rotation by the deadline, so the hung one is not the last of its
    side (that one is never charged on its partners' word).

    On a loaded host (CI: two cores, other tests beside) this process, router and workers
    alike, can stall for longer than the 1 s deadline:
    - the spare is put back as the hung one is paired (`_back_once_paired`); put back by an
      admin call once a poll saw the request, it came back after a stall past the deadline,
      the hung one the last of its side, spared;
    - a request whose deadline passed before the router sent it to the pair (a 504 that
      charged and remembered nothing) is sent again; the test waited 10 s for a request the
      hung worker would never get, and failed."""
    entry = router.planner.pool.get(spare)
    for _ in range(_SENDS):
        await _in_rotation(router)
        await _admin(session, router, f"/workers/{spare}/drain")
        try:
            async with _back_once_paired(router, hung, spare):
                message = await _to_the_deadline(session, router)
        finally:
            if entry.draining:  # the hung worker was never paired
                await _admin(session, router, f"/workers/{spare}/drain", {"drain": False})
        if message is not None:
            return message
    raise AssertionError(f"the request deadline passed before the pair was asked, {_SENDS} times")


def _one_second_deadline(config: RouterConfig) -> RouterConfig:
    """`config` (`_config`'s: its health checks a stall does not fail; a spare taken for
    unhealthy at the deadline left the hung worker the last of its side, spared) with a 1 s
    request deadline."""
    return msgspec.structs.replace(config, timeouts=TimeoutsConfig(request_s=1.0))


async def _in_rotation(router: RouterService) -> None:
    """Every worker not drained is routable: discovered, healthy, its circuit closed."""

    async def ready() -> bool:
        now = router.planner.clock()
        return all(e.routable(now) and e.discovered for e in router.planner.pool if not e.draining)

    await eventually(ready, what="every worker not drained to be in rotation")


async def _paired(router: RouterService) -> None:
    async def paired() -> bool:
        return router.planner.pool.disaggregated(MODEL)

    await eventually(paired, what="the roles to be discovered")


async def test_a_stream_its_decode_broke_off_counts_as_502_not_as_its_200() -> None:
    """A decode dying mid-stream: the client has its 200 and a cut body, and the request was
    counted as that 200 (by its prefill worker). It counts as 502, as on the whole-request
    path, in the decisions too, with no usage; the decode is charged one ordinary failure (as
    on the whole-request path: a prompt that crashes every decode must not open every circuit)."""
    async with FakePdWorker("prefill") as p0, FakePdWorker("decode", cut=True) as d0:
        config = _config(workers=(_fake("p0", p0), _fake("d0", d0)))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            body = {"model": MODEL, "prompt": "cut short", "max_tokens": 4, "stream": True}
            async with session.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-worker"] == "d0"
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()

            async def counted() -> list[str]:
                async with session.get(router.url + "/metrics") as resp:
                    text = await resp.text()
                return [
                    line
                    for line in text.splitlines()
                    if line.startswith("kvroute_requests_total{") and line.endswith(" 1.0")
                ]

            async def once() -> bool:
                return bool(await counted())

            await eventually(once, timeout_s=3.0, what="the broken stream to be counted")
            (line,) = await counted()
            assert 'code="502"' in line and 'worker="p0"' in line, line
            decisions = router.app[DECISIONS].recent
            assert [(d.status, d.cached_tokens) for d in decisions] == [(502, None)]
            assert router.planner.pool.get("d0").breaker.failures == 1
            assert router.planner.pool.get("d0").routable(router.planner.clock())
            assert router.planner.pool.get("p0").routable(router.planner.clock())


async def test_a_prefill_refusing_a_request_takes_back_the_marks_of_both_sides() -> None:
    """A prefill's 4xx is the client's answer: neither side stores the prompt, so neither is
    predicted to hold it (its marks stayed for `pending_ttl_s`)."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        FakePdWorker("decode", hang=True) as hung,
    ):
        config = _config(workers=(WorkerConfig(url=p0.url, id="p0"), _fake("hung", hung)))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            refused = {**PLAIN, "sampling_params": {"max_new_tokens": -5}}
            async with session.post(router.url + "/generate", json=refused) as resp:
                assert resp.status == 400, await resp.text()
            assert (await _pending(session, router))["p0"] == 0


@pytest.mark.parametrize("status", [400, 500])
async def test_a_failed_prefill_takes_back_its_decodes_marks(status: int) -> None:
    """The decode of a prefill that refused (4xx) or failed (5xx) got no KV: it is not
    predicted to hold the prompt."""
    async with (
        FakePdWorker("prefill", status=status) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        config = _config(workers=(_fake("p0", p0), WorkerConfig(url=d0.url, id="d0")))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            async with session.post(router.url + "/generate", json=PLAIN) as resp:
                assert resp.status == (400 if status == 400 else 502), await resp.text()
            assert (await _pending(session, router))["d0"] == 0


async def test_a_pair_request_that_can_reuse_nothing_marks_nothing_on_its_decode() -> None:
    """`reuse_limit` 0 (here logprobs from the first token) marks nothing pending on the decode
    side either, while the request runs."""
    async with (
        FakePdWorker("prefill", hang=True) as hung,
        ReferenceWorker(reference("decode", kv_transfer_timeout_s=30.0)) as d0,
    ):
        config = _config(workers=(_fake("hung", hung), WorkerConfig(url=d0.url, id="d0")))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            capped = {**PLAIN, "return_logprob": True, "logprob_start_len": 0}
            sent = asyncio.create_task(session.post(router.url + "/generate", json=capped))
            try:
                await asyncio.wait_for(hung.arrived.wait(), 10)
                assert (await _pending(session, router))["d0"] == 0
                # the same request with nothing that stops reuse is marked there
                second = asyncio.create_task(session.post(router.url + "/generate", json=PLAIN))
                try:
                    await eventually(
                        lambda: _marked(session, router), what="the plain request's marks"
                    )
                finally:
                    second.cancel()
            finally:
                sent.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sent


async def _marked(session: aiohttp.ClientSession, router: RouterService) -> bool:
    return (await _pending(session, router))["d0"] > 0


async def test_a_pair_request_its_client_abandoned_counts_as_499() -> None:
    """A client leaving while its pair works (here the prefill never answers) is counted as the
    proxy counts it: 499, by the prefill worker; it appeared in no request series."""
    async with (
        FakePdWorker("prefill", hang=True) as hung,
        FakePdWorker("decode", hang=True) as d0,
    ):
        config = _config(workers=(_fake("hung", hung), _fake("d0", d0)))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await _paired(router)
            port = int(router.url.rsplit(":", 1)[1])
            body = msgspec.json.encode(BODY)
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            await writer.drain()
            await asyncio.wait_for(hung.arrived.wait(), 10)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

            async def counted() -> bool:
                async with session.get(router.url + "/metrics") as resp:
                    text = await resp.text()
                return any(
                    line.startswith("kvroute_requests_total{")
                    and 'code="499"' in line
                    and 'worker="hung"' in line
                    for line in text.splitlines()
                )

            await eventually(counted, timeout_s=3.0, what="the abandoned pair request")


@pytest.mark.parametrize("wedged", ["decode", "prefill"])
async def test_a_lone_pair_at_the_deadline_charges_neither_whichever_side_is_wedged(
    wedged: Literal["prefill", "decode"],
) -> None:
    """One prefill and one decode (SGLang), the deadline with both legs waiting: a wedged
    decode (its prefill waiting for it to take the KV) and a wedged prefill (its decode
    waiting for the KV) look the same to the router, and with no other partner nothing tells
    them apart. Neither is charged, whichever it is, again and again: charging the decode
    would charge a healthy one for a wedged prefill, and opening either circuit sends no
    request elsewhere (each is the last of its side), it only turns the 504s into 503s for
    the cooldown (the known-open note "PD 1P1D deadline never charged": as designed)."""
    healthy: Literal["prefill", "decode"] = "prefill" if wedged == "decode" else "decode"
    async with (
        ReferenceWorker(reference(healthy, kv_transfer_timeout_s=30.0)) as worker,
        FakePdWorker(wedged, hang=True) as hung,
    ):
        workers = router_config([("healthy", worker.url)]).workers
        config = _one_second_deadline(_config(workers=(*workers, _fake("hung", hung))))
        prefill, decode = ("healthy", "hung") if wedged == "decode" else ("hung", "healthy")
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            for _ in range(2):
                message = await _stalled(session, router)
                assert message.startswith(f"neither prefill {prefill} nor decode {decode}")
                assert message.endswith("(neither charged)")
            assert _failures(router) == {"healthy": 0, "hung": 0}


async def test_a_lone_decode_stalling_after_its_prefill_answered_is_charged() -> None:
    """Where the side is told, a lone pair's deadline is charged: a decode that stalls once
    its prefill answered (the KV came) is charged at once, as a whole request's worker that
    does not answer by the deadline is."""
    async with (
        FakePdWorker("prefill") as p0,
        FakePdWorker("decode", hang=True) as d0,
    ):
        config = _one_second_deadline(_config(workers=(_fake("p0", p0), _fake("d0", d0))))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            message = await _stalled(session, router)
            assert (
                message
                == "worker d0 did not answer within the request timeout (timeouts.request_s)"
            )
            assert _failures(router) == {"p0": 0, "d0": 1}
