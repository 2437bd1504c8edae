"""`kvroute bench index`: indexer ingest rate, query latency and memory per indexed entry.

Three measurements, written to `docs/benchmarks/index.md`:
- ingest: decode + apply of a realistic coalesced SGLang stream (page size 16): multi-turn
  sessions over shared system prompts (half of them salted by tenant), each request storing
  its uncached suffix as ONE `BlockStored` chained to its cached prefix, several requests per
  scheduler step, FIFO eviction as `BlockRemoved` once the worker's pool is full. Payloads are
  encoded by our byte-identical SGLang encoder beforehand; the timed loop is exactly what the
  subscriber does per message (`decode_batch` + `PrefixIndex.apply`). Unit: block operations
  (stored + removed hashes) per second, one core.
- query: an 8,192-token prompt (512 blocks) against 64 streams holding ~2M (block, stream)
  entries, through `IndexerService.query` (what the router calls: all 64 workers' matches).
  Prompts are documents some streams hold entirely (the worst case: the walk goes to the end)
  and fresh prompts that share only a system prompt.
- memory: bytes traced by `tracemalloc` while building that index (everything the index
  allocates and keeps: dicts, engine-hash ints, keys, values), per entry, with the sharing
  factor (entries per unique block key) stated, and a no-sharing worst case at a smaller scale.
  Building under tracemalloc is slower; the build time shown includes that overhead.

Every loop is bounded (`--seconds`, counts) and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import platform
import random
import time
import tracemalloc
from collections import deque
from pathlib import Path

import msgspec

from indexer.config import StreamConfig
from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol import EventBatch, Removed, Stored, decode_batch, encode_batch
from indexer.service import IndexerService, stream_id

__all__ = ["add_arguments", "run"]

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "index.md"
PAGE = 16
MODEL = "bench-model"
TARGET_OPS = 1_000_000
TARGET_P99_US = 250.0
TARGET_BYTES = 120.0


class IngestResult(msgspec.Struct):
    """Ingest throughput."""

    batches: int
    block_ops: int
    stored: int
    removed: int
    decode_apply_ops_s: float
    apply_only_ops_s: float
    decode_only_ops_s: float


class QueryResult(msgspec.Struct):
    """Query latency of one prompt kind, microseconds."""

    kind: str
    queries: int
    p50_us: float
    p99_us: float
    mean_matched_blocks: float


class MemoryResult(msgspec.Struct):
    """Index size and the memory it holds (tracemalloc)."""

    label: str
    streams: int
    entries: int
    unique_keys: int
    traced_bytes: int
    bytes_per_entry: float
    build_s: float


def _rand_hash(rng: random.Random) -> int:
    return rng.getrandbits(64) - (1 << 63)


# ---------------------------------------------------------------- ingest


def ingest_workload(seed: int, batches: int, capacity_blocks: int) -> list[bytes]:
    """Encoded payloads of one busy SGLang worker; see the module docstring."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(32 * PAGE)] for _ in range(8)]
    # session -> (namespace salt, tokens so far, engine hashes of its full pages)
    sessions: list[tuple[str | None, list[int], list[int]]] = []
    for s in range(256):
        salt = f"tenant-{s % 8}" if s % 2 else None
        system = systems[s % len(systems)]
        sessions.append((salt, list(system), []))
    system_hashes: dict[tuple[str | None, int], list[int]] = {}
    held: deque[list[int]] = deque()
    held_blocks = 0
    payloads = []
    for step in range(batches):
        events: list[Stored | Removed] = []
        for _ in range(rng.randrange(4, 9)):
            i = rng.randrange(len(sessions))
            salt, tokens, hashes = sessions[i]
            if not hashes:
                # the system prompt is cached once per namespace and shared by its sessions
                key = (salt, i % len(systems))
                shared = system_hashes.get(key)
                if shared is None:
                    shared = [_rand_hash(rng) for _ in range(len(tokens) // PAGE)]
                    system_hashes[key] = shared
                    events.append(_stored(shared, None, tokens[: 32 * PAGE], salt))
                    held.append(shared)
                    held_blocks += len(shared)
                hashes.extend(shared)
            turn = [rng.randrange(32000) for _ in range(rng.randrange(4, 13) * PAGE)]
            new = [_rand_hash(rng) for _ in range(len(turn) // PAGE)]
            events.append(_stored(new, hashes[-1], turn, salt))
            tokens.extend(turn)
            hashes.extend(new)
            held.append(new)
            held_blocks += len(new)
            if len(tokens) > 8192:  # the conversation ends; a new one starts on its system
                sessions[i] = (salt, tokens[: 32 * PAGE], [])
        while held_blocks > capacity_blocks:
            victim = held.popleft()
            held_blocks -= len(victim)
            events.append(Removed(block_hashes=victim, medium="GPU"))  # type: ignore[arg-type]
        payloads.append(encode_batch(EventBatch(ts=float(step), events=events), "array"))  # type: ignore[arg-type]
    return payloads


def _stored(hashes: list[int], parent: int | None, tokens: list[int], salt: str | None) -> Stored:
    return Stored(
        block_hashes=hashes,  # type: ignore[arg-type]
        parent=parent,
        token_ids=tokens,  # type: ignore[arg-type]
        block_size=PAGE,
        medium="GPU",
        cache_salt=salt,
    )


def bench_ingest(payloads: list[bytes], seconds: float) -> IngestResult:
    """Decode + apply every payload in order (repeating on fresh indexes up to `seconds`)."""
    decoded = [decode_batch(p) for p in payloads]
    stored = sum(len(e.block_hashes) for b in decoded for e in b.events if isinstance(e, Stored))
    removed = sum(len(e.block_hashes) for b in decoded for e in b.events if isinstance(e, Removed))
    ops = stored + removed

    def timed(fn_decode: bool, fn_apply: bool) -> float:
        """Best block ops/s over rounds on fresh indexes (at least 2, up to `seconds`)."""
        best = 0.0
        deadline = time.perf_counter() + seconds
        rounds = 0
        while rounds < 2 or (time.perf_counter() < deadline and rounds < 20):
            rounds += 1
            index = PrefixIndex()
            index.add_stream("w#dp0", model=MODEL, block_size=PAGE)
            gc.collect()
            start = time.perf_counter()
            if fn_decode and fn_apply:
                for seq, p in enumerate(payloads):
                    index.apply("w#dp0", decode_batch(p), seq)
            elif fn_apply:
                for seq, b in enumerate(decoded):
                    index.apply("w#dp0", b, seq)
            else:
                for p in payloads:
                    decode_batch(p)
            best = max(best, ops / (time.perf_counter() - start))
        return best

    return IngestResult(
        batches=len(payloads),
        block_ops=ops,
        stored=stored,
        removed=removed,
        decode_apply_ops_s=timed(True, True),
        apply_only_ops_s=timed(False, True),
        decode_only_ops_s=timed(True, False),
    )


# ---------------------------------------------------------- query and memory


def _doc(doc_id: int, systems: int) -> list[int]:
    """8,192 tokens: one of `systems` shared system prompts (512 tokens), then the document."""
    system = list(random.Random(-1 - doc_id % systems).randbytes(32 * PAGE))
    return system + list(random.Random(doc_id).randbytes(8192 - 32 * PAGE))


def _doc_ns(doc_id: int) -> Namespace:
    return Namespace(MODEL, None, None if doc_id % 2 else f"tenant-{doc_id % 4}")


def build_index(
    streams: int, docs_per_stream: int, pool: int | None, seed: int
) -> tuple[PrefixIndex, dict[str, list[int]], MemoryResult, str]:
    """64 streams each holding whole 8,192-token documents (pool=None: nobody shares)."""
    rng = random.Random(seed)
    systems = 16
    held: dict[str, list[int]] = {}
    for s in range(streams):
        if pool is None:
            held[stream_id(f"w{s}", 0)] = [s * docs_per_stream + d for d in range(docs_per_stream)]
        else:
            held[stream_id(f"w{s}", 0)] = rng.sample(range(pool), docs_per_stream)
    docs = {d: _doc(d, systems) for d in sorted({d for ds in held.values() for d in ds})}
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    index = PrefixIndex()
    for sid in held:
        index.add_stream(sid, model=MODEL, block_size=PAGE)
    for sid, doc_ids in held.items():
        for d in doc_ids:
            tokens = docs[d]
            hashes = [_rand_hash(rng) for _ in range(len(tokens) // PAGE)]
            ns = _doc_ns(d)
            ev = _stored(hashes, None, tokens, ns.cache_salt)
            index.apply(sid, EventBatch(ts=0.0, events=[ev]))
    build_s = time.perf_counter() - start
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = len(index)
    unique = len(index._table)
    label = "shared" if pool is not None else "no sharing"
    memory = MemoryResult(label, streams, entries, unique, grown, grown / entries, build_s)
    del docs
    return index, held, memory, label


async def _query_latencies(
    index: PrefixIndex, held: dict[str, list[int]], seconds: float, seed: int
) -> list[QueryResult]:
    rng = random.Random(seed)
    async with IndexerService() as service:
        # real subscribers (their SUBs connect to a port nobody listens on), the built index
        for sid in held:
            worker = sid.split("#")[0]
            await service.add_worker(
                worker, [StreamConfig(endpoint="tcp://127.0.0.1:9", block_size=PAGE, model=MODEL)]
            )
        for subs in service._workers.values():
            for sub in subs:
                sub.index = index
        service.index = index
        all_docs = sorted({d for ds in held.values() for d in ds})
        fresh_ids = [10_000_000 + i for i in range(50)]
        kinds = {
            "held document (full 512-block walk)": [rng.choice(all_docs) for _ in range(50)],
            "fresh prompt (system prompt only)": fresh_ids,
        }
        results = []
        for kind, doc_ids in kinds.items():
            prompts = [(_doc_ns(d), _doc(d, 16)) for d in doc_ids]
            samples: list[float] = []
            matched = 0
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline and len(samples) < 20_000:
                for ns, tokens in prompts:
                    t0 = time.perf_counter_ns()
                    out = service.query(ns, tokens)
                    samples.append((time.perf_counter_ns() - t0) / 1000)
                    matched += max(m.matched_blocks for m in out.values())
            samples.sort()
            results.append(
                QueryResult(
                    kind=kind,
                    queries=len(samples),
                    p50_us=samples[len(samples) // 2],
                    p99_us=samples[min(len(samples) - 1, int(len(samples) * 0.99))],
                    mean_matched_blocks=matched / len(samples),
                )
            )
        return results


# ---------------------------------------------------------------- report


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def render(
    ingest: IngestResult, queries: list[QueryResult], memory: list[MemoryResult], args: object
) -> str:
    """The markdown report."""
    lines = [
        "# Indexer benchmark",
        "",
        "`kvroute bench index` (bench/index_bench.py). Provisional numbers from a shared "
        "2-core machine; rerun on a quiet machine before quoting them.",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, "
        f"msgspec {msgspec.__version__}. Parameters: {args}",
        "",
        "## Ingest (decode + apply, one core)",
        "",
        f"A coalesced SGLang stream, page size 16: {ingest.batches:,} batches, "
        f"{ingest.stored:,} stored + {ingest.removed:,} removed block hashes "
        f"({ingest.block_ops:,} block operations). Best round.",
        "",
        "| path | block ops/s |",
        "|---|---:|",
        f"| decode + apply (what the subscriber does) | {ingest.decode_apply_ops_s:,.0f} |",
        f"| apply only (pre-decoded) | {ingest.apply_only_ops_s:,.0f} |",
        f"| decode only | {ingest.decode_only_ops_s:,.0f} |",
        "",
        f"Target >= {TARGET_OPS:,} block ops/s: "
        f"**{_verdict(ingest.decode_apply_ops_s >= TARGET_OPS)}**.",
        "",
        "## Query (8,192-token prompt, 64 streams, IndexerService.query)",
        "",
        "| prompt | queries | p50 us | p99 us | mean best match (blocks) |",
        "|---|---:|---:|---:|---:|",
    ]
    for q in queries:
        lines.append(
            f"| {q.kind} | {q.queries:,} | {q.p50_us:,.0f} | {q.p99_us:,.0f} | "
            f"{q.mean_matched_blocks:,.1f} |"
        )
    worst = max(q.p99_us for q in queries)
    lines += [
        "",
        f"Target p99 <= {TARGET_P99_US:.0f} us (worst kind): "
        f"**{_verdict(worst <= TARGET_P99_US)}**.",
        "",
        "## Memory",
        "",
        "| index | streams | entries | unique keys | entries per key | traced memory | bytes/entry "
        "| build s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in memory:
        lines.append(
            f"| {m.label} | {m.streams} | {m.entries:,} | {m.unique_keys:,} | "
            f"{m.entries / max(m.unique_keys, 1):.2f} | {m.traced_bytes / 2**20:,.0f} MiB | "
            f"{m.bytes_per_entry:,.0f} | {m.build_s:.1f} |"
        )
    shared = memory[0]
    lines += [
        "",
        f"Target <= {TARGET_BYTES:.0f} bytes/entry (shared index): "
        f"**{_verdict(shared.bytes_per_entry <= TARGET_BYTES)}**.",
        "",
        "## What limits these numbers",
        "",
        LIMITS,
    ]
    return "\n".join(lines) + "\n"


LIMITS = """\
All of it is single-threaded CPython; what is left is interpreter work and memory traffic, not
algorithmic cost. Measured breakdowns (same machine, same session, provisional):
- Ingest: `decode_batch` (msgspec, C) costs ~0.3-0.4 us per block entry, `PrefixIndex.apply`
  ~0.9 us per block operation. A stored block costs one C-level tuple hash of its 16 tokens plus a
  chain hash (~0.2 us) and C-level dict updates (`isdisjoint`/`update` over the whole event);
  a removed block costs a few C-level passes per event. The rest is fixed per-event Python
  work (validation, namespace resolution, calls), ~3 us per event of ~8 pages. Apply alone
  runs at ~1.1 M block ops/s; with decode the total is ~0.8 M, short of 1 M. Ways past it:
  decoding straight into the index's shapes (skipping the `EventBatch` model), or the hot
  loop in a compiled extension.
- Query: for a prompt held to the end (512 blocks, 2M entries), measured per stage: building
  the block tuples ~40 us, chain-hashing them ~75 us, looking the keys up ~95-125 us (the
  table and its key objects are ~100 MB: each lookup is ~3 cache misses, and an int key
  must be loaded to compare it), the C-level running AND ~20 us, drop bookkeeping ~15 us.
  The walk stops as soon as no stream still matches, so a prompt that only shares a system
  prompt costs ~100 us. Turning the result into 64
  `WorkerMatch` objects adds ~20-40 us. The full walk's p99 misses 250 us here.
- Memory: an entry costs one slot in its stream's dict (~42 bytes amortized) and its engine
  hash, a 36-byte int; each UNIQUE block key adds a table slot (~42 bytes) and the 36-byte key
  int (shared with the stream dicts); table values (holder sets) are shared int objects. So
  ~80 bytes per entry plus ~80 per unique key: ~160 with no sharing, ~135 when, as here, a key
  is held by ~2.4 streams on average. Under 120 would need a compiled table (Rust/C, ~40-65
  bytes) or dropping engine hashes, which the protocol needs for parents and removals.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute bench index`."""
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    parser.add_argument("--batches", type=int, default=2000, help="ingest batches")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument(
        "--docs-per-stream", type=int, default=61, help="8,192-token documents held per stream"
    )
    parser.add_argument("--pool", type=int, default=2000, help="distinct documents to draw from")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)


def run(args: argparse.Namespace) -> int:
    """Run the three measurements and write the report."""
    print(f"index bench: seed={args.seed}")
    payloads = ingest_workload(args.seed, args.batches, capacity_blocks=50_000)
    ingest = bench_ingest(payloads, args.seconds)
    print(f"ingest: {ingest.decode_apply_ops_s:,.0f} block ops/s (decode + apply)")
    del payloads
    index, held, shared, _ = build_index(args.streams, args.docs_per_stream, args.pool, args.seed)
    print(f"memory: {shared.entries:,} entries, {shared.bytes_per_entry:.0f} bytes/entry")
    queries = asyncio.run(_query_latencies(index, held, args.seconds, args.seed))
    for q in queries:
        print(f"query {q.kind}: p50 {q.p50_us:.0f} us, p99 {q.p99_us:.0f} us")
    del index, held
    gc.collect()
    small = max(1, args.docs_per_stream // 8)
    _, _, unshared, _ = build_index(args.streams, small, None, args.seed)
    print(f"memory (no sharing): {unshared.bytes_per_entry:.0f} bytes/entry")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    params = (
        f"seed={args.seed}, batches={args.batches}, streams={args.streams}, "
        f"docs/stream={args.docs_per_stream}, pool={args.pool}, seconds={args.seconds}"
    )
    args.output.write_text(render(ingest, queries, [shared, unshared], params))
    print(f"wrote {args.output}")
    return 0
