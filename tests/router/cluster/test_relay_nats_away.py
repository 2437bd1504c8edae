"""`kvroute relay` while its NATS does not answer: said once, and shown on `/health`.

The NATS client retries a refused connection by itself forever, so the relay's own "does not
answer" line never ran: the relay listened and then said nothing at INFO or WARNING for as long
as NATS was away (a wrong `[cluster] url` was invisible), and `/health` said "ok". It now warns
once after `cluster.startup_timeout_s` (as a replica does), says one line when NATS answers,
and `/health`'s top-level status is "degraded" meanwhile (200, as a degraded replica's).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from nats import connect as nats_connect
from nats import errors as nats_errors

from router.cluster.server import NatsServer
from router.service import RouterService
from tests.router.cluster.conftest import cluster, workers
from tests.router.conftest import eventually, router_config
from workers.worker import ReferenceWorker

_LOGGER = "router.cluster.relay_publisher"


@pytest.fixture
def held_port() -> Iterator[socket.socket]:
    """A loopback port bound and never listened on: a connection to it is refused, and no
    other process takes it until the test releases it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


def _relay(worker: ReferenceWorker, port: int) -> RouterService:
    config = router_config(
        [("w0", worker.url)],
        cluster=cluster(f"nats://127.0.0.1:{port}", startup_timeout_s=0.5),
    )
    return RouterService(config, relay=True)


async def _health(session: aiohttp.ClientSession, relay: RouterService) -> tuple[int, Any]:
    async with session.get(relay.url + "/health") as resp:
        return resp.status, await resp.json()


def _said(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == _LOGGER and r.levelno >= logging.WARNING and words in r.getMessage()
    ]


async def _warned(caplog: pytest.LogCaptureFixture) -> None:
    """Until the relay said its startup-timeout warning."""

    async def warned() -> bool:
        return bool(_said(caplog, "relay degraded"))

    await eventually(warned, timeout_s=10, what="the relay's startup-timeout warning")


async def test_a_relay_whose_nats_refuses_warns_once_and_its_health_says_degraded(
    held_port: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    port = held_port.getsockname()[1]
    caplog.set_level(logging.INFO)
    async with workers(1) as (w0,), aiohttp.ClientSession() as session, _relay(w0, port) as relay:
        await _warned(caplog)
        status, body = await _health(session, relay)
        # the workers answer: 200 as a degraded replica's, but not a plain "ok"
        assert status == 200 and body["status"] == "degraded", body
        assert body["relay"]["status"] == "degraded" and body["relay"]["published"] == 0, body
        # it keeps trying (each refusal every 0.1 s here) without saying it again
        await asyncio.sleep(1.5)  # ~15 refusals, a window in which a repeat would show
    said = _said(caplog, "relay degraded")
    assert len(said) == 1, said
    # the URL it tries and why it fails are named: a wrong [cluster] url shows here
    assert f"nats://127.0.0.1:{port}" in said[0] and "within 0.5 s" in said[0], said
    assert "ConnectionRefusedError" in said[0], said


async def test_a_relay_says_so_when_a_late_nats_answers_and_its_health_is_ok_again(
    held_port: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    port = held_port.getsockname()[1]
    caplog.set_level(logging.INFO)
    async with workers(1) as (w0,), aiohttp.ClientSession() as session, _relay(w0, port) as relay:
        await _warned(caplog)
        held_port.close()  # the port is free for the late server only now
        async with NatsServer(port=port):

            async def answered() -> bool:
                return bool(_said(caplog, "relay resynced"))

            await eventually(answered, timeout_s=15, what="the relay to say NATS answers")
            status, body = await _health(session, relay)
            assert status == 200 and body["status"] == "ok", body
            assert body["relay"]["status"] == "ok", body
            async with session.post(
                w0.url + "/generate",
                json={"text": "a prompt written once NATS answers", "sampling_params": {}},
            ) as resp:
                assert resp.status == 200

            async def published() -> bool:
                return bool((await _health(session, relay))[1]["relay"]["published"] > 0)

            await eventually(published, timeout_s=10, what="records written")
    resynced = _said(caplog, "relay resynced")
    assert len(resynced) == 1 and f"nats://127.0.0.1:{port}" in resynced[0], resynced


async def test_a_relay_whose_nats_answers_at_once_warns_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with (
        NatsServer() as nats,
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        _relay(w0, nats.port) as relay,
    ):

        async def ok() -> bool:
            return bool((await _health(session, relay))[1]["status"] == "ok")

        await eventually(ok, timeout_s=10, what="the relay's health to say ok")
        await asyncio.sleep(1.0)  # past the startup timeout
    assert not _said(caplog, "relay degraded") and not _said(caplog, "relay resynced")


async def test_a_relay_whose_nats_client_is_closed_for_good_connects_a_new_one_and_writes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nats-py closes its client for good on a server's -ERR (here a line past nats-server's
    4 KiB control line, as a record of a 2,000-character worker id's stream was: its subject
    is the stream id in hex) and reconnects no more. Before, the relay wrote nothing from then
    on, until restarted, and its followers predicted nothing. Now a new client connects, said
    once, and the records reach the stream again."""
    caplog.set_level(logging.INFO)
    async with (
        NatsServer() as nats,
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        _relay(w0, nats.port) as relay,
    ):
        publisher = relay.relay
        assert publisher is not None
        listener = await nats_connect(nats.url)
        try:
            js = listener.jetstream()

            async def stored() -> int:
                try:
                    info = await js.stream_info("kvroute_events")
                except nats_errors.Error:
                    return 0
                return int(info.state.messages)

            async def ok() -> bool:
                return bool((await _health(session, relay))[1]["status"] == "ok")

            await eventually(ok, timeout_s=10, what="the relay's health to say ok")
            closing = publisher._nc
            assert closing is not None
            await closing.publish("x" * 5000, b"")  # a real -ERR: the server drops the client

            async def replaced() -> bool:
                return closing.is_closed and publisher._nc is not closing and await ok()

            await eventually(replaced, timeout_s=10, what="a new client")
            before = await stored()
            async with session.post(
                w0.url + "/generate",
                json={"text": "a prompt written after the new client", "sampling_params": {}},
            ) as resp:
                assert resp.status == 200

            async def written() -> bool:
                return await stored() > before

            await eventually(written, timeout_s=10, what="records stored through the new client")
        finally:
            await listener.close()
    closed = _said(caplog, "closed for good")
    assert len(closed) == 1 and "maximum control line exceeded" in closed[0].lower(), closed
    assert len(_said(caplog, "relay resynced")) == 1
