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
  body, `X-Data-Parallel-Rank` on its OpenAI routes; vLLM: `X-data-parallel-rank`);
- whether a lone one-page `BlockStored` may teach an unconfigured stream its page size
  (SGLang publishes one event per page; vLLM 0.33 publishes a partial entry, one hash block
  of a block, as a one-page event: a vLLM stream learns from a store of two or more pages);
- how a prefill/decode pair serves one request (`PdPairing`) and where a worker advertises its
  role and bootstrap port (SGLang's server args `disaggregation_mode`, "null" | "prefill" |
  "decode", and `disaggregation_bootstrap_port`, default 8998, dumped into `/server_info`;
  vLLM advertises neither: its kv_role lives in `--kv-transfer-config`, so it is configured).

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
    "VLLM_PREFILL_KV_TRANSFER_PARAMS",
    "EngineName",
    "EngineSpec",
    "NamespaceRule",
    "PdPairing",
    "PdRole",
    "engine_spec",
]

EngineName = Literal["sglang", "vllm"]
ChatConventionName = Literal["sglang", "vllm"]  # router.prompt.conventions holds them


class NamespaceRule(enum.Enum):
    """Where a `BlockStored` says which cache namespace its blocks are in."""

    PER_EVENT = "per_event"  # every event carries cache_salt (and lora_name / lora_id)
    # the first block's extra_keys hold the salt; children inherit their parent's namespace
    ROOT_EXTRA_KEYS = "root_extra_keys"


PdRole = Literal["both", "prefill", "decode"]


class PdPairing(enum.Enum):
    """How a prefill worker and a decode worker serve one request together."""

    # SGLang: the request goes to both at once with the prefill's `bootstrap_host`,
    # `bootstrap_port` and a fresh random `bootstrap_room` (0 .. 2**63 - 1, as its router
    # draws it); the decode's answer is the client's (`managers/io_struct.py` GenerateReqInput,
    # `entrypoints/openai/protocol.py` PDRoutingFields, sglang-router's PD mode)
    BOOTSTRAP_ROOM = "bootstrap_room"
    # vLLM's NIXL proxy protocol: the request goes to the prefill first with `max_tokens` 1,
    # `stream` false and `kv_transfer_params` asking for a remote decode; the
    # `kv_transfer_params` of its answer go with the original request to the decode
    # (`distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`)
    KV_TRANSFER_PARAMS = "kv_transfer_params"


# what vLLM's disaggregated-serving proxy sends its prefill worker (vLLM 0.33)
VLLM_PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
SGLANG_BOOTSTRAP_PORT = 8998  # --disaggregation-bootstrap-port's default


def _no_server_info(_: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _no_role(_: Mapping[str, Any]) -> tuple[PdRole | None, int | None]:
    return None, None


_SGLANG_MODES: dict[str, PdRole] = {"null": "both", "prefill": "prefill", "decode": "decode"}


def _sglang_role(info: Mapping[str, Any]) -> tuple[PdRole | None, int | None]:
    """(role, bootstrap port) from SGLang's server args; None where the answer says nothing."""
    mode = info.get("disaggregation_mode")
    role = _SGLANG_MODES.get(mode) if isinstance(mode, str) else None
    port = info.get("disaggregation_bootstrap_port")
    valid = isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
    return role, port if valid else None


def _sglang_advertised(info: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's `/server_info` kv-events settings, normalized to one dict.

    Two shapes: a `kv_events` block, and SGLang's `kv_events_config` (a JSON string of the
    publisher's settings, SGLang's defaults filling what it leaves out) with `page_size` and
    `dp_size` beside it. The block is SGLang 0.5.23's descriptor ({publisher, endpoint_host,
    endpoint_port_base, replay_endpoint_port_base, topic, block_size, dp_size}; null when it
    publishes nothing) or the reference workers' ({endpoint, replay_endpoint, topic,
    block_size, dp_size, endpoint_port_base, replay_port_base}).
    """
    block = info.get("kv_events")
    if isinstance(block, Mapping):
        advertised = dict(block)
        # SGLang 0.5.23's own descriptor (`describe_kv_events_publisher`) names a host and
        # port bases, rank r on base + r, the host possibly a wildcard the subscriber swaps for
        # the worker's: spelled here as the rank-0 endpoints the rest reads
        host = advertised.get("endpoint_host")
        if "endpoint" not in advertised and isinstance(host, str) and host:
            for base, endpoint, named in (
                ("endpoint_port_base", "endpoint", "endpoint_port_base"),
                ("replay_endpoint_port_base", "replay_endpoint", "replay_port_base"),
            ):
                port = advertised.get(base)
                if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
                    advertised.setdefault(endpoint, f"tcp://{host}:{port}")
                    advertised.setdefault(named, port)
        return advertised
    raw = info.get("kv_events_config")
    if isinstance(raw, str) and raw:
        try:
            raw = json.loads(raw)
        except ValueError:
            raw = None
    advertised = dict(raw) if isinstance(raw, Mapping) else {}
    if isinstance(raw, Mapping):
        # SGLang's own defaults (`KVEventsConfig`, 0.5.23) for what the JSON leaves out: no
        # publisher is the null one (nothing is published), a zmq one binds tcp://*:5557
        advertised.setdefault("publisher", "null")
        if advertised["publisher"] == "zmq":
            advertised.setdefault("endpoint", "tcp://*:5557")
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
    # prefill/decode: how a pair is formed, and the (role, bootstrap port) a server_info
    # answer advertises (None each where it says nothing)
    pd_pairing: PdPairing
    advertised_role: Callable[[Mapping[str, Any]], tuple[PdRole | None, int | None]]
    default_bootstrap_port: int | None
    # what a one-page store does on a stream whose page size is not known: no lone page shows
    # the size, for it may be a partial one (SGLang's trailing partial page of a node; vLLM
    # 0.33's partial entry inside a block with fine-grained prefix hits, Mamba "align"
    # hybrids, as a store of one hash block). Learned from one, every later full page was a
    # mismatch and nothing more was indexed on the rank. SGLang sends one event per page, so
    # its one-page stores are held, in order with the stream's other events, until a page
    # proves the size (`indexer.index.held`); vLLM sends each request's new full blocks in
    # one event, so its one-page stores before the first of several pages are skipped
    one_page_stores_held: bool
    # whether a store of a block the stream holds (same hash, same tier) is another copy that
    # gets its own removal: SGLang publishes a store per new radix node only, and a request
    # with an `extra_key` stores its own node of a page the plain tree holds (same hash:
    # `extra_key` is not hashed); vLLM re-reports reused blocks (kv_cache_report_mode
    # "full") with no removal of their own, so there a store again counts once
    stored_again_is_copy: bool

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
    pd_pairing=PdPairing.BOOTSTRAP_ROOM,
    advertised_role=_sglang_role,
    default_bootstrap_port=SGLANG_BOOTSTRAP_PORT,
    one_page_stores_held=True,
    stored_again_is_copy=True,
)

VLLM = EngineSpec(
    name="vllm",
    namespace_rule=NamespaceRule.ROOT_EXTRA_KEYS,
    chat="vllm",
    server_info_paths=(),
    advertised_events=_no_server_info,
    dp_rank_header="X-data-parallel-rank",
    dp_rank_generate_field=None,
    pd_pairing=PdPairing.KV_TRANSFER_PARAMS,
    advertised_role=_no_role,
    default_bootstrap_port=None,  # the prefill's answer says where its KV is
    one_page_stores_held=False,
    stored_again_is_copy=False,
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
