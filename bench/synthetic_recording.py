"""A synthetic SGLang-like fleet written as a recording: input for tests and benchmarks.

`synthesize_recording` plays a multi-tenant, salted, multi-turn workload against simulated paged
prefix caches (SGLang's salted hash chain, coalesced `BlockStored`, LRU eviction as
`BlockRemoved`) and writes what their publishers would have sent, in the `kvroute record` file
format, so everything that reads recordings can be exercised without a fleet.
"""

from __future__ import annotations

import os
import random
from collections import OrderedDict

import msgspec

from indexer.protocol.encode import WireLayout, encode_batch
from indexer.protocol.events import BlockHash, EventBatch, Removed, Stored
from indexer.recording.format import RecordingWriter, Source
from workers.hashing import digest_to_hash, page_digests, salt_seed

__all__ = ["SyntheticWorkload", "synthesize_recording"]


class SyntheticWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """A scripted SGLang-like fleet: multi-tenant, salted, multi-turn, under cache pressure.

    Tenants share a few system prompts (so salted tenants with identical text land in different
    namespaces), conversations grow by turns (prefix reuse), each stream's paged cache holds
    `capacity_pages` pages and evicts LRU leaves (BlockRemoved), and every request is one batch
    with SGLang's coalescing (one BlockStored per run of new pages, parent = last cached page).
    """

    streams: int = 4
    tenants: int = 8
    salted_fraction: float = 0.75
    system_prompts: int = 3
    system_tokens: int = 256
    turns: int = 4
    turn_tokens: int = 64
    conversations: int = 100
    page_size: int = 16
    capacity_pages: int = 1024
    rate_per_s: float = 500.0
    layout: WireLayout = "array"
    model: str = "sim"
    seed: int = 0


class _SimCache:
    """One stream's paged prefix cache: SGLang's hash chain, LRU eviction of leaves."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, int | None] = OrderedDict()  # page hash -> parent hash
        self.children: dict[int, int] = {}

    def request(self, tokens: list[int], salt: str | None, page: int) -> list[Stored | Removed]:
        """The events of caching `tokens` (full pages only, like SGLang's page-aligned keys)."""
        full = tokens[: len(tokens) // page * page]
        path = [digest_to_hash(d) for d in page_digests(full, page, salt_seed(salt))]
        new_from = next((i for i, h in enumerate(path) if h not in self.lru), None)
        events: list[Stored | Removed] = []
        if new_from is not None:
            evicted = self._evict(len(path) - new_from, set(path))
            if evicted:
                removed: list[BlockHash] = list(evicted)
                events.append(Removed(block_hashes=removed, medium="GPU"))
            parent = path[new_from - 1] if new_from else None
            for i in range(new_from, len(path)):
                self.lru[path[i]] = path[i - 1] if i else None
                if i:
                    self.children[path[i - 1]] = self.children.get(path[i - 1], 0) + 1
            stored: list[BlockHash] = list(path[new_from:])
            events.append(
                Stored(
                    block_hashes=stored,
                    parent=parent,
                    token_ids=list(tokens[new_from * page : len(path) * page]),
                    block_size=page,
                    medium="GPU",
                    cache_salt=salt,
                )
            )
        for h in reversed(path):  # deepest first, so a parent is always fresher than its child
            self.lru.move_to_end(h)
        return events

    def _evict(self, needed: int, keep: set[int]) -> list[int]:
        evicted: list[int] = []
        while len(self.lru) + needed > self.capacity and self.lru:
            h = next(iter(self.lru))
            if h in keep or self.children.get(h):
                self.lru.move_to_end(h)  # only when the whole cache is this request's path
                if len(evicted) > self.capacity:
                    break
                continue
            parent = self.lru.pop(h)
            self.children.pop(h, None)
            if parent is not None and parent in self.children:
                self.children[parent] -= 1
            evicted.append(h)
        return evicted


def synthesize_recording(
    path: str | os.PathLike[str],
    workload: SyntheticWorkload | None = None,
    *,
    compress: bool = False,
    overwrite: bool = False,
) -> int:
    """Write a realistic recording of `workload` (for benchmarks and tests); returns records."""
    w = workload or SyntheticWorkload()
    rng = random.Random(w.seed)
    vocab = 50_000
    prompts = [
        [rng.randrange(vocab) for _ in range(w.system_tokens)] for _ in range(w.system_prompts)
    ]
    salted = int(w.tenants * w.salted_fraction)
    salts = [f"tenant-{t}" if t < salted else None for t in range(w.tenants)]
    caches = [_SimCache(w.capacity_pages) for _ in range(w.streams)]
    seqs = [0] * w.streams
    # stream ids follow the indexer service's "{worker}#dp{rank}"
    names = [f"sim-{i}#dp0" for i in range(w.streams)]
    sources = [
        Source(
            stream=f"sim-{i}#dp0",
            topic="kv",
            block_size=w.page_size,
            model=w.model,
            worker=f"sim-{i}",
        )
        for i in range(w.streams)
    ]
    # interleave conversations: each arrival is the next turn of a random open conversation
    pending = [(c, 1) for c in range(w.conversations)]
    turns_text = {
        c: [rng.randrange(vocab) for _ in range(w.turns * w.turn_tokens)]
        for c in range(w.conversations)
    }
    now = 1_700_000_000.0
    records = 0
    with RecordingWriter.create(
        path, sources, compress=compress, overwrite=overwrite, buffer_bytes=1 << 20
    ) as writer:
        while pending:
            i = rng.randrange(len(pending))
            conv, turn = pending[i]
            if turn >= w.turns:
                pending[i] = pending[-1]
                pending.pop()
            else:
                pending[i] = (conv, turn + 1)
            tenant = conv % w.tenants
            tokens = prompts[tenant % w.system_prompts] + turns_text[conv][: turn * w.turn_tokens]
            stream = conv % w.streams if rng.random() < 0.9 else rng.randrange(w.streams)
            events = caches[stream].request(tokens, salts[tenant], w.page_size)
            now += rng.expovariate(w.rate_per_s)
            if not events:
                continue
            batch = EventBatch(ts=now, events=list(events), dp_rank=0)
            payload = encode_batch(batch, w.layout)
            writer.write(names[stream], b"kv", seqs[stream], payload, recv_time=now)
            seqs[stream] += 1
            records += 1
    return records
