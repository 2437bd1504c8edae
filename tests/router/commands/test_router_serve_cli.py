"""`kvroute serve` as a user runs it: a real process, a config file, Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shlex
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.cluster.server import NatsServer
from router.config import AdminConfig, ListenConfig, RouterConfig
from router.service import RouterService
from tests.raw_http import wait_eof
from tests.router.commands.refusal import refused_in_one_line
from tests.router.conftest import HungDiscovery, eventually
from workers.config import DEFAULT_MODEL
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


async def _run(*args: str, loop: str | None = None) -> asyncio.subprocess.Process:
    """`kvroute serve ARGS`, with $KVROUTE_EVENT_LOOP set to `loop` when given."""
    env = None if loop is None else {**os.environ, "KVROUTE_EVENT_LOOP": loop}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.commands.cli",
        "serve",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


async def test_serve_starts_answers_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text('[listen]\nport = 0\n[admin]\ntoken = "t"\n')
    proc = await _run("--config", str(config), "--policy", "round_robin")
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert "listening on http://127.0.0.1:" in line and "round_robin" in line
        assert "index core native" in line or "index core python" in line
        assert "0 workers" in line  # said as `up` says it (before: not at all)
        url = line.split("listening on ")[1].split()[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as resp:
                assert resp.status == 503  # no workers configured
            async with session.get(url + "/admin/workers") as resp:
                assert resp.status == 401
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        assert b"event loop: uvloop" in err  # the default where uvloop is installed
        # the stop is said, with how long it may take (before: nothing)
        assert b"SIGINT: stopping: requests in flight are let finish, for up to 60 s" in err
        warned = [x for x in err.decode().splitlines() if "lists no [[workers]]" in x]
        assert len(warned) == 1 and "every request is a 503" in warned[0], err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_an_empty_or_comment_only_config_is_refused_at_start(tmp_path: Path) -> None:
    """A reload refused these (caught mid-save), a start served them: a router on
    127.0.0.1:8000 with no workers, every request a 503, nothing said. Refused in one line."""
    config = tmp_path / "router.toml"
    for text, said in (
        ("", "is empty"),
        (" \n\t\n", "is empty"),
        ("# only a comment\n[listen]\n", "has no settings, only comments or empty tables"),
    ):
        config.write_text(text)
        proc = await _run("--config", str(config))
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:  # it served (as it did): stopped, not left behind
                proc.kill()
                await proc.wait()
        assert proc.returncode == 2 and not out, (out, err)
        lines = err.decode().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvroute serve: {config} {said}"), lines
        assert "[[workers]]" in lines[0] and "caught while being written" not in lines[0]


async def test_a_wildcard_host_is_said_to_listen_on_all_interfaces(tmp_path: Path) -> None:
    """`listen.host = "0.0.0.0"` printed `listening on http://127.0.0.1:P` only, which reads as
    bound to loopback: the line says all interfaces now, the URL still first for the tools
    that take the word after "listening on"."""
    config = tmp_path / "router.toml"
    with contextlib.closing(socket.socket()) as probe:  # a free port for /metrics
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    listen = f'[listen]\nhost = "0.0.0.0"\nport = 0\nmetrics_port = {metrics_port}\n'
    config.write_text(listen + '[admin]\ntoken = "t"\n')  # none: refused on 0.0.0.0
    proc = await _run("--config", str(config))
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = line.split("listening on ")[1].split()[0]
        port = url.rpartition(":")[2]
        assert url == f"http://127.0.0.1:{port}", line
        assert f"(all interfaces, bound to 0.0.0.0:{port}: {url} from this host; policy" in line
        metrics = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert metrics.startswith("kvroute metrics on http://127.0.0.1:"), metrics
        assert metrics.rstrip().endswith("/metrics (all interfaces)"), metrics
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
            assert resp.status == 503  # no workers configured: it answers
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")
async def test_an_empty_host_with_port_0_listens_on_one_port_in_both_families() -> None:
    """`listen.host = ""` binds IPv6 and IPv4 every interface, a socket each: with port 0 each
    drew its own port, the router said the first (the IPv6 one, as 0.0.0.0's), and IPv4
    clients of the port it said reached nothing."""
    config = RouterConfig(listen=ListenConfig(host="", port=0), admin=AdminConfig(token="t"))
    async with RouterService(config) as router:
        assert {address for address, _ in router.bound} == {"::", "0.0.0.0"}, router.bound
        ports = {port for _, port in router.bound}
        assert len(ports) == 1, router.bound
        (port,) = ports
        assert router.wildcard_bind == f"0.0.0.0:{port}"
        async with aiohttp.ClientSession() as session:
            for host in ("127.0.0.1", "[::1]"):
                async with session.get(f"http://{host}:{port}/health") as resp:
                    assert resp.status == 503, host  # no workers: it answers, on both


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")
async def test_an_ipv6_wildcard_host_names_the_ipv6_loopback() -> None:
    """`listen.host = "::"` binds IPv6 only: its URL said 127.0.0.1, where nothing listened."""
    config = RouterConfig(listen=ListenConfig(host="::", port=0), admin=AdminConfig(token="t"))
    async with RouterService(config) as router:
        assert router.url.startswith("http://[::1]:"), router.url
        async with aiohttp.ClientSession() as session, session.get(router.url + "/health") as resp:
            assert resp.status == 503


async def test_a_fleet_table_is_said_to_start_nothing_here(tmp_path: Path) -> None:
    """`kvroute serve --config configs/local.toml` ignored its [fleet] without a word: a router
    of no workers, every request a 503."""
    config = tmp_path / "local.toml"
    config.write_text("[listen]\nport = 0\n[fleet]\nworkers = 2\n")
    proc = await _run("--config", str(config))
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert "listening on" in line
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    warnings = [x for x in err.decode().splitlines() if "WARNING" in x and "[fleet]" in x]
    assert len(warnings) == 1, err.decode()
    assert f"kvroute up --config {config}" in warnings[0] and "[[workers]] (0:" in warnings[0]


async def test_the_event_loop_is_chosen_by_name_or_refused(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text("[listen]\nport = 0\n")
    proc = await _run("--config", str(config), loop="asyncio")
    assert proc.stdout is not None
    try:
        assert b"listening on" in await asyncio.wait_for(proc.stdout.readline(), 30)
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0 and b"event loop: asyncio" in err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    proc = await _run("--config", str(config), loop="tokio")
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"KVROUTE_EVENT_LOOP='tokio': use uvloop or asyncio" in err
    assert b"never awaited" not in err  # the refusal alone, no warning beside it


async def test_a_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text("[policy]\nnmae = 'kv'\n")
    proc = await _run("--config", str(config))
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"nmae" in err


@pytest.mark.parametrize("verb", ["serve", "indexer"])
async def test_a_config_that_is_not_utf8_exits_2_in_one_line_naming_it(
    tmp_path: Path, verb: str
) -> None:
    config = tmp_path / "router.toml"
    config.write_bytes(b"\xff\xfe[listen]\n")
    line = await refused_in_one_line(verb, "--config", str(config))
    assert line.startswith(f"kvroute {verb}: {config}: not UTF-8"), line


# a file nested past what anything reads: tomllib's recursion (arrays, inline tables) and the
# settings check's (a dotted key, which tomllib reads without recursing)
_TOO_DEEP = {
    "arrays": ("x = " + "[" * 3000 + "]" * 3000, "nest too deep to read"),
    "inline tables": ("x = " + "{a = " * 3000 + "1" + "}" * 3000, "nest too deep to read"),
    "dotted key": (".".join(["a"] * 3000) + " = 1", "`a.a.a ... a` nests more than 32"),
}


@pytest.mark.parametrize("verb", ["serve", "indexer", "up"])
@pytest.mark.parametrize("shape", sorted(_TOO_DEEP))
async def test_a_config_nested_too_deep_exits_2_in_one_line_naming_it(
    tmp_path: Path, verb: str, shape: str
) -> None:
    """Before, a RecursionError: exit 1 and a traceback of 3,000 lines."""
    config = tmp_path / "router.toml"
    nested, said = _TOO_DEEP[shape]
    config.write_text(nested + '\n[listen]\nport = 0\n[admin]\ntoken = "t"\n')
    # `up`: refused before any worker starts
    line = await refused_in_one_line(verb, "--config", str(config))
    assert line.startswith(f"kvroute {verb}: {config}: "), line
    assert said in line, line


@pytest.mark.parametrize("verb", ["serve", "indexer"])
async def test_a_fifo_for_a_config_exits_2_in_one_line_naming_it(tmp_path: Path, verb: str) -> None:
    """Before, the process waited on the FIFO for a writer, saying nothing."""
    config = tmp_path / "router.toml"
    os.mkfifo(config)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "router.commands.cli", verb, "--config", str(config)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 2
    lines = err.decode().splitlines()
    assert lines == [f"kvroute {verb}: {config}: is a FIFO (named pipe), not a regular file"]


async def _serve_with_a_port_held(
    tmp_path: Path, processes: str, ports: Callable[[int], str]
) -> tuple[int, int | None, bytes]:
    """`kvroute serve --processes N` on a config whose [listen] `ports(port)` names a port a
    real listener holds (without SO_REUSEPORT, so replicas cannot share it either), its
    replicas agreeing through a real nats-server: (the port, exit code, stderr)."""
    holder = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = holder.sockets[0].getsockname()[1]
    config = tmp_path / "router.toml"
    text = "[listen]\nhost = '127.0.0.1'\n" + ports(port)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(holder.wait_closed)
        stack.callback(holder.close)
        if processes != "1":
            nats = await stack.enter_async_context(NatsServer())
            text += f"[cluster]\nurl = '{nats.url}'\n"
        config.write_text(text)
        proc = await _run("--config", str(config), "--processes", processes)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    return port, proc.returncode, err


@pytest.mark.parametrize("processes", ["1", "2"])
async def test_a_port_in_use_exits_2_in_one_line_without_a_traceback(
    tmp_path: Path, processes: str
) -> None:
    port, returncode, err = await _serve_with_a_port_held(
        tmp_path, processes, lambda port: f"port = {port}\n"
    )
    assert returncode == 2
    # one wording for both (one router said asyncio's "error while attempting to bind on
    # address ('127.0.0.1', P): address already in use")
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use)".encode() in err
    assert b"(serve --port)" in err
    assert b"Traceback" not in err


async def test_a_router_restarted_on_its_port_takes_it_back(tmp_path: Path) -> None:
    """Stopped after serving a client (the connections it closed wait in TIME_WAIT on the
    port), `kvroute serve` starts again on the same port at once. The check of a taken port
    before the startup held it with SO_REUSEPORT alone, which Linux refuses beside those:
    exit 2, "Address already in use", for about a minute (QA)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "router.toml"
    config.write_text(f"[listen]\nhost = '127.0.0.1'\nport = {port}\n")
    for run in range(2):
        proc = await _run("--config", str(config))
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert f"listening on http://127.0.0.1:{port}" in line, (run, line)
            async with aiohttp.ClientSession() as session:  # kept alive: the router closes it
                for _ in range(3):
                    async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                        assert resp.status == 503  # no workers
                proc.send_signal(signal.SIGINT)
                await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@pytest.mark.parametrize("taken", ["port", "metrics_port"])
async def test_a_taken_port_is_refused_before_the_fleet_is_discovered(
    tmp_path: Path, taken: str
) -> None:
    """One router: a taken port is refused at once, in its one line, not after its startup
    waited for the workers' discovery (a worker whose HTTP hangs: two health timeouts, 16 s).
    Before, the service found it as it bound, after that wait, under the startup's lines."""
    hung: list[asyncio.StreamWriter] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)  # accepted, never answered
        await reader.read()

    worker = await asyncio.start_server(hang, "127.0.0.1", 0)
    holder = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = holder.sockets[0].getsockname()[1]
    worker_port = worker.sockets[0].getsockname()[1]
    listen = f"port = {port}\n" if taken == "port" else f"port = 0\nmetrics_port = {port}\n"
    config = tmp_path / "router.toml"
    config.write_text(
        f"[listen]\nhost = '127.0.0.1'\n{listen}[health]\ntimeout_s = 8.0\n"
        f"[[workers]]\nid = 'w0'\nurl = 'http://127.0.0.1:{worker_port}'\n"
    )
    try:
        proc = await _run("--config", str(config))
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        for writer in hung:
            writer.close()
        for server in (worker, holder):
            server.close()
    assert proc.returncode == 2
    lines = err.decode().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], lines
    assert f"listen.{taken}" in lines[0] or "(serve --port)" in lines[0], lines


@pytest.mark.parametrize("processes", ["1", "2"])
async def test_a_metrics_port_in_use_is_refused_as_a_port_in_use(
    tmp_path: Path, processes: str
) -> None:
    """A taken listen.metrics_port was said in asyncio's words ("cannot serve metrics on ...
    (error while attempting to bind on address ('127.0.0.1', P): address already in use)"),
    and under --processes by child 0, once both children had started and joined the cluster,
    then "replica 0 exited before listening". It is refused as a taken listen.port is, and
    under --processes by the parent, before any child starts."""
    port, returncode, err = await _serve_with_a_port_held(
        tmp_path, processes, lambda port: f"port = 0\nmetrics_port = {port}\n"
    )
    lines = err.decode().splitlines()
    assert returncode == 2, lines
    who = "" if processes == "1" else "; process i of 2 serves metrics on it + i"
    assert lines[-1] == (
        f"kvroute serve: cannot listen on 127.0.0.1:{port} for metrics (Address already in use): "
        f"choose another [listen] host or metrics_port (listen.metrics_port{who}), or stop what "
        "holds it"
    ), lines
    if processes != "1":
        assert not [line for line in lines if "process=" in line], lines  # no child started


@pytest.mark.parametrize("verb", ["serve", "indexer"])
async def test_a_port_in_use_names_the_option_of_the_command_refused(
    tmp_path: Path, verb: str
) -> None:
    """`kvroute indexer` was told to choose "serve --port, up --router-port"."""
    holder = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = holder.sockets[0].getsockname()[1]
    config = tmp_path / "router.toml"
    config.write_text(f"[listen]\nhost = '127.0.0.1'\nport = {port}\n")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.commands.cli", verb, "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        holder.close()
        await holder.wait_closed()
    lines = err.decode().splitlines()
    assert proc.returncode == 2, lines
    said = [line for line in lines if "cannot listen" in line]
    assert said == [
        f"kvroute {verb}: cannot listen on 127.0.0.1:{port} (Address already in use): choose "
        f"another [listen] host or port ({verb} --port), or stop what holds it"
    ], lines


async def _idle_connection(port: int) -> bytes:
    """Open a connection, send nothing, and return what the router sent before closing it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await wait_eof(reader, 20)
    finally:
        writer.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_serve_under_a_low_descriptor_limit_refuses_idle_floods_and_stays_reachable(
    tmp_path: Path, loop: str
) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    # the report: under `ulimit -n 256`, 300 idle connections made the router unreachable and
    # logged 15,827 "Too many open files" lines
    config = tmp_path / "router.toml"
    config.write_text("[listen]\nport = 0\n[limits]\nidle_timeout_s = 1.0\n")
    python = shlex.quote(sys.executable)
    command = f"ulimit -n 256 && exec {python} -m router.commands.cli serve --config "
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        command + shlex.quote(str(config)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "KVROUTE_EVENT_LOOP": loop},
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = line.split("listening on ")[1].split()[0]
        port = int(url.rsplit(":", 1)[1])
        answers = await asyncio.wait_for(
            asyncio.gather(*(_idle_connection(port) for _ in range(300))), 30
        )
        refused = [json.loads(a.partition(b"\r\n\r\n")[2]) for a in answers if a]
        # lowered to what 256 descriptors hold; every other connection got an answer at once
        assert 100 <= len(refused) < 300
        assert all(r["error"]["type"] == "TooManyConnectionsError" for r in refused)
        assert all(a == b"" or a.startswith(b"HTTP/1.1 503") for a in answers)
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "no_worker"
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = err.decode()
    assert "Too many open files" not in log
    assert "limits.max_connections = 1024 needs more file descriptors" in log
    assert log.count("(limits.max_connections)") <= 2, log  # rate-limited, not one per refusal


def catches_sighup(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGHUP (its `SigCgt` mask, bit 0)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & 1 << (signal.SIGHUP - 1))


async def refused(port: int) -> bool:
    """Whether a connection to `port` on 127.0.0.1 is refused (nothing listens there)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False  # a listener closing under the connection: asked again (a clean clone's CI)
    writer.close()
    await writer.wait_closed()
    return False


async def test_a_sighup_while_starting_or_stopping_never_ends_serve(tmp_path: Path) -> None:
    """SIGHUP's default action ended `kvroute serve` before its handler was up (the router
    still starting) and after it was removed (the shutdown grace, cutting the requests it was
    letting finish). It is caught from the process's start: one during startup is a reload
    once the router is up, one during the grace is said and ignored."""
    cfg = ReferenceConfig(time_scale=1.0, decode_ms_per_token=10.0, page_size=16)
    async with ReferenceWorker(cfg) as worker, HungDiscovery() as hung:
        config = tmp_path / "router.toml"
        # the startup waits 2 health timeouts for the worker whose discovery hangs: 5 s
        config.write_text(
            "[listen]\nport = 0\n[health]\ntimeout_s = 2.5\n"
            f"[[workers]]\nid = 'w'\nurl = '{worker.url}'\n"
            f"[[workers]]\nid = 'h'\nurl = '{hung.url}'\n"
        )
        proc = await _run("--config", str(config))
        assert proc.stdout is not None and proc.stderr is not None
        log = bytearray()
        reading = asyncio.create_task(_collect(proc.stderr, log))
        try:
            # as soon as it is caught, at the latest 3 s in: still within the 5 s of startup
            with contextlib.suppress(AssertionError):
                await eventually(_true(catches_sighup, proc.pid), 3, "SIGHUP caught")
            proc.send_signal(signal.SIGHUP)
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert "listening on" in line, (line, bytes(log).decode())
            url = line.split("listening on ")[1].split()[0]
            await eventually(_true(bytearray.__contains__, log, b"config reloaded from"), 30)
            assert b"SIGHUP while starting" in log, bytes(log).decode()

            # named as the worker serves it: h's models are never known, so another name
            # (which h may serve) is refused with a 503 meanwhile
            body = {
                "model": DEFAULT_MODEL,
                "prompt": "a long one",
                "max_tokens": 300,
                "stream": True,
            }
            events: list[bytes] = []
            async with (
                aiohttp.ClientSession() as session,
                session.post(url + "/v1/completions", json=body) as resp,
            ):
                assert resp.status == 200, await resp.text()
                with contextlib.suppress(aiohttp.ClientPayloadError):  # cut: said below
                    async for event in resp.content:
                        if not event.strip():
                            continue
                        events.append(event)
                        if len(events) == 1:  # in flight: the grace begins
                            proc.send_signal(signal.SIGTERM)
                            port = int(url.rsplit(":", 1)[1])  # the listener closes first
                            await eventually(functools.partial(refused, port), 10, "closed")
                            proc.send_signal(signal.SIGHUP)
            assert events[-1].strip() == b"data: [DONE]", f"cut after {len(events)} events"
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            await reading
            assert b"SIGHUP ignored: shutting down" in log, bytes(log).decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            reading.cancel()


def _true(check: Callable[..., bool], *args: Any) -> Callable[[], Awaitable[bool]]:
    """`check(*args)` as `eventually` polls it."""

    async def checked() -> bool:
        return check(*args)

    return checked


async def _collect(stream: asyncio.StreamReader, into: bytearray) -> None:
    """Append all of `stream` to `into` as it comes, until its end."""
    while chunk := await stream.read(4096):
        into += chunk


async def test_a_closed_stdout_does_not_end_serve_with_a_traceback(tmp_path: Path) -> None:
    """Saying where it listens on a pipe nobody reads any more (`kvroute serve | head -0`, or a
    `--processes` child whose parent died) raised BrokenPipeError: a traceback, and the
    router ended before serving. It now serves on, saying nothing more on stdout."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "router.toml"
    config.write_text(f'[listen]\nport = {port}\n[admin]\ntoken = "t"\n')
    read, write = os.pipe()
    os.close(read)  # nobody will read what it prints
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.commands.cli", "serve", "--config", str(config),
            stdout=write, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    finally:
        os.close(write)
    assert proc.stderr is not None
    try:

        async def answers() -> bool:
            if proc.returncode is not None:
                return True  # ended: said below
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"http://127.0.0.1:{port}/health") as resp,
                ):
                    return resp.status == 503  # up, with no worker
            except aiohttp.ClientError:
                return False

        await eventually(answers, 30, "the router to answer")
        assert proc.returncode is None, (await proc.stderr.read()).decode()
        proc.send_signal(signal.SIGINT)
        err = (await asyncio.wait_for(proc.stderr.read(), 30)).decode(errors="replace")
        assert await asyncio.wait_for(proc.wait(), 30) == 0, err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert "Traceback" not in err and "BrokenPipe" not in err, err


async def test_the_relay_says_where_it_listens_without_a_policy(tmp_path: Path) -> None:
    """It routes nothing and refuses --policy, yet said "(policy kv, index core native)"."""
    with socket.socket() as held:  # NATS that never answers: the relay listens all the same
        held.bind(("127.0.0.1", 0))
        config = tmp_path / "relay.toml"
        config.write_text(
            f"[listen]\nport = 0\n[admin]\ntoken = 't'\n"
            f"[cluster]\nurl = 'nats://127.0.0.1:{held.getsockname()[1]}'\n"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.commands.cli", "relay", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        finally:
            proc.send_signal(signal.SIGINT)
            await asyncio.wait_for(proc.wait(), 30)
    assert "kvroute relay (KV events to nats://" in line and "listening on http://" in line
    assert "policy" not in line and "index core " in line, line


def test_the_processes_option_says_what_each_verb_runs() -> None:
    """`kvroute indexer --processes` said "one router through the config's [cluster]"."""
    from router.commands.cli import build_parser

    for verb, noun in (("serve", "one router"), ("indexer", "one indexer")):
        parser, _ = build_parser([verb, "--help"])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        text = " ".join(sub.choices[verb].format_help().split())
        assert f"{noun} through the config's [cluster]" in text, text
