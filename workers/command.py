"""`kvroute worker`: run one reference worker until Ctrl-C, SIGTERM or SIGHUP.

The knobs are shared with `kvroute up` (`add_worker_options`, `config_from_args`), so a fleet
and a single worker are configured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
from collections.abc import Callable
from urllib.parse import urlsplit

import msgspec

from workers.config import DEFAULT_MODEL, WorkerConfig
from workers.errors import PortTakenError, WorkerError
from workers.worker import KvEventsInfo, ReferenceWorker

__all__ = [
    "add_arguments",
    "add_worker_options",
    "at_least",
    "config_from_args",
    "describe_kv_events",
    "run",
    "wait_for_shutdown",
]


def _tcp_endpoint(value: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (host, port); port 0 means ephemeral."""
    parts = urlsplit(value)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT, got {value!r}")
    return parts.hostname, parts.port


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low`, refused in argparse's usage error (which
    names the flag) rather than by the config's validation, which names only the field.

    `kvroute up` takes it from here for its counts too."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """The cache, event and latency knobs every reference worker takes."""
    defaults = WorkerConfig()
    cache = parser.add_argument_group("KV cache")
    cache.add_argument(
        "--page-size",
        type=int,
        default=defaults.page_size,
        help="tokens per KV page (block_size; default %(default)s)",
    )
    cache.add_argument(
        "--capacity-tokens",
        type=int,
        default=defaults.capacity_tokens,
        help="KV pool size per DP rank, in tokens, rounded down to whole pages "
        "(default %(default)s)",
    )
    cache.add_argument(
        "--host-capacity-tokens",
        type=int,
        default=defaults.host_capacity_tokens,
        help="host-memory KV tier per DP rank, in tokens: a write-through copy of the GPU "
        "pages, kept when the GPU evicts them and loaded back on a hit (0 = none; default "
        "%(default)s)",
    )
    cache.add_argument(
        "--dp-size",
        "--dp",
        type=at_least(1),
        default=defaults.dp_size,
        help="data-parallel ranks per worker: one cache, scheduler and event stream each "
        "(rank r publishes on the events port + r); a request names its rank as on SGLang "
        "(default %(default)s)",
    )
    events = parser.add_argument_group("KV events")
    events.add_argument(
        "--event-format",
        choices=["map", "array"],
        default=defaults.event_format,
        help="wire layout of the KV events: map, the tagged maps SGLang >= 0.5.20 publishes "
        "(0.5.23 among them; an adapter's pages carry its lora_name), or array, the 7/8-slot "
        "arrays of SGLang <= 0.5.19 (an adapter's pages carry a made-up lora_id, so a router "
        "predicts no LoRA hit; default %(default)s)",
    )
    events.add_argument(
        "--buffer-steps",
        type=int,
        default=defaults.buffer_steps,
        help="batches kept per stream for replay (default %(default)s)",
    )
    events.add_argument(
        "--buffer-bytes",
        type=int,
        default=defaults.buffer_bytes,
        help="payload bytes kept per stream for replay, at most (default 32 MiB)",
    )
    latency = parser.add_argument_group("latency model")
    latency.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=defaults.prefill_ms_per_token,
        help="prefill cost per uncached prompt token (default %(default)s)",
    )
    latency.add_argument(
        "--host-load-ms-per-token",
        type=float,
        default=defaults.host_load_ms_per_token,
        help="cost of loading a host-tier token back onto the GPU (default %(default)s)",
    )
    latency.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=defaults.decode_ms_per_token,
        help="cost of one decode step, one token for every running request (default %(default)s)",
    )
    latency.add_argument(
        "--time-scale",
        type=float,
        default=defaults.time_scale,
        help="multiplies every simulated duration (0 = as fast as possible; default %(default)s)",
    )
    latency.add_argument(
        "--max-running-requests",
        type=int,
        default=defaults.max_running_requests,
        help="running batch size per DP rank; more requests wait in a queue (default %(default)s)",
    )
    latency.add_argument(
        "--overlap-schedule",
        action="store_true",
        help="form the next batch while a prefill runs, before its prompts are cached, as "
        "SGLang's default overlap scheduler does (advertised in /server_info; default: off)",
    )
    latency.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="waiting queue bound per DP rank, beyond it HTTP 503 (default %(default)s)",
    )
    latency.add_argument(
        "--context-length",
        type=int,
        default=defaults.context_length,
        help="longest prompt + output accepted (default %(default)s)",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument(
        "--transfer-ms-per-token",
        type=float,
        default=defaults.transfer_ms_per_token,
        help="cost of moving one prompt token's KV from a prefill worker to a decode worker "
        "(default %(default)s)",
    )
    pd.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=defaults.kv_transfer_timeout_s,
        help="seconds either side of a KV handoff waits for the other; a prefill then frees "
        "the pages, a decode answers 504 (default %(default)s)",
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="model name the worker reports (default %(default)s)"
    )
    parser.add_argument(
        "--sglang-version",
        default=defaults.version,
        metavar="VERSION",
        help="the SGLang version /server_info reports; it also decides how an OpenAI "
        "request's model names a LoRA adapter (0.5.17-0.5.22: split at the first ':'; "
        "default %(default)s)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute worker`."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="HTTP listen address (default %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=30000, help="HTTP port (0 = ephemeral; default %(default)s)"
    )
    parser.add_argument(
        "--events",
        type=_tcp_endpoint,
        default="tcp://127.0.0.1:5557",  # a string default goes through `type` as well
        metavar="tcp://HOST:PORT",
        help="PUB endpoint of DP rank 0; rank r binds PORT + r (port 0 = ephemeral; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--replay",
        type=_tcp_endpoint,
        default=None,
        metavar="tcp://HOST:PORT",
        help="ROUTER replay endpoint of DP rank 0, on the --events host; rank r binds PORT + r "
        "(default the events port + 100, or + N with --dp-size N over 100; ephemeral when the "
        "events port is)",
    )
    parser.add_argument(
        "--topic", default="", help="topic frame of every published message (default empty)"
    )
    parser.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="prefill/decode disaggregation role (SGLang's --disaggregation-mode; both = null; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=0,
        help="a prefill worker's KV bootstrap port (SGLang's --disaggregation-bootstrap-port; "
        "0 = ephemeral, the default)",
    )
    add_worker_options(parser)


def config_from_args(args: argparse.Namespace, **overrides: object) -> WorkerConfig:
    """A WorkerConfig from parsed options (plus per-command overrides such as ports)."""
    fields: dict[str, object] = {
        "model": args.model,
        "version": args.sglang_version,
        "page_size": args.page_size,
        "capacity_tokens": args.capacity_tokens,
        "host_capacity_tokens": args.host_capacity_tokens,
        "host_load_ms_per_token": args.host_load_ms_per_token,
        "dp_size": args.dp_size,
        "event_format": args.event_format,
        "buffer_steps": args.buffer_steps,
        "buffer_bytes": args.buffer_bytes,
        "prefill_ms_per_token": args.prefill_ms_per_token,
        "decode_ms_per_token": args.decode_ms_per_token,
        "time_scale": args.time_scale,
        "max_running_requests": args.max_running_requests,
        "max_queued_requests": args.max_queued_requests,
        "overlap_schedule": args.overlap_schedule,
        "context_length": args.context_length,
        "transfer_ms_per_token": args.transfer_ms_per_token,
        "kv_transfer_timeout_s": args.kv_transfer_timeout,
    }
    fields.update(overrides)
    try:
        return msgspec.convert(fields, WorkerConfig)
    except msgspec.ValidationError as exc:
        # msgspec names the field (`$.page_size`); the user typed an option
        found = re.search(r"at `\$\.(\w+)`", str(exc))
        if found is None:
            raise
        field = found.group(1)
        flag = _FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))
        raise ValueError(f"{field} ({flag}): {str(exc).split(' - at ')[0]}") from None


# fields whose option is not their name with dashes
_FLAG_OF_FIELD = {
    "kv_transfer_timeout_s": "--kv-transfer-timeout",
    "events_host": "--events",
    "events_port": "--events",
    "replay_port": "--replay",
    "version": "--sglang-version",
}


def describe_kv_events(kv: KvEventsInfo) -> str:
    """One line per DP rank: where its events and replays are."""
    topic = kv.topic or "(empty topic)"
    lines = [
        f"  rank {rank}: events {events}  replay {replay}  topic {topic}"
        for rank, (events, replay) in enumerate(zip(kv.endpoints, kv.replay_endpoints, strict=True))
    ]
    return "\n".join(lines)


async def wait_for_shutdown(*, hangup_stops: bool = False) -> None:
    """Return on SIGINT or SIGTERM (Ctrl-C included), and with `hangup_stops` on SIGHUP too.

    A lone worker stops on SIGHUP (its terminal hung up) the way it stops on Ctrl-C, closing
    its sockets and saying so, where the default action ended it without a word.

    The handlers stay until the event loop closes: a signal after the first (Ctrl-C again while
    the worker closes) is said once and ignored, as `kvroute serve` ignores it. Before, they
    were removed at the first: the second ended the process by its default action, with a
    traceback (SIGINT) or none (SIGTERM). (`kvroute up` has its own, from its first instant:
    `router.commands.stopping`.)"""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    said_again = False

    def on_signal(sig: signal.Signals) -> None:
        nonlocal said_again
        if not stop.is_set():
            if sig is signal.SIGHUP:
                _hung_up()
            stop.set()
        elif not said_again:
            said_again = True
            print(
                f"{sig.name} again: already stopping (requests in flight are let finish); ignored",
                file=sys.stderr,
                flush=True,
            )

    signals = [signal.SIGINT, signal.SIGTERM]
    if hangup_stops:
        signals.append(signal.SIGHUP)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    await stop.wait()


def _hung_up() -> None:
    print(
        "SIGHUP: stopping (a reference worker has no config to reload; run it under nohup or "
        "a service manager to keep it past its terminal)",
        file=sys.stderr,
        flush=True,
    )


async def _serve(config: WorkerConfig) -> None:
    async with ReferenceWorker(config) as worker:
        print(f"reference worker {config.model} at {worker.url}", flush=True)
        print(describe_kv_events(worker.kv_events), flush=True)
        if worker.disagg.bootstrap_port is not None:
            print(f"  {config.role}: KV bootstrap port {worker.disagg.bootstrap_port}", flush=True)
        elif config.role != "both":
            print(f"  {config.role}: fetches KV from its prefill workers", flush=True)
        print("Ctrl-C to stop", flush=True)
        await wait_for_shutdown(hangup_stops=True)
    print("stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    """Run one worker until interrupted."""
    events_host, events_port = args.events
    if args.replay is not None:
        if args.replay[0] != events_host:
            print("kvroute worker: --replay must use the --events host", file=sys.stderr)
            return 2
        replay_port = args.replay[1]
    else:
        replay_port = _default_replay_port(events_port, args.dp_size)
    clash = _own_port_clash(events_port, replay_port, args.dp_size)
    if clash:
        print(f"kvroute worker: {clash}", file=sys.stderr)
        return 2
    try:
        config = config_from_args(
            args,
            host=args.host,
            port=args.port,
            events_host=events_host,
            events_port=events_port,
            replay_port=replay_port,
            topic=args.topic,
            role=args.role,
            bootstrap_port=args.bootstrap_port,
        )
        asyncio.run(_serve(config))
    except PortTakenError as exc:
        flag = "--port" if exc.port == args.port else "--bootstrap-port"
        print(
            f"kvroute worker: {exc}: choose another {flag} (0 picks a free one), or stop what "
            "holds it",
            file=sys.stderr,
        )
        return 2
    except (msgspec.ValidationError, ValueError, WorkerError, OSError) as exc:
        print(f"kvroute worker: {exc}", file=sys.stderr)
        return 2
    return 0


def _default_replay_port(events_port: int, ranks: int) -> int:
    """The replay port of rank 0 when `--replay` is left out: 100 ports above the events port,
    or as many as there are ranks when that is more, so the two ranges never overlap (with
    `--dp-size` 600 the default was in the events' range, refused as a clash); ephemeral when
    the events port is."""
    return events_port + max(100, ranks) if events_port else 0


def _own_port_clash(events_port: int, replay_port: int, ranks: int) -> str:
    """Why the ranks' event and replay ports (rank r on each base + r) overlap, or "".

    The bind of the second range failed as if another process held the port ("cannot bind
    ...: Address already in use"), where it was this worker's own socket of the first."""
    if not events_port or not replay_port or abs(events_port - replay_port) >= ranks:
        return ""
    port = max(events_port, replay_port)
    return (
        f"--events port {events_port} and --replay port {replay_port} overlap with --dp "
        f"{ranks}: DP rank r publishes on {events_port} + r and replays on {replay_port} + r, "
        f"so port {port} would be both DP rank {port - events_port}'s events and DP rank "
        f"{port - replay_port}'s replay socket; leave --replay out (the default, "
        f"{_default_replay_port(events_port, ranks)}) or start it at least {ranks} ports away "
        "from --events"
    )
