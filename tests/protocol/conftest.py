"""Shared access to the golden KV-event captures in tests/fixtures/kv-events/."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

FIXTURE_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "kv-events"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURE_DIR / name).read_text(encoding="utf-8"))
    return data


def _payloads() -> Iterator[tuple[str, bytes]]:
    """(label, payload) for every payload in every capture: live, replay and scenario."""
    for path in sorted(FIXTURE_DIR.glob("*.json")):
        data = _load(path.name)
        if data.get("frames"):
            yield path.name, bytes.fromhex(data["frames"][2])
        for reply in data.get("replies", []):
            if reply[-1]:
                yield path.name, bytes.fromhex(reply[-1])
        for op in data.get("operations", []):
            if op.get("frames"):
                yield f"{path.name}#{op['step']}", bytes.fromhex(op["frames"][2])


@pytest.fixture(scope="session")
def load_fixture() -> Callable[[str], dict[str, Any]]:
    """Load one capture's JSON by file name."""
    return _load


@pytest.fixture(scope="session")
def golden_payloads() -> list[tuple[str, bytes]]:
    """Every real payload in the captures, labelled by file (and scenario step)."""
    return list(_payloads())
