"""An opt-in pytest plugin that stalls the event loop now and then, as a loaded host does.

On a loaded CI host (two cores, other jobs beside) a test process can stop for a second or
more: the router and the in-process reference workers stop together, and every timer that fell
due meanwhile fires at once when it runs again. A test whose short timeout (a health check's
0.5 s, a 1 s deadline, a fake's delay) spans its own steps then fails now and then. Busy loops
beside the suite rarely cause such stalls (the scheduler shares the cores fairly); this does, at
the moments that matter: after a callback, once a stall is due, with a chance per callback, so
stalls land amid activity rather than in an idle wait.

    python3 -m pytest -p tests.stall_injection -p no:randomly tests/router/test_router_pd.py

Knobs (environment): KVROUTE_STALL_S ("0.6-1.3": a stall's length, drawn uniformly),
KVROUTE_STALL_GAP_S ("1.0-3.0": from a stall's end to when the next is due), KVROUTE_STALL_P
(0.05: its chance per callback once due), KVROUTE_STALL_SEED (else random). The seed is printed;
a failed test's report has a section listing its stalls.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

import pytest

__all__ = ["Stalls"]


def _span(name: str, default: str) -> tuple[float, float]:
    low, _, high = os.environ.get(name, default).partition("-")
    return float(low), float(high or low)


class Stalls:
    """When the next stall is due, how long each lasts, and the stalls of the running test."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        self._length = _span("KVROUTE_STALL_S", "0.6-1.3")
        self._gap = _span("KVROUTE_STALL_GAP_S", "1.0-3.0")
        self._p = float(os.environ.get("KVROUTE_STALL_P", "0.05"))
        self._due = time.monotonic() + self._rng.uniform(*self._gap)
        self.seen: list[str] = []

    def after(self, handle: asyncio.Handle) -> None:
        """Stall the loop (a blocking sleep) after `handle` ran, if one is due and drawn."""
        if time.monotonic() < self._due or self._rng.random() >= self._p:
            return
        length = self._rng.uniform(*self._length)
        # the callback's name only: a repr may read state too early (aiohttp's
        # ClientResponse.__repr__ reads `headers`, a reify: None cached before `start`)
        callback = getattr(handle, "_callback", None)
        name = getattr(callback, "__qualname__", type(callback).__name__)
        self.seen.append(f"{length:.2f} s after {name}")
        time.sleep(length)
        self._due = time.monotonic() + self._rng.uniform(*self._gap)


_STALLS = Stalls(int(os.environ.get("KVROUTE_STALL_SEED", str(random.randrange(1 << 30)))))
_run = asyncio.Handle._run


def _stalling_run(self: asyncio.Handle) -> None:
    _run(self)
    _STALLS.after(self)


asyncio.Handle._run = _stalling_run  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    print(f"stall injection: seed {_STALLS.seed} (KVROUTE_STALL_SEED)", file=sys.stderr)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _STALLS.seen.clear()


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    if call.when == "call" and call.excinfo is not None:
        item.add_report_section("call", "stalls", "\n".join(_STALLS.seen) or "none")
