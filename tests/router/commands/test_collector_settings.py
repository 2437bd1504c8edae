"""A serving process settles the garbage collector once it is up: the startup heap frozen, the
youngest generation collected after 10,000 net allocations (700 made each collection walk the
requests in flight: 5% of the router's CPU per request, 10% with tracing)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.commands.collector_settings import YOUNG_THRESHOLD, settle_collector


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's collector as it was, afterwards."""
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_settling_freezes_the_heap_and_raises_only_the_youngest_threshold(
    collector: None,
) -> None:
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    assert settle_collector({}) is True
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    assert gc.get_freeze_count() > 1000  # this interpreter's modules at least


def test_it_can_be_turned_off(collector: None) -> None:
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    assert settle_collector({"KVROUTE_GC_TUNING": " OFF "}) is False
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0


# `kvroute serve` in this process's main thread, watched from another: the collector's
# settings when the router says it listens, then SIGINT ends it
_SERVE_AND_REPORT = """
import gc, io, os, signal, sys, threading
from router.commands import cli
up = threading.Event()
class Told(io.TextIOWrapper):
    def write(self, text):
        if "listening on" in text:
            up.set()
        return super().write(text)
sys.stdout = Told(sys.stdout.detach(), line_buffering=True)
def watch():
    up.wait(30)
    print("THRESHOLD", gc.get_threshold()[0], "FROZEN", gc.get_freeze_count(), file=sys.stderr)
    os.kill(os.getpid(), signal.SIGINT)
gc.set_threshold(700, 10, 10)
threading.Thread(target=watch, daemon=True).start()
sys.argv = ["kvroute", "serve", "--config", sys.argv[1]]
sys.exit(cli.main())
"""


@pytest.mark.parametrize(
    ("env", "threshold"), [({}, YOUNG_THRESHOLD), ({"KVROUTE_GC_TUNING": "off"}, 700)]
)
async def test_serve_settles_the_collector_once_up(
    tmp_path: Path, env: dict[str, str], threshold: int
) -> None:
    config = tmp_path / "router.toml"
    config.write_text('[listen]\nport = 0\n[admin]\ntoken = "t"\n')
    environ = {k: v for k, v in os.environ.items() if k != "KVROUTE_GC_TUNING"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SERVE_AND_REPORT, str(config), env={**environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert b"listening on http://127.0.0.1:" in out
    report = next(line for line in err.decode().splitlines() if line.startswith("THRESHOLD"))
    words = report.split()
    assert int(words[1]) == threshold
    assert (int(words[3]) > 1000) is (threshold == YOUNG_THRESHOLD)
