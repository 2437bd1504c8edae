"""The index benchmark's inputs: a realistic SGLang event stream, held documents, a baseline.

- `ingest_workload`: a coalesced SGLang stream (page size 16) of multi-turn sessions over shared
  system prompts, half of them salted by tenant, with FIFO eviction once the pool is full,
  recorded to a `kvroute record` file and read back (`record_ingest_workload`, `read_recording`);
- `build_index`: ~2M (block, stream) entries of 8,192-token documents over 64 streams;
- `NaiveIndex`: the dict-of-sets baseline the report compares with.

`bench.index_bench` runs the measurements; `bench.index_report` writes them.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc
from collections import deque
from pathlib import Path

import msgspec

from bench.index_report import MemoryResult
from indexer.backend import DEFAULT, Backend
from indexer.index import PrefixIndex
from indexer.namespace import Namespace, chain_keys, namespace_seed
from indexer.protocol import BlockHash, EventBatch, Removed, Stored, encode_batch
from indexer.recording.format import RecordingReader, RecordingWriter, Source
from indexer.service import stream_id

PAGE = 16
MODEL = "bench-model"


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


class NaiveIndex:
    """The baseline: block key -> set of streams, per stream engine hash -> key, no tricks.

    Same key function and the same events as `PrefixIndex`, but one Python step per block and
    no namespace codes (isolation rests on the seeded keys alone). Only for comparison.
    """

    def __init__(self) -> None:
        self.table: dict[int, set[str]] = {}
        self.blocks: dict[str, dict[BlockHash, int]] = {}
        self._seeds: dict[str | None, int] = {}

    def seed(self, salt: str | None) -> int:
        """The chain seed of the bench model's namespace with `salt`."""
        seed = self._seeds.get(salt)
        if seed is None:
            seed = self._seeds[salt] = namespace_seed(Namespace(MODEL, None, salt), PAGE)
        return seed

    def apply(self, stream: str, batch: EventBatch) -> None:
        """Apply SGLang-style stores and removes, block by block."""
        blocks = self.blocks.setdefault(stream, {})
        table = self.table
        for ev in batch.events:
            if isinstance(ev, Stored):
                prev = self.seed(ev.cache_salt) if ev.parent is None else blocks.get(ev.parent)
                if prev is None:
                    continue
                keys = chain_keys(prev, ev.token_ids, PAGE)
                for h, key in zip(ev.block_hashes, keys, strict=False):
                    blocks[h] = key
                    table.setdefault(key, set()).add(stream)
            elif isinstance(ev, Removed):
                for h in ev.block_hashes:
                    gone = blocks.pop(h, None)
                    if gone is not None:
                        holders = table[gone]
                        holders.discard(stream)
                        if not holders:
                            del table[gone]

    def match(self, namespace: Namespace, tokens: list[int]) -> dict[str, int]:
        """Leading blocks held per stream, one set intersection per block."""
        depths: dict[str, int] = {}
        alive: set[str] | None = None
        done = 0
        for key in chain_keys(self.seed(namespace.cache_salt), tokens, PAGE):
            holders = self.table.get(key, set())
            now = holders if alive is None else alive & holders
            for stream in (alive or set()) - now:
                depths[stream] = done
            alive = now
            if not alive:
                break
            done += 1
        for stream in alive or ():
            depths[stream] = done
        return depths

    @classmethod
    def mirror(cls, index: PrefixIndex) -> NaiveIndex:
        """A naive index holding exactly `index`'s entries (sharing its int objects)."""
        naive = cls()
        for sid, st in index._streams.items():
            naive.blocks[sid] = dict(st.blocks)
            for key in st.blocks.values():
                naive.table.setdefault(key, set()).add(sid)
        return naive


class IngestRecord(msgspec.Struct, frozen=True):
    """One recorded message, as the ingest loop applies it."""

    stream: str
    seq: int
    payload: bytes


INGEST_STREAM = "w#dp0"


def record_ingest_workload(path: Path, payloads: list[bytes]) -> None:
    """Write the synthetic stream as a `kvroute record` file (one source, seqs from 0)."""
    source = Source(stream=INGEST_STREAM, topic="kv", block_size=PAGE, model=MODEL, worker="w")
    with RecordingWriter.create(path, [source], overwrite=True, buffer_bytes=1 << 20) as writer:
        for seq, payload in enumerate(payloads):
            writer.write(INGEST_STREAM, b"kv", seq, payload, recv_time=float(seq))


def read_recording(path: Path) -> tuple[list[IngestRecord], dict[str, int | None]]:
    """Every readable record of a recording, and each stream's block size from its header."""
    with RecordingReader(path) as reader:
        records = [IngestRecord(p.record.stream, p.record.seq, p.record.payload) for p in reader]
        if reader.damage is not None:
            print(f"recording damaged at byte {reader.damage.offset}: {reader.damage.reason}")
        return records, {sid: src.block_size for sid, src in reader.sources.items()}


def doc_tokens(doc_id: int, systems: int) -> list[int]:
    """8,192 tokens: one of `systems` shared system prompts (512 tokens), then the document."""
    system = list(random.Random(-1 - doc_id % systems).randbytes(32 * PAGE))
    return system + list(random.Random(doc_id).randbytes(8192 - 32 * PAGE))


def doc_namespace(doc_id: int) -> Namespace:
    return Namespace(MODEL, None, None if doc_id % 2 else f"tenant-{doc_id % 4}")


def build_index(
    streams: int, docs_per_stream: int, pool: int | None, seed: int, backend: Backend = DEFAULT
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
    docs = {d: doc_tokens(d, systems) for d in sorted({d for ds in held.values() for d in ds})}
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    # pending entries outlive the query rounds
    index = PrefixIndex(pending_ttl_s=3600.0, backend=backend)
    for sid in held:
        index.add_stream(sid, model=MODEL, block_size=PAGE)
    for sid, doc_ids in held.items():
        for d in doc_ids:
            tokens = docs[d]
            hashes = [_rand_hash(rng) for _ in range(len(tokens) // PAGE)]
            ns = doc_namespace(d)
            ev = _stored(hashes, None, tokens, ns.cache_salt)
            index.apply(sid, EventBatch(ts=0.0, events=[ev]))
    build_s = time.perf_counter() - start
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = len(index)
    unique = len(index._table)
    label = ("shared" if pool is not None else "no sharing") + f", {backend.name}"
    memory = MemoryResult(label, streams, entries, unique, grown, grown / entries, build_s)
    del docs
    return index, held, memory, label
