"""A replica or relay stops within a bound while its NATS does not answer.

QA: a `kvroute serve --processes N` child (and `kvroute relay`) ignored SIGTERM while NATS was
down, its shutdown waiting forever on its connect task. Python 3.11's `asyncio.wait_for`, which
nats-py's connect attempts wait in, returns the attempt's refused connection instead of the
CancelledError when both land in one loop step, and the client's retry loop catches it and
tries again: the cancellation is lost. Now a stop cancels again the tasks that outlived a
cancellation, under a deadline, and tells the client to try no more (`router.cluster.tasks`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest

from router.cluster.relay_publisher import RelayPublisher
from router.cluster.server import NatsServer
from router.cluster.tasks import StoppableTaskGroup, stop_tasks
from router.config import ClusterConfig
from router.service import RouterService
from tests.router.cluster.conftest import cluster
from tests.router.conftest import router_config

# nats-py waits this long (the reconnect wait: min(1 s, heartbeat_interval_s)) between
# attempts: short, so that a cancellation often lands as one fails
_RETRY_S = 0.001
_STOPS = 25  # enter and leave this many times: before, one in a few hung (measured)
_STOP_WITHIN_S = 3.0


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A NATS URL whose port is bound and never listened on: every attempt is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"nats://127.0.0.1:{sock.getsockname()[1]}"


def _down(url: str) -> ClusterConfig:
    return cluster(
        url,
        heartbeat_interval_s=_RETRY_S,
        heartbeat_timeout_s=0.5,
        startup_timeout_s=0.05,
        replica_id="a",
    )


async def _stops_each_time(enter: Callable[[], Coroutine[Any, Any, Any]], seed: int) -> None:
    """Enter and leave `_STOPS` times, each leave within `_STOP_WITHIN_S` (the seed printed)."""
    print(f"seed {seed}")
    rng = random.Random(seed)
    for i in range(_STOPS):
        thing = await enter()
        await asyncio.sleep(rng.random() * 0.05)  # the connect loop at some point of its own
        started = time.monotonic()
        leaving = asyncio.ensure_future(thing.__aexit__(None, None, None))
        done, _ = await asyncio.wait([leaving], timeout=_STOP_WITHIN_S)
        assert done, f"stop {i} still waiting after {_STOP_WITHIN_S} s (seed {seed})"
        leaving.result()
        assert time.monotonic() - started < _STOP_WITHIN_S


async def _replica(url: str) -> RouterService:
    router = RouterService(router_config([], cluster=_down(url)))
    await router.__aenter__()
    return router


async def _relay(url: str) -> RelayPublisher:
    relay = RelayPublisher(_down(url), name="test-relay")
    return await relay.__aenter__()


async def test_a_replica_stops_while_nats_is_down(dead_url: str) -> None:
    await _stops_each_time(lambda: _replica(dead_url), seed=random.randrange(1 << 30))


async def test_the_relay_stops_while_nats_is_down(dead_url: str) -> None:
    await _stops_each_time(lambda: _relay(dead_url), seed=random.randrange(1 << 30))


@pytest.mark.parametrize("what", ["replica", "relay"])
def test_they_stop_on_uvloop_too(dead_url: str, what: str) -> None:
    # the router's default loop, on which QA measured one lost cancellation in two
    uvloop = pytest.importorskip("uvloop")
    make = _replica if what == "replica" else _relay
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_stops_each_time(lambda: make(dead_url), seed=random.randrange(1 << 30)))


# ---------------------------------------------------------------- the stop itself


class _Stubborn:
    """A task body that outlives `lose` cancellations, as nats-py's connect loop does with one
    lost (`lose=-1`: every one, until `release`)."""

    def __init__(self, lose: int) -> None:
        self.lose = lose
        self.lost = 0
        self.released = asyncio.Event()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if self.released.is_set() or self.lost == self.lose:
                    raise
                self.lost += 1

    def release(self) -> None:
        self.released.set()


async def test_a_task_that_lost_cancellations_is_cancelled_again() -> None:
    stubborn = _Stubborn(lose=3)
    task = asyncio.create_task(stubborn.run())
    await asyncio.sleep(0)
    started = time.monotonic()
    assert await stop_tasks([task], within_s=5.0) == []
    assert task.cancelled() and stubborn.lost == 3
    assert time.monotonic() - started < 2.0


@pytest.fixture
async def stubborn_group() -> AsyncIterator[tuple[StoppableTaskGroup, _Stubborn]]:
    group = StoppableTaskGroup()
    await group.__aenter__()
    stubborn = _Stubborn(lose=-1)
    yield group, stubborn
    stubborn.release()
    await stop_tasks(group.running, within_s=5.0)
    await group.__aexit__(None, None, None)


async def test_a_group_stop_leaves_behind_a_task_that_never_ends(
    stubborn_group: tuple[StoppableTaskGroup, _Stubborn],
) -> None:
    group, stubborn = stubborn_group
    quick = group.create_task(asyncio.sleep(3600))
    never = group.create_task(stubborn.run(), name="never-ends")
    await asyncio.sleep(0)
    started = time.monotonic()
    assert await group.stop(within_s=0.3) == [never]
    assert 0.3 <= time.monotonic() - started < 1.0
    assert quick.cancelled() and not never.done() and stubborn.lost >= 1


async def test_a_replica_says_what_it_left_behind(
    dead_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="router.cluster.service")
    monkeypatch.setattr("router.cluster.service.STOP_TIMEOUT_S", 0.3)
    router = await _replica(dead_url)
    cluster_service = router.cluster
    assert cluster_service is not None
    stubborn = _Stubborn(lose=-1)
    task = cluster_service._spawn(stubborn.run())
    try:
        await asyncio.wait_for(router.__aexit__(None, None, None), 5.0)
    finally:
        stubborn.release()
        task.cancel()
    said = [r.getMessage() for r in caplog.records if "left behind" in r.getMessage()]
    assert said == [
        "cluster: 1 background task(s) still running 0.3 s after being told to stop, left "
        "behind (_Stubborn.run); stopping anyway"
    ], said


# ---------------------------------------------------------------- a stop after NATS went away


async def _stop_with_data_buffered(what: str) -> None:
    """Connect a replica or the relay to a real nats-server, kill the server, have the client
    buffer data for it (as a replica's heartbeats do after ~20 s down), then stop."""
    async with NatsServer() as nats:
        config = cluster(nats.url, replica_id="a")
        if what == "replica":
            router = RouterService(router_config([], cluster=config))
            await router.__aenter__()
            assert router.cluster is not None
            client, leave = router.cluster._nc, router.__aexit__
        else:
            relay = await RelayPublisher(config, name="test-relay").__aenter__()
            await _until(lambda: relay.connected, "the relay to connect")
            client, leave = relay._nc, relay.__aexit__
        try:
            assert client is not None and client.is_connected
            await nats.stop()
            await _until(lambda: client.is_reconnecting, "the client to see NATS gone")
            await client.publish("kvroute-test.buffered", b"waits for a server that is gone")
            # what its close would write to the dropped connection's transport
            assert client._pending_data_size > 0
        finally:
            await asyncio.wait_for(leave(None, None, None), _STOP_WITHIN_S + 5.0)
        assert client.is_closed


async def _until(check: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(10.0):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("what", ["replica", "relay"])
def test_a_stop_after_nats_went_away_with_data_buffered_is_clean_on_uvloop(what: str) -> None:
    """QA: a replica stopped after NATS had been down ~20 s exited with status 1 and a
    traceback: nats-py's close wrote what its client buffered to the dropped connection's
    transport, which uvloop refuses (`RuntimeError: unable to perform operation on
    <TCPTransport closed=True ...>`), and the error left the rest of the stop undone."""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_stop_with_data_buffered(what))
