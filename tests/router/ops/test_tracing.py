"""Traces of proxied requests (`router.http.tracing`, `router.http.observe`), on real sockets.

A router with the OpenTelemetry SDK's in-memory exporter in front of backends on 127.0.0.1
that record the headers they receive: the span tree, its attributes, the `traceparent` the
worker gets, `x-request-id` through to the worker, back to the client and onto log lines;
tracing off by default, and on from the config file or the OTEL_* variables; new traces the
sample ratio drops decided without the SDK, and every other decision left to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import aiohttp
import hypothesis
import msgspec
import pytest
from aiohttp import web
from hypothesis import strategies as st
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.propagate import get_global_textmap, set_global_textmap
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider, export
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.config import ObserveConfig, PolicyConfig, RouterConfig, TracingConfig, WorkerConfig
from router.http.bootstrap_unreachable import BootstrapUnreachable
from router.http.keys import DECISIONS, TRACING
from router.http.observe import error_type
from router.http.outcome import AttemptFailed
from router.http.pair_failure import HandoffFailed, PrefillFailed
from router.http.pair_handoff import HandoffFault
from router.http.tracing import (
    TraceDecision,
    Tracing,
    build_tracing,
    parse_traceparent,
    w3c_propagation,
)
from router.http.upstream_client import UpstreamDroppedError
from router.service import RouterService
from tests.router.conftest import eventually, router_config, serve_app
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

SALT = "tenant-secret-salt-7f3a"
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "Summarize the quarterly report. " * 8}],
    "max_tokens": 2,
    "cache_salt": SALT,
}
_ANSWER = msgspec.json.encode(
    {
        "id": "c",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }
)
CLIENT_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736  # a client's trace id
# version, trace id, parent span id, flags (sampled, and the SDK's "random trace id" bit)
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)


class Backend:
    """An aiohttp server on 127.0.0.1 answering chat requests, keeping the headers it got;
    `cut`: it streams two events, then closes the connection (the engine died mid-stream);
    `drop`: it closes the connection before answering."""

    def __init__(self, status: int = 200, *, cut: bool = False, drop: bool = False) -> None:
        self.status = status
        self.cut = cut
        self.drop = drop
        self.seen: list[dict[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        if self.drop:
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(30)  # cancelled: its connection is closed
        if self.cut:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"delta": {"content": "o"}}]}\n\n' * 2)
            assert request.transport is not None
            request.transport.close()  # no last chunk: the answer is unended
            await asyncio.sleep(30)  # cancelled: its connection is closed
        if self.status != 200:
            return web.Response(status=self.status, text="overloaded")
        return web.Response(body=_ANSWER, content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def __aenter__(self) -> Backend:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        # a handler of a cut answer waits until its connection is gone: cancelled then
        self._runner, self.url = await serve_app(
            app, access_log=None, handler_cancellation=self.cut or self.drop
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def _config(workers: tuple[WorkerConfig, ...], **overrides: Any) -> RouterConfig:
    """A loopback router (admin token, quick health rounds) in front of `workers`."""
    return msgspec.structs.replace(router_config([]), workers=workers, **overrides)


def _worker(wid: str, backend: Backend) -> WorkerConfig:
    # a plain backend: configured model, no KV events, nothing to discover
    return WorkerConfig(id=wid, url=backend.url, model="m", kv_events=False)


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set the OTEL_* variables they mean; none leaks in from the shell."""
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    async with Backend() as b:
        yield b


class Traced(NamedTuple):
    router: RouterService
    exporter: InMemorySpanExporter  # where the router's spans end up
    way: str

    @property
    def url(self) -> str:
        return self.router.url

    def spans(self) -> tuple[ReadableSpan, ...]:
        """The finished spans, checked to be made the way under test."""
        spans = self.exporter.get_finished_spans()
        for span in spans:
            # the SDK's spans hand their bounded attributes on; kvroute's recorder a plain
            # dict (the public `attributes` is a read-only view of either)
            made_by_sdk = isinstance(span._attributes, BoundedAttributes)
            assert made_by_sdk is (self.way == "sdk"), (self.way, span.name)
        return spans


@contextlib.asynccontextmanager
async def _traced_router(
    way: str, config: RouterConfig, provider: TracerProvider, exporter: InMemorySpanExporter
) -> AsyncIterator[Traced]:
    """A router tracing with a provider handed in (`sdk`: the SDK makes every span), or with
    the one kvroute makes from the config (`recorder`: new traces are recorded by kvroute)."""
    if way == "sdk":
        async with RouterService(config, tracer_provider=provider) as router:
            yield Traced(router, exporter, way)
        return
    tracing = TracingConfig(enabled=True, exporter="memory")
    async with RouterService(msgspec.structs.replace(config, tracing=tracing)) as router:
        made = router.app[TRACING]
        assert made.recorder is not None and made.memory is not None
        yield Traced(router, made.memory, way)


@pytest.fixture(params=["sdk", "recorder"])
def way(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def traced(
    way: str, provider: TracerProvider, exporter: InMemorySpanExporter, backend: Backend
) -> AsyncIterator[Traced]:
    async with _traced_router(way, _config((_worker("b0", backend),)), provider, exporter) as t:
        yield t


async def _post(url: str, body: object, headers: dict[str, str] | None = None) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as resp,
    ):
        await resp.read()
        return resp


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named: dict[str, ReadableSpan] = {}
    for span in spans:
        assert span.name not in named, f"two {span.name!r} spans"
        named[span.name] = span
    return named


def _count(span: ReadableSpan, key: str) -> int:
    value = (span.attributes or {})[key]
    assert isinstance(value, int), (span.name, key, value)
    return value


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _no_salt(spans: tuple[ReadableSpan, ...]) -> None:
    for span in spans:
        for key, value in (span.attributes or {}).items():
            assert SALT not in str(value), f"{span.name}.{key} carries the salt"
        assert SALT not in span.name


async def test_one_request_is_a_span_tree_and_the_worker_continues_it(
    traced: Traced, backend: Backend
) -> None:
    resp = await _post(traced.url, CHAT, {"x-request-id": "client-req-1"})
    assert resp.status == 200
    spans = traced.spans()
    named = _by_name(spans)
    assert set(named) == {"POST /v1/chat/completions", "parse", "tokenize", "route", "upstream"}
    root = named["POST /v1/chat/completions"]
    assert root.parent is None and root.kind is SpanKind.SERVER
    assert root.context is not None
    trace_id, root_id = root.context.trace_id, root.context.span_id
    assert all(s.context is not None and s.context.trace_id == trace_id for s in spans)
    assert _parent_id(named["parse"]) == root_id
    parse = named["parse"].context
    assert parse is not None and _parent_id(named["tokenize"]) == parse.span_id
    assert _parent_id(named["route"]) == root_id
    assert _parent_id(named["upstream"]) == root_id
    assert named["upstream"].kind is SpanKind.CLIENT
    for span in spans:  # each context as the API's own constructor makes it (the recorder's
        # skips its checks): equal as tuples, and through every property; sampled, and its id
        # random (a new trace), both ways
        c = span.context
        assert c is not None
        made = SpanContext(c.trace_id, c.span_id, False, TraceFlags(0x03))
        assert c == made and c.is_valid and c.trace_flags.sampled and not c.is_remote
        assert c.trace_state == made.trace_state and 0 < c.span_id < 2**64

    # where it went and why: on route (the decision) and upstream (the attempt); the request
    # span names the worker
    assert (root.attributes or {})["kvroute.worker"] == "b0"
    matched = int(resp.headers["x-kvroute-matched-tokens"])
    pending = int(resp.headers["x-kvroute-pending-tokens"])
    for name in ("route", "upstream"):
        attrs = named[name].attributes or {}
        assert attrs["kvroute.worker"] == "b0", name
        assert attrs["kvroute.matched_tokens"] == matched, name
        assert attrs["kvroute.pending_tokens"] == pending, name
        assert "kvroute.dp_rank" not in attrs  # one rank: the engine picks
    assert _count(named["tokenize"], "kvroute.prompt_tokens") > 0
    assert _count(named["route"], "kvroute.prompt_tokens") > 0
    assert (named["upstream"].attributes or {})["http.response.status_code"] == 200
    assert (root.attributes or {})["kvroute.request_id"] == "client-req-1"
    assert (root.attributes or {})["kvroute.model"] == "m"
    assert all(s.status.status_code is StatusCode.UNSET for s in spans)
    assert all(s.resource.attributes["service.name"] for s in spans)
    assert {s.instrumentation_scope.name for s in spans if s.instrumentation_scope} == {"kvroute"}
    for span in spans:  # each ends after it starts, inside its parent
        assert span.start_time is not None and span.end_time is not None
        assert span.start_time <= span.end_time
        assert root.start_time <= span.start_time and span.end_time <= root.end_time  # type: ignore[operator]
    _no_salt(spans)

    # the worker's parent is the upstream span, in the request's trace
    (seen,) = backend.seen
    found = TRACEPARENT.match(seen["traceparent"])
    assert found is not None
    upstream = named["upstream"].context
    assert upstream is not None
    assert int(found.group(1), 16) == trace_id
    assert int(found.group(2), 16) == upstream.span_id
    assert seen["traceparent"].endswith("-03")  # sampled, the trace id random
    # x-request-id: the client's, to the worker and back
    assert seen["x-request-id"] == "client-req-1"
    assert resp.headers["x-request-id"] == "client-req-1"


async def test_a_client_trace_is_continued_and_its_sampling_followed(
    traced: Traced, backend: Backend
) -> None:
    client_trace, client_span = f"{CLIENT_TRACE:032x}", "00f067aa0ba902b7"
    sampled = f"00-{client_trace}-{client_span}-01"
    context = {"traceparent": sampled, "tracestate": "vendor=abc", "baggage": "tenant=a"}
    resp = await _post(traced.url, CHAT, context)
    assert resp.status == 200
    # the client's state and baggage reach the worker as they were
    assert backend.seen[-1]["tracestate"] == "vendor=abc"
    assert backend.seen[-1]["baggage"] == "tenant=a"
    root = _by_name(traced.spans())["POST /v1/chat/completions"]
    assert root.context is not None and root.parent is not None
    assert root.context.trace_id == int(client_trace, 16)
    assert root.parent.span_id == int(client_span, 16) and root.parent.is_remote
    found = TRACEPARENT.match(backend.seen[-1]["traceparent"])
    assert found is not None and found.group(1) == client_trace
    assert found.group(2) != client_span  # the router's upstream span, not the client's

    # a trace the client did not sample: no spans, and the worker is told "not sampled"
    traced.exporter.clear()
    unsampled = f"00-{client_trace}-{client_span}-00"
    resp = await _post(traced.url, CHAT, {"traceparent": unsampled})
    assert resp.status == 200
    assert traced.spans() == ()
    found = TRACEPARENT.match(backend.seen[-1]["traceparent"])
    assert found is not None and found.group(1) == client_trace
    assert not int(backend.seen[-1]["traceparent"][-2:], 16) & 1  # the sampled flag is off


async def test_a_bad_request_is_a_400_with_its_exception_on_the_parse_span(
    traced: Traced, backend: Backend
) -> None:
    """The request span of a refusal the router answers itself says its status, and a 4xx
    leaves its status UNSET, as one a worker answered does (before: no status code, and
    ERROR); `error.type` names the refusal's class."""
    resp = await _post(traced.url, {"model": "m", "messages": "not a list"}, {"x-request-id": "b1"})
    assert resp.status == 400
    assert resp.headers["x-request-id"] == "b1"  # a refusal echoes it as an answer does
    named = _by_name(traced.spans())
    assert set(named) == {"POST /v1/chat/completions", "parse"}  # no route, no upstream
    parse, root = named["parse"], named["POST /v1/chat/completions"]
    assert parse.status.status_code is StatusCode.ERROR
    (event,) = parse.events
    attrs = event.attributes or {}
    assert event.name == "exception"
    assert str(attrs["exception.type"]).endswith("RequestError")
    assert "messages" in str(attrs["exception.message"])
    assert "Traceback" in str(attrs["exception.stacktrace"])
    assert root.status.status_code is StatusCode.UNSET
    assert _count(root, "http.response.status_code") == 400
    assert (root.attributes or {})["error.type"] == "RequestError"
    assert not backend.seen  # it never left the router


async def test_a_body_over_the_limit_is_named_on_its_span_as_its_answer_names_it(
    way: str, provider: TracerProvider, exporter: InMemorySpanExporter, backend: Backend
) -> None:
    """A chunked body growing past `limits.max_body_bytes` is refused by aiohttp's read as its
    `HTTPRequestEntityTooLarge`, which the answer and `kvroute_rejected_requests` name
    `PayloadTooLargeError`: the request span's `error.type` says the same (it said aiohttp's
    class)."""
    config = _config((_worker("b0", backend),))
    config = msgspec.structs.replace(
        config, limits=msgspec.structs.replace(config.limits, max_body_bytes=1024)
    )

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(8):
            yield b"x" * 512
        yield b'"}]}'

    async with (
        _traced_router(way, config, provider, exporter) as traced,
        aiohttp.ClientSession() as session,
        session.post(traced.url + "/v1/chat/completions", data=chunks()) as resp,
    ):
        answer = await resp.json()
        assert resp.status == 413 and answer["error"]["type"] == "PayloadTooLargeError"
        root = _by_name(traced.spans())["POST /v1/chat/completions"]
        assert (root.attributes or {})["error.type"] == "PayloadTooLargeError"
        assert _count(root, "http.response.status_code") == 413
        assert root.status.status_code is StatusCode.UNSET
        assert not backend.seen


async def test_a_retry_is_a_failed_upstream_span_then_another(
    way: str, provider: TracerProvider, exporter: InMemorySpanExporter, backend: Backend
) -> None:
    async with Backend(status=503) as failing:
        # round robin: the first request goes to the first worker, the failing one
        config = _config(
            (_worker("bad", failing), _worker("b0", backend)),
            policy=PolicyConfig(name="round_robin"),
        )
        async with _traced_router(way, config, provider, exporter) as traced:
            resp = await _post(traced.url, CHAT)
            spans = traced.spans()
    assert resp.status == 200 and resp.headers["x-kvroute-worker"] == "b0"
    upstream = sorted(
        (s for s in spans if s.name == "upstream"),
        key=lambda s: _count(s, "kvroute.attempt"),
    )
    assert [(s.attributes or {})["kvroute.worker"] for s in upstream] == ["bad", "b0"]
    assert upstream[0].status.status_code is StatusCode.ERROR
    assert upstream[0].status.description == "HTTP 503"
    # an HTTP status that failed the attempt, as OpenTelemetry names it (before: "HTTP 503")
    assert (upstream[0].attributes or {})["error.type"] == "503"
    assert _count(upstream[0], "http.response.status_code") == 503  # what the worker said
    assert _count(upstream[1], "http.response.status_code") == 200
    assert upstream[1].status.status_code is not StatusCode.ERROR
    # each worker was told its own attempt's span, in the one trace
    ids = [TRACEPARENT.match(b.seen[-1]["traceparent"]) for b in (failing, backend)]
    assert all(m is not None for m in ids)
    contexts = [s.context for s in upstream]
    assert [int(m.group(2), 16) for m in ids if m] == [c.span_id for c in contexts if c]


async def test_every_worker_failing_is_a_502_whose_spans_name_each_failures_class(
    way: str, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """QA: the request span of the router's 502 had no `http.response.status_code`, and each
    upstream span's `error.type` was the failure's free text (`connection dropped: the worker
    closed ...`, `HTTP 503`), a value per message where the conventions want a few classes.
    The text stays as the status description."""
    async with Backend(drop=True) as dropping, Backend(status=503) as failing:
        # round robin: the first request goes to the first worker (its 503 is no last try's,
        # not passed through), the retry to the one that drops the connection
        config = _config(
            (_worker("fail", failing), _worker("drop", dropping)),
            policy=PolicyConfig(name="round_robin"),
        )
        async with _traced_router(way, config, provider, exporter) as traced:
            resp = await _post(traced.url, CHAT)
            spans = traced.spans()
    assert resp.status == 502
    root = _by_name(tuple(s for s in spans if s.name != "upstream"))["POST /v1/chat/completions"]
    assert _count(root, "http.response.status_code") == 502
    assert root.status.status_code is StatusCode.ERROR
    assert (root.attributes or {})["error.type"] == "UpstreamError"
    upstream = sorted(
        (s for s in spans if s.name == "upstream"), key=lambda s: _count(s, "kvroute.attempt")
    )
    failed = {(s.attributes or {})["kvroute.worker"]: s for s in upstream}
    assert set(failed) == {"drop", "fail"}
    assert (failed["drop"].attributes or {})["error.type"] == "UpstreamDroppedError"
    assert "closed the connection" in str(failed["drop"].status.description)
    assert "http.response.status_code" not in (failed["drop"].attributes or {})
    assert (failed["fail"].attributes or {})["error.type"] == "503"
    assert _count(failed["fail"], "http.response.status_code") == 503
    assert all(s.status.status_code is StatusCode.ERROR for s in upstream)


async def test_a_workers_5xx_passed_through_names_its_status_as_the_error(
    way: str, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The last worker's 5xx is the client's answer: both spans say its status, in ERROR, with
    the status as `error.type` (the upstream span said `HTTP 500`, the request span none)."""
    async with Backend(status=500) as failing:
        config = _config((_worker("fail", failing),))
        async with _traced_router(way, config, provider, exporter) as traced:
            resp = await _post(traced.url, CHAT)
            spans = traced.spans()
    assert resp.status == 500
    named = _by_name(tuple(s for s in spans if s.name != "parse"))
    for name in ("POST /v1/chat/completions", "upstream"):
        span = named[name]
        assert _count(span, "http.response.status_code") == 500, name
        assert span.status.status_code is StatusCode.ERROR, name
        assert (span.attributes or {})["error.type"] == "500", name


def _raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
    """`error` as `raise error from cause` leaves it."""
    try:
        raise error from cause
    except BaseException as raised:
        return raised


def test_an_attempts_error_type_is_the_class_of_what_failed_it() -> None:
    """The router's carriers of a failed attempt name what they carry, through a pair's too:
    the error raised below them, else the worker's status; anything else is its own class."""
    dropped = _raised(AttemptFailed("connection dropped: ...", hard=True), UpstreamDroppedError())
    assert error_type(dropped) == "UpstreamDroppedError"
    status = _raised(AttemptFailed("HTTP 503", hard=False, status=503))
    assert error_type(status) == "503"
    # a pair's prefill blamed for its decode's failure
    assert error_type(_raised(PrefillFailed("no KV", hard=False, status=503), status)) == "503"
    assert error_type(_raised(PrefillFailed("no KV", hard=False), dropped)) == (
        "UpstreamDroppedError"
    )
    timed_out = _raised(PrefillFailed("no answer", hard=False, status=504), TimeoutError())
    assert error_type(timed_out) == "TimeoutError"
    assert error_type(PrefillFailed("no bootstrap port known", hard=False)) == "PrefillFailed"
    unreachable = _raised(BootstrapUnreachable("gone", port=1, status=502), status)
    assert error_type(unreachable) == "BootstrapUnreachable"
    handoff = HandoffFailed("it never took the KV", fault=HandoffFault.DECODE, status=500)
    assert error_type(_raised(handoff, PrefillFailed("x", hard=False))) == "HandoffFailed"


async def test_a_stream_its_worker_broke_off_ends_both_spans_in_error(
    way: str, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The client got the worker's 200 and a cut body: the request and upstream spans said
    200, status UNSET, no `error.type` (only a WARNING line told). They keep the 200 that was
    sent, and end in ERROR with the upstream error's class as `error.type`."""
    async with Backend(cut=True) as cutting:
        config = _config((_worker("b0", cutting),))
        async with _traced_router(way, config, provider, exporter) as t:
            async with (
                aiohttp.ClientSession() as session,
                session.post(t.url + "/v1/chat/completions", json=CHAT | {"stream": True}) as r,
            ):
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()

            async def ended() -> bool:
                return any(s.name == "POST /v1/chat/completions" for s in t.spans())

            await eventually(ended, what="the request span to end")
            named = _by_name(t.spans())
    for name in ("POST /v1/chat/completions", "upstream"):
        span = named[name]
        assert span.status.status_code is StatusCode.ERROR, name
        assert span.status.description == "UpstreamDroppedError", name
        assert (span.attributes or {})["error.type"] == "UpstreamDroppedError", name
        assert _count(span, "http.response.status_code") == 200, name  # what the client got
    assert "kvroute.cached_tokens" not in (named["upstream"].attributes or {})


async def test_dp_rank_and_matched_tokens_from_a_reference_worker(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    cfg = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=2)
    async with ReferenceWorker(cfg) as worker:
        config = router_config([("w0", worker.url)])
        async with RouterService(config, tracer_provider=provider) as router:
            body = {"input_ids": list(range(3, 200)), "cache_salt": SALT, "stream": False}

            async def matched() -> bool:
                exporter.clear()
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(router.url + "/generate", json=body) as resp,
                ):
                    assert resp.status == 200
                    return int(resp.headers["x-kvroute-matched-tokens"]) >= 160

            await eventually(matched, what="the prompt's prefix indexed on one rank")
    named = _by_name(exporter.get_finished_spans())
    assert "tokenize" not in named  # token ids need no tokenizer
    attrs = named["upstream"].attributes or {}
    assert attrs["kvroute.dp_rank"] in (0, 1)
    assert _count(named["upstream"], "kvroute.matched_tokens") >= 160
    _no_salt(exporter.get_finished_spans())


async def test_a_prefill_decode_pair_is_traced_with_the_prefill_side_decision(
    way: str, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    def role(name: Literal["prefill", "decode"]) -> ReferenceConfig:
        return ReferenceConfig(time_scale=0.0, page_size=16, role=name, kv_transfer_timeout_s=5.0)

    async with ReferenceWorker(role("prefill")) as p0, ReferenceWorker(role("decode")) as d0:
        config = router_config([("p0", p0.url), ("d0", d0.url)])  # roles from /server_info
        async with _traced_router(way, config, provider, exporter) as traced:
            body = {"input_ids": list(range(3, 100)), "cache_salt": SALT, "stream": False}

            async def answered() -> bool:
                traced.exporter.clear()
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(traced.url + "/generate", json=body) as resp,
                ):
                    await resp.read()
                    return resp.status == 200 and resp.headers["x-kvroute-prefill-worker"] == "p0"

            await eventually(answered, what="the pair discovered and answering")
            named = _by_name(traced.spans())
    assert set(named) == {"POST /generate", "parse", "route", "upstream"}
    root = named["POST /generate"].context
    assert root is not None
    assert _parent_id(named["route"]) == root.span_id == _parent_id(named["upstream"])
    for name in ("route", "upstream"):  # the decision is the prefill side's
        assert (named[name].attributes or {})["kvroute.worker"] == "p0", name
    assert (named["upstream"].attributes or {})["http.response.status_code"] == 200
    _no_salt(tuple(named.values()))


async def test_request_ids_are_made_when_missing_and_put_on_log_lines(
    traced: Traced,
    backend: Backend,
    log_request_ids: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="router.http.observe")
    resp = await _post(traced.url, CHAT)
    made = resp.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert backend.seen[-1]["x-request-id"] == made
    resp = await _post(traced.url, CHAT, {"x-request-id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    lines = [r for r in caplog.records if r.name == "router.http.observe"]
    ids = [getattr(r, "request_id", None) for r in lines]
    assert ids == [made, "abc-123"]
    assert "abc-123" in lines[-1].getMessage() and "b0" in lines[-1].getMessage()
    assert all(SALT not in r.getMessage() for r in caplog.records)


async def test_a_malformed_request_id_is_replaced_never_logged_and_a_well_formed_one_kept(
    traced: Traced,
    backend: Backend,
    log_request_ids: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client's id went verbatim into log lines (`[%(request_id)s]: message`): spaces and a
    bracket in it forged a line's level, logger and message of the client's choosing."""
    caplog.set_level(logging.DEBUG, logger="router.http.observe")
    forged = "fake] CRITICAL router.admin [-]: admin token is hunter2 "
    made: list[str] = []
    for given in (forged, "a" * 129, "caf\u00e9"):
        resp = await _post(traced.url, CHAT, {"x-request-id": given})
        assert resp.status == 200
        made.append(resp.headers["x-request-id"])
        assert re.fullmatch(r"[0-9a-f]{32}", made[-1]), given  # the router's, in its place
        assert backend.seen[-1]["x-request-id"] == made[-1]  # the worker's logs take it too
    # an id of the usual shapes passes through as sent, and is logged as sent
    kept = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"
    resp = await _post(traced.url, CHAT, {"x-request-id": kept})
    assert resp.headers["x-request-id"] == kept == backend.seen[-1]["x-request-id"]
    # a refusal echoes a well-formed id only
    refused = await _post(traced.url, {"messages": "not a list"}, {"x-request-id": forged})
    assert refused.status == 400 and "x-request-id" not in refused.headers
    lines = [r for r in caplog.records if r.name == "router.http.observe"]
    assert [getattr(r, "request_id", None) for r in lines] == [*made, kept]
    assert not [r for r in caplog.records if "hunter2" in f"{r.__dict__}"]


async def test_tracing_is_off_by_default(backend: Backend) -> None:
    config = _config((_worker("b0", backend),))
    assert config.tracing == TracingConfig()
    async with RouterService(config) as router:
        assert router.app.get(TRACING) is None
        resp = await _post(router.url, CHAT)
        assert resp.status == 200
        client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        await _post(router.url, CHAT, {"traceparent": client})
    first, second = backend.seen
    assert "traceparent" not in first  # nothing added
    assert second["traceparent"] == client  # a client's passes through untouched
    assert first["x-request-id"] == resp.headers["x-request-id"]  # ids work without tracing


async def test_the_config_file_turns_tracing_on(backend: Backend) -> None:
    tracing = TracingConfig(enabled=True, exporter="memory", service_name="edge-router")
    config = _config((_worker("b0", backend),), tracing=tracing)
    async with RouterService(config) as router:
        memory = router.app[TRACING].memory
        assert memory is not None
        await _post(router.url, CHAT)
        spans = memory.get_finished_spans()
    assert {s.name for s in spans} >= {"POST /v1/chat/completions", "upstream"}
    assert spans[0].resource.attributes["service.name"] == "edge-router"
    assert "traceparent" in backend.seen[-1]


async def test_recorded_spans_reach_a_batch_exporter_whole(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the console exporter behind the SDK's batch processor (its thread, its JSON encoding):
    # the recorder's spans go through the same processor the SDK's would. The exporter writes
    # to the stdout of when its module was imported (a default argument), so the test has it
    # write to a buffer instead
    written = io.StringIO()

    class Console(export.ConsoleSpanExporter):
        def __init__(self) -> None:
            super().__init__(out=written)

    monkeypatch.setattr(export, "ConsoleSpanExporter", Console)
    tracing = TracingConfig(enabled=True, exporter="console")
    config = _config((_worker("b0", backend),), tracing=tracing)
    async with RouterService(config) as router:
        assert router.app[TRACING].recorder is not None
        assert (await _post(router.url, CHAT)).status == 200
    out = written.getvalue()  # the router's exit flushed the batch
    decoder, spans, at = json.JSONDecoder(), [], 0
    while out[at:].strip():
        span, at = decoder.raw_decode(out, at + len(out[at:]) - len(out[at:].lstrip()))
        spans.append(span)
    by_name = {span["name"]: span for span in spans}
    assert set(by_name) == {"POST /v1/chat/completions", "parse", "tokenize", "route", "upstream"}
    root = by_name["POST /v1/chat/completions"]
    assert root["parent_id"] is None and root["kind"] == "SpanKind.SERVER"
    assert root["resource"]["attributes"]["service.name"] == "kvroute"
    assert root["attributes"]["kvroute.worker"] == "b0"
    assert by_name["upstream"]["parent_id"] == root["context"]["span_id"]
    assert by_name["tokenize"]["parent_id"] == by_name["parse"]["context"]["span_id"]
    found = TRACEPARENT.match(backend.seen[-1]["traceparent"])
    assert found is not None
    assert {span["context"]["trace_id"] for span in spans} == {"0x" + found.group(1)}
    assert by_name["upstream"]["context"]["span_id"] == "0x" + found.group(2)


async def _memory_spans_of_one_request(config: RouterConfig) -> Sequence[ReadableSpan]:
    """What a router of `config` with the in-memory exporter the environment asks for
    (OTEL_TRACES_EXPORTER=memory) recorded of one chat request."""
    async with RouterService(config) as router:
        memory = router.app[TRACING].memory
        assert memory is not None
        await _post(router.url, CHAT)
        return memory.get_finished_spans()


async def test_otel_variables_turn_tracing_on_and_off(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config((_worker("b0", backend),))
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "memory")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    spans = await _memory_spans_of_one_request(config)
    assert spans and spans[0].resource.attributes["service.name"] == "from-env"

    # the other variable the SDK reads a service name from
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=edge, service.name=from-attributes")
    spans = await _memory_spans_of_one_request(config)
    attributes = spans[0].resource.attributes
    assert (attributes["service.name"], attributes["team"]) == ("from-attributes", "edge")

    # OTEL_SDK_DISABLED wins over the file and the exporter variable
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    on = _config((_worker("b0", backend),), tracing=TracingConfig(enabled=True))
    async with RouterService(on) as router:
        assert router.app.get(TRACING) is None
        await _post(router.url, CHAT)
    assert "traceparent" not in backend.seen[-1]

    # a sampler from the environment: none of the new traces recorded, and the worker is told
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert await _memory_spans_of_one_request(config) == ()
    assert not int(backend.seen[-1]["traceparent"][-2:], 16) & 1  # the sampled flag is off


async def test_observe_off_records_nothing_and_traces_nothing(
    backend: Backend, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    # the benchmarks' baseline: the proxy without the operations layer
    config = _config((_worker("b0", backend),), observe=ObserveConfig(enabled=False))
    async with RouterService(config, tracer_provider=provider) as router:
        assert router.app.get(TRACING) is None  # tracing is part of the layer
        resp = await _post(router.url, CHAT)
        assert resp.status == 200 and resp.headers["x-kvroute-worker"] == "b0"
        assert not router.app[DECISIONS].recent
    assert "x-request-id" not in resp.headers
    assert "x-request-id" not in backend.seen[-1] and "traceparent" not in backend.seen[-1]
    assert exporter.get_finished_spans() == ()


async def test_a_new_trace_the_ratio_drops_makes_no_span_yet_tells_the_worker(
    backend: Backend,
) -> None:
    tracing = TracingConfig(enabled=True, exporter="memory", sample_ratio=0.0)
    config = _config((_worker("b0", backend),), tracing=tracing)
    async with RouterService(config) as router:
        assert router.app[TRACING].decides_sampling
        memory = router.app[TRACING].memory
        assert memory is not None
        for _ in range(3):
            assert (await _post(router.url, CHAT)).status == 200
        assert memory.get_finished_spans() == ()
        sent = [seen["traceparent"] for seen in backend.seen]
        found = [TRACEPARENT.match(header) for header in sent]
        assert all(f is not None for f in found), sent
        assert len({f.group(1) for f in found if f is not None}) == 3  # a trace each
        assert all(header.endswith("-02") for header in sent)  # not sampled, the id random

        # a client's unsampled trace is continued unrecorded, with the one flag the SDK keeps
        for flags, sent_on in (("00", "-00"), ("02", "-02"), ("0e", "-02")):
            header = f"00-{'7' * 32}-00f067aa0ba902b7-{flags}"
            assert (await _post(router.url, CHAT, {"traceparent": header})).status == 200
            forwarded = backend.seen[-1]["traceparent"]
            assert forwarded.startswith(f"00-{'7' * 32}-") and forwarded.endswith(sent_on), flags
            assert "00f067aa0ba902b7" not in forwarded  # a span id of its own
        assert memory.get_finished_spans() == ()

        # a client's sampled trace is recorded whatever the ratio, and continued
        client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        client = f"00-{client_trace}-00f067aa0ba902b7-01"
        assert (await _post(router.url, CHAT, {"traceparent": client})).status == 200
        spans = memory.get_finished_spans()
        assert {s.name for s in spans} >= {"POST /v1/chat/completions", "upstream"}
        continued = TRACEPARENT.match(backend.seen[-1]["traceparent"])
        assert continued is not None and continued.group(1) == client_trace

        # baggage alone, or a malformed traceparent, starts a new trace: the ratio drops it
        memory.clear()
        for headers in ({"baggage": "tenant=a"}, {"traceparent": "00-bogus-01"}):
            assert (await _post(router.url, CHAT, headers)).status == 200
            fresh = TRACEPARENT.match(backend.seen[-1]["traceparent"])
            assert fresh is not None and fresh.group(1) != client_trace
            assert not int(backend.seen[-1]["traceparent"][-2:], 16) & 1
        assert memory.get_finished_spans() == ()


def _kept(tracing: Tracing, draws: int) -> int:
    kept = 0
    for _ in range(draws):
        decision = tracing.decide({})
        assert decision is not None and decision.trace_id != 0 and decision.parent_span_id == 0
        kept += decision.kept
    return kept


def test_the_ratio_keeps_its_share_of_new_traces(provider: TracerProvider) -> None:
    assert _kept(Tracing(provider, owned=False, root_ratio=0.0), 2000) == 0
    assert _kept(Tracing(provider, owned=False, root_ratio=1.0), 2000) == 2000
    # 4,000 draws at 25%: 1,000 expected, 27 the standard deviation
    assert 800 <= _kept(Tracing(provider, owned=False, root_ratio=0.25), 4000) <= 1200
    # a valid client trace is continued and its flag followed, whatever the ratio
    dropping = Tracing(provider, owned=False, root_ratio=0.0)
    for flags, kept in (("01", True), ("00", False), ("03", True)):
        header = "00-" + "1" * 32 + "-" + "2" * 16 + "-" + flags
        assert dropping.decide({"traceparent": header}) == TraceDecision(
            int("1" * 32, 16), int("2" * 16, 16), kept, flags
        )
    # baggage alone, or a malformed traceparent, is a new trace: the ratio decides (drops it)
    for headers in (
        {"baggage": "tenant=a"},
        {"traceparent": "00-" + "0" * 32 + "-" + "2" * 16 + "-01"},  # the invalid trace id
        {"traceparent": "00-" + "1" * 32 + "-" + "0" * 16 + "-01"},  # the invalid span id
        {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01-extra"},  # more, in v00
        {"traceparent": "ff-" + "1" * 32 + "-" + "2" * 16 + "-01"},  # the invalid version
        {"traceparent": "00-" + "A" * 32 + "-" + "2" * 16 + "-01"},  # upper case
        {"traceparent": "garbage"},
    ):
        decision = dropping.decide(headers)
        assert decision is not None and decision.parent_span_id == 0, headers
        assert not decision.kept and decision.flags == "02", headers
    # a later version may add fields; surrounding blanks are allowed (as the SDK reads it)
    later = parse_traceparent(" 01-" + "1" * 32 + "-" + "2" * 16 + "-01-more")
    assert later is not None and later.kept
    # a provider handed in keeps its own sampler for everything
    assert not Tracing(provider, owned=False).decides_sampling


class _B3Like(TextMapPropagator):
    """A propagator whose headers kvroute cannot write (B3's, say)."""

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        return context if context is not None else Context()

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        carrier["x-b3-traceid"] = "0" * 32

    @property
    def fields(self) -> set[str]:
        return {"x-b3-traceid"}


def test_other_propagators_leave_every_decision_to_the_sdk() -> None:
    assert w3c_propagation({"traceparent", "tracestate", "baggage"})
    assert w3c_propagation({"traceparent", "tracestate"})
    assert not w3c_propagation({"baggage"})
    assert not w3c_propagation({"traceparent", "tracestate", "x-b3-traceid"})
    before = get_global_textmap()
    set_global_textmap(_B3Like())
    try:
        tracing = build_tracing(TracingConfig(enabled=True, exporter="memory", sample_ratio=0.0))
        assert tracing is not None and not tracing.decides_sampling
        assert tracing.decide({}) is None
        span = tracing.tracer.start_span("root")  # the SDK's ratio sampler drops it
        assert not span.is_recording()
        tracing.shutdown()
    finally:
        set_global_textmap(before)


def test_a_request_s_trace_is_started_as_decide_says(provider: TracerProvider) -> None:
    """`Tracing.start`, the request path's way: a dropped new trace is only the header the
    worker gets; a kept one a decision to record; the ratio's share holds."""
    dropping = Tracing(provider, owned=False, root_ratio=0.0)
    headers = {dropping.start({}) for _ in range(50)}
    assert len(headers) == 50  # a trace id and a parent span id of its own each
    for header in headers:
        assert isinstance(header, str)
        found = TRACEPARENT.match(header)
        assert found is not None and header.startswith("00-") and header.endswith("-02")
        assert int(found.group(1), 16) and int(found.group(2), 16)
    keeping = Tracing(provider, owned=False, root_ratio=1.0)
    kept = keeping.start({})
    assert isinstance(kept, TraceDecision) and kept.kept and kept.parent_span_id == 0
    quarter = Tracing(provider, owned=False, root_ratio=0.25)
    share = sum(isinstance(quarter.start({}), TraceDecision) for _ in range(4000))
    assert 800 <= share <= 1200  # 1,000 expected, 27 the standard deviation
    # a client's trace: continued, its flag followed
    client = "00-" + "1" * 32 + "-" + "2" * 16 + "-00"
    unsampled = dropping.start({"traceparent": client})
    assert isinstance(unsampled, str) and unsampled.startswith("00-" + "1" * 32 + "-")
    assert unsampled.endswith("-00") and "2" * 16 not in unsampled  # a new parent span id
    sampled = dropping.start({"traceparent": client[:-2] + "01"})
    assert isinstance(sampled, TraceDecision) and sampled.kept
    # the SDK decides with a provider handed in
    assert Tracing(provider, owned=False).start({}) is None


def _comparable(span: ReadableSpan) -> dict[str, Any]:
    """A span's JSON export without what differs between two runs of one request: ids,
    times, the resource (the SDK's provider here is the test's own) and the time to first
    byte."""
    exported = json.loads(span.to_json())
    for key in ("parent_id", "start_time", "end_time", "resource"):
        exported.pop(key)
    exported["context"].pop("trace_id")
    exported["context"].pop("span_id")
    # what the JSON leaves out of the contexts
    assert span.context is not None
    exported["context"]["trace_flags"] = int(span.context.trace_flags)
    exported["context"]["is_remote"] = span.context.is_remote
    parent = span.parent
    exported["parent"] = None if parent is None else (int(parent.trace_flags), parent.is_remote)
    exported["attributes"].pop("kvroute.ttft_s", None)
    for event in exported["events"]:
        event.pop("timestamp")
        event["attributes"].pop("exception.stacktrace", None)
    return dict(exported)


@pytest.mark.parametrize(
    "headers, body",
    [
        ({"x-request-id": "same"}, CHAT),
        ({"x-request-id": "same", "traceparent": f"00-{'5' * 32}-{'6' * 16}-01"}, CHAT),
        ({"x-request-id": "same", "traceparent": f"00-{'5' * 32}-{'6' * 16}-03"}, CHAT),
        ({"x-request-id": "same"}, {**CHAT, "stream": True}),
        ({"x-request-id": "same"}, {"messages": "not a list"}),
    ],
    ids=["new trace", "client trace", "client trace, random id", "stream", "bad request"],
)
async def test_recorded_spans_export_as_the_sdk_s_own(
    headers: dict[str, str],
    body: object,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    backend: Backend,
) -> None:
    # the same request, traced by the SDK and by kvroute's recorder: every exported field but
    # the ids and times is the same (names, kinds, attributes, status, events, flags, scope)
    exports: dict[str, dict[str, dict[str, Any]]] = {}
    for way in ("sdk", "recorder"):
        config = _config((_worker("b0", backend),))
        async with _traced_router(way, config, provider, exporter) as traced:
            await _post(traced.url, body, headers)
            exports[way] = {s.name: _comparable(s) for s in traced.spans()}
    assert exports["sdk"] and exports["sdk"] == exports["recorder"]


_HEX = "0123456789abcdef"


def _field(size: int) -> st.SearchStrategy[str]:
    """A nonzero field of `size` hex digits (a text of hex digits would mostly be all zeros:
    hypothesis favours the simplest strings)."""
    return st.integers(1, 16**size - 1).map(lambda n: f"{n:0{size}x}")


def _bad_field(size: int) -> st.SearchStrategy[str]:
    """A field W3C refuses, or that is fine in some places only: all zeros, upper case, a
    wrong length, a stray character."""
    return st.one_of(
        st.just("0" * size),
        st.text(_HEX + "ABCDEF", min_size=size, max_size=size),
        st.text(_HEX + "-xX ", min_size=size - 1, max_size=size + 1),
    )


_BLANK = st.sampled_from(["", " ", "\t"])
_WELL_FORMED = st.builds(
    lambda lead, trace, span, flags, trail: f"{lead}00-{trace}-{span}-{flags}{trail}",
    _BLANK,
    _field(32),
    _field(16),
    st.one_of(_field(2), st.just("00")),
    _BLANK,
)
_ODD = st.builds(
    lambda lead, version, trace, span, flags, rest, trail: (
        f"{lead}{version}-{trace}-{span}-{flags}{rest}{trail}"
    ),
    _BLANK,
    st.one_of(st.just("00"), st.just("ff"), _field(2), _bad_field(2)),
    st.one_of(_field(32), _bad_field(32)),
    st.one_of(_field(16), _bad_field(16)),
    st.one_of(_field(2), _bad_field(2)),
    st.sampled_from(["", "-", "-extra", "-00-more"]),
    _BLANK,
)
# one_of picks its branches alike: well-formed headers about half the time
_TRACEPARENTS = st.one_of(_WELL_FORMED, _ODD, st.text(max_size=80))


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(header=_TRACEPARENTS)
def test_traceparent_is_read_as_the_sdk_s_propagator_reads_it(header: str) -> None:
    # kvroute reads a client's traceparent itself on the request path (`parse_traceparent`):
    # whatever the header, it must continue exactly the traces the SDK's W3C propagator
    # would, with the same ids and flags, and start afresh where the SDK would
    extracted = TraceContextTextMapPropagator().extract({"traceparent": header})
    sdk = get_current_span(extracted).get_span_context()
    ours = parse_traceparent(header)
    if not sdk.is_valid:
        assert ours is None, header
        return
    assert ours is not None, header
    assert (ours.trace_id, ours.parent_span_id) == (sdk.trace_id, sdk.span_id), header
    assert int(ours.flags, 16) == sdk.trace_flags and ours.kept is sdk.trace_flags.sampled
