"""The router's configuration: TOML validated into frozen msgspec structs.

Every table rejects unknown keys by name (`forbid_unknown_fields`), so a typo such as
`[policy] decode_wieght` fails at startup instead of silently using a default. Every field has
a default, so `RouterConfig(workers=(WorkerConfig(url=...),))` is a complete config in code
(the benchmarks start one router per policy that way).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

from indexer.config import (
    MAX_BLOCK_SIZE,
    MAX_DP_SIZE,
    endpoint_problem,
    ranks_problem,
    shown_endpoint,
)
from indexer.engines import EngineName, PdRole
from indexer.index.media import MEDIUM_ORDER
from router.errors import ConfigError

__all__ = [
    "ADMIN_TOKEN_ENV",
    "MAX_CONFIG_BYTES",
    "MAX_WORKER_ID_LEN",
    "QUERY_TOKEN_ENV",
    "AdminConfig",
    "BreakerConfig",
    "ClusterConfig",
    "FieldError",
    "HealthConfig",
    "IndexerSection",
    "LimitsConfig",
    "ListenConfig",
    "LiveConfig",
    "ObserveConfig",
    "PdConfig",
    "PolicyConfig",
    "PolicyName",
    "QueryConfig",
    "RouterConfig",
    "TimeoutsConfig",
    "TokenizerConfig",
    "TracingConfig",
    "WorkerConfig",
    "load_config",
    "parse_config",
    "read_config_file",
    "redact_url",
    "shown_worker_id",
    "worker_id_problem",
]

ADMIN_TOKEN_ENV = "KVROUTE_ADMIN_TOKEN"
QUERY_TOKEN_ENV = "KVROUTE_QUERY_TOKEN"

PolicyName = Literal["kv", "round_robin", "random", "least_load", "approx_tree"]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class FieldError(ValueError):
    """A table's own check (`__post_init__`) refused one of its fields: `parse_config` adds
    `field` to the path msgspec names (the table's), so the key a refused reload answers with
    is `workers[2].url`, not `workers[2]`. To any other reader (`POST /admin/workers`) it is
    the ValueError it always was."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ListenConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the router's HTTP server listens (port 0 picks a free port)."""

    host: str = "127.0.0.1"
    port: Port = 8000
    # a second port on `host` serving GET /metrics only (None: none). Under `kvroute serve
    # --processes N` process i serves it on metrics_port + i: each is a scrape target of its
    # own, where the shared port's /metrics answers from whichever process took the connection
    metrics_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None

    def __post_init__(self) -> None:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise FieldError(
                "metrics_port",
                f"listen.metrics_port {self.metrics_port} is listen.port: give it a port of its "
                "own",
            )


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which routing policy runs, and its weights."""

    name: PolicyName = "kv"
    seed: int = 0
    # kv: score = hit_weight * cached prefix tokens - (queued prefill tokens + decode_weight *
    # running requests); a running decode costs about as much as this many prefill tokens.
    # A hit is worth more than the prefill it saves right now: sending a prefix elsewhere also
    # copies it into a second cache, evicting other tenants' pages under KV pressure. At 1.0
    # the routing benchmark (docs/benchmarks/routing.md, kv_default vs kv) lost a third of the
    # oracle's hit rate to load noise; 4.0 stays within a few percent of the oracle.
    hit_weight: NonNegativeFloat = 4.0
    decode_weight: NonNegativeFloat = 32.0
    # a decode step's time in prefill tokens (the engine's time per output token over its
    # prefill time per prompt token): a running request holds its place in the batch for its
    # output tokens times this. A request sent to a (worker, rank) that runs as many requests
    # as its `max_running_requests` waits in its queue until places free: (the requests in
    # flight there beyond that limit, and itself) / the limit x a request's run, in prefill
    # tokens, counted in its load and, by `kv`, taken off the hit it would find there
    # (`router.routing.policy`). 200: the reference worker's (a 10 ms step, 0.05 ms per
    # prompt token); set it to your engine's
    decode_step_weight: NonNegativeFloat = 200.0
    # prefix blocks held off-GPU save less work (they must be loaded back first); both
    # engines' spellings (vLLM: CPU, STORAGE; SGLang HiCache: CPU_PINNED, DISK, EXTERNAL). A
    # medium not listed here earns nothing: kvroute cannot know what loading it back costs
    medium_weights: dict[str, NonNegativeFloat] = msgspec.field(
        default_factory=lambda: {
            "GPU": 1.0,
            "CPU": 0.5,
            "CPU_PINNED": 0.5,
            "DISK": 0.25,
            "STORAGE": 0.25,
            "EXTERNAL": 0.1,
        }
    )
    # admission-time prediction (router.routing.admission): discount a worker's match by what
    # it must evict before it admits the request (its max_total_num_tokens against what it
    # holds and what the requests queued ahead of this one must allocate, least recently used
    # first). Off: the raw match counts, as when a worker's capacity is unknown
    admission: bool = True
    # output tokens an in-flight request that names no output limit is assumed to generate
    # when forecasting evictions (requests that name one count their own:
    # `router.prompt.output_limit`)
    admission_reserve_tokens: Annotated[int, msgspec.Meta(ge=0)] = 16
    # whether the forecast also discounts the hit a worker is scored by (else it only changes
    # the reported prediction: x-kvroute-matched-tokens, /admin/route, the queued-load estimate)
    admission_scoring: bool = False
    # a request sent to a rank where nothing waits to be answered, but requests decode, is
    # admitted when the current decode step ends: about this long (the router cannot see
    # steps). Until then a request sent after it would run in its batch and not find the
    # blocks it brings. Longer fails safe: fewer such hits predicted
    admission_batch_window_ms: NonNegativeFloat = 20.0
    # hold a request in the router while the (worker, rank) it would go to has no KV room to
    # admit it: the uncached prompts and outputs of the requests in flight there, and its own,
    # would not fit the rank's max_total_num_tokens. It is routed once that rank frees room
    # or another one becomes the better choice, on what the index says then (the worker
    # would have queued it anyway; the router decides later, and knows better). A prefill/
    # decode pair is held for its prefill side; a rank whose capacity is unknown never holds
    hold_until_room: bool = False
    # the share of each in-flight request's output limit `hold_until_room` counts as allocated
    # (the new request's own counts whole). 1: the whole limit, as the reference worker
    # reserves it. SGLang reserves `new_token_ratio` of what a running request may still
    # generate (0.7 at start, decaying to about 0.1 while nothing is retracted), so with
    # long output limits a lower share keeps the router from counting a worker full that
    # SGLang still fills; 0 counts only the prompts
    hold_output_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    # eviction-aware placement (router.routing.eviction_cost): score -= eviction_weight * the
    # tokens of reused blocks, held by no other worker, that the request's own allocation
    # would evict there (0: off)
    eviction_weight: NonNegativeFloat = 0.0
    # room before reuse (router.routing.planner `_forecast`): score -= room_weight * the tokens
    # the request's own allocation (its uncached prompt and output) would evict there, used
    # or not. Where every pool is full it is nearly the same for every candidate (it adds
    # room_weight to the weight of a hit); where some have room, a prefix a page or two long
    # no longer pulls every new prompt onto the one full pool that holds it (0: off)
    room_weight: NonNegativeFloat = 0.5
    # learn decode_weight (the running requests' cost in prefill tokens) from observed time to
    # first token of streamed answers sent with no whole answer queued ahead (router.routing.
    # balance; a whole answer's first byte comes after its decode), the configured value as
    # the prior, worth this many samples; bounded to [decode_weight / 4, decode_weight * 4]
    balance_learning: bool = False
    balance_prior_samples: NonNegativeFloat = 20.0
    # approx_tree mirrors sglang-router 0.3.2's cache_aware policy, with its defaults: out of
    # balance (max - min requests in flight > approx_balance_abs and max > approx_balance_rel x
    # min), the least loaded worker; else the longest past-routing match when it covers more
    # than approx_cache_threshold of the prompt; else the worker with the smallest tree. Every
    # approx_eviction_interval_s (0: never) each worker's part of the tree is cut to
    # approx_max_tree_size tokens (SGLang: characters), least recently used leaves first.
    approx_cache_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    approx_balance_abs: Annotated[int, msgspec.Meta(ge=0)] = 64
    approx_balance_rel: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    approx_eviction_interval_s: NonNegativeFloat = 60.0
    approx_max_tree_size: Annotated[int, msgspec.Meta(ge=1)] = 2**26

    def __post_init__(self) -> None:
        for tier, weight in self.medium_weights.items():
            if tier not in MEDIUM_ORDER:
                # a misspelled tier would earn nothing, silently
                raise FieldError(
                    "medium_weights",
                    f"policy.medium_weights: unknown tier {tier!r} (the engines' tiers: "
                    f"{', '.join(MEDIUM_ORDER)})",
                )
            if not math.isfinite(weight):
                raise FieldError(
                    f"medium_weights.{tier}",
                    f"policy.medium_weights.{tier} must be a finite number",
                )
        for name in (
            "hit_weight",
            "decode_weight",
            "decode_step_weight",
            "eviction_weight",
            "room_weight",
        ):
            if not math.isfinite(getattr(self, name)):
                raise FieldError(name, f"policy.{name} must be a finite number")


class PdConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Prefill/decode pairs: how the decode worker is chosen (`router.routing.pd`).

    The prefill worker is chosen by `[policy]` over the model's prefill workers. The decode
    worker by load: `decode_weight` per running request plus `decode_kv_weight` per token of
    KV its running requests hold (a decode's memory fills with their prompts), against
    `hit_weight` per prompt token it already holds where decode workers publish KV events.
    """

    decode_kv_weight: NonNegativeFloat = 0.02


DEFAULT_OFFLOAD_MIN_BYTES = 8192  # tokenizer.offload_min_bytes when unset (kind = "hf")


class TokenizerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the router turns text into token ids (must match the workers' tokenizer)."""

    kind: Literal["byte", "hf"] = "byte"
    path: str = ""  # tokenizer.json, when kind = "hf"
    # How chat messages become prompt text; it must be the template the engine uses.
    # "": auto. With kind = "hf": the model's template beside `path` (chat_template.jinja, else
    #     tokenizer_config.json's chat_template), falling back to kvroute's with a warning.
    #     With kind = "byte": kvroute's (what the reference workers use).
    # "kvroute": kvroute's built-in template.
    # a path: a tokenizer_config.json, or a .jinja file (special tokens then come from the
    #     tokenizer_config.json beside `path`, else beside the .jinja file).
    chat_template: str = ""
    # whose OpenAI layer to mirror when rendering: how list-of-parts content is flattened
    # (SGLang joins text parts with a space for string templates, vLLM with a newline) and how
    # `tools`, `tool_choice`, `chat_template_kwargs` and `reasoning_effort` reach the template
    chat_engine: EngineName = "sglang"
    # kind = "hf" only: request bodies of at least this many bytes are parsed and tokenized on
    # one of `offload_threads` threads, off the event loop (router.prompt.offload); 0: never;
    # unset: 8192 (about 2,000 tokens) with kind = "hf". Measured by `kvroute bench tokenize`,
    # see docs/router.md "Tokenizing off the loop"
    offload_min_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    offload_threads: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2

    def __post_init__(self) -> None:
        if self.kind == "hf" and not self.path:
            raise FieldError("path", "tokenizer.path is required when tokenizer.kind = 'hf'")
        if self.kind == "byte" and self.offload_min_bytes:  # 0 and unset are fine
            raise FieldError(
                "offload_min_bytes",
                "tokenizer.offload_min_bytes needs tokenizer.kind = 'hf' (the byte tokenizer "
                "is Python and holds the GIL: a thread would only add a hop)",
            )

    def offload_bytes(self) -> int:
        """The body size from which requests are parsed on a thread; 0: never."""
        if self.kind != "hf":
            return 0
        return (
            DEFAULT_OFFLOAD_MIN_BYTES if self.offload_min_bytes is None else self.offload_min_bytes
        )


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _token_problem(key: str, token: str) -> str | None:
    """Why `token` could never match a client's `Authorization: Bearer TOKEN` (whose value is
    read without the spaces around it, `router.http.bearer`), which would lock the API it
    guards out, silently; None when it can. The token itself is never said."""
    if token and not token.strip():
        problem = "is only whitespace"
    elif token != token.strip():
        problem = "begins or ends with whitespace"
    elif _CONTROL.search(token):
        problem = "holds a control character"
    else:
        return None
    return (
        f"{key} {problem}: no request's `Authorization: Bearer ...` could carry it - at `$.{key}`"
    )


class AdminConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The admin API under /admin."""

    enabled: bool = True
    token: str = ""  # or $KVROUTE_ADMIN_TOKEN; without either, admin only binds on loopback
    # key of the namespace fingerprints shown instead of salts; empty: random per process
    fingerprint_key: str = ""


class TimeoutsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Deadlines of the upstream hop."""

    request_s: PositiveFloat = 300.0
    connect_s: PositiveFloat = 2.0


class HealthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Periodic health checks of every worker."""

    interval_s: PositiveFloat = 2.0
    timeout_s: PositiveFloat = 1.0
    path: str = "/health"
    # a healthy worker whose KV-event streams come from its `/server_info` has it read again
    # this often, its streams looking fine or not (0: never): a pod replaced behind its URL
    # while the old one runs on is caught without traffic (`RereadSchedule.settings_due`)
    settings_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0


class BreakerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The per-worker circuit breaker."""

    failure_threshold: Annotated[int, msgspec.Meta(ge=1)] = 3
    cooldown_s: PositiveFloat = 5.0


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Bounds on what one request may cost the router."""

    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16 * 1024 * 1024
    # an index snapshot loaded through POST /admin/index/load (admin token): about 19 bytes
    # an entry, so 16 MiB would refuse the router's own dump of a million-entry index
    max_snapshot_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1024 * 1024 * 1024
    max_retries: Annotated[int, msgspec.Meta(ge=0)] = 2
    # a body nesting deeper is a 400; kept far below Python's recursion limit (~1000) so nothing
    # that walks a body recursively (msgspec, Jinja's tojson, the engines' parsers) can fail
    max_json_depth: Annotated[int, msgspec.Meta(ge=8, le=512)] = 128
    # a cache_salt (body, salt header or admin input) longer than this is a 400
    max_salt_bytes: Annotated[int, msgspec.Meta(ge=1)] = 256
    # a LoRA adapter name (lora_path, a model's adapter, the query API's lora) longer than
    # this is a 400: Linux's PATH_MAX, as a name is at most a path (`check_adapter_name`)
    max_adapter_name_bytes: Annotated[int, msgspec.Meta(ge=1)] = 4096
    # requests held at once for a worker with room (`policy.hold_until_room`); beyond this the
    # oldest held one is routed at once (the worker queues it) and the new one held in its
    # place (0: none is held). A held request's deadline is its timeouts.request_s, as anywhere
    max_held_requests: Annotated[int, msgspec.Meta(ge=0)] = 1024
    # open client connections; one more gets a 503 (lowered to what RLIMIT_NOFILE can hold
    # beside the KV-event streams' share: `router.http.listener.connection_cap`)
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 1024
    # a keep-alive connection with no request for this long is closed (above the 60 s idle
    # timeout of common load balancers, so they never reuse a connection the router closed)
    idle_timeout_s: PositiveFloat = 75.0
    # a request's headers must be complete this long after its first byte (a new connection's
    # first request: after the connect; one that sent nothing by then is closed), else 408
    header_timeout_s: PositiveFloat = 10.0
    # a request's body must be complete this long after its headers, else 408
    body_timeout_s: PositiveFloat = 60.0
    # refused clients (malformed requests, timeouts, the connection cap) are logged at most
    # once per interval, with a count of the lines held back
    refusal_log_interval_s: PositiveFloat = 10.0


class IndexerSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Options passed to the KV-event indexer."""

    pending_ttl_s: PositiveFloat = 2.0
    stale_after_s: PositiveFloat = 30.0
    replay_timeout_s: PositiveFloat = 1.0
    # a quiet stream asks its replay socket for anything newer (and proves its epoch) this
    # often; 0 disables the probe
    probe_interval_s: NonNegativeFloat = 2.0
    # a busy stream asks its replay socket for a live batch it applied this often (the check
    # that shows a forwarder re-pointed at another worker: `IndexerConfig`); no off
    live_check_interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 1.0
    # each SUB socket's queue in messages (0: unbounded); what overflows it is dropped by ZMQ
    # and shows as a gap, repaired from the replay socket
    rcv_hwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000
    # at most one log line per stream and kind of problem this often (0: every one)
    log_interval_s: NonNegativeFloat = 10.0
    # a subscriber that failed is restarted after a backoff that doubles up to this
    restart_backoff_max_s: PositiveFloat = 5.0


class TracingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """OpenTelemetry tracing (`router.http.tracing`); the OTEL_* variables fill what is empty."""

    enabled: bool = False  # also on when OTEL_TRACES_EXPORTER names an exporter
    exporter: Literal["", "otlp", "console", "memory", "none"] = ""  # "": $OTEL_TRACES_EXPORTER
    service_name: str = ""  # "": $OTEL_SERVICE_NAME, else "kvroute"
    # share of new traces recorded (a request continuing a client's trace follows its flag);
    # $OTEL_TRACES_SAMPLER wins when set
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0


class ObserveConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The per-request operations layer (`router.http.observe`): decision metrics, the recent
    decisions, `x-request-id` and traces."""

    # false: none of it (the benchmarks' baseline for what it costs); the request counters and
    # the duration histogram of /metrics stay (time to first token is the statistics')
    enabled: bool = True


class QueryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The KV query API for other gateways (`POST /v1/kv/query`), with a token of its own."""

    # served when it has a token, or the router listens on loopback only (else off, with a
    # warning: the index says which prompts are cached where, not for anyone to ask)
    enabled: bool = True
    token: str = ""  # or $KVROUTE_QUERY_TOKEN


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One worker; everything but `url` can be discovered from its `/server_info`."""

    url: str
    id: str = ""  # defaults to the url
    # the rank-0 PUB endpoint ("tcp://host:port"; rank r is port + r) or one endpoint per rank
    events: str | list[str] | None = None
    replay: str | list[str] | None = None
    engine: EngineName = "sglang"  # its wire, discovery and chat rules: indexer.engines
    # tokens per KV page, at most 2**16 (`indexer.protocol.wire.MAX_BLOCK_SIZE`: why)
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)] | None = None
    # data-parallel ranks, at most 1024 (`indexer.config.MAX_DP_SIZE`: why)
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_DP_SIZE)] | None = None
    topic: str | None = None
    # The model this worker serves: requests go only to workers of the model their body names
    # (a fleet serving one model takes any name). "" and no `models`: discovered from the
    # worker's /server_info (served_model_name) or /v1/models when it registers.
    model: str = ""
    # further names it answers to (vLLM serves several --served-model-name); its KV events are
    # indexed under its first name (`model`, else models[0]): one engine, one cache
    models: tuple[str, ...] = ()
    kv_events: bool = True  # false: a plain backend, routed without cache affinity
    # prefill/decode disaggregation: what it does in a pair ("both": whole requests). Unset:
    # as its /server_info advertises (SGLang's disaggregation_mode), else "both"
    role: PdRole | None = None
    # a prefill's KV bootstrap port (SGLang's --disaggregation-bootstrap-port, told to the
    # decode side); unset: advertised, else the engine's default (SGLang 8998)
    bootstrap_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None

    def __post_init__(self) -> None:
        if not self.url.lower().startswith(("http://", "https://")):
            raise FieldError(
                "url", f"workers.url must start with http:// or https://, got {self.url!r}"
            )
        scheme, rest = self.url.split("://", 1)
        if scheme != scheme.lower():  # schemes are case-insensitive (RFC 3986): one spelling
            msgspec.structs.force_setattr(self, "url", f"{scheme.lower()}://{rest}")
        authority = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
        if "@" in authority or ("@" in rest and not _port_parses(self.url)):
            # a password may hold a "/", which leaves part of it as a path and the rest as a
            # port that does not parse: that is credentials too (an "@" in a path is not)
            # the router sends no credentials from a url, and the url would show (as the
            # worker's id, in metric labels, in logs): refused before anything quotes it
            raise FieldError(
                "url",
                f"workers.url {redact_url(self.url)!r} carries credentials (user:password@): "
                "the router does not send them, and would show them as the worker's id, in "
                "logs and metrics",
            )
        # checked here so a bad url is a 400 on POST /admin/workers, not a 500 from discovery
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 - parsing the port is the check
        except ValueError as exc:
            raise FieldError("url", f"workers.url {self.url!r}: {exc}") from None
        if not parts.hostname:
            raise FieldError("url", f"workers.url {self.url!r} names no host")

        self._check_id()
        if any(not name.strip() for name in self.models):
            raise FieldError("models", "workers.models: a model name must not be empty")
        for key, given in (("events", self.events), ("replay", self.replay)):
            for endpoint in [given] if isinstance(given, str) else given or ():
                if problem := endpoint_problem(endpoint):
                    raise FieldError(key, f"workers.{key} {shown_endpoint(endpoint)!r}: {problem}")
        self._check_ranks()
        if self.bootstrap_port is not None and self.role not in ("prefill", None):
            raise FieldError(
                "bootstrap_port", "workers.bootstrap_port is a prefill worker's (role = 'prefill')"
            )

    def _check_ranks(self) -> None:
        """`dp_size` ranks on the rank-0 endpoints given (rank r on port + r), checked when
        read: a 400 on POST /admin/workers, before discovery builds a list of them."""
        if self.dp_size is None:
            return
        for key, given in (("events", self.events), ("replay", self.replay)):
            if isinstance(given, str) and (problem := ranks_problem(given, self.dp_size)):
                raise FieldError(
                    "dp_size", f"workers.dp_size with {key} {shown_endpoint(given)!r}: {problem}"
                )

    def _check_id(self) -> None:
        """Refuse a worker id the router cannot carry (`worker_id_problem`): the `id` given,
        else the url it defaults to. A url's control characters are refused with an `id`
        too: they would split its log lines, and `urlsplit` drops tabs and newlines, so the
        url connected to would not be the url written."""
        if bad := _CONTROL.search(self.url):
            raise FieldError(
                "url",
                f"workers.url {redact_url(self.url)!r} holds a control character "
                f"(U+{ord(bad.group()):04X}), which no url has",
            )
        if self.id:
            if problem := worker_id_problem(self.id):
                raise FieldError("id", f"workers.id {shown_worker_id(self.id)} {problem}")
        elif problem := worker_id_problem(self.worker_id):
            raise FieldError(
                "url",
                f"workers.url {shown_worker_id(redact_url(self.url))}, the worker's id "
                f"without an `id`, {problem}: give the worker an `id` of printable ASCII (or "
                "write the url in its ASCII form: an xn-- host, a %-escaped path)",
            )

    @property
    def served_models(self) -> tuple[str, ...]:
        """The names the config says this worker serves, its cache's first; () = discover."""
        return tuple(dict.fromkeys((self.model, *self.models) if self.model else self.models))

    @property
    def worker_id(self) -> str:
        """The id the router and the admin API use for this worker."""
        return self.id or self.url.rstrip("/")

    @property
    def server(self) -> tuple[str, str, int | None, str]:
        """The server `url` names, spelled one way (`HTTP://A:80/` is `http://a`,
        `http://localhost:1` is `http://127.0.0.1:1`): two entries of one server would make it
        two routing candidates, each with half its load."""
        parts = urlsplit(self.url)
        port = parts.port
        if port == {"http": 80, "https": 443}.get(parts.scheme.lower()):
            port = None
        host = _one_spelling(parts.hostname or "")
        return (parts.scheme.lower(), host, port, parts.path.rstrip("/"))


# a character of a worker id that is not printable ASCII (U+0020-U+007E); a control character
# (C0, DEL, C1)
_NOT_PRINTABLE_ASCII = re.compile(r"[^\x20-\x7e]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# the longest worker id, in characters (bytes: an id is ASCII). Room for any url a worker
# has (a Kubernetes service's full name is under 160 characters), and small beside every
# limit an id meets on its way out: %-escaped in an admin path at most 768 bytes of
# aiohttp's 8190-byte request line; its NATS fleet key (base64) 342 characters of
# nats-server's 4 KiB control line beside the longest subject prefix and a reply inbox;
# in the x-kvroute-worker header (the pair headers carry two) well inside the 4-8 KiB a
# reverse proxy keeps for an answer's headers (nginx's proxy_buffer_size). Before, there was
# no bound: a 3,100-character id closed a replica's NATS connection for good (the server
# refused the line), and one of 9,000 could be neither drained nor removed, its answers
# unreadable to aiohttp clients
MAX_WORKER_ID_LEN = 256
_SHOWN_ID = 64  # an id quoted in a message is clipped to this


def worker_id_problem(worker_id: str) -> str | None:
    """Why `worker_id` cannot be a worker's id, None when it can: an id is 1 to 256
    (`MAX_WORKER_ID_LEN`) printable ASCII characters (U+0020-U+007E), neither beginning nor
    ending with a space.

    It is sent as it is in the `x-kvroute-worker` answer header (and the pair headers), where
    a control character (C0, DEL, C1) is refused by aiohttp, which made every answer of the
    worker a 500 after it ran, and a CR/LF would end the header; it is written in log lines,
    which a newline would split. A non-ASCII character is no control character, but HTTP
    carries only ASCII in a header (RFC 9110: other bytes are opaque, latin-1 to most
    clients), so a client would read another id than the admin API's: refused too, rather
    than encoded into a second spelling of the id. A header's value loses its leading and
    trailing spaces (RFC 9110 5.5), so `"a "` reached clients as `a`, and a blank id as
    nothing. Its length: `MAX_WORKER_ID_LEN`."""
    if not worker_id.strip(" "):
        return "is blank: a worker id is 1 to 256 printable ASCII characters"
    if len(worker_id) > MAX_WORKER_ID_LEN:
        return (
            f"is {len(worker_id)} characters long: a worker id is at most {MAX_WORKER_ID_LEN}, "
            "as it travels in answer headers, admin paths and the cluster's NATS keys"
        )
    bad = _NOT_PRINTABLE_ASCII.search(worker_id)
    if bad is not None:
        code = ord(bad.group())
        kind = "a control character" if _CONTROL.match(bad.group()) else "a non-ASCII character"
        return (
            f"holds {kind} (U+{code:04X}): a worker id is printable ASCII (U+0020-U+007E), as "
            "it is sent in the x-kvroute-worker answer header and written in log lines"
        )
    if worker_id != worker_id.strip(" "):
        return (
            "begins or ends with a space, which the x-kvroute-worker answer header drops: "
            "clients would read another id"
        )
    return None


def shown_worker_id(worker_id: str) -> str:
    """`worker_id` quoted for a message (repr: no control character of it gets through),
    clipped to 64 characters with its length said: a refused 9,000-character id would
    otherwise fill the log line and the error answer."""
    if len(worker_id) <= _SHOWN_ID:
        return repr(worker_id)
    return f"{worker_id[:_SHOWN_ID]!r}... ({len(worker_id)} characters)"


def _one_spelling(host: str) -> str:
    """`host` spelled one way where its spelling alone says what it is: an IP literal in its
    compressed form (`[0:0::1]` is `::1`), `localhost` as 127.0.0.1 (RFC 6761: it is the
    loopback; the IPv4 one is where a worker on it listens). No other name is resolved: it
    would block validation on DNS, tie it to the resolver's answer of the moment, and two
    names of one address may be two servers (virtual hosts behind one proxy); a worker that
    is another's server under a name is told apart at registration by its KV-event stream
    (status `duplicate`, sent nothing)."""
    host = host.lower().removesuffix(".")
    if host == "localhost":
        return "127.0.0.1"
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


def _port_parses(url: str) -> bool:
    try:
        urlsplit(url).port  # noqa: B018 - parsing the port is the check
    except ValueError:
        return False
    return True


def redact_url(url: str) -> str:
    """`url` without its user-info (`nats://***@host:4222`): a NATS URL may carry a user and
    password, or a token in the user's place, and logs, stdout and error answers are read by
    more people than the config file is. Everything up to the last `@` goes, so a password
    holding an unescaped `/` or `@` is hidden too (`indexer.config.shown_endpoint`)."""
    return shown_endpoint(url)


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Router replicas that agree through NATS (`router.cluster`); absent: one replica alone."""

    # the NATS server(s) every replica connects to ("nats://host:4222"), JetStream enabled
    url: str | list[str] = "nats://127.0.0.1:4222"
    # first token of every subject, and of the JetStream buckets' names: replicas with the same
    # prefix are one router, so two fleets can share a NATS server under two prefixes
    subject_prefix: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = "kvroute"
    # how often a replica says it is alive (and which of its requests are in flight), and how
    # long the others wait for it before its in-flight load stops counting
    heartbeat_interval_s: PositiveFloat = 1.0
    heartbeat_timeout_s: PositiveFloat = 3.0
    # at start, how long to wait for NATS, the shared fleet and the warm start before serving
    # on local state (degraded, resyncing when NATS answers)
    startup_timeout_s: PositiveFloat = 5.0
    # how often the oldest live replica publishes the index snapshot new replicas start from;
    # 0: never (new replicas then start cold and catch up from the workers' replay)
    snapshot_interval_s: NonNegativeFloat = 60.0
    # the shortest time between two of this replica's decision messages: a decision made
    # sooner after the last message waits that long for the ones after it, and they go as one
    # (each message is a socket write here and at every receiver, the cost that dominates a
    # replica's share of the cluster under load); an idle replica's next decision goes at once.
    # It adds at most this much to the propagation delay; 0 sends every loop turn's decisions
    publish_interval_s: Annotated[float, msgspec.Meta(ge=0.0, le=0.1)] = 0.0005
    # this replica's name among the others; "": host-pid-random, new at every start
    replica_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{0,64}$")] = ""
    # where a replica reads the workers' KV events: "zmq", from each worker's sockets (every
    # replica subscribes to every worker); "relay", from the JetStream stream `kvroute relay`
    # writes (one subscription per worker in all, repaired and proven by the relay)
    events: Literal["zmq", "relay"] = "zmq"
    # how long, and up to how many bytes, the relay's stream keeps records: a replica that
    # falls further behind (or starts from an older snapshot) rebuilds the streams it missed
    # (JetStream refuses a max age under 100 ms; under a few heartbeats nothing could follow)
    relay_max_age_s: Annotated[float, msgspec.Meta(ge=10.0)] = 900.0
    relay_max_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 1 << 30

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise FieldError(
                "heartbeat_timeout_s",
                "cluster.heartbeat_timeout_s must be longer than cluster.heartbeat_interval_s "
                "(a live replica would expire between two heartbeats)",
            )
        urls = [self.url] if isinstance(self.url, str) else self.url
        if not urls or any(not u.startswith(("nats://", "tls://")) for u in urls):
            raise FieldError(
                "url", f"cluster.url must be nats:// or tls:// URL(s), got {self.shown_servers!r}"
            )
        for url in urls:
            shown = redact_url(url)
            # the NATS client refuses these only inside the cluster's connect task, where the
            # failure surfaced as a cancelled startup with no word of the URL
            if "," in url:
                raise FieldError(
                    "url", f"cluster.url {shown!r}: several servers go in a list, not a string"
                )
            try:
                parts = urlsplit(url)
                parts.port  # noqa: B018 - parsing the port is the check
            except ValueError as exc:
                # urlsplit quotes what it took for the port: with user-info, that can be a
                # piece of the password (one holding an unescaped "/")
                said = str(exc) if "@" not in url else "its host or port does not parse"
                raise FieldError("url", f"cluster.url {shown!r}: {said}") from None
            if not parts.hostname:
                raise FieldError("url", f"cluster.url {shown!r} names no host")

    @property
    def servers(self) -> list[str]:
        """The NATS URLs as a list."""
        return [self.url] if isinstance(self.url, str) else list(self.url)

    @property
    def shown_servers(self) -> list[str]:
        """The NATS URLs as logs and messages may show them: without user-info."""
        return [redact_url(url) for url in self.servers]


_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]*")  # RFC 9110 token ("": none)


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole router configuration (one TOML file)."""

    listen: ListenConfig = ListenConfig()
    policy: PolicyConfig = PolicyConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    admin: AdminConfig = AdminConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    health: HealthConfig = HealthConfig()
    breaker: BreakerConfig = BreakerConfig()
    limits: LimitsConfig = LimitsConfig()
    indexer: IndexerSection = IndexerSection()
    pd: PdConfig = PdConfig()
    tracing: TracingConfig = TracingConfig()
    query: QueryConfig = QueryConfig()
    observe: ObserveConfig = ObserveConfig()
    # header whose value overrides the body's cache_salt (set by a trusted gateway); "" = none
    salt_header: str = ""
    workers: tuple[WorkerConfig, ...] = ()
    # several replicas as one router (NATS); None: this replica alone
    cluster: ClusterConfig | None = None
    # `kvroute up` only: the embedded fleet, validated by the workers package
    fleet: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not _HEADER_NAME.fullmatch(self.salt_header):
            # a name no request can carry: the trusted gateway's override would never apply
            raise ValueError(
                f"salt_header {self.salt_header!r} is not an HTTP header name (RFC 9110: "
                "letters, digits and !#$%&'*+-.^_`|~, no spaces or colon) - at `$.salt_header`"
            )
        # here, not in their tables: msgspec would add the table's path to the key a refused
        # reload names (`admin`, not `admin.token`)
        for key, token, env in (
            ("admin.token", self.admin.token, ADMIN_TOKEN_ENV),
            ("query.token", self.query.token, QUERY_TOKEN_ENV),
        ):
            if problem := _token_problem(key, token):
                raise ValueError(problem)
            # the variable stands in for an empty key: held to the same rule (a whitespace-only
            # one locked the API out as silently)
            if not token and (problem := _token_problem(f"${env}", os.environ.get(env, ""))):
                raise ValueError(problem.split(" - at ")[0] + f" (it stands in for {key})")
        # the key is spelled as msgspec spells a nested one (`_error_key` reads it back), so a
        # refused reload names it; the id may be the URL (no `id` given): then `url` is the key
        ids: dict[str, int] = {}
        for i, worker in enumerate(self.workers):
            first = ids.setdefault(worker.worker_id, i)
            if first != i and not worker.id and not self.workers[first].id:
                # each one's id is its url: one url listed twice, which "duplicate id" hid
                raise ValueError(
                    f"workers[{first}] and workers[{i}] are one url "
                    f"({shown_worker_id(redact_url(worker.url))}, no id given: the url is the "
                    f"id): list it once (several dp ranks: dp_size) - at `$.workers[{i}].url`"
                )
            if first != i:
                field = "id" if worker.id else "url"
                raise ValueError(
                    f"workers: duplicate id {worker.worker_id!r} (workers[{first}] has it "
                    f"already) - at `$.workers[{i}].{field}`"
                )
        seen: dict[tuple[str, str, int | None, str], int] = {}
        for i, worker in enumerate(self.workers):
            first = seen.setdefault(worker.server, i)
            if first != i:
                other = self.workers[first].worker_id
                spelt = self.workers[first].url
                urls = worker.url if spelt == worker.url else f"{spelt} and {worker.url}"
                raise ValueError(
                    f"workers {other!r} and {worker.worker_id!r} are one server ({urls}): "
                    f"list it once (several dp ranks: dp_size) - at `$.workers[{i}].url`"
                )

    def admin_token(self) -> str:
        """The admin bearer token: the config's, else $KVROUTE_ADMIN_TOKEN, else ''."""
        return self.admin.token or os.environ.get(ADMIN_TOKEN_ENV, "")

    def query_token(self) -> str:
        """The KV query API's bearer token: the config's, else $KVROUTE_QUERY_TOKEN, else ''."""
        return self.query.token or os.environ.get(QUERY_TOKEN_ENV, "")


class LiveConfig:
    """The config the router runs on now: a reload (`router.http.reload`) replaces it whole,
    so a reader takes `current` once per request and sees one consistent config."""

    def __init__(self, config: RouterConfig) -> None:
        self.current = config


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`")


def _error_key(message: str) -> str | None:
    """The dotted key a msgspec validation message points at (`policy.hit_weight`)."""
    at = _AT.search(message)
    path = at.group(1) if at else ""
    unknown = _UNKNOWN.match(message)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    return path or None


def parse_config(data: dict[str, Any], *, source: str = "config") -> RouterConfig:
    """Validate a decoded TOML document into a RouterConfig (ConfigError names the key)."""
    try:
        return msgspec.convert(data, RouterConfig)
    except msgspec.ValidationError as exc:
        message = str(exc)
        key = _error_key(message)
        refused = exc.__cause__  # what a table's own check raised (msgspec chains it)
        if isinstance(refused, FieldError):
            # msgspec's path is the table's (`workers[2]`): the field is the key
            key = f"{key}.{refused.field}" if key else refused.field
            message = f"{refused} - at `$.{key}`"
        raise ConfigError(f"{source}: {message}", key=key) from exc


# far above any real config (a fleet of thousands of workers is a few hundred kilobytes): a
# bound on what a path that is no config (a log, a device behind a symlink) makes the router read
MAX_CONFIG_BYTES = 16 * 1024 * 1024

_NOT_A_FILE = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def read_config_file(path: str | Path, *, reloading: bool = False) -> bytes:
    """The bytes of the config file at `path`, read once (ConfigError saying why not).

    Only a regular file of at most `MAX_CONFIG_BYTES` is read, checked on the opened file
    itself (a symlink is followed, to what it points at now). Before, anything was read to its
    end: a FIFO at the path blocked the reading thread, the router's event loop on a reload,
    until some process wrote to it; `/dev/zero` was read until the kernel killed the router. The
    open does not block either (`O_NONBLOCK`: a FIFO's open waits for a writer without it).

    An empty file is refused: read again for a running router (`reloading`) it is more likely
    a file caught mid-save, and applying it would drop every worker; at a start it is no
    router to run (before, one started on 127.0.0.1:8000 with no workers, every request a 503,
    and nothing said why). The file is read once and these bytes are what is parsed: before,
    the check read it, then the parser read it again, and a save that emptied the file between
    the two applied it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _NOT_A_FILE.get(stat.S_IFMT(mode), "of an unknown type")
            raise ConfigError(f"{path}: is {kind}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, MAX_CONFIG_BYTES + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_CONFIG_BYTES:
                raise ConfigError(
                    f"{path}: larger than {MAX_CONFIG_BYTES} bytes ({MAX_CONFIG_BYTES >> 20} "
                    "MiB), the most a config file may be: is this the config?"
                )
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if not data.strip():
        raise ConfigError(f"{path} is empty{_why_settings_needed(reloading)}")
    return data


def _why_settings_needed(reloading: bool) -> str:
    """Why a file without a setting is refused, said after what it lacks."""
    if reloading:
        return " (caught while being written?): applied, it would drop every worker"
    return (
        ": a config gives at least the workers to route to ([[workers]]) or where to listen "
        "([listen]); configs/ has examples"
    )


def load_config(path: str | Path, *, reloading: bool = False) -> RouterConfig:
    """Read and validate a TOML config file (`reloading`: see `read_config_file`; a file of
    comments and empty tables only is refused as an empty one is)."""
    data = read_config_file(path, reloading=reloading)
    return _parse_toml(data, source=str(path), reloading=reloading)


# no kvroute setting nests more than three tables deep (`[[workers]]` > `lora` > a name): a
# document past this is no config, and anything that walks it recursively (the settings check,
# a reload's comparison, an encoder) would end in a RecursionError rather than a refusal
MAX_CONFIG_DEPTH = 32


def _holds_a_setting(table: dict[str, Any], *, source: str) -> bool:
    """Whether a parsed TOML document holds a key with a value, in itself or a table under it;
    ConfigError naming the key when tables or arrays nest past `MAX_CONFIG_DEPTH`.

    Iterative: a 3,000-part dotted key (`a.a.a... = 1`, which tomllib reads without
    recursing) made the recursive walk raise a RecursionError, a 500 to `POST /admin/reload`
    and a traceback from `kvroute serve`."""
    holds = False
    # (value, its trail, its depth); a trail is (the parent's trail, a key or an array index),
    # a link per value rather than a path copied into each
    pending: list[tuple[object, _Trail, int]] = [(table, None, 0)]
    while pending:
        value, trail, depth = pending.pop()
        if depth > MAX_CONFIG_DEPTH:
            path = _key_path(trail)
            raise ConfigError(
                f"{source}: `{_clipped_key(path)}` nests more than {MAX_CONFIG_DEPTH} tables or "
                "arrays deep, far past any kvroute setting: is this the config?",
                key=str(path[0]),
            )
        if isinstance(value, dict):
            pending.extend((v, (trail, k), depth + 1) for k, v in value.items())
        else:
            holds = True
            if isinstance(value, list):
                pending.extend((v, (trail, i), depth + 1) for i, v in enumerate(value))
    return holds


_Trail = tuple["_Trail", str | int] | None


def _key_path(trail: _Trail) -> list[str | int]:
    """The keys and array indexes from the document down to the value of `trail`."""
    path: list[str | int] = []
    while trail is not None:
        trail, part = trail
        path.append(part)
    return path[::-1]


def _clipped_key(path: list[str | int]) -> str:
    """A key path as TOML dots it (array items as `[i]`), its middle left out when long."""
    if len(path) > 5:
        return f"{_dotted(path[:3])} ... {_dotted(path[-1:])}"
    return _dotted(path)


def _dotted(path: list[str | int]) -> str:
    """`path` as TOML writes a key: dotted, array items as `[i]`."""
    said = ""
    for part in path:
        if isinstance(part, int):
            said += f"[{part}]"
        else:
            said += f".{part}" if said else part
    return said


def _parse_toml(data: bytes, *, source: str, reloading: bool = False) -> RouterConfig:
    """Validate the bytes of a TOML config file (`source`: its path, for the messages). A
    document without a single key is refused, as an empty file is (`reloading`: read again, a
    save caught after its opening comments, applied, would drop every worker)."""
    try:
        parsed = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        # TOML is UTF-8 by definition; a file saved as UTF-16 or Latin-1 must not escape as a
        # traceback (serve) or a 500 (a reload), so it is refused like any invalid file
        bad = exc.object[exc.start]
        raise ConfigError(
            f"{source}: not UTF-8 text (byte 0x{bad:02x} at offset {exc.start}); "
            "TOML files must be UTF-8"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
    except RecursionError as exc:
        # tomllib recurses once per nested array or inline table: a few hundred (`x = [[[...`)
        # exhaust the stack, which escaped as a 500 (a reload) or a traceback (serve)
        raise ConfigError(
            f"{source}: invalid TOML: arrays or inline tables nest too deep to read "
            f"(a config nests at most {MAX_CONFIG_DEPTH}): is this the config?"
        ) from exc
    if not _holds_a_setting(parsed, source=source):
        # table headers with no key under them say as little as comments (`[listen]` alone: a
        # save caught after its first line)
        raise ConfigError(
            f"{source} has no settings, only comments or empty tables"
            + _why_settings_needed(reloading)
        )
    return parse_config(parsed, source=source)
