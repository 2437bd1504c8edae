"""The inference engines kvroute fronts: one spec per engine, owning every rule that differs.

Nothing else in kvroute compares engine names. A spec says:
- where a block's cache namespace lives on the wire: SGLang puts the request's `cache_salt` on
  every `BlockStored` (`PER_EVENT`); vLLM puts it in the first block's `extra_keys` and every
  child inherits its parent's namespace (`ROOT_EXTRA_KEYS`);
- where a worker advertises its KV-event publisher (`/server_info` for SGLang, nothing for vLLM)
  and how that answer is read;
- which chat-request conventions its OpenAI layer follows (`chat`: the router's prompt package
  holds the conventions themselves, keyed by this name);
- how a request asks for one data-parallel rank (SGLang: `routed_dp_rank` in the `/generate`
  body, `X-Data-Parallel-Rank` on its OpenAI routes; vLLM: `X-data-parallel-rank`).

Facts from the engines' released code: SGLang 0.5.23 (`managers/io_struct.py`,
`entrypoints/openai/serving_base.py`, `disaggregation/kv_events.py`), vLLM 0.33. Adding an
engine (TensorRT-LLM publishes the same ZMQ KV events) means one spec here plus its fixtures.

Pure: no I/O.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import msgspec

__all__ = [
    "ENGINES",
    "SGLANG",
    "VLLM",
    "EngineName",
    "EngineSpec",
    "NamespaceRule",
    "engine_spec",
]

EngineName = Literal["sglang", "vllm"]
ChatConventionName = Literal["sglang", "vllm"]  # router.prompt.conventions holds them


class NamespaceRule(enum.Enum):
    """Where a `BlockStored` says which cache namespace its blocks are in."""

    PER_EVENT = "per_event"  # every event carries cache_salt (and lora_name / lora_id)
    # the first block's extra_keys hold the salt; children inherit their parent's namespace
    ROOT_EXTRA_KEYS = "root_extra_keys"


def _no_server_info(_: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _sglang_advertised(info: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's `/server_info` kv-events settings, normalized to one dict.

    Two shapes: a `kv_events` block ({endpoint, replay_endpoint, topic, block_size, dp_size,
    endpoint_port_base, replay_port_base}, as the reference workers and SGLang builds that
    advertise one send it), and stock SGLang's `kv_events_config` (a JSON string of the
    publisher's settings) with `page_size` and `dp_size` beside it.
    """
    block = info.get("kv_events")
    if isinstance(block, Mapping):
        return dict(block)
    raw = info.get("kv_events_config")
    if isinstance(raw, str) and raw:
        try:
            raw = json.loads(raw)
        except ValueError:
            raw = None
    advertised = dict(raw) if isinstance(raw, Mapping) else {}
    if "block_size" not in advertised and isinstance(info.get("page_size"), int):
        advertised["block_size"] = info["page_size"]
    if "dp_size" not in advertised and isinstance(info.get("dp_size"), int):
        advertised["dp_size"] = info["dp_size"]
    return advertised


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything kvroute does differently for one engine."""

    name: EngineName
    namespace_rule: NamespaceRule
    chat: ChatConventionName
    # HTTP paths that may answer with the worker's settings, tried in order (none: configure)
    server_info_paths: tuple[str, ...]
    # the kv-events settings a server_info answer advertises, as one flat dict
    advertised_events: Callable[[Mapping[str, Any]], dict[str, Any]]
    # how a request names its data-parallel rank: a header on the OpenAI routes, and a body
    # field of the native /generate route where the engine has one
    dp_rank_header: str
    dp_rank_generate_field: str | None

    @property
    def salt_in_root_extra_keys(self) -> bool:
        """Whether a block's namespace may come from extra_keys and be inherited."""
        return self.namespace_rule is NamespaceRule.ROOT_EXTRA_KEYS


SGLANG = EngineSpec(
    name="sglang",
    namespace_rule=NamespaceRule.PER_EVENT,
    chat="sglang",
    server_info_paths=("/server_info", "/get_server_info"),
    advertised_events=_sglang_advertised,
    dp_rank_header="X-Data-Parallel-Rank",
    dp_rank_generate_field="routed_dp_rank",  # `data_parallel_rank` is its deprecated alias
)

VLLM = EngineSpec(
    name="vllm",
    namespace_rule=NamespaceRule.ROOT_EXTRA_KEYS,
    chat="vllm",
    server_info_paths=(),
    advertised_events=_no_server_info,
    dp_rank_header="X-data-parallel-rank",
    dp_rank_generate_field=None,
)

ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (SGLANG, VLLM)}
assert set(ENGINES) == set(get_args(EngineName)), "every EngineName needs a spec"


class UnknownEngineError(ValueError):
    """A name no spec answers to (in a snapshot, a recording or a config)."""


def engine_spec(name: str) -> EngineSpec:
    """The spec named `name`; UnknownEngineError naming the known ones otherwise."""
    spec = ENGINES.get(name)
    if spec is None:
        raise UnknownEngineError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")
    return spec
