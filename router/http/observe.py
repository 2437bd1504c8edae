"""One proxied request as operators see it: its id, timings, decision, outcome and trace.

The proxy opens an `Observation` per request (`Observer.begin`) and tells it what happens: the
phases (parse, route), each upstream attempt, the first byte, the answer (whose usage says how
many tokens the worker served from cache), the end. The observation feeds `DecisionStats`
(metrics, the recent decisions, the dashboard's window) and, when tracing is on, the request's
spans. The proxy's inner steps reach it without new parameters (`observation(request)`): it sits
in a context variable of the handler's task, a lookup in C where the request's own mapping would
be three Python calls, on every hop of every request.

`x-request-id`: a client's well-formed id (`well_formed_request_id`) is passed through to the
worker untouched (and echoed back); a request without one, or with one that is not, gets one of
the router's in its place, so every log line can name it. So does a request whose `Connection`
names the header (`client_request_id`): the client made it its hop's only, and the router does
not adopt it (before, it took the id as its own and set it on the worker's request, which the
copy of the client's headers had dropped as hop-by-hop). `install_log_request_id` puts the id
of the observation in the handler's task on every log record (`kvroute serve` logs it), and
each request ends with a DEBUG line naming it. Only a well-formed id is written into log lines:
a client's spaces and brackets would forge a line's level, logger and message of their own.

Spans follow OpenTelemetry's HTTP conventions: the status code the client got on the request
span, the router's own errors too (`answered_status`), ERROR for a 5xx only, and as `error.type`
a class, one of a few values (`error_type`), never a message.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict, MultiMapping

from indexer.errors import IndexerError
from router.errors import RouterError
from router.fleet.false_hits import FalseHitWatch
from router.http.decisions import Decision, DecisionStats
from router.http.hop_headers import connection_named
from router.http.outcome import AttemptFailed, BrokenOff
from router.http.pair_failure import PrefillFailed
from router.http.spans import SpanMaker, TraceSpan
from router.http.tracing import PARSE_CONTEXT, TraceDecision, Tracing
from router.http.usage import StreamTail, cached_tokens
from router.prompt.request import Endpoint
from router.routing.planner import Plan
from router.routing.policy import Candidate

__all__ = [
    "OBSERVATION",
    "REQUEST_ID_HEADER",
    "DroppedTrace",
    "Observation",
    "Observer",
    "TracedObservation",
    "Unobserved",
    "Unproxied",
    "answered_kind",
    "answered_status",
    "client_request_id",
    "error_type",
    "install_log_request_id",
    "observation",
    "well_formed_request_id",
]

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
# what a client's id may be to be passed on and logged as sent: UUIDs, hex, base64 and ULIDs,
# AWS's `Root=1-...;Parent=...` ids. No space, bracket, quote or control character: in a log
# line (`[%(request_id)s]: message`) those would start a forged level, logger and message
_WELL_FORMED_ID = re.compile(r"[A-Za-z0-9._~:/+=@,;-]{1,128}")
_NO_PHASE = contextlib.nullcontext()
# a made id: this process's random half, then a counter (32 hex digits, as a UUID's). Unique
# across replicas and restarts without uuid4's cost (the largest part of observing a request).
# Counted from 2**128 + (random << 64) so that `hex(n)[3:]` is the id, zero-padded: a third
# of the cost of formatting the two halves with a width (0.26 against 0.64 us)
_ID_COUNTER = itertools.count((1 << 128) | (int.from_bytes(os.urandom(8), "big") << 64))


def client_request_id(headers: MultiMapping[str]) -> str | None:
    """The client's `x-request-id` as it sent it; None without one, or when its `Connection`
    names the header (hop-by-hop then: the client's hop's only, neither adopted nor passed on).
    """
    given = headers.get(REQUEST_ID_HEADER)
    if given is None or hdrs.CONNECTION not in headers:
        return given
    named = connection_named(headers.getall(hdrs.CONNECTION))
    return None if REQUEST_ID_HEADER in named else given


def well_formed_request_id(value: str) -> bool:
    """Whether a client's `x-request-id` is used as sent: 1-128 characters, each a letter, a
    digit or one of `._~:/+=@,;-`."""
    return _WELL_FORMED_ID.fullmatch(value) is not None


class Observer:
    """Opens the observations of one router; owns nothing that needs closing."""

    def __init__(
        self,
        stats: DecisionStats,
        block_size: Callable[[str], int | None],
        tracing: Tracing | None = None,
        *,
        enabled: bool = True,
    ) -> None:
        self.stats = stats
        self.tracing = tracing
        self.enabled = enabled  # `[observe] enabled`: false, every request is `Unobserved`
        # told every answer's cached against predicted tokens: a worker whose answers keep
        # reusing far less than predicted is checked (set by the app)
        self.watch: FalseHitWatch | None = None
        # the statistics read a decision's block size when they count it, off the request path
        stats.block_size = block_size

    def begin(self, request: web.Request, endpoint: Endpoint) -> Observation:
        """Start observing `request` (found again by `observation(request)`)."""
        if not self.enabled:
            # not stored: the proxy's inner steps skip it altogether. The variable is cleared:
            # the task of a keep-alive connection serves its requests one after another
            OBSERVATION.set(None)
            return Unobserved()
        tracing = self.tracing
        obs: Observation
        if tracing is None:
            obs = Observation(self, request, endpoint)
        else:
            decision = tracing.start(request.headers)
            if isinstance(decision, str):
                # a trace not recorded (the ratio or the client said so): decided before
                # anything is made, so the request is observed as without tracing, and its
                # worker gets the header saying the trace was dropped
                obs = DroppedTrace(self, request, endpoint, decision)
            else:
                obs = TracedObservation(self, request, endpoint, tracing, decision)
        OBSERVATION.set(obs)  # the handler's own task: no reset needed
        return obs


class Observation:
    """What one request did, told by the proxy as it happens: its decision statistics and
    request id (a router with tracing observes each request as a `TracedObservation`)."""

    __slots__ = (
        "_decision",
        "_observer",
        "_tail",
        "endpoint",
        "model",
        "request_id",
        "started",
    )

    def __init__(self, observer: Observer, request: web.Request, endpoint: Endpoint) -> None:
        self._observer = observer
        self.started = time.perf_counter()
        self.endpoint = endpoint._value_  # what `.value` returns, without enum's descriptor
        self.model = ""
        given = client_request_id(request.headers)
        # a client's id that is not well formed (or that its Connection names) is replaced
        # everywhere (the worker's logs take it too): the client gets back the id its request
        # was logged under
        self.request_id = (
            given
            if given is not None and _WELL_FORMED_ID.fullmatch(given) is not None
            else hex(next(_ID_COUNTER))[3:]
        )
        self._decision: Decision | None = None
        self._tail: StreamTail | None = None

    def phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A child span around one step (`parse`, `route`); nothing without tracing."""
        return _NO_PHASE

    def planned(self, plan: Plan, model: str) -> None:
        """The decision's facts."""
        self.model = model

    def attempt(self, plan: Plan, candidate: Candidate, attempt: int) -> None:
        """The request goes to `candidate` (attempt 0 is the decision; later ones retries)."""
        decision = Decision(
            self.request_id,
            self.endpoint,
            self.model,
            plan.namespace,
            plan.prompt_tokens,
            plan.candidates,
            candidate,
            attempt,
            None,  # the statistics fill it in when they count it
        )
        if self._decision is not None:  # the attempt before, retried: counted as it stands
            self._observer.stats.told(self._decision)
        self._decision = decision

    def outgoing(self, headers: CIMultiDict[str]) -> None:
        """Headers for the worker: the request id (in place of a client's malformed one)."""
        headers[REQUEST_ID_HEADER] = self.request_id

    def failed(
        self, error: BaseException, status: int | None = None, reason: str | None = None
    ) -> None:
        """The attempt failed with `error` before any byte reached the client (a retry may
        follow); `status`: the worker's HTTP status, when it answered one; `reason`: what to
        say of it (default: the error's message)."""

    def first_byte(self) -> None:
        """The worker's first byte arrived: time to first token, at the router."""
        decision = self._decision
        if decision is not None and decision.ttft_s is None:
            decision.ttft_s = time.perf_counter() - self.started

    def response_headers(self, headers: CIMultiDict[str]) -> None:
        """Headers for the client: the request id."""
        headers[REQUEST_ID_HEADER] = self.request_id

    def body(self, payload: bytes) -> None:
        """A whole (non-streamed) answer: its usage."""
        if self._decision is not None:
            self._decision.cached_tokens = cached_tokens(payload)

    def chunk(self, chunk: bytes) -> None:
        """One chunk of a streamed answer (the last few are read for usage at the end)."""
        tail = self._tail
        if tail is None:
            tail = self._tail = StreamTail()
        tail.feed(chunk)

    def finish(self, status: int, broken_off: BrokenOff | None = None) -> None:
        """The answer went out with `status`: count the outcome. `broken_off`: the stream was
        cut after that (its worker broke it off, or the request deadline passed); counted as
        its code, as in the request metrics, and with no usage (none came)."""
        decision = self._decision
        if decision is None:
            return
        if broken_off is not None:
            # events that came may carry cached_tokens (SGLang's /generate: every one), but an
            # answer never finished is no success: neither in accuracy nor among the usage
            # missing (`DecisionStats` counts those of a 200)
            status = broken_off.code
        elif self._tail is not None:
            decision.cached_tokens = self._tail.cached_tokens()
        decision.status = status
        decision.duration_s = time.perf_counter() - self.started
        self._decision = None
        observer = self._observer
        observer.stats.told(decision)
        cached = decision.cached_tokens
        if cached is not None and status == 200 and observer.watch is not None:
            chosen = decision.chosen
            # the prediction from events alone, as x-kvroute-matched-tokens said it (the
            # outcomes count the pending part too): the watch looks for a worker whose events
            # come from another cache, and a pending mark is the router's own guess at a
            # request still on its way, missed under KV pressure on a healthy worker (QA: 11
            # of 19 in one run), which must not have its streams subscribed anew
            observer.watch.answered(
                chosen.worker, min(chosen.matched_tokens, chosen.predicted_tokens), cached
            )
        if log.isEnabledFor(logging.DEBUG):
            chosen = decision.chosen
            # the prediction, as x-kvroute-matched-tokens says it (the raw match read as a
            # false hit where the admission forecast predicted its pages evicted)
            log.debug(
                "request %s: %s %s -> %s rank %s, status %d, matched %d (held %d), cached %s, "
                "%.1f ms",
                self.request_id,
                self.endpoint,
                self.model or "-",
                chosen.worker,
                chosen.dp_rank,
                status,
                chosen.predicted_split[0],
                chosen.matched_tokens,
                decision.cached_tokens,
                decision.duration_s * 1e3,
            )

    def close(self, error: BaseException | None) -> None:
        """The handler is done (answered, raised or cancelled)."""
        decision = self._decision
        if decision is not None:  # not answered (failed or cancelled): counted as it stands
            self._decision = None
            self._observer.stats.told(decision)


class DroppedTrace(Observation):
    """An observation in a router with tracing, of a request whose trace is not recorded (the
    sample ratio or the client's flags said so): an `Observation` whose worker gets the
    `traceparent` of the dropped trace, so the worker does not record it either."""

    __slots__ = ("_traceparent",)

    def __init__(
        self, observer: Observer, request: web.Request, endpoint: Endpoint, traceparent: str
    ) -> None:
        super().__init__(observer, request, endpoint)
        self._traceparent = traceparent

    def outgoing(self, headers: CIMultiDict[str]) -> None:
        """Headers for the worker: the request id, and the dropped trace's `traceparent`."""
        super().outgoing(headers)
        headers["traceparent"] = self._traceparent  # replaces the client's


class TracedObservation(Observation):
    """An observation in a router with tracing of a request whose trace is recorded (by
    kvroute's recorder, or by the SDK where it decides): the request's spans. Each step does
    what an `Observation` does, then its span's part."""

    __slots__ = (
        "_phase_span",
        "_request_ctx",
        "_request_span",
        "_spans",
        "_tracing",
        "_upstream_span",
    )

    def __init__(
        self,
        observer: Observer,
        request: web.Request,
        endpoint: Endpoint,
        tracing: Tracing,
        decision: TraceDecision | None,
    ) -> None:
        super().__init__(observer, request, endpoint)
        self._tracing = tracing
        self._request_span: TraceSpan | None = None
        self._request_ctx: Any = None
        self._phase_span: TraceSpan | None = None
        self._upstream_span: TraceSpan | None = None
        # who makes this request's spans: the SDK, or kvroute's recorder for a trace it keeps
        # (`router.http.spans`)
        self._spans: SpanMaker | None = None
        self._start_trace(tracing, request, decision)

    def _start_trace(
        self, tracing: Tracing, request: web.Request, decision: TraceDecision | None
    ) -> None:
        name = f"{request.method} {self.endpoint}"
        attributes = {
            "http.request.method": request.method,
            "url.path": request.path,
            "kvroute.endpoint": self.endpoint,
            "kvroute.request_id": self.request_id,
        }
        span: TraceSpan
        recorder = tracing.recorder
        if decision is not None and recorder is not None:
            span = recorder.root(
                decision.trace_id,
                decision.parent_span_id,
                name,
                tracing.server_kind,
                attributes,
                decision.flags,
            )
            self._spans = recorder
        else:  # the SDK's way: the client's context, the SDK's sampler
            parent = tracing.propagator.extract(request.headers)
            span = tracing.spans.start(name, parent, tracing.server_kind, attributes)
            self._spans = tracing.spans
        # sampled out: no child spans either (they would cost), but the decision still goes
        # to the worker (`outgoing`), so it does not record what this trace dropped
        self._request_ctx = self._spans.context_of(span)
        if span.is_recording():
            self._request_span = span

    def phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A child span around one step (`parse`, `route`)."""
        if self._request_span is None:
            return _NO_PHASE
        spans = self._spans
        assert spans is not None  # a request span was made
        span = self._phase_span = spans.start(name, self._request_ctx)
        token = PARSE_CONTEXT.set((spans, spans.context_of(span))) if name == "parse" else None
        return _PhaseSpan(self, span, token)

    def _phase_ended(
        self,
        span: TraceSpan,
        token: contextvars.Token[tuple[SpanMaker, Any] | None] | None,
        error: BaseException | None,
    ) -> None:
        if isinstance(error, Exception):  # not a cancellation
            span.record_exception(error)
            span.set_status(self._tracing.error(type(error).__name__))
        if token is not None:
            PARSE_CONTEXT.reset(token)
        self._phase_span = None
        span.end()

    def planned(self, plan: Plan, model: str) -> None:
        """The decision's facts, on the `route` span."""
        super().planned(plan, model)
        span = self._phase_span
        if span is None:
            return
        first = plan.candidates[0] if plan.candidates else None
        attributes = _target_attributes(first) if first is not None else {}
        attributes["kvroute.candidates"] = len(plan.candidates)
        attributes["kvroute.prompt_tokens"] = plan.prompt_tokens
        attributes["kvroute.namespace"] = plan.namespace  # a fingerprint, never the salt
        span.set_attributes(attributes)

    def attempt(self, plan: Plan, candidate: Candidate, attempt: int) -> None:
        """The request goes to `candidate`: an `upstream` span for the attempt."""
        super().attempt(plan, candidate, attempt)
        if self._request_span is None:
            return
        spans = self._spans
        assert spans is not None  # a request span was made
        self._end_upstream(None)
        attributes = _target_attributes(candidate)
        attributes["server.address"] = candidate.url
        attributes["kvroute.attempt"] = attempt
        self._upstream_span = spans.start(
            "upstream", self._request_ctx, self._tracing.client_kind, attributes
        )

    def outgoing(self, headers: CIMultiDict[str]) -> None:
        """Headers for the worker: the request id, and the upstream span as `traceparent`."""
        super().outgoing(headers)
        spans = self._spans
        if spans is None:
            return
        span = self._upstream_span
        # not sampled (or no attempt span, a pair's decode hop): the request's own context
        context = spans.context_of(span) if span is not None else self._request_ctx
        carrier: dict[str, str] = {}
        spans.inject(carrier, context)
        for name, value in carrier.items():
            headers[name] = value  # replaces the client's: the worker's parent is ours

    def failed(
        self, error: BaseException, status: int | None = None, reason: str | None = None
    ) -> None:
        """The attempt failed before any byte reached the client: its span ends with it, the
        failure's class as `error.type` (`error_type`), what it said as the status's
        description."""
        span = self._upstream_span
        if span is not None and status is not None:
            span.set_attribute("http.response.status_code", status)
        self._end_upstream(error_type(error), str(error) if reason is None else reason)

    def finish(self, status: int, broken_off: BrokenOff | None = None) -> None:
        """The answer went out with `status`: count the outcome, close the upstream span. Both
        spans keep the `status` the client was sent; a stream cut after it began (`broken_off`)
        ends in error with its `error.type`."""
        decision = self._decision
        super().finish(status, broken_off)
        if decision is None:
            return
        # a cut stream's error is its class; a 5xx's, its status (OpenTelemetry's convention)
        error = None if broken_off is None else broken_off.error
        said = error
        if error is None and status >= 500:
            error, said = str(status), f"HTTP {status}"
        span = self._upstream_span
        if span is not None:
            answered: dict[str, int | float] = {"http.response.status_code": status}
            if decision.cached_tokens is not None:
                answered["kvroute.cached_tokens"] = decision.cached_tokens
            if decision.ttft_s is not None:
                answered["kvroute.ttft_s"] = decision.ttft_s
            span.set_attributes(answered)
            self._end_upstream(error, said)
        request_span = self._request_span
        if request_span is not None:
            # the request span names its worker too (a search by worker finds the request);
            # the rest of the decision is on its children: each attribute costs a few us
            request_span.set_attributes(
                {"kvroute.worker": decision.chosen.worker, "http.response.status_code": status}
            )
            if error is not None:
                request_span.set_attribute("error.type", error)
                request_span.set_status(self._tracing.error(said or error))

    def close(self, error: BaseException | None) -> None:
        """The handler is done (answered, raised or cancelled): end the request span."""
        super().close(error)
        span = self._request_span
        if span is None:
            return
        self._request_span = None
        if self.model:
            span.set_attribute("kvroute.model", self.model)
        if error is None:
            self._end_upstream(None)
        else:
            kind = answered_kind(error)
            self._end_upstream(kind)
            # the router answered it itself (an error raised: `router.http.app.answer_errors`),
            # or nobody (the client left): the status it sent, and ERROR for a 5xx or none,
            # as for an answer a worker sent (a 4xx is the client's: UNSET)
            status = answered_status(error)
            span.set_attribute("error.type", kind)
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            if status is None or status >= 500:
                span.set_status(self._tracing.error(kind))
        span.end()

    def _end_upstream(self, error: str | None, said: str | None = None) -> None:
        """End the attempt's span; `error`: its `error.type` (and ERROR), `said` the status's
        description (default: `error`)."""
        span = self._upstream_span
        if span is None:
            return
        self._upstream_span = None
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(self._tracing.error(said or error))
        span.end()


class _PhaseSpan:
    """A phase's span for the length of a `with` (a class: a generator-based context manager
    costs four more calls a phase)."""

    __slots__ = ("_observation", "_span", "_token")

    def __init__(
        self,
        observation: TracedObservation,
        span: TraceSpan,
        token: contextvars.Token[tuple[SpanMaker, Any] | None] | None,
    ) -> None:
        self._observation = observation
        self._span = span
        self._token = token

    def __enter__(self) -> TraceSpan:
        return self._span

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        self._observation._phase_ended(self._span, self._token, error)


class Unobserved(Observation):
    """An observation that records nothing (`[observe] enabled = false`): no request id, no
    decision statistics, no spans. It exists so the proxy's path has no branch of its own, and
    so a benchmark can measure what observing costs against it."""

    __slots__ = ()

    def __init__(self) -> None:  # none of the state of an Observation is needed
        self.started = time.perf_counter()

    def phase(self, name: str) -> contextlib.AbstractContextManager[object]:
        """No span."""
        return _NO_PHASE

    def planned(self, plan: Plan, model: str) -> None:
        """Nothing kept."""

    def attempt(self, plan: Plan, candidate: Candidate, attempt: int) -> None:
        """Nothing kept."""

    def outgoing(self, headers: CIMultiDict[str]) -> None:
        """Nothing added."""

    def failed(
        self, error: BaseException, status: int | None = None, reason: str | None = None
    ) -> None:
        """Nothing kept."""

    def first_byte(self) -> None:
        """Nothing kept."""

    def response_headers(self, headers: CIMultiDict[str]) -> None:
        """Nothing added."""

    def body(self, payload: bytes) -> None:
        """Nothing read."""

    def chunk(self, chunk: bytes) -> None:
        """Nothing read."""

    def finish(self, status: int, broken_off: BrokenOff | None = None) -> None:
        """Nothing counted."""

    def close(self, error: BaseException | None) -> None:
        """No span to end."""


# what only carries a failed attempt: its `error.type` is what it carries (`error_type`)
_CARRIERS = (AttemptFailed, PrefillFailed)


def error_type(error: BaseException) -> str:
    """A failed attempt's `error.type`: the class of what failed, one of a few values, as
    OpenTelemetry's conventions want it (the message goes in the status's description). The
    router's carriers of an attempt's failure (`AttemptFailed`, `PrefillFailed`, not their
    subclasses: `BootstrapUnreachable` says more) stand for what they were raised from
    (`UpstreamDroppedError`, `TimeoutError`), or, raised from nothing, for the worker's HTTP
    status that failed the attempt (`"503"`). Before, it was the message (`connection dropped:
    the worker closed ...`, `HTTP 503`): a value per message."""
    while type(error) in _CARRIERS:
        cause = error.__cause__
        if cause is None:
            status = getattr(error, "status", None)
            return type(error).__name__ if status is None else str(status)
        error = cause
    return type(error).__name__


def answered_status(error: BaseException) -> int | None:
    """The status the router answers a request that raised `error` with, as
    `router.http.app.answer_errors` answers it; None when it answers nothing (the client left:
    the handler cancelled, or its connection reset)."""
    if isinstance(error, RouterError | web.HTTPException):
        return error.status
    if isinstance(error, IndexerError | RequestPayloadError):
        return 400
    if isinstance(error, ConnectionResetError) or not isinstance(error, Exception):
        return None
    return 500  # a bug: answered as an InternalError


def answered_kind(error: BaseException) -> str:
    """The error's kind as `router.http.app.answer_errors` names it to the client and in
    `kvroute_rejected_requests` (a span said aiohttp's `HTTPRequestEntityTooLarge` where the
    answer said `PayloadTooLargeError`)."""
    if isinstance(error, web.HTTPException) and error.status == 413:
        return "PayloadTooLargeError"
    if isinstance(error, RequestPayloadError):
        return "BadHttpRequestError"
    return type(error).__name__


def _target_attributes(candidate: Candidate) -> dict[str, str | int | float]:
    """Where a request goes and why, as span attributes (set in one call: cheaper)."""
    attributes: dict[str, str | int | float] = {
        "kvroute.worker": candidate.worker,
        "kvroute.matched_tokens": candidate.matched_tokens,
        "kvroute.pending_tokens": candidate.pending_tokens,
        "kvroute.score": candidate.score,
    }
    if candidate.dp_rank is not None:
        attributes["kvroute.dp_rank"] = candidate.dp_rank
    return attributes


# where the proxy's inner steps find the request's observation: the request being handled in
# this task (a handler runs in one task; tasks it starts copy the variable)
OBSERVATION: contextvars.ContextVar[Observation | None] = contextvars.ContextVar(
    "kvroute_observation", default=None
)


def observation(request: web.Request) -> Observation | None:
    """The observation of `request` (the one this task handles), if the proxy opened one."""
    return OBSERVATION.get()


def install_log_request_id() -> None:
    """Give every log record a `request_id` attribute: the request its task is handling ("-"
    outside a request), for a log format to print with `%(request_id)s`."""
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        obs = OBSERVATION.get()
        record.request_id = "-" if obs is None else obs.request_id
        return record

    logging.setLogRecordFactory(factory)


class Unproxied(Unobserved):
    """A request the router answers itself (the admin API, the dashboard, /health, the
    listener's refusals): nothing is observed but its id, which names the log lines written
    while it is handled (`install_log_request_id`) and goes back on its answer
    (`router.http.app.request_id_middleware`)."""

    __slots__ = ()

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id

    @classmethod
    def named(cls, headers: MultiMapping[str]) -> Unproxied:
        """Named by the client's well-formed id, else by one of the router's."""
        given = client_request_id(headers)
        if given is None or _WELL_FORMED_ID.fullmatch(given) is None:
            given = hex(next(_ID_COUNTER))[3:]
        return cls(given)
