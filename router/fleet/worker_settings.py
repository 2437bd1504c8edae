"""What a worker says about itself over HTTP: its settings (`/server_info`) and its models.

Read when a worker registers (`router.fleet.registration`) and by `kvroute record --config`, so
a recording names the namespaces the router indexes under. The answers are interpreted by the pure
`router.fleet.discovery`.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import msgspec

from indexer.engines import SGLANG, EngineSpec
from router.config import WorkerConfig
from router.errors import RequestError
from router.fleet.discovery import (
    adapters_from_model_list,
    models_from_model_list,
    models_from_server_info,
)

__all__ = ["read_served_models", "read_server_info"]

log = logging.getLogger(__name__)


def _failure(path: str, exc: Exception, timeout_s: float) -> str:
    """Why asking `path` failed. A timeout says so and after how long: its exception's text is
    empty, and "TimeoutError: " alone did not say the worker was slow rather than broken."""
    if isinstance(exc, TimeoutError):
        return f"{path}: no answer within {timeout_s:g} s (timed out)"
    return f"{path}: {type(exc).__name__}: {exc}"


# a real server info is a few KiB (SGLang's, every server argument: about 10 KiB), a model list
# as much per model: past this an answer is no settings document, and reading it whole held it
# in the router's memory (64 MB of it took the router from 64 to 130 MB)
MAX_ANSWER_BYTES = 4 * 1024 * 1024


class _Unreadable(Exception):
    """A worker's answer that is not a JSON document the router reads (the reason)."""


async def _json_answer(resp: aiohttp.ClientResponse) -> object:
    """The JSON document of `resp`, read up to `MAX_ANSWER_BYTES` (decompressed); _Unreadable
    saying why when it is longer, not JSON, or nested too deep to decode.

    No frame an exception raised here passes through holds the answer: a traceback keeps its
    frames' locals, and a refusal kept for a log line or the next round held the 4 MiB read
    until a full collection, which the router's collector settings make rare (QA: an idle
    router at 1.3 GB after 80 s of a worker answering 4 MiB+ chunked every health round)."""
    cap = MAX_ANSWER_BYTES
    if resp.content_length is not None and resp.content_length > cap:
        raise _too_long(cap)  # said before a byte of it is read
    body = await _capped_body(resp, cap)
    if body is None:
        raise _too_long(cap)
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        why = f"DecodeError: {exc}"
    except RecursionError:
        # msgspec recurses per array or object: 100,000 nested arrays escaped as a 500 (an
        # admin add) or a traceback in the log (a discovery in the background)
        why = "JSON nested too deep to decode"
    del body
    raise _Unreadable(why)


def _too_long(cap: int) -> _Unreadable:
    return _Unreadable(f"answer longer than {cap >> 20} MiB, more than any worker's settings")


async def _capped_body(resp: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The body of `resp`, None once it is longer than `cap` (read no further)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await resp.content.read(cap + 1 - size):
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _kind(value: object) -> str:
    """What a JSON value is, said where an object was expected."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "an array" if isinstance(value, list) else "a string"


async def read_server_info(
    session: aiohttp.ClientSession, url: str, spec: EngineSpec = SGLANG, *, timeout_s: float
) -> dict[str, Any]:
    """A worker's settings from the first of its engine's server-info paths that answers."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    last = "no answer" if spec.server_info_paths else f"{spec.name} advertises no settings"
    for path in spec.server_info_paths:
        try:
            async with session.get(url.rstrip("/") + path, timeout=timeout) as resp:
                if resp.status != 200:
                    last = f"{path}: HTTP {resp.status}"
                    continue
                info = await _json_answer(resp)
                if isinstance(info, dict):
                    return info
                # before, "HTTP 200", which named nothing wrong
                last = f"{path}: HTTP 200 with {_kind(info)}, not a JSON object"
        except _Unreadable as exc:
            last = f"{path}: {exc}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = _failure(path, exc, timeout_s)
    raise RequestError(f"cannot read server_info of {url}: {last}")


async def _model_list(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[object, str]:
    """A worker's `/v1/models` answer, decoded (None: no answer it could give), and why it
    could not be asked ("" when it could)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url.rstrip("/") + "/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                return None, ""
            return await _json_answer(resp), ""
    except (aiohttp.ClientError, TimeoutError) as exc:
        return None, _failure("/v1/models", exc, timeout_s)
    except _Unreadable:
        return None, ""  # answered, but with no model list


async def read_served_models(
    session: aiohttp.ClientSession,
    config: WorkerConfig,
    spec: EngineSpec,
    info: dict[str, Any] | None,
    *,
    timeout_s: float,
    adapters: dict[str, str] | None = None,
    info_read: bool = False,
    advertised: list[str] | None = None,
) -> tuple[str, ...]:
    """The models the worker of `config` serves: its config's, else the ones it advertises.

    SGLang's `served_model_name` when its `/server_info` was read anyway, else the
    worker's `/v1/models`, else (an engine with a settings path) its `/server_info`.
    RequestError when the worker cannot be asked (it is retried on the health rounds);
    () when it answers but advertises none.

    `adapters`, when given, is filled with the LoRA adapters `/v1/models` lists by name (vLLM
    names one by itself): from the same answer, or (the names came from elsewhere) from one
    read for them, best effort.

    `info_read`: the caller tried the server info already (`info` None: it did not answer), so
    it is not asked again (a registration; a hung worker's would wait out its paths twice).

    `advertised`, when given, is filled with the names the worker advertises in the answers
    read anyway (its `served_model_name`, else its `/v1/models`; nothing is asked for them):
    a configured name the worker does not advertise may be a config pointing at another
    worker.
    """
    url = config.url.rstrip("/")
    said = models_from_server_info(info) if info is not None else None
    named: tuple[str, ...] | None = config.served_models or said
    if named is not None and adapters is None:
        if advertised is not None:
            advertised.extend(said or ())
        return named
    answer, unreachable = await _model_list(session, url, timeout_s)
    if adapters is not None:
        adapters.update(adapters_from_model_list(answer))
    listed = models_from_model_list(answer)
    if advertised is not None:
        advertised.extend(said or listed or ())
    if named is not None:
        return named
    if listed is not None:
        return listed
    if info is None and not info_read and spec.server_info_paths:
        try:
            settings = await read_server_info(session, url, spec, timeout_s=timeout_s)
        except RequestError:
            settings = None
        if settings is not None and (named := models_from_server_info(settings)) is not None:
            return named
    if unreachable:
        raise RequestError(f"cannot read the models of {url}: {unreachable}")
    log.warning(
        "worker %s advertises no model: it is routed only in a one-model fleet%s",
        config.worker_id,
        # a fleet of vLLM workers reads a name no worker serves as an adapter's (`resolve`)
        ", where each request's model is read as a LoRA adapter's and predicts no hit; give "
        "it `model` in its config (an OpenAI server behind --api-key does not list models)"
        if adapters is not None
        else "",
    )
    return ()
