"""Shared fixtures of the reference-worker tests: the golden KV-event captures."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from indexer.protocol.events import BlockHash, Cleared, Event, Removed, Stored

_PROJECT_COPY = Path(__file__).resolve().parent.parent / "fixtures" / "kv-events"
_SHARED_COPY = Path("/work/shared/fixtures/kv-events")


def load_fixture(name: str) -> Any:
    """A golden capture by file name: the project's copy when present, else the shared one."""
    for folder in (_PROJECT_COPY, _SHARED_COPY):
        path = folder / name
        if path.exists():
            return json.loads(path.read_text(encoding="utf-8"))
    pytest.skip(f"fixture {name} is not available")


@pytest.fixture(scope="session")
def kv_fixture() -> Callable[[str], Any]:
    """The fixture loader, for tests that need other captures."""
    return load_fixture


@pytest.fixture(scope="session")
def hash_vectors() -> Any:
    """hash-vectors.json: SGLang's own event hashes."""
    return load_fixture("hash-vectors.json")


@pytest.fixture(scope="session")
def scenario() -> Any:
    """scenario-radix-salted.json: what SGLang's real RadixCache emitted, step by step."""
    return load_fixture("scenario-radix-salted.json")


class EventConsumer:
    """A minimal subscriber: rebuilds the set of cached pages from the events alone.

    Default-format hashes ignore extra_key, so two namespaces that differ only in extra_key
    publish the same hashes: like any real consumer, count references per hash.
    """

    def __init__(self) -> None:
        # hash -> (parent hash, page tokens, salt)
        self.pages: dict[BlockHash, tuple[BlockHash | None, tuple[int, ...], str | None]] = {}
        self.refs: dict[BlockHash, int] = {}

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Cleared):
                self.pages.clear()
                self.refs.clear()
            elif isinstance(event, Stored):
                parent = event.parent
                for i, h in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                    page = (parent, tuple(int(t) for t in tokens), event.cache_salt)  # type: ignore[arg-type]
                    assert self.pages.setdefault(h, page) == page, "one hash, two pages"
                    self.refs[h] = self.refs.get(h, 0) + 1
                    parent = h
            else:
                assert isinstance(event, Removed)
                for h in event.block_hashes:
                    assert h in self.pages, "removed a page that was never stored"
                    self.refs[h] -= 1
                    if not self.refs[h]:
                        del self.pages[h], self.refs[h]

    def prefixes(self) -> set[tuple[str | None, tuple[int, ...]]]:
        """Every cached page as (salt, full token prefix), following parent links."""
        out = set()
        for h in self.pages:
            tokens: tuple[int, ...] = ()
            salt = self.pages[h][2]
            current: BlockHash | None = h
            while current is not None:
                parent, page, _ = self.pages[current]
                tokens = page + tokens
                current = parent
            out.add((salt, tokens))
        return out


@pytest.fixture(scope="session")
def event_consumer() -> type[EventConsumer]:
    """The minimal event consumer class, rebuilding cached pages from events alone."""
    return EventConsumer
