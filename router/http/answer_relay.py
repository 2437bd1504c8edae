"""A worker's answer passed through to the client.

The answer gets the router's own headers (the worker, the predicted and raw matches, the
forecast, the rank told: `WORKER_HEADER`...), hop-by-hop headers dropped (`HOP_BY_HOP`, and
those its `Connection` names: `router.http.hop_headers`; the request's copy follows the same
rule). A
whole answer is sent as one; a stream is forwarded chunk by chunk, and its response headers
only sent once the worker produced its first chunk, so a worker that dies before answering is
retried too (`AttemptFailed`). A stream cut after that is no retry: the client's connection is
cut, and the request counts as a failure (`router.http.outcome`): 502 when its worker broke it
off (one ordinary failure of the worker), 504 when the request deadline passed (a failure of the
worker only when it had stalled).

An answer is a stream when it is SSE (`text/event-stream`), or chunked to a request that asked
to stream (`ParsedRequest.stream`); any other is read whole (within the whole answer's bound),
whatever its framing: a proxy or sidecar in front of the worker may re-chunk a whole JSON
answer, which read whole is retried when cut and has its usage read as a whole answer's.
Before, every chunked answer was relayed as a stream: cut, the client had a 200 and a cut body,
and a batched `/generate` had its last item's `cached_tokens` held against its first item's
prediction. The usage of a batch of several prompts (`ParsedRequest.many_prompts`) is never
read, whole or streamed: it is every item's, the prediction its first item's (a one-item list's
is its item's, read as a single prompt's).

`AnswerHooks` is what a caller adds to one answer (the pair dispatcher's,
`router.http.pair_hooks`: headers naming both workers, a wait for the prefill side before
anything is committed, the prefill's logprobs merged in).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from multidict import CIMultiDict

from router.errors import UpstreamTimeoutError
from router.http.direct_answer import ChunkedResponse, SentResponse, send_whole
from router.http.hop_headers import HOP_BY_HOP, copy_headers
from router.http.intake import PARSED
from router.http.metrics import DEADLINE_CUT
from router.http.observe import observation
from router.http.outcome import AttemptFailed, client_left, mark_broken_off
from router.http.rank_refusal import RankMoved, refuses_rank
from router.http.upstream_client import UpstreamClientError, UpstreamResponse
from router.routing.load import Ticket, Withdraw
from router.routing.planner import Candidate, Planner

__all__ = [
    "DP_RANK_HEADER",
    "FORECAST_HEADER",
    "MATCHED_HEADER",
    "PENDING_HEADER",
    "RAW_MATCHED_HEADER",
    "RAW_PENDING_HEADER",
    "WORKER_HEADER",
    "AnswerHooks",
    "relay_answer",
]

log = logging.getLogger(__name__)

WORKER_HEADER = "x-kvroute-worker"
MATCHED_HEADER = "x-kvroute-matched-tokens"
PENDING_HEADER = "x-kvroute-pending-tokens"
# the index's match before the admission-time discount (`router.routing.admission`)
RAW_MATCHED_HEADER = "x-kvroute-raw-matched-tokens"
RAW_PENDING_HEADER = "x-kvroute-raw-pending-tokens"
# when the forecast kept less than the raw match: why the rest is lost (`AdmissionForecast.cause`)
FORECAST_HEADER = "x-kvroute-forecast-lost"
DP_RANK_HEADER = "x-kvroute-dp-rank"  # only when the engine was told a rank


class AnswerHooks:
    """What a caller adds to one forwarded answer (the pair dispatcher); by default nothing."""

    def __init__(self) -> None:
        self.request_headers: dict[str, str] = {}  # set on the upstream request
        self.headers: dict[str, str] = {}  # set on the answer (after the proxy's own)

    async def before_commit(self, status: int) -> None:
        """Awaited once the worker answered (`status`), before anything reaches the client;
        raising makes the attempt fail (AttemptFailed: retried)."""

    def passes_through(self, status: int, last_try: bool, payload: bytes) -> bool:
        """Whether the worker's 5xx `status` (its body: `payload`) is the client's answer (else
        AttemptFailed). With hooks, the caller charges the failure to whichever worker it
        blames (a pair's decode may fail for its prefill, and say so in its body): once the
        request ended (`charge`), or at once in `timed_out`."""
        return last_try

    def timed_out(self) -> str | None:
        """The request deadline passed before the worker answered (UpstreamTimeoutError):
        the worker charged for it (None: the caller charges the worker it sent to)."""
        return None

    def body(self, payload: bytes) -> bytes:
        """A whole (non-streamed) answer, as the client gets it."""
        return payload

    def chunk(self, data: bytes) -> bytes:
        """One streamed chunk, as the client gets it."""
        return data

    def end(self) -> bytes:
        """What the stream ends with, after the last chunk."""
        return b""


async def relay_answer(
    planner: Planner,
    request: web.Request,
    upstream: UpstreamResponse,
    candidate: Candidate,
    ticket: Ticket,
    *,
    last_try: bool,
    hooks: AnswerHooks | None = None,
    deadline: float | None = None,
    rank_moved: Callable[[], Awaitable[bool]] | None = None,
    stall_s: float,
) -> web.StreamResponse:
    """Pass the worker's answer through; raises AttemptFailed while a retry is still legal,
    RankMoved when the worker refused the rank the router chose (`rank_moved` given).
    `deadline` (event-loop time) bounds the client's reading too: a client that stops
    reading holds the request, its worker connection and its load no longer than that.
    A stream the deadline cuts after its worker sent nothing for `stall_s` charges it."""
    if not 200 <= upstream.status < 300:
        # its end takes back what routing marked (`Planner.withdraw`): a worker that
        # refused the request (4xx: SGLang validates before scheduling) stored nothing
        status = upstream.status
        ticket.withdraw = Withdraw.ALL if 400 <= status < 500 else Withdraw.PENDING
    payload: bytes | None = None  # read already
    if upstream.status >= 500:
        if hooks is not None:
            # read first: whom a pair's failure is blamed on may be in its body
            payload = await upstream.read()
            last_try = hooks.passes_through(upstream.status, last_try, payload)
        if not last_try:
            raise AttemptFailed(f"HTTP {upstream.status}", hard=False, status=upstream.status)
        # passed through, but still a failure: charged once the request ended (`charge`:
        # by `Proxy._route`, or the pair dispatcher's `_answered`)
    if upstream.status == 400 and rank_moved is not None:
        payload = await upstream.read()
        if refuses_rank(upstream.status, payload):
            raise RankMoved(candidate.worker, anew=await rank_moved())
    out = copy_headers(upstream.headers, HOP_BY_HOP)
    out[WORKER_HEADER] = candidate.worker
    # what the worker is predicted to reuse at admission; the index's raw answer beside it
    matched, pending = candidate.predicted_split
    out[MATCHED_HEADER] = str(matched)
    out[PENDING_HEADER] = str(pending)
    out[RAW_MATCHED_HEADER] = str(candidate.matched_tokens)
    out[RAW_PENDING_HEADER] = str(candidate.pending_tokens)
    if candidate.admission is not None and candidate.admission.cause:
        out[FORECAST_HEADER] = candidate.admission.cause
    if candidate.dp_rank is not None:
        out[DP_RANK_HEADER] = str(candidate.dp_rank)
    if hooks is not None:
        out.update(hooks.headers)
    obs = observation(request)
    if obs is not None:
        obs.response_headers(out)
    parsed = request[PARSED]
    # chunked says nothing by itself: any hop may re-chunk a whole answer. What the client
    # asked for does (and SSE is a stream whoever asked: a worker's stream, unbounded)
    streaming = payload is None and (
        "text/event-stream" in upstream.headers.get("Content-Type", "")
        or (parsed.stream and "chunked" in upstream.headers.get("Transfer-Encoding", "").lower())
    )
    if not streaming:
        if payload is None:
            payload = await upstream.read()
        if hooks is not None:
            planner.first_byte(ticket)
            await hooks.before_commit(upstream.status)
            payload = hooks.body(payload)
        if obs is not None:
            obs.first_byte()
        # the client has its answer before the router's bookkeeping (this request's own
        # below, and its end's in the caller): at low concurrency that is latency saved
        try:
            response = await send_whole(request, upstream.status, out, payload, deadline=deadline)
        except ConnectionResetError:  # gone, or cut at the deadline: the worker answered
            response = SentResponse(upstream.status, out, False, 0)
            client_left(request)
        if hooks is None:
            planner.first_byte(ticket)
        if obs is not None and not parsed.many_prompts:  # a batch's usage is no one prediction's
            obs.body(payload)
        if upstream.status < 500:
            planner.record_success(candidate.worker)
        return response
    # wait for the first chunk before committing headers: until then, a retry is legal
    first = await upstream.readany()
    # a stream's first chunk is its first token (an error's is none): a time to first token.
    # Its content is not read: SGLang sends a chat stream's role chunk with the first output,
    # and an upstream that sends it before the prefill fools the balance fit (docs/router.md)
    planner.first_byte(ticket, first_token=200 <= upstream.status < 300)
    if hooks is not None:
        await hooks.before_commit(upstream.status)
    if obs is not None:
        obs.first_byte()
    return await _stream(
        planner, request, upstream, out, first, candidate.worker, stall_s, hooks, deadline
    )


async def _stream(
    planner: Planner,
    request: web.Request,
    upstream: UpstreamResponse,
    headers: CIMultiDict[str],
    first: bytes,
    worker: str,
    stall_s: float,
    hooks: AnswerHooks | None = None,
    deadline: float | None = None,
) -> web.StreamResponse:
    """Pass a streamed answer through from its `first` chunk on, the response headers
    committed; a worker breaking off from here is no retry."""
    response = ChunkedResponse(status=upstream.status, headers=headers, deadline=deadline)
    chunk = first
    # a batch's events are each one item's: its usage is no one prediction's (none is read)
    usage = None if request[PARSED].many_prompts else observation(request)
    loop = asyncio.get_running_loop()
    try:
        await response.prepare(request)
        while chunk:
            data = chunk if hooks is None else hooks.chunk(chunk)
            await response.write(data)
            if usage is not None:
                usage.chunk(data)  # its usage is read once the stream ends
            # from here the wait is the worker's (the client took the chunk already)
            asked = loop.time()
            try:
                chunk = await upstream.readany()
            except (UpstreamClientError, TimeoutError) as exc:
                # bytes already reached the client, so no retry; cut the connection so the
                # client sees a truncated stream, not a clean end, and count the request as
                # the failure it is (its status line said the worker's 200: `answer_code`)
                if isinstance(exc, TimeoutError):
                    _deadline_cut(planner, request, worker, loop.time() - asked, stall_s)
                else:
                    # one ordinary failure, as a 5xx: the prompt may be what crashes the
                    # engine, and a client retrying it would carry it to every worker (hard,
                    # each cut opened a circuit: two took a fleet of two out for the cooldown).
                    # A worker really gone refuses the next request's connection: that opens
                    # its circuit at once
                    planner.record_failure(worker, hard=False)
                    log.warning("worker %s failed mid-stream: %s", worker, type(exc).__name__)
                    mark_broken_off(request, type(exc).__name__)
                upstream.close()
                if request.transport is not None:
                    request.transport.close()
                return response
        if hooks is not None and (tail := hooks.end()):
            await response.write(tail)
        await response.write_eof()
    except ConnectionResetError:
        # the client went away, or stopped reading until the deadline and was cut
        # (`ClientStalledError`; left to `Proxy.forward`, either would count against the worker
        # and retry a request whose bytes were sent); closing the upstream connection makes
        # the worker abort. The worker was streaming: it works (a recovering worker's
        # circuit closes on it, as on a whole answer)
        upstream.close()
        planner.record_success(worker)
        client_left(request)
        return response
    except asyncio.CancelledError:
        # the client went away and aiohttp cancelled the handler: the same (`Proxy.forward`
        # closes the upstream connection)
        planner.record_success(worker)
        raise
    if upstream.status < 500:  # a streamed 5xx is a failure (`Proxy._route` charges it)
        planner.record_success(worker)
    return response


def _deadline_cut(
    planner: Planner, request: web.Request, worker: str, silent_s: float, stall_s: float
) -> None:
    """The request deadline cut `worker`'s stream, after it had sent nothing for `silent_s`.

    The client has a cut body: the request counts as 504 (it counted as the worker's 200).
    A worker that was still streaming is not charged: a long generation is no sign of a
    broken worker, and charged it would reopen a recovering worker's circuit. One that had
    sent nothing for `stall_s` (`timeouts.connect_s`, what a worker is given to show it is
    there) or longer has stalled: one ordinary failure, as a worker that never answered."""
    stalled = silent_s >= stall_s
    if stalled:
        planner.record_failure(worker, hard=False)
    log.warning(
        "the stream of worker %s was cut at the request deadline (timeouts.request_s): %s",
        worker,
        f"it had sent nothing for {silent_s:.1f} s (stalled: one failure charged)"
        if stalled
        else "it was still streaming (no failure charged)",
    )
    mark_broken_off(request, UpstreamTimeoutError.__name__, DEADLINE_CUT)
