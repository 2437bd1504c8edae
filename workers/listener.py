"""The reference worker's HTTP listener: malformed requests answered in JSON and logged quietly.

aiohttp answers a request its parser refuses with plain text quoting the offending bytes, and
logs it at ERROR with a traceback and the raw header line (a salt header included), once per
request. The worker answers in its JSON error shape instead, naming the kind of problem, and
logs at most one line per interval with a count of the lines held back. The router's listener
(`router.http.listener`) does the same and more; the package layering keeps the two apart.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any

from aiohttp import hdrs, web

from workers.errors import PortTakenError

__all__ = ["SHUTDOWN_TIMEOUT_S", "QuietHandler", "QuietServer", "WorkerRunner", "bind_site"]

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


class _RefusalLog:
    """One WARNING line per interval, counting the lines held back: `indexer.log_throttle`'s
    rule with one key, copied, since the workers may import only the indexer's wire protocol
    and engine specs (DESIGN.md section 1)."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next = float("-inf")
        self._suppressed = 0

    def note(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self._interval_s
        suppressed, self._suppressed = self._suppressed, 0
        log.warning(message + ", %d similar suppressed", *args, suppressed)


class QuietHandler(web.RequestHandler):
    """aiohttp's protocol, with JSON answers and one quiet log line for malformed requests."""

    def __init__(self, manager: QuietServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._refusals = manager.refusals

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if request.content.exception() is not None:
                # a broken body: aiohttp would drain the rest, fail again and log it at ERROR
                self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer in the worker's JSON error shape; never echo or log the request's bytes."""
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            kind, text = "internal_error", "internal worker error (see the worker log)"
        else:
            reason = type(exc).__name__ if exc is not None else f"HTTP {status}"
            self._refusals.note("bad HTTP request from %s: %s", request.remote, reason)
            kind, text = "invalid_request_error", f"malformed HTTP request ({reason})"
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot answer the error")
        resp = web.json_response({"error": {"type": kind, "message": text}}, status=status)
        resp.force_close()
        return resp


class QuietServer(web.Server):
    """aiohttp's server whose connections are `QuietHandler`s sharing one refusal log."""

    def __init__(self, handler: Any, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.refusals = _RefusalLog(LOG_INTERVAL_S)
        self._app_handler = self.request_handler
        self.request_handler = self._before_routing

    async def _before_routing(self, request: web.BaseRequest) -> web.StreamResponse:
        """aiohttp answers `Expect` ahead of the middlewares, in plain text (or a 500 when the
        value is not UTF-8): refuse what it would refuse, in JSON, before it sees it."""
        expect = request.headers.get(hdrs.EXPECT)
        if expect is not None and expect.lower() != "100-continue":
            message = "the Expect header can only be 100-continue"
            resp = web.json_response(
                {"error": {"type": "invalid_request_error", "message": message}}, status=417
            )
            resp.force_close()
            return resp
        return await self._app_handler(request)

    def __call__(self) -> QuietHandler:
        return QuietHandler(self, loop=self._loop, **self._kwargs)


# how long a stopping worker lets its requests in flight run (aiohttp's default, said by
# `kvroute up` as it stops)
SHUTDOWN_TIMEOUT_S = 60.0


class WorkerRunner(web.AppRunner):
    """`web.AppRunner` serving through `QuietServer`, its requests in flight let run for
    `SHUTDOWN_TIMEOUT_S` at a stop."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, shutdown_timeout=SHUTDOWN_TIMEOUT_S, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return QuietServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            **server._kwargs,
        )


async def bind_site(site: web.TCPSite, what: str, port: int) -> None:
    """Start `site`; its port held by another process is a PortTakenError naming `what` and
    the port (the bind's own "[Errno 98] error while attempting to bind on address" named
    neither the port's use nor the option that moves it)."""
    try:
        await site.start()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or not port:
            raise
        raise PortTakenError(f"{what} {port} is taken", port) from exc
