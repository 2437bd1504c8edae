"""`kvroute record`: capture KV-event streams to a file; `kvroute record inspect FILE` reads one.

Recording subscribes exactly like the router's indexer (same `StreamSubscriber`, so gaps are
repaired by replay and restarts detected the same way) and writes every message it accepts, in
the order it is applied, through the subscriber's raw sink: replayed batches are flagged, and
malformed payloads are kept byte for byte. Each record reaches the OS as it arrives, so Ctrl-C,
SIGTERM, SIGHUP, `--duration`, `--max-bytes` or a crash never lose what was written (SIGTERM and
SIGHUP stop it as Ctrl-C does: an open compressed chunk is closed, the summary printed, the exit
status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import errno
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from indexer.config import MAX_BLOCK_SIZE, StreamConfig, endpoint_problem, shown_endpoint
from indexer.engines import ENGINES, engine_spec
from indexer.errors import IndexerError, ProtocolError
from indexer.fingerprint import salt_fingerprint
from indexer.protocol.decode import decode_batch
from indexer.protocol.events import Cleared, Removed, Stored, Unreadable
from indexer.recording.capture import Capture, CaptureStats, capture
from indexer.recording.format import Record, RecordingReader, RecordingWriter, RecordMark, Source
from indexer.recording.replay import replay_into_index
from indexer.subscriptions import stream_id
from router.commands.replay import print_summary, stdout_closed
from router.errors import RouterError

if TYPE_CHECKING:
    from router.config import WorkerConfig

__all__ = ["add_arguments", "record", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute record` and its `inspect` sub-verb."""
    # argparse's own usage ends in `ACTION ...`, which reads as a required word: recording
    # takes none, and `inspect` is the one sub-verb
    parser.usage = (
        "%(prog)s (--config FILE | --endpoint tcp://HOST:PORT) --out FILE [options]\n"
        "       %(prog)s inspect FILE [--events | --json] [--show-salts]"
    )
    parser.add_argument("--config", type=Path, help="record every worker of a router TOML config")
    parser.add_argument("--endpoint", help="PUB endpoint of one stream (tcp://HOST:PORT)")
    parser.add_argument("--replay", help="its replay ROUTER endpoint (gap repair)")
    parser.add_argument("--topic", default="", help="subscription prefix (default: everything)")
    parser.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="sglang",
        help="the engine publishing at --endpoint: how its events and replay socket are read "
        "(default sglang)",
    )
    parser.add_argument("--block-size", type=int, help="the stream's page size, when known")
    parser.add_argument("--model", default="", help="served model name (the index namespace)")
    parser.add_argument(
        "--worker",
        default="worker",
        help="worker id of --endpoint: its stream is recorded as ID#dp0 (default worker)",
    )
    parser.add_argument("--out", type=Path, help="recording file to write")
    parser.add_argument("--append", action="store_true", help="continue an existing recording")
    parser.add_argument("--compress", action="store_true", help="zlib chunks (flushed every 1 s)")
    parser.add_argument(
        "--duration",
        type=float,
        help="stop after this many seconds (default: none, until Ctrl-C, SIGTERM or SIGHUP)",
    )
    parser.add_argument(
        "--max-bytes", type=int, help="stop once the file holds this many bytes (default: none)"
    )
    sub = parser.add_subparsers(
        dest="record_action", metavar="[inspect]", title="sub-verb", prog=parser.prog
    )
    inspect = sub.add_parser(
        "inspect",
        help="summarize a recording (optional: without it, record)",
        description=_INSPECT_HELP,
    )
    inspect.add_argument("file", type=Path, help="a recording made by `kvroute record`")
    inspect.add_argument(
        "--events",
        action="store_true",
        help="print every decoded event and the subscriber's clear / forget-seq marks, in "
        "order (not with --json)",
    )
    inspect.add_argument(
        "--show-salts",
        action="store_true",
        help="print cache_salt values in --events (else their fingerprints)",
    )
    inspect.add_argument(
        "--json",
        action="store_true",
        help="print the summary as JSON (not with --events: one stdout would not parse as JSON)",
    )


_INSPECT_HELP = "A recording's header, streams and what replaying it builds; --events lists them."


def run(args: argparse.Namespace) -> int:
    """Record, or inspect a recording."""
    try:
        if getattr(args, "record_action", None) == "inspect":
            return _inspect(args, sys.stdout)
        return _record(args)
    except BrokenPipeError:  # `| head`: its reader has all it wanted
        return stdout_closed()


def _record(args: argparse.Namespace) -> int:
    if args.out is None:
        print("kvroute record: --out FILE is required", file=sys.stderr)
        return 2
    try:
        sources = _sources(args)
    except (RouterError, IndexerError, ValueError, OSError) as exc:
        print(f"kvroute record: {exc}", file=sys.stderr)
        return 2
    try:
        writer = (
            RecordingWriter.append(args.out, sources, compress=args.compress)
            if args.append
            else RecordingWriter.create(args.out, sources, compress=args.compress)
        )
    except IndexerError as exc:  # exists, locked by another writer, another stream's source
        print(f"kvroute record: {exc}", file=sys.stderr)
        return 2
    if args.max_bytes is not None and writer.bytes_written >= args.max_bytes:
        # the limit is checked as records are written: it would stop after the first one
        writer.close()
        if not args.append:
            args.out.unlink()
        print(
            f"kvroute record: --max-bytes {args.max_bytes}: {args.out} holds "
            f"{writer.bytes_written:,} bytes before any record",
            file=sys.stderr,
        )
        return 2
    if writer.cut is not None:
        cut = writer.cut
        print(
            f"kvroute record: cut {writer.cut_bytes:,} bytes of a damaged tail at byte "
            f"{cut.offset:,} ({cut.reason}) before appending",
            file=sys.stderr,
        )
    progress = sys.stdout.isatty()

    def ready() -> None:
        print(
            f"recording {len(sources)} stream(s) to {args.out} (Ctrl-C to stop)",
            file=sys.stderr,
            flush=True,
        )

    stats = asyncio.run(
        record(
            writer,
            sources,
            duration_s=args.duration,
            max_bytes=args.max_bytes,
            progress=progress,
            on_ready=ready,
        )
    )
    try:
        _print_done(args.out, writer, stats, sys.stdout)
        if stats.error:
            print(f"kvroute record: {stats.error}", file=sys.stderr)
        sys.stdout.flush()
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        # the terminal hung up (SIGHUP's cause): nobody is left to read the summary, and the
        # file is complete (closed as the capture ended), so this is no failure
        _terminal_gone()
    return 1 if stats.error else 0


def _terminal_gone() -> None:
    """Send stdout and stderr nowhere: the interpreter's last flush would fail on them again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (sys.stdout.fileno(), sys.stderr.fileno()):
        os.dup2(devnull, fd)
    os.close(devnull)


def _sources(args: argparse.Namespace) -> list[Source]:
    if (args.config is None) == (args.endpoint is None):
        raise ValueError("give exactly one of --config FILE or --endpoint tcp://...")
    for flag, endpoint in (("--endpoint", args.endpoint), ("--replay", args.replay)):
        if endpoint is not None and (problem := endpoint_problem(endpoint)):
            raise ValueError(f"{flag} {shown_endpoint(endpoint)!r}: {problem}")
    for flag, limit in (("--duration", args.duration), ("--max-bytes", args.max_bytes)):
        if limit is not None and not limit > 0:
            raise ValueError(f"{flag} {limit}: must be > 0")
    if args.block_size is not None and not 0 < args.block_size <= MAX_BLOCK_SIZE:
        # StreamConfig's bound is only checked when decoding, not when built here
        raise ValueError(f"--block-size {args.block_size}: must be 1-{MAX_BLOCK_SIZE}")
    if args.endpoint is not None:
        return [
            Source(
                stream=stream_id(args.worker, 0),
                endpoint=args.endpoint,
                replay_endpoint=args.replay,
                topic=args.topic,
                engine=args.engine,
                block_size=args.block_size,
                model=args.model,
                worker=args.worker,
            )
        ]
    sources, skipped = _config_sources(args.config)
    for worker, why in skipped.items():
        # a capture records the streams it starts with: a worker down now is left out, said
        # once and not asked again (another `kvroute record` takes it once it answers)
        print(
            f"kvroute record: worker {worker} is NOT recorded (skipped, not retried): {why}",
            file=sys.stderr,
        )
    return sources


def _config_sources(path: Path) -> tuple[list[Source], dict[str, str]]:
    """Every KV-event stream of a router config (asking the worker for what it omits), and
    why each worker that could not be asked was not (by id: its streams are not recorded).

    Each stream is recorded under the model the router would index it under, read the way
    the router's supervisor reads it (`router.fleet.worker_settings`), so a replay of the file
    names the same namespaces as the router does. A worker that does not answer is skipped,
    not fatal: an incident is when one is down, and the others are what there is to record;
    only a config none of whose streams can be recorded is refused."""
    from router.config import load_config

    config = load_config(path)
    sources, skipped = asyncio.run(_discover(config.workers))
    if not sources:
        if skipped:
            raise ValueError("; ".join(f"worker {w}: {why}" for w, why in skipped.items()))
        raise ValueError(f"{path}: no worker publishes KV events")
    return sources, skipped


async def _discover(workers: Sequence[WorkerConfig]) -> tuple[list[Source], dict[str, str]]:
    import aiohttp

    from router.fleet.discovery import needs_discovery, streams_for
    from router.fleet.worker_settings import read_served_models, read_server_info

    sources: list[Source] = []
    skipped: dict[str, str] = {}
    async with aiohttp.ClientSession() as session:
        for worker in workers:
            if not worker.kv_events:
                continue
            spec = engine_spec(worker.engine)
            try:
                info = None
                if needs_discovery(worker):
                    info = await read_server_info(session, worker.url, spec, timeout_s=5.0)
                models = await read_served_models(session, worker, spec, info, timeout_s=5.0)
                streams = streams_for(worker, info, model=models[0] if models else "")
            except RouterError as exc:  # the worker, not the config: named with its id
                # streams_for's words name it already
                skipped[worker.worker_id] = str(exc).removeprefix(f"worker {worker.worker_id}: ")
                continue
            sources.extend(_source(worker.worker_id, s) for s in streams)
    return sources, skipped


def _source(worker: str, s: StreamConfig) -> Source:
    return Source(
        stream=stream_id(worker, s.dp_rank),
        endpoint=s.endpoint,
        replay_endpoint=s.replay_endpoint,
        topic=s.topic,
        engine=s.engine,
        block_size=s.block_size,
        dp_rank=s.dp_rank,
        model=s.model,
        worker=worker,
    )


async def record(
    writer: RecordingWriter,
    sources: Sequence[Source],
    *,
    duration_s: float | None = None,
    max_bytes: int | None = None,
    progress: bool = False,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[], None] | None = None,
) -> CaptureStats:
    """Capture `sources` (`indexer.recording.capture`) until a limit, `stop`, Ctrl-C, SIGTERM
    (what a service manager or `kill` sends) or SIGHUP (the terminal hung up): the same clean
    stop as Ctrl-C for each, so an open compressed chunk reaches the file."""
    loop = asyncio.get_running_loop()
    live: list[_Progress] = []

    def ready(running: Capture) -> None:
        for sig, reason in _STOP_SIGNALS.items():
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, running.stop_by, reason)
        if progress:
            live.append(_Progress(running))
        if on_ready is not None:
            on_ready()

    def tick(running: Capture) -> None:
        for shown in live:
            shown.update()

    try:
        return await capture(
            writer,
            sources,
            duration_s=duration_s,
            max_bytes=max_bytes,
            stop=stop,
            on_ready=ready,
            on_tick=tick,
        )
    finally:
        for sig in _STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        for shown in live:
            shown.close()


# SIGHUP too: a terminal's hangup (an ssh session's end) is how a long capture often ends, and
# its default action would lose the open compressed chunk and the summary
_STOP_SIGNALS = {signal.SIGINT: "ctrl-c", signal.SIGTERM: "sigterm", signal.SIGHUP: "sighup"}


class _Progress:
    """A rich live table of events/s, bytes and gaps (only on a terminal)."""

    def __init__(self, running: Capture) -> None:
        from rich.live import Live

        self._writer = running.writer
        self._service = running
        self._started = time.monotonic()
        self._last = (self._started, 0)
        self._live = Live(self._render(0.0), refresh_per_second=4, transient=False)
        self._live.start()

    def _render(self, rate: float) -> Any:
        from rich.table import Table

        table = Table(title=f"recording to {self._writer.path}")
        for column in ("stream", "batches", "events", "gaps", "replays", "restarts", "errors"):
            table.add_column(column)
        for st in self._service.streams():
            table.add_row(
                st.stream,
                str(st.batches),
                str(st.events),
                str(st.gaps),
                str(st.replays),
                str(st.restarts),
                str(st.decode_errors),
            )
        elapsed = time.monotonic() - self._started
        table.caption = (
            f"{self._writer.messages} records  {self._writer.bytes_written:,} bytes  "
            f"{rate:,.0f} events/s  {elapsed:.0f} s"
        )
        return table

    def update(self) -> None:
        now = time.monotonic()
        events = sum(st.events for st in self._service.streams())
        then, before = self._last
        rate = (events - before) / (now - then) if now > then else 0.0
        self._last = (now, events)
        self._live.update(self._render(rate))

    def close(self) -> None:
        # its last frame, to a terminal that may have hung up (EIO): the summary says the rest
        with contextlib.suppress(OSError):
            self._live.stop()


def _print_done(path: Path, writer: RecordingWriter, stats: CaptureStats, out: TextIO) -> None:
    # messages, as inspect and replay count them; the subscriber's marks apart (before, they
    # were counted as records: 317 here, 315 there after a restart's two marks)
    marks = f" and {stats.marks} subscriber marks (clear / forget-seq)" if stats.marks else ""
    out.write(
        f"recorded {stats.records} records{marks} ({writer.messages} records in the file, "
        f"{writer.bytes_written:,} bytes) to {path} in {stats.seconds:.1f} s; "
        f"stopped by {stats.stopped_by or 'end'}\n"
    )
    for stream, counters in stats.streams.items():
        out.write(f"  {stream}: " + "  ".join(f"{k} {v}" for k, v in counters.items()) + "\n")


# ------------------------------------------------------------------------------- inspect


def _inspect(args: argparse.Namespace, out: TextIO) -> int:
    if args.events and args.json:
        # one stdout cannot hold both and stay parseable JSON
        print("kvroute record inspect: --events and --json do not go together", file=sys.stderr)
        return 2
    try:
        with RecordingReader(args.file) as reader:
            header = reader.header
            if args.events:
                _print_events(reader, out, show_salts=args.show_salts)
            else:
                # streams an append added are declared along the file, not in its header
                collections.deque(reader, maxlen=0)
            # by stream id, as the summary's streams and the ports of `kvroute replay --publish`
            sources = {stream: reader.sources[stream] for stream in sorted(reader.sources)}
        summary, _ = replay_into_index(args.file)
    except BrokenPipeError:
        raise  # stdout, not the file: `run` ends quietly
    except (OSError, IndexerError) as exc:
        print(f"kvroute record inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"header": header, "sources": list(sources.values()), "summary": summary}
        out.write(msgspec.json.encode(doc).decode() + "\n")
        return 1 if summary.damaged else 0
    out.write(
        f"kvroute recording, format version {header.format_version}, created "
        f"{_utc(header.created_unix_s, '%Y-%m-%dT%H:%M:%S+00:00')} by {header.tool}\n"
    )
    out.write("sources:\n")
    for s in sources.values():
        # none given when it was recorded: the stream's pages say it (the summary's line),
        # and "None" here beside that number read as a contradiction (QA)
        size = "not set (learned from its pages)" if s.block_size is None else s.block_size
        out.write(
            f"  {s.stream}: {s.engine} {s.endpoint or '-'} replay {s.replay_endpoint or '-'} "
            f"topic {s.topic!r} block size {size} dp rank {s.dp_rank} "
            f"model {s.model or '-'}\n"
        )
    print_summary(summary, out)
    return 1 if summary.damaged else 0


def _utc(unix_s: float, form: str) -> str:
    """`unix_s` in UTC as `form`; the number itself when no date has it (a hand-made file's
    NaN or 1e20 is shown, not a crash)."""
    try:
        return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime(form)
    except (OverflowError, ValueError, OSError):
        return repr(unix_s)


def _salt(salt: str | None, show: bool) -> str:
    if salt is None:
        return "-"
    return repr(salt) if show else salt_fingerprint(salt)


def _event_salt(event: Stored, show: bool) -> str:
    """SGLang's cache_salt, or vLLM's extra_keys[0] (salt, or lora name and salt)."""
    if event.cache_salt is not None or not event.extra_keys or not event.extra_keys[0]:
        return _salt(event.cache_salt, show)
    keys = event.extra_keys[0]
    shown = [repr(k) if show else salt_fingerprint(str(k)) for k in keys]
    return "extra_keys[0]=[" + ", ".join(shown) + "]"


def _mark_line(r: Record, has_seq: bool) -> str:
    """A mark's line: what the subscriber decided there, and after which seq (`has_seq`:
    a message of the stream came before it, since the last forget; a mark's own seq 0 also
    means none)."""
    where = f"after seq {r.seq}" if has_seq else "no seq yet"
    if r.mark is RecordMark.CLEAR:
        return f"MARK CLEAR ({where}): the subscriber dropped the stream's entries here"
    return (
        f"MARK FORGET SEQ ({where}): the subscriber forgot the stream's seq and fence here "
        "(a restart: it rebuilds from the next seq)"
    )


def _print_events(reader: RecordingReader, out: TextIO, *, show_salts: bool) -> None:
    # marks too, in file order: a clear the seqs do not show is otherwise invisible here,
    # yet the replay summarized below drops the stream's entries at it
    with_seq: set[str] = set()
    for positioned in reader.records(marks=True):
        r = positioned.record
        when = _utc(r.recv_time, "%H:%M:%S.%f")
        if r.mark:
            out.write(f"#{positioned.number} {when} {r.stream} ")
            out.write(_mark_line(r, r.stream in with_seq) + "\n")
            if r.mark is RecordMark.FORGET_SEQ:
                with_seq.discard(r.stream)
            continue
        with_seq.add(r.stream)
        flag = (" replayed, run start" if r.run_start else " replayed") if r.replayed else ""
        out.write(
            f"#{positioned.number} {when} {r.stream} seq {r.seq} topic {r.topic!r}{flag} "
            f"({len(r.payload)} bytes)\n"
        )
        try:
            batch = decode_batch(r.payload)
        except ProtocolError as exc:
            out.write(f"    MALFORMED: {exc}\n")
            continue
        for event in batch.events:
            if isinstance(event, Stored):
                out.write(
                    f"    BlockStored {len(event.block_hashes)} pages x {event.block_size} "
                    f"parent {event.parent!r} first {event.block_hashes[:1]} "
                    f"lora {event.lora_name or event.lora_id} medium {event.medium} "
                    f"salt {_event_salt(event, show_salts)}\n"
                )
            elif isinstance(event, Removed):
                out.write(f"    BlockRemoved {len(event.block_hashes)} pages {event.medium}\n")
            elif isinstance(event, Cleared):
                out.write("    AllBlocksCleared\n")
            elif isinstance(event, Unreadable):
                out.write(
                    f"    {event.kind} {len(event.block_hashes)} pages UNREADABLE "
                    f"(forgotten): {event.reason}\n"
                )
        if batch.skipped:
            out.write(f"    ({batch.skipped} events of unknown kinds skipped)\n")
    if reader.damage is not None:
        d = reader.damage
        out.write(f"STOPPED at byte {d.offset} (record {d.record}): {d.kind}: {d.reason}\n")
