"""`/admin/debug/memory`: what the router process holds, for operators and the soak benchmark.

Resident memory is always reported (Linux `/proc/self/statm`). Allocation sites need Python's
`tracemalloc`, which costs time on every allocation, so it is off unless the environment asks
for it: `KVROUTE_TRACEMALLOC=N` starts tracing at startup with N frames per allocation (0 or
unset: off; not an integer: a warning, and off). Then
`POST /admin/debug/memory/baseline` takes a snapshot and `GET /admin/debug/memory` names the
allocation sites that grew the most since it (`?top=K`, default 15), which is how a leak is
found: run traffic, take a baseline once warm, keep running, look at what keeps growing.

Site names are source locations (file:line), never data: no salt can appear in an answer.
"""

from __future__ import annotations

import logging
import os
import tracemalloc
from pathlib import Path

import msgspec
from aiohttp import web

__all__ = ["TRACEMALLOC_ENV", "add_memory_routes", "rss_bytes", "start_tracing"]

TRACEMALLOC_ENV = "KVROUTE_TRACEMALLOC"

log = logging.getLogger(__name__)

_BASELINE: web.AppKey[list[tracemalloc.Snapshot]] = web.AppKey("memory_baseline", list)
_json = msgspec.json.Encoder()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class GrowthSite(msgspec.Struct, frozen=True):
    """One allocation site and how it changed since the baseline."""

    site: str  # file:line of the innermost frame
    size_bytes: int
    size_diff_bytes: int
    count: int
    count_diff: int


def start_tracing() -> bool:
    """Start tracemalloc when `KVROUTE_TRACEMALLOC` asks (frames per allocation); True if on.

    Unset, empty or 0 (or below) is off, as a switch reads; a value that is not an integer is
    a mistake, said in a warning, and off (tracing slows every allocation: never by guess)."""
    raw = os.environ.get(TRACEMALLOC_ENV, "").strip()
    if not raw or tracemalloc.is_tracing():
        return tracemalloc.is_tracing()
    try:
        frames = int(raw)
        if frames <= 0:
            return False
        tracemalloc.start(frames)
    except ValueError:  # not an integer, or more frames than tracemalloc keeps (65535)
        log.warning(
            "%s=%r is not a number of frames (an integer from 1 to 65535, 0 for off): "
            "tracemalloc stays off",
            TRACEMALLOC_ENV,
            raw,
        )
        return False
    return True


def rss_bytes() -> int | None:
    """Resident memory of this process (None where /proc is not available)."""
    try:
        fields = Path("/proc/self/statm").read_text().split()
    except OSError:
        return None
    return int(fields[1]) * _PAGE


def _snapshot() -> tracemalloc.Snapshot:
    # the tracer's own bookkeeping is not the router's memory
    return tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )


async def memory(request: web.Request) -> web.Response:
    """GET: RSS, traced bytes and, against the baseline, the fastest-growing sites."""
    try:
        top = max(1, min(200, int(request.query.get("top", "15"))))
    except ValueError:
        return web.json_response(
            {"error": {"type": "RequestError", "message": "top must be an integer"}}, status=400
        )
    body: dict[str, object] = {"rss_bytes": rss_bytes(), "tracing": tracemalloc.is_tracing()}
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        body.update(traced_bytes=current, traced_peak_bytes=peak)
        baselines = request.app[_BASELINE]
        if baselines:
            stats = _snapshot().compare_to(baselines[-1], "lineno")
            stats.sort(key=lambda s: s.size_diff, reverse=True)
            body["growth"] = [
                GrowthSite(
                    site=f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
                    size_bytes=s.size,
                    size_diff_bytes=s.size_diff,
                    count=s.count,
                    count_diff=s.count_diff,
                )
                for s in stats[:top]
            ]
    return web.Response(body=_json.encode(body), content_type="application/json")


async def baseline(request: web.Request) -> web.Response:
    """POST: take the snapshot later growth is measured against (409 when not tracing)."""
    if not tracemalloc.is_tracing():
        message = f"tracemalloc is off: start the router with {TRACEMALLOC_ENV}=N"
        error = {"error": {"type": "ConflictError", "message": message}}
        return web.Response(body=_json.encode(error), status=409, content_type="application/json")
    request.app[_BASELINE][:] = [_snapshot()]
    done = {"baseline": True, "traced_bytes": tracemalloc.get_traced_memory()[0]}
    return web.Response(body=_json.encode(done), content_type="application/json")


def add_memory_routes(app: web.Application) -> None:
    """Register the memory routes on the admin sub-application."""
    app[_BASELINE] = []
    app.router.add_get("/debug/memory", memory)
    app.router.add_post("/debug/memory/baseline", baseline)
