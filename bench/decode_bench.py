"""`kvroute bench decode`: KV-event payload decode throughput, in block entries per second.

The workload is what a busy SGLang worker publishes: coalesced `BlockStored` events (page
size 16, several pages per event, half of them salted) plus a share of `BlockRemoved`, in both
SGLang layouts (the 7/8-slot arrays and the >= 0.5.20 maps), encoded by our own
byte-identical encoder. A "block entry" is one hash of a stored or removed event: the unit the
index ingests. The baseline is an untyped `msgspec.msgpack.decode` of the same bytes (parsing
only, no validation, no model), run in the same process, so the ratio says what validation
and normalization cost on this machine. Every loop is bounded by `--seconds`.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from bench.command import write_markdown
from indexer.protocol import EventBatch, Removed, Stored, WireLayout, decode_batch, encode_batch

__all__ = ["add_arguments", "run"]

DEFAULT_OUTPUT = Path("docs/benchmarks/decode.md")  # below the working directory, as every suite
PAGE_SIZE = 16
ROUNDS = 3


class CaseResult(msgspec.Struct, frozen=True):
    """Throughput of one layout: ours and the parse-only baseline."""

    layout: str
    payload_bytes: int
    blocks_per_batch: int
    events_per_batch: int
    blocks_per_s: float
    events_per_s: float
    baseline_blocks_per_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the decode suite."""
    parser.add_argument("--seconds", type=float, default=3.0, help="time budget per measurement")
    parser.add_argument("--pages-per-event", type=int, default=8, help="coalesced pages/event")
    parser.add_argument("--events-per-batch", type=int, default=16, help="events per payload")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--output", "--out", type=Path, default=DEFAULT_OUTPUT, help="markdown report"
    )


def _workload(rng: random.Random, pages: int, events: int) -> EventBatch:
    """One scheduler step's batch: coalesced stores, every fourth event a removal."""
    out: list[Stored | Removed] = []
    for index in range(events):
        hashes: list[int | bytes] = [rng.randrange(-(2**63), 2**63) for _ in range(pages)]
        if index % 4 == 3:
            out.append(Removed(hashes, "GPU"))
            continue
        tokens: list[int | tuple[int, int]] = [
            rng.randrange(150_000) for _ in range(pages * PAGE_SIZE)
        ]
        parent = rng.choice([None, rng.randrange(-(2**63), 2**63)])
        salt = "tenant-a" if index % 2 == 0 else None
        out.append(Stored(hashes, parent, tokens, PAGE_SIZE, None, medium="GPU", cache_salt=salt))
    return EventBatch(1767225600.25, list(out), 0)


def _rate(fn: Callable[[bytes], object], payload: bytes, seconds: float) -> float:
    """Best-of-rounds calls per second, each round bounded by its share of `seconds`."""
    best = 0.0
    budget = seconds / ROUNDS
    for _ in range(ROUNDS):
        calls = 0
        start = time.perf_counter()
        deadline = start + budget
        while True:
            for _ in range(20):
                fn(payload)
            calls += 20
            now = time.perf_counter()
            if now >= deadline:
                break
        best = max(best, calls / (now - start))
    return best


def _measure(batch: EventBatch, layout: WireLayout, seconds: float) -> CaseResult:
    payload = encode_batch(batch, layout)
    blocks = sum(len(e.block_hashes) for e in batch.events if isinstance(e, Stored | Removed))
    decoded = decode_batch(payload)
    assert decoded == batch, "decoder does not reproduce the benchmark batch"
    ours = _rate(decode_batch, payload, seconds)
    baseline = _rate(msgspec.msgpack.decode, payload, seconds)
    return CaseResult(
        layout=layout,
        payload_bytes=len(payload),
        blocks_per_batch=blocks,
        events_per_batch=len(batch.events),
        blocks_per_s=ours * blocks,
        events_per_s=ours * len(batch.events),
        baseline_blocks_per_s=baseline * blocks,
    )


def _markdown(results: list[CaseResult], args: argparse.Namespace) -> str:
    lines = [
        "# KV-event decode throughput",
        "",
        "`kvroute bench decode`: `decode_batch` on coalesced SGLang payloads (page size "
        f"{PAGE_SIZE}, {args.pages_per_event} pages per event, {args.events_per_batch} events "
        "per batch, every 4th event a `BlockRemoved`, half the stores salted). A block entry is "
        "one hash of a stored or removed event. Baseline: untyped `msgspec.msgpack.decode` of "
        "the same bytes (parse only), same process, same run.",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, msgspec "
        f"{msgspec.__version__}; best of {ROUNDS} rounds, {args.seconds:g} s per measurement. "
        "Numbers from a shared machine are indicative; compare ratios, not absolutes.",
        "",
        "| layout | payload bytes | blocks/batch | block entries/s | events/s "
        "| parse-only block entries/s | ours / parse-only |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.layout} | {r.payload_bytes:,} | {r.blocks_per_batch} | {r.blocks_per_s:,.0f} "
            f"| {r.events_per_s:,.0f} | {r.baseline_blocks_per_s:,.0f} "
            f"| {r.blocks_per_s / r.baseline_blocks_per_s:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Measure both layouts, print the table, write the markdown report."""
    if args.seconds <= 0 or args.pages_per_event <= 0 or args.events_per_batch <= 0:
        print("decode bench: --seconds, --pages-per-event and --events-per-batch must be > 0")
        return 2
    batch = _workload(random.Random(args.seed), args.pages_per_event, args.events_per_batch)
    layouts: list[WireLayout] = ["array", "map"]
    results = [_measure(batch, layout, args.seconds) for layout in layouts]
    report = _markdown(results, args)
    write_markdown(report, args.output)
    print(f"written to {args.output}")
    return 0
