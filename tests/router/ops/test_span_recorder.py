"""kvroute's recorded spans are the SDK's `ReadableSpan`: every public view of one equals that
of a span the SDK's own constructor builds from the same facts (a renamed private field in a new
SDK fails here)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, Status, StatusCode

from router.http.span_recorder import RecordedSpan, SpanRecorder

_VIEWS = (
    "name",
    "context",
    "kind",
    "parent",
    "start_time",
    "end_time",
    "status",
    "attributes",
    "events",
    "links",
    "resource",
    "instrumentation_scope",
    "dropped_attributes",
    "dropped_events",
    "dropped_links",
)


def _sdk_copy(span: ReadableSpan) -> ReadableSpan:
    """The span as the SDK's constructor makes it from the public views."""
    return ReadableSpan(
        span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=dict(span.attributes or {}),
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def test_a_request_s_recorded_spans_read_as_the_sdk_s() -> None:
    delivered: list[Sequence[ReadableSpan]] = []
    recorder = SpanRecorder(Resource.create({"service.name": "t"}), [delivered.append])
    root = recorder.root(0xABC, 0x123, "POST /x", SpanKind.SERVER, {"a": 1}, "01")
    child = recorder.start("parse", root, attributes={"b": "two"})
    grandchild = recorder.start("tokenize", child)
    grandchild.set_attribute("kvroute.prompt_tokens", 3)
    grandchild.end()
    child.record_exception(ValueError("bad"))
    child.set_status(Status(StatusCode.ERROR, "ValueError"))
    child.end()
    assert delivered == []  # the children wait for their request's root
    root.set_attributes({"c": 2.5})
    root.end()
    root.end()  # a second end is ignored
    (batch,) = delivered
    assert [span.name for span in batch] == ["POST /x", "tokenize", "parse"]
    for span in batch:
        assert isinstance(span, RecordedSpan)
        copy = _sdk_copy(span)
        for view in _VIEWS:
            assert getattr(span, view) == getattr(copy, view), (span.name, view)
        assert json.loads(span.to_json()) == json.loads(copy.to_json())
    by_name = {span.name: span for span in batch}
    assert by_name["POST /x"].parent is not None and by_name["POST /x"].parent.span_id == 0x123
    assert by_name["tokenize"].parent == by_name["parse"].context
    assert by_name["parse"].status.status_code is StatusCode.ERROR
    assert [event.name for event in by_name["parse"].events] == ["exception"]
    assert by_name["tokenize"].attributes == {"kvroute.prompt_tokens": 3}


def test_a_child_ending_after_its_root_goes_alone() -> None:
    delivered: list[Sequence[ReadableSpan]] = []
    recorder = SpanRecorder(Resource.create({}), [delivered.append])
    root = recorder.root(7, 0, "r", SpanKind.SERVER, {}, "02")
    late = recorder.start("upstream", root, SpanKind.CLIENT)
    root.end()
    late.end()
    assert [[span.name for span in batch] for batch in delivered] == [["r"], ["upstream"]]
    assert delivered[0][0].parent is None  # a new trace


def test_the_trace_flags_are_the_sdk_s() -> None:
    # sampled always (a recorded trace is a kept one); the W3C "random trace id" bit (0x02)
    # where the SDK sets it: on a new trace (its id drawn at random) and under a client span
    # whose flags have it. The worker's traceparent carries the same flags
    recorder = SpanRecorder(Resource.create({}), [])
    for client, parent_id, expected, header in (
        ("01", 0x5, 0x01, "-01"),
        ("03", 0x5, 0x03, "-03"),
        ("0b", 0x5, 0x03, "-03"),  # bits W3C has not defined are the client's alone
        ("02", 0, 0x03, "-03"),  # a new trace (`Tracing.decide` says "02")
    ):
        root = recorder.root(0xABC, parent_id, "r", SpanKind.SERVER, {}, client)
        child = recorder.start("route", root)
        assert isinstance(child, RecordedSpan)
        for span in (root, child):
            assert span.context is not None and span.context.trace_flags == expected, client
        if parent_id:
            assert root.parent is not None and root.parent.trace_flags == int(client, 16)
        carrier: dict[str, str] = {}
        recorder.inject(carrier, child)
        assert carrier["traceparent"].endswith(header), client
        assert carrier["traceparent"] == f"00-{0xABC:032x}-{child.span_id:016x}{header}"
