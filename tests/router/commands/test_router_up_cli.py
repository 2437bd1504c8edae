"""`kvroute up` as a new user runs it: workers + router, the printed curl works, Ctrl-C stops."""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import json
import os
import shutil
import signal
import socket
import sys
import tomllib
from pathlib import Path

import aiohttp
import pytest

from tests.raw_http import json_error, parse_responses, wait_eof
from tests.router.commands.refusal import refused_in_one_line
from tests.router.commands.test_router_serve_cli import refused
from tests.router.conftest import eventually
from tests.subprocesses import ends_on_sigint


async def _refused_in_one_line(*args: str) -> str:
    """`kvroute up ARGS`, which must refuse in one line (`refused_in_one_line`)."""
    return await refused_in_one_line("up", *args)


async def _read_until(stream: asyncio.StreamReader, marker: str, lines: list[str]) -> str:
    while True:
        line = (await stream.readline()).decode()
        if not line:
            raise AssertionError("kvroute up exited early:\n" + "".join(lines))
        lines.append(line)
        if marker in line:
            return line


async def test_up_starts_workers_and_router_and_its_curl_example_works() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.commands.cli",
        "up",
        "--router-port",
        "0",
        "--worker-port-base",
        "0",
        "--time-scale",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        line = await asyncio.wait_for(_read_until(proc.stdout, "kvroute router:", lines), 60)
        url = line.split("kvroute router:")[1].split()[0]
        await asyncio.wait_for(_read_until(proc.stdout, "Ctrl-C", lines), 10)
        start = next(i for i, text in enumerate(lines) if text.startswith("curl -s " + url))
        # the first curl is the router's, and one Ctrl-C line: a worker's curl, printed first,
        # was what a new user copied (QA: no x-kvroute-* headers in its answer)
        assert min(i for i, text in enumerate(lines) if "curl" in text) == start, lines
        assert sum("Ctrl-C" in text for text in lines) == 1, lines
        command = lines[start].rstrip().removesuffix("\\") + lines[start + 1].strip()
        if shutil.which("curl") and shutil.which("bash"):
            shell = await asyncio.create_subprocess_exec(
                "bash", "-c", command, stdout=asyncio.subprocess.PIPE
            )
            out, _ = await asyncio.wait_for(shell.communicate(), 30)
            answer = json.loads(out)
        else:  # no curl here: send the very body the example shows
            body = command.split("-d '", 1)[1].rstrip("'")
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as resp,
            ):
                answer = await resp.json()
        assert answer["choices"][0]["message"]["content"]
        async with aiohttp.ClientSession() as session, session.get(url + "/admin/workers") as resp:
            workers = (await resp.json())["workers"]
        assert [w["id"] for w in workers] == ["worker-0", "worker-1"]
        assert all(w["status"] == "ready" and w["streams"] for w in workers)
        # SIGHUP (a terminal closed, a reload out of habit) is said and survived
        proc.send_signal(signal.SIGHUP)
        await asyncio.wait_for(_read_until(proc.stdout, "SIGHUP ignored", lines), 10)
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        assert b"stopped" in rest
        # the first Ctrl-C is said, with how long it may take (before: nothing, up to 60 s)
        said = b"kvroute: stopping: the router lets its requests in flight finish, for up to 60 s"
        assert said in rest, rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("alone", [[], ["--no-router"]], ids=["with-router", "workers-alone"])
async def test_an_unknown_fleet_key_is_refused(tmp_path: Path, alone: list[str]) -> None:
    """The [fleet] table shapes the workers with or without the router (--no-router read no
    config at all: its [fleet] was ignored, a missing file too)."""
    config = tmp_path / "local.toml"
    config.write_text("[fleet]\nworkers = 1\npage_sise = 8\n")
    for path, said in ((config, b"page_sise"), (tmp_path / "missing.toml", b"missing.toml")):
        up = ["up", *alone, "--config", str(path)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.commands.cli", *up,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 2 and said in err


@pytest.mark.parametrize("replicas", [[], ["--replicas", "2"]], ids=["one", "replicas"])
async def test_a_router_config_a_start_refuses_is_refused_before_any_worker_starts(
    tmp_path: Path, replicas: list[str]
) -> None:
    """The workers started and printed their curl, then the router refused the tokenizer path
    and they stopped: the router's start checks run first now."""
    config = tmp_path / "fleet.toml"
    missing = tmp_path / "no-such-model" / "tokenizer.json"
    config.write_text(f"[tokenizer]\nkind = 'hf'\npath = '{missing}'\n[fleet]\nworkers = 1\n")
    line = await _refused_in_one_line(
        "--config", str(config), "--router-port", "0", "--worker-port-base", "0", *replicas
    )
    assert line.startswith("kvroute up: ") and str(missing) in line


@pytest.mark.parametrize(
    "args",
    [["--relay"], ["--replicas", "2"], ["--router-port", "0", "--policy", "kv"]],
    ids=["relay", "replicas", "port-policy"],
)
async def test_router_options_with_no_router_are_refused(args: list[str]) -> None:
    """`--no-router --relay` (or `--replicas 2`) started the workers alone and said nothing of
    the relay or replicas asked for."""
    line = await _refused_in_one_line("--no-router", *args)
    assert "and --no-router do not go together" in line, line
    assert all(arg in line for arg in args if arg.startswith("--")), line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--worker-port-base", "65535"], "--worker-port-base 65535: 2 ports"),
        (["--events-port-base", "65535"], "--events-port-base 65535: 2 ports"),
        (["--replay-port-base", "65534", "--dp", "2"], "--replay-port-base 65534: 4 ports"),
        (["--prefill", "1", "--decode", "2", "--worker-port-base", "65534"], "3 ports"),
    ],
    ids=["worker", "events", "replay-dp", "pd"],
)
async def test_a_port_base_too_high_for_the_fleet_names_the_option(
    args: list[str], said: str
) -> None:
    """`port must be a port number (0 = ephemeral)` named neither the option nor why: worker-1
    would need 65536."""
    line = await _refused_in_one_line("--router-port", "0", *args)
    assert said in line and "past 65535" in line, line


async def test_a_taken_worker_port_names_the_option_that_moves_it() -> None:
    """The default base (31000) may be taken on a shared host: the bare bind error named no
    option, where a taken router port names --router-port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.commands.cli", "up", "--workers", "1",
            "--worker-port-base", str(port), "--router-port", "0", "--time-scale", "0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    said = err.decode()
    assert proc.returncode == 2, said
    assert f"worker-0's HTTP port {port} is taken" in said and "--worker-port-base" in said
    assert "Traceback" not in said


async def test_up_serves_through_the_same_guarded_listener_as_serve(tmp_path: Path) -> None:
    config = tmp_path / "local.toml"
    config.write_text("[limits]\nheader_timeout_s = 0.3\n[fleet]\nworkers = 1\ntime_scale = 0\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.commands.cli",
        "up",
        "--config",
        str(config),
        "--router-port",
        "0",
        "--worker-port-base",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    async with ends_on_sigint(proc):
        line = await asyncio.wait_for(_read_until(proc.stdout, "kvroute router:", lines), 60)
        url = line.split("kvroute router:")[1].split()[0]
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(b"GET /hea")  # half a request line: 408 at the header timeout
        answer = await wait_eof(reader, 10)
        writer.close()
        (response,) = parse_responses(answer)
        assert response.status == 408 and json_error(response)["type"] == "RequestTimeoutError"


async def test_up_with_dp_ranks_routes_to_a_rank() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.commands.cli",
        "up",
        "--workers",
        "1",
        "--dp",
        "2",
        "--router-port",
        "0",
        "--worker-port-base",
        "0",
        "--time-scale",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    async with ends_on_sigint(proc):
        line = await asyncio.wait_for(_read_until(proc.stdout, "kvroute router:", lines), 60)
        url = line.split("kvroute router:")[1].split()[0]
        assert line.rstrip().endswith("(policy kv, 1 worker)"), line  # said "1 workers"
        assert any("2 data-parallel ranks each" in text for text in lines)
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/admin/workers") as resp:
                (worker,) = (await resp.json())["workers"]
            assert len(worker["streams"]) == 2
            body = {"prompt": "hello ranks", "max_tokens": 1}
            async with session.post(url + "/admin/route", json=body) as resp:
                plan = await resp.json()
            assert sorted(c["dp_rank"] for c in plan["candidates"]) == [0, 1]
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["x-kvroute-dp-rank"] in ("0", "1")


async def test_up_with_prefill_and_decode_starts_a_pd_fleet_served_as_pairs() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "up", "--prefill", "2", "--decode", "2",
        "--router-port", "0", "--worker-port-base", "0", "--time-scale", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        line = await asyncio.wait_for(_read_until(proc.stdout, "kvroute router:", lines), 60)
        url = line.split("kvroute router:")[1].split()[0]
        printed = "".join(lines)
        assert "2 prefill reference workers" in printed and "2 decode reference workers" in printed
        assert printed.count("KV bootstrap port") == 2
        body = {"text": "a prompt for a pair of workers", "sampling_params": {"max_new_tokens": 4}}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/generate", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-kvroute-prefill-worker"].startswith("prefill-")
            assert resp.headers["x-kvroute-worker"].startswith("decode-")
            assert (await resp.json())["meta_info"]["completion_tokens"] == 4
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest.mark.parametrize(
    ("shape", "url_marker"),
    [([], "kvroute router:"), (["--replicas", "2"], "replica processes listening on")],
    ids=["one-router", "replicas"],
)
async def test_a_second_ctrl_c_in_the_grace_lets_the_request_finish(
    shape: list[str], url_marker: str
) -> None:
    """Ctrl-C again while `up` let a request finish (its shutdown grace) aborted it: two
    tracebacks (KeyboardInterrupt, then "unhandled exception during asyncio.run() shutdown"),
    exit 130 and the request cut, where `kvroute serve` ignores it. The handlers went at the
    first signal; now a second one is said once and ignored, a third is not said again."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "up", "--workers", "1", *shape,
        "--router-port", "0", "--worker-port-base", "0",
        "--time-scale", "1", "--decode-ms-per-token", "10",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # as a terminal starts it: Ctrl-C reaches its whole group
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        line = await asyncio.wait_for(_read_until(proc.stdout, url_marker, lines), 90)
        url = line.split(url_marker)[1].split()[0]
        port = int(url.rsplit(":", 1)[1])
        await asyncio.wait_for(_read_until(proc.stdout, "Ctrl-C stops", lines), 10)
        body = {"model": "m", "prompt": "a long one", "max_tokens": 300, "stream": True}
        events: list[bytes] = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            async for event in resp.content:
                if not event.strip():
                    continue
                events.append(event)
                if len(events) == 1:  # in flight: Ctrl-C, and again once the grace began
                    os.killpg(proc.pid, signal.SIGINT)
                    await eventually(functools.partial(refused, port), 10, "the port closed")
                    os.killpg(proc.pid, signal.SIGINT)
                    await asyncio.sleep(0.2)
                    os.killpg(proc.pid, signal.SIGINT)
        assert events[-1].strip() == b"data: [DONE]", f"cut after {len(events)} events"
        rest, _ = await asyncio.wait_for(proc.communicate(), 60)
        said = "".join(lines) + rest.decode(errors="replace")
        assert proc.returncode == 0, said
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert "Traceback" not in said, said
    assert said.count("already stopping") == 1, said


ROOT = Path(__file__).resolve().parents[3]


def test_the_default_config_ships_in_the_package_as_configs_has_it() -> None:
    """A wheel holds the packages only: `kvroute up` with no --config found no
    configs/local.toml. The package carries a copy, declared as package data."""
    shipped = ROOT / "router" / "commands" / "local.toml"
    assert shipped.read_bytes() == (ROOT / "configs" / "local.toml").read_bytes(), (
        "router/commands/local.toml must be configs/local.toml: copy one to the other"
    )
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["router"]
    assert any(fnmatch.fnmatch("commands/local.toml", p) for p in patterns), patterns


async def test_up_runs_with_no_config_from_the_packages_alone(tmp_path: Path) -> None:
    """As a wheel installs it: the packages (and their package data) alone, no configs/ beside
    them, run from a directory without one."""
    site = tmp_path / "site"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in ("router", "workers", "indexer", "bench"):
        for path in (ROOT / package).rglob("*"):
            inside = path.relative_to(ROOT / package).as_posix()
            data = declared["package-data"].get(package, [])
            if (
                path.is_file()
                and "__pycache__" not in inside
                and (path.suffix in (".py", ".so") or any(fnmatch.fnmatch(inside, p) for p in data))
            ):
                (site / package / inside).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, site / package / inside)
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "up", "--router-port", "0",
        "--worker-port-base", "0", "--time-scale", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    async with ends_on_sigint(proc):
        line = await asyncio.wait_for(_read_until(proc.stdout, "kvroute router:", lines), 60)
        assert "2 workers" in line, line  # local.toml's [fleet] workers = 2


async def test_up_with_no_router_says_it_stops_its_workers() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "up", "--no-router", "--workers", "1",
        "--worker-port-base", "0", "--time-scale", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        await asyncio.wait_for(_read_until(proc.stdout, "Ctrl-C stops every worker", lines), 60)
        proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        said = b"kvroute: stopping the workers: each lets its requests in flight finish, for up to"
        assert said in rest, rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("replicas", [[], ["--replicas", "2"]], ids=["one", "replicas"])
async def test_a_taken_router_port_is_refused_before_any_worker_starts(
    replicas: list[str],
) -> None:
    """The workers (and, for --replicas, the nats-server) started and printed how to reach
    them, then the router refused its port: the port is held before anything starts now."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = await _refused_in_one_line(
            "--workers", "1", "--router-port", str(port), "--worker-port-base", "0", *replicas
        )
    assert line.startswith(f"kvroute up: cannot listen on 127.0.0.1:{port} (Address already")
    assert "--router-port" in line


def _metrics_config(tmp_path: Path, metrics_port: int) -> Path:
    """A config for `up` of one worker on free ports whose router has `metrics_port`."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        f"[listen]\nhost = '127.0.0.1'\nport = 0\nmetrics_port = {metrics_port}\n"
        "[tokenizer]\nkind = 'byte'\n[fleet]\nworkers = 1\nworker_port_base = 0\ntime_scale = 0\n"
    )
    return config


@pytest.mark.parametrize(
    ("router", "who"),
    [
        ([], ""),
        (["--replicas", "2"], "; process i of 2 serves metrics on it + i"),
        (["--relay"], ""),
    ],
    ids=["one", "replicas", "relay"],
)
async def test_a_taken_metrics_port_is_refused_before_any_worker_starts(
    tmp_path: Path, router: list[str], who: str
) -> None:
    """The worker (and, for --replicas and --relay, the nats-server) started and printed how
    to reach it, then the router (or replica 0) refused listen.metrics_port in asyncio's words
    ("cannot serve metrics on ... (error while attempting to bind on address ...)"): it is
    held before anything starts now, and refused as a taken router port is."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = await _refused_in_one_line("--config", str(_metrics_config(tmp_path, port)), *router)
    assert line == (
        f"kvroute up: cannot listen on 127.0.0.1:{port} for metrics (Address already in use): "
        f"choose another [listen] host or metrics_port (listen.metrics_port{who}), or stop what "
        "holds it"
    )


@pytest.mark.parametrize("relay", [[], ["--relay"]], ids=["one", "relay"])
async def test_the_metrics_port_is_held_from_before_the_workers_start_and_served(
    tmp_path: Path, relay: list[str]
) -> None:
    """A listener that tries listen.metrics_port while the workers start is refused (before,
    it took the port and the router failed), and the router (under --relay, replica 0) serves
    /metrics on it: the relay took it for itself, and replica 0 exited before listening."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "up",
        "--config", str(_metrics_config(tmp_path, port)), *relay,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    lines: list[str] = []
    async with ends_on_sigint(proc):
        assert proc.stdout is not None
        await asyncio.wait_for(_read_until(proc.stdout, "reference worker", lines), 30)
        with socket.socket() as late, pytest.raises(OSError):  # no SO_REUSEADDR/PORT either
            late.bind(("127.0.0.1", port))
        await asyncio.wait_for(_read_until(proc.stdout, "Ctrl-C stops the router", lines), 30)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as resp,
        ):
            assert resp.status == 200
            assert "kvroute_requests_total" in await resp.text()
    if relay:  # its one replica's stop, said in the singular ("the 1 replicas" was said)
        assert proc.stdout is not None
        rest = (await proc.stdout.read()).decode()
        assert "stopping the replica (SIGTERM)" in rest, rest


async def test_the_router_port_is_held_from_before_the_workers_start() -> None:
    """Between the check and the router's start nothing else can take the port: a listener
    that tries while the workers start is refused, and the router serves on it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "up", "--workers", "1",
        "--router-port", str(port), "--worker-port-base", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        await asyncio.wait_for(_read_until(proc.stdout, "reference worker", lines), 30)
        with socket.socket() as late, pytest.raises(OSError):  # no SO_REUSEADDR/PORT either
            late.bind(("127.0.0.1", port))
        said = await asyncio.wait_for(_read_until(proc.stdout, "kvroute router:", lines), 30)
        assert f"http://127.0.0.1:{port}" in said
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0


@pytest.mark.parametrize(
    ("args", "fleet"),
    [
        (["--workers", "3", "--prefill", "1", "--decode", "1"], ""),
        (["--workers", "2", "--prefill", "1", "--decode", "1"], ""),
        (["--workers", "3"], "prefill = 1\ndecode = 1\n"),
    ],
    ids=["workers-3", "workers-default-value", "fleet-table"],
)
async def test_workers_with_prefill_decode_is_refused(
    tmp_path: Path, args: list[str], fleet: str
) -> None:
    """`--workers 3 --prefill 1 --decode 1` started a 1 + 1 fleet and dropped --workers
    without a word."""
    config = tmp_path / "fleet.toml"
    config.write_text(f"[fleet]\n{fleet}")
    given = ["--config", str(config)] if fleet else []  # else the default config
    line = await _refused_in_one_line(
        *given, "--router-port", "0", "--worker-port-base", "0", *args
    )
    assert "--workers" in line and "do not go together" in line, line
