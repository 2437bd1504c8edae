"""The router's listener over real sockets: client deadlines, the connection cap, quiet logs.

Slow clients are played with raw asyncio streams (half a request line, half a body, nothing at
all) and every wait is on the socket's EOF with a bounded deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import LimitsConfig, QueryConfig
from router.http.keys import RELOADER
from router.http.listener import MAX_LINGERING_REFUSALS, RefusalLog
from router.service import RouterService
from tests.raw_http import exchange, json_error, parse_responses, request_bytes, wait_eof
from tests.router.conftest import AUTH, eventually, router_config

SECRET = b"tenant-SECRET-7b1e"
FAST = 0.3  # the deadline under test
SLOW = 30.0  # a deadline that must not be what closed the connection


def _port(router: RouterService) -> int:
    return int(router.url.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def _router(**limits: float) -> AsyncIterator[RouterService]:
    fields: dict[str, Any] = {
        "idle_timeout_s": SLOW,
        "header_timeout_s": SLOW,
        "body_timeout_s": SLOW,
    } | limits
    config = router_config([], salt_header="x-tenant-salt", limits=LimitsConfig(**fields))
    async with RouterService(config) as router:
        yield router


@contextlib.asynccontextmanager
async def _connect(
    router: RouterService,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(router))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _closed_after(reader: asyncio.StreamReader, started: float) -> tuple[float, bytes]:
    answer = await wait_eof(reader, FAST + 5)
    return time.monotonic() - started, answer


# ----------------------------------------------------------------------------- deadlines


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout() -> None:
    async with _router(idle_timeout_s=FAST) as router, _connect(router) as (reader, _):
        elapsed, answer = await _closed_after(reader, time.monotonic())
    assert answer == b"" and FAST * 0.8 < elapsed < FAST + 3


async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() -> None:
    async with _router(idle_timeout_s=FAST) as router, _connect(router) as (reader, writer):
        for _ in range(2):  # the connection is reused, then left idle
            writer.write(request_bytes(b"GET", b"/health", close=False))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), 5)
        elapsed, answer = await _closed_after(reader, time.monotonic())
    assert answer == b"" and FAST * 0.8 < elapsed < FAST + 3


async def test_a_new_connection_that_sends_nothing_is_closed_at_the_header_timeout() -> None:
    """Not held until the idle timeout: 1,024 silent sockets locked every client out (QA)."""
    async with _router(header_timeout_s=FAST) as router:
        async with _connect(router) as (reader, _):
            elapsed, answer = await _closed_after(reader, time.monotonic())
        rejected = await _rejected(router)
    assert answer == b""  # no request was begun: closed, with no answer
    assert FAST * 0.8 < elapsed < FAST + 3  # the idle timeout (30 s) did not do it
    assert rejected[("-", "RequestTimeoutError")] == 1, rejected


async def test_a_keep_alive_connection_idle_past_the_header_timeout_still_serves() -> None:
    """Between requests a connection is the idle timeout's: only a new one's first request is
    due from the connect."""
    async with _router(header_timeout_s=FAST) as router, _connect(router) as (reader, writer):
        for pause in (0.0, FAST * 3):
            await asyncio.sleep(pause)  # idle between the two requests, past the header timeout
            writer.write(request_bytes(b"GET", b"/metrics", close=False))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), 5)


async def test_half_a_request_line_is_closed_after_the_header_timeout() -> None:
    async with _router(header_timeout_s=FAST) as router, _connect(router) as (reader, writer):
        started = time.monotonic()
        writer.write(b"GET /hea")
        elapsed, answer = await _closed_after(reader, started)
    (response,) = parse_responses(answer)
    assert response.status == 408
    assert json_error(response)["type"] == "RequestTimeoutError"
    assert "limits.header_timeout_s" in json_error(response)["message"]
    assert FAST * 0.8 < elapsed < FAST + 3  # the idle timeout (30 s) did not do it


async def test_headers_trickling_in_do_not_extend_the_header_timeout() -> None:
    async with _router(header_timeout_s=FAST) as router, _connect(router) as (reader, writer):
        started = time.monotonic()
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        answer = b""
        for i in range(200):  # a slowloris: one header line every 20 ms, for at most 4 s
            if reader.at_eof():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(f"X-Pad-{i}: {'a' * 10}\r\n".encode())
            with contextlib.suppress(TimeoutError):
                answer += await asyncio.wait_for(reader.read(4096), 0.02)
        elapsed, rest = await _closed_after(reader, started)
    assert parse_responses(answer + rest)[0].status == 408
    assert elapsed < FAST + 3


async def test_half_a_body_is_a_408_and_a_close_after_the_body_timeout() -> None:
    async with _router(body_timeout_s=FAST) as router:
        for path in (b"/v1/completions", b"/admin/route"):
            async with _connect(router) as (reader, writer):
                head = request_bytes(
                    b"POST", path, [(b"Authorization", b"Bearer test-admin-token")]
                )
                head = head.replace(b"Content-Length: 0", b"Content-Length: 100")
                started = time.monotonic()
                writer.write(head + b'{"prompt": ')
                elapsed, answer = await _closed_after(reader, started)
            (response,) = parse_responses(answer)
            assert response.status == 408, (path, response)
            error = json_error(response)
            assert error["type"] == "RequestTimeoutError"
            assert "limits.body_timeout_s" in error["message"]
            assert FAST * 0.8 < elapsed < FAST + 3


async def test_a_body_nobody_reads_is_cut_at_the_body_timeout_too() -> None:
    async with _router(body_timeout_s=FAST) as router, _connect(router) as (reader, writer):
        # /health answers without reading the body, which then never completes
        request = request_bytes(b"GET", b"/health", [(b"Content-Length", b"100")], close=False)
        writer.write(request + b"0123456789")
        elapsed, answer = await _closed_after(reader, time.monotonic())
    assert parse_responses(answer)[0].status == 503  # no worker: the answer came first
    assert elapsed < FAST + 3


async def test_a_declared_body_over_the_limit_is_a_413_before_it_is_read() -> None:
    async with _router() as router, _connect(router) as (reader, writer):
        declared = b"Content-Length: 1073741824"  # 1 GiB that never comes
        request = request_bytes(b"POST", b"/generate").replace(b"Content-Length: 0", declared)
        started = time.monotonic()
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await asyncio.wait_for(reader.readexactly(length), 5)
        answered = time.monotonic() - started
    (response,) = parse_responses(head + body)
    assert response.status == 413 and answered < 2  # not after a body (30 s) timeout
    error = json_error(response)
    assert error["type"] == "PayloadTooLargeError" and "limits.max_body_bytes" in error["message"]


# -------------------------------------------------------------------------- connection cap


async def _served(router: RouterService) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection the router has accepted: one keep-alive request answered on it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(router))
    writer.write(request_bytes(b"GET", b"/metrics", close=False))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await asyncio.wait_for(reader.readexactly(length), 5)
    return reader, writer


async def test_one_connection_over_the_cap_gets_a_503_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    cap = 4
    config = router_config([], limits=LimitsConfig(max_connections=cap))
    async with RouterService(config) as router:
        held = [await _served(router) for _ in range(cap)]
        try:
            for _ in range(5):
                (refused,) = parse_responses(await exchange(_port(router), b""))
                assert refused.status == 503
                error = json_error(refused)
                assert error["type"] == "TooManyConnectionsError"
                assert str(cap) in error["message"]
        finally:
            for _, writer in held[1:]:
                writer.close()
        # a freed slot serves again (the server notices the close asynchronously)
        for _ in range(100):
            (response,) = parse_responses(
                await exchange(_port(router), request_bytes(b"GET", b"/metrics"))
            )
            if response.status == 200:
                break
            assert json_error(response)["type"] == "TooManyConnectionsError"
            await asyncio.sleep(0.02)
        assert response.status == 200
        held[0][1].close()
    lines = [r for r in caplog.records if "limits.max_connections" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


def _read_until_close(sock: socket.socket) -> tuple[bytes, bool]:
    """What `sock` receives until the router closes it, and whether that close was a reset."""
    chunks: list[bytes] = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        return b"".join(chunks), True
    return b"".join(chunks), False


async def test_a_client_writing_as_it_connects_over_the_cap_reads_its_503_and_an_eof() -> None:
    """Before, the router wrote the 503 and closed with the request unread: its kernel then
    sent a reset in place of the close, which a client takes for a failure (and a client whose
    kernel had not taken in the 503 yet, or that discards on a reset, never sees it)."""
    cap = 2
    config = router_config([], limits=LimitsConfig(max_connections=cap))
    body = json.dumps({"prompt": "x" * 5000}).encode()
    requests = [
        request_bytes(b"GET", b"/health", close=False),
        request_bytes(b"POST", b"/v1/completions", [], body),
    ]
    async with RouterService(config) as router:
        held = [await _served(router) for _ in range(cap)]
        try:
            for attempt in range(12):
                # connected and written before the router's loop can accept it (the kernel
                # completes the handshake from the listen backlog): the request is unread
                # when the router refuses the connection, as with curl against a busy router
                with socket.create_connection(("127.0.0.1", _port(router)), timeout=10) as sock:
                    sock.sendall(requests[attempt % 2])
                    answer, reset = await asyncio.to_thread(_read_until_close, sock)
                responses = parse_responses(answer)
                assert responses, f"attempt {attempt}: no answer"
                assert responses[0].status == 503, (attempt, responses[0])
                assert json_error(responses[0])["type"] == "TooManyConnectionsError"
                assert not reset, f"attempt {attempt}: the 503 was followed by a reset"
        finally:
            for _, writer in held:
                writer.close()


async def test_a_refused_connection_is_read_briefly_then_closed() -> None:
    """The drain after the 503 is bounded: a client that neither closes nor stops sending is
    closed within a fraction of a second, and only a few dozen drain at once."""
    cap = 1
    config = router_config([], limits=LimitsConfig(max_connections=cap, idle_timeout_s=SLOW))
    async with RouterService(config) as router:
        listener = router.app[RELOADER].listener
        assert listener is not None
        held = [await _served(router) for _ in range(cap)]
        try:
            # silent, then endless: each is closed long before any client deadline
            for flood in (False, True):
                async with _connect(router) as (reader, writer):
                    started = time.monotonic()
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                    assert head.startswith(b"HTTP/1.1 503"), head
                    with contextlib.suppress(ConnectionError):
                        while flood and not reader.at_eof():
                            writer.write(b"x" * 4096)
                            await writer.drain()
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(reader.read(65536), 0.01)
                    await wait_eof(reader, 5)
                    assert time.monotonic() - started < 2, flood
            # many at once: the ones past the bound are closed at once, as before
            peak = 0
            clients = [await asyncio.open_connection("127.0.0.1", _port(router)) for _ in range(80)]
            try:
                for reader, _ in clients:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                    assert head.startswith(b"HTTP/1.1 503"), head
                    peak = max(peak, len(listener.lingering))
                for reader, _ in clients:
                    await wait_eof(reader, 5)
            finally:
                for _, writer in clients:
                    writer.close()
            assert 0 < peak <= MAX_LINGERING_REFUSALS

            async def none_lingering() -> bool:
                return not listener.lingering

            await eventually(none_lingering, what="the refused connections closed")
        finally:
            for _, writer in held:
                writer.close()


async def test_clients_refused_past_the_lingering_ones_read_their_503_and_an_eof_too() -> None:
    """Past the refused connections lingering (`MAX_LINGERING_REFUSALS`), a refused connection
    was closed at once with its request unread, and its kernel sent a reset after the 503 (QA:
    45 of 300 GETs, 65 of 300 5 KB POSTs over a cap of 20). What the client sent already is
    read and dropped first now, so its close is a FIN."""
    config = router_config([], limits=LimitsConfig(max_connections=1))
    body = json.dumps({"prompt": "x" * 5000}).encode()
    requests = [
        request_bytes(b"GET", b"/health", close=False),
        request_bytes(b"POST", b"/v1/completions", [], body),
    ]
    clients: list[socket.socket] = []
    async with RouterService(config) as router:
        held = await _served(router)
        try:
            # connected and written while this test holds the router's loop: all of them wait
            # in its listen backlog (128) with their requests in its kernel, as in a burst, and
            # it refuses them in one go: the first 32 linger, the rest are closed at once
            for n in range(2 * MAX_LINGERING_REFUSALS + 20):
                sock = socket.create_connection(("127.0.0.1", _port(router)), timeout=10)
                clients.append(sock)
                sock.sendall(requests[n % 2])
            answers = await asyncio.gather(
                *(asyncio.to_thread(_read_until_close, sock) for sock in clients)
            )
        finally:
            for sock in clients:
                sock.close()
            held[1].close()
    reset = [n for n, (_, was_reset) in enumerate(answers) if was_reset]
    assert not reset, f"{len(reset)} of {len(answers)} refused clients were reset"
    for answer, _ in answers:
        (refused,) = parse_responses(answer)
        assert refused.status == 503
        assert json_error(refused)["type"] == "TooManyConnectionsError"


# ------------------------------------------------------------------------------- quiet logs

MALFORMED = [
    # a control character in the salt header: aiohttp used to log the whole line at ERROR
    request_bytes(b"GET", b"/health", [(b"X-Tenant-Salt", SECRET + b"\x01")]),
    request_bytes(b"POST", b"/generate", [(b"X-Tenant-Salt", b"\x00" + SECRET)], b"{}"),
    # a header line over 8,190 bytes that starts with the salt
    request_bytes(b"GET", b"/health", [(b"X-Tenant-Salt", SECRET + b"a" * 9000)]),
    # a request line over 8,190 bytes with the salt in the query
    request_bytes(b"GET", b"/health?salt=" + SECRET + b"b" * 9000),
    # not HTTP at all, with the salt in it
    b"\x16\x03\x01" + SECRET + b"\r\n\r\n",
    SECRET + b" / HTTP/1.1\r\n\r\n",
    # a header name with a space, a lone LF, broken chunking
    b"GET / HTTP/1.1\r\nX Tenant Salt: " + SECRET + b"\r\n\r\n",
    b"GET / HTTP/1.1\nX-Tenant-Salt: " + SECRET + b"\r\n\x01\r\n\r\n",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + SECRET + b"\r\n",
]


def _record_text(record: logging.LogRecord) -> str:
    parts = [record.getMessage(), repr(record.args), record.stack_info or ""]
    if record.exc_info:
        parts.append(logging.Formatter().formatException(record.exc_info))
    return "\n".join(parts)


async def test_malformed_requests_never_log_the_salt_and_log_one_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with _router() as router:
        for round_ in range(3):  # 27 bad requests inside one interval (10 s)
            for raw in MALFORMED:
                responses = parse_responses(await exchange(_port(router), raw))
                assert responses, (round_, raw[:60])
                response = responses[0]
                assert response.status == 400, (raw[:60], response)
                assert json_error(response)["type"] == "BadHttpRequestError"
                assert SECRET not in response.body
        # a body that does not decode: refused by the app, and not drained (it would fail again)
        broken = request_bytes(b"POST", b"/generate", [(b"Content-Encoding", b"gzip")], SECRET)
        (response,) = parse_responses(await exchange(_port(router), broken))
        assert response.status == 400 and SECRET not in response.body
        assert json_error(response)["type"] == "BadHttpRequestError"
    for record in caplog.records:
        assert SECRET.decode() not in _record_text(record), record.name
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    lines = [r for r in caplog.records if "bad HTTP request" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].name == "router.http.listener" and lines[0].levelno == logging.WARNING


def test_the_refusal_log_counts_what_it_held_back() -> None:
    now = [0.0]
    logger = logging.getLogger("tests.refusals")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        refusals = RefusalLog(logger, 10.0, clock=lambda: now[0])
        for step in range(100):  # 100 refusals over 25 s: one line per 10 s
            now[0] = step * 0.25
            refusals.note("bad HTTP request from %s: %s", "10.0.0.1", "LineTooLong")
    finally:
        logger.removeHandler(handler)
    assert records == [
        "bad HTTP request from 10.0.0.1: LineTooLong, 0 similar suppressed",
        "bad HTTP request from 10.0.0.1: LineTooLong, 39 similar suppressed",
        "bad HTTP request from 10.0.0.1: LineTooLong, 39 similar suppressed",
    ]


async def test_expectations_are_refused_in_json_and_a_too_large_body_before_100_continue() -> None:
    async with _router() as router:
        for path in (b"/generate", b"/nope", b"/admin/route"):
            for value in (b"\xff\xfe", b"102-processing"):
                raw = request_bytes(b"POST", path, [(b"Expect", value), _ADMIN_AUTH], b"{}")
                (response,) = parse_responses(await exchange(_port(router), raw))
                assert response.status == 417, (path, value, response)
                assert json_error(response)["type"] == "ExpectationFailedError"
        # with 100-continue the client waits for a go-ahead: a declared 1 GiB gets a 413 instead
        declared = b"Content-Length: 1073741824"
        raw = request_bytes(b"POST", b"/generate", [(b"Expect", b"100-continue")])
        answer = await exchange(_port(router), raw.replace(b"Content-Length: 0", declared))
    (response,) = parse_responses(answer)
    assert response.status == 413 and json_error(response)["type"] == "PayloadTooLargeError"


_ADMIN_AUTH = (b"Authorization", AUTH["Authorization"].encode())


async def test_an_admin_request_without_the_token_is_a_401_before_any_limit_is_named() -> None:
    """A snapshot load over limits.max_snapshot_bytes without a token got a 413 naming the
    limit and its value: the listener's size check ran before the admin token was checked.
    Now a stranger hears 401 and nothing else, still before the body is read (the 1 GiB
    declared never comes) and before any 100-continue; with the token the limit holds."""
    declared = b"Content-Length: 1073741824"
    # each refusal drains the unsent body for min(2 s, body_timeout_s) before it closes
    async with _router(max_snapshot_bytes=4096, body_timeout_s=FAST) as router:
        port = _port(router)
        wrong = (b"Authorization", b"Bearer wrong")
        for path in (b"/admin/index/load", b"/admin/workers"):
            for headers in ([], [wrong], [(b"Expect", b"100-continue")], [(b"Expect", b"nope")]):
                raw = request_bytes(b"POST", path, headers).replace(b"Content-Length: 0", declared)
                answer = await asyncio.wait_for(exchange(port, raw), 5)
                (response,) = parse_responses(answer)
                assert response.status == 401, (path, headers, response)
                assert response.headers["www-authenticate"] == 'Bearer realm="kvroute"'
                assert json_error(response)["type"] == "AuthError"
                assert b"limits" not in answer and b"4096" not in answer
        raw = request_bytes(b"POST", b"/admin/index/load", [_ADMIN_AUTH])
        answer = await exchange(port, raw.replace(b"Content-Length: 0", declared))
    (response,) = parse_responses(answer)
    assert response.status == 413
    assert "limits.max_snapshot_bytes" in json_error(response)["message"]


async def test_a_kv_query_without_its_token_is_a_401_before_any_limit_is_named() -> None:
    """An oversized POST /v1/kv/query without the query token got the listener's 413 naming
    limits.max_body_bytes and its value, where /admin answers 401 first. Now the query API's
    own 401 comes first there too (its words, before the body and any 100-continue), and a
    request with the token still hears the limit."""
    declared = b"Content-Length: 1073741824"
    token = "query-token-4"
    # each refusal drains the unsent body for min(2 s, body_timeout_s) before it closes
    limits = LimitsConfig(max_body_bytes=4096, body_timeout_s=FAST)
    config = router_config([], limits=limits, query=QueryConfig(token=token))
    async with RouterService(config) as router:
        port = _port(router)
        wrong = (b"Authorization", b"Bearer wrong")
        for path in (b"/v1/kv/query", b"/v1/kv/routed"):
            for headers in ([], [wrong], [_ADMIN_AUTH], [(b"Expect", b"100-continue")]):
                raw = request_bytes(b"POST", path, headers).replace(b"Content-Length: 0", declared)
                answer = await asyncio.wait_for(exchange(port, raw), 5)
                (response,) = parse_responses(answer)
                assert response.status == 401, (path, headers, response)
                assert response.headers["www-authenticate"] == 'Bearer realm="kvroute"'
                assert "query token" in json_error(response)["message"]
                assert b"limits" not in answer and b"4096" not in answer
            raw = request_bytes(b"POST", path, [(b"Authorization", f"Bearer {token}".encode())])
            answer = await exchange(port, raw.replace(b"Content-Length: 0", declared))
            (response,) = parse_responses(answer)
            assert response.status == 413, (path, response)
            assert "limits.max_body_bytes" in json_error(response)["message"]


# ------------------------------------------------------------- refusals that name the problem


async def test_a_chunked_or_compressed_body_over_the_limit_is_a_413_naming_the_limit() -> None:
    """aiohttp refuses these while reading them, in words of its own that named neither the
    setting nor the unit ("Maximum request body size 1024 exceeded.")."""
    body = b'{"prompt": "' + b"x" * 4000 + b'"}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    async with _router(max_body_bytes=1024) as router:
        for headers, sent in (
            ([(b"Transfer-Encoding", b"chunked")], chunked),
            ([(b"Content-Encoding", b"gzip")], gzip.compress(body)),  # 50 bytes, 4 KB decoded
        ):
            raw = request_bytes(b"POST", b"/generate", headers, sent)
            if headers[0][0] == b"Transfer-Encoding":
                raw = raw.replace(b"Content-Length: %d\r\n" % len(sent), b"")
            (response,) = parse_responses(await exchange(_port(router), raw))
            assert response.status == 413, response
            error = json_error(response)
            assert error["type"] == "PayloadTooLargeError"
            assert "limits.max_body_bytes (1024 bytes" in error["message"], error
            assert "Maximum request body size" not in error["message"]


async def test_a_chunked_body_over_the_limit_is_drained_then_the_connection_closed() -> None:
    """As a declared one is (docs/router.md, "draining a refused body"): the 413 said nothing
    of closing, and the connection stayed open for the next request once its body was read."""
    body = b'{"prompt": "' + b"x" * 2000 + b'", "max_tokens": 1}'
    chunks = b"".join(b"%x\r\n%s\r\n" % (500, body[i : i + 500]) for i in range(0, 2000, 500))
    chunked = chunks + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 2000, body[2000:])
    # keep-alive (no Connection: close): only the router may close it
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with _router(max_body_bytes=1024) as router, _connect(router) as (reader, writer):
        writer.write(head + chunked)
        answer = await wait_eof(reader, 5)  # drained (2 s at most), then closed
    (response,) = parse_responses(answer)
    assert response.status == 413 and json_error(response)["type"] == "PayloadTooLargeError"
    assert response.headers.get("connection", "").lower() == "close", response.headers


async def test_a_body_in_an_encoding_the_router_cannot_decode_is_a_415() -> None:
    """An unknown Content-Encoding was read as if the body were not encoded, and forwarded
    without the header: a worker got bytes labelled as something else."""
    async with _router() as router:
        for codings in ([b"x-foo"], [b"gzip, gzip"], [b"gzip", b"gzip"]):
            headers = [(b"Content-Encoding", coding) for coding in codings]
            raw = request_bytes(b"POST", b"/generate", headers, b'{"text": "x"}')
            (response,) = parse_responses(await exchange(_port(router), raw))
            assert response.status == 415, (codings, response)
            assert json_error(response)["type"] == "UnsupportedEncodingError"
            assert "gzip" in response.headers["accept-encoding"]
        # not every Content-Encoding is refused: one the router decodes, or none at all
        raw = request_bytes(b"GET", b"/metrics", [(b"Content-Encoding", b"x-foo")])
        (response,) = parse_responses(await exchange(_port(router), raw))
        assert response.status == 200  # no body, nothing to decode
        raw = request_bytes(b"POST", b"/generate", [(b"Content-Encoding", b"identity")], b"{")
        (response,) = parse_responses(await exchange(_port(router), raw))
        assert response.status == 400  # read (a bad body), not refused for its coding


async def test_a_body_in_brotli_or_zstandard_is_decoded_like_gzip() -> None:
    """aiohttp's parser decodes br and zstd only with their packages (Brotli, backports.zstd on
    Python < 3.14), which kvroute did not install: such a body was refused while its headers
    were parsed, with an HTTP/1.0 400 that echoed no request id, where the 415 (or the body's
    own error) was due. Installed, the body reaches the handler decoded, the same as gzip's."""
    import brotli

    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        from backports import zstd

    body = b'{"text": 5}'  # well-formed JSON, a field of the wrong type: an error only read finds
    encoded = {b"gzip": gzip.compress(body), b"br": brotli.compress(body)}
    encoded[b"zstd"] = zstd.compress(body)
    async with _router() as router:
        for coding, sent in encoded.items():
            headers = [(b"Content-Encoding", coding), (b"x-request-id", b"req-1")]
            answer = await exchange(
                _port(router), request_bytes(b"POST", b"/generate", headers, sent)
            )
            assert answer.startswith(b"HTTP/1.1 400"), (coding, answer[:60])
            (response,) = parse_responses(answer)
            assert "text" in json_error(response)["message"], (coding, response)
            assert response.headers["x-request-id"] == "req-1"
            # bytes that are not that coding: the parser's 400, for this request all the same
            headers[1] = (b"x-request-id", b"req-2")
            raw = request_bytes(b"POST", b"/generate", headers, b"not " + coding)
            answer = await exchange(_port(router), raw)
            assert answer.startswith(b"HTTP/1.1 400"), (coding, answer[:60])
            (response,) = parse_responses(answer)
            assert json_error(response)["type"] == "BadHttpRequestError", (coding, response)
            assert response.headers["x-request-id"] == "req-2"


async def test_every_refusal_of_a_read_request_echoes_its_well_formed_id() -> None:
    """The app's refusals (a 400 for a bad body) echoed a client's `x-request-id`, the
    listener's (413, 415, 417, its 401) did not: a client could not match those to its
    request. Each echoes a well-formed id now, never a malformed one. The 413 names the size
    declared beside the limit (the docs said no refusal names the value that broke it)."""
    declared = b"Content-Length: 2000000"
    refusals: list[tuple[int, list[tuple[bytes, bytes]], bytes]] = [
        (400, [], b"{"),
        (413, [(b"Expect", b"100-continue")], b""),  # 2 MB declared, never sent
        (415, [(b"Content-Encoding", b"x-foo")], b"{}"),
        (417, [(b"Expect", b"nope")], b"{}"),
    ]
    # a refusal of an unsent body drains it for min(2 s, body_timeout_s) before it closes
    async with _router(max_body_bytes=1 << 20, body_timeout_s=FAST) as router:
        port = _port(router)
        for status, headers, body in refusals:
            for rid, echoed in ((b"rid-413", "rid-413"), (b"bad id [x]", None)):
                raw = request_bytes(b"POST", b"/generate", [(b"x-request-id", rid), *headers], body)
                if status == 413:
                    raw = raw.replace(b"Content-Length: 0", declared)
                (response,) = parse_responses(await exchange(port, raw))
                assert response.status == status, (status, rid, response)
                assert response.headers.get("x-request-id") == echoed, (status, rid, response)
                if status == 413:
                    message = json_error(response)["message"]
                    assert "2000000 bytes" in message and "limits.max_body_bytes" in message
        # the listener's 401 for an admin request without the token, before any limit
        raw = request_bytes(b"POST", b"/admin/index/load", [(b"x-request-id", b"rid-401")])
        raw = raw.replace(b"Content-Length: 0", declared)
        (response,) = parse_responses(await exchange(port, raw))
        assert response.status == 401 and response.headers.get("x-request-id") == "rid-401"


async def test_a_request_without_host_is_a_400_that_says_so() -> None:
    async with _router() as router:
        raw = b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
        (response,) = parse_responses(await exchange(_port(router), raw))
    assert response.status == 400
    error = json_error(response)
    assert error["type"] == "BadHttpRequestError" and "Host header" in error["message"], error


async def test_a_405_names_the_methods_allowed() -> None:
    """RFC 9110 15.5.6: a 405 must carry Allow (the JSON error answer dropped aiohttp's)."""
    async with _router() as router:
        for path in (b"/v1/completions", b"/health"):
            raw = request_bytes(b"DELETE" if path == b"/health" else b"GET", path)
            (response,) = parse_responses(await exchange(_port(router), raw))
            assert response.status == 405, response
            assert json_error(response)["type"] == "HTTPMethodNotAllowed"
            allowed = {m.strip() for m in response.headers["allow"].split(",")}
            assert allowed == ({"POST"} if path == b"/v1/completions" else {"GET", "HEAD"})


# ------------------------------------------------------------------ refusals in the metrics


async def _rejected(router: RouterService) -> dict[tuple[str, str], float]:
    """`kvroute_rejected_requests_total` by (endpoint, error), scraped over the socket."""
    answer = await exchange(_port(router), request_bytes(b"GET", b"/metrics"))
    (response,) = parse_responses(answer)
    assert response.status == 200, response
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(response.body.decode()):
        for sample in family.samples:
            if sample.name == "kvroute_rejected_requests_total":
                assert sample.labels["model"] == ""  # no body read: no model
                counts[sample.labels["endpoint"], sample.labels["error"]] = sample.value
    return counts


async def test_the_listeners_refusals_are_counted_by_route_and_logged(
    caplog: pytest.LogCaptureFixture, log_request_ids: None
) -> None:
    """Only the app's refusals were counted in kvroute_rejected_requests: the listener's 413
    for a declared body (what most clients send; the same body chunked was counted), its
    415, 417, its 401 and a malformed request's 400 were not, and but the 400 none was
    logged. Each is counted now, under its route's template (`-`: no route, or no request
    read) and the type its answer names, and logged (the template, never the path) under
    the request's id when it sent a well-formed one."""
    caplog.set_level(logging.WARNING, "router.http.listener")
    declared = b"Content-Length: 2147483648"  # never sent; over max_snapshot_bytes too
    nope = (b"Expect", b"nope")
    errors = {
        401: "AuthError",
        413: "PayloadTooLargeError",
        415: "UnsupportedEncodingError",
        417: "ExpectationFailedError",
    }
    drain = "/admin/workers/{id}/drain"
    refusals: list[tuple[bytes, list[tuple[bytes, bytes]], int, str]] = [
        (b"/v1/completions", [], 413, "/v1/completions"),
        (b"/generate", [(b"Content-Encoding", b"x-foo")], 415, "/generate"),
        (b"/admin/workers/w1/drain", [_ADMIN_AUTH, nope], 417, drain),
        (b"/admin/index/load", [], 401, "/admin/index/load"),  # a 413 with the token
        (b"/no/such/route", [nope], 417, "-"),
        # a method the route does not take: still its route (a 405 would be the app's)
        (b"/health", [nope], 417, "/health"),
    ]
    async with _router(body_timeout_s=FAST, refusal_log_interval_s=0.001) as router:
        before = await _rejected(router)
        assert not [key for key in before if key[0] != "/metrics"], before
        for path, headers, status, _ in refusals:
            rid = (b"x-request-id", b"rid-%d" % status)
            raw = request_bytes(b"POST", path, [*headers, rid], b"{}")
            if status in (413, 401):
                raw = raw.replace(b"Content-Length: 2\r\n\r\n{}", declared + b"\r\n\r\n")
            (response,) = parse_responses(await exchange(_port(router), raw))
            assert response.status == status, (path, response)
            assert json_error(response)["type"] == errors[status]
            await asyncio.sleep(0.002)  # past the log interval: each refusal has its line
        (response,) = parse_responses(await exchange(_port(router), MALFORMED[0]))
        assert response.status == 400
        counted = await _rejected(router)
    expected: dict[tuple[str, str], float] = {}
    for _, _, status, route in refusals:
        expected[route, errors[status]] = expected.get((route, errors[status]), 0) + 1
    expected["-", "BadHttpRequestError"] = 1
    assert counted == expected, counted
    records = [r for r in caplog.records if r.name == "router.http.listener"]
    lines = {r.getMessage(): getattr(r, "request_id", None) for r in records}
    for _, _, status, route in refusals:
        line = f"refused a request from 127.0.0.1 to {route}: {status} {errors[status]}"
        named = [rid for x, rid in lines.items() if x.startswith(line)]
        assert named == [f"rid-{status}"], (line, lines)
    assert not [x for x in lines if "w1" in x or "no/such" in x], lines  # never the path


async def test_a_header_timeout_and_the_connection_cap_are_counted_too() -> None:
    """Answered before any request was read: counted under `-`."""
    limits = LimitsConfig(max_connections=2, header_timeout_s=FAST)
    async with RouterService(router_config([], limits=limits)) as router:
        async with _connect(router) as (reader, writer):
            writer.write(b"GET /hea")
            (response,) = parse_responses(await wait_eof(reader, FAST + 5))
            assert response.status == 408
        held = [await _served(router), await _served(router)]
        try:
            (refused,) = parse_responses(await exchange(_port(router), b""))
            assert refused.status == 503
        finally:
            for _, writer in held:
                writer.close()
        rejected: dict[tuple[str, str], float] = {}

        async def scraped() -> bool:  # a slot frees once the server notices a close
            nonlocal rejected
            with contextlib.suppress(AssertionError):  # a 503 still, no metrics
                rejected = await _rejected(router)
            return bool(rejected)

        await eventually(scraped, what="a slot freed")
    assert rejected[("-", "RequestTimeoutError")] == 1, rejected
    assert rejected[("-", "TooManyConnectionsError")] >= 1, rejected  # the tries meanwhile too
