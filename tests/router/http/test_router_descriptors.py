"""The router under a low descriptor limit, over real sockets: its connection cap leaves the
KV-event streams their descriptors, and a worker connection the router cannot open for want of
descriptors is the router's own failure, not the worker's.

QA: under `ulimit -n 1024` a router following a worker of 100 ranks sat at 622 descriptors idle
with a cap of 464 connections; 402 idle clients took the rest, and new clients (/health too)
got resets or nothing, with nothing logged. With fewer clients left, a connection to the
worker failing with EMFILE was a 502 that opened the healthy worker's circuit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from router.config import HealthConfig, RouterConfig, WorkerConfig
from router.routing.breaker import BreakerState
from router.service import RouterService
from tests.raw_http import request_bytes, wait_eof
from tests.router.conftest import eventually, router_config
from tests.router.test_router_pd_failures import MODEL, FakePdWorker
from tests.subprocesses import ends_on_sigint
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

_SOFT_LIMIT = 1024  # the common default (soft; here hard too)
_RANKS = 100


def _descriptor_limit(limit: int) -> Callable[[], None]:
    """Soft and hard limit both: the router raises a soft limit to the hard one as it starts
    (`router.commands.descriptor_limit`)."""

    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return set_limit


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.asynccontextmanager
async def _served_router(config: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """`kvroute serve` under a descriptor limit of 1,024: the process and its port. After
    the block it must stop on SIGINT; its stderr is left to read."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "serve", "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=_descriptor_limit(_SOFT_LIMIT),
    )  # fmt: skip
    assert proc.stdout is not None
    async with ends_on_sigint(proc):
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "listening on " in line, line
        url = line.split("listening on ")[1].split()[0]
        yield proc, int(url.rsplit(":", 1)[1])


async def _one_answer(
    port: int, request: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, bytes]:
    """A new connection and the status and body of its one answer (0 and the bytes read when
    the router sent no whole answer within 5 s, or reset the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    try:
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
        return reader, writer, 0, repr(exc).encode()
    return reader, writer, int(head.split()[1]), body


async def test_following_100_ranks_the_router_refuses_clients_with_a_503_before_descriptors_run_out(
    tmp_path: Path,
) -> None:
    cfg = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=_RANKS)
    async with ReferenceWorker(cfg) as worker:
        config = tmp_path / "router.toml"
        config.write_text(
            '[listen]\nhost = "127.0.0.1"\nport = 0\n[admin]\ntoken = "t"\n'
            "[limits]\nidle_timeout_s = 60\n"
            f'[[workers]]\nid = "big"\nurl = "{worker.url}"\n'
        )
        async with _served_router(config) as (proc, port):
            # every rank's stream subscribed, and their sockets open: most of the descriptors
            # (six a stream, 622 in all; QA's router sat there idle)
            streams = request_bytes(b"GET", b"/admin/streams", [(b"Authorization", b"Bearer t")])

            async def subscribed() -> bool:
                _, writer, status, body = await _one_answer(port, streams)
                writer.close()
                if status != 200 or len(json.loads(body)["streams"]) != _RANKS:
                    return False
                return _descriptors(proc.pid) > 6 * _RANKS

            await eventually(subscribed, timeout_s=30, what="the 100 streams' sockets open")
            idle = _descriptors(proc.pid)
            held: list[asyncio.StreamWriter] = []
            try:
                # idle keep-alive clients, each served once, until the router refuses one
                health = request_bytes(b"GET", b"/health", close=False)
                for _ in range(_SOFT_LIMIT):
                    _, writer, status, body = await _one_answer(port, health)
                    held.append(writer)
                    if status != 200:
                        break
                assert status == 503, (len(held), idle, _descriptors(proc.pid), body[:200])
                assert json.loads(body)["error"]["type"] == "TooManyConnectionsError"
                served = len(held) - 1
                # at the cap the process is within its limit, with room for an upstream
                # connection for each client it holds
                assert _descriptors(proc.pid) + served < _SOFT_LIMIT
                # every further client, /health and the admin API too, gets the 503 and a
                # clean close: not a reset, not silence
                for target in (b"/health", b"/admin/workers", b"/health"):
                    reader, writer, status, body = await _one_answer(
                        port, request_bytes(b"GET", target)
                    )
                    assert status == 503, (target, body[:200])
                    assert json.loads(body)["error"]["type"] == "TooManyConnectionsError"
                    await wait_eof(reader, 5)
                    writer.close()
            finally:
                for writer in held:
                    writer.close()

            async def serves_again() -> bool:
                _, writer, status, _ = await _one_answer(port, request_bytes(b"GET", b"/health"))
                writer.close()
                return status == 200

            await eventually(serves_again, what="the router serving once the clients left")
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
    assert "Too many open files" not in log, log[-2000:]
    assert "kept for the KV-event streams" in log, log[-2000:]


# --------------------------------------------------- a worker connection with no descriptor


@contextlib.contextmanager
def _no_descriptor_left() -> Iterator[None]:
    """Every descriptor this process may open taken, for the block: its soft RLIMIT_NOFILE
    lowered to a few past what it holds, those few opened on /dev/null; then all given back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_descriptors(os.getpid()) + 64, hard))
    taken: list[int] = []
    try:
        with contextlib.suppress(OSError):  # EMFILE: the last one is taken
            while len(taken) < 100_000:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body of the next answer on a keep-alive connection."""
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return int(head.split()[1]), await reader.readexactly(length)


async def _refused_for_want_of_descriptors(router: RouterService, path: bytes, body: bytes) -> str:
    """POST `body` to `path` on a connection the router accepted before its descriptors ran
    out, sent once none is left: the 503's message (asserted a 503 `OutOfResourcesError`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(router))
    try:
        # served once: the connection is the router's before its descriptors run out
        writer.write(request_bytes(b"GET", b"/health", close=False))
        assert (await _answer(reader))[0] == 200
        post = request_bytes(b"POST", path, [(b"Content-Type", b"application/json")], body)
        with _no_descriptor_left():
            writer.write(post)
            status, answer = await _answer(reader)
    finally:
        writer.close()
    assert status == 503, answer[:300]
    error = json.loads(answer)["error"]
    assert error["type"] == "OutOfResourcesError", error
    return str(error["message"])


def _port(router: RouterService) -> int:
    return int(router.url.rsplit(":", 1)[1])


def _unfollowed(config: RouterConfig) -> RouterConfig:
    """`config` with no KV-event stream: no zmq socket that could want a descriptor."""
    workers = tuple(msgspec.structs.replace(w, kv_events=False) for w in config.workers)
    return msgspec.structs.replace(config, workers=workers)


def _charged(router: RouterService) -> dict[str, tuple[int, BreakerState]]:
    clock = router.planner.clock()
    return {e.id: (e.breaker.failures, e.breaker.state(clock)) for e in router.planner.pool}


async def test_a_worker_connection_the_router_has_no_descriptor_for_is_its_503_not_the_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a 502 (`cannot connect to ...: Too many open files`) charged to the healthy
    worker as a refused connection, which opened its circuit at once."""
    caplog.set_level(logging.WARNING)
    async with ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as worker:
        # health rounds far apart: only the request could move the breaker
        config = router_config([("w", worker.url)], health=HealthConfig(interval_s=60.0))
        async with RouterService(_unfollowed(config)) as router, aiohttp.ClientSession() as s:
            body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
            for _ in range(2):  # the second is not logged (one line per interval)
                message = await _refused_for_want_of_descriptors(router, b"/v1/completions", body)
                assert "worker w" in message and "RLIMIT_NOFILE" in message, message
                assert _charged(router) == {"w": (0, BreakerState.CLOSED)}
            # descriptors back: served at once, the worker in rotation all along
            async with s.post(router.url + "/v1/completions", data=body) as resp:
                assert resp.status == 200, await resp.text()
    said = [r.getMessage() for r in caplog.records if r.name == "router.http.local_shortage"]
    assert len(said) == 1, said
    assert "worker w: Too many open files" in said[0] and "not charged" in said[0], said


async def test_a_prefill_the_router_has_no_descriptor_for_is_its_503_and_neither_side_charged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill leg's own HTTP client (aiohttp): its connection error wraps the EMFILE. The
    prefill answers every request with `Connection: close`, so the leg must connect anew."""
    caplog.set_level(logging.WARNING)
    async with (
        FakePdWorker("prefill", keep_alive=False) as prefill,
        FakePdWorker("decode") as decode,
    ):
        workers = tuple(
            WorkerConfig(
                url=w.url, id=wid, engine="vllm", role=w.role, model=MODEL, kv_events=False
            )
            for wid, w in (("p", prefill), ("d", decode))
        )
        config = router_config([], health=HealthConfig(interval_s=60.0))
        config = msgspec.structs.replace(config, workers=workers)
        async with RouterService(config) as router:
            body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
            message = await _refused_for_want_of_descriptors(router, b"/v1/completions", body)
            assert "worker p" in message and "RLIMIT_NOFILE" in message, message
            assert _charged(router) == {
                "p": (0, BreakerState.CLOSED),
                "d": (0, BreakerState.CLOSED),
            }
            assert not prefill.seen and not decode.seen
    said = [r.getMessage() for r in caplog.records if r.name == "router.http.local_shortage"]
    assert len(said) == 1 and "worker p: Too many open files" in said[0], said
