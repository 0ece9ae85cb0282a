"""The gRPC probe's client: ``grpc.health.v1.Health/Check`` (gRPC's standard health service)
on a new h2c connection (or h2 over TLS, with the service's ``upstream_tls``), and the
serving status it answers.

One call, by hand on the gateway's own HTTP/2 session (``wire.h2_session``, the upstream
leg's), its two messages encoded and read here: a
``HealthCheckRequest`` is one string field (``service``), a ``HealthCheckResponse`` one enum
field (``status``), too little protobuf for a protobuf library. As ``probe_client``: a
connection of its own, closed on every path; every failure a ``ProbeError`` or an
``OSError``; no timeout of its own (the prober bounds the whole check).
"""

from __future__ import annotations

import asyncio
from typing import Final

from ..wire import h2_session
from ..wire.h2_session import (
    ConnectionTerminated,
    DataReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from ..wire.upstream_tls import UpstreamTls
from .probe_client import ProbeConnectionClosed, ProbeError, ProbeInvalidResponse, ProbeTlsRefused

PATH: Final = b"/grpc.health.v1.Health/Check"
SERVING: Final = 1
STATUS_NAMES: Final = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
RESPONSE_LIMIT: Final = 64 * 1024


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def request_message(service: str) -> bytes:
    """A ``HealthCheckRequest`` for ``service`` in gRPC's framing (uncompressed)."""
    name = service.encode()
    body = b"\x0a" + _varint(len(name)) + name if name else b""
    return b"\x00" + len(body).to_bytes(4, "big") + body


def serving_status(data: bytes) -> int:
    """The ``status`` of a framed ``HealthCheckResponse`` (0, UNKNOWN, if it has none)."""
    if len(data) < 5 or data[0] != 0 or int.from_bytes(data[1:5], "big") != len(data) - 5:
        raise ProbeInvalidResponse("grpc probe: not one uncompressed message")
    body, i, status = data[5:], 0, 0
    while i < len(body):
        key, i = _read_varint(body, i)
        wire = key & 7
        if wire == 0:
            value, i = _read_varint(body, i)
            if key >> 3 == 1:
                status = value
        elif wire == 2:
            size, i = _read_varint(body, i)
            i += size
        else:
            raise ProbeInvalidResponse("grpc probe: a HealthCheckResponse field of another kind")
    return status


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while i < len(data) and shift < 64:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
    raise ProbeInvalidResponse("grpc probe: a broken varint")


async def check(
    host: str, port: int, service: str, *, authority: str, tls: UpstreamTls | None = None
) -> int:
    """Call ``Health/Check`` for ``service`` at ``host:port`` over h2c, or h2 over ``tls``
    (agreed by ALPN): the status answered (``SERVING`` is 1). ``ProbeError`` if the call
    fails (its ``grpc-status``)."""
    if tls is None:
        reader, writer = await asyncio.open_connection(host, port)
    else:
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection(
            host, port, ssl=tls.context(loop.time()), server_hostname=tls.server_hostname(host)
        )
    try:
        if tls is not None:
            refusal = tls.refusal(writer.get_extra_info("ssl_object"))
            if refusal is not None:
                raise ProbeTlsRefused(refusal)
        conn = h2_session.Session(True, 1)
        conn.initiate()
        stream_id = conn.open_stream()
        conn.send_headers(
            stream_id,
            [
                (b":method", b"POST"),
                (b":scheme", b"http" if tls is None else b"https"),
                (b":authority", authority.encode()),
                (b":path", PATH),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
                (b"user-agent", b"gateway-prober"),
            ],
        )
        conn.send_data(stream_id, request_message(service), True)
        writer.write(conn.take())
        fields: dict[bytes, bytes] = {}
        body = bytearray()
        ended = False
        while not ended:
            data = await reader.read(65536)
            if not data:
                raise ProbeConnectionClosed("grpc probe: the connection closed before the end")
            try:
                events = conn.receive(data)
            except h2_session.ProtocolError as exc:
                raise ProbeInvalidResponse(f"grpc probe: HTTP/2 broken: {exc}") from None
            for event in events:
                if isinstance(event, ResponseReceived | TrailersReceived):
                    fields.update(event.headers)
                elif isinstance(event, DataReceived):
                    body += event.data
                    if len(body) > RESPONSE_LIMIT:
                        raise ProbeInvalidResponse("grpc probe: the answer is too large")
                    conn.acknowledge(stream_id, event.flow_controlled_length)
                elif isinstance(event, StreamEnded):
                    ended = True
                elif isinstance(event, StreamReset | ConnectionTerminated):
                    raise ProbeError("grpc probe: the replica reset the call")
            writer.write(conn.take())
        status = fields.get(b"grpc-status", b"")
        if status != b"0":
            message = fields.get(b"grpc-message", b"").decode("latin-1")
            raise ProbeError(f"grpc-status {status.decode('latin-1') or '-'} {message}".strip())
        return serving_status(bytes(body))
    finally:
        writer.close()
