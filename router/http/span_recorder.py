"""kvroute's own recording of the traces it keeps: spans that are the SDK's `ReadableSpan`.

When kvroute decides a request's trace and keeps it (`Tracing.decide`), the SDK would sample
every span of it in, and its span machinery costs about 27 us a span (a lock, a bounded
attribute dict, two context copies). A `RecordedSpan` is instead a `ReadableSpan` from the
start: the fields the SDK's readers see are filled as the request goes, so ending a span hands
the very object to the exporters, with no copy into a second one. A request's spans go together
when its root span ends (a child ending later goes alone).

A `ReadableSpan` keeps its fields in underscored attributes that its properties read; the SDK's
own `Span` subclass fills them the same way. tests/router/ops/test_tracing.py reads every one
back through the public properties and `to_json`, so an SDK that renamed them fails there.

This module imports OpenTelemetry: it is loaded only when tracing is on (`build_tracing`).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from random import getrandbits
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from router.http.spans import RANDOM_TRACE_ID, TraceSpan

__all__ = ["RecordedSpan", "SpanRecorder"]

_SAMPLED = TraceFlags(0x01)
_SAMPLED_RANDOM = TraceFlags(_SAMPLED | RANDOM_TRACE_ID)
_INTERNAL = SpanKind.INTERNAL
_UNSET = Status(StatusCode.UNSET)
_NO_EVENTS: tuple[Event, ...] = ()
_NEW = tuple.__new__


def _span_context(trace_id: int, span_id: int, remote: bool, flags: TraceFlags) -> SpanContext:
    """A `SpanContext` of nonzero ids that fit (the recorder's own, or a client's `traceparent`
    parsed by its rules), made as `SpanContext.__new__` makes it, without its defaults and
    range checks: a third of what making a span cost."""
    return _NEW(SpanContext, (trace_id, span_id, remote, flags, DEFAULT_TRACE_STATE, True))


class SpanRecorder:
    """Records the spans of the traces kvroute keeps and hands each request's, together, to
    every one of `deliver`: the `on_end` of the span processors kvroute added to its provider,
    or an exporter's `export` where kvroute would otherwise add the SDK's `SimpleSpanProcessor`
    for it (`build_tracing`)."""

    def __init__(
        self, resource: Resource, deliver: Sequence[Callable[[Sequence[ReadableSpan]], object]]
    ) -> None:
        self.resource = resource
        self.deliver = tuple(deliver)
        # what the SDK's tracer for "kvroute" would stamp on its spans
        self.scope = InstrumentationScope("kvroute")

    def root(
        self,
        trace_id: int,
        parent_span_id: int,
        name: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        flags: str,
    ) -> RecordedSpan:
        """The first span this process records of the trace `trace_id` (nonzero, as the
        client's span `parent_span_id`: `parse_traceparent` refuses zeros), under that span
        (0: a new trace, whose `flags` say its id is random). `flags`: the client's trace
        flags (two hex digits), as `TraceDecision.flags` has them. `attributes` becomes the
        span's own. Its spans are sampled, and random where the SDK's would be."""
        given = int(flags, 16)
        parent = (
            _span_context(trace_id, parent_span_id, True, TraceFlags(given))
            if parent_span_id
            else None
        )
        own = _SAMPLED_RANDOM if given & RANDOM_TRACE_ID else _SAMPLED
        span = RecordedSpan(self, name, trace_id, parent, None, kind, attributes, own)
        span.held = []
        return span

    def start(
        self,
        name: str,
        parent: Any,
        kind: SpanKind | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> TraceSpan:
        """A child of `parent` (a `RecordedSpan`); `attributes` becomes the span's own."""
        assert isinstance(parent, RecordedSpan)
        return RecordedSpan(
            self,
            name,
            parent.trace_id,
            parent._context,
            parent.root or parent,
            kind or _INTERNAL,
            attributes if attributes is not None else {},
            parent.flags,
        )

    def context_of(self, span: TraceSpan) -> Any:
        """A recorded span is its own handle as a parent."""
        return span

    def inject(self, carrier: MutableMapping[str, str], parent: Any) -> None:
        """The W3C `traceparent` naming `parent`; a client's `tracestate` and `baggage` reach
        the worker as it sent them (the proxy forwards its headers)."""
        assert isinstance(parent, RecordedSpan)
        ids = (parent.trace_id << 64 | parent.span_id).to_bytes(24, "big").hex()
        flags = "-03" if parent.flags & RANDOM_TRACE_ID else "-01"
        carrier["traceparent"] = "00-" + ids[:32] + "-" + ids[32:] + flags


class RecordedSpan(ReadableSpan):
    """One span of a kept trace: a `ReadableSpan` whose fields are filled while it runs.

    The fields most spans leave as they start (no events, no links, status unset, not ended)
    are the class's until a span sets its own: fewer stores per span, and a smaller span to
    keep until it is exported."""

    held: list[RecordedSpan]  # a root's only (`SpanRecorder.root`): its ended children
    ended = False
    _events = _NO_EVENTS
    _links = ()
    _status = _UNSET
    _instrumentation_info = None
    _end_time: int | None = None

    def __init__(
        self,
        recorder: SpanRecorder,
        name: str,
        trace_id: int,
        parent: SpanContext | None,
        root: RecordedSpan | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        flags: TraceFlags,
    ) -> None:
        # the SDK's `ReadableSpan.__init__` is not called: it takes a dozen keywords to fill
        # the same fields, and the fields are the contract its properties read
        self.recorder = recorder
        self.trace_id = trace_id
        self.span_id = span_id = getrandbits(64) or 1  # zero is the invalid span id
        self.root = root  # the trace's first span; None: this one is
        self._name = name
        # its ids, sampled: its children's parent and its export's context
        self.flags = flags  # its context's trace flags, its children's too
        self._context = _span_context(trace_id, span_id, False, flags)
        self._parent = parent
        self._kind = kind
        self._attributes = self.values = attributes  # `values`: the same dict, typed mutable
        self._resource = recorder.resource
        self._instrumentation_scope = recorder.scope
        self._start_time = time.time_ns()

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one attribute."""
        self.values[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Set several attributes."""
        self.values.update(attributes)

    def set_status(self, status: Status) -> None:
        """Set the status; an OK one is final (as the SDK's)."""
        if self._status.status_code is not StatusCode.OK:
            self._status = status

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
        self._events = (*self._events, Event("exception", attributes, time.time_ns()))

    def is_recording(self) -> bool:
        """Until it ends."""
        return not self.ended

    def end(self) -> None:
        """End it (once: a second end is ignored). A child waits for its root; a root goes to
        the exporters with its ended children."""
        if self.ended:
            return
        self.ended = True
        self._end_time = time.time_ns()
        root = self.root
        if root is not None and not root.ended:
            root.held.append(self)
            return
        finished: list[ReadableSpan] = [self]
        if root is None and self.held:
            finished.extend(self.held)
            self.held.clear()
        for deliver in self.recorder.deliver:
            deliver(finished)
