"""The two ways a request's spans are made: by the OpenTelemetry SDK, or recorded by kvroute.

When kvroute made the provider, its sampler and its processors, and the propagators are W3C's
(`Tracing.decides_sampling`), kvroute decides on each request's trace itself (`Tracing.decide`), and
the traces it keeps are recorded by `router.http.span_recorder.SpanRecorder` (loaded only then:
it imports OpenTelemetry), whose spans are the SDK's own `ReadableSpan` filled as the request
goes, for a fraction of what the SDK's span machinery costs.
Otherwise (a sampler or propagators of the OTEL_* variables, a `TracerProvider` handed
in) every request gets the SDK's spans (`SdkSpans`): its sampler, limits and processors decide.

A span's handle as a parent (`context_of`) is an OpenTelemetry `Context` on the SDK's way and the
`RecordedSpan` itself on the recorder's; the proxy only passes it back to the same maker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import Span, SpanKind, Status, Tracer

__all__ = ["RANDOM_TRACE_ID", "SdkSpans", "SpanMaker", "TraceSpan"]

# the W3C trace context level 2 "random trace id" flag: the SDK sets it on a trace whose id its
# generator drew at random, and on every span under a parent that has it (a literal: an SDK
# older than the bit has no name for it)
RANDOM_TRACE_ID = 0x02


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
        attributes: dict[str, Any] | None = None,
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
        attributes: dict[str, Any] | None = None,
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
