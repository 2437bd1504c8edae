"""What a worker says about itself over HTTP: its settings (`/server_info`) and its models.

Read by the supervisor when a worker registers and by `kvroute record --config`, so a recording
names the namespaces the router indexes under. The answers are interpreted by the pure
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

__all__ = ["read_adapters", "read_served_models", "read_server_info"]

log = logging.getLogger(__name__)


async def read_server_info(
    session: aiohttp.ClientSession, url: str, spec: EngineSpec = SGLANG, *, timeout_s: float
) -> dict[str, Any]:
    """A worker's settings from the first of its engine's server-info paths that answers."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    last = "no answer" if spec.server_info_paths else f"{spec.name} advertises no settings"
    for path in spec.server_info_paths:
        try:
            async with session.get(url.rstrip("/") + path, timeout=timeout) as resp:
                if resp.status == 200:
                    info = msgspec.json.decode(await resp.read())
                    if isinstance(info, dict):
                        return info
                last = f"{path}: HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            last = f"{path}: {type(exc).__name__}: {exc}"
    raise RequestError(f"cannot read server_info of {url}: {last}")


async def read_adapters(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float
) -> dict[str, str]:
    """The LoRA adapters a worker lists in its `/v1/models` (id -> its base model); {} when
    it lists none or cannot be asked (best effort: a request naming one is then refused as an
    unknown model in a fleet of several models, never routed as the base)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url.rstrip("/") + "/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                return {}
            return adapters_from_model_list(msgspec.json.decode(await resp.read()))
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
        return {}


async def read_served_models(
    session: aiohttp.ClientSession,
    config: WorkerConfig,
    spec: EngineSpec,
    info: dict[str, Any] | None,
    *,
    timeout_s: float,
) -> tuple[str, ...]:
    """The models the worker of `config` serves: its config's, else the ones it advertises.

    SGLang's `served_model_name` when its `/server_info` was read anyway, else the
    worker's `/v1/models`, else (an engine with a settings path) its `/server_info`.
    RequestError when the worker cannot be asked (it is retried on the health rounds);
    () when it answers but advertises none.
    """
    if config.served_models:
        return config.served_models
    if info is not None and (named := models_from_server_info(info)) is not None:
        return named
    url = config.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    unreachable = ""
    try:
        async with session.get(url + "/v1/models", timeout=timeout) as resp:
            if resp.status == 200:
                listed = models_from_model_list(msgspec.json.decode(await resp.read()))
                if listed is not None:
                    return listed
    except (aiohttp.ClientError, TimeoutError) as exc:
        unreachable = f"/v1/models: {type(exc).__name__}: {exc}"
    except msgspec.DecodeError:
        pass  # answered, but with no model list
    if info is None and spec.server_info_paths:
        try:
            settings = await read_server_info(session, url, spec, timeout_s=timeout_s)
        except RequestError:
            settings = None
        if settings is not None and (named := models_from_server_info(settings)) is not None:
            return named
    if unreachable:
        raise RequestError(f"cannot read the models of {url}: {unreachable}")
    log.warning(
        "worker %s advertises no model: it is routed only in a one-model fleet", config.worker_id
    )
    return ()
