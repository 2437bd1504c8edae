"""The upstream hop's client against real sockets: scripted HTTP servers on 127.0.0.1 that
answer the way workers do, and the ways they fail."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from router.http.upstream_client import (
    Origin,
    UnsafeHeaderError,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDroppedError,
    UpstreamResponse,
)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ScriptedServer:
    """A raw TCP server that runs `script` on every connection and counts them."""

    def __init__(self, script: Script, tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self._tls = tls
        self.connections = 0
        self.closed = 0  # connections whose peer (the client) closed them
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    @classmethod
    def once(cls, raw: bytes, *, linger: bool = False) -> ScriptedServer:
        """A server that answers one request with `raw`, then closes (with `linger`: waits for
        the client to close first, and counts it)."""

        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(raw)
            await writer.drain()
            if linger:
                await server.read_request(reader)

        server = cls(script)
        return server

    @classmethod
    def answering(cls, body: bytes) -> ScriptedServer:
        """A server that answers every request of each connection with `body` (keep-alive)."""

        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await server.read_request(reader):
                writer.write(_answer(body))
                await writer.drain()

        server = cls(script)
        return server

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._tls)
        port = self._server.sockets[0].getsockname()[1]
        self.origin = Origin("127.0.0.1", port, False, f"127.0.0.1:{port}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request (head and Content-Length body); b"" when the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed += 1
            return b""
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body


def _answer(body: bytes, *extra: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"Content-Type: application/json", *extra]
    head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def _post(
    client: UpstreamClient,
    origin: Origin,
    body: bytes = b"{}",
    *,
    timeout_s: float = 5.0,
    headers: list[tuple[str, str]] | None = None,
) -> tuple[int, bytes]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with client.post(
        origin, "/generate", headers or [], body, deadline=deadline, connect_timeout_s=2
    ) as response:
        return response.status, await response.read()


def _exchange(
    client: UpstreamClient, origin: Origin
) -> contextlib.AbstractAsyncContextManager[UpstreamResponse]:
    """A POST of `{}` with 5 s to answer, its answer read by the test."""
    deadline = asyncio.get_running_loop().time() + 5
    return client.post(origin, "/generate", [], b"{}", deadline=deadline, connect_timeout_s=2)


@contextlib.asynccontextmanager
async def _client(keepalive_s: float = 4.0) -> AsyncIterator[UpstreamClient]:
    async with UpstreamClient(keepalive_s=keepalive_s) as client:
        yield client


async def test_keep_alive_reuses_one_connection_and_sends_what_it_was_given() -> None:
    async with ScriptedServer.answering(b'{"ok": true}') as server, _client() as client:
        for i in range(5):
            status, body = await _post(
                client, server.origin, b'{"n": %d}' % i, headers=[("x-request-id", "r1")]
            )
            assert (status, body) == (200, b'{"ok": true}')
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /generate HTTP/1.1\r\n")
    assert f"Host: {server.origin.netloc}".encode() in first
    assert b"Content-Length: 8\r\n" in first and b"x-request-id: r1\r\n" in first
    assert first.endswith(b'\r\n\r\n{"n": 0}')


async def test_a_chunked_stream_arrives_chunk_by_chunk() -> None:
    second = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n"
        )
        await writer.drain()
        await second.wait()  # the client must see chunk 1 before chunk 2 exists
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()
        await server.read_request(reader)

    async with ScriptedServer(script) as server, _client() as client:
        async with _exchange(client, server.origin) as response:
            assert response.headers["Transfer-Encoding"] == "chunked"
            assert await response.readany() == b"data: 1"
            second.set()
            assert await response.readany() == b"data: 2"
            assert await response.readany() == b""
        # read to its end: the connection is back in the pool
        assert sum(len(idle) for idle in client._idle.values()) == 1


async def test_an_answer_that_ends_with_the_connection_is_read_whole() -> None:
    async with (
        ScriptedServer.once(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end") as server,
        _client() as client,
    ):
        assert await _post(client, server.origin) == (200, b"until the end")
        assert await _post(client, server.origin) == (200, b"until the end")
        assert server.connections == 2  # `Connection: close` is never reused


async def test_a_connection_closed_mid_body_is_a_dropped_error() -> None:
    async with (
        ScriptedServer.once(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b") as server,
        _client() as client,
    ):
        with pytest.raises(UpstreamDroppedError, match="before its answer ended"):
            await _post(client, server.origin)
        assert not client._idle.get(server.origin)


async def test_an_answer_that_is_not_http_is_a_dropped_error() -> None:
    async with (
        ScriptedServer.once(b"SSH-2.0-OpenSSH_9.2\r\n\r\n", linger=True) as server,
        _client() as client,
    ):
        with pytest.raises(UpstreamDroppedError, match="not an HTTP answer"):
            await _post(client, server.origin)


async def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
        async with _client() as client:
            with pytest.raises(UpstreamConnectError, match="cannot connect") as caught:
                await _post(client, Origin("127.0.0.1", port, False, f"127.0.0.1:{port}"))
            assert not isinstance(caught.value, UpstreamConnectTimeout)


@contextlib.contextmanager
def _never_accepting() -> Iterator[Origin]:
    """A listener whose accept queue is full: Linux drops the SYN, so a connect hangs as to an
    unreachable host."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        try:
            yield Origin("127.0.0.1", port, False, f"127.0.0.1:{port}")
        finally:
            for filler in fillers:
                filler.close()


async def _connect(client: UpstreamClient, origin: Origin, connect_timeout_s: float) -> int:
    """A POST with 10 s to answer and `connect_timeout_s` to connect: its status."""
    deadline = asyncio.get_running_loop().time() + 10
    async with client.post(
        origin, "/generate", [], b"{}", deadline=deadline, connect_timeout_s=connect_timeout_s
    ) as response:
        await response.read()
        return response.status


async def test_a_listener_that_never_accepts_is_a_connect_timeout() -> None:
    with _never_accepting() as origin:
        await asyncio.sleep(0.1)
        async with _client() as client:
            with pytest.raises(UpstreamConnectTimeout, match=r"within 0\.3 s"):
                await _connect(client, origin, 0.3)


async def test_a_connect_the_routers_own_stall_expired_is_made_again() -> None:
    """A connect in flight while the router's loop stalled past the connect timeout expired as
    the loop came back, though the worker had accepted (the loop runs the expired timer before
    the task the connection wakes): a retry and a failure charged to a healthy worker. A timer
    that ran late is no verdict: the connection is made again, once."""
    async with ScriptedServer.answering(b'{"ok": true}') as server, _client() as client:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            loop.call_soon(time.sleep, 0.5)  # the stall, once the connect is under way
            assert await _connect(client, server.origin, 0.2) == 200
            client._idle.clear()  # the next one connects anew
    with _never_accepting() as origin:
        await asyncio.sleep(0.1)
        async with _client() as client:
            loop.call_soon(time.sleep, 0.5)
            started = loop.time()
            # a worker that does not accept still times out: the second connect's verdict
            with pytest.raises(UpstreamConnectTimeout, match=r"within 0\.2 s"):
                await _connect(client, origin, 0.2)
            assert loop.time() - started >= 0.5 + 0.2


async def test_the_deadline_bounds_a_slow_answer_and_drops_its_connection() -> None:
    async with (
        ScriptedServer.once(
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", linger=True
        ) as server,
        _client() as client,
    ):
        with pytest.raises(TimeoutError):
            await _post(client, server.origin, timeout_s=0.3)
        for _ in range(100):
            if server.closed:
                break
            await asyncio.sleep(0.01)
        assert server.closed == 1


async def test_an_abandoned_answer_closes_its_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await writer.drain()

    async with ScriptedServer(script) as server, _client() as client:
        for _ in range(2):
            async with _exchange(client, server.origin) as response:
                assert await response.readany() == b"abc"
            # left before its end: never reused, the worker sees the close (and aborts)
        for _ in range(100):
            if server.closed == 2:
                break
            await asyncio.sleep(0.01)
        assert (server.connections, server.closed) == (2, 2)
        assert not client._open  # the pool forgets closed connections: nothing accumulates


async def test_a_failure_in_the_callers_block_closes_its_connection() -> None:
    async with ScriptedServer.answering(b'{"ok": true}') as server, _client() as client:
        with pytest.raises(ZeroDivisionError):
            async with _exchange(client, server.origin) as response:
                assert response.status == 200
                raise ZeroDivisionError  # before its body was taken: e.g. the client left
        assert not any(client._idle.values())  # not pooled: closed (its unread body with it)
        for _ in range(100):  # the pool forgets it once the loop reports the close
            if not client._open:
                break
            await asyncio.sleep(0.01)
        assert not client._open
        # an answer read to its end goes back to the pool: the next request reuses it
        assert await _post(client, server.origin) == (200, b'{"ok": true}')
        assert await _post(client, server.origin) == (200, b'{"ok": true}')
    assert server.connections == 2


async def test_a_large_answer_is_read_whole_through_flow_control() -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB, eight times the buffer's high-water mark

    async with ScriptedServer.once(_answer(payload), linger=True) as server, _client() as client:
        deadline = asyncio.get_running_loop().time() + 10
        got = bytearray()
        async with client.post(
            server.origin, "/generate", [], b"{}", deadline=deadline, connect_timeout_s=2
        ) as response:
            while chunk := await response.readany():
                got += chunk
                await asyncio.sleep(0)  # a slow reader: the socket is paused meanwhile
        assert bytes(got) == payload


async def test_idle_connections_close_after_the_keep_alive() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(_answer(b"{}"))
            await writer.drain()

    async with ScriptedServer(script) as server, _client(keepalive_s=0.2) as client:
        await _post(client, server.origin)
        for _ in range(100):
            if server.closed:
                break
            await asyncio.sleep(0.02)
        assert server.closed == 1  # the sweeper closed it, not a new request
        await _post(client, server.origin)
        assert server.connections == 2


async def test_a_worker_that_talks_while_idle_is_not_reused() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(_answer(b"{}"))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"HTTP/1.1 200 OK\r\n")  # nobody asked
            await writer.drain()

    async with ScriptedServer(script) as server, _client() as client:
        assert await _post(client, server.origin) == (200, b"{}")
        await asyncio.sleep(0.2)
        assert await _post(client, server.origin) == (200, b"{}")
        assert server.connections == 2


async def test_a_header_with_a_line_break_is_refused_before_sending() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)

    async with ScriptedServer(script) as server, _client() as client:
        with pytest.raises(UnsafeHeaderError):
            await _post(client, server.origin, headers=[("x-a", "1\r\nx-injected: 2")])
        await asyncio.sleep(0.05)
        assert server.connections == 0


def test_origins_of_worker_urls() -> None:
    assert Origin.split("http://127.0.0.1:30000") == (
        Origin("127.0.0.1", 30000, False, "127.0.0.1:30000"),
        "",
    )
    assert Origin.split("https://user:pw@gpu-7.internal/sglang/") == (
        Origin("gpu-7.internal", 443, True, "gpu-7.internal"),
        "/sglang",
    )
    assert Origin.split("http://[::1]:8000") == (Origin("::1", 8000, False, "[::1]:8000"), "")
    with pytest.raises(ValueError, match="not an http"):
        Origin.split("unix:///tmp/worker.sock")


def test_the_client_runs_on_uvloop_too() -> None:
    # KVROUTE_EVENT_LOOP=uvloop is supported: its transports are not asyncio's classes
    uvloop = pytest.importorskip("uvloop")

    async def exchange() -> tuple[int, list[bytes]]:
        async with ScriptedServer.answering(b'{"ok": true}') as server, _client() as client:
            bodies = [(await _post(client, server.origin))[1] for _ in range(3)]
        return server.connections, bodies

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(exchange()) == (1, [b'{"ok": true}'] * 3)


async def test_an_interim_answer_is_skipped_for_the_real_one() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
            writer.write(_answer(b'{"real": 1}'))
            await writer.drain()

    async with ScriptedServer(script) as server, _client() as client:
        async with _exchange(client, server.origin) as response:
            assert response.status == 200
            assert "Link" not in response.headers
            assert await response.read() == b'{"real": 1}'
        assert await _post(client, server.origin) == (200, b'{"real": 1}')
        assert server.connections == 1


async def test_a_released_answer_reads_nothing_of_the_next_request() -> None:
    second_may_answer = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while await server.read_request(reader):
            n += 1
            if n == 2:
                await second_may_answer.wait()
            writer.write(_answer(b'{"n": %d}' % n))
            await writer.drain()

    async with ScriptedServer(script) as server, _client() as client:
        async with _exchange(client, server.origin) as first:
            assert await first.read() == b'{"n": 1}'
        second = asyncio.create_task(_post(client, server.origin))
        await asyncio.sleep(0.05)  # the second request is on the first one's connection now
        # the first answer gives nothing more, at once, and takes nothing of the second's
        assert await asyncio.wait_for(first.readany(), 1) == b""
        assert await asyncio.wait_for(first.read(), 1) == b""
        second_may_answer.set()
        assert await second == (200, b'{"n": 2}')
        assert server.connections == 1


async def test_failed_requests_leave_no_connection_behind() -> None:
    async with (
        ScriptedServer.once(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ncut") as server,
        _client() as client,
    ):
        for _ in range(5):
            with pytest.raises(UpstreamDroppedError):
                await _post(client, server.origin)
        await asyncio.sleep(0.05)
        assert not client._open and not any(client._idle.values())


async def test_an_https_worker_is_verified_and_served() -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(_answer(b'{"tls": true}'))
            await writer.drain()

    server = ScriptedServer(script, tls=server_tls)
    async with server:
        origin = server.origin._replace(tls=True)
        trusting = ssl.create_default_context()
        ca.configure_trust(trusting)
        async with UpstreamClient(tls_context=trusting) as client:
            assert await _post(client, origin) == (200, b'{"tls": true}')
            assert await _post(client, origin) == (200, b'{"tls": true}')
        assert server.connections == 1
        # the system's trust store does not know this CA: no connection, and nothing sent
        async with _client() as default:
            with pytest.raises(UpstreamConnectError, match="cannot connect"):
                await _post(default, origin)
        assert len(server.requests) == 2


async def test_a_large_whole_answer_is_read_whole() -> None:
    # read() takes the body as it comes: past the high-water mark the socket pauses until it
    # is taken, so waiting for the end first would wait until the deadline
    payload = bytes(range(256)) * 8192  # 2 MiB
    async with ScriptedServer.once(_answer(payload), linger=True) as server, _client() as client:
        assert await _post(client, server.origin, timeout_s=5) == (200, payload)


async def test_an_answer_head_that_never_ends_is_refused() -> None:
    sent = 0  # bytes of the head the client's socket took
    hung_up = asyncio.Event()  # a write met the connection the client closed

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        try:
            for i in range(100_000):  # 400 MB of headers, unless the client hangs up
                line = b"X-Filler-%d: %s\r\n" % (i, b"x" * 4000)
                writer.write(line)
                await writer.drain()
                sent += len(line)
        except ConnectionError:
            hung_up.set()
            raise

    async with ScriptedServer(script) as server, _client() as client:
        with pytest.raises(UpstreamDroppedError, match="answer head exceeds"):
            await _post(client, server.origin)
        # refused at 256 KiB, the connection is closed at once: the worker stops writing
        # (a client that kept it open would leave the worker blocked on a full socket)
        async with asyncio.timeout(2):
            await hung_up.wait()
    assert server.connections == 1
    assert sent < 32 * 1024 * 1024  # 256 KiB and what the sockets' buffers held (4 MB here)


async def test_a_second_answer_in_the_same_read_is_not_mixed_into_the_first() -> None:
    second = b"HTTP/1.1 404 Not Found\r\nX-Second: yes\r\nContent-Length: 5\r\n\r\nEXTRA"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(_answer(b'{"ok": 1}') + second)  # one write: one read
            await writer.drain()

    async with ScriptedServer(script) as server, _client() as client:
        deadline = asyncio.get_running_loop().time() + 5
        async with client.post(
            server.origin, "/generate", [], b"{}", deadline=deadline, connect_timeout_s=2
        ) as response:
            assert (response.status, await response.read()) == (200, b'{"ok": 1}')
            assert "X-Second" not in response.headers
        assert await _post(client, server.origin) == (200, b'{"ok": 1}')
        assert server.connections == 2  # the one that talked out of turn was not reused
