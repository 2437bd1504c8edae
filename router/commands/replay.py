"""`kvroute replay FILE`: a recording into an in-memory index, or republished on PUB sockets.

`--into index` (default) decodes and applies as fast as possible and prints what the router
would have known; `--publish tcp://HOST:PORT` plays the streams to a live router at the recorded
pace (`--speed`), with optional faults, each clear mark as an `AllBlocksCleared` batch.
`--from/--to` take a time (`+SECONDS` after the first record, `SECONDSs`, or an ISO 8601
timestamp, UTC when naive) or a seq (`seq:N`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import math
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import msgspec

from indexer.errors import IndexerError
from indexer.recording.format import Record, RecordingReader, Source
from indexer.recording.replay import (
    RecordFilter,
    ReplaySummary,
    before_window,
    parse_window,
    replay_into_index,
    select_records,
    streams_of,
)
from indexer.recording.republish import PublishedStream, RepublishConfig, Republisher, parse_faults
from indexer.snapshot import dump_index

__all__ = ["add_arguments", "parse_window", "print_summary", "run", "stdout_closed"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute replay`."""
    parser.add_argument("file", type=Path, help="a recording made by `kvroute record`")
    parser.add_argument(
        "--into", choices=["index"], help="replay into an in-memory index (the default)"
    )
    parser.add_argument("--dump", type=Path, help="write the final index snapshot here")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--publish",
        metavar="tcp://HOST:PORT",
        help="republish on PUB sockets (port + i per stream); the recorder's clear marks go "
        "out as AllBlocksCleared batches of their own (later seqs one higher), its forget-seq "
        "marks are not sent (no message says them)",
    )
    parser.add_argument(
        "--replay-endpoint",
        metavar="tcp://HOST:PORT",
        help="replay ROUTER of the first stream (default: after the PUB ports)",
    )
    parser.add_argument(
        "--replay-buffer",
        type=int,
        default=10_000,
        help="batches each stream's replay ROUTER keeps (--publish; default 10000, SGLang's)",
    )
    parser.add_argument(
        "--speed", default="1", help="pace multiplier of the recorded timing, or 'max' (default 1)"
    )
    parser.add_argument(
        "--faults", default="", help="drop=P,dup=P,reorder=P,restart-at=SEQ (with --publish)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the fault injection (--faults; default 0)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=10.0,
        help="seconds to wait for subscribers (--publish; default 10)",
    )
    parser.add_argument(
        "--linger",
        type=float,
        default=2.0,
        help="seconds to keep answering replay requests after the last message (--publish; "
        "default 2)",
    )
    parser.add_argument("--from", dest="start", help="first record: +SECONDS, ISO time or seq:N")
    parser.add_argument("--to", dest="end", help="last record: +SECONDS, ISO time or seq:N")
    parser.add_argument(
        "--stream", action="append", default=[], help="replay only this stream (repeatable)"
    )


# the options of a republish alone (flag, dest): given without --publish, they are refused
_PUBLISH_ONLY = (
    ("--replay-endpoint", "replay_endpoint"),
    ("--replay-buffer", "replay_buffer"),
    ("--speed", "speed"),
    ("--faults", "faults"),
    ("--seed", "seed"),
    ("--wait", "wait"),
    ("--linger", "linger"),
)


def stdout_closed() -> int:
    """The exit status once stdout's reader has gone (`| head`): quiet, as a Unix tool that
    SIGPIPE ends (128 + SIGPIPE), instead of a traceback or an error message."""
    # the interpreter flushes stdout once more on exit, which would fail again: send it nowhere
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def run(args: argparse.Namespace) -> int:
    """Replay into an index (default) or republish."""
    try:
        return _run(args)
    except BrokenPipeError:
        return stdout_closed()


def _run(args: argparse.Namespace) -> int:
    try:
        _check_seq_bounds(args.start, args.end)
        with RecordingReader(args.file) as reader:
            flt = parse_window(reader, args.start, args.end)
            if args.stream:
                # a misspelt stream would replay nothing and say nothing: name what there is
                # (a pass over the file: streams an append added are declared along it)
                collections.deque(reader, maxlen=0)
                unknown = sorted(set(args.stream) - set(reader.sources))
                if unknown:
                    raise ValueError(
                        f"--stream {', '.join(unknown)}: not in {args.file} (its streams: "
                        f"{', '.join(sorted(reader.sources)) or 'none'})"
                    )
                flt = msgspec.structs.replace(flt, streams=frozenset(args.stream))
            if args.start is not None or args.end is not None:
                _check_not_empty(reader, flt, args)
    except (OSError, IndexerError, ValueError) as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 2
    if args.publish:
        # what only an index replay makes: refused, not silently left out
        index_only = [
            flag
            for flag, given in (("--dump", args.dump), ("--json", args.json), ("--into", args.into))
            if given
        ]
        if index_only:
            print(
                f"kvroute replay: {', '.join(index_only)} and --publish do not go together "
                "(a republish builds no index)",
                file=sys.stderr,
            )
            return 2
        return _publish(args, flt)
    # what only a republish does: refused, not silently left out (`--speed 10` into an index
    # ran as fast as ever; `--faults` alone was already refused)
    defaults = argparse.ArgumentParser(add_help=False)
    add_arguments(defaults)
    publish_only = [
        flag for flag, dest in _PUBLISH_ONLY if getattr(args, dest) != defaults.get_default(dest)
    ]
    if publish_only:
        print(
            f"kvroute replay: {', '.join(publish_only)} need{'s' if len(publish_only) == 1 else ''}"
            " --publish (an index replay applies the records at once, with no faults)",
            file=sys.stderr,
        )
        return 2
    dump = None
    if args.dump:
        # made before the replay, so a refusal comes at once; never over an existing file, as
        # `record --out` (a mistyped --dump must not destroy a recording, least of all the one
        # replayed); owner only, as a recording: a snapshot holds the salts in clear
        try:
            dump = os.fdopen(os.open(args.dump, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
        except OSError as exc:
            why = "it exists (remove it, or choose another name)"
            why = why if isinstance(exc, FileExistsError) else exc.strerror or str(exc)
            print(f"kvroute replay: --dump {args.dump}: cannot create: {why}", file=sys.stderr)
            return 2
    try:
        summary, index = replay_into_index(args.file, flt=flt)
        if dump is not None:
            with dump:
                # the same snapshot `/admin` and `IndexerService.dump` make: loadable by a router
                dump.write(dump_index(index))
    except (OSError, IndexerError) as exc:
        if dump is not None:
            with contextlib.suppress(OSError):
                dump.close()
            args.dump.unlink(missing_ok=True)  # made above: no empty or half-written snapshot
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.encode(summary).decode() + "\n")
    else:
        print_summary(summary, sys.stdout)
    return 1 if summary.damaged else 0


def print_summary(summary: ReplaySummary, out: TextIO) -> None:
    """The human summary of an offline replay."""
    span = (summary.last_time or 0.0) - (summary.first_time or 0.0)
    w = out.write
    w(f"{summary.path}: {summary.records} records over {span:.1f} s\n")
    w(
        f"  batches {summary.batches}  events {summary.events}  blocks stored "
        f"{summary.blocks_stored}  removed {summary.blocks_removed}  decode errors "
        f"{summary.decode_errors}\n"
    )
    w(
        f"  applied in {summary.elapsed_s:.3f} s: {summary.block_ops_per_s:,.0f} block ops/s "
        "(read + decode + apply)\n"
    )
    w(f"  final index: {summary.index_entries} entries\n")
    w("  streams:\n")
    why = (
        "the window starts past damage (below), so what came before it is unknown"
        if summary.damage_before_window is not None
        else "the window starts after this stream's first record"
    )
    for s in summary.streams:
        w(
            f"    {s.stream}: records {s.records} (replayed {s.replayed_records})  seq "
            f"{s.first_seq}..{s.last_seq}  gaps {s.gaps} (repaired by {s.replays} replays, "
            f"lost {s.lost_gaps})  restarts {s.restarts}  clears {s.marked_clears}  decode "
            f"errors {s.decode_errors}  unknown parents {s.unknown_parents}  block size "
            f"{'unknown' if s.block_size is None else s.block_size} (mismatches "
            f"{s.block_size_mismatches})  entries {s.entries}\n"
        )
        if s.partial:
            w(
                f"      {why}: its state is a part, kept with no seq and no fence (a router "
                "loading a dump of it rebuilds the stream from the worker)\n"
            )
    w("  namespaces (id, model, lora, salt fingerprint: blocks, tokens, holders):\n")
    for ns in summary.namespaces:
        holders = ", ".join(f"{k}={v}" for k, v in sorted(ns.holders.items()))
        w(
            f"    {ns.namespace}  {ns.model or '-'}, {ns.lora or '-'}, {ns.salt}: "
            f"{ns.blocks}, {ns.tokens}, {holders}\n"
        )
    if summary.damage_before_window is not None:
        d = summary.damage_before_window
        w(
            f"  STOPPED at byte {d.offset} (record {d.record}) before the window: {d.kind}: "
            f"{d.reason}; what the file holds from there to the window is unknown, so the "
            "window (read from past the damage) holds every stream in part: none keeps a seq "
            "or fence\n"
        )
    if summary.damage is not None:
        d = summary.damage
        w(
            f"  STOPPED at byte {d.offset} (record {d.record}): {d.kind}: {d.reason}; "
            "everything before it was replayed\n"
        )


def _check_not_empty(reader: RecordingReader, flt: RecordFilter, args: argparse.Namespace) -> None:
    """ValueError when --from/--to select no record of a file that has some: beyond either
    end it replayed nothing (a 0-entry --dump) and exited 0, where --from after --to is
    refused. A time window seeks: this costs a pass only when the window is empty or
    selects by seq."""
    if next(select_records(reader, flt), None) is not None or reader.damage is not None:
        return  # a damaged file: the replay says where it stopped
    first = last = None
    seqs: list[int] = []
    for positioned in select_records(reader, RecordFilter()):  # what +SECONDS counts from
        record = positioned.record
        first = record.recv_time if first is None else first
        last = record.recv_time
        seqs.append(record.seq)
    if first is None or last is None:
        return  # no record at all: no window to blame
    given = " ".join(
        f"{flag} {text!r}" for flag, text in (("--from", args.start), ("--to", args.end)) if text
    )
    damage = reader.damage
    # records past damage are unknown: the span read is not the file's, and the window may lie
    # in what could not be read (before, the span was given as the file's)
    cut = (
        ""
        if damage is None
        else f"; read up to damage at byte {damage.offset} (record {damage.record}): "
        f"{damage.kind}: {damage.reason}, what lies past it is unknown"
    )
    raise ValueError(
        f"{given}: the window is empty: no record of {args.file} is in it (its records: "
        f"+0.0 to +{last - first:.1f} s, {_utc(first)} to {_utc(last)}; seq {min(seqs)} to "
        f"{max(seqs)}{cut})"
    )


def _utc(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat(timespec="seconds")


def _check_seq_bounds(start: str | None, end: str | None) -> None:
    """ValueError for a negative `seq:N`: no record has one, and the bound was taken in
    silence (`--to seq:-1` replayed nothing, `--from seq:-1` everything)."""
    for flag, text in (("--from", start), ("--to", end)):
        if text is None or not text.strip().startswith("seq:"):
            continue
        try:
            seq = int(text.strip()[4:])
        except ValueError:
            continue  # not an integer: parse_window says so
        if seq < 0:
            raise ValueError(f"{flag} {text!r}: a seq is >= 0")


def _parse_speed(text: str) -> float | None:
    if text == "max":
        return None
    try:
        speed = float(text)
    except ValueError:
        speed = float("nan")
    if not speed > 0 or speed == float("inf"):
        raise ValueError(f"--speed {text!r}: a number > 0, or 'max'")
    return speed


def _publish(args: argparse.Namespace, flt: RecordFilter) -> int:
    if args.replay_buffer < 1:
        print(
            f"kvroute replay: --replay-buffer {args.replay_buffer}: must be >= 1", file=sys.stderr
        )
        return 2
    for flag, seconds in (("--wait", args.wait), ("--linger", args.linger)):
        # a negative one was taken as 0 in silence
        if not 0 <= seconds < math.inf:
            print(f"kvroute replay: {flag} {seconds}: seconds, >= 0", file=sys.stderr)
            return 2
    try:
        config = RepublishConfig(
            endpoint=args.publish,
            replay_endpoint=args.replay_endpoint,
            speed=_parse_speed(args.speed),
            replay_buffer=args.replay_buffer,
            faults=parse_faults(args.faults, seed=args.seed),
        )
        with RecordingReader(args.file) as reader:
            sources = streams_of(reader, flt)
        _check_ports(args.publish, args.replay_endpoint, len(sources))
    except (OSError, IndexerError, ValueError) as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_republish(args, config, sources, flt))
    except (OSError, IndexerError, ValueError) as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 2


def _check_ports(publish: str, replay: str | None, streams: int) -> None:
    """ValueError when the ports the streams take from the given ones run past 65535 (else the
    bind of the first port out of range failed with ZMQ's words: "Invalid argument")."""
    ranges = [("--publish", publish, streams, f"{streams} stream(s) publish on")]
    if replay is not None:
        ranges.append(("--replay-endpoint", replay, streams, f"{streams} stream(s) answer on"))
    else:  # the replay ROUTERs take the ports right after the PUB ports
        ranges[0] = (
            "--publish",
            publish,
            2 * streams,
            f"{streams} stream(s) publish and answer on",
        )
    for flag, endpoint, ports, what in ranges:
        port = endpoint.rpartition(":")[2]
        if not port.isdigit() or int(port) == 0:  # malformed is RepublishConfig's to say; 0: free
            continue
        first, last = int(port), int(port) + ports - 1
        if last > 65535:
            raise ValueError(
                f"{flag} {endpoint}: {what} ports {first}-{last} (one per stream and socket "
                f"from the given port), past 65535: give a port up to {65536 - ports}, or 0 "
                "for free ports"
            )


def _records(path: Path, flt: RecordFilter, damaged: list[str]) -> Iterator[Record]:
    """The selected records; a damage the reader stopped at, or one before the window that
    its time seek read past, is said and added to `damaged` (as an index replay says both)."""
    with RecordingReader(path) as reader:
        _, skipped = before_window(reader, flt)
        # the marks too: a subscriber must drop the stream's entries where the recorder's did
        for positioned in select_records(reader, flt, marks=True):
            yield positioned.record
        stopped = reader.damage
    if skipped is not None and (stopped is None or stopped.offset != skipped.offset):
        said = (
            f"recording damaged at byte {skipped.offset} (record {skipped.record}) before the "
            f"window: {skipped.reason}"
        )
        damaged.append(said)
        print(said + "; the window, after it, was published", file=sys.stderr)
    if stopped is not None:
        said = f"recording damaged at byte {stopped.offset} (record {stopped.record}): "
        said += stopped.reason
        damaged.append(said)
        print(said + "; everything before it was published", file=sys.stderr)


async def _republish(
    args: argparse.Namespace, config: RepublishConfig, sources: list[Source], flt: RecordFilter
) -> int:
    async with Republisher(sources, config) as rep:
        for s in rep.streams:
            print(f"stream {s.stream}: PUB {s.endpoint}  replay {s.replay_endpoint}", flush=True)
        if args.wait > 0 and not await rep.wait_subscribed(args.wait):
            print("no subscriber on every stream yet; publishing anyway", flush=True)
        damaged: list[str] = []
        streams = await rep.run(_records(args.file, flt, damaged))
        await asyncio.sleep(max(0.0, args.linger))  # late replay requests still get answers
    _print_published(streams, sys.stdout)
    return 1 if damaged else 0  # as an index replay of a damaged file: not all of it went


def _print_published(streams: list[PublishedStream], out: TextIO) -> None:
    for s in streams:
        out.write(
            f"{s.stream}: sent {s.sent}  dropped {s.dropped}  duplicated {s.duplicated}  "
            f"reordered {s.reordered}  restarts {s.restarts}  replay requests "
            f"{s.replay_requests} ({s.replayed} batches)  last seq {s.last_seq}  clears "
            f"{s.clears} (sent)  forgets {s.forgets} (not sent)\n"
        )
