"""`kvroute bench cluster`: what sharing costs between router replicas on NATS (loopback).

Four measurements, each against a real nats-server (JetStream) started for the run:

- decision propagation: replica a commits paced routing decisions (a pending mark of a
  1,024-token prompt and a load begin each, as the planner reports them); replica b records,
  for every batch it applies, the delay from a's publish (`time.time()` on both ends: one host,
  one clock). Both replicas share this process's event loop, so the delay includes waiting for
  the other's turns;
- warm start: replica a in front of a real reference worker holds a prompt the worker cached,
  plus `--entries` synthetic index entries on other streams; a publishes its snapshot; then a new
  replica c starts. Reported: snapshot size and publish time, c's start until ready (fleet read,
  snapshot fetched and loaded, the worker's stream proven by its replay), and whether c's very
  first request for the prompt was predicted as the hit it is (`x-kvroute-matched-tokens`);
- through the event relay: a reference worker's batches reach a replica subscribed to it and
  one following `kvroute relay`; reported, per replica, the delay from the batch's publish to
  its stream applying it;
- a peer's decision, received: every replica applies every other replica's decisions as its
  own (the prompt's pending marks and recency on the chosen worker, the load), so the fleet's
  request rate sets a cost on each replica. Replica b, in front of a real reference worker,
  decodes and applies batches as a peer publishes them (one routed request each: its pending
  mark, begin, first byte and end), for prompts of `--peer-prompt-tokens` token ids, sent as
  block keys (what a replica sends) and as token ids (what one before the keys sent); reported
  in b's process CPU time per request, decoding alone and with the applying.

The report goes to `docs/benchmarks/cluster.md`. Every loop is bounded by a count and a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import aiohttp
import msgspec

from bench.command import write_markdown
from bench.index_workload import _stored, doc_tokens
from indexer.namespace import Namespace, namespace_seed
from indexer.protocol import EventBatch
from indexer.protocol.decode import decode_batch
from indexer.service import stream_id
from router.cluster.server import NatsServer
from router.cluster.wire import (
    Batch,
    Begin,
    Decision,
    End,
    FirstByte,
    Pending,
    batch_decoder,
    encoder,
)
from router.config import AdminConfig, ClusterConfig, ListenConfig, RouterConfig, WorkerConfig
from router.service import RouterService
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

__all__ = ["add_arguments", "run"]

_PAGE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute bench cluster`."""
    parser.add_argument("--decisions", type=int, default=4000, help="decisions a publishes")
    parser.add_argument("--rate", type=float, default=2000.0, help="decisions per second")
    parser.add_argument("--entries", type=int, default=1_000_000, help="snapshot index entries")
    parser.add_argument(
        "--peer-prompt-tokens",
        default="1024,8192",
        help="comma-separated prompt lengths for the cost of applying a peer's decision",
    )
    parser.add_argument(
        "--relay-requests", type=int, default=400, help="worker batches through the relay"
    )
    parser.add_argument("--relay-rate", type=float, default=100.0, help="their rate per second")
    parser.add_argument("--output", "--out", default="docs/benchmarks/cluster.md")


def _replica(name: str, nats: str, workers: tuple[WorkerConfig, ...] = ()) -> RouterConfig:
    return RouterConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        admin=AdminConfig(enabled=True),
        workers=workers,
        cluster=ClusterConfig(
            url=nats, replica_id=name, snapshot_interval_s=0.0, startup_timeout_s=30.0
        ),
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _propagation(args: argparse.Namespace, nats: str) -> list[str]:
    async with (
        RouterService(_replica("a", nats)) as a,
        RouterService(_replica("b", nats)) as b,
    ):
        assert a.cluster is not None and b.cluster is not None
        rng = random.Random(1)
        tokens = [rng.randrange(3, 259) for _ in range(1024)]
        ns = Namespace("m", None, "tenant")
        load = a.planner.load
        b.cluster.peers.delays.clear()
        gap = 1.0 / args.rate
        start = time.perf_counter()
        deadline = start + 60.0
        for i in range(args.decisions):
            ticket = load.begin("w0", 1024)
            a.cluster.outbox.committed(ns, tokens, ticket, marked=True)
            load.end(ticket)
            a.cluster.outbox.finished(ticket)
            pause = start + (i + 1) * gap - time.perf_counter()
            await asyncio.sleep(max(0.0, pause))
            if time.perf_counter() > deadline:
                break
        await asyncio.sleep(0.5)  # the last batches land
        delays = [d * 1e3 for d in b.cluster.peers.delays]
    if not delays:
        return ["No batch arrived: propagation not measured."]
    return [
        f"| {args.decisions} | {args.rate:g} | {len(delays)} | {statistics.median(delays):.3f} | "
        f"{_pct(delays, 0.99):.3f} | {max(delays):.3f} |"
    ]


def _fill(index_service: object, entries: int) -> int:
    """Add about `entries` synthetic entries on 64 streams nobody serves; returns how many."""
    from indexer.service import IndexerService

    assert isinstance(index_service, IndexerService)
    index = index_service.index
    rng = random.Random(7)
    per_doc = 8192 // _PAGE
    docs = max(1, entries // per_doc)
    streams = [stream_id(f"synthetic-{s}", 0) for s in range(64)]
    for sid in streams:
        index.add_stream(sid, model="bench-model", block_size=_PAGE)
    for d in range(docs):
        tokens = doc_tokens(d, 16)
        hashes = [rng.getrandbits(63) for _ in range(per_doc)]
        event = _stored(hashes, None, tokens, None if d % 2 else f"tenant-{d % 4}")
        index.apply(streams[d % len(streams)], EventBatch(ts=0.0, events=[event]))
    return docs * per_doc


async def _warm_start(args: argparse.Namespace, nats: str) -> list[str]:
    cfg = ReferenceConfig(time_scale=0.0, page_size=_PAGE)
    async with ReferenceWorker(cfg) as worker, aiohttp.ClientSession() as session:
        fleet = (WorkerConfig(url=worker.url, id="w0"),)
        body = {"text": "a prompt the worker keeps " * 12, "sampling_params": {"max_new_tokens": 1}}
        async with RouterService(_replica("a", nats, fleet)) as a:
            assert a.cluster is not None
            for _ in range(200):  # the slow-joiner SUB: until the stream has applied the prompt
                async with session.post(a.url + "/generate", json=body) as resp:
                    await resp.read()
                    if int(resp.headers.get("x-kvroute-matched-tokens", "0")) > 0:
                        break
                await asyncio.sleep(0.05)
            filled = _fill(a.indexer, args.entries)
            total = len(a.indexer.index)
            started = time.perf_counter()
            size = await a.cluster.publish_snapshot()
            publish_s = time.perf_counter() - started
            started = time.perf_counter()
            async with RouterService(_replica("c", nats, fleet)) as c:
                ready_s = time.perf_counter() - started
                assert c.cluster is not None
                async with session.post(c.url + "/generate", json=body) as resp:
                    await resp.read()
                    matched = int(resp.headers.get("x-kvroute-matched-tokens", "0"))
                first_s = time.perf_counter() - started
                load_s = c.cluster.warm_start_s or 0.0
                fetch_s = c.cluster.fetch_s or 0.0
    return [
        f"| {total:,} ({filled:,} synthetic) | {size / 1e6:.1f} MB | {publish_s:.2f} | "
        f"{fetch_s:.2f} | {load_s - fetch_s:.2f} | {ready_s:.2f} | {first_s:.2f} | {matched} |"
    ]


async def _relay(args: argparse.Namespace, nats: str) -> list[str]:
    """Event delay to a replica subscribed to the worker and to one following the relay."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=_PAGE)
    async with ReferenceWorker(cfg) as worker, aiohttp.ClientSession() as session:
        fleet = (WorkerConfig(url=worker.url, id="w0"),)
        follower = _replica("f", nats, fleet)
        assert follower.cluster is not None
        follower = msgspec.structs.replace(
            follower, cluster=msgspec.structs.replace(follower.cluster, events="relay")
        )
        direct = msgspec.structs.replace(_replica("d", nats, fleet), cluster=None)
        delays: dict[str, list[float]] = {"direct": [], "relay": []}
        async with (
            RouterService(_replica("relay", nats, fleet), relay=True),
            RouterService(follower) as via_relay,
            RouterService(direct) as via_zmq,
        ):
            for name, service in (("direct", via_zmq), ("relay", via_relay)):
                service.indexer.applied_listeners.append(_delay_to(service, delays[name]))
            rng = random.Random(7)
            gap = 1.0 / args.relay_rate
            start = time.perf_counter()
            deadline = start + 60.0
            for i in range(args.relay_requests):
                ids = [rng.randrange(3, 259) for _ in range(4 * _PAGE)]
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
                async with session.post(worker.url + "/generate", json=body) as resp:
                    await resp.read()
                pause = start + (i + 1) * gap - time.perf_counter()
                await asyncio.sleep(max(0.0, pause))
                if time.perf_counter() > deadline:
                    break
            await asyncio.sleep(1.0)  # the last batches land
    rows = []
    for name, label in (("direct", "its own ZMQ subscription"), ("relay", "the relay's stream")):
        got = [d * 1e3 for d in delays[name]]
        if not got:
            rows.append(f"| {label} | 0 | - | - | - |")
            continue
        rows.append(
            f"| {label} | {len(got)} | {statistics.median(got):.3f} | {_pct(got, 0.99):.3f} | "
            f"{max(got):.3f} |"
        )
    return rows


def _delay_to(service: RouterService, into: list[float]) -> Callable[[str], None]:
    """An applied listener: the delay from the worker's publish (the batch's own time, on
    this host's clock) to its stream applying it in `service`."""

    def applied(stream: str) -> None:
        fence = service.indexer.index.fence(stream)
        payload = None if fence is None else fence.payload
        if payload is not None:
            into.append(time.time() - decode_batch(payload).ts)

    return applied


async def _peer_cost(args: argparse.Namespace, nats: str) -> list[str]:
    """Replica b's CPU per peer request it applies: rows per prompt length."""
    lengths = [int(n) for n in str(args.peer_prompt_tokens).split(",") if n.strip()]
    cfg = ReferenceConfig(time_scale=0.0, page_size=_PAGE)
    rows = []
    async with ReferenceWorker(cfg) as worker:
        fleet = (WorkerConfig(url=worker.url, id="w0"),)
        async with RouterService(_replica("b", nats, fleet)) as b:
            assert b.cluster is not None
            planner = b.planner
            deadline = time.monotonic() + 30.0
            # the stream's page size and the worker's pool, as the book needs them
            while not (
                (streams := planner.indexer.stream_ids("w0"))
                and planner.indexer.index.block_size(streams[0])
                and (entry := planner.pool.find("w0")) is not None
                and entry.capacity_tokens
            ):
                if time.monotonic() > deadline:
                    return ["The worker's stream never became known: not measured."]
                await asyncio.sleep(0.05)
            peers = b.cluster.peers
            rng = random.Random(3)
            ns = Namespace("m", None, "tenant")
            number = 0
            chain = planner.indexer.index.backend.chain
            seed = namespace_seed(ns, _PAGE)
            for length in lengths:
                # 16 prompts, each 8 times: a burst of siblings over a few prefixes
                docs = [[rng.randrange(32_000) for _ in range(length)] for _ in range(16)]
                for sent in ("block keys", "token ids"):
                    raw = []
                    for doc in docs * 8:
                        number += 1
                        if sent == "block keys":  # what a replica sends
                            keys = chain(seed, doc, _PAGE, 0, -1)
                            pending = Pending("w0", None, ns, [], number, 0, 0, _PAGE, keys)
                        else:  # what a replica from before the keys sent
                            pending = Pending("w0", None, ns, doc, number, 0, 0)
                        decisions: list[Decision] = [
                            pending,
                            Begin(number, "w0", None, length, 1),
                            FirstByte(number),
                            End(number),
                        ]
                        raw.append(encoder.encode(Batch("a", time.time(), decisions)))
                    started = time.process_time()
                    for message in raw:
                        batch_decoder.decode(message)
                    decode_us = (time.process_time() - started) / len(raw) * 1e6
                    started = time.process_time()
                    for message in raw:
                        peers.apply(batch_decoder.decode(message))
                    total_us = (time.process_time() - started) / len(raw) * 1e6
                    share = total_us * 1000 / 1e6 * 100  # % of a core at 1,000 requests/s
                    size = sum(map(len, raw)) / len(raw) / 1e3
                    rows.append(
                        f"| {length:,} | {sent} | {size:.1f} KB | {len(raw)} | {decode_us:.0f} | "
                        f"{total_us:.0f} | {share:.0f}% |"
                    )
    return rows


async def _run(args: argparse.Namespace) -> str:
    async with NatsServer() as nats:
        propagation = await _propagation(args, nats.url)
    async with NatsServer() as nats:
        warm = await _warm_start(args, nats.url)
    async with NatsServer() as nats:
        peer_cost = await _peer_cost(args, nats.url)
    async with NatsServer() as nats:
        relay = await _relay(args, nats.url)
    load = os.getloadavg()
    return "\n".join(
        [
            "# Router replicas on NATS",
            "",
            "Written by `kvroute bench cluster` (module docstring: `bench/cluster_bench.py`). "
            "A real nats-server with JetStream on 127.0.0.1, started for the run.",
            "",
            f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, load average "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end of the run.",
            "",
            "## Decision propagation (replica a publishes, replica b applies)",
            "",
            "Target: p99 <= 2 ms on loopback.",
            "",
            "| decisions | per second | batches applied | p50 ms | p99 ms | max ms |",
            "|---|---|---|---|---|---|",
            *propagation,
            "",
            "## Warm start from the snapshot in JetStream",
            "",
            "Target: a new replica warm (its first routed request hits) within 2 s of start at "
            "1 M index entries. `fetch` is reading the snapshot from the object store, `load` "
            "validating it into a fresh index (`load_index`); `ready` is the new replica's "
            "whole start (NATS, fleet, snapshot, the worker's stream proven by its replay, "
            "the listener); `first hit` adds its first request, whose predicted tokens are in "
            "the last column.",
            "",
            "| index entries | snapshot | publish s | fetch s | load s | ready s | first hit s | "
            "matched tokens |",
            "|---|---|---|---|---|---|---|---|",
            *warm,
            "",
            "## A peer's decision, received",
            "",
            "Every replica applies every other replica's decisions (the prompt's pending marks "
            "and recency on the chosen worker, the load), so each replica pays this for every "
            "request the rest of the fleet routes. Replica b's process CPU time per routed "
            "request of a peer (one batch: its pending mark, begin, first byte and end; the "
            "prompt as its block keys, as a replica sends it, or as its token ids, as one "
            "from before the keys did), "
            "decoding the NATS message alone and decoding with applying; the last column is "
            "what 1,000 such requests/s of the rest of the fleet cost b, in share of one core.",
            "",
            "| prompt tokens | the prompt sent as | message | requests | decode us | "
            "decode + apply us | at 1,000 req/s |",
            "|---|---|---|---|---|---|---|",
            *peer_cost,
            "",
            "## Through the event relay",
            "",
            "A reference worker publishes one batch per request (`--relay-requests` prompts of "
            f"{4 * _PAGE} tokens sent straight to it, `--relay-rate` a second); a replica "
            "subscribed to it directly and a replica following `kvroute relay` "
            '(`[cluster] events = "relay"`) both apply them. The delay is from the batch\'s '
            "own time (the worker's clock at publish; one host) to the stream applying it; all "
            "four processes' work shares this process's event loop, so the delays include "
            "waiting for the others' turns.",
            "",
            "| replica reading | batches applied | p50 ms | p99 ms | max ms |",
            "|---|---|---|---|---|",
            *relay,
            "",
        ]
    )


def run(args: argparse.Namespace) -> int:
    """Run the cluster benchmark and write its report."""
    report = asyncio.run(_run(args))
    write_markdown(report, args.output)
    return 0
