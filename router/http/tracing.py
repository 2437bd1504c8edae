"""OpenTelemetry tracing of proxied requests (optional: `pip install 'kvroute[otel]'`).

Off by default. On when `[tracing] enabled = true`, or when `OTEL_TRACES_EXPORTER` names an
exporter; `OTEL_SDK_DISABLED=true` turns it off whatever the file says. What the file leaves
empty comes from the standard variables: the exporter (`OTEL_TRACES_EXPORTER`: otlp, console),
the service name (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), the sampler
(`OTEL_TRACES_SAMPLER` / `_ARG`, else the file's `sample_ratio` under a parent-based sampler),
the OTLP endpoint (`OTEL_EXPORTER_OTLP_*`, read by the exporter itself) and the propagators
(`OTEL_PROPAGATORS`, W3C `traceparent` by default).

A trace kvroute does not record costs no OpenTelemetry object: when kvroute made the sampler (no
`OTEL_TRACES_SAMPLER`) and the propagators are W3C's (the default), kvroute decides as the SDK's
`ParentBased(TraceIdRatioBased)` would (`Tracing.decide`; `Tracing.start` on the request path, which
writes a dropped new trace's header straight from one random draw): a valid client `traceparent` is
followed, and a new trace's random id is kept when its low 64 bits fall below ratio x 2^64. A trace
not kept sends the worker a `traceparent` with the sampled flag off. A kept one is recorded by
kvroute too (`router.http.span_recorder.SpanRecorder`): the SDK's own `ReadableSpan` objects, filled
as the request goes and handed to the exporters kvroute made when it ends. The SDK's sampler and
spans serve every request when the sampler, the propagators or the provider are not kvroute's. (The
SDK's span machinery costs a dropped request about 80 Python calls, and a kept one about 27 us a
span.)

One span per request (SERVER, continuing the client's `traceparent`), children `parse` (with
`tokenize` inside it: tokenizing is part of reading the request), `route` and one `upstream`
(CLIENT) per attempt, whose context goes to the worker as its `traceparent`. The attribute
names are listed in docs/operations.md. Spans are started with an explicit parent and never
made "current", so nothing leaks between the requests sharing the event loop.

Nothing here is imported unless tracing is on: `opentelemetry` stays optional.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from random import getrandbits
from typing import TYPE_CHECKING, Any, NamedTuple

from router.config import TracingConfig
from router.errors import ConfigError
from router.http.spans import RANDOM_TRACE_ID, SdkSpans, SpanMaker
from router.prompt.tokenizer import PromptTokenizer

if TYPE_CHECKING:
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Status, Tracer, TracerProvider

    from router.http.span_recorder import SpanRecorder
    from router.prompt.conventions import ChatOptions

__all__ = ["TracedTokenizer", "Tracing", "build_tracing", "tracing_wanted", "w3c_propagation"]

log = logging.getLogger(__name__)

# the span maker and the `parse` span's handle of the request being parsed, for the tokenizer
# (called deep inside the parser) to hang its span under; set by the `parse` phase in the
# handler's own task
PARSE_CONTEXT: contextvars.ContextVar[tuple[SpanMaker, Any] | None] = contextvars.ContextVar(
    "kvroute_parse_context", default=None
)
# the in-memory exporter keeps the newest this many spans (it is for tests and benchmarks)
_MEMORY_SPANS = 10_000
# the headers of the W3C propagators (trace context and baggage, OTEL_PROPAGATORS' default):
# with only those, kvroute can write a dropped trace's header itself
_W3C_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})
_LOW_64 = (1 << 64) - 1
# the trace flags of a dropped root: not sampled, the trace id random (W3C trace context
# level 2; the SDK sets the same bit)
_DROPPED_FLAGS = "02"
# a W3C traceparent: version, trace id, parent span id, flags, and what a later version may add
_TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
_TRACEPARENT_MAX = 512  # longer headers are ignored (as the SDK does)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def _env_names_service() -> bool:
    """Whether `$OTEL_RESOURCE_ATTRIBUTES` (key=value pairs, comma-separated) names a
    `service.name`, which the SDK then reads itself."""
    pairs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(pair.partition("=")[0].strip() == "service.name" for pair in pairs)


def _env_exporter() -> str:
    return os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()


def tracing_wanted(config: TracingConfig) -> bool:
    """Whether the config file and the OTEL_* variables turn tracing on."""
    if _env_true("OTEL_SDK_DISABLED"):
        return False
    if config.enabled:
        return True
    exporter = _env_exporter()
    return bool(exporter) and exporter != "none"


class Tracing:
    """The tracer, the propagator, and the provider when kvroute made it (shut down on exit)."""

    def __init__(
        self,
        provider: TracerProvider,
        *,
        owned: bool,
        memory: InMemorySpanExporter | None = None,
        root_ratio: float | None = None,
        recorder: SpanRecorder | None = None,
    ) -> None:
        from opentelemetry import trace
        from opentelemetry.propagate import get_global_textmap

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("kvroute")
        self.propagator: TextMapPropagator = get_global_textmap()
        self.memory = memory  # the in-memory exporter, when that is the one configured
        self._owned = owned
        # what a request's spans need of the API, looked up once: `from opentelemetry import
        # trace` in the request path costs microseconds per call (a namespace package)
        self.server_kind = trace.SpanKind.SERVER
        self.client_kind = trace.SpanKind.CLIENT
        self.spans = SdkSpans(
            self.tracer, self.propagator, trace.set_span_in_context, trace.SpanKind.INTERNAL
        )
        # the kept traces' spans, when kvroute made the provider and its processors
        self.recorder = recorder
        self._status = trace.Status
        self._error = trace.StatusCode.ERROR
        # traces are decided here (`decide`), new ones at `root_ratio`, given only when
        # kvroute made the sampler to record every root it is handed and the propagators are
        # W3C's (`build_tracing`); None: the SDK decides every span
        self._root_bound = None if root_ratio is None else round(root_ratio * (_LOW_64 + 1))

    @property
    def decides_sampling(self) -> bool:
        """Whether kvroute makes every request's sampling decision itself (`decide`)."""
        return self._root_bound is not None

    def decide(self, headers: Mapping[str, str]) -> TraceDecision | None:
        """kvroute's sampling decision for a request with these `headers`, or None when the
        SDK decides (`decides_sampling` is false). A valid W3C `traceparent` is continued and its
        sampled flag followed (what the SDK's `ParentBased` sampler does); without one (absent
        or malformed: W3C says start afresh) the request starts a new trace, kept at the
        ratio. The client's `tracestate` and `baggage` reach the worker untouched either way
        (the proxy forwards them)."""
        bound = self._root_bound
        if bound is None:
            return None
        parent = parse_traceparent(headers.get("traceparent"))
        if parent is not None:
            return parent
        trace_id = getrandbits(128) or 1
        return TraceDecision(trace_id, 0, trace_id & _LOW_64 < bound, _DROPPED_FLAGS)

    def start(self, headers: Mapping[str, str]) -> TraceDecision | str | None:
        """`decide`, as a request starts: a trace to record (the `TraceDecision`), the
        `traceparent` to send the worker for one not recorded (a str), or None when the SDK
        decides. A request without a `traceparent` (most, where clients do not trace) is
        decided from one random draw, the header of a dropped one written straight from it:
        on the router's path a dropped trace costs a draw and a format, nothing more."""
        bound = self._root_bound
        if bound is None:
            return None
        if "traceparent" in headers:
            decision = self.decide(headers)
            assert decision is not None  # kvroute decides (bound)
            return decision if decision.kept else self.unsampled_traceparent(decision)
        drawn = getrandbits(192)  # the trace id (128 bits), then the worker's parent span id
        trace_id = drawn >> 64
        if trace_id & _LOW_64 >= bound and trace_id and drawn & _LOW_64:
            ids = drawn.to_bytes(24, "big").hex()  # a third faster than format(drawn, "048x")
            return "00-" + ids[:32] + "-" + ids[32:] + "-" + _DROPPED_FLAGS
        # kept, or a zero id drawn (once in 2^64): as `decide` does
        trace_id = trace_id or 1
        decision = TraceDecision(trace_id, 0, trace_id & _LOW_64 < bound, _DROPPED_FLAGS)
        return decision if decision.kept else self.unsampled_traceparent(decision)

    @staticmethod
    def unsampled_traceparent(decision: TraceDecision) -> str:
        """The `traceparent` to send the worker for a trace not recorded: its trace id, a new
        span id, the flags (not sampled), so the worker does not record what this dropped.
        Of the client's flags only the random-trace-id bit is kept, as the SDK keeps it."""
        flags = "02" if int(decision.flags, 16) & RANDOM_TRACE_ID else "00"
        return f"00-{decision.trace_id:032x}-{getrandbits(64) or 1:016x}-{flags}"

    def error(self, description: str) -> Status:
        """An ERROR status saying `description`."""
        return self._status(self._error, description)

    def shutdown(self) -> None:
        """Flush and stop the provider kvroute made (one handed in belongs to its owner)."""
        if self._owned:
            shutdown = getattr(self.provider, "shutdown", None)
            if shutdown is not None:
                shutdown()


def build_tracing(config: TracingConfig, provider: TracerProvider | None = None) -> Tracing | None:
    """The tracing of `config`, None when off. A `provider` (tests: the SDK's in-memory
    exporter) is used as given, whatever the config says."""
    if provider is not None:
        return Tracing(provider, owned=False)
    if not tracing_wanted(config):
        return None
    try:
        from opentelemetry.propagate import get_global_textmap
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider as SdkProvider
        from opentelemetry.sdk.trace import sampling
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from router.http.span_recorder import SpanRecorder
    except ImportError as exc:
        raise ConfigError(
            "tracing is on but OpenTelemetry is not installed: pip install 'kvroute[otel]' "
            f"({exc.name} missing)"
        ) from None
    exporter_name = config.exporter or _env_exporter() or "otlp"
    attributes: dict[str, Any] = {}
    if config.service_name:
        attributes["service.name"] = config.service_name
    elif not os.environ.get("OTEL_SERVICE_NAME") and not _env_names_service():
        attributes["service.name"] = "kvroute"  # given here, it would override the variables
    resource = Resource.create(attributes)  # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES too
    sampler = None  # the SDK reads OTEL_TRACES_SAMPLER
    root_ratio = None
    if not os.environ.get("OTEL_TRACES_SAMPLER"):
        sampler = sampling.ParentBased(sampling.TraceIdRatioBased(config.sample_ratio))
        if w3c_propagation(get_global_textmap().fields):
            # kvroute decides on every trace itself (`Tracing.decide`) and records the kept
            # ones (`SpanRecorder`): a root reaching the SDK without a parent is one to record
            root_ratio = config.sample_ratio
            sampler = sampling.ParentBased(sampling.ALWAYS_ON)
    provider_sdk = SdkProvider(resource=resource, sampler=sampler)
    memory = None
    exporter: SpanExporter
    processors: list[SpanProcessor] = []
    # where the recorder's spans go: each processor's `on_end`, or for the in-memory exporter
    # its `export`: the SDK's simple processor around it would add two context switches a span
    # (to keep an exporter's own calls out of traces, which a list append does not make)
    deliveries: list[Callable[[Sequence[ReadableSpan]], object]] = []
    if exporter_name == "memory":
        # the newest spans only: a benchmark's long run stays bounded
        try:
            memory = exporter = InMemorySpanExporter(max_spans=_MEMORY_SPANS)
        except TypeError:  # an SDK older than max_spans (2026): every span is kept
            log.warning("this OpenTelemetry SDK keeps every span in memory: for tests only")
            memory = exporter = InMemorySpanExporter()
        # synchronous: the in-memory export is a list append, a thread would only add switches
        processors.append(SimpleSpanProcessor(exporter))
        deliveries.append(exporter.export)
    elif exporter_name == "console":
        processors.append(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(
                "tracing.exporter = 'otlp' needs pip install opentelemetry-exporter-otlp-proto-http"
            ) from None
        processors.append(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter_name != "none":
        raise ConfigError(
            f"tracing.exporter (or OTEL_TRACES_EXPORTER) = {exporter_name!r}: "
            "use otlp, console, memory or none"
        )
    for processor in processors:
        provider_sdk.add_span_processor(processor)
        if not isinstance(processor, SimpleSpanProcessor):
            deliveries.append(_ends_each(processor))
    # the traces kvroute keeps are recorded without the SDK's spans, to the same exporters
    # (`router.http.spans`)
    recorder = SpanRecorder(resource, deliveries) if root_ratio is not None else None
    log.info("tracing on: exporter %s", exporter_name)
    return Tracing(
        provider_sdk, owned=True, memory=memory, root_ratio=root_ratio, recorder=recorder
    )


def _ends_each(processor: SpanProcessor) -> Callable[[Sequence[ReadableSpan]], object]:
    def end_each(spans: Sequence[ReadableSpan]) -> None:
        for span in spans:
            processor.on_end(span)

    return end_each


class TraceDecision(NamedTuple):
    """A request's trace as kvroute decided it (`Tracing.decide`)."""

    trace_id: int
    parent_span_id: int  # the client's span; 0: a new trace
    kept: bool  # recorded
    # the client's trace flags (two hex digits; a new trace's: "02", its id random): the kept
    # trace's spans and the header of a dropped one carry their random-trace-id bit
    flags: str


def parse_traceparent(header: str | None) -> TraceDecision | None:
    """The trace a W3C `traceparent` header names (kept: its sampled flag), None when there is
    none or it is invalid, by the rules of the SDK's `TraceContextTextMapPropagator`."""
    if not header or len(header) > _TRACEPARENT_MAX:
        return None
    found = _TRACEPARENT.match(header)
    if found is None:
        return None
    version, trace_hex, span_hex, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    sampled = bool(int(flags, 16) & 1)
    return TraceDecision(trace_id, span_id, sampled, flags)


def w3c_propagation(fields: Iterable[str]) -> bool:
    """Whether propagators with these header `fields` are W3C's (trace context, and baggage
    or not): kvroute can then write a dropped trace's header itself."""
    chosen = set(fields)
    return "traceparent" in chosen and chosen <= _W3C_FIELDS


class TracedTokenizer(PromptTokenizer):
    """A tokenizer whose calls are `tokenize` spans under the request being parsed."""

    def __init__(self, inner: PromptTokenizer) -> None:
        super().__init__(inner._encoder, inner.name, inner.template, inner.offload)
        self._inner = inner

    def text(self, text: str) -> list[int]:
        """`PromptTokenizer.text`, traced."""
        parsing = PARSE_CONTEXT.get()
        if parsing is None:
            return self._inner.text(text)
        spans, parent = parsing
        span = spans.start("tokenize", parent)
        try:
            tokens = self._inner.text(text)
            span.set_attribute("kvroute.prompt_tokens", len(tokens))
            return tokens
        finally:
            span.end()

    def chat(self, messages: Sequence[object], options: ChatOptions | None = None) -> list[int]:
        """`PromptTokenizer.chat`, traced."""
        parsing = PARSE_CONTEXT.get()
        if parsing is None:
            return self._inner.chat(messages, options)
        spans, parent = parsing
        span = spans.start("tokenize", parent)
        try:
            tokens = self._inner.chat(messages, options)
            span.set_attribute("kvroute.prompt_tokens", len(tokens))
            span.set_attribute("kvroute.chat", True)
            return tokens
        finally:
            span.end()
