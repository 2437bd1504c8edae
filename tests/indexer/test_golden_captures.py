"""Every golden capture, decoded by the real decoder and applied to an index event by event,
gives the namespaces and prefixes an independent reading of its `expected` events says.

The reading (written here, not shared with the index): an SGLang block lands in
(model, lora_name, cache_salt) of its event; a vLLM block without a parent takes the salt from
the last string of `extra_keys[0]` (after the LoRA name) and children inherit their parent's
namespace; a block's prefix is its parent's prefix plus its own tokens; partial pages never
match; BlockRemoved forgets, AllBlocksCleared empties the stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from indexer.backend import PURE
from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol.decode import decode_batch
from indexer.protocol.events import EventBatch
from indexer.protocol.frames import ReplayData, parse_replay_reply
from tests.indexer.backends import native_or_skip

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kv-events"
MODEL = "m"


def _token(t: Any) -> Any:
    return tuple(t) if isinstance(t, list) else t


def _hash(h: Any) -> Any:
    return bytes.fromhex(h["bytes_hex"]) if isinstance(h, dict) else h


class Reading:
    """What a stream holds according to the expected events: hash -> (namespace, prefix)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.held: dict[Any, tuple[Namespace, tuple[Any, ...], bool]] = {}
        # a stream learns its page size from a store of two or more pages, or (SGLang) from a
        # run: a one-page store chained on the whole one-page store held right before it in
        # the same batch; a lone page may be a partial one. Until then a vLLM one-page store
        # is not held, and SGLang's events wait in order (`waiting`)
        self.sized = False
        self.waiting: list[dict[str, Any]] = []
        self.batch_starts = 0  # index in `waiting` where the current batch's events begin

    def new_batch(self) -> None:
        self.batch_starts = len(self.waiting)

    def apply(self, ev: dict[str, Any]) -> None:
        if not self.sized and self.engine != "vllm" and ev["type"] != "AllBlocksCleared":
            parent = _hash(ev.get("parent_block_hash"))
            last = self.waiting[-1] if len(self.waiting) > self.batch_starts else None
            chained = (
                last is not None
                and last["type"] == "BlockStored"
                and len(last["block_hashes"]) == 1
                and _hash(last["block_hashes"][0]) == parent
                and len(last["token_ids"]) == last["block_size"] >= ev["block_size"]
            )
            if ev["type"] != "BlockStored" or (len(ev["block_hashes"]) < 2 and not chained):
                self.waiting.append(ev)
                return
            self.sized = True
            for w in self.waiting:
                self.apply(w)
            self.waiting.clear()
        kind = ev["type"]
        if kind == "AllBlocksCleared":
            self.waiting.clear()
            self.batch_starts = 0
            self.held.clear()
        elif kind == "BlockRemoved":
            for h in ev["block_hashes"]:
                self.held.pop(_hash(h), None)
        elif kind == "BlockStored":
            self._store(ev)

    def _store(self, ev: dict[str, Any]) -> None:
        if not self.sized:  # vLLM
            if len(ev["block_hashes"]) < 2:
                return
            self.sized = True
        parent = _hash(ev["parent_block_hash"])
        # an adapter named by id alone: a namespace no request names
        lora = ev["lora_name"] or (f"\x00lora_id:{ev['lora_id']}" if ev["lora_id"] else None)
        if parent is not None:
            if parent not in self.held:
                return
            parent_ns, prefix, parent_partial = self.held[parent]
        else:
            parent_ns, prefix, parent_partial = None, (), False
        if self.engine == "vllm":
            if parent_ns is not None:
                ns = parent_ns
            else:
                first = (ev["extra_keys"] or [None])[0] or []
                if lora is not None and first and first[0] == ev["lora_name"]:
                    first = first[1:]
                ns = Namespace(MODEL, lora, first[-1] if first else None)
        else:
            ns = Namespace(MODEL, lora, ev["cache_salt"])
        size = ev["block_size"]
        tokens = [_token(t) for t in ev["token_ids"]]
        partial = parent_partial or size < 4  # every capture uses page size 4
        for i, h in enumerate(ev["block_hashes"]):
            prefix = prefix + tuple(tokens[i * size : (i + 1) * size])
            self.held[_hash(h)] = (ns, prefix, partial)

    def depth(self, ns: Namespace, tokens: tuple[Any, ...]) -> int:
        have = {p for n, p, partial in self.held.values() if n == ns and not partial}
        d = 0
        while (d + 1) * 4 <= len(tokens) and tokens[: (d + 1) * 4] in have:
            d += 1
        return d

    def check(self, index: PrefixIndex, stream: str) -> None:
        assert index.entries(stream) == len(self.held)
        namespaces = {ns for ns, _, _ in self.held.values()} | {Namespace(MODEL)}
        expected_sizes: dict[Namespace, int] = {}
        for ns, prefix, partial in self.held.values():
            if not partial:
                expected_sizes[ns] = expected_sizes.get(ns, 0) + 1
            for other in namespaces:
                got = index.query(other, _request(prefix))[stream].blocks
                assert got == self.depth(other, prefix), (other, prefix)
        assert {s.namespace: s.blocks for s in index.namespaces()} == expected_sizes


def _request(prefix: tuple[Any, ...]) -> list[Any]:
    """The tokens of a request whose key is `prefix`: on SGLang EAGLE bigram pages, the raw
    tokens whose (prev, next) pairs the pages are (n tokens make n - 1 pairs)."""
    if prefix and isinstance(prefix[0], tuple):
        return [pair[0] for pair in prefix] + [prefix[-1][1]]
    return list(prefix)


def _engine(doc: dict[str, Any]) -> str:
    return "vllm" if doc["producer"]["engine"] == "vllm" else "sglang"


def _run(doc: dict[str, Any], messages: list[tuple[bytes, list[dict[str, Any]]]]) -> None:
    index = PrefixIndex(backend=PURE)
    _check(doc, messages, index)
    index = PrefixIndex(backend=native_or_skip())
    _check(doc, messages, index)


def _check(
    doc: dict[str, Any], messages: list[tuple[bytes, list[dict[str, Any]]]], index: PrefixIndex
) -> None:
    engine = _engine(doc)
    reading = Reading(engine)
    done: list[EventBatch] = []
    # after each event: a fresh index takes the batches before, then this batch up to the
    # event, as one batch (a page size is proven by a run of pages within one batch, so
    # one event a batch would not be what the engine published)
    for payload, expected_events in messages:
        batch = decode_batch(payload)
        assert len(batch.events) == len(expected_events)
        reading.new_batch()
        for k, want in enumerate(expected_events, start=1):
            fresh = PrefixIndex(backend=index.backend)
            fresh.add_stream("s", model=MODEL, engine=engine)  # type: ignore[arg-type]
            for before in done:
                fresh.apply("s", before)
            fresh.apply("s", EventBatch(batch.ts, batch.events[:k]))
            reading.apply(want)
            reading.check(fresh, "s")
        done.append(batch)


def _live_files() -> list[Path]:
    return sorted(p for p in FIXTURES.glob("*-live-*.json"))


@pytest.mark.parametrize("path", _live_files(), ids=lambda p: p.stem)
def test_live_capture(path: Path) -> None:
    doc = json.loads(path.read_text())
    payload = bytes.fromhex(doc["frames"][2])
    _run(doc, [(payload, doc["expected"]["events"])])


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*-replay*.json")), ids=lambda p: p.stem)
def test_replay_capture(path: Path) -> None:
    doc = json.loads(path.read_text())
    messages = []
    batches = iter(doc["expected"]["batches"])
    for reply in doc["replies"]:
        parsed = parse_replay_reply([bytes.fromhex(f) for f in reply])
        if isinstance(parsed, ReplayData):
            messages.append((parsed.payload, next(batches)["events"]))
    _run(doc, messages)


def test_radix_scenario() -> None:
    doc = json.loads((FIXTURES / "scenario-radix-salted.json").read_text())
    messages = [
        (bytes.fromhex(op["frames"][2]), op["expected"]["events"])
        for op in doc["operations"]
        if op["frames"] is not None
    ]
    _run(doc, messages)


def test_salted_and_inherited_namespaces() -> None:
    """The headline facts, spelled out on two captures."""
    sglang = json.loads((FIXTURES / "sglang-0.5.20-live-map-session.json").read_text())
    index = PrefixIndex()
    index.add_stream("s", model=MODEL)
    batch = decode_batch(bytes.fromhex(sglang["frames"][2]))
    index.apply("s", EventBatch(0.0, batch.events[:3]))
    salted = [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 2000, 2001, 2002, 2003]
    assert index.query(Namespace(MODEL, None, "tenant-b"), salted)["s"].blocks == 3
    assert index.query(Namespace(MODEL), salted)["s"].blocks == 2  # the unsalted node's 2 pages
    assert index.query(Namespace(MODEL, None, "tenant-a"), salted)["s"].blocks == 0

    vllm = json.loads((FIXTURES / "vllm-0.33.0-live-map.json").read_text())
    index = PrefixIndex()
    index.add_stream("v", model=MODEL, engine="vllm")
    batch = decode_batch(bytes.fromhex(vllm["frames"][2]))
    index.apply("v", EventBatch(0.0, batch.events[:3]))
    tokens = list(range(1, 13))
    # the child block (no extra_keys of its own) inherited tenant-a from its parent
    assert index.query(Namespace(MODEL, None, "tenant-a"), tokens)["v"].blocks == 3
    assert index.query(Namespace(MODEL), tokens)["v"].blocks == 0
    assert index.query(Namespace(MODEL, "sql-adapter"), tokens)["v"].blocks == 1
