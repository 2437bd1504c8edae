"""Every knob of one reference worker, validated by type at the boundary."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from indexer.protocol.encode import WireLayout

__all__ = ["DEFAULT_MODEL", "WorkerConfig", "WorkerRole"]

# SGLang's --disaggregation-mode, with "both" for its "null": one worker runs the whole request
WorkerRole = Literal["both", "prefill", "decode"]

DEFAULT_MODEL = "kvroute/reference-byte-lm"

_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]
_NonNegative = Annotated[float, msgspec.Meta(ge=0)]


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One reference worker: its cache, its event streams, its latency model, its ports.

    Ports of 0 are ephemeral (the bound ones are reported by the running worker). With
    `dp_size > 1`, rank r publishes on `events_port + r` and replays on `replay_port + r`;
    ephemeral bases are chosen so the whole run of ports is free.
    """

    model: str = DEFAULT_MODEL
    # Simulated SGLang version string reported by /server_info and /get_server_info; it also
    # says how an OpenAI request's `model` names a LoRA adapter (0.5.17-0.5.22 split it at the
    # first ":", 0.5.23 after the served name: `io_struct.parse_model_parameter`)
    version: str = "0.5.23-kvroute"
    host: str = "127.0.0.1"
    port: _Port = 0
    # KV-event streams (ZMQ PUB + ROUTER replay), bound on `events_host`.
    events_host: str = "127.0.0.1"
    events_port: _Port = 0
    replay_port: _Port = 0
    topic: str = ""
    # SGLang 0.5.23's layout (tagged maps, an adapter by its `lora_name`); "array" is what
    # SGLang <= 0.5.19 publishes, where an adapter is only a number no request names
    event_format: WireLayout = "map"
    # Batches kept for replay per stream (SGLang's default buffer_steps).
    buffer_steps: _Positive = 10_000
    # ...and their payload bytes at most (workers.replay_ring: SGLang bounds only the count)
    buffer_bytes: _Positive = 32 << 20
    dp_size: _Positive = 1
    # The paged KV pool of each DP rank.
    page_size: _Positive = 16
    capacity_tokens: _Positive = 131_072
    # Optional host tier per DP rank (SGLang HiCache's host pool): evicted GPU pages move there
    # and are loaded back on a hit at host_load_ms_per_token. 0: no host tier.
    host_capacity_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Latency model: a prefill step costs prefill_ms_per_token per uncached prompt token; a
    # decode step (one token for every running request) costs decode_ms_per_token.
    prefill_ms_per_token: _NonNegative = 0.05
    host_load_ms_per_token: _NonNegative = 0.01
    decode_ms_per_token: _NonNegative = 10.0
    # Multiplies every simulated duration: 0 runs as fast as the event loop allows (tests).
    time_scale: _NonNegative = 1.0
    max_running_requests: _Positive = 32
    max_queued_requests: _Positive = 4096
    # Longest prompt + output accepted (SGLang's context length).
    context_length: _Positive = 32_768
    # Prefill/decode disaggregation (`workers.disagg`): a prefill worker computes the prompt,
    # holds its pages and serves them on its bootstrap port (SGLang's
    # --disaggregation-bootstrap-port; 0 = ephemeral); a decode worker fetches them, paying
    # transfer_ms_per_token per page token moved, then decodes. Either side gives up on its
    # partner after kv_transfer_timeout_s (the prefill frees the pages, the decode answers 504).
    role: WorkerRole = "both"
    bootstrap_port: _Port = 0
    transfer_ms_per_token: _NonNegative = 0.002
    kv_transfer_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # `POST /flush_cache {"cache_salt": ...}` empties that salt's pages only (advertised as
    # `flush_cache_by_salt` in /server_info); false: it empties the whole cache, as SGLang's
    # (0.5.23: its /flush_cache takes no salt), and says nothing
    flush_by_salt: bool = True
    # SGLang's overlap scheduler (on unless `--disable-overlap-schedule`): the next batch is
    # formed while a prefill batch runs, before that batch's prompts are cached, so a request
    # admitted right behind its sibling finds none of the sibling's prompt. Off here by default
    # (advertised as `disable_overlap_schedule` in /server_info, which the router reads)
    overlap_schedule: bool = False

    def __post_init__(self) -> None:
        # msgspec checks Meta constraints only when decoding; direct construction needs these.
        for name in ("port", "events_port", "replay_port", "bootstrap_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a port number (0 = ephemeral)")
        for name in (
            "buffer_steps",
            "buffer_bytes",
            "dp_size",
            "page_size",
            "capacity_tokens",
            "max_running_requests",
            "max_queued_requests",
            "context_length",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.host_capacity_tokens < 0:
            raise ValueError("host_capacity_tokens must be >= 0")
        for name in (
            "prefill_ms_per_token",
            "host_load_ms_per_token",
            "decode_ms_per_token",
            "transfer_ms_per_token",
            "time_scale",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.capacity_tokens < self.page_size:
            raise ValueError("capacity_tokens must hold at least one page")
        if self.dp_size > 1 and self.events_port and self.events_port + self.dp_size > 65536:
            raise ValueError("events_port + dp_size runs past port 65535")
        if self.dp_size > 1 and self.replay_port and self.replay_port + self.dp_size > 65536:
            raise ValueError("replay_port + dp_size runs past port 65535")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError("role must be 'both', 'prefill' or 'decode'")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError("kv_transfer_timeout_s must be > 0")
        if self.event_format not in ("array", "map"):
            raise ValueError("event_format must be 'array' or 'map'")

    @property
    def total_pages(self) -> int:
        """Pages in each rank's pool."""
        return self.capacity_tokens // self.page_size
