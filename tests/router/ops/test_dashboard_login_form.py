"""`POST /dashboard/login` with bodies no browser sends, over raw sockets to a real router.

The route takes a body from anyone before any token is known. A body that is no readable form
is a 400 JSON error naming the problem and logs nothing; a form without the token, or with a
wrong one, is the login form again (401). Before, each malformed body was a 500 and an ERROR
traceback in the log, one per request.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
from collections.abc import AsyncIterator

import pytest

from router.config import AdminConfig, LimitsConfig
from router.http.dashboard.session import COOKIE
from router.service import RouterService
from tests.raw_http import RawResponse, exchange, json_error, parse_responses, request_bytes
from tests.router.conftest import TOKEN, router_config

FORM = b"application/x-www-form-urlencoded"
MULTIPART = b"multipart/form-data; boundary=XX"
LIMIT = 64 * 1024  # limits.max_body_bytes of the router under test
SECRET = TOKEN.encode()


def _part(headers: bytes, value: bytes) -> bytes:
    return b"--XX\r\n" + headers + b"\r\n\r\n" + value + b"\r\n"


TOKEN_PART = b'Content-Disposition: form-data; name="token"'
ENDED = b"--XX--\r\n"

# (what is wrong, Content-Type, body, a word the error's message says)
MALFORMED: list[tuple[str, bytes | None, bytes, str]] = [
    ("an unknown charset", FORM + b"; charset=nope", b"token=" + SECRET, "charset"),
    ("a charset no text is in", FORM + b"; charset=rot13", b"token=" + SECRET, "charset"),
    ("bytes that are not UTF-8", FORM, b"token=" + SECRET + b"\xff", "utf-8"),
    ("bytes that are not UTF-16", FORM + b"; charset=utf-16", b"token=x", "utf-16"),
    ("multipart without a boundary", b"multipart/form-data", b"x", "multipart"),
    ("multipart cut short", MULTIPART, _part(TOKEN_PART, SECRET)[:-2], "whole"),
    ("multipart cut in a head", MULTIPART, b"--XX\r\n" + TOKEN_PART + b"\r\n", "whole"),
    ("multipart not at its boundary", MULTIPART, b"token=" + SECRET, "boundary"),
    ("multipart empty", MULTIPART, b"", "boundary"),
    ("a part without a name", MULTIPART, _part(b"X-A: 1", SECRET) + ENDED, "multipart"),
    (
        "a part in an unknown transfer encoding",
        MULTIPART,
        _part(TOKEN_PART + b"\r\nContent-Transfer-Encoding: rot", SECRET) + ENDED,
        "RuntimeError",
    ),
    (
        "a part of bad base64",
        MULTIPART,
        _part(TOKEN_PART + b"\r\nContent-Transfer-Encoding: base64", b"a") + ENDED,
        "multipart",
    ),
    (
        "a part in an unknown charset",
        MULTIPART,
        _part(TOKEN_PART + b"\r\nContent-Type: text/plain; charset=nope", SECRET) + ENDED,
        "charset",
    ),
    ("a part that is not UTF-8", MULTIPART, _part(TOKEN_PART, b"\xff") + ENDED, "utf-8"),
    (
        "a nested multipart",
        MULTIPART,
        _part(TOKEN_PART + b"\r\nContent-Type: multipart/mixed; boundary=YY", b"--YY--") + ENDED,
        "multipart",
    ),
    ("a part's header line bad", MULTIPART, _part(b"not a header", SECRET) + ENDED, "headers"),
    (
        "a boundary too long",
        b"multipart/form-data; boundary=" + b"X" * 100,
        _part(TOKEN_PART, SECRET),
        "multipart",
    ),
    ("JSON", b"application/json", b'{"token": "' + SECRET + b'"}', "Content-Type"),
    ("text", b"text/plain", b"token=" + SECRET, "Content-Type"),
    ("no Content-Type", None, b"token=" + SECRET, "Content-Type"),
    ("1001 fields", FORM, b"&".join([b"a=b"] * 1001), "fields"),
    # aiohttp's 413 for too many fields: its parser takes the codec's error for one
    ("a %-escape no idna text is", FORM + b"; charset=idna", b"token=%ff", "not valid 'idna' text"),
    ("a body no punycode is", FORM + b"; charset=punycode", b"token=%ff", "'punycode' text"),
    (
        "1001 parts",
        MULTIPART,
        _part(b'Content-Disposition: form-data; name="a"', b"b") * 1001,
        "fields",
    ),
]


def _port(router: RouterService) -> int:
    return int(router.url.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def _router(token: str = TOKEN) -> AsyncIterator[RouterService]:
    config = router_config(
        [], admin=AdminConfig(token=token), limits=LimitsConfig(max_body_bytes=LIMIT)
    )
    async with RouterService(config) as router:
        yield router


async def _post(router: RouterService, content_type: bytes | None, body: bytes) -> RawResponse:
    headers = [] if content_type is None else [(b"Content-Type", content_type)]
    request = request_bytes(b"POST", b"/dashboard/login", headers, body)
    (answer,) = parse_responses(await exchange(_port(router), request))
    return answer


def _logged_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_a_body_that_is_no_readable_form_is_a_400_naming_the_problem(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with _router() as router:
        for what, content_type, body, named in MALFORMED:
            answer = await _post(router, content_type, body)
            assert answer.status == 400, (what, answer)
            error = json_error(answer)
            assert error["type"] == "RequestError", (what, error)
            assert "login form" in error["message"], (what, error)
            assert named.lower() in error["message"].lower(), (what, error)
            assert SECRET not in answer.body, what  # the body's bytes are never echoed
            assert COOKIE not in answer.headers.get("set-cookie", ""), what
    assert not _logged_errors(caplog)
    for record in caplog.records:
        assert TOKEN not in record.getMessage(), record.name


async def test_fifty_malformed_logins_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with _router() as router:
        for _ in range(50):
            answer = await _post(router, FORM + b"; charset=nope", b"token=x")
            assert answer.status == 400
    assert not _logged_errors(caplog)
    assert not [r for r in caplog.records if "dashboard/login" in r.getMessage()]


async def test_a_body_over_the_limit_stays_a_413_naming_the_limit() -> None:
    huge = b"token=" + b"a" * LIMIT
    async with _router() as router:
        declared = await _post(router, FORM, huge)
        chunked = request_bytes(
            b"POST",
            b"/dashboard/login",
            [(b"Content-Type", FORM), (b"Transfer-Encoding", b"chunked")],
            b"",
        ).replace(b"Content-Length: 0\r\n", b"")
        chunked += b"%x\r\n%s\r\n0\r\n\r\n" % (len(huge), huge)
        (streamed,) = parse_responses(await exchange(_port(router), chunked))
    for answer in (declared, streamed):
        assert answer.status == 413, answer
        error = json_error(answer)
        assert error["type"] == "PayloadTooLargeError" and "max_body_bytes" in error["message"]


async def test_a_form_without_the_token_is_the_login_form_again() -> None:
    file_part = b'Content-Disposition: form-data; name="token"; filename="t"'
    bytes_part = TOKEN_PART + b"\r\nContent-Type: application/octet-stream"
    async with _router() as router:
        for content_type, body in [
            (FORM, b"other=" + SECRET),
            (FORM, b""),
            (MULTIPART, _part(file_part, SECRET) + ENDED),  # a file is no token
            (MULTIPART, _part(bytes_part, SECRET) + ENDED),  # nor are bytes
        ]:
            answer = await _post(router, content_type, body)
            assert answer.status == 401, (body, answer)
            assert b'action="/dashboard/login"' in answer.body
            assert b"The form had no token." in answer.body
        wrong = await _post(router, FORM, b"token=nope")
    assert wrong.status == 401 and b"That is not the admin token." in wrong.body


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        (FORM, b"token=" + SECRET),
        (FORM + b"; charset=utf-8", b"token=" + SECRET),
        (MULTIPART, _part(TOKEN_PART, SECRET) + ENDED),
        (MULTIPART, _part(TOKEN_PART + b"\r\nContent-Type: text/plain", SECRET) + ENDED),
    ],
)
async def test_a_well_formed_form_with_the_token_still_logs_in(
    content_type: bytes, body: bytes
) -> None:
    async with _router() as router:
        answer = await _post(router, content_type, body)
    assert answer.status == 303 and answer.headers["location"] == "/dashboard"
    assert answer.headers["set-cookie"].startswith(COOKIE + "=")


async def test_the_connection_is_kept_after_a_refused_login() -> None:
    bad = request_bytes(
        b"POST", b"/dashboard/login", [(b"Content-Type", b"multipart/form-data")], b"x", close=False
    )
    good = request_bytes(
        b"POST", b"/dashboard/login", [(b"Content-Type", FORM)], b"token=" + SECRET
    )
    async with _router() as router:
        first, second = parse_responses(await exchange(_port(router), bad + good))
    assert (first.status, second.status) == (400, 303)


async def test_without_an_admin_token_there_is_no_login_whatever_the_body() -> None:
    async with _router(token="") as router:
        for _, content_type, body, _ in MALFORMED[:6]:
            answer = await _post(router, content_type, body)
            assert answer.status == 303, answer


async def test_an_encoded_form_is_a_415_not_read_as_sent() -> None:
    """The router's listener leaves bodies as sent (`router.http.request_body`), and aiohttp's
    form reader would read a gzip'd form's bytes as the form."""
    async with _router() as router:
        headers = [(b"Content-Type", FORM), (b"Content-Encoding", b"gzip")]
        answers = []
        # an empty one too: its reader has no count of compressed bytes (QA: a 500 and a
        # traceback, on a route that needs no token)
        for body in (gzip.compress(b"token=" + SECRET), b""):
            request = request_bytes(b"POST", b"/dashboard/login", headers, body)
            answers += parse_responses(await exchange(_port(router), request))
    for answer in answers:
        assert answer.status == 415, answer
        assert "Content-Encoding" in json_error(answer)["message"]
