"""Hostile event sequences never crash the index and never leave it inconsistent.

After every batch the shared table, namespace sizes, duplicate-key counts and tier tables are
recomputed from the per-stream maps and compared with what the index maintains incrementally.
Events are drawn adversarially: repeated hashes inside one event, hashes reused for other
content, unknown parents and removes, partial pages with children, odd media, page sizes that
do not fit, clears, evictions, snapshots reloaded mid-way.
"""

from __future__ import annotations

import os
import random

import pytest

from indexer import snapshot
from indexer.backend import PURE, Backend
from indexer.index import CODE_BITS, CODE_MASK, NS_MASK, PrefixIndex, ns_code
from indexer.index.media import best_medium
from indexer.namespace import Namespace
from indexer.protocol.events import Cleared, Event, EventBatch, Removed, Stored
from indexer.snapshot import dump_index, load_index
from tests.indexer.backends import native_or_skip


def check_invariants(index: PrefixIndex) -> None:
    table: dict[int, int] = {}
    ns_of: dict[int, int] = {}
    blocks_per_ns: dict[int, int] = {}
    for st in index._streams.values():
        counts: dict[int, int] = {}
        per_key: dict[int, int] = {}
        for key in st.blocks.values():
            v = index._table[key]
            ns_id = v & NS_MASK
            assert v & CODE_MASK == ns_code(ns_id)
            ns_of.setdefault(key, ns_id)
            assert ns_of[key] == ns_id
            table[key] = table.get(key, 0) | st.sbit
            counts[ns_id] = counts.get(ns_id, 0) + 1
            per_key[key] = per_key.get(key, 0) + 1
        assert {k: n for k, n in st.ns_counts.items() if n} == counts
        assert st.dup_keys == {k: n - 1 for k, n in per_key.items() if n > 1}
        assert all(n > 1 for n in st.refs.values())
        assert set(st.refs) <= set(st.blocks) | set(st.partial)
        for h, held in st.media.items():
            # copies per tier add up to the references; the best tier is the one indexed
            assert h in st.blocks and held and all(n > 0 for n in held.values())
            assert sum(held.values()) == st.refs.get(h, 1)
            best = best_medium(held)
            if best != index.default_medium:
                assert index._tiers[best][st.blocks[h]] & st.bit
    assert {k: v >> CODE_BITS for k, v in index._table.items()} == {
        k: v >> CODE_BITS for k, v in table.items()
    }
    for ns_id in ns_of.values():
        blocks_per_ns[ns_id] = blocks_per_ns.get(ns_id, 0) + 1
    got = {i: n for i, n in enumerate(index._registry.blocks) if n}
    assert got == blocks_per_ns
    # every id a value, a pending or a partial entry carries names a namespace (released ids
    # are never referenced), and the registry's two directions agree
    registry = index._registry
    referenced = set(ns_of.values()) | index.pending.namespaces()
    for st in index._streams.values():
        referenced.update(ns_id for _, ns_id in st.partial.values())
        for ns_id in st.ns_cache.values():
            assert registry.known(ns_id)
    assert all(registry.known(i) for i in referenced)
    assert all(registry.find(registry.names[i]) == i for i in registry.ids())  # type: ignore[arg-type]


def hostile_batch(rng: random.Random, held: list[object]) -> EventBatch:
    events: list[Event] = []
    for _ in range(rng.randrange(1, 5)):
        roll = rng.random()
        recent = held[-20:]
        if roll < 0.6:
            n = rng.randrange(1, 5)
            # a small hash space: hashes get stored twice (refcounts) and reused for other
            # content; a tiny token alphabet: different hashes share keys (dup_keys)
            hashes: list[object] = [rng.randrange(40) for _ in range(n)]
            if rng.random() < 0.05:
                hashes.append(hashes[0])  # one hash twice in one event
            if rng.random() < 0.05:
                hashes[0] = b"\x01" * 32
            page = 4 if rng.random() < 0.85 else rng.choice([2, 8, 0])
            if page == 2:
                hashes = hashes[:1]  # a trailing partial page
            tokens = [rng.randrange(3) for _ in range(len(hashes) * max(page, 1))]
            if rng.random() < 0.05:
                tokens = tokens[:-1]
            parent_roll = rng.random()
            parent = None
            if parent_roll < 0.5 and recent:
                parent = rng.choice(recent)
            elif parent_roll < 0.55:
                parent = rng.randrange(1000, 1010)  # never stored
            events.append(
                Stored(
                    block_hashes=hashes,  # type: ignore[arg-type]
                    parent=parent,  # type: ignore[arg-type]
                    token_ids=tokens,  # type: ignore[arg-type]
                    block_size=page,
                    medium=rng.choice([None, "GPU", "GPU", "CPU", "DISK"]),
                    cache_salt=rng.choice([None, None, "", "a"]),
                    lora_name=rng.choice([None, None, "l"]),
                    extra_keys=rng.choice([None, [["a"]], [["l", "b"]], [[]]]),  # type: ignore[arg-type]
                )
            )
            held.extend(hashes)
        elif roll < 0.97:
            pool = [*recent, 1, 2, 3, 12345]
            k = rng.randrange(1, 6)
            events.append(
                Removed(
                    block_hashes=[rng.choice(pool) for _ in range(k)],  # type: ignore[misc]
                    medium=rng.choice([None, None, "GPU", "CPU"]),  # offload: per-tier removes
                )
            )
        else:
            events.append(Cleared())
    return EventBatch(ts=0.0, events=events)


@pytest.mark.parametrize("seed", [11, 12, int(os.environ.get("KVROUTE_TEST_SEED", "13"))])
def test_hostile_sequences_keep_the_index_consistent(seed: int, backend: Backend) -> None:
    print(f"invariants seed={seed} backend={backend.name}")
    rng = random.Random(seed)
    index = PrefixIndex(backend=backend, namespace_sweep=2)  # ids released and reused often
    for name, engine in (("s", "sglang"), ("v", "vllm"), ("t", "sglang")):
        index.add_stream(name, model="m", engine=engine, block_size=4)  # type: ignore[arg-type]
    held: list[object] = []
    for step in range(600):
        stream = rng.choice(["s", "v", "t"])
        index.apply(stream, hostile_batch(rng, held), step)
        if rng.random() < 0.03:
            index.evict_namespace(Namespace("m", rng.choice([None, "l"]), rng.choice([None, "a"])))
        if rng.random() < 0.02:
            index = load_index(dump_index(index), backend=backend)
        if rng.random() < 0.01:
            index.drop_stream(stream)
            index.add_stream(stream, model="m", block_size=4)
        if rng.random() < 0.05:
            index.add_pending(stream, Namespace("m"), [rng.randrange(4) for _ in range(12)])
        check_invariants(index)
        index.query(Namespace("m", None, "a"), [rng.randrange(4) for _ in range(16)])


@pytest.mark.parametrize("seed", [31, int(os.environ.get("KVROUTE_TEST_SEED", "32"))])
def test_compiled_and_python_backends_agree(seed: int) -> None:
    print(f"backends seed={seed}")
    rng = random.Random(seed)
    native = PrefixIndex(backend=native_or_skip(), namespace_sweep=2)
    python = PrefixIndex(backend=PURE, namespace_sweep=2)
    both = (native, python)
    for index in both:
        for name, engine in (("s", "sglang"), ("v", "vllm")):
            index.add_stream(name, model="m", engine=engine, block_size=4)  # type: ignore[arg-type]
    held: list[object] = []
    matched = 0
    for step in range(500):
        stream = rng.choice(["s", "v"])
        batch = hostile_batch(rng, held)
        assert native.apply(stream, batch, step) == python.apply(stream, batch, step)
        if rng.random() < 0.03:
            doomed = Namespace("m", rng.choice([None, "l"]), rng.choice([None, "a"]))
            assert native.evict_namespace(doomed) == python.evict_namespace(doomed)
        if rng.random() < 0.05:
            tokens = [rng.randrange(4) for _ in range(12)]
            assert native.add_pending(stream, Namespace("m"), tokens) == python.add_pending(
                stream, Namespace("m"), tokens
            )
        assert state(native) == state(python), step
        for salt in (None, "a"):
            tokens = [rng.randrange(3) for _ in range(16)]
            want = python.query(Namespace("m", None, salt), tokens)
            assert native.query(Namespace("m", None, salt), tokens) == want
            matched += sum(m.blocks for m in want.values())
    assert matched, "no query ever matched: the comparison proved nothing"
    restored = load_index(dump_index(native), backend=PURE)
    assert state(restored) == state(python)


def steady_batch(rng: random.Random, held: list[object]) -> EventBatch:
    """SGLang-style traffic the inline store path takes, with hostile repeats mixed in."""
    events: list[Event] = []
    for _ in range(rng.randrange(1, 6)):
        if rng.random() < 0.75:
            n = rng.randrange(1, 5)
            # mostly fresh hashes (the steady case), sometimes a small space where they recur
            space = 60 if rng.random() < 0.3 else 1 << 40
            hashes: list[object] = [rng.randrange(space) for _ in range(n)]
            if rng.random() < 0.1:
                hashes.append(hashes[0])  # one hash twice in one event
            parent = rng.choice(held[-30:]) if held and rng.random() < 0.8 else None
            alphabet = 3 if rng.random() < 0.3 else 1000  # small: keys shared across streams
            events.append(
                Stored(
                    block_hashes=hashes,  # type: ignore[arg-type]
                    parent=parent,  # type: ignore[arg-type]
                    token_ids=[rng.randrange(alphabet) for _ in range(len(hashes) * 4)],
                    block_size=4,
                    medium=rng.choice([None, "GPU"]),
                    cache_salt=rng.choice([None, "a"]),
                )
            )
            held.extend(hashes)
        else:
            k = rng.randrange(1, 6)
            pool = [*held[-30:], 7]
            events.append(
                Removed(
                    block_hashes=[rng.choice(pool) for _ in range(k)],  # type: ignore[misc]
                    medium=rng.choice([None, None, "GPU", "CPU"]),  # offload: per-tier removes
                )
            )
    return EventBatch(ts=0.0, events=events)


def state(index: PrefixIndex) -> object:
    streams = {
        name: (
            dict(st.blocks.items()),
            st.refs,
            st.dup_keys,
            st.partial,
            {k: n for k, n in st.ns_counts.items() if n},
        )
        for name, st in index._streams.items()
    }
    # the sizes of the ids in use: a snapshot places only the namespaces it holds entries of,
    # so a loaded registry may lack trailing ids the original still keeps (unused, size 0)
    registry = index._registry
    sizes = {i: (n, registry.tokens[i]) for i, n in enumerate(registry.blocks) if n}
    return dict(index._table.items()), streams, sizes


@pytest.mark.parametrize("seed", [21, int(os.environ.get("KVROUTE_TEST_SEED", "22"))])
def test_inline_store_path_equals_the_general_one(seed: int, backend: Backend) -> None:
    print(f"inline store seed={seed} backend={backend.name}")
    rng = random.Random(seed)
    fast, slow = PrefixIndex(backend=backend), PrefixIndex(backend=backend)
    slow._writer.store = slow._writer._store_general  # type: ignore[method-assign]
    for index in (fast, slow):
        for name in ("s", "t"):
            index.add_stream(name, model="m", block_size=4)
    held: list[object] = []
    for step in range(400):
        stream = rng.choice(["s", "t"])
        batch = steady_batch(rng, held)
        assert fast.apply(stream, batch, step) == slow.apply(stream, batch, step)
        if rng.random() < 0.02:
            fast.apply(stream, EventBatch(ts=0.0, events=[Cleared()]))
            slow.apply(stream, EventBatch(ts=0.0, events=[Cleared()]))
        check_invariants(fast)
        assert state(fast) == state(slow)


@pytest.mark.parametrize("seed", [41, int(os.environ.get("KVROUTE_TEST_SEED", "42"))])
def test_bulk_snapshot_load_equals_the_entry_by_entry_one(
    seed: int, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bulk linking of a snapshot's entries builds exactly what the per-entry loop builds:
    keys shared across streams, keys repeated within a stream, several namespaces per stream."""
    print(f"bulk load seed={seed} backend={backend.name}")
    rng = random.Random(seed)
    index = PrefixIndex(backend=backend)
    for name in ("s", "v", "t"):
        index.add_stream(name, model="m", block_size=4)
    held: list[object] = []
    compared = 0
    for step in range(300):
        index.apply(rng.choice(["s", "v", "t"]), hostile_batch(rng, held), step)
        if step % 25 == 24:
            data = dump_index(index)
            bulk = load_index(data, backend=backend)
            with monkeypatch.context() as m:
                m.setattr(snapshot, "_link", snapshot._link_one_by_one)
                one_by_one = load_index(data, backend=backend)
            check_invariants(bulk)
            assert state(bulk) == state(one_by_one) == state(index), step
            compared += sum(st.dup_keys != {} for st in bulk._streams.values())
    assert compared, "no stream ever had a repeated key: the comparison missed that path"
