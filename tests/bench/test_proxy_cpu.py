"""`kvroute bench proxy` counts a target's CPU over every process that serves it: a replica
fleet's parent, its children and their nats-server; and sglang-router's own process."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestServer

from bench import proxy_bench, sglang_router
from bench.proxy_bench import (
    _ALSO,
    _LEAN,
    _PARSER_LANE,
    _PIDS,
    _cpu_s,
    _other_notes,
    _process_cpu_s,
)

# a parent that does nothing but wait on a child that burns CPU until its stdin closes
_BURNER = "import sys\nwhile not sys.stdin.closed:\n    sum(range(100_000))\n"
_PARENT = (
    "import subprocess, sys\n"
    f"child = subprocess.Popen([sys.executable, '-c', {_BURNER!r}], stdin=subprocess.PIPE)\n"
    "print(child.pid, flush=True)\n"
    "sys.stdin.read()\n"
    "child.kill()\n"
)


@pytest.fixture
def parent() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    child = int(proc.stdout.readline())
    try:
        yield proc, child
    finally:
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()
        _PIDS.pop("http://tree", None)
        _ALSO.pop("http://tree", None)


def _burned(pid: int, at_least_s: float) -> None:
    deadline = time.monotonic() + 20
    while (_process_cpu_s(pid) or 0.0) < at_least_s:
        assert time.monotonic() < deadline, "the burner never used the CPU"
        time.sleep(0.05)


def test_a_targets_cpu_counts_the_children_of_its_process(
    parent: tuple[subprocess.Popen[str], int],
) -> None:
    proc, child = parent
    _PIDS["http://tree"] = proc.pid
    _burned(child, 0.3)
    own = _process_cpu_s(proc.pid)
    counted = _cpu_s("http://tree")
    assert own is not None and counted is not None
    # the parent only waits; nearly all of it is the child's
    assert own < 0.3 <= counted
    assert counted >= (_process_cpu_s(child) or 0.0) - 0.05


def test_a_process_named_beside_a_target_is_counted_with_it(
    parent: tuple[subprocess.Popen[str], int],
) -> None:
    _, burner = parent
    # an idle process, not the burner's parent, stands for the target; the burner, named
    # beside it, for its nats-server
    idle = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    assert idle.stdin is not None
    try:
        _PIDS["http://tree"] = idle.pid
        _burned(burner, 0.3)
        alone = _cpu_s("http://tree")
        assert alone is not None and alone < 0.3
        _ALSO["http://tree"] = [burner]
        assert (_cpu_s("http://tree") or 0.0) >= 0.3
        # a pid that is gone counts nothing and breaks nothing
        _ALSO["http://tree"] = [burner, 2**22 + 12345]
        assert (_cpu_s("http://tree") or 0.0) >= 0.3
        assert _cpu_s("http://nobody") is None
    finally:
        idle.stdin.close()
        idle.wait(10)


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    proxy_bench.add_arguments(parser)
    args = parser.parse_args(["--processes", "2"])
    args.sglang_router_found = (sys.executable, "this test")
    return args


def test_the_notes_hold_the_cpu_per_request_against_sglang_router_and_one_process() -> None:
    rates = {
        "kvroute": 4000.0,
        "kvroute --processes 2": 4400.0,
        "sglang-router": 6400.0,
        "bare aiohttp forwarder": 5000.0,
    }
    cpu = {"kvroute": 180.0, "kvroute --processes 2": 240.0, "sglang-router": 60.0}
    notes = _other_notes(_args(), rates, cpu)
    assert any("kvroute 180 us, sglang-router 60 us (3.0x)" in n for n in notes), notes
    assert any("replicas and their nats-server: 240 us, against 180 us" in n for n in notes)
    # without CPU numbers there are no CPU notes, and the throughput ones stay
    bare = _other_notes(_args(), rates)
    assert not any("CPU per request" in n for n in bare)
    assert any("kvroute / sglang-router throughput ratio: 0.62" in n for n in bare)


@pytest.mark.skipif(
    not sglang_router.installed(),
    reason="no python at hand imports sglang_router (KVROUTE_SGLANG_ROUTER_PYTHON, the bench venv)",
)
async def test_sglang_routers_process_is_registered_while_it_runs() -> None:
    python = sglang_router.installed()
    assert python
    # the backend the proxy bench runs sglang-router in front of
    backend = TestServer(proxy_bench._backend_app(), host="127.0.0.1")
    await backend.start_server()
    pids: dict[str, int] = {}
    try:
        async with sglang_router.launch(
            python, [str(backend.make_url("")).rstrip("/")], policy="round_robin", pids=pids
        ) as url:
            assert list(pids) == [url]
            assert _process_cpu_s(pids[url]) is not None  # a live process of ours
    finally:
        await backend.close()


def test_the_lean_forwarder_is_named_for_what_it_is() -> None:
    # it was "floor: ...", "the thinnest forwarder Python can be", yet the parser lane on
    # aiohttp's parser served more requests/s than it in the committed run
    rates = {
        "kvroute": 5316.0,
        "sglang-router": 7268.0,
        "bare aiohttp forwarder": 5458.0,
        _LEAN: 8466.0,
        _PARSER_LANE: 8963.0,
    }
    notes = _other_notes(_args(), rates)
    assert _LEAN.startswith("lean forwarder: asyncio Protocol + httptools")
    assert f"{_PARSER_LANE} / {_LEAN} throughput ratio: 1.06" in "\n".join(notes)
    (mine,) = [n for n in notes if n.startswith(f"{_LEAN} / sglang-router")]
    assert "ratio: 1.16 (a one-process Python forwarder on this loop" in mine
    assert not any("thinnest" in n or "floor" in n for n in notes)
