"""Prefill/decode disaggregation in the reference workers: the KV handoff, in both spellings.

A worker with `role = "prefill"` runs a request's prompt (reusing its cache and publishing its
events as any worker does), keeps the prompt's pages locked, and serves them from its
bootstrap server (`GET /kv/{key}` on `bootstrap_port`, SGLang's
`--disaggregation-bootstrap-port`). A worker with `role = "decode"` fetches them from there
before it queues the request, paying `transfer_ms_per_token` for every token it does not hold
itself (the time is spent while the prefill side serves the fetch, so a prefill that dies
mid-transfer cuts the decode's fetch), then decodes as usual. Either side waits for the other
at most `kv_transfer_timeout_s`: a prefill whose decode never came frees its pages, a decode
whose KV never came answers 504, never hangs.

The two engines pair a request differently, and both spellings are accepted:
- SGLang sends the request to both at once with `bootstrap_host`/`bootstrap_port` (the
  prefill's bootstrap server) and a random `bootstrap_room`; the prefill answers once its KV
  has been handed over, the decode answers the client.
- vLLM's NIXL proxy sends it to the prefill first with `kv_transfer_params.do_remote_decode`;
  the prefill answers at once with `kv_transfer_params` naming the pages (`remote_host`,
  `remote_port`, `remote_request_id`, `remote_block_ids`, `remote_engine_id`, as vLLM 0.33's
  `nixl/pull_scheduler.py` returns them) and holds them until they are read; the proxy then
  sends the original request with those params to the decode.

A worker with `role = "both"` ignores the PD fields, as SGLang's "null" mode does.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from workers.config import WorkerConfig
from workers.errors import KvTransferError, KvTransferTimeoutError, RequestError
from workers.io_struct import ApiRequest, Generation
from workers.listener import bind_site
from workers.scheduler import Job, QueueFullError

__all__ = ["Disaggregation", "Handoff", "HandoffTable", "RemoteKv", "room_rank"]

# handoffs open at once on one prefill worker (each a locked prompt, or a decode waiting)
_CAPACITY = 4096


def room_rank(config: WorkerConfig, item: Generation) -> int | None:
    """The DP rank a prefill worker with several ranks runs a request on when it names none:
    its bootstrap room's, `room % dp_size` (SGLang 0.5.23 resolves `load_balance_method` auto
    to `follow_bootstrap_room` on a prefill worker, `arg_groups/serving_hook.py`, and its decode
    side finds the prefill's rank the same way); None on any other worker or request."""
    handoff = item.handoff
    if config.role != "prefill" or config.dp_size < 2 or handoff is None or handoff.room is None:
        return None
    return handoff.room % config.dp_size


class RemoteKv(msgspec.Struct, frozen=True):
    """What a prefill's bootstrap server says about the KV it handed over."""

    prompt_tokens: int
    cached_tokens: int  # the prefill side's cache hit on this prompt
    transferred_tokens: int
    engine_id: str


class Handoff:
    """One request's KV between its prefill and its decode (on the prefill worker)."""

    __slots__ = ("job", "ready", "taken")

    def __init__(self) -> None:
        self.job: Job | None = None
        self.ready = asyncio.Event()  # the prefill finished: its pages are held
        self.taken = asyncio.Event()  # the decode side has them


class HandoffTable:
    """Open handoffs by key; each waiter removes what it opened when it is done with it."""

    def __init__(self, capacity: int = _CAPACITY) -> None:
        self._capacity = capacity
        self._open: dict[str, Handoff] = {}

    def open(self, key: str) -> Handoff:
        """The handoff named `key`, opened if new (whichever side comes first opens it)."""
        handoff = self._open.get(key)
        if handoff is None:
            if len(self._open) >= self._capacity:
                raise QueueFullError("too many KV handoffs open on this prefill worker")
            handoff = self._open[key] = Handoff()
        return handoff

    def discard(self, key: str) -> None:
        """Forget whatever `key` names."""
        self._open.pop(key, None)

    def close(self, key: str, handoff: Handoff) -> None:
        """Forget `handoff` (if `key` still names it)."""
        if self._open.get(key) is handoff:
            del self._open[key]

    def __len__(self) -> int:
        return len(self._open)


class Disaggregation:
    """The PD side of one reference worker: its bootstrap server, or its fetches of KV."""

    def __init__(
        self,
        config: WorkerConfig,
        peek: Callable[[Generation], int],
        release: Callable[[Job], None],
    ) -> None:
        self.config = config
        self.engine_id = uuid.uuid4().hex  # vLLM's remote_engine_id: this process
        self.handoffs = HandoffTable()
        self.fetching = 0  # decode side: fetches in flight (tests wait on it)
        self._peek = peek  # tokens of a prompt the decode side already caches
        self._release = release
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._holds: set[asyncio.Task[None]] = set()
        self.bootstrap_port: int | None = None

    @property
    def role(self) -> str:
        """This worker's role: both, prefill or decode."""
        return self.config.role

    async def start(self) -> None:
        """Open the bootstrap server (prefill) or the client session (decode)."""
        if self.role == "prefill":
            app = web.Application()
            app.router.add_get("/kv/{key}", self._serve_kv)
            # a decode that disconnects cancels its transfer: the pages then wait for the timeout
            runner = web.AppRunner(
                app, access_log=None, handle_signals=False, handler_cancellation=True
            )
            await runner.setup()
            self._runner = runner
            site = web.TCPSite(runner, self.config.host, self.config.bootstrap_port)
            await bind_site(site, "KV bootstrap port", self.config.bootstrap_port)
            self.bootstrap_port = int(runner.addresses[0][1])
        elif self.role == "decode":
            self._session = aiohttp.ClientSession(auto_decompress=False)

    async def aclose(self) -> None:
        """Stop the bootstrap server, the pending holds and the session."""
        for task in self._holds:
            task.cancel()
        for task in list(self._holds):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _scaled_s(self, ms: float) -> float:
        return ms * self.config.time_scale / 1000.0

    # ----------------------------------------------------------------- before queueing

    async def prepare(self, api: ApiRequest) -> ApiRequest:
        """The request as this role runs it: a prefill holds its pages and produces one
        token; a decode fetches its KV first (RequestError without PD fields)."""
        if self.role == "both":
            return api
        items = api.items
        if any(item.handoff is None for item in items):
            raise RequestError(
                f"a {self.role} worker serves only prefill/decode requests: give "
                "bootstrap_host, bootstrap_port and bootstrap_room (SGLang) or "
                "kv_transfer_params (vLLM)"
            )
        if self.role == "prefill":
            for item in items:
                self._check_room(item)
            for item in items:
                assert item.handoff is not None
                self.handoffs.open(item.handoff.key)  # a decode may already be waiting
            held = [msgspec.structs.replace(i, max_new_tokens=1, hold_kv=True) for i in items]
            return msgspec.structs.replace(api, items=held)
        fetched = await asyncio.gather(*(self._fetch(item) for item in items))
        moved = [
            msgspec.structs.replace(i, kv_transferred=True, remote_cached_tokens=kv.cached_tokens)
            for i, kv in zip(items, fetched, strict=True)
        ]
        return msgspec.structs.replace(api, items=moved)

    def _check_room(self, item: Generation) -> None:
        """Refuse a prefill named a rank other than its room's with no `disagg_prefill_dp_rank`,
        as SGLang 0.5.23's KV sender fails it (`common/conn.py`): its decode side, not told the
        rank, looks for the KV on the room's rank."""
        implied = room_rank(self.config, item)
        rank = item.dp_rank
        if implied is None or rank is None or not 0 <= rank < self.config.dp_size:
            return  # a rank out of range is the submit's 400
        assert item.handoff is not None
        if item.handoff.prefill_dp_rank is None and rank != implied:
            raise KvTransferError(
                f"follow_bootstrap_room conflict: dispatched to dp_rank {rank} but "
                f"bootstrap_room {item.handoff.room} implies dp_rank {implied}"
            )

    async def _fetch(self, item: Generation) -> RemoteKv:
        """Read one request's KV from its prefill's bootstrap server (decode side)."""
        handoff = item.handoff
        assert handoff is not None and self._session is not None
        if handoff.host is None or handoff.port is None:
            raise RequestError("a decode request needs bootstrap_host and bootstrap_port")
        host = f"[{handoff.host}]" if ":" in handoff.host else handoff.host
        url = f"http://{host}:{handoff.port}/kv/{handoff.key}"
        query = {"prompt_tokens": str(len(item.input_ids)), "have": str(self._peek(item))}
        where = f"the prefill's bootstrap server {handoff.host}:{handoff.port}"
        timeout_s = self.config.kv_transfer_timeout_s
        self.fetching += 1
        try:
            async with (
                asyncio.timeout(timeout_s),
                self._session.get(url, params=query) as resp,
            ):
                body = await resp.read()
                if resp.status == 504:
                    raise KvTransferTimeoutError(_message(body, f"{where} timed out"))
                if resp.status != 200:
                    raise KvTransferError(_message(body, f"{where} answered {resp.status}"))
                return msgspec.json.decode(body, type=RemoteKv)
        except TimeoutError:
            raise KvTransferTimeoutError(
                f"no KV for {handoff.key} from {where} within {timeout_s:g} s"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise KvTransferError(f"cannot reach {where}: {exc.os_error or exc}") from exc
        except (aiohttp.ClientError, msgspec.DecodeError) as exc:
            # a dropped connection mid-transfer: the prefill side died
            raise KvTransferError(f"KV transfer from {where} failed: {exc}") from exc
        finally:
            self.fetching -= 1

    # ----------------------------------------------------------------- after prefilling

    async def handed_over(self, api: ApiRequest, jobs: list[Job]) -> dict[str, Any] | None:
        """After a prefill's jobs finished: offer their pages to the decode side.

        SGLang's spelling waits (bounded) until the decode side has them; vLLM's returns the
        `kv_transfer_params` to answer with at once and holds the pages in the background.
        """
        if self.role != "prefill":
            return None
        offers: list[tuple[str, Handoff, Job]] = []
        for item, job in zip(api.items, jobs, strict=True):
            assert item.handoff is not None
            handoff = self.handoffs.open(item.handoff.key)
            handoff.job = job
            handoff.ready.set()
            offers.append((item.handoff.key, handoff, job))
        vllm = api.items[0].handoff
        assert vllm is not None
        if vllm.remote_decode:
            (key, handoff, job), *_ = offers
            task = asyncio.create_task(self._hold(key, handoff, job), name=f"kv-hold-{key}")
            self._holds.add(task)
            task.add_done_callback(self._holds.discard)
            return self._kv_transfer_params(key, job)
        try:
            async with asyncio.timeout(self.config.kv_transfer_timeout_s):
                for _, handoff, _ in offers:
                    await handoff.taken.wait()
        except TimeoutError:
            raise KvTransferTimeoutError(
                f"no decode worker fetched the KV within {self.config.kv_transfer_timeout_s:g} s"
            ) from None
        finally:
            for key, handoff, job in offers:
                self._release(job)
                self.handoffs.close(key, handoff)
        return None

    def abandon(self, api: ApiRequest, jobs: list[Job]) -> None:
        """A prefill stopped before its handoff ended: free its pages, close its handoffs."""
        if self.role != "prefill":
            return
        for job in jobs:
            self._release(job)
        for item in api.items:
            assert item.handoff is not None
            self.handoffs.discard(item.handoff.key)

    async def _hold(self, key: str, handoff: Handoff, job: Job) -> None:
        """vLLM: keep a prefill's pages until they are read or the lease runs out."""
        try:
            async with asyncio.timeout(self.config.kv_transfer_timeout_s):
                await handoff.taken.wait()
        except TimeoutError:
            pass
        finally:
            self._release(job)
            self.handoffs.close(key, handoff)

    def _kv_transfer_params(self, key: str, job: Job) -> dict[str, Any]:
        """What vLLM's prefill answers: where its pages are, for the decode to pull them."""
        pages = -(-len(job.prompt) // self.config.page_size)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(pages))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": key.removeprefix("req-"),
            "remote_host": self.config.host,
            "remote_port": self.bootstrap_port,
            "tp_size": 1,
            "remote_num_tokens": len(job.prompt),
        }

    # ----------------------------------------------------------------- bootstrap server

    async def _serve_kv(self, request: web.Request) -> web.Response:
        """GET /kv/{key}: wait for the prefill, move its pages (paying the time), hand over."""
        key = request.match_info["key"]
        try:
            prompt_tokens = int(request.query.get("prompt_tokens", "-1"))
            have = max(0, int(request.query.get("have", "0")))
        except ValueError:
            return _error(400, "invalid_request_error", "prompt_tokens and have are integers")
        try:
            handoff = self.handoffs.open(key)
        except QueueFullError as exc:
            return _error(503, "overloaded", str(exc))
        timeout_s = self.config.kv_transfer_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await handoff.ready.wait()
        except TimeoutError:
            if handoff.job is None:
                self.handoffs.close(key, handoff)  # its prefill never came: nothing is held
            return _error(
                504, "kv_transfer_timeout", f"no prefill for {key} within {timeout_s:g} s"
            )
        job = handoff.job
        assert job is not None
        if 0 <= prompt_tokens != len(job.prompt):
            return _error(
                409,
                "kv_mismatch",
                f"{key} holds a {len(job.prompt)}-token prompt, not {prompt_tokens} tokens",
            )
        moved = max(0, len(job.prompt) - have)
        # the pages move while both sides hold the connection: a prefill dying now cuts it
        await asyncio.sleep(self._scaled_s(self.config.transfer_ms_per_token * moved))
        handoff.taken.set()
        kv = RemoteKv(
            prompt_tokens=len(job.prompt),
            cached_tokens=job.cached_tokens,
            transferred_tokens=moved,
            engine_id=self.engine_id,
        )
        return web.Response(body=msgspec.json.encode(kv), content_type="application/json")


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


def _message(body: bytes, fallback: str) -> str:
    """The message of a JSON error answer, else `fallback`."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return fallback
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else fallback
