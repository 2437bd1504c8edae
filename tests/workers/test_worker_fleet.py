"""The fleet, DP ranks, and the CLI as a user runs it (a real process, a real signal)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import signal
import socket
import sys
from collections.abc import Callable

import aiohttp
import pytest
import zmq
import zmq.asyncio

from indexer.protocol import (
    ReplayData,
    Stored,
    build_replay_request,
    decode_batch,
    parse_replay_reply,
)
from router.commands.up import add_arguments as add_up_arguments
from workers.command import (
    _default_replay_port,
    _own_port_clash,
    add_arguments,
    config_from_args,
)
from workers.config import WorkerConfig
from workers.fleet import Fleet


async def _replayed(ctx: zmq.asyncio.Context, endpoint: str) -> list[ReplayData]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(endpoint)
    await dealer.send_multipart(build_replay_request(0))
    out: list[ReplayData] = []
    while True:
        assert await dealer.poll(5000)
        reply = parse_replay_reply(await dealer.recv_multipart())
        if not isinstance(reply, ReplayData):
            break
        out.append(reply)
    dealer.close()
    return out


async def test_fleet_with_dp_ranks() -> None:
    config = WorkerConfig(page_size=4, dp_size=2, time_scale=0, event_format="map")
    ctx = zmq.asyncio.Context()
    try:
        async with Fleet(2, config) as fleet, aiohttp.ClientSession() as http:
            assert [w.id for w in fleet.workers] == ["worker-0", "worker-1"]
            assert [w.topic for w in fleet.workers] == ["kv@worker-0", "kv@worker-1"]
            urls = {w.url for w in fleet.workers}
            assert len(urls) == 2
            for w in fleet.workers:
                assert w.dp_size == 2 and w.block_size == 4
                ports = [int(e.rsplit(":", 1)[1]) for e in w.events_endpoints]
                assert ports[1] == ports[0] + 1
                replay_ports = [int(e.rsplit(":", 1)[1]) for e in w.replay_endpoints]
                assert replay_ports[1] == replay_ports[0] + 1
            target = fleet.workers[1]
            body = {"text": "rank one only", "data_parallel_rank": 1, "cache_salt": "s"}
            async with http.post(f"{target.url}/generate", json=body) as resp:
                assert (await resp.json())["meta_info"]["dp_rank"] == 1
            rank1 = [
                decode_batch(r.payload) for r in await _replayed(ctx, target.replay_endpoints[1])
            ]
            rank0 = [
                decode_batch(r.payload) for r in await _replayed(ctx, target.replay_endpoints[0])
            ]
            assert all(b.dp_rank == 1 for b in rank1)
            assert any(isinstance(e, Stored) for b in rank1 for e in b.events)
            assert not any(isinstance(e, Stored) for b in rank0 for e in b.events)
            async with http.post(
                f"{target.url}/debug/match", json={"text": "rank one only", "cache_salt": "s"}
            ) as resp:
                assert (await resp.json())["ranks"] == [0, 12]
    finally:
        ctx.destroy(linger=0)


def test_fleet_port_bases_are_per_worker_and_per_rank() -> None:
    fleet = Fleet(
        3,
        WorkerConfig(dp_size=2),
        http_port_base=41000,
        events_port_base=42000,
        replay_port_base=43000,
    )
    cfg = fleet.worker_config(2)
    assert (cfg.port, cfg.events_port, cfg.replay_port, cfg.topic) == (
        41002,
        42004,
        43004,
        "kv@worker-2",
    )
    assert fleet.worker_config(0).events_port == 42000


@pytest.mark.parametrize(
    ("argv", "workers"),
    [
        (["worker", "--port", "0", "--events", "tcp://127.0.0.1:0", "--time-scale", "0"], 1),
        # `kvroute up` now also starts the router: its test lives with the router's
    ],
    ids=["worker"],
)
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGHUP], ids=["sigint", "sighup"])
async def test_cli_runs_until_sigint(argv: list[str], workers: int, stop: signal.Signals) -> None:
    """Ctrl-C stops it; so does a hangup (its terminal closed), cleanly and saying so, where
    the default action of SIGHUP ended it with no word and no clean stop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.commands.cli",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        banner = ""
        async with asyncio.timeout(20):
            while "Ctrl-C" not in banner:
                line = await proc.stdout.readline()
                assert line, "the worker exited early"
                banner += line.decode()
        urls = sorted(set(re.findall(r"http://127\.0\.0\.1:\d+", banner)))
        assert len(urls) == workers, banner
        assert banner.count("events tcp://127.0.0.1:") == workers
        async with aiohttp.ClientSession() as http:
            for url in urls:
                async with http.get(f"{url}/health") as resp:
                    assert resp.status == 200
        proc.send_signal(stop)
        async with asyncio.timeout(20):
            assert await proc.wait() == 0
        assert proc.stderr is not None
        said = (await proc.stderr.read()).decode()
        assert ("SIGHUP: stopping" in said) == (stop == signal.SIGHUP), said
        assert (await proc.stdout.read()).decode().strip().endswith("stopped")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_the_sglang_version_is_an_option_of_worker_and_up() -> None:
    """It decides how an OpenAI request's model names an adapter, and what /server_info
    says; before, only a WorkerConfig in Python could set it."""
    worker, up = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_arguments(worker)
    add_up_arguments(up)
    assert config_from_args(worker.parse_args([])).version == WorkerConfig().version
    for parser in (worker, up):
        args = parser.parse_args(["--sglang-version", "0.5.22"])
        assert config_from_args(args).version == "0.5.22"


async def _worker_refusal(*argv: str) -> str:
    """`kvroute worker ARGV`, which must exit 2 at once: its stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "worker", "--time-scale", "0", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    said = err.decode()
    assert proc.returncode == 2 and "Traceback" not in said, said
    return said


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("replay_offset", [1, -1], ids=["replay-above", "replay-below"])
async def test_dp_ranks_whose_event_and_replay_ports_overlap_are_refused_naming_both(
    replay_offset: int,
) -> None:
    """The README's `--events ...:5557 --replay ...:5558` with `--dp 2`: rank 1 publishes on
    5558, the port of rank 0's replay socket. The bind failed with "cannot bind ...: Address
    already in use", as if another process held it: it was the worker's own socket. Both
    ranges are named now, and the fix (the default, events + 100)."""
    events = _free_port() + 1  # room below it for the replay-below case
    replay = events + replay_offset
    said = await _worker_refusal(
        "--port", "0", "--dp", "2",
        "--events", f"tcp://127.0.0.1:{events}", "--replay", f"tcp://127.0.0.1:{replay}",
    )  # fmt: skip
    clash = max(events, replay)
    first, second = (
        ("rank 1's events", "rank 0's replay")
        if replay_offset > 0
        else ("rank 0's events", "rank 1's replay")
    )
    assert f"port {clash} would be both DP {first} and DP {second} socket" in said, said
    assert f"(the default, {events + 100})" in said and "already in use" not in said, said


async def test_a_taken_http_port_names_the_option_that_moves_it() -> None:
    """`kvroute up`, `serve` and `--metrics-port` name the option; the worker printed the bare
    "[Errno 98] error while attempting to bind on address ...\""""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        said = await _worker_refusal("--port", str(port), "--events", "tcp://127.0.0.1:0")
    assert f"HTTP port {port} is taken: choose another --port" in said, said
    assert "[Errno" not in said, said


@pytest.mark.parametrize("ranks", [1, 100, 150, 1024])
def test_the_default_replay_port_never_overlaps_the_ranks_events(ranks: int) -> None:
    """With `--dp-size` over 100, the default replay port (events + 100) was inside the events'
    range, and the worker refused its own defaults as a clash."""
    replay = _default_replay_port(5557, ranks)
    assert replay == 5557 + max(100, ranks)
    assert _own_port_clash(5557, replay, ranks) == ""
    assert _default_replay_port(0, ranks) == 0  # ephemeral events: ephemeral replay


def _soft_descriptor_limit(soft: int, hard: int | None = None) -> Callable[[], None]:
    def limit() -> None:
        current_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, current_hard if hard is None else hard))

    return limit


@pytest.mark.parametrize("ranks", [300, 520])
async def test_a_worker_of_more_ranks_than_its_soft_limits_hold_serves_each_one(
    ranks: int,
) -> None:
    """Under a soft descriptor limit of 1,024 (the common default), 300 ranks (1,200
    descriptors) made libzmq abort the process; 520 ranks are 1,040 zmq sockets, past libzmq's
    default table of 1,023, and failed to bind as if their ports were taken. The worker raises
    the soft limit towards the hard one and serves the last rank's replay socket."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "worker", "--time-scale", "0",
        "--port", "0", "--dp-size", str(ranks), "--events", "tcp://127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=_soft_descriptor_limit(1024),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        last = ""
        async with asyncio.timeout(60):
            while "Ctrl-C to stop" not in (line := (await proc.stdout.readline()).decode()):
                if not line:
                    said = (await proc.stderr.read()).decode()
                    raise AssertionError(f"the worker ended before it served: {said}")
                if line.strip().startswith(f"rank {ranks - 1}:"):
                    last = line
        replay = re.search(r"replay (tcp://\S+)", last)
        assert replay is not None, last
        ctx = zmq.asyncio.Context()
        try:
            await _replayed(ctx, replay.group(1))  # the last rank's replay socket answers
        finally:
            ctx.destroy(linger=0)
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)


async def test_a_worker_of_more_ranks_than_its_hard_descriptor_limit_allows_is_refused() -> None:
    """Told to hold more sockets than the process had descriptors for, libzmq aborted the
    process ("Too many open files (src/ip_resolver.cpp:542)"); now the worker says what it
    needs before its first socket."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "worker", "--time-scale", "0",
        "--port", "0", "--dp-size", "600", "--events", "tcp://127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=_soft_descriptor_limit(1024, 1024),
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    said = err.decode()
    assert proc.returncode == 2, said
    assert "--dp-size 600 needs at least 2,464 file descriptors" in said, said
    assert "at most 1,024" in said and "Traceback" not in said, said
