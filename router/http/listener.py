"""The router's HTTP listener: aiohttp's server with client deadlines, a connection cap, quiet logs.

aiohttp closes idle keep-alive connections (`keepalive_timeout`, here `limits.idle_timeout_s`)
but bounds neither how long a client may take to send its headers or its body nor how many
connections it may hold, and it logs every malformed request at ERROR with a traceback and the
raw header line, a salt header included. `RouterRunner` serves the app with `GuardedServer`,
whose protocol `GuardedHandler` (aiohttp's `RequestHandler`) adds:

- a new connection's first request must have its headers complete `limits.header_timeout_s`
  after the connect (one that sent nothing by then is closed, with no answer), a later one's
  that long after its first byte, else 408 and close;
- a body must be complete `limits.body_timeout_s` after its headers, else 408 and close;
- beyond `limits.max_connections` open connections a new one gets a 503 and is closed: its
  writing side at once, then what it sent is read and dropped until it closes too, for at most
  `CAPPED_LINGER_S` and `CAPPED_LINGER_BYTES`, and at most `MAX_LINGERING_REFUSALS` such
  connections at a time (closing with its request unread would send a reset in place of the
  close, and a client may lose the 503 to it); past them one is closed at once, after what
  the kernel holds of its input is read and dropped (`CLOSED_AT_ONCE_DRAIN_BYTES`, no wait);
- the cap is lowered to what the descriptor limit holds beside the KV-event streams' share
  (`connection_cap`);
- before routing, a declared body over `limits.max_body_bytes` is a 413 (ahead of any
  `100 Continue`, so the client never sends it), a body in a `Content-Encoding` the router does
  not decode a 415 and an `Expect` other than 100-continue a 417; an `/admin` request without
  the admin token, or a KV query API request without the query token (`AUTH_GATES`), gets
  its API's 401 instead of any of them (a stranger learns nothing of the limits), its body
  unread just the same; each of these answers echoes a well-formed `x-request-id`;
- a malformed request gets a 400 JSON answer that names the kind of problem, never the bytes.

Every refusal is logged through one `RefusalLog`: at most one line per
`limits.refusal_log_interval_s`, with the client address and the reason, never header contents,
and a count of the similar lines it kept back. A flood of bad clients cannot flood the log.
Every refusal is counted too, each one (`REJECTIONS`: the app's `kvroute_rejected_requests`), by
the route's template (`-` when the request was not read, or its path is no route) and the error
type its answer names. Before, only the app's refusals were: a 413 for a declared body (what
most clients send) never showed in the metric, nor in the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

import msgspec
from aiohttp import hdrs, http_exceptions, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader

from indexer.log_throttle import LogThrottle
from router.config import LimitsConfig
from router.errors import (
    AuthError,
    BadHttpRequestError,
    ExpectationFailedError,
    PayloadTooLargeError,
    RequestTimeoutError,
    RouterError,
    TooManyConnectionsError,
    UnsupportedEncodingError,
)
from router.http.bearer import bears_token
from router.http.metrics import NO_ROUTE, route_template
from router.http.observe import (
    OBSERVATION,
    REQUEST_ID_HEADER,
    Unproxied,
    client_request_id,
    well_formed_request_id,
)
from router.http.request_body import DECODED_CODINGS

__all__ = [
    "ADMIN_PREFIX",
    "ADMIN_TOKEN",
    "AUTH_GATES",
    "CAPPED_LINGER_BYTES",
    "CAPPED_LINGER_S",
    "CLOSED_AT_ONCE_DRAIN_BYTES",
    "DIRECT_ROUTES",
    "MAX_FIELD_BYTES",
    "MAX_HEADERS",
    "MAX_LINE_BYTES",
    "MAX_LINGERING_REFUSALS",
    "REJECTIONS",
    "SHUTDOWN_TIMEOUT_S",
    "SNAPSHOT_PATH",
    "STREAM_DESCRIPTORS",
    "AuthGate",
    "GuardedHandler",
    "GuardedServer",
    "RefusalLog",
    "RouterRunner",
    "connection_cap",
]

log = logging.getLogger(__name__)

# the one route whose body is bounded by limits.max_snapshot_bytes, not max_body_bytes
SNAPSHOT_PATH = "/admin/index/load"
# where the admin sub-application is mounted, and its bearer token when it has one (set when
# the app is made; the token only changes with a restart): the listener refuses a request
# without it before its own refusals, which would tell a stranger the admin API's limits
ADMIN_PREFIX = "/admin"
ADMIN_TOKEN: web.AppKey[str] = web.AppKey("admin_token")
# other routes with a bearer token of their own (the KV query API's), refused the same way:
# each gate says what the app would answer a request without the token (None: it may pass,
# or it is not the gate's route); read per request, so a token a reload changes is honoured
AuthGate = Callable[[web.BaseRequest], AuthError | None]
AUTH_GATES: web.AppKey[tuple[AuthGate, ...]] = web.AppKey("auth_gates")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# the app's POST handlers by exact path that the listener calls past the app's router and
# middlewares (`GuardedServer.direct`), set when the app is made
DIRECT_ROUTES: web.AppKey[dict[str, _Handler]] = web.AppKey("direct_routes")
# counts one refusal of the listener's (the route's template, `NO_ROUTE` when it has none;
# the error type its answer names) where the app counts its own (`kvroute_rejected_requests`,
# whose model label is "" here: no body was read), set when the app is made
Rejections = Callable[[str, str], None]
REJECTIONS: web.AppKey[Rejections] = web.AppKey("listener_rejections")
# the file descriptors the process's KV-event streams may hold, all of their share
# (`indexer.subscriptions.Subscriptions.descriptor_room`), set when the app's resources open:
# kept out of the connection budget (`connection_cap`)
STREAM_DESCRIPTORS: web.AppKey[int] = web.AppKey("stream_descriptors")

# aiohttp's own defaults, spelled out so docs/router.md can state them
MAX_LINE_BYTES = 8190  # request line, and any one header line
MAX_FIELD_BYTES = 8190  # one header value
MAX_HEADERS = 128
# after refusing a request early (a 413 before its body), how long its body is still read and
# discarded so the client gets to read the answer instead of a reset
_LINGER_S = 2.0
# a connection refused at the cap (its 503 written, its writing side shut): how long, and how
# many bytes, what it sent is read and dropped before it is closed, so that the close is a FIN
# and not a reset. Kept short: it is a connection over the cap, holding a descriptor. A client
# that wrote its request at once has all of it in the kernel already, and closes on the 503.
CAPPED_LINGER_S = 0.25
CAPPED_LINGER_BYTES = 16 * 1024
# at most this many refused connections linger at once; past it one is closed at once, after
# what the client sent already is read from the kernel and dropped (at most this much)
MAX_LINGERING_REFUSALS = 32
CLOSED_AT_ONCE_DRAIN_BYTES = 64 * 1024
# descriptors kept for everything but client connections and the KV-event streams (the
# listener, logs, zmq's own, health checks), and for the refused connections lingering
_RESERVED_FDS = 64 + MAX_LINGERING_REFUSALS
_json = msgspec.json.Encoder()

# any other request Content-Encoding would be read as if the body were not encoded at all
_ACCEPTED_CODINGS = frozenset(("", "identity", *DECODED_CODINGS))

# what a malformed request did wrong, by aiohttp's exception class (most specific first)
_MALFORMED: tuple[tuple[type[Exception], str], ...] = (
    (http_exceptions.LineTooLong, f"a request line or header is over {MAX_LINE_BYTES} bytes"),
    (http_exceptions.BadHttpMethod, "the request method is not a valid HTTP method"),
    (http_exceptions.BadStatusLine, "the request line is malformed"),
    (http_exceptions.InvalidURLError, "the request target is not a valid URL"),
    (http_exceptions.InvalidHeader, "a header name is malformed"),
    (http_exceptions.PayloadEncodingError, "the body's transfer or content encoding is broken"),
    (
        http_exceptions.BadHttpMessage,
        f"the request headers are malformed (a control character, a bad line, bad framing, "
        f"or more than {MAX_HEADERS} headers)",
    ),
)


def _malformed(exc: BaseException | None) -> str:
    """What a request aiohttp's parser refused did wrong, in words that never quote its bytes."""
    if isinstance(exc, http_exceptions.BadHttpMessage) and exc.message.startswith("Missing 'Host'"):
        # aiohttp's own words for this one refusal ("Missing 'Host' header in request."), under
        # the class of every malformed head: told apart by them, the client learns what to add
        return "an HTTP/1.1 request must have a Host header (RFC 9112 3.2)"
    return next(
        (text for kind, text in _MALFORMED if isinstance(exc, kind)), "malformed HTTP request"
    )


class RefusalLog:
    """One WARNING line per interval about refused clients, counting the lines it held back."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        # one key: every refusal shares the line, whoever the client and whatever the reason
        self._throttle = LogThrottle(interval_s, max_keys=1, clock=clock)

    def note(self, message: str, *args: object) -> None:
        """Log `message % args` unless a line went out less than an interval ago."""
        suppressed = self._throttle.allow("refused")
        if suppressed is not None:
            self._logger.warning(message + ", %d similar suppressed", *args, suppressed)


def _error_body(error: type[RouterError], message: str) -> bytes:
    return _json.encode({"error": {"type": error.__name__, "message": message}})


def _raw_answer(error: type[RouterError], message: str) -> bytes:
    """A whole HTTP/1.1 response, for a connection aiohttp is not (or no longer) serving."""
    body = _error_body(error, message)
    status = HTTPStatus(error.status)
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _json_answer(
    error: type[RouterError], message: str, headers: dict[str, str] | None = None
) -> web.Response:
    """The JSON error answer, closing the connection (its body will not be read)."""
    resp = web.Response(
        status=error.status,
        body=_error_body(error, message),
        content_type="application/json",
        headers=headers,
    )
    resp.force_close()
    return resp


def _peer(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


def _drop_received(transport: asyncio.Transport) -> None:
    """Read and drop what the kernel holds of `transport`'s input now, up to
    `CLOSED_AT_ONCE_DRAIN_BYTES`, without waiting: closed with input unread, a socket sends a
    reset. The transport has not read yet (it starts once `connection_made` returns), so
    nothing is taken from under it; the socket is non-blocking (the event loop's)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    left = CLOSED_AT_ONCE_DRAIN_BYTES
    try:
        while left > 0:
            # os.read, not the socket's recv: asyncio's socket wrapper warns on recv
            chunk = os.read(sock.fileno(), min(left, 65536))
            if not chunk:
                return  # the client closed its side already
            left -= len(chunk)
    except OSError:  # BlockingIOError: all read; a reset: nothing more to spare it
        return


def connection_cap(limits: LimitsConfig, stream_descriptors: int = 0) -> int:
    """`limits.max_connections`, lowered to what the process's descriptor limit can hold
    beside `stream_descriptors`, the descriptors its KV-event streams may hold.

    A proxied request holds a client and an upstream connection; past the descriptor limit
    accept() fails (asyncio logs every failure), the router stops answering anyone, and a cap
    it cannot reach would never refuse the connection that breaks it. The streams' share is
    kept whole, not what they hold now: a worker registered later opens its streams' sockets
    then, and connections holding their descriptors would leave libzmq without any (it fails
    the streams in a loop, or aborts the process). Before, only 96 descriptors were kept
    beside the connections: a router following a worker of 100 ranks sat at 622 of 1,024
    idle with a cap of 464, and 402 idle clients took the rest (new clients reset, /health
    too, nothing logged).
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    budget = max(1, (soft - _RESERVED_FDS - stream_descriptors) // 2)
    if limits.max_connections > budget:
        log.warning(
            "limits.max_connections = %d needs more file descriptors than RLIMIT_NOFILE = %d "
            "allows (two per proxied connection, %d kept for the KV-event streams, %d for the "
            "rest): capping at %d; raise the limit with `ulimit -n` to serve more",
            limits.max_connections,
            soft,
            stream_descriptors,
            _RESERVED_FDS,
            budget,
        )
        return budget
    return limits.max_connections


class GuardedHandler(web.RequestHandler):
    """aiohttp's per-connection protocol, with header and body deadlines and the cap."""

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guarded_by = manager
        self._limits = manager.limits
        self._started = False  # counted against the cap, served by aiohttp
        self._in_request = False  # headers complete, response not finished
        self._deadline: asyncio.TimerHandle | None = None  # the header or the body deadline
        self._body_late = False
        self._sent_nothing = False  # a new connection that has not sent a byte yet
        # refused at the cap and lingering (`_linger`): what it may still send before its close
        self._refused: asyncio.Transport | None = None
        self._linger_bytes = 0

    # ----------------------------------------------------------------- connection lifecycle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._guarded_by
        if server.open_connections >= server.cap:
            server.refusals.note(
                "refused a connection from %s: %d connections open (limits.max_connections)",
                _peer(transport),
                server.open_connections,
            )
            server.count_rejection(NO_ROUTE, TooManyConnectionsError.__name__)
            message = f"the router is at its connection limit ({server.cap}); retry shortly"
            # a TCP transport: uvloop's is no asyncio.Transport subclass but works alike
            refused = cast(asyncio.Transport, transport)
            refused.write(_raw_answer(TooManyConnectionsError, message))
            self._linger(refused)
            return
        self._started = True
        server.open_connections += 1
        super().connection_made(transport)
        # a new connection's first request is due from the connect, not from its first byte:
        # one that sends nothing was held until the idle timeout (75 s), and 1,024 of them
        # locked every client out (503) for as long, round after round
        self._sent_nothing = True
        self._deadline = asyncio.get_running_loop().call_later(
            self._limits.header_timeout_s, self._headers_late
        )

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close a refused connection once it has closed its side too, or after at most
        `CAPPED_LINGER_S` and `CAPPED_LINGER_BYTES`: what it sends meanwhile is dropped.

        Closing a socket with input unread makes the kernel send a reset, not a FIN: the client
        then sees its connection reset after (or, where its kernel drops what it had not read,
        in place of) the 503. Writing is shut at once, so the client reads the 503 and an end;
        its own end closes the connection (aiohttp's `eof_received` lets asyncio close it).
        """
        lingering = self._guarded_by.lingering
        if len(lingering) >= MAX_LINGERING_REFUSALS or not transport.can_write_eof():
            # a flood over the cap: no descriptor held for it. What the client sent already
            # is dropped first, so the close of one that wrote its whole request as it
            # connected is a FIN; before, 45 of 300 such clients (past the 32 lingering) saw
            # a reset after their 503
            _drop_received(transport)
            transport.close()
            return
        transport.write_eof()
        self._refused = transport
        self._linger_bytes = CAPPED_LINGER_BYTES
        lingering.add(self)
        self._deadline = asyncio.get_running_loop().call_later(CAPPED_LINGER_S, transport.close)

    def close_refused(self) -> None:
        """Close a lingering refused connection now (the server stops)."""
        if self._refused is not None:
            self._refused.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._started:
            # refused: aiohttp never saw this connection
            self._guarded_by.lingering.discard(self)
            self._refused = None
            self._cancel_deadline()
            return
        self._started = False
        self._guarded_by.open_connections -= 1
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._started:
            if self._refused is not None:
                # dropped; past the bound it is closed, with a reset if more is on its way:
                # a client that sends this much to a refused connection is not waited for
                self._linger_bytes -= len(data)
                if self._linger_bytes < 0:
                    self._refused.close()
            return
        if data:
            self._sent_nothing = False
            if not self._in_request and self._deadline is None:
                # the first bytes of a later request on the connection: its headers are now
                # due (the first request's were due from the connect already)
                self._deadline = asyncio.get_running_loop().call_later(
                    self._limits.header_timeout_s, self._headers_late
                )
        super().data_received(data)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    # --------------------------------------------------------------------------- deadlines

    def request_started(self, request: web.BaseRequest) -> None:
        """Headers are complete (called by the server's request factory): the body is due."""
        self._in_request = True
        self._body_late = False
        self._cancel_deadline()
        body = request.content
        if not body.is_eof():
            self._deadline = asyncio.get_running_loop().call_later(
                self._limits.body_timeout_s, self._body_timed_out, body
            )
            body.on_eof(self._cancel_deadline)

    def _headers_late(self) -> None:
        self._deadline = None
        if self._in_request or self.transport is None:
            return
        seconds = self._limits.header_timeout_s
        self._guarded_by.count_rejection(NO_ROUTE, RequestTimeoutError.__name__)
        if self._sent_nothing:
            self._guarded_by.refusals.note(
                "closed a connection from %s: nothing sent within %s s of connecting "
                "(limits.header_timeout_s)",
                _peer(self.transport),
                seconds,
            )
            # closed without a 408: no request was begun, so there is none to answer. A client
            # that connected ahead of its request (a pool's pre-connect) and writes it as the
            # close arrives would read a 408 as that request's answer; a bare close is what
            # clients take for a connection gone stale, and retry on a new one
            self.force_close()
            return
        self._guarded_by.refusals.note(
            "closed a connection from %s: request headers incomplete after %s s "
            "(limits.header_timeout_s)",
            _peer(self.transport),
            seconds,
        )
        message = f"request headers not received within limits.header_timeout_s ({seconds} s)"
        self.transport.write(_raw_answer(RequestTimeoutError, message))
        self.force_close()

    def _body_timed_out(self, body: StreamReader) -> None:
        self._deadline = None
        if body.is_eof() or self.transport is None:
            return
        seconds = self._limits.body_timeout_s
        self._guarded_by.refusals.note(
            "closed a connection from %s: request body incomplete after %s s "
            "(limits.body_timeout_s)",
            _peer(self.transport),
            seconds,
        )
        if not self._in_request:
            self.force_close()  # answered already; this was the rest of its body
            return
        # a handler waiting on the body gets the error (the middleware answers 408), and the
        # connection closes after that answer: the rest of the body is not worth waiting for
        self._body_late = True
        body.set_exception(
            RequestTimeoutError(
                f"request body not received within limits.body_timeout_s ({seconds} s)"
            )
        )

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._in_request = False
            if self._body_late or request.content.exception() is not None:
                # a broken or late body: draining the rest would only fail or wait again
                self.force_close()

    # ------------------------------------------------------------------- malformed requests

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A JSON answer for what aiohttp refuses itself; one quiet log line per interval.

        aiohttp's messages quote the offending bytes (a whole header line, salt included), so
        neither the answer nor the log line carries them: only the kind of problem.
        """
        if status >= 500:
            # a bug below the middleware: a traceback is wanted (it carries no header bytes)
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            reason = "internal router error (see the router log)"
            body = _json.encode({"error": {"type": "InternalError", "message": reason}})
        else:
            reason = _malformed(exc)
            self._guarded_by.refusals.note(
                "bad HTTP request from %s: %s",
                request.remote,
                type(exc).__name__ if exc is not None else f"HTTP {status}",
            )
            # its path was not read (aiohttp hands over a stand-in request): no route to name.
            # A 5xx above is not counted: it is a bug, or a client gone before its answer
            self._guarded_by.count_rejection(NO_ROUTE, BadHttpRequestError.__name__)
            body = _error_body(BadHttpRequestError, reason)
        if request.writer.output_size > 0:
            # as aiohttp: part of an answer went out, the connection is beyond repair
            raise ConnectionError("response already started; cannot answer the error")
        resp = web.Response(status=status, body=body, content_type="application/json")
        resp.force_close()
        return resp


def _uncounted(route: str, error: str) -> None:
    """A server without the app's metrics counts no refusal."""


def _decodable(codings: list[str]) -> bool:
    """Whether the router decodes a body sent with these `Content-Encoding` values: a single
    one it knows (`router.http.request_body`; two codings, or two header lines, it does not)."""
    return len(codings) == 1 and codings[0].strip().lower() in _ACCEPTED_CODINGS


class GuardedServer(web.Server):
    """aiohttp's server whose connections are `GuardedHandler`s, counted against the cap."""

    def __init__(
        self,
        handler: Any,
        *,
        limits: LimitsConfig,
        request_factory: Any = None,
        stream_descriptors: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, request_factory=request_factory, **kwargs)
        self.limits = limits
        # what the KV-event streams may hold, kept out of the cap (`connection_cap`)
        self.stream_descriptors = stream_descriptors
        self.cap = connection_cap(limits, stream_descriptors)
        self.open_connections = 0
        # connections refused at the cap whose close waits for their client's (`_linger`)
        self.lingering: set[GuardedHandler] = set()
        self.refusals = RefusalLog(log, limits.refusal_log_interval_s)
        self._inner_factory = self.request_factory
        self.request_factory = self._make_guarded_request
        self._app_handler = self.request_handler
        self.request_handler = self._before_routing
        # POST handlers by exact path served past the app's router and middlewares (the
        # generation endpoints, `RouterRunner` fills it from the app); a request
        # with an `Expect` goes the app's way, which answers 100-continue
        self.direct: dict[str, _Handler] = {}
        self.admin_token = ""  # "" = the admin API is open (loopback) or not served
        self.auth_gates: tuple[AuthGate, ...] = ()
        # where a refusal is counted, and the app's routes it is counted under (`RouterRunner`
        # sets both from the app; a bare server counts nothing and names no route)
        self.count_rejection: Rejections = _uncounted
        self.routes: web.UrlDispatcher | None = None

    def reconfigure(self, limits: LimitsConfig) -> None:
        """`limits` for the connections accepted from now on (a reload); each open one keeps
        the deadlines it started with."""
        if limits.refusal_log_interval_s != self.limits.refusal_log_interval_s:
            self.refusals = RefusalLog(log, limits.refusal_log_interval_s)
        self.limits = limits
        self.cap = connection_cap(limits, self.stream_descriptors)

    @classmethod
    def adopt(
        cls, server: web.Server, limits: LimitsConfig, stream_descriptors: int = 0
    ) -> GuardedServer:
        """A guarded server with the same handler, request factory and protocol options."""
        return cls(
            server.request_handler,
            limits=limits,
            request_factory=server.request_factory,
            stream_descriptors=stream_descriptors,
            handler_cancellation=server.handler_cancellation,
            **server._kwargs,
        )

    def _make_guarded_request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        request = self._inner_factory(message, payload, protocol, writer, task)
        if isinstance(protocol, GuardedHandler):
            protocol.request_started(request)
        return request

    async def _before_routing(self, request: web.BaseRequest) -> web.StreamResponse:
        """Refusals due before the app routes (aiohttp answers `Expect` ahead of middlewares)."""
        refused = self._refusal(request)
        if refused is not None:
            error, answer = refused
            # a stranger hears the API's 401 (its words), not what its limits are
            auth = self._unauthorized(request)
            if auth is not None:
                error, answer = AuthError, _json_answer(AuthError, str(auth), auth.headers())
            route = NO_ROUTE if self.routes is None else await route_template(self.routes, request)
            self.count_rejection(route, error.__name__)
            given_id = client_request_id(request.headers)  # none its Connection names
            if given_id is not None and not well_formed_request_id(given_id):
                given_id = None  # never repeated, never logged
            # its line names it as its answer does, never the connection's request before
            OBSERVATION.set(None if given_id is None else Unproxied(given_id))
            # the route's template, never the path the client wrote
            self.refusals.note(
                "refused a request from %s to %s: %d %s",
                request.remote,
                route,
                answer.status,
                error.__name__,
            )
            # echoed as the app's refusals echo it (`router.http.app`), so the client can match
            # the refusal to its request
            if given_id is not None:
                answer.headers[REQUEST_ID_HEADER] = given_id
            return answer
        if request.method == hdrs.METH_POST and hdrs.EXPECT not in request.headers:
            direct = self.direct.get(request.path)
            if direct is not None:
                # the app's request factory made it: a web.Request, not yet routed
                return await direct(cast(web.Request, request))
        # the rest, an admin request without the token too, gets the app's answer (its 401
        # counted by route in the metrics)
        return await self._app_handler(request)

    def _refusal(self, request: web.BaseRequest) -> tuple[type[RouterError], web.Response] | None:
        """The listener's own refusal of `request` (417, 413, 415) and its error type, None
        when it has none."""
        expect = request.headers.get(hdrs.EXPECT)
        if expect is not None and expect.lower() != "100-continue":
            error: type[RouterError] = ExpectationFailedError
            return error, _json_answer(error, "the Expect header can only be 100-continue")
        declared = request.content_length
        limit, key = self.limits.max_body_bytes, "max_body_bytes"
        if request.path == SNAPSHOT_PATH:
            limit, key = self.limits.max_snapshot_bytes, "max_snapshot_bytes"
        if declared is not None and declared > limit:
            error = PayloadTooLargeError
            return error, _json_answer(
                error, f"request body of {declared} bytes is over limits.{key} ({limit} bytes)"
            )
        codings = request.headers.getall(hdrs.CONTENT_ENCODING, ())
        if codings and request.body_exists and not _decodable(codings):
            # RFC 9110 15.5.16: a 415 says which codings would have been taken
            accepted = ", ".join(DECODED_CODINGS)
            error = UnsupportedEncodingError
            return error, _json_answer(
                error,
                f"the request body's Content-Encoding is not one the router decodes: send it "
                f"in one of {accepted}, or not encoded",
                {"Accept-Encoding": accepted},
            )
        return None

    def _unauthorized(self, request: web.BaseRequest) -> AuthError | None:
        """The 401 the app would answer `request` for a missing or wrong token, if any."""
        if self.admin_token and not self._admin_allowed(request):
            return AuthError("admin API: missing or wrong bearer token")
        for gate in self.auth_gates:
            refused = gate(request)
            if refused is not None:
                return refused
        return None

    def _admin_allowed(self, request: web.BaseRequest) -> bool:
        """False for an admin request without the admin token (the path as the app routes it,
        so no spelling of it goes around the check)."""
        path = request.path
        if path != ADMIN_PREFIX and not path.startswith(ADMIN_PREFIX + "/"):
            return True
        return bears_token(request.headers, self.admin_token)

    async def shutdown(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 - aiohttp's
        # the refused connections still lingering are closed now, not left to their timers
        for handler in list(self.lingering):
            handler.close_refused()
        await super().shutdown(timeout)

    def __call__(self) -> GuardedHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


# how long a stopping router lets its requests in flight run before cancelling them (aiohttp's
# default, named: `kvroute serve --processes` waits this long for each child, and a margin)
SHUTDOWN_TIMEOUT_S = 60.0


class RouterRunner(web.AppRunner):
    """`web.AppRunner` serving through `GuardedServer` with the router's limits."""

    def __init__(self, app: web.Application, limits: LimitsConfig, **kwargs: Any) -> None:
        super().__init__(
            app,
            keepalive_timeout=limits.idle_timeout_s,
            # bodies are decoded by the handlers (`router.http.request_body`): aiohttp's parser
            # took a gzip body cut short for a whole one
            auto_decompress=False,
            lingering_time=min(_LINGER_S, limits.body_timeout_s),
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_FIELD_BYTES,
            max_headers=MAX_HEADERS,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            **kwargs,
        )
        self._limits = limits

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # the app's resources are open once it returns
        server = GuardedServer.adopt(made, self._limits, self.app.get(STREAM_DESCRIPTORS, 0))
        # the app's direct routes (they reach its proxy once its resources are open)
        server.direct = self.app.get(DIRECT_ROUTES, {})
        server.admin_token = self.app.get(ADMIN_TOKEN, "")
        server.auth_gates = self.app.get(AUTH_GATES, ())
        server.count_rejection = self.app.get(REJECTIONS, _uncounted)
        server.routes = self.app.router
        return server
