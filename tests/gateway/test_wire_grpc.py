"""``wire.grpc``: which requests are gRPC, ``grpc-timeout``, the gateway's errors as gRPC
statuses and trailers-only answers; ``wire.http2.request_fields``, the upstream HTTP/2 head."""

from __future__ import annotations

import pytest

from gateway.health import grpc_probe
from gateway.health.probe_client import ProbeInvalidResponse
from gateway.wire import grpc, http2


def test_grpc_is_told_by_its_content_type() -> None:
    assert grpc.is_grpc([(b"content-type", b"application/grpc")])
    assert grpc.is_grpc([(b"te", b"trailers"), (b"content-type", b"application/grpc+proto")])
    assert not grpc.is_grpc([(b"content-type", b"application/json")])
    assert not grpc.is_grpc([])


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(b"200m", 0.2), (b"1S", 1.0), (b"2M", 120.0), (b"1H", 3600.0), (b"5000u", 0.005),
     (b"7n", 7e-9), (b"123456789S", None), (b"S", None), (b"1x", None), (b"-1S", None)],
)  # fmt: skip
def test_grpc_timeout(value: bytes, seconds: float | None) -> None:
    assert grpc.timeout([(b"grpc-timeout", value)]) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("fields", "status"),
    [([(b"grpc-status", b"0")], "0"), ([(b"grpc-message", b"x"), (b"grpc-status", b"16")], "16"),
     ([(b"grpc-status", b"17")], "2"), ([(b"grpc-status", b"abc")], "2"),
     ([(b"grpc-status", b"")], "2"), ([(b"grpc-message", b"x")], None), ([], None)],
)  # fmt: skip
def test_an_answers_status_as_a_client_reads_it(fields: grpc.Fields, status: str | None) -> None:
    assert grpc.status(fields) == status


def test_the_gateways_errors_as_statuses() -> None:
    assert grpc.status_of(503) == grpc.UNAVAILABLE == 14
    assert grpc.status_of(429) == grpc.RESOURCE_EXHAUSTED == 8
    assert grpc.status_of(401) == grpc.UNAUTHENTICATED == 16
    assert grpc.status_of(504) == grpc.DEADLINE_EXCEEDED == 4
    assert grpc.status_of(404) == grpc.UNIMPLEMENTED
    assert grpc.status_of(599) == grpc.UNKNOWN


def test_a_trailers_only_answer() -> None:
    fields = grpc.trailers_only(14, "no routable upstream: 100% é", b"rid")
    assert fields == [
        (b":status", b"200"),
        (b"content-type", b"application/grpc"),
        (b"x-request-id", b"rid"),
        (b"grpc-status", b"14"),
        (b"grpc-message", b"no routable upstream: 100%25 %C3%A9"),
    ]


def test_an_upstream_head_in_http2_fields() -> None:
    lines = [
        b"POST /test.Echo/Unary HTTP/1.1",
        b"Host: api.example\r\nContent-Type: application/grpc",
        b"Connection: keep-alive",
        b"TE: gzip",
        b"X-Request-Id: r1",
    ]
    assert http2.request_fields(lines) == [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":authority", b"api.example"),
        (b":path", b"/test.Echo/Unary"),
        (b"content-type", b"application/grpc"),
        (b"x-request-id", b"r1"),
        (b"te", b"trailers"),
    ]


def test_the_health_checks_messages() -> None:
    """``health.grpc_probe``'s by-hand protobuf, against what grpcio-health-checking's own
    messages encode to."""
    health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
    expected = health_pb2.HealthCheckRequest(service="test.Echo").SerializeToString()
    assert (
        grpc_probe.request_message("test.Echo")
        == b"\0" + len(expected).to_bytes(4, "big") + expected
    )
    assert grpc_probe.request_message("") == b"\0\0\0\0\0"
    for status in (0, 1, 2, 3):
        body = health_pb2.HealthCheckResponse(status=status).SerializeToString()
        framed = b"\0" + len(body).to_bytes(4, "big") + body
        assert grpc_probe.serving_status(framed) == status
    with pytest.raises(ProbeInvalidResponse):
        grpc_probe.serving_status(b"\0\0\0\0\x05\x08")
