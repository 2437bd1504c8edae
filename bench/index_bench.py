"""`kvroute bench index`: indexer ingest rate, query latency and memory per indexed entry.

Three measurements, written to `docs/benchmarks/index.md`:
- ingest: decode + apply of a recorded KV-event stream, read back from a `kvroute record`
  file (`--recording FILE` takes a real capture; without it the bench first records the
  synthetic stream below to a file and reads that). The synthetic stream is a realistic
  coalesced SGLang stream (page size 16): multi-turn sessions over shared system prompts (half
  of them salted by tenant), each request storing its uncached suffix as ONE `BlockStored`
  chained to its cached prefix, several requests per scheduler step, FIFO eviction as
  `BlockRemoved` once the worker's pool is full, encoded by our byte-identical SGLang encoder.
  The timed loop is exactly what the subscriber does per message (`decode_batch` +
  `PrefixIndex.apply` into the record's stream). Unit: block operations (stored + removed
  hashes) per second, one core; the naive baseline applies the same pre-decoded batches.
- query: an 8,192-token prompt (512 blocks) against 64 streams holding ~2M (block, stream)
  entries, through `IndexerService.query` (what the router calls: all 64 workers' matches).
  Prompts are documents some streams hold entirely (the worst case: the walk goes to the end),
  fresh prompts that share only a system prompt, and held documents while the pending table
  is busy (as in a live router). Samples come in rounds, so a round disturbed by another
  tenant of a shared machine is visible as such. A per-stage breakdown and a naive
  dict-of-sets baseline holding the same entries are measured in the same run.
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
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.index_report import (
    ROUNDS,
    AdminResult,
    BackendResult,
    IngestResult,
    QueryResult,
    StageResult,
    render,
)
from bench.index_workload import (
    MODEL,
    PAGE,
    IngestRecord,
    NaiveIndex,
    build_index,
    doc_namespace,
    doc_tokens,
    ingest_workload,
    read_recording,
    record_ingest_workload,
)
from indexer.backend import DEFAULT, NATIVE, PURE, Backend
from indexer.config import StreamConfig
from indexer.errors import ProtocolError
from indexer.index import PrefixIndex
from indexer.namespace import Namespace, namespace_seed, py_chain
from indexer.protocol import EventBatch, Removed, Stored, decode_batch
from indexer.service import IndexerService
from indexer.sink import IndexSink
from indexer.snapshot import dump_index, load_index
from router.routing.admission import RecencyBook, recency_stride

__all__ = ["add_arguments", "run"]

DEFAULT_OUTPUT = Path("docs/benchmarks/index.md")  # below the working directory, as every suite


def bench_ingest(
    records: list[IngestRecord],
    seconds: float,
    block_sizes: dict[str, int | None] | None = None,
    backend: Backend = DEFAULT,
) -> IngestResult:
    """Decode + apply every record in order (repeating on fresh indexes up to `seconds`)."""
    sizes = block_sizes or {}
    streams = sorted({r.stream for r in records})
    payloads = [r.payload for r in records]
    decoded = []
    for p in payloads:
        try:
            decoded.append(decode_batch(p))
        except ProtocolError:
            decoded.append(EventBatch(ts=0.0, events=[]))  # a malformed capture: skipped
    stored = sum(len(e.block_hashes) for b in decoded for e in b.events if isinstance(e, Stored))
    removed = sum(len(e.block_hashes) for b in decoded for e in b.events if isinstance(e, Removed))
    ops = stored + removed

    def timed(fn_decode: bool, fn_apply: bool, on: Backend = backend) -> float:
        """Best block ops/s over rounds on fresh indexes (at least 2, up to `seconds`)."""
        best = 0.0
        deadline = time.perf_counter() + seconds
        rounds = 0
        while rounds < 2 or (time.perf_counter() < deadline and rounds < 20):
            rounds += 1
            index = PrefixIndex(backend=on)
            for sid in streams:
                index.add_stream(sid, model=MODEL, block_size=sizes.get(sid) or PAGE)
            gc.collect()
            start = time.perf_counter()
            if fn_decode and fn_apply:
                for r in records:
                    try:
                        index.apply(r.stream, decode_batch(r.payload), r.seq)
                    except ProtocolError:
                        continue
            elif fn_apply:
                for r, b in zip(records, decoded, strict=True):
                    index.apply(r.stream, b, r.seq)
            else:
                for p in payloads:
                    try:
                        decode_batch(p)
                    except ProtocolError:
                        continue
            best = max(best, ops / (time.perf_counter() - start))
        return best

    return IngestResult(
        batches=len(records),
        block_ops=ops,
        stored=stored,
        removed=removed,
        decode_apply_ops_s=timed(True, True),
        apply_only_ops_s=timed(False, True),
        decode_only_ops_s=timed(True, False),
        naive_apply_ops_s=_timed_naive(decoded, ops, seconds),
        python_decode_apply_ops_s=timed(True, True, PURE),
    )


def _timed_naive(decoded: list[EventBatch], ops: int, seconds: float) -> float:
    """Best block ops/s of `NaiveIndex.apply` over the pre-decoded batches."""
    best = 0.0
    deadline = time.perf_counter() + seconds
    rounds = 0
    while rounds < 2 or (time.perf_counter() < deadline and rounds < 20):
        rounds += 1
        naive = NaiveIndex()
        gc.collect()
        start = time.perf_counter()
        for b in decoded:
            naive.apply("w#dp0", b)
        best = max(best, ops / (time.perf_counter() - start))
    return best


# ---------------------------------------------------------- query and memory


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[len(samples) // 2], samples[min(len(samples) - 1, int(len(samples) * 0.99))]


async def _query_latencies(
    index: PrefixIndex, held: dict[str, list[int]], seconds: float, seed: int
) -> tuple[list[QueryResult], StageResult]:
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
                sub.sink = IndexSink(index, sub.stream_id)
        service.index = index
        all_docs = sorted({d for ds in held.values() for d in ds})
        held_ids = [rng.choice(all_docs) for _ in range(50)]
        kinds = {
            "held document (full 512-block walk)": (held_ids, False),
            "fresh prompt (system prompt only)": ([10_000_000 + i for i in range(50)], False),
            "held document, pending entries present": (held_ids, True),
        }
        results = []
        for kind, (doc_ids, with_pending) in kinds.items():
            prompts = [(doc_namespace(d), doc_tokens(d, 16)) for d in doc_ids]
            if with_pending:
                # a live router marks every routed prompt pending for a few seconds: the walk
                # then also reads the pending table (other prompts' entries, here)
                for i in range(64):
                    ns, tokens = doc_namespace(20_000_000 + i), doc_tokens(20_000_000 + i, 16)
                    index.add_pending(rng.choice(list(held)), ns, tokens)
            rounds: list[list[float]] = []
            match_samples: list[float] = []
            matched = 0
            for _ in range(ROUNDS):
                samples: list[float] = []
                deadline = time.perf_counter() + seconds / ROUNDS
                while time.perf_counter() < deadline and len(samples) < 4_000:
                    for ns, tokens in prompts:
                        t0 = time.perf_counter_ns()
                        out = service.query(ns, tokens)
                        samples.append((time.perf_counter_ns() - t0) / 1000)
                        matched += max(m.matched_blocks for m in out.values())
                    # the index alone in a sweep of its own: right after the service call on
                    # the same prompt it would find that prompt's entries still in the CPU cache
                    for ns, tokens in prompts:
                        t0 = time.perf_counter_ns()
                        index.match(ns, tokens)
                        match_samples.append((time.perf_counter_ns() - t0) / 1000)
                rounds.append(samples)
            index.pending.clear()
            everything = [x for r in rounds for x in r]
            p50, p99 = _percentiles(everything)
            quiet_p50, quiet_p99 = min((_percentiles(r) for r in rounds), key=lambda q: q[1])
            match_p50, match_p99 = _percentiles(match_samples)
            results.append(
                QueryResult(
                    kind=kind,
                    queries=len(everything),
                    p50_us=p50,
                    p99_us=p99,
                    quiet_p50_us=quiet_p50,
                    quiet_p99_us=quiet_p99,
                    mean_matched_blocks=matched / len(everything),
                    match_p50_us=match_p50,
                    match_p99_us=match_p99,
                )
            )
        prompts = [(doc_namespace(d), doc_tokens(d, 16)) for d in held_ids]
        return results, _stages(index, service, prompts)


def match_latencies(
    index: PrefixIndex, held: dict[str, list[int]], seconds: float, seed: int
) -> tuple[float, float]:
    """p50/p99 of `PrefixIndex.match` on held documents (the python-backend comparison)."""
    rng = random.Random(seed)
    all_docs = sorted({d for ds in held.values() for d in ds})
    prompts = [
        (doc_namespace(d), doc_tokens(d, 16)) for d in (rng.choice(all_docs) for _ in range(50))
    ]
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and len(samples) < 10_000:
        for ns, tokens in prompts:
            t0 = time.perf_counter_ns()
            index.match(ns, tokens)
            samples.append((time.perf_counter_ns() - t0) / 1000)
    return _percentiles(samples)


def admin_operations(index: PrefixIndex, backend: Backend) -> AdminResult:
    """Time snapshot dump and load, then a namespace eviction and a stream clear on the loaded
    copy (`index` itself is left as it was)."""
    entries = len(index)
    t0 = time.perf_counter()
    data = dump_index(index)
    t1 = time.perf_counter()
    loaded = load_index(data, backend=backend)
    t2 = time.perf_counter()
    assert len(loaded) == entries
    evicted = loaded.evict_namespace(doc_namespace(0))  # tenant-0's namespace
    t3 = time.perf_counter()
    cleared = loaded.clear_stream(loaded.streams()[0])
    t4 = time.perf_counter()
    del loaded
    return AdminResult(
        entries, t1 - t0, len(data) / 2**20, t2 - t1, t3 - t2, evicted, t4 - t3, cleared
    )


def _stages(
    index: PrefixIndex, service: IndexerService, prompts: list[tuple[Namespace, list[int]]]
) -> StageResult:
    """Median per-query cost of each stage over the held-document prompts (a few passes)."""
    get_many = index._table.get_many
    chain = index.backend.chain
    seeds = {ns: namespace_seed(ns, PAGE) for ns, _ in prompts}

    def floor(ns: Namespace, tokens: list[int]) -> object:
        return get_many(keys(ns, tokens), 0)

    def keys(ns: Namespace, tokens: list[int]) -> list[int]:
        return chain(seeds[ns], tokens, PAGE, 0, -1)

    def python_keys(ns: Namespace, tokens: list[int]) -> object:
        return py_chain(seeds[ns], tokens, PAGE)

    naive = NaiveIndex.mirror(index)
    stages: dict[str, list[float]] = {}
    fns: dict[str, Callable[[Namespace, list[int]], object]] = {
        "python_keys": python_keys,
        "keys": keys,
        "floor": floor,
        "match": index.match,
        "service": service.query,
        "naive": naive.match,
    }
    for _ in range(5):
        for name, fn in fns.items():
            for ns, tokens in prompts:
                t0 = time.perf_counter_ns()
                fn(ns, tokens)
                stages.setdefault(name, []).append((time.perf_counter_ns() - t0) / 1000)
    streams = index.streams()
    for i, (ns, tokens) in enumerate(prompts * 2):
        # a stream that holds the prompt (only the blocks it misses are marked) and one that
        # may not, as routing does: after the router picks a worker it marks the prompt there
        t0 = time.perf_counter_ns()
        index.add_pending(streams[i % len(streams)], ns, tokens)
        stages.setdefault("pending", []).append((time.perf_counter_ns() - t0) / 1000)
    index.pending.clear()
    steady = _steady_pending(index.backend, prompts)
    # the admission forecast's recency book, as routing feeds it
    book = RecencyBook(index.backend.int_map)
    stride = recency_stride(PAGE)
    for ns, tokens in prompts * 2:
        touched = keys(ns, tokens)[::stride]
        t0 = time.perf_counter_ns()
        book.touch(touched)
        stages.setdefault("recency", []).append((time.perf_counter_ns() - t0) / 1000)
    med = {name: _percentiles(v)[0] for name, v in stages.items()}
    for ns, tokens in prompts[:5]:  # the baseline answers the same question
        found = index.match(ns, tokens).blocks
        assert {s: d for s, d in naive.match(ns, tokens).items() if d} == found
    return StageResult(
        med["python_keys"],
        med["keys"],
        med["floor"],
        med["match"],
        med["service"],
        med["naive"],
        med["pending"],
        med["recency"],
        steady,
    )


def _steady_pending(backend: Backend, prompts: list[tuple[Namespace, list[int]]]) -> float:
    """Median µs of `add_pending` in a live router's steady state: 100 prompts/s over 8
    streams with the default 2 s TTL, so each new mark retires the one made 2 s (200 marks)
    before it, on a clock the loop advances."""
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0], pending_ttl_s=2.0, backend=backend)
    streams = [f"s{i}" for i in range(8)]
    for sid in streams:
        index.add_stream(sid, model=MODEL, block_size=PAGE)
    samples: list[float] = []
    for i in range(1_200):
        now[0] += 0.01
        ns, tokens = prompts[(i * 7) % len(prompts)]
        t0 = time.perf_counter_ns()
        index.add_pending(streams[i % len(streams)], ns, tokens)
        if i >= 400:  # past the first TTL: every call retires a mark from here on
            samples.append((time.perf_counter_ns() - t0) / 1000)
    return _percentiles(samples)[0]


# ---------------------------------------------------------------- report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute bench index`."""
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    parser.add_argument(
        "--recording",
        type=Path,
        default=None,
        help="ingest this `kvroute record` capture instead of the synthetic stream",
    )
    parser.add_argument("--batches", type=int, default=2000, help="ingest batches")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument(
        "--docs-per-stream", type=int, default=61, help="8,192-token documents held per stream"
    )
    parser.add_argument("--pool", type=int, default=2000, help="distinct documents to draw from")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--backend",
        choices=["native", "python"],
        default=DEFAULT.name,
        help="index backend to measure (default: %(default)s); with native, the python "
        "backend is measured too, as the baseline",
    )
    parser.add_argument("--output", "--out", type=Path, default=DEFAULT_OUTPUT)


def run(args: argparse.Namespace) -> int:
    """Run the three measurements and write the report."""
    if args.backend == "native" and NATIVE is None:
        print(
            "the compiled backend is not available (C extensions not built); use --backend python"
        )
        return 2
    backend = NATIVE if args.backend == "native" and NATIVE is not None else PURE
    print(f"index bench: seed={args.seed} backend={backend.name}")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.recording
        if path is None:
            path = Path(tmp) / "ingest.kvrec"
            record_ingest_workload(path, ingest_workload(args.seed, args.batches, 50_000))
        records, block_sizes = read_recording(path)
    print(
        f"ingest input: {len(records):,} records from {args.recording or 'a synthetic recording'}"
    )
    ingest = bench_ingest(records, args.seconds, block_sizes, backend)
    print(f"ingest: {ingest.decode_apply_ops_s:,.0f} block ops/s (decode + apply)")
    del records
    index, held, shared, _ = build_index(
        args.streams, args.docs_per_stream, args.pool, args.seed, backend
    )
    print(f"memory: {shared.entries:,} entries, {shared.bytes_per_entry:.0f} bytes/entry")
    admin = admin_operations(index, backend)  # before the query service takes the streams
    print(f"admin: {admin}")
    gc.collect()
    queries, stages = asyncio.run(_query_latencies(index, held, args.seconds, args.seed))
    for q in queries:
        print(
            f"query {q.kind}: p50 {q.p50_us:.0f} us, p99 {q.p99_us:.0f} us "
            f"(quietest round: p50 {q.quiet_p50_us:.0f} us, p99 {q.quiet_p99_us:.0f} us)"
        )
    print(f"stages: {stages}")
    del index, held
    gc.collect()
    compared = None
    if backend is not PURE:
        index, held, slow, _ = build_index(
            args.streams, args.docs_per_stream, args.pool, args.seed, PURE
        )
        p50, p99 = match_latencies(index, held, args.seconds, args.seed)
        compared = BackendResult(
            PURE.name, ingest.python_decode_apply_ops_s, p50, p99, slow.bytes_per_entry
        )
        print(
            f"python backend: match p50 {p50:.0f} us, p99 {p99:.0f} us, "
            f"{slow.bytes_per_entry:.0f} B/entry"
        )
        del index, held
        gc.collect()
    small = max(1, args.docs_per_stream // 8)
    _, _, unshared, _ = build_index(args.streams, small, None, args.seed, backend)
    print(f"memory (no sharing): {unshared.bytes_per_entry:.0f} bytes/entry")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    params = (
        f"seed={args.seed}, batches={args.batches}, streams={args.streams}, "
        f"docs/stream={args.docs_per_stream}, pool={args.pool}, seconds={args.seconds}, "
        f"ingest input={args.recording or 'synthetic stream, recorded to a kvrec file'}"
    )
    args.output.write_text(
        render(ingest, queries, stages, [shared, unshared], params, backend.name, compared, admin)
    )
    print(f"wrote {args.output}")
    return 0
