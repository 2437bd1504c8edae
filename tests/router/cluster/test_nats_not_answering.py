"""A replica whose NATS does not answer at its start says why, as `kvroute relay` does.

QA: a refused connection and a server that is not NATS both read `cluster degraded: NATS at
... did not answer within 3 s`, while the relay's line said `(last attempt:
ConnectionRefusedError ...)`. Real sockets on 127.0.0.1: a port that refuses, a listener that
never speaks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

from router.cluster.nats_client import attempt_error
from router.service import RouterService
from tests.router.cluster.conftest import cluster
from tests.router.conftest import router_config

SECRET = "s3cret/pass"


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A port bound and never listened on: every connection is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A listener that takes connections and never says a word (not NATS: no INFO line)."""

    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    async with server:
        yield int(server.sockets[0].getsockname()[1])
    for writer in held:
        writer.close()
        await writer.wait_closed()


async def _startup_line(port: int, caplog: pytest.LogCaptureFixture, within_s: float) -> str:
    """The replica's `cluster degraded` line, NATS at `port` with a password in the URL."""
    caplog.set_level(logging.DEBUG)
    url = f"nats://kvuser:{SECRET.replace('/', '%2F')}@127.0.0.1:{port}"
    config = router_config([], cluster=cluster(url, startup_timeout_s=within_s, replica_id="a"))
    async with RouterService(config):
        pass
    assert not any(SECRET in r.getMessage() for r in caplog.records)
    said = [r.getMessage() for r in caplog.records if "cluster degraded" in r.getMessage()]
    assert len(said) == 1, said
    return said[0]


async def test_a_refused_connection_is_named(
    refusing_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    line = await _startup_line(refusing_port, caplog, 0.5)
    assert "did not answer within 0.5 s (last attempt: ConnectionRefusedError" in line, line
    assert f"nats://***@127.0.0.1:{refusing_port}" in line


async def test_a_server_that_is_not_nats_is_named(
    silent_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    # past the client's connect timeout (2 s), which is how such a server shows
    line = await _startup_line(silent_port, caplog, 2.5)
    assert "(last attempt: TimeoutError: no answer within the client's connect timeout" in line


def test_an_attempts_error_never_shows_the_urls_password_or_token() -> None:
    servers = [f"nats://kvuser:{SECRET.replace('/', '%2F')}@h:4222", "nats://tok3n@g:4222"]
    for text in (f"bad {SECRET}", "bad s3cret%2Fpass", "bad tok3n"):
        said = attempt_error(OSError(text), servers)
        assert said == "OSError: bad ***", said
    assert attempt_error(OSError("kvuser at h"), servers) == "OSError: kvuser at h"
