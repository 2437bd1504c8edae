"""`kvroute bench soak`: does the router's (and a worker's) memory stay flat under long traffic?

A fleet of real processes on 127.0.0.1: `--workers` reference workers (`kvroute worker`) and the
router (`kvroute serve`, its own process so its RSS is its own, started with
`KVROUTE_TRACEMALLOC=1` so `/admin/debug/memory` can name growing allocation sites). A bounded
load generator keeps `--concurrency` requests in flight for `--minutes`: documents of 50-400
words with a unique suffix (300 of them), 60% salted from 5,001 salts, completions, chat and
`/generate`, a third streaming, some streams dropped by the client after the first chunk; one
worker is killed (SIGKILL) and restarted on its ports halfway. RSS of every process and the
router's traced heap are sampled every `--sample-s`; after `--warmup-minutes` the router takes a
tracemalloc baseline, and at the end the sites that grew most since are listed.

The report (`docs/benchmarks/soak.md`, with `soak_rss.png`) gives RSS over time and the growth
after warm-up per process, against the target: <= 2 MB over 30 minutes after a 2-minute warm-up.
Every loop is bounded by the run's deadline and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from bench.soak_report import Sample, SoakReport, write_soak_report

__all__ = ["add_arguments", "run"]

TOKEN = "soak-admin-token"
WORDS = [
    "cache",
    "prefix",
    "router",
    "tenant",
    "salt",
    "page",
    "block",
    "worker",
    "prompt",
    "token",
    "event",
    "stream",
    "index",
    "query",
    "namespace",
    "decode",
    "prefill",
    "replay",
    "batch",
    "fleet",
    "rank",
    "model",
    "adapter",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute bench soak`."""
    parser.add_argument("--minutes", type=float, default=10.0, help="measured run after warm-up")
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument(
        "--rate", type=float, default=None, help="cap on requests/s (default: as fast as it goes)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--capacity-tokens", type=int, default=32768)
    parser.add_argument(
        "--buffer-steps",
        type=int,
        default=None,
        help="the workers' replay buffer in batches (default: the worker's own)",
    )
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-restart", action="store_true", help="skip the worker restart")
    parser.add_argument(
        "--no-trace",
        action="store_true",
        help="run the router without tracemalloc (RSS only, no growth sites)",
    )
    parser.add_argument("--out", "--output", type=Path, default=Path("docs/benchmarks"))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rss_of(pid: int) -> int | None:
    """Resident bytes of a process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return None
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


class _Process:
    """One fleet process, started again on the same ports after a kill."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, **(self.env or {})},
            cwd=os.getcwd(),
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                await self.kill()


async def _wait_ready(session: aiohttp.ClientSession, url: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up within {deadline_s:g} s")


def _documents(rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400))) for _ in range(300)]


def _request(rng: random.Random, docs: list[str], serial: int) -> tuple[str, dict[str, Any]]:
    """(path, body) of one request of the mixed workload."""
    text = rng.choice(docs) + f" question {serial}"  # a unique suffix: every prompt is new
    salt = f"tenant-{rng.randrange(5001)}" if rng.random() < 0.6 else None
    stream = rng.random() < 0.33
    kind = rng.random()
    body: dict[str, Any]
    if kind < 0.5:
        path, body = "/v1/completions", {"prompt": text, "max_tokens": 8, "stream": stream}
    elif kind < 0.8:
        messages = [{"role": "user", "content": text}]
        path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": 8}
        body["stream"] = stream
    else:
        path = "/generate"
        body = {"text": text, "sampling_params": {"max_new_tokens": 8}, "stream": stream}
    if salt is not None:
        body["cache_salt"] = salt
    return path, body


class _Load:
    """Counters of the load generator."""

    def __init__(self) -> None:
        self.sent = 0
        self.ok = 0
        self.errors = 0
        self.disconnects = 0


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    drop: bool,
    load: _Load,
) -> None:
    load.sent += 1
    try:
        async with session.post(
            url + path, json=body, timeout=aiohttp.ClientTimeout(total=60)
        ) as resp:
            if body.get("stream") and drop:
                await resp.content.readany()  # the client goes away after the first chunk
                load.disconnects += 1
                return
            await resp.read()
            if resp.status == 200:
                load.ok += 1
            else:
                load.errors += 1
    except (aiohttp.ClientError, TimeoutError):
        load.errors += 1


async def _drive(
    session: aiohttp.ClientSession,
    url: str,
    settings: argparse.Namespace,
    deadline: float,
    load: _Load,
) -> None:
    rng = random.Random(settings.seed)
    docs = _documents(rng)
    gap = 1.0 / settings.rate if settings.rate else 0.0
    slots = asyncio.Semaphore(settings.concurrency)
    tasks: set[asyncio.Task[None]] = set()
    serial = 0
    while time.monotonic() < deadline:
        await slots.acquire()
        serial += 1
        path, body = _request(rng, docs, serial)
        drop = rng.random() < 0.05
        task = asyncio.create_task(_one(session, url, path, body, drop, load))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        task.add_done_callback(lambda _: slots.release())
        if gap:
            await asyncio.sleep(gap)
    if tasks:
        await asyncio.wait(tasks)


async def _memory(session: aiohttp.ClientSession, url: str, **query: str) -> dict[str, Any]:
    async with session.get(
        url + "/admin/debug/memory",
        params=query,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=aiohttp.ClientTimeout(total=30),
    ) as resp:
        return dict(await resp.json())


@contextlib.asynccontextmanager
async def _fleet(
    settings: argparse.Namespace, tmp: Path
) -> AsyncIterator[tuple[str, _Process, list[_Process]]]:
    py = [sys.executable, "-m", "router.commands.cli"]
    workers: list[_Process] = []
    lines = [
        "[listen]",
        'host = "127.0.0.1"',
        "port = {router_port}",
        "[admin]",
        f'token = "{TOKEN}"',
    ]
    ports = _free_ports(3 * settings.workers + 1)
    for i in range(settings.workers):
        http, events, replay = ports[3 * i : 3 * i + 3]
        argv = [*py, "worker", "--port", str(http), "--events", f"tcp://127.0.0.1:{events}"]
        argv += ["--replay", f"tcp://127.0.0.1:{replay}", "--time-scale", "0"]
        argv += ["--capacity-tokens", str(settings.capacity_tokens), "--page-size", "16"]
        if settings.buffer_steps is not None:
            argv += ["--buffer-steps", str(settings.buffer_steps)]
        workers.append(_Process(f"worker-{i}", argv))
        lines += [
            "[[workers]]",
            f'id = "w{i}"',
            f'url = "http://127.0.0.1:{http}"',
            f'events = "tcp://127.0.0.1:{events}"',
            f'replay = "tcp://127.0.0.1:{replay}"',
            "block_size = 16",
        ]
    config = tmp / "soak.toml"
    config.write_text("\n".join(lines).format(router_port=ports[-1]) + "\n")
    env = {} if settings.no_trace else {"KVROUTE_TRACEMALLOC": "1"}
    router = _Process("router", [*py, "serve", "--config", str(config)], env)
    try:
        for w in workers:
            await w.start()
        await router.start()
        yield f"http://127.0.0.1:{ports[-1]}", router, workers
    finally:
        await router.stop()
        for w in workers:
            await w.stop()


async def soak(settings: argparse.Namespace) -> SoakReport:
    """Run the soak and gather its samples (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        async with (
            _fleet(settings, Path(tmp)) as (url, router, workers),
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
        ):
            await _wait_ready(session, url + "/health")
            started = time.monotonic()
            warm_end = started + settings.warmup_minutes * 60
            deadline = warm_end + settings.minutes * 60
            # a tracemalloc snapshot itself costs tens of MB of RSS that the allocator keeps:
            # taken inside the warm-up, it is not counted as growth
            baseline_at = warm_end - min(60.0, settings.warmup_minutes * 30)
            load = _Load()
            samples: list[Sample] = []
            driver = asyncio.create_task(_drive(session, url, settings, deadline, load))
            restarted = settings.no_restart or not workers
            baseline_taken = False
            try:
                while time.monotonic() < deadline:
                    now = time.monotonic()
                    mem = await _memory(session, url)
                    samples.append(
                        Sample(
                            t_s=now - started,
                            router_rss=rss_of(router.pid) or 0,
                            router_traced=int(mem.get("traced_bytes") or 0),
                            worker_rss=[rss_of(w.pid) or 0 for w in workers],
                            requests=load.sent,
                        )
                    )
                    if not baseline_taken and not settings.no_trace and now >= baseline_at:
                        async with session.post(
                            url + "/admin/debug/memory/baseline",
                            headers={"Authorization": f"Bearer {TOKEN}"},
                        ) as resp:
                            baseline_taken = resp.status == 200
                    if not restarted and now >= warm_end + settings.minutes * 30:
                        await workers[-1].kill()
                        await asyncio.sleep(2.0)
                        await workers[-1].start()
                        restarted = True
                    await asyncio.sleep(
                        max(0.0, min(settings.sample_s, deadline - time.monotonic()))
                    )
                await driver
                growth = (await _memory(session, url, top="15")).get("growth", [])
            finally:
                driver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await driver
            return SoakReport(
                command=_command(settings),
                minutes=settings.minutes,
                warmup_minutes=settings.warmup_minutes,
                concurrency=settings.concurrency,
                workers=settings.workers,
                requests=load.sent,
                ok=load.ok,
                errors=load.errors,
                disconnects=load.disconnects,
                worker_restarted=not settings.no_restart,
                samples=samples,
                growth=msgspec.convert(growth, list[dict[str, Any]]),
                traced=not settings.no_trace,
            )


def _command(settings: argparse.Namespace) -> str:
    parts = ["kvroute bench soak", f"--minutes {settings.minutes:g}"]
    parts += [
        f"--warmup-minutes {settings.warmup_minutes:g}",
        f"--concurrency {settings.concurrency}",
    ]
    if settings.rate:
        parts.append(f"--rate {settings.rate:g}")
    parts += [f"--workers {settings.workers}", f"--capacity-tokens {settings.capacity_tokens}"]
    if settings.buffer_steps is not None:
        parts.append(f"--buffer-steps {settings.buffer_steps}")
    if settings.no_restart:
        parts.append("--no-restart")
    if settings.no_trace:
        parts.append("--no-trace")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Run the soak and write the report."""
    if args.minutes <= 0 or args.warmup_minutes < 0 or args.concurrency < 1 or args.workers < 1:
        print(
            "kvroute bench soak: --minutes > 0, --concurrency and --workers >= 1", file=sys.stderr
        )
        return 2
    report = asyncio.run(soak(args))
    path = write_soak_report(report, args.out)
    print(f"report: {path}")
    return 0
