"""The zmq sockets of a process's subscriptions: sized from its descriptor limit, and the
streams that do not fit wait (predicting nothing), said once, instead of failing in a loop.

libzmq's context opens 1023 sockets by default and a stream holds three or four: a router
followed about 255 ranks in all, though a worker may have 1024. A 300-rank worker made ~400
"subscriber failed; restarting" tracebacks in 8 s (`ZMQError: Too many open files`), a
1024-rank one 6,276.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import resource
import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from indexer.config import IndexerConfig
from indexer.service import IndexerService, StreamConfig
from indexer.stats import StreamState
from indexer.subscriptions import socket_budget
from tests.router.conftest import eventually
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


class HeldPorts:
    """Loopback ports bound and never listened on, held for the test: a connection to one is
    refused, and no socket of the process takes it as its own port meanwhile (a port merely
    found free may become a connecting socket's, which then talks to itself)."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []

    def endpoint(self) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self._held.append(sock)
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        for sock in self._held:
            sock.close()


@pytest.fixture
def ports() -> Iterator[HeldPorts]:
    held = HeldPorts()
    yield held
    held.close()


def _silent_streams(ports: HeldPorts, ranks: int) -> list[StreamConfig]:
    """`ranks` streams with replay endpoints (six sockets each), nobody behind them."""
    return [
        StreamConfig(
            endpoint=ports.endpoint(),
            replay_endpoint=ports.endpoint(),
            block_size=16,
            model="m",
            dp_rank=rank,
        )
        for rank in range(ranks)
    ]


@contextlib.contextmanager
def _descriptor_limit(soft: int) -> Iterator[None]:
    """The process's soft RLIMIT_NOFILE lowered to `soft` (the hard one stays), then back."""
    was, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (was, hard))


def test_the_context_may_open_as_many_sockets_as_descriptors() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = zmq.Context.instance().get(zmq.SOCKET_LIMIT)
    expected = ceiling if soft == resource.RLIM_INFINITY else min(ceiling, soft)
    assert socket_budget(ceiling)[0] == expected
    with _descriptor_limit(600):
        assert socket_budget(ceiling) == (600, 600)


async def test_every_rank_of_a_300_rank_worker_is_followed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """1,200 sockets: past libzmq's default of 1023, within the descriptor limit."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 4096:
        pytest.skip("needs a descriptor limit of 4096 (the worker and the router share it)")
    caplog.set_level(logging.WARNING)
    cfg = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=300)
    async with ReferenceWorker(cfg) as worker, IndexerService() as indexer:
        info = worker.kv_events
        streams = [
            StreamConfig(
                endpoint=endpoint, replay_endpoint=replay, block_size=16, model="m", dp_rank=rank
            )
            for rank, (endpoint, replay) in enumerate(
                zip(info.endpoints, info.replay_endpoints, strict=True)
            )
        ]
        await indexer.add_worker("w", streams)

        async def synced() -> bool:
            return all(s.state == StreamState.SYNCED for s in indexer.streams())

        await eventually(synced, timeout_s=30, what="all 300 ranks to sync")
        assert len(indexer.streams()) == 300
    failed = [r for r in caplog.records if "subscriber failed" in r.getMessage()]
    assert not failed, failed[0].getMessage()


async def test_streams_past_the_budget_wait_said_once_and_start_when_sockets_free(
    caplog: pytest.LogCaptureFixture, ports: HeldPorts
) -> None:
    """A descriptor limit of 512: the context opens 512 sockets, the streams hold 256 of them,
    42 streams of six (with a replay socket). Of a worker of 80 ranks, 38 wait (one WARNING
    naming the limit, no traceback), and another worker's stream waits behind them; removing
    a worker lets them in, in order."""
    caplog.set_level(logging.INFO, logger="indexer")
    with _descriptor_limit(512):
        indexer = await IndexerService().__aenter__()
    try:
        subs = indexer._subs  # the sockets are the subscriptions': what the test looks at
        assert (subs.max_sockets, subs.socket_room) == (512, 256)
        await indexer.add_worker("big", _silent_streams(ports, 80))
        await indexer.add_worker("late", _silent_streams(ports, 1))
        assert subs.waiting() == [*(f"big#dp{r}" for r in range(42, 80)), "late#dp0"]
        await asyncio.sleep(0.5)  # the 42 sessions open their sockets meanwhile
        said = [r for r in caplog.records if r.name == "indexer.subscriptions"]
        said = [r for r in said if r.levelno >= logging.WARNING]
        assert len(said) == 1, [r.getMessage() for r in said]  # once per log_interval_s
        line = said[0].getMessage()
        assert "38 of its 80 KV-event stream(s) wait for zmq sockets" in line, line
        assert "RLIMIT_NOFILE 512" in line and "ulimit -n" in line, line
        # a waiting stream predicts nothing: it never applied anything
        waiting = indexer.health_of("big#dp70")
        assert waiting is not None and waiting.state == StreamState.SYNCING
        started = time.monotonic()
        await indexer.remove_worker("big")
        assert subs.waiting() == []
        assert [s.stream for s in indexer.streams()] == ["late#dp0"]
        assert time.monotonic() - started < 5.0
        assert any("has them now" in r.getMessage() for r in caplog.records)
        # the late stream runs: its task is alive, not parked
        task = subs.task("late#dp0")
        assert task is not None and not task.done()
    finally:
        await indexer.__aexit__(None, None, None)
    assert not [r for r in caplog.records if "subscriber failed" in r.getMessage()]


async def test_a_session_failing_in_a_loop_says_its_traceback_once_then_a_line_an_interval(
    caplog: pytest.LogCaptureFixture, ports: HeldPorts
) -> None:
    """The process out of descriptors (taken by something else than the streams): each session
    fails at its first socket. It logged a traceback at every restart (30 in 1.5 s here); now
    the first with its traceback, then one line a `log_interval_s` counting the others."""
    caplog.set_level(logging.WARNING, logger="indexer")
    streams = _silent_streams(ports, 1)
    config = IndexerConfig(log_interval_s=0.4, restart_backoff_max_s=0.05)
    with _descriptor_limit(256):
        async with IndexerService(config) as indexer:
            hog: list[int] = []
            try:
                with contextlib.suppress(OSError):
                    while True:
                        hog.append(os.open(os.devnull, os.O_RDONLY))
                await indexer.add_worker("w", streams)
                await asyncio.sleep(1.5)
            finally:
                for fd in hog:
                    os.close(fd)
    failed = [r for r in caplog.records if "subscriber failed" in r.getMessage()]
    traced = [r.exc_text or "" for r in failed if r.exc_info is not None]
    assert len(traced) == 1 and "ZMQError: Too many open files" in traced[0], traced
    again = [r.getMessage() for r in failed if r.exc_info is None]
    assert 1 <= len(again) <= 4, again  # one an interval of 0.4 s
    assert all("failed again (ZMQError: Too many open files; " in line for line in again), again
    counts = [re.search(r"; (\d+) more since", line) for line in again]
    held_back = sum(int(count[1]) for count in counts if count is not None)
    assert held_back >= 5, again  # the restarts went on (every 50 ms), said in the count
