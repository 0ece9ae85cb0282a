"""Inbound HTTP/2 (``proxy.h2_downstream``, ``proxy.h2_stream``): real clients on loopback.

curl (nghttp2) by prior knowledge (h2c) and by ALPN over TLS; ``H2Client`` (the ``h2``
library's state machine) where a test needs several streams on one connection, windows
kept shut, or GOAWAY seen. Upstreams are real aiohttp servers; the upstream leg is
HTTP/1.1. The codec's pieces that need no socket are tested alone at the end.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway import Pool, TlsConfig
from gateway.config import ListenerLimits
from gateway.observability.scrape import ConnectionsCollector, Http2ConnectionsCollector
from gateway.proxy.h2_downstream import H2Connection, incoming
from gateway.proxy.h2_stream import OUT_HIGH_WATER
from gateway.proxy.request import Refused
from gateway.server import TrafficServer
from gateway.wire import http1, http2
from gateway.wire.splice import SPLICE_SIZE
from tests.support.eventually import eventually
from tests.support.h2_client import H2Client

from .conftest import Recorder, raw_request, routing
from .test_tls import write_pair

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")

Start = Callable[..., Awaitable[Any]]


async def curl(*args: str) -> tuple[int, bytes, str]:
    """curl's exit status, output and its verbose trace."""
    process = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "-m",
        "10",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out, err.decode(errors="replace")


@pytest.fixture
async def echo(upstream: Start, pool: Pool) -> None:
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")


def h2_connections(server: TrafficServer) -> set[H2Connection]:
    return server._h2_connections


# -- by prior knowledge (h2c) -------------------------------------------------------------------


async def test_curl_by_prior_knowledge_is_routed_answered_and_recorded(
    gateway: Start, echo: None, recorder: Recorder
) -> None:
    server = await gateway()
    status, out, trace = await curl(
        "-v", "--http2-prior-knowledge", f"http://127.0.0.1:{server.port}/hello?x=1"
    )
    assert status == 0, trace
    assert "< HTTP/2 200" in trace
    assert "x-request-id: " in trace
    answer = json.loads(out)
    assert answer["upstream"] == "u1"
    assert answer["path"] == "/hello?x=1"
    sent = dict(answer["headers"])
    assert sent["Host"] == f"127.0.0.1:{server.port}"  # :authority, as the upstream's Host
    assert sent["X-Forwarded-Proto"] == "http"
    (record,) = await recorder.wait(1)
    assert (record.service, record.status, record.path) == ("web", 200, "/hello")
    assert record.http_version == "2"  # the access log's "GET /hello HTTP/2", "protocol": "h2"


async def test_streams_on_one_connection_are_routed_and_answered_each(
    gateway: Start, upstream: Start, pool: Pool, recorder: Recorder
) -> None:
    pool.set_service(routing("a", prefix="/a"))
    pool.set_service(routing("b", prefix="/b"))
    await upstream("a", "a1")
    await upstream("b", "b1")
    server = await gateway()
    client = await H2Client.connect(server.port)
    try:
        streams = [client.request(f"/{'ab'[i % 2]}/{i}") for i in range(10)]
        answers = await client.get(*streams)
        # The gateway's header blocks index nothing (wire.hpack_encoder).
        assert not client.conn.decoder.header_table.dynamic_entries
    finally:
        await client.close()
    for i, answer in enumerate(answers):
        assert answer.status == 200
        assert answer.headers[b"content-length"] == str(len(answer.body)).encode()
        body = json.loads(answer.body)
        assert (body["upstream"], body["path"]) == (f"{'ab'[i % 2]}1", f"/{'ab'[i % 2]}/{i}")
    records = await recorder.wait(10)
    assert sorted(r.service for r in records) == ["a"] * 5 + ["b"] * 5
    assert len(h2_connections(server)) <= 1


async def test_a_post_body_is_relayed_with_and_without_a_length(
    gateway: Start, echo: None, tmp_path: Path
) -> None:
    server = await gateway()
    body = tmp_path / "body"
    body.write_bytes(b"x" * 300_000)  # over the stream's window: acknowledged as passed on
    status, out, trace = await curl(
        "--http2-prior-knowledge",
        "--data-binary",
        f"@{body}",
        f"http://127.0.0.1:{server.port}/upload",
    )
    assert status == 0, trace
    assert json.loads(out)["body"] == 300_000
    client = await H2Client.connect(server.port)
    try:
        # No length given: whole by the time it is sent (then framed by its length), or
        # streamed chunked.
        stream = client.request("/chunks", method="POST", body=b"y" * 1000)
        (answer,) = await client.get(stream)
    finally:
        await client.close()
    sent = json.loads(answer.body)
    assert (answer.status, sent["method"], sent["body"]) == (200, "POST", 1000)


async def test_trailers_to_an_http1_replica_are_dropped(gateway: Start, echo: None) -> None:
    """As nginx does: the body goes whole (chunked, or framed by its length once whole),
    its trailers nowhere; the stream is answered."""
    server = await gateway()
    client = await H2Client.connect(server.port)
    try:
        stream = client.request("/t", method="POST", body=b"y" * 1000, end=False)
        client.conn.send_headers(stream, [("x-checksum", "abc")], end_stream=True)
        client.flush()
        (answer,) = await client.get(stream)
    finally:
        await client.close()
    sent = json.loads(answer.body)
    assert (answer.status, sent["body"]) == (200, 1000)
    assert "x-checksum" not in {name.lower() for name, _ in sent["headers"]}
    assert client.terminated is None


async def test_the_gateways_own_answers_go_on_the_stream(
    gateway: Start, pool: Pool, recorder: Recorder
) -> None:
    pool.set_service(routing("down", prefix="/down"))  # no routable upstream
    server = await gateway()
    client = await H2Client.connect(server.port)
    try:
        nowhere, down = client.request("/nowhere"), client.request("/down/x")
        big = client.request("/nowhere", headers=[("x-big", "v" * 20_000)])  # over a field's limit
        answers = await client.get(nowhere, down, big)
        again = client.request("/nowhere")  # the connection serves on
        (after,) = await client.get(again)
    finally:
        await client.close()
    not_found, unavailable, too_large = answers
    assert not_found.status == 404
    assert json.loads(not_found.body)["error"] == "no_route"
    assert not_found.headers[b"content-type"].startswith(b"application/json")
    assert unavailable.status == 503
    assert b"retry-after" in unavailable.headers
    assert too_large.status == 431
    assert after.status == 404
    assert b"connection" not in not_found.headers  # no connection-specific field in HTTP/2
    records = await recorder.wait(3)
    assert sorted(r.status for r in records)[:3] == [404, 404, 503]


async def test_a_slow_reader_pauses_the_upstream_and_gets_the_whole_answer(
    gateway: Start, upstream: Start, pool: Pool
) -> None:
    size = 8 * 1024 * 1024

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = size
        await response.prepare(request)
        for _ in range(size // 65536):
            await response.write(b"z" * 65536)
        return response

    app = web.Application()
    app.router.add_get("/big", big)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", app)
    server = await gateway()
    client = await H2Client.connect(server.port, window=65535, acknowledge=False)
    try:
        stream = client.request("/big")
        await client.read(lambda: len(client.answers[stream].body) >= 65535)
        (conn,) = h2_connections(server)
        h2_stream = await eventually(
            lambda: next((s for s in conn.streams.values() if s.writing_paused), None),
            what="the stream's upstream paused",
        )
        # Held by the gateway: what its queue bounds, and the read that went over it (a
        # splice buffer's), never the whole answer.
        assert h2_stream.out_bytes <= OUT_HIGH_WATER + SPLICE_SIZE
        client.acknowledge = True
        client.open_windows()
        (answer,) = await client.get(stream, within=20)
    finally:
        await client.close()
    assert answer.ended
    assert len(answer.body) == size


async def test_shutdown_sends_goaway_and_finishes_the_open_stream(
    gateway: Start, upstream: Start, pool: Pool
) -> None:
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/slow", slow)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", app)
    server = await gateway(shutdown_timeout=10)
    client = await H2Client.connect(server.port)
    try:
        stream = client.request("/slow")
        await arrived.wait()
        stopping = asyncio.create_task(server.stop())
        await client.read(lambda: client.terminated is not None)
        assert client.terminated is not None
        assert client.terminated.error_code == 0  # NO_ERROR: a graceful GOAWAY
        assert client.terminated.last_stream_id == stream
        release.set()
        (answer,) = await client.get(stream)
        assert (answer.status, bytes(answer.body)) == (200, b"late")
        await client.read(lambda: False)  # then the gateway closes the connection
        assert client.closed
        await stopping
    finally:
        release.set()
        await client.close()


async def test_a_request_body_that_pauses_too_long_is_408_on_its_stream(
    gateway: Start, echo: None, recorder: Recorder
) -> None:
    server = await gateway(limits=ListenerLimits(body_timeout=0.3))
    client = await H2Client.connect(server.port)
    try:
        stalled = client.request(
            "/up", method="POST", body=b"x" * 100, headers=[("content-length", "1000")], end=False
        )
        (answer,) = await client.get(stalled)  # within 0.3 s of its last read, and a slot
        assert answer.status == 408
        assert json.loads(answer.body)["error"] == "request_timeout"
        (other,) = await client.get(client.request("/other"))  # the connection serves on
        assert other.status == 200
    finally:
        await client.close()
    records = await recorder.wait(2)
    assert sorted(r.status for r in records) == [200, 408]


async def test_cleartext_off_refuses_the_preface_as_before(gateway: Start, echo: None) -> None:
    server = await gateway(http2={"cleartext": False})
    answer = await raw_request(server.port, http2.PREFACE)
    assert answer.startswith(b"HTTP/1.1 400 ")


async def test_http1_on_the_same_listener_is_untouched(gateway: Start, echo: None) -> None:
    server = await gateway()
    answer = await raw_request(
        server.port, b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert not h2_connections(server)


async def test_a_split_preface_is_still_http2(gateway: Start, echo: None) -> None:
    server = await gateway()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    client = H2Client(reader, writer)
    first = client.conn.data_to_send()  # the preface, then SETTINGS
    writer.write(first[:16])
    await writer.drain()
    await eventually(lambda: server.connections == 1)
    writer.write(first[16:])
    try:
        (answer,) = await client.get(client.request("/split"))
    finally:
        await client.close()
    assert answer.status == 200


async def test_http2_connections_are_counted_in_a_gauge_of_their_own(
    gateway: Start, echo: None
) -> None:
    server = await gateway()
    registry = CollectorRegistry()
    registry.register(ConnectionsCollector(lambda: (server.connections, server.parked)))
    registry.register(Http2ConnectionsCollector(lambda: server.http2))
    plain = await asyncio.open_connection("127.0.0.1", server.port)
    client = await H2Client.connect(server.port)
    try:
        await client.get(client.request("/"))
        await eventually(lambda: server.connections == 2, what="both connections open")
        assert registry.get_sample_value("gateway_http2_connections") == 1
        assert registry.get_sample_value("gateway_client_connections", {"state": "in_loop"}) == 2
    finally:
        await client.close()
        plain[1].close()
    await eventually(lambda: server.connections == 0, what="no connection left")
    assert registry.get_sample_value("gateway_http2_connections") == 0
    nothing = CollectorRegistry()
    nothing.register(Http2ConnectionsCollector(lambda: None))  # before the listener started
    assert nothing.get_sample_value("gateway_http2_connections") is None


async def test_the_stream_limit_is_advertised(gateway: Start, echo: None) -> None:
    server = await gateway(http2={"max_concurrent_streams": 7})
    client = await H2Client.connect(server.port)
    try:
        await client.read(lambda: client.conn.remote_settings.max_concurrent_streams == 7)
    finally:
        await client.close()


# -- by ALPN over TLS ---------------------------------------------------------------------------


async def test_alpn_offers_h2_first_and_http1_when_asked(
    tls_gateway: Start, echo: None, ca: trustme.CA, tmp_path: Path
) -> None:
    pair = write_pair(ca, tmp_path / "a", "localhost")
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    both = await tls_gateway(TlsConfig(certificates=(pair,)))
    port = both.tls_ports[0]
    status, out, trace = await curl(
        "-v", "--http2", "--cacert", str(ca_file), f"https://localhost:{port}/over-tls"
    )
    assert status == 0, trace
    assert "ALPN: server accepted h2" in trace
    assert "< HTTP/2 200" in trace
    assert dict(json.loads(out)["headers"])["X-Forwarded-Proto"] == "https"
    only = await tls_gateway(TlsConfig(certificates=(pair,), alpn=("http/1.1",)))
    status, out, trace = await curl(
        "-v", "--http2", "--cacert", str(ca_file), f"https://localhost:{only.tls_ports[0]}/"
    )
    assert status == 0, trace
    assert "< HTTP/1.1 200" in trace


# -- the codec's pieces, without a socket -------------------------------------------------------


def test_a_head_becomes_a_request_as_http1_would_have_it() -> None:
    fields = [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":authority", b"api.example.test:8443"),
        (b":path", b"/v1/x?y=1"),
        (b"content-type", b"application/json"),
        (b"x-request-id", b"abc"),
    ]
    request = incoming(fields, 16384, body=True)
    assert (request.method, request.target, request.host) == ("POST", b"/v1/x?y=1", fields[2][1])
    assert request.chunked  # a body of no known length
    assert request.content_length is None
    assert (b"host", b"api.example.test:8443") in request.headers
    assert request.request_id == b"abc"
    assert not request.is_websocket
    with_length = incoming([*fields[:4], (b"content-length", b"12")], 16384, body=True)
    assert (with_length.content_length, with_length.chunked) == (12, False)
    assert not incoming(fields[:4], 16384, body=False).chunked


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ([(b":method", b"CONNECT"), (b":authority", b"a:1")], 405),
        ([(b":method", b"GET"), (b":path", b"/"), (b":authority", b"bad host")], 400),
        ([(b":method", b"GET"), (b":path", b"/"), (b"host", b"a"), (b"host", b"b")], 400),
        ([(b":method", b"GET"), (b":path", b"/"), (b"x", b"v" * 20000)], 431),
        ([(b":method", b"GET"), (b":path", b"/" + b"a" * 16384)], 414),
        ([(b":method", b"POST"), (b":path", b"/"), (b"content-length", b"x")], 400),
        ([(b":method", b"GET"), (b":path", b"/"), (b"x", b"\xff")], 400),
    ],
)
def test_heads_http1_would_refuse_are_refused(
    fields: list[tuple[bytes, bytes]], status: int
) -> None:
    with pytest.raises(Refused) as refused:
        incoming(fields, 16384, body=False)
    assert refused.value.status == status


def test_the_gateways_answers_are_told_in_http2_fields() -> None:
    data = http1.json_response(503, {"error": "x"}, {"Retry-After": "1"}, close=True)
    status, fields, body = http2.split_answer(data)
    names = [name for name, _ in fields]
    assert (status, fields[0], body) == (503, (b":status", b"503"), b'{"error": "x"}')
    assert b"connection" not in names  # RFC 9113 8.2.2
    assert (b"retry-after", b"1") in fields
    assert (b"content-length", b"14") in fields
    lines = [b"Keep-Alive: 5\r\nX-A: 1", b"Transfer-Encoding: chunked", b"Upgrade: h2c"]
    assert http2.answer_fields(200, lines) == [(b":status", b"200"), (b"x-a", b"1")]
