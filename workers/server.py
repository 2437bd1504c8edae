"""The reference worker's HTTP API, compatible with SGLang's where clients and routers look.

SGLang: `POST /generate` (text or input_ids, batched or not, SSE with `stream`), `GET /health`,
`GET /get_model_info`, `GET /server_info` and `/get_server_info` (with the `kv_events` block),
`GET`/`POST /flush_cache` (all, or a POST's `{"cache_salt": ...}` for one namespace, "" the
unsalted one).
OpenAI: `POST /v1/completions`, `POST /v1/chat/completions` (SSE, `stream_options
.include_usage`), `GET /v1/models`; usage carries `prompt_tokens_details.cached_tokens`.
A request names its DP rank as SGLang's do (`workers.io_struct`): `routed_dp_rank` (or the
deprecated `data_parallel_rank`) in any body, the `X-Data-Parallel-Rank` header on the OpenAI
routes; without one, the ranks take requests in turn.
kvroute: `POST /debug/match` (per DP rank, what the request would report as cached and what the
cache holds of its prompt, no side effect) so benchmarks can compare the router's index with
the truth, and every answer names the worker in
`X-Reference-Worker` (its HTTP port), so a benchmark knows which cache served a request even
through a router that does not say (routers pass upstream headers on).
Prefill/decode roles (`workers.disagg`): a prefill worker answers once its KV is handed over
(SGLang) or at once with `kv_transfer_params` (vLLM), one final chunk when asked to stream; a
decode worker fetches its KV before queueing and reports the prefill side's `cached_tokens`.
`/server_info` advertises `disaggregation_mode` and `disaggregation_bootstrap_port` as SGLang's
does. With `return_logprob`, `/generate` reports (made-up, deterministic) `input_token_logprobs`
as SGLang's `[logprob, token_id, None]` triples, from `logprob_start_len` on (none when it is
unset): a prefill reports the prompt's, a decode none,
so SGLang's router merging the two gets the whole list a single worker reports.

Errors are JSON `{"error": {"type", "message"}}`: 400 for bad input (checked before anything is
queued), 503 when the waiting queue is full. Salts are never echoed or logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError

from indexer.protocol.tokens import ByteTokenizer
from workers.errors import (
    CacheBusyError,
    KvTransferError,
    KvTransferTimeoutError,
    RequestError,
    WorkerError,
)
from workers.io_struct import (
    DP_RANK_HEADER,
    ApiRequest,
    normalize_key,
    parse_chat,
    parse_completion,
    parse_generate,
)
from workers.scheduler import Job, QueueFullError

if TYPE_CHECKING:
    from workers.worker import ReferenceWorker

__all__ = ["WORKER_HEADER", "WORKER_KEY", "build_app"]

log = logging.getLogger(__name__)

WORKER_KEY: web.AppKey[ReferenceWorker] = web.AppKey("worker")
_MAX_BODY_BYTES = 16 * 1024 * 1024
_TOKENIZER = ByteTokenizer()
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Domain errors into JSON answers, in one place."""
    try:
        return await handler(request)
    except RequestError as exc:
        return _error(400, "invalid_request_error", str(exc))
    except CacheBusyError as exc:
        return _error(400, "cache_busy", str(exc))
    except QueueFullError as exc:
        return _error(503, "overloaded", str(exc))
    except KvTransferTimeoutError as exc:
        return _error(504, "kv_transfer_timeout", str(exc))
    except KvTransferError as exc:
        return _error(502, "kv_transfer_failed", str(exc))
    except WorkerError as exc:
        return _error(500, "worker_error", str(exc))
    except RequestPayloadError as exc:
        # a body the parser could not decode; its message may quote the body, so only its kind
        cause = type(exc.__cause__ or exc).__name__
        return _error(400, "invalid_request_error", f"the body cannot be decoded ({cause})")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own refusals (unknown path, wrong method, body too large) in the same shape
        kind = "payload_too_large" if exc.status == 413 else "invalid_request_error"
        return _error(exc.status, kind, exc.text or exc.reason)
    except ConnectionResetError:
        raise  # the client is gone: nobody to answer
    except Exception:
        # a bug: the traceback goes to the log (it carries no request body, so no salt)
        log.exception("unexpected error handling %s %s", request.method, request.path)
        return _error(500, "internal_error", "internal worker error (see the worker log)")


async def _json(request: web.Request, *, optional: bool = False) -> Any:
    raw = await request.read()
    if optional and not raw.strip():
        return {}
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise RequestError("the body nests JSON too deeply to parse") from None


def _worker(request: web.Request) -> ReferenceWorker:
    return request.app[WORKER_KEY]


def _sse(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def _open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    if request.version < HttpVersion11:
        # no chunks in HTTP/1.0: the stream ends where the connection does, so it closes
        # after it even for a client asking to keep it (aiohttp alone would keep it)
        response.force_close()
    await response.prepare(request)
    return response


def _submit_all(worker: ReferenceWorker, api: ApiRequest) -> list[Job]:
    jobs: list[Job] = []
    try:
        for item in api.items:
            jobs.append(worker.submit(item))
    except WorkerError:
        for job in jobs:
            worker.cancel(job)
        raise
    return jobs


async def _run(worker: ReferenceWorker, jobs: list[Job]) -> None:
    """Wait for every job; a cancelled handler (client gone) cancels them."""
    try:
        for job in jobs:
            await job.wait()
    except asyncio.CancelledError:
        for job in jobs:
            worker.cancel(job)
        raise
    if any(job.cancelled for job in jobs):
        # Not by this client (it is still here): a crashed scheduler aborted them.
        worker.check_alive()


def _finish_reason(job: Job) -> str:
    return "abort" if job.cancelled else "length"


def _input_logprobs(job: Job) -> list[list[Any]]:
    """The prompt's logprob triples (made up: the worker has no model) from its
    `logprob_start_len` on, none without one, as SGLang 0.5.23 reports them
    (`SchedulerLogprobResultProcessor`: the tokens from the start, the first without a value).
    A decode whose KV came by transfer computed none of them."""
    start = job.generation.logprob_start_len
    if job.generation.kv_transferred or start is None:
        return []
    return [
        [None if i == start else -((t % 7) + 1) / 8.0, t, None]
        for i, t in enumerate(job.prompt)
        if i >= start
    ]


def _meta_info(job: Job, rid: str, logprobs: bool = False) -> dict[str, Any]:
    end = job.finished_at or time.monotonic()
    finish: dict[str, Any] | None = None
    if job.finished:
        finish = {"type": _finish_reason(job)}
        if not job.cancelled:
            finish["length"] = len(job.output)
    return {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(job.prompt),
        "completion_tokens": len(job.output),
        "cached_tokens": job.reported_cached_tokens,
        "e2e_latency": end - job.created_at,
        "dp_rank": job.rank,
    } | ({"input_token_logprobs": _input_logprobs(job)} if logprobs else {})


def _generate_result(job: Job, rid: str, logprobs: bool = False) -> dict[str, Any]:
    return {
        "text": _TOKENIZER.decode(job.output),
        "output_ids": list(job.output),
        "meta_info": _meta_info(job, rid, logprobs),
    }


async def _prefilled(worker: ReferenceWorker, api: ApiRequest, jobs: list[Job]) -> Any:
    """A prefill's jobs run and handed over; returns vLLM's `kv_transfer_params` (or None).

    Whatever stops it on the way (the client gone, the decode never coming) frees the pages.
    """
    try:
        await _run(worker, jobs)
        return await worker.disagg.handed_over(api, jobs)
    except BaseException:
        worker.disagg.abandon(api, jobs)
        raise


async def _answer_once(request: web.Request, api: ApiRequest, payload: Any) -> web.StreamResponse:
    """A prefill's one answer: JSON, or one SSE chunk when it was asked to stream."""
    if not api.stream:
        return web.json_response(payload)
    response = await _open_sse(request)
    await response.write(_sse(payload))
    await response.write(_DONE)
    return response


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's native endpoint."""
    worker = _worker(request)
    api = await worker.disagg.prepare(parse_generate(await _json(request)))
    jobs = _submit_all(worker, api)
    rids = [item.rid or uuid.uuid4().hex for item in api.items]
    lp = api.return_logprob
    if worker.disagg.role == "prefill":
        await _prefilled(worker, api, jobs)
        results = [_generate_result(job, rid, lp) for job, rid in zip(jobs, rids, strict=True)]
        return await _answer_once(request, api, results if api.batch else results[0])
    if not api.stream:
        await _run(worker, jobs)
        results = [_generate_result(job, rid, lp) for job, rid in zip(jobs, rids, strict=True)]
        return web.json_response(results if api.batch else results[0])
    (job,), (rid,) = jobs, rids
    try:
        response = await _open_sse(request)
        async for _ in job.tokens():
            await response.write(_sse(_generate_result(job, rid, lp)))
        if not job.output:
            await response.write(_sse(_generate_result(job, rid, lp)))
        await response.write(_DONE)
    except asyncio.CancelledError:
        worker.cancel(job)
        raise
    except ConnectionResetError:
        # the client went away mid-stream (aiohttp's ClientConnectionResetError): its job is
        # cancelled and there is nobody left to answer; raised on, aiohttp would log a whole
        # traceback per disconnect (4,037 of them in a 30-minute `kvroute bench soak`)
        worker.cancel(job)
        log.debug("client went away mid-stream on %s", request.path)
    return response


def _usage(jobs: list[Job]) -> dict[str, Any]:
    """The OpenAI usage of a request's jobs (a batch's summed over its items, as SGLang's)."""
    prompt = sum(len(job.prompt) for job in jobs)
    output = sum(len(job.output) for job in jobs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": sum(job.reported_cached_tokens for job in jobs)},
    }


async def _openai(request: web.Request, api: ApiRequest, *, chat: bool) -> web.StreamResponse:
    worker = _worker(request)
    api = await worker.disagg.prepare(api)
    jobs = _submit_all(worker, api)  # (one, or a batched completion's items)
    model = api.model or worker.config.model
    prefix = "chatcmpl" if chat else "cmpl"
    head = {
        "id": f"{prefix}-{api.items[0].rid or uuid.uuid4().hex}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    prefill = worker.disagg.role == "prefill"
    params = await _prefilled(worker, api, jobs) if prefill else None
    if not api.stream or prefill:
        if not prefill:
            await _run(worker, jobs)
        choices: list[dict[str, Any]] = []
        for index, job in enumerate(jobs):
            text = _TOKENIZER.decode(job.output)
            reason = _finish_reason(job)
            if chat:
                message = {"role": "assistant", "content": text}
                choices.append(
                    {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
                )
            else:
                choices.append(
                    {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
                )
        body: dict[str, Any] = head | {"object": "chat.completion" if chat else "text_completion"}
        body |= {"choices": choices, "usage": _usage(jobs)}
        if params is not None:
            body["kv_transfer_params"] = params  # vLLM: where the decode side pulls the KV
        return await _answer_once(request, api, body)

    def chunk(
        delta: str | None, reason: str | None, *, role: bool = False, index: int = 0
    ) -> bytes:
        piece: dict[str, Any]
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if delta is not None:
                d["content"] = delta
            piece = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            text = delta or ""
            piece = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        return _sse(head | {"choices": [piece]})

    try:
        response = await _open_sse(request)
        # chat's first chunk (the role) goes once the first token exists, as SGLang's
        # serving_chat sends it (in its loop over the outputs, just before the first one's):
        # a router takes the first chunk as the first token. Before, it went at once, before
        # the prefill, and the router's balance fit learned nothing from streamed chat
        role = chat
        # a batch's items one after the other, each chunk naming its item (`index`): they
        # run together, and a client reads any order (SGLang interleaves them)
        for index, job in enumerate(jobs):
            async for token in job.tokens():
                if role:
                    role = False
                    await response.write(chunk(None, None, role=True))
                await response.write(chunk(_TOKENIZER.decode([token]), None, index=index))
            if role:  # no output at all: the role still comes first
                role = False
                await response.write(chunk(None, None, role=True))
            await response.write(chunk(None, _finish_reason(job), index=index))
        if api.include_usage:
            await response.write(_sse(head | {"choices": [], "usage": _usage(jobs)}))
        await response.write(_DONE)
    except asyncio.CancelledError:
        for job in jobs:
            worker.cancel(job)
        raise
    except ConnectionResetError:
        # the client went away mid-stream (aiohttp's ClientConnectionResetError): its job is
        # cancelled and there is nobody left to answer; raised on, aiohttp would log a whole
        # traceback per disconnect (4,037 of them in a 30-minute `kvroute bench soak`)
        for job in jobs:
            worker.cancel(job)
        log.debug("client went away mid-stream on %s", request.path)
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI text completions (the rank header as SGLang's OpenAI layer reads it)."""
    rank = request.headers.get(DP_RANK_HEADER)
    cfg = _worker(request).config
    api = parse_completion(
        await _json(request), dp_rank_header=rank, served=cfg.model, version=cfg.version
    )
    return await _openai(request, api, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completions through the shared byte tokenizer and chat template."""
    rank = request.headers.get(DP_RANK_HEADER)
    cfg = _worker(request).config
    api = parse_chat(
        await _json(request), dp_rank_header=rank, served=cfg.model, version=cfg.version
    )
    return await _openai(request, api, chat=True)


async def health(request: web.Request) -> web.StreamResponse:
    """200 while every scheduler runs."""
    _worker(request).check_alive()
    return web.Response(text="")


async def models(request: web.Request) -> web.StreamResponse:
    """The one model this worker serves."""
    cfg = _worker(request).config
    card = {
        "id": cfg.model,
        "object": "model",
        "created": 0,
        "owned_by": "kvroute",
        "root": cfg.model,
        "max_model_len": cfg.context_length,
    }
    return web.json_response({"object": "list", "data": [card]})


async def model_info(request: web.Request) -> web.StreamResponse:
    """SGLang's /get_model_info."""
    cfg = _worker(request).config
    return web.json_response(
        {
            "model_path": cfg.model,
            "tokenizer_path": None,
            "is_generation": True,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "reference-byte-lm",
            "architectures": ["KvrouteReferenceWorker"],
        }
    )


async def server_info(request: web.Request) -> web.StreamResponse:
    """SGLang's /server_info: the settings a router needs, with the `kv_events` block."""
    worker = _worker(request)
    cfg = worker.config
    loads = [sched.load for sched in worker.ranks]
    return web.json_response(
        {
            "model_path": cfg.model,
            "served_model_name": cfg.model,
            "version": cfg.version,
            "page_size": cfg.page_size,
            "dp_size": cfg.dp_size,
            "max_total_num_tokens": cfg.total_pages * cfg.page_size,
            # SGLang's HiCache settings, for the host tier: its pool is the ratio times the
            # device pool, and keeps a copy of what the GPU holds (write-through), as here
            "enable_hierarchical_cache": cfg.host_capacity_tokens > 0,
            "hicache_ratio": cfg.host_capacity_tokens / (cfg.total_pages * cfg.page_size),
            "hicache_size": 0,
            "max_running_requests": cfg.max_running_requests,
            "context_length": cfg.context_length,
            "tokenizer": "byte",
            "kv_events": msgspec.to_builtins(worker.kv_events),
            # SGLang's server args: "null" is its name for a worker that does both
            "disaggregation_mode": {"both": "null"}.get(cfg.role, cfg.role),
            "disaggregation_bootstrap_port": worker.disagg.bootstrap_port or 8998,
            # not SGLang's: its /flush_cache takes no salt and empties the whole cache; this
            # worker flushes one salt's pages, and says so for the router's evictions
            "flush_cache_by_salt": cfg.flush_by_salt,
            "disable_overlap_schedule": not cfg.overlap_schedule,
            # SGLang's chunk budget per batch (-1: none): this worker never splits a prompt
            "chunked_prefill_size": -1,
            "internal_states": [
                {"dp_rank": r, "running": run, "waiting": wait}
                for r, (run, wait) in enumerate(loads)
            ],
        }
    )


async def flush_cache(request: web.Request) -> web.StreamResponse:
    """Flush everything (only when idle, as SGLang), or one salt's pages with `cache_salt`.

    SGLang takes GET as well as POST (0.5.23 `http_server.flush_cache`) and reads no body; a
    GET here reads none either, so it always flushes everything."""
    body = {} if request.method == "GET" else await _json(request, optional=True)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    worker = _worker(request)
    if "cache_salt" not in body or not worker.config.flush_by_salt:
        removed = worker.flush_all()  # SGLang's takes no salt: whatever the body says, all
        return web.json_response({"message": "Cache flushed.", "pages_removed": removed})
    # A body that names a namespace never empties the others: "" (or null) is the unsalted one.
    salt = normalize_key(body["cache_salt"], "cache_salt")
    removed = worker.flush_namespace(salt)
    return web.json_response({"message": "Cache flushed.", "pages_removed": removed})


async def debug_match(request: web.Request) -> web.StreamResponse:
    """What the request would report as `cached_tokens` on each DP rank if it came now (its
    prompt but the last token, page aligned, capped by `logprob_start_len` with
    `return_logprob`: `cached_tokens`, `ranks`), and the cached prefix of the whole prompt
    (`held_tokens`, `held_ranks`); changes nothing."""
    body = await _json(request)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    probe = dict(body)
    probe.pop("sampling_params", None)
    probe.pop("stream", None)
    if "tokens" in probe:
        probe["input_ids"] = probe.pop("tokens")
    cfg = _worker(request).config
    if "messages" in body:
        api = parse_chat(body, served=cfg.model, version=cfg.version)
    else:
        api = parse_generate(probe)
    if api.batch:
        raise RequestError("debug/match takes one prompt")
    item = api.items[0]
    worker = _worker(request)
    reused = worker.would_reuse(item)
    held = worker.match(item.namespace, item.input_ids)
    return web.json_response(
        {
            "cached_tokens": max(reused),
            "ranks": reused,
            "held_tokens": max(held),
            "held_ranks": held,
            "prompt_tokens": len(item.input_ids),
        }
    )


WORKER_HEADER = "X-Reference-Worker"


async def _name_the_worker(request: web.Request, response: web.StreamResponse) -> None:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        response.headers[WORKER_HEADER] = str(sockname[1])


def build_app(worker: ReferenceWorker) -> web.Application:
    """The aiohttp application of one worker."""
    app = web.Application(middlewares=[_errors], client_max_size=_MAX_BODY_BYTES)
    app[WORKER_KEY] = worker
    app.on_response_prepare.append(_name_the_worker)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/flush_cache", flush_cache, allow_head=False)  # a HEAD flushes nothing
    app.router.add_post("/debug/match", debug_match)
    return app
