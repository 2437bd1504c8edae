"""SGLang's Rust router (`sglang-router` on PyPI) as a child process, for the benchmarks.

`kvroute bench proxy` puts it in front of a trivial backend (its proxy cost), `kvroute bench
routing` in front of a reference fleet with its `cache_aware` policy (an external routing
baseline). It lives in whatever Python environment has it installed, named by
`--sglang-router-python` (env `KVROUTE_SGLANG_ROUTER_PYTHON`); kvroute never imports it. When
that python cannot import it, `provision` makes the benchmarks' own virtual environment
(`~/.cache/kvroute-bench/sglang-router`: `python3 -m venv`, then pip installs the pinned
`sglang-router==0.3.2`, with `--find-links $KVROUTE_SGLANG_ROUTER_WHEELS` when that names a
directory of wheels) and uses it; the reports say which python ran it, or why none could.

Facts about it that the benchmarks depend on (checked against sglang-router 0.3.2):
- on `/generate` it parses the body into its own typed request and re-serializes it, so fields
  it does not know are dropped: `cache_salt` is one of them, `extra_key` is kept;
- it routes `input_ids` by the text of the ids joined with spaces (its approximate radix tree
  works on characters), and it receives no KV events;
- with `--dp-aware` it asks each worker's `/get_server_info` for `dp_size`, lists one worker
  per rank (`URL@rank`) with a tree of its own, and names the rank in the request, as kvroute
  does; the routing benchmark runs it so on fleets with DP ranks;
- on start it looks up a tokenizer for the workers' model path on the Hugging Face hub. The
  child gets proxy variables that point at a closed loopback port (loopback itself exempt), so
  that lookup fails at once and nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

__all__ = [
    "DEFAULT_PYTHON",
    "PINNED",
    "VENV",
    "SglangRouterError",
    "importable",
    "installed",
    "launch",
    "provision",
    "version",
]

DEFAULT_PYTHON = os.environ.get("KVROUTE_SGLANG_ROUTER_PYTHON", sys.executable)
PINNED = "sglang-router==0.3.2"  # the version the facts above were checked against
_VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvroute-bench"
_INSTALL_TIMEOUT_S = 600.0
# where the benchmarks install it when no python at hand has it
VENV = _VENV / "sglang-router"
# port 9 (discard) on loopback: nothing listens, so any off-host request fails immediately
_DEAD_PROXY = "http://127.0.0.1:9"


class SglangRouterError(RuntimeError):
    """sglang-router is not installed for that python, or did not start and become ready."""


def importable(python: str) -> bool:
    """Whether `python` can import `sglang_router` (False when `python` does not run)."""
    try:
        done = subprocess.run(
            [python, "-c", "import sglang_router"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def installed(asked: str = "") -> str | None:
    """A python at hand that imports sglang_router, installing nothing: `asked` (default
    $KVROUTE_SGLANG_ROUTER_PYTHON), else the benchmarks' venv once `provision` made it."""
    for python in (asked or os.environ.get("KVROUTE_SGLANG_ROUTER_PYTHON", ""), _venv_python(VENV)):
        if python and importable(str(python)):
            return str(python)
    return None


def _run(argv: Sequence[str], timeout_s: float) -> str | None:
    """None when `argv` succeeded, else the last lines it printed (or why it did not run)."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode == 0:
        return None
    said = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    return " | ".join(said[-3:])[-600:] or f"exit status {done.returncode}"


def provision(asked: str, venv: Path | None = None) -> tuple[str | None, str]:
    """A python that imports sglang_router, and a sentence for the report saying where it came
    from: `asked` when it can, else the benchmarks' venv, created (with the `PINNED` version)
    when it is missing. (None, why) when neither works, e.g. offline without a wheel.
    """
    if importable(asked):
        return asked, f"`{asked}` (asked for)"
    venv = venv or VENV
    python = _venv_python(venv)
    if python.exists() and importable(str(python)):
        return str(python), f"`{python}` (the benchmarks' venv; `{asked}` cannot import it)"
    started = time.monotonic()
    failed = None
    if not python.exists():
        failed = _run([sys.executable, "-m", "venv", str(venv)], 120.0)
    if failed is None:
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", PINNED]
        wheels = os.environ.get("KVROUTE_SGLANG_ROUTER_WHEELS", "")
        if wheels and Path(wheels).is_dir():
            pip += ["--find-links", wheels]
        failed = _run(pip, _INSTALL_TIMEOUT_S)
    if failed is not None or not importable(str(python)):
        why = failed or "installed, but it still cannot import sglang_router"
        return None, (
            f"`{asked}` cannot import sglang_router and making the venv `{venv}` with "
            f"{PINNED} failed ({why}); pass a python that has it with --sglang-router-python "
            "(or KVROUTE_SGLANG_ROUTER_PYTHON), or a directory holding its wheel with "
            "KVROUTE_SGLANG_ROUTER_WHEELS"
        )
    took = time.monotonic() - started
    return str(python), (
        f"`{python}` (the benchmarks' venv, made for this run in {took:.0f} s with {PINNED}; "
        f"`{asked}` cannot import it)"
    )


def version(python: str) -> str:
    """The sglang-router version installed for `python` ("(version unknown)" if it cannot say)."""
    code = "import importlib.metadata as m; print(m.version('sglang-router'))"
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "(version unknown)"
    found = done.stdout.strip()
    return found if done.returncode == 0 and found else "(version unknown)"


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = _DEAD_PROXY
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _free_port() -> int:
    # the router takes a port number, not a socket: a tiny race, acceptable on loopback
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _base_url(url: str) -> str:
    """A listed worker URL without the `@rank` its `--dp-aware` mode appends per DP rank."""
    base, sep, rank = url.rpartition("@")
    return base.rstrip("/") if sep and rank.isdigit() else url.rstrip("/")


def _registered(data: Any) -> set[str]:
    """Worker URLs the router lists as healthy (`/workers`, or the older `/list_workers`)."""
    if not isinstance(data, dict):
        return set()
    if isinstance(data.get("workers"), list):
        return {
            _base_url(str(w.get("url", "")))
            for w in data["workers"]
            if isinstance(w, dict) and w.get("is_healthy", True)
        }
    if isinstance(data.get("urls"), list):
        return {str(u).rstrip("/") for u in data["urls"]}
    return set()


async def _wait_ready(
    proc: asyncio.subprocess.Process, url: str, workers: Sequence[str], timeout_s: float
) -> None:
    """Poll the router until it lists every worker as healthy."""
    want = {w.rstrip("/") for w in workers}
    async with aiohttp.ClientSession() as session, asyncio.timeout(timeout_s):
        while True:
            if proc.returncode is not None:
                raise SglangRouterError(f"sglang-router exited with {proc.returncode}")
            for path in ("/workers", "/list_workers"):
                with contextlib.suppress(aiohttp.ClientError, ValueError):
                    async with session.get(url + path) as resp:
                        if resp.status == 200 and want <= _registered(await resp.json()):
                            return
            await asyncio.sleep(0.1)


def _tail(log: Any) -> str:
    log.seek(0)
    lines = log.read().decode(errors="replace").strip().splitlines()
    return " | ".join(lines[-3:])[-600:]


@contextlib.asynccontextmanager
async def launch(
    python: str,
    workers: Sequence[str],
    policy: str = "cache_aware",
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 60.0,
    pd_args: Sequence[str] | None = None,
    pids: dict[str, int] | None = None,
) -> AsyncIterator[str]:
    """sglang-router with `policy` in front of `workers`; yields its URL once all are registered.

    With `pids`, its process id is put there under its URL while it runs (for its CPU time).

    With `pd_args` (`--pd-disaggregation --prefill URL PORT ... --decode URL ...`) it runs in
    its prefill/decode mode over those workers, `policy` choosing the prefill side.
    Raises SglangRouterError when it cannot start (not importable, exits, or never ready).
    """
    port = _free_port()
    fleet = ["--worker-urls", *workers] if pd_args is None else [*pd_args]
    argv = [
        python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        *fleet, "--policy", policy, "--log-level", "warn",
        # its Prometheus exporter binds 0.0.0.0:29000 unless told: two routers at once (or
        # two runs on one host) would collide, and nothing here should leave loopback
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
        *extra_args,
    ]  # fmt: skip
    # on registration it probes each worker with an HTTP/2 preface, which a worker in this
    # process logs as a bad request (aiohttp's server, or the reference worker's listener):
    # expected, so hushed until the router is ready
    server_logs = [logging.getLogger(name) for name in ("aiohttp.server", "workers.listener")]
    levels = [server_log.level for server_log in server_logs]
    for server_log in server_logs:
        server_log.setLevel(logging.CRITICAL)
    with tempfile.TemporaryFile() as log:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=_child_env()
        )
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                await _wait_ready(proc, url, workers, ready_timeout_s)
            except TimeoutError as exc:
                raise SglangRouterError(
                    f"sglang-router did not list every worker within {ready_timeout_s:g} s: "
                    f"{_tail(log)}"
                ) from exc
            except SglangRouterError as exc:
                raise SglangRouterError(f"{exc}: {_tail(log)}") from exc
            finally:
                for server_log, level in zip(server_logs, levels, strict=True):
                    server_log.setLevel(level)
            if pids is not None:
                pids[url] = proc.pid
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
