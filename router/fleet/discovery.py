"""Turning a worker's config and `/server_info` into the KV-event streams to subscribe to.

A worker entry may spell out its event endpoints; whatever it leaves out is read from the
worker's `/server_info` (or `/get_server_info`), read by the worker's engine spec
(`indexer.engines`: SGLang advertises a `kv_events` block or a `kv_events_config`; vLLM
advertises nothing, so its streams are configured). A wildcard bind host (`*`, `0.0.0.0`) means
"the worker's own host".
Data-parallel rank r publishes on base port + r and replays on replay base port + r.

The models a worker serves come from its config, else from what it advertises: SGLang's
`/server_info` carries `served_model_name` (its `--served-model-name`, which defaults to the
model path), and every OpenAI-compatible server lists its models on `/v1/models`, where SGLang
and vLLM also list each loaded LoRA adapter as a card with a `parent` (an adapter of that base
model, not a model of its own: requests reach it as `base:adapter` or with `lora_path`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from indexer.config import MAX_BLOCK_SIZE, MAX_DP_SIZE, endpoint_problem, shown_endpoint
from indexer.engines import engine_spec
from indexer.service import StreamConfig
from router.config import WorkerConfig
from router.errors import RequestError

__all__ = [
    "MAX_CAPACITY_TOKENS",
    "MAX_RUNNING_REQUESTS",
    "adapters_from_model_list",
    "caches_prompts_late",
    "capacity_from_server_info",
    "flushes_by_salt",
    "host_capacity_from_server_info",
    "max_running_from_server_info",
    "models_from_model_list",
    "models_from_server_info",
    "needs_discovery",
    "settings_note",
    "streams_for",
    "version_from_server_info",
    "worker_host",
]

_WILDCARDS = {"*", "0.0.0.0", "", "::", "[::]"}


def worker_host(url: str) -> str:
    """The host part of a worker's HTTP url."""
    return urlsplit(url).hostname or "127.0.0.1"


def needs_discovery(worker: WorkerConfig) -> bool:
    """True when the config alone does not say where the worker publishes."""
    return worker.kv_events and (worker.events is None or worker.block_size is None)


def _split(endpoint: str) -> tuple[str, str, int | None]:
    """(scheme://, host, port) of a ZMQ tcp endpoint."""
    scheme, sep, rest = endpoint.rpartition("://")
    host, _, port = rest.rpartition(":")
    # ASCII digits, 5 at most: int() refuses "²" (a digit to isdigit) and 4300 digits or more
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5):
        return endpoint, "", None
    return scheme + "://", host, int(port)


def _localize(endpoint: str, host: str) -> str:
    scheme, bound, port = _split(endpoint)
    if port is None:
        return endpoint
    if bound in _WILDCARDS:
        bound = host
    return f"{scheme}{bound}:{port}"


def _per_rank(
    spec: str | list[str] | None, base_port: int | None, dp_size: int, host: str
) -> list[str | None]:
    if spec is None:
        return [None] * dp_size
    if isinstance(spec, list):
        if not all(isinstance(e, str) for e in spec):  # what a worker advertised, unchecked
            raise RequestError(f"expected endpoint strings (one per dp rank), got {spec!r}")
        if len(spec) != dp_size:
            raise RequestError(f"expected {dp_size} endpoints (one per dp rank), got {len(spec)}")
        return [_localize(e, host) for e in spec]
    scheme, bound, port = _split(_localize(spec, host))
    if port is None:
        if dp_size != 1:
            raise RequestError(f"endpoint {spec!r} has no port to offset per dp rank")
        return [spec]
    first = port if base_port is None else base_port
    # checked before the list is built (`dp_size` is bounded already: `streams_for`)
    shown = shown_endpoint(spec)
    if not 0 < first < 65536:
        raise RequestError(f"endpoint {shown!r}: the port must be 1-65535, got {first}")
    if first + dp_size - 1 > 65535:
        raise RequestError(
            f"endpoint {shown!r}: {dp_size} ranks from port {first} (rank r on port + r) run "
            f"to port {first + dp_size - 1}, past 65535"
        )
    return [f"{scheme}{bound}:{first + r}" for r in range(dp_size)]


def models_from_server_info(info: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The model an SGLang `/server_info` answer serves (`served_model_name`), None if absent."""
    name = info.get("served_model_name")
    return (name,) if isinstance(name, str) and name.strip() else None


def models_from_model_list(answer: object) -> tuple[str, ...] | None:
    """The base models of an OpenAI `/v1/models` list, in its order; None if it is no list.

    Cards with a `parent` are LoRA adapters of that model (SGLang, vLLM) and are left out.
    """
    data = answer.get("data") if isinstance(answer, Mapping) else None
    if not isinstance(data, list):
        return None
    names = [
        card["id"]
        for card in data
        if isinstance(card, Mapping)
        and isinstance(card.get("id"), str)
        and card["id"].strip()
        and card.get("parent") is None
    ]
    return tuple(dict.fromkeys(names))


def adapters_from_model_list(answer: object) -> dict[str, str]:
    """The LoRA adapters of an OpenAI `/v1/models` list: each card with a `parent`, by its id
    (vLLM names an adapter by itself in a request's `model`)."""
    data = answer.get("data") if isinstance(answer, Mapping) else None
    if not isinstance(data, list):
        return {}
    return {
        card["id"]: card["parent"]
        for card in data
        if isinstance(card, Mapping)
        and isinstance(card.get("id"), str)
        and isinstance(card.get("parent"), str)
        and card["id"].strip()
    }


# The largest KV pool, in tokens, a rank's settings may say: 2**40 (about 1.1e12), far past
# any (a GPU's pool holds 10^5-10^7 tokens, a HiCache host tier of terabytes 10^9-10^10), and
# small enough for the forecast's arithmetic (a ratio times a pool of 1e308 was a float
# infinity, and `int()` of it raised). A larger one is taken as unknown, said once per worker.
MAX_CAPACITY_TOKENS = 2**40
# the most requests a rank may say it runs at once (SGLang's max_running_requests stays in the
# thousands)
MAX_RUNNING_REQUESTS = 2**20


def capacity_from_server_info(info: Mapping[str, Any] | None) -> int | None:
    """The KV pool of one rank in tokens (SGLang's `max_total_num_tokens`), None if absent or
    not a whole number of 1 to `MAX_CAPACITY_TOKENS` (`settings_note` says why).

    SGLang reports one scheduler's pool; every data-parallel rank has a pool of that size.
    """
    return _bounded(info.get("max_total_num_tokens"), MAX_CAPACITY_TOKENS) if info else None


def host_capacity_from_server_info(info: Mapping[str, Any] | None) -> int | None:
    """The host tier of one rank in tokens (SGLang's HiCache: `enable_hierarchical_cache`, its
    pool `hicache_ratio` times the device pool, as `mem_cache/kv_cache_builder.py` sizes it in
    0.5.23), None when there is none, it is not said, or it is no finite size of 1 to
    `MAX_CAPACITY_TOKENS` tokens: no host-tier hit is then predicted (fail closed)."""
    if info is None or info.get("enable_hierarchical_cache") is not True:
        return None
    ratio, device = info.get("hicache_ratio"), capacity_from_server_info(info)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or device is None:
        return None
    try:
        # a float product (an infinity past the largest float, never an error), checked
        # before `int()`, which raised on an infinity; an integer ratio past the largest
        # float cannot be made one
        host = float(ratio) * device
    except OverflowError:
        return None
    return int(host) if math.isfinite(host) and 1 <= host <= MAX_CAPACITY_TOKENS else None


def settings_note(info: Mapping[str, Any] | None) -> str | None:
    """What a worker's settings say of its capacity or concurrency that is taken as unknown
    (None: nothing): a number out of range, or not a number (a worker, or what stands in its
    place, may advertise anything). Said once per worker and note
    (`router.fleet.registration_notes`)."""
    if info is None:
        return None
    notes = []
    checks = [
        (
            "max_total_num_tokens",
            MAX_CAPACITY_TOKENS,
            "its KV capacity is unknown (no admission forecast)",
        ),
        ("max_running_requests", MAX_RUNNING_REQUESTS, "its concurrency is unknown"),
    ]
    for key, most, meaning in checks:
        value = info.get(key)
        if value is not None and _bounded(value, most) is None:
            notes.append(f"{key} {_shown(value)} is no whole number of 1 to {most}: {meaning}")
    ratio = info.get("hicache_ratio")
    tiered = info.get("enable_hierarchical_cache") is True and ratio is not None
    if tiered and capacity_from_server_info(info) and host_capacity_from_server_info(info) is None:
        notes.append(
            f"hicache_ratio {_shown(ratio)} makes no host tier of 1 to {MAX_CAPACITY_TOKENS} "
            "tokens: no host-tier hit predicted"
        )
    return "; ".join(notes) or None


def _shown(value: object) -> str:
    """An advertised value quoted in a log line, clipped (an integer may have 4,000 digits)."""
    said = repr(value)
    return said if len(said) <= 40 else f"{said[:40]}..."


def flushes_by_salt(info: Mapping[str, Any] | None) -> bool:
    """Whether the worker's `/flush_cache {"cache_salt": ...}` empties that salt's pages only
    (`flush_cache_by_salt`: the reference workers). SGLang's (0.5.23) takes no salt: it empties
    the whole cache."""
    return info is not None and info.get("flush_cache_by_salt") is True


def max_running_from_server_info(info: Mapping[str, Any] | None) -> int | None:
    """How many requests one rank runs at once (`max_running_requests`), None if absent or
    not a whole number of 1 to `MAX_RUNNING_REQUESTS`."""
    return _bounded(info.get("max_running_requests"), MAX_RUNNING_REQUESTS) if info else None


def caches_prompts_late(engine: str, info: Mapping[str, Any] | None) -> bool:
    """Whether the worker may form a batch after it admitted a request and before it has
    cached that request's whole prompt, so that a request admitted right behind it finds none,
    or only part, of that prompt:
    - SGLang's overlap scheduler forms its next batch before it caches the prompts of the
      prefill running (0.5.23 `event_loop_overlap` calls `get_next_batch_to_run` before
      `process_batch_result`), on unless its server args say `disable_overlap_schedule`;
    - chunked prefill splits a prompt over several batches when it does not fit what is left
      of one batch's token budget (SGLang's `chunked_prefill_size`, -1 for none; vLLM's
      `max_num_batched_tokens`, which nothing advertises), and caches each part as it ends.
    So only an SGLang worker that says it neither overlaps nor chunks (a chunk budget of -1,
    or one no batch can fill: as large as its KV pool) caches each prompt before it batches
    again; anything not said is taken as late (fail closed), vLLM's always."""
    if engine != "sglang" or info is None:
        return True
    if info.get("disable_overlap_schedule") is not True:
        return True
    chunk, pool = info.get("chunked_prefill_size"), capacity_from_server_info(info)
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        return True
    return chunk > 0 and (pool is None or chunk < pool)


def version_from_server_info(info: Mapping[str, Any] | None) -> str | None:
    """The engine version the worker advertises (SGLang's `version`), None if absent: how it
    reads an adapter from a request's `model` depends on it (`router.routing.pool`)."""
    version = info.get("version") if info is not None else None
    return version if isinstance(version, str) and version else None


def streams_for(
    worker: WorkerConfig, info: Mapping[str, Any] | None, model: str | None = None
) -> list[StreamConfig]:
    """The streams of `worker`: its config, completed from its `/server_info` when given.

    `model` is the name its cache is indexed under (default: the config's `model`).
    """
    if not worker.kv_events:
        return []
    adv = engine_spec(worker.engine).advertised_events(info) if info is not None else {}
    host = worker_host(worker.url)
    events = (
        worker.events if worker.events is not None else _endpoints(adv, "endpoints", "endpoint")
    )
    if worker.events is None and adv.get("publisher") not in (None, "zmq"):
        raise RequestError(
            f"worker {worker.worker_id}: its kv_events_config publisher is "
            f"{adv.get('publisher')!r}: it publishes no KV events (routed by load alone; start "
            "it with a zmq publisher, or set kv_events = false)"
        )
    if not isinstance(events, str | list):
        raise RequestError(
            f"worker {worker.worker_id}: no KV-event endpoint configured or advertised"
        )
    replay = (
        worker.replay
        if worker.replay is not None
        else _endpoints(adv, "replay_endpoints", "replay_endpoint")
    )
    advertised_dp = _int(adv.get("dp_size"))
    if advertised_dp is not None and advertised_dp > MAX_DP_SIZE:
        # a rank is a stream, a port and a routing candidate: refused before any per-rank
        # list is built (the worker is routed by load alone, no hit predicted for it)
        raise RequestError(
            f"worker {worker.worker_id}: advertises dp_size {advertised_dp}, over "
            f"{MAX_DP_SIZE}, the most ranks a worker may have: its KV events are not followed"
        )
    if worker.dp_size and advertised_dp and worker.dp_size != advertised_dp:
        # the ranks beyond the config's would go unsubscribed while the engine places requests
        # on them, or requests would name ranks it lacks: no stream is trusted (fail closed)
        raise RequestError(
            f"worker {worker.worker_id}: the config says dp_size {worker.dp_size}, the worker "
            f"advertises {advertised_dp}: fix the config, or leave dp_size out to take the "
            "worker's"
        )
    dp_size = worker.dp_size or advertised_dp or (len(events) if isinstance(events, list) else 1)
    if dp_size > MAX_DP_SIZE:  # an advertised list of endpoints that long
        raise RequestError(
            f"worker {worker.worker_id}: {dp_size} ranks, over {MAX_DP_SIZE}, the most a worker "
            "may have: its KV events are not followed"
        )
    block_size = worker.block_size or _int(adv.get("block_size"))
    if block_size is not None and block_size > MAX_BLOCK_SIZE:
        # an advertised one (a config's is bounded when read, though not one built in code):
        # every key of the worker's pages is chained from it, and 2**64 made each request of
        # its model a 500
        said = "advertises page size" if worker.block_size is None else "has page size"
        raise RequestError(
            f"worker {worker.worker_id}: {said} {block_size}, over "
            f"{MAX_BLOCK_SIZE} tokens, the most kvroute takes: its KV events are not followed "
            "(routed by load alone, no cache hit predicted for it)"
        )
    topic = worker.topic if worker.topic is not None else adv.get("topic")
    base = None if worker.events is not None else _int(adv.get("endpoint_port_base"))
    replay_base = None if worker.replay is not None else _int(adv.get("replay_port_base"))
    live = _per_rank(events, base, dp_size, host)
    replays = _per_rank(
        replay if isinstance(replay, str | list) else None, replay_base, dp_size, host
    )
    for key, endpoints in (("events", live), ("replay", replays)):
        # what the worker advertised (a config's were checked when it was read)
        for endpoint in endpoints:
            if endpoint is not None and (problem := endpoint_problem(endpoint)):
                raise RequestError(
                    f"worker {worker.worker_id}: {key} {shown_endpoint(endpoint)!r}: {problem}"
                )
    return [
        StreamConfig(
            endpoint=endpoint,
            replay_endpoint=replays[rank],
            topic=topic if isinstance(topic, str) else "",
            block_size=block_size,
            engine=worker.engine,
            dp_rank=rank,
            model=worker.model if model is None else model,
        )
        for rank, endpoint in enumerate(live)
        if endpoint is not None
    ]


def _endpoints(adv: Mapping[str, Any], many: str, one: str) -> object:
    """The advertised per-rank endpoint list when there is one, else the rank-0 endpoint."""
    listed = adv.get(many)
    if isinstance(listed, list) and listed and all(isinstance(e, str) for e in listed):
        return listed
    return adv.get(one)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _bounded(value: object, most: int) -> int | None:
    """`value` when it is a whole number of 1 to `most`, else None."""
    got = _int(value)
    return got if got is not None and got <= most else None
