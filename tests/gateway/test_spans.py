"""The spans of a sampled request (``gateway.observability.spans``): one server span, one
client span per attempt, their times and OpenTelemetry's attribute names; the bounded buffer
and its batching policy (``span_buffer``), on numbers alone; and their OTLP encoding
(``otlp``), decoded back with opentelemetry-proto."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gateway.observability import otlp, tracing
from gateway.observability.span_buffer import SpanBuffer
from gateway.observability.spans import CLIENT, SERVER, Recording, Span
from gateway.pool.events import RequestRecord
from gateway.pool.upstream import Upstream
from tests.support.clock import FakeClock

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
HOP = "b7ad6b7169203331"
WALL = 1_700_000_000.0

A = Upstream("a", "web", "10.0.0.1", 8001, revision=3)
B = Upstream("b", "web", "10.0.0.2", 8002, revision=3)


def record(status: int = 200, *, error: str | None = None, retries: int = 0) -> RequestRecord:
    upstream = B if retries else A
    return RequestRecord(
        f"{TRACE}-{HOP}", "web", 3, upstream.id, "GET", "/api/x", status, 0.25, 0.1, 0, 42, retries,
        ("status",) * retries, error,
    )  # fmt: skip


def attributes(span: Span) -> dict[str, object]:
    return dict(span[8])


def test_a_request_makes_a_server_span_and_a_client_span_of_its_attempt() -> None:
    recording = Recording(TRACE, HOP, PARENT)
    client_id = recording.attempt(A, now=10.05)
    server, client = recording.finish(record(), "example.com", now=10.25, wall=WALL)

    assert server[:5] == (TRACE, HOP, PARENT, "GET web", SERVER)
    assert (server[5], server[6]) == (pytest.approx(WALL + 10.0), pytest.approx(WALL + 10.25))
    assert server[7] is False
    assert attributes(server) == {
        "http.request.method": "GET",
        "url.path": "/api/x",
        "server.address": "example.com",
        "http.response.status_code": 200,
        "http.request.body.size": 0,
        "http.response.body.size": 42,
        "gateway.retries": 0,
        "gateway.service": "web",
        "gateway.revision": 3,
        "gateway.upstream": "a",
        "network.peer.address": "10.0.0.1:8001",
    }
    # The client span is the server span's child, with the id the upstream was sent.
    assert client[:5] == (TRACE, client_id, HOP, "GET", CLIENT)
    assert client_id not in (HOP, PARENT)
    assert len(client_id) == 16
    assert (client[5], client[6]) == (pytest.approx(WALL + 10.05), pytest.approx(WALL + 10.25))
    assert attributes(client) == {
        "http.request.method": "GET",
        "server.address": "10.0.0.1",
        "server.port": 8001,
        "gateway.upstream": "a",
        "gateway.revision": 3,
        "gateway.attempt": 1,
        "http.response.status_code": 200,
    }


def test_a_retried_request_has_a_client_span_per_attempt() -> None:
    recording = Recording(TRACE, HOP, "")
    first = recording.attempt(A, now=10.0)
    recording.failed("status", now=10.1, status=503)
    second = recording.attempt(B, now=10.1)
    server, one, two = recording.finish(record(retries=1), "h", now=10.25, wall=0.0)

    assert server[2] == ""  # a new trace: the server span is its root
    assert attributes(server)["gateway.retries"] == 1
    assert (one[1], two[1]) == (first, second)
    assert one[2] == two[2] == HOP
    assert one[7] is True
    assert two[7] is False
    assert attributes(one)["error.type"] == "status"
    assert attributes(one)["http.response.status_code"] == 503
    assert (one[5], one[6], two[5], two[6]) == pytest.approx((10.0, 10.1, 10.1, 10.25))
    assert attributes(two)["gateway.attempt"] == 2
    assert "error.type" not in attributes(two)


def test_a_failed_request_carries_the_gateways_failure_kind() -> None:
    recording = Recording(TRACE, HOP, PARENT)
    recording.attempt(A, now=10.0)
    recording.failed("connect", now=10.01)
    recording.queued, recording.cold_start, recording.choice = 0.5, True, "canary"
    server, client = recording.finish(
        record(502, error="upstream_connect_failed"), "h", now=10.25, wall=0.0
    )
    assert server[7] is True
    assert attributes(server)["error.type"] == "upstream_connect_failed"
    assert attributes(server)["gateway.queue_wait"] == 0.5
    assert attributes(server)["gateway.cold_start"] is True
    assert attributes(server)["gateway.choice"] == "canary"
    assert client[7] is True
    assert attributes(client)["error.type"] == "connect"
    assert "http.response.status_code" not in attributes(client)


def test_an_unrouted_request_has_a_server_span_alone() -> None:
    empty = RequestRecord(f"{TRACE}-{HOP}", "", None, None, "GET", "/x", 404, 0.001, None, 0, 0, 0)
    (server,) = Recording(TRACE, HOP, PARENT).finish(empty, "h", now=1.0, wall=0.0)
    assert server[3] == "GET"
    assert server[7] is False  # a 404 is the client's: no error on the server span


def test_the_client_span_id_goes_upstream_as_the_parent() -> None:
    _request_id, lines = tracing.context(f"00-{TRACE}-{PARENT}-01".encode(), b"rojo=1", 0.0)
    assert tracing.sampled(lines)
    assert tracing.parent_id(f"00-{TRACE}-{PARENT}-01".encode()) == PARENT
    assert tracing.parent_id(None) == ""
    sent = tracing.with_parent(lines, "1111222233334444")
    assert sent == f"traceparent: 00-{TRACE}-1111222233334444-01\r\ntracestate: rojo=1".encode()
    _, unsampled = tracing.context(f"00-{TRACE}-{PARENT}-00".encode(), None, 1.0)
    assert not tracing.sampled(unsampled)


# -- the buffer ------------------------------------------------------------------------------


def spans(count: int) -> list[Span]:
    return [(TRACE, f"{i + 1:016x}", "", "GET", SERVER, 0.0, 1.0, False, ()) for i in range(count)]


def test_a_full_buffer_drops_and_counts_what_does_not_fit() -> None:
    woken: list[int] = []
    buffer = SpanBuffer(capacity=5, batch_size=3, interval=1.0, wake=lambda: woken.append(1))
    buffer.add(spans(2))
    assert woken == []
    buffer.add(spans(2))
    assert woken == [1]  # a batch is full: the driver is woken, once
    buffer.add(spans(3))
    assert (len(buffer), buffer.dropped, woken) == (5, 2, [1])
    assert len(buffer.take(now=0.0)) == 3
    buffer.lost(3)  # that batch's export failed
    assert buffer.dropped == 5
    buffer.discard()
    assert (len(buffer), buffer.dropped) == (0, 7)
    assert repr(buffer) == "<SpanBuffer held=0/5 dropped=7 batch=3>"


def test_a_batch_is_due_when_full_or_when_its_spans_waited_the_interval() -> None:
    clock = FakeClock()
    buffer = SpanBuffer(capacity=100, batch_size=4, interval=1.0)
    buffer.take(clock())  # the last batch: now
    assert not buffer.due(clock())
    assert buffer.until_due(clock()) == 1.0  # nothing held: look again in an interval
    buffer.add(spans(1))
    clock.advance(0.4)
    assert not buffer.due(clock())
    assert buffer.until_due(clock()) == pytest.approx(0.6)
    clock.advance(0.6)
    assert buffer.due(clock())
    assert buffer.until_due(clock()) == 0.0
    assert len(buffer.take(clock())) == 1
    buffer.add(spans(9))
    assert buffer.due(clock())  # a full batch does not wait
    assert [len(buffer.take(clock())) for _ in range(3)] == [4, 4, 1]
    assert not buffer.due(clock())


# -- OTLP ------------------------------------------------------------------------------------


def test_spans_encode_as_an_otlp_export_request() -> None:
    recording = Recording(TRACE, HOP, PARENT)
    client_id = recording.attempt(A, now=10.0)
    finished = recording.finish(record(), "h", now=10.25, wall=WALL)
    decoded = ExportTraceServiceRequest.FromString(otlp.encode(finished, "edge"))
    (resource_spans,) = decoded.resource_spans
    assert resource_spans.resource.attributes[0].key == "service.name"
    assert resource_spans.resource.attributes[0].value.string_value == "edge"
    (scope,) = resource_spans.scope_spans
    assert scope.scope.name == "gateway"
    server, client = scope.spans
    assert (server.trace_id.hex(), server.span_id.hex(), server.parent_span_id.hex()) == (
        TRACE,
        HOP,
        PARENT,
    )
    assert server.kind == server.SPAN_KIND_SERVER
    assert client.kind == client.SPAN_KIND_CLIENT
    assert (client.span_id.hex(), client.parent_span_id.hex()) == (client_id, HOP)
    assert server.start_time_unix_nano == round((WALL + 10.0) * 1e9)
    assert server.end_time_unix_nano == round((WALL + 10.25) * 1e9)
    values = {a.key: a.value for a in server.attributes}
    assert values["http.response.status_code"].int_value == 200
    assert values["url.path"].string_value == "/api/x"
    assert server.status.code == server.status.STATUS_CODE_UNSET
