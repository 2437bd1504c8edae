"""The reference worker's listener: malformed requests get a JSON 400 and one quiet log line."""

from __future__ import annotations

import logging

import pytest

from tests.raw_http import exchange, json_error, parse_responses, request_bytes
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

SECRET = b"tenant-SECRET-90c2"


async def test_malformed_requests_are_json_400s_and_never_log_the_salt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    malformed = [
        request_bytes(b"POST", b"/generate", [(b"X-Tenant-Salt", SECRET + b"\x01")], b"{}"),
        request_bytes(b"GET", b"/health", [(b"X-Tenant-Salt", SECRET + b"a" * 9000)]),
        SECRET + b" / HTTP/1.1\r\n\r\n",
        b"POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + SECRET + b"\r\n",
    ]
    async with ReferenceWorker(WorkerConfig(time_scale=0)) as worker:
        port = int(worker.url.rsplit(":", 1)[1])
        for _ in range(5):
            for raw in malformed:
                (response,) = parse_responses(await exchange(port, raw))
                assert response.status == 400, (raw[:40], response)
                assert json_error(response)["type"] == "invalid_request_error"
                assert SECRET not in response.body
        # aiohttp answers Expect before any middleware: plain text, or a 500 for non-UTF-8
        for value in (b"\xff\xfe", b"102-processing"):
            raw = request_bytes(b"POST", b"/generate", [(b"Expect", value)], b"{}")
            (response,) = parse_responses(await exchange(port, raw))
            assert (
                response.status == 417 and json_error(response)["type"] == "invalid_request_error"
            )
        # a body that does not decode (a bad gzip stream) is the client's fault too
        broken = request_bytes(b"POST", b"/generate", [(b"Content-Encoding", b"gzip")], b"{}")
        (response,) = parse_responses(await exchange(port, broken))
        assert response.status == 400 and "ContentEncodingError" in json_error(response)["message"]
    for record in caplog.records:
        text = record.getMessage() + repr(record.args)
        if record.exc_info:
            text += logging.Formatter().formatException(record.exc_info)
        assert SECRET.decode() not in text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([r for r in caplog.records if "bad HTTP request" in r.getMessage()]) == 1
