"""The two ways a request's spans are made: by the OpenTelemetry SDK, or recorded by kvroute.

When kvroute made the provider, its sampler and its processors, and the propagators are W3C's
(`Tracing.decides_sampling`), kvroute decides on each request's trace itself (`Tracing.decide`), and
the traces it keeps are recorded by `SpanRecorder`: the SDK would sample every one of their
spans in (the parent is sampled), and its span machinery costs about 27 us a span (a lock, a
bounded attribute dict, two context copies), against about 4 us for a plain object that becomes
the SDK's own `ReadableSpan` when it ends and goes to the same exporters (the same export
format). Otherwise (a sampler or propagators of the OTEL_* variables, a `TracerProvider` handed
in) every request gets the SDK's spans (`SdkSpans`): its sampler, limits and processors decide.

A span's handle as a parent (`context_of`) is an OpenTelemetry `Context` on the SDK's way and the
`RecordedSpan` itself on the recorder's; the proxy only passes it back to the same maker.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from random import getrandbits
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import Span, SpanContext, SpanKind, Status, Tracer

__all__ = ["RecordedSpan", "SdkSpans", "SpanMaker", "SpanRecorder", "TraceSpan"]


class TraceSpan(Protocol):
    """What the proxy does with a span (an SDK span or a `RecordedSpan`)."""

    def set_attribute(self, key: str, value: Any) -> None: ...

    def set_attributes(self, attributes: Mapping[str, Any]) -> None: ...

    def set_status(self, status: Status) -> None: ...

    def record_exception(self, exception: BaseException) -> None: ...

    def is_recording(self) -> bool: ...

    def end(self) -> None: ...


class SpanMaker(Protocol):
    """Starts a request's spans and writes the worker's trace headers."""

    def start(
        self,
        name: str,
        parent: Any,
        kind: SpanKind | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> TraceSpan: ...

    def context_of(self, span: TraceSpan) -> Any: ...

    def inject(self, carrier: MutableMapping[str, str], parent: Any) -> None: ...


class SdkSpans:
    """Spans made by the SDK's tracer; a parent is an OpenTelemetry `Context`."""

    def __init__(
        self,
        tracer: Tracer,
        propagator: TextMapPropagator,
        in_context: Callable[[Span], Context],
        internal: SpanKind,
    ) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self._in_context = in_context
        self._internal = internal

    def start(
        self,
        name: str,
        parent: Any,
        kind: SpanKind | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> TraceSpan:
        """A span under `parent` (a `Context`; the client's extracted one for the root)."""
        return self._tracer.start_span(
            name, context=parent, kind=kind or self._internal, attributes=attributes
        )

    def context_of(self, span: TraceSpan) -> Any:
        """The `Context` whose current span is `span`."""
        return self._in_context(span)  # type: ignore[arg-type]

    def inject(self, carrier: MutableMapping[str, str], parent: Any) -> None:
        """The configured propagators' headers for `parent`."""
        self._propagator.inject(carrier, context=parent)


class SpanRecorder:
    """Records the spans of the traces kvroute keeps, and hands them, as the SDK's
    `ReadableSpan`s, to every one of `deliver`: the spans of a request together when its root
    span ends (a child ending later goes alone). The deliveries are the `on_end` of the span
    processors kvroute added to its provider, or an exporter's `export` where kvroute would
    otherwise add the SDK's `SimpleSpanProcessor` for it (`build_tracing`)."""

    def __init__(
        self, resource: Resource, deliver: Sequence[Callable[[Sequence[ReadableSpan]], object]]
    ) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self._resource = resource
        self._deliver = tuple(deliver)
        # what the SDK's tracer for "kvroute" would stamp on its spans
        self._scope = InstrumentationScope("kvroute")
        self._readable = ReadableSpan
        self._event = Event
        self._context = SpanContext
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._internal = SpanKind.INTERNAL
        self._unset = Status(StatusCode.UNSET)
        self._ok = StatusCode.OK

    def root(
        self,
        trace_id: int,
        parent_span_id: int,
        name: str,
        kind: SpanKind,
        attributes: Mapping[str, Any],
    ) -> RecordedSpan:
        """The first span this process records of the trace `trace_id` (nonzero), under the
        client's span `parent_span_id` (0: a new trace)."""
        parent = (
            self._context(trace_id, parent_span_id, True, self._sampled) if parent_span_id else None
        )
        return RecordedSpan(self, name, trace_id, parent, None, kind, dict(attributes))

    def start(
        self,
        name: str,
        parent: Any,
        kind: SpanKind | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> TraceSpan:
        """A child of `parent` (a `RecordedSpan`)."""
        assert isinstance(parent, RecordedSpan)
        return RecordedSpan(
            self,
            name,
            parent.trace_id,
            parent.context,
            parent.root or parent,
            kind or self._internal,
            dict(attributes) if attributes else {},
        )

    def context_of(self, span: TraceSpan) -> Any:
        """A recorded span is its own handle as a parent."""
        return span

    def inject(self, carrier: MutableMapping[str, str], parent: Any) -> None:
        """The W3C `traceparent` naming `parent`; a client's `tracestate` and `baggage` reach
        the worker as it sent them (the proxy forwards its headers)."""
        assert isinstance(parent, RecordedSpan)
        carrier["traceparent"] = f"00-{parent.trace_id:032x}-{parent.span_id:016x}-01"

    def ended(self, span: RecordedSpan, end_time: int) -> None:
        """`span` ended at `end_time`: hand it on (with its request's, for a root)."""
        readable = self._readable(
            span.name,
            context=span.context,
            parent=span.parent,
            resource=self._resource,
            attributes=span.attributes,
            events=span.events,
            kind=span.kind,
            status=span.status or self._unset,
            start_time=span.start_time,
            end_time=end_time,
            instrumentation_scope=self._scope,
        )
        root = span.root
        if root is not None and not root._ended:
            root.held.append(readable)  # goes with its request's root span
            return
        finished = [readable]
        if root is None:
            finished.extend(span.held)
            span.held.clear()
        for deliver in self._deliver:
            deliver(finished)


class RecordedSpan:
    """One span of a kept trace, as plain fields until it ends."""

    __slots__ = (
        "_ended",
        "_recorder",
        "attributes",
        "context",
        "events",
        "held",
        "kind",
        "name",
        "parent",
        "root",
        "span_id",
        "start_time",
        "status",
        "trace_id",
    )

    def __init__(
        self,
        recorder: SpanRecorder,
        name: str,
        trace_id: int,
        parent: SpanContext | None,
        root: RecordedSpan | None,
        kind: SpanKind,
        attributes: dict[str, Any],
    ) -> None:
        self._recorder = recorder
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id = getrandbits(64) or 1  # zero is the invalid span id
        # its ids, sampled: its children's parent and its export's context
        self.context = recorder._context(trace_id, span_id, False, recorder._sampled)
        self.parent = parent
        self.root = root  # the trace's first span; None: this one is
        self.held: list[ReadableSpan] = []  # the root's: its ended children, until it ends
        self.kind = kind
        self.attributes = attributes
        self.events: list[Event] = []
        self.status: Status | None = None
        self.start_time = time.time_ns()
        self._ended = False

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one attribute."""
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Set several attributes."""
        self.attributes.update(attributes)

    def set_status(self, status: Status) -> None:
        """Set the status; an OK one is final (as the SDK's)."""
        current = self.status
        if current is not None and current.status_code is self._recorder._ok:
            return
        self.status = status

    def record_exception(self, exception: BaseException) -> None:
        """An `exception` event with the semantic conventions' attributes."""
        kind = type(exception)
        module = kind.__module__
        name = f"{module}.{kind.__qualname__}" if module != "builtins" else kind.__qualname__
        attributes = {
            "exception.type": name,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": "False",
        }
        self.events.append(self._recorder._event("exception", attributes, time.time_ns()))

    def is_recording(self) -> bool:
        """Until it ends."""
        return not self._ended

    def end(self) -> None:
        """End it and hand it on (once: a second end is ignored)."""
        if self._ended:
            return
        self._ended = True
        self._recorder.ended(self, time.time_ns())
