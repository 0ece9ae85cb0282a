"""Spans as OTLP's protobuf: an ``ExportTraceServiceRequest``, as a collector's
``/v1/traces`` takes it over HTTP. PURE.

The messages are opentelemetry-proto's (OpenTelemetry's own generated code of the OTLP
``.proto`` files): nothing of the wire format is written here. Only the main process imports
this module; a worker hands its spans over as plain tuples (``spans.Span``).
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanMessage

from .spans import Span, Value

CONTENT_TYPE = "application/x-protobuf"
SCOPE = "gateway"
"""The instrumentation scope's name: the gateway's own spans."""


def _value(value: Value) -> AnyValue:
    if isinstance(value, bool):  # before int: a bool is an int
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=value)


def _attributes(pairs: Iterable[tuple[str, Value]]) -> list[KeyValue]:
    return [KeyValue(key=key, value=_value(value)) for key, value in pairs]


def _span(span: Span) -> SpanMessage:
    trace_id, span_id, parent_id, name, kind, start, end, error, attributes = span
    return SpanMessage(
        trace_id=bytes.fromhex(trace_id),
        span_id=bytes.fromhex(span_id),
        parent_span_id=bytes.fromhex(parent_id),
        name=name,
        kind=kind,  # type: ignore[arg-type]  # SERVER, CLIENT: OTLP's numbers
        start_time_unix_nano=round(start * 1e9),
        end_time_unix_nano=round(end * 1e9),
        attributes=_attributes(attributes),
        status=Status(code=Status.STATUS_CODE_ERROR if error else Status.STATUS_CODE_UNSET),
    )


def encode(spans: Iterable[Span], service_name: str) -> bytes:
    """``spans`` as the body of one export request, their resource ``service_name``'s."""
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=_attributes([("service.name", service_name)])),
                scope_spans=[
                    ScopeSpans(
                        scope=InstrumentationScope(name=SCOPE),
                        spans=[_span(span) for span in spans],
                    )
                ],
            )
        ]
    )
    body: bytes = request.SerializeToString()
    return body
