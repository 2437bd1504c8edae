"""Helpers shared by the record/replay tests: comparable index snapshots, a signalling writer."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from indexer.recording.format import RecordingWriter
from indexer.snapshot import _unseal


def canonical(dump: bytes) -> dict[str, Any]:
    """An index snapshot without what legitimately differs (slots, id order, counters)."""
    snap = msgspec.msgpack.decode(_unseal(dump))
    names = {
        i: tuple(ns) if isinstance(ns, list) else tuple(ns.values()) for i, ns in snap["namespaces"]
    }
    out: dict[str, Any] = {}
    for st in snap["streams"]:
        # the seq and the fence after the counters are positions in a stream, not its content
        name, _, model, engine, block_size, _, hashes, keys, ns_ids, refs, media, partial = st[:12]
        entries = sorted(
            (repr(h), k, names[n]) for h, k, n in zip(hashes, keys, ns_ids, strict=True)
        )
        if entries or refs or partial:
            out[name] = {
                "meta": (model, engine, block_size),
                "entries": entries,
                "refs": sorted(map(repr, refs)),
                "media": sorted(map(repr, media)),
                "partial": sorted((repr(h), k, names[n]) for h, k, n in partial),
            }
    return out


class CountingWriter(RecordingWriter):
    """Signals once the recorder has written `target` records."""

    target = 0
    reached: asyncio.Event

    def write(self, *args: Any, **kwargs: Any) -> int:
        number = super().write(*args, **kwargs)
        if self.records >= self.target:
            self.reached.set()
        return number
