"""HTTPS listeners: real OpenSSL handshakes on loopback, certificates from a per-test CA.

The gateway is a ``TrafficServer`` with a ``Termination`` (``listen_tls``), in front of real
upstreams; clients are Python's ``ssl`` (raw sockets, to see the certificate a handshake got,
whether its session was resumed) and aiohttp.
"""

from __future__ import annotations

import asyncio
import io
import os
import socket
import ssl
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from gateway import Pool, TlsConfig
from gateway.config import CertificateFiles, ListenerLimits
from gateway.tls.names import NameIndex
from tests.support.eventually import eventually

from .conftest import raw_request, routing
from .test_server import read_response


def write_pair(ca: trustme.CA, directory: Path, *names: str) -> CertificateFiles:
    """A certificate for ``names`` signed by ``ca``, written as PEM files in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    issued = ca.issue_cert(*names)
    cert, key = directory / "cert.pem", directory / "key.pem"
    issued.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    return CertificateFiles(cert_file=str(cert), key_file=str(key))


def client_context(ca: trustme.CA, **settings: Any) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    for name, value in settings.items():
        setattr(context, name, value)
    return context


def handshake(
    port: int,
    context: ssl.SSLContext,
    server_name: str | None,
    session: ssl.SSLSession | None = None,
    request: bytes = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
) -> tuple[list[str], bool, ssl.SSLSession | None, bytes]:
    """A blocking TLS client: (the names its certificate has, resumed, session, answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=server_name, session=session) as tls:
            cert = tls.getpeercert()
            names = [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"] if cert else []
            tls.sendall(request)
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
            return names, tls.session_reused, tls.session, answer


@pytest.fixture
async def echo(upstream: Callable[..., Awaitable[Any]], pool: Pool) -> None:
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")


# -- names (pure) -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server_name", "found"),
    [
        ("a.test", "A"),
        ("A.Test.", "A"),
        ("x.w.test", "W"),
        ("w.test", None),  # a wildcard covers one label, not its parent
        ("a.b.w.test", None),  # nor two labels
        ("exact.w.test", "E"),  # exact beats wildcard
        ("", None),
        (None, None),
        ("127.0.0.1", None),
    ],
)
def test_names_exact_then_wildcard_one_label(server_name: str | None, found: str | None) -> None:
    index = NameIndex.build(
        [(["a.test"], "A"), (["*.w.test"], "W"), (["exact.w.test"], "E"), (["a.test"], "later")]
    )
    assert index.find(server_name) == found


# -- serving ------------------------------------------------------------------------------------


async def test_https_is_served_and_upstreams_hear_it_came_over_tls(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    pair = write_pair(ca, tmp_path / "a", "a.test")
    server = await tls_gateway(TlsConfig(certificates=(pair,)))
    context = client_context(ca)
    async with aiohttp.ClientSession() as session:
        url = f"https://a.test:{server.tls_ports[0]}/x"
        resolver = {"a.test": "127.0.0.1"}
        connector = aiohttp.TCPConnector(resolver=_Static(resolver), ssl=context)
        async with aiohttp.ClientSession(connector=connector) as tls_session:
            for _ in range(3):  # kept alive
                async with tls_session.get(url) as answer:
                    assert answer.status == 200
                    seen = dict((await answer.json())["headers"])
                    assert seen["X-Forwarded-Proto"] == "https"
            payload = os.urandom(1000 * 1000)  # a body large enough to be spliced, under TLS
            async with tls_session.post(url, data=io.BytesIO(payload)) as answer:
                assert (await answer.json())["body"] == len(payload)
        async with session.get(f"http://127.0.0.1:{server.port}/x") as answer:
            assert dict((await answer.json())["headers"])["X-Forwarded-Proto"] == "http"
    tally = server.tls.tally
    assert sum(tally.ok.values()) + sum(tally.resumed.values()) == 1
    assert set(tally.ok) <= {"TLSv1.3", "TLSv1.2"}


async def test_sni_chooses_exact_then_wildcard_and_unknown_gets_the_default(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    first = write_pair(ca, tmp_path / "a", "a.test")
    wild = write_pair(ca, tmp_path / "w", "*.w.test")
    exact = write_pair(ca, tmp_path / "e", "exact.w.test")
    server = await tls_gateway(TlsConfig(certificates=(first, wild, exact)))
    port = server.tls_ports[0]
    trusting = client_context(ca)
    anyone = client_context(ca, check_hostname=False)
    for name, expected in [
        ("a.test", ["a.test"]),
        ("x.w.test", ["*.w.test"]),
        ("exact.w.test", ["exact.w.test"]),
    ]:
        names, _, _, answer = await asyncio.to_thread(handshake, port, trusting, name)
        assert names == expected
        assert answer.startswith(b"HTTP/1.1 200 ")
    for name in ("unknown.test", None):  # no SNI, or a name nobody covers: the first listed
        names, *_ = await asyncio.to_thread(handshake, port, anyone, name)
        assert names == ["a.test"]


async def test_unknown_names_refused_when_asked(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    pair = write_pair(ca, tmp_path / "a", "a.test")
    server = await tls_gateway(TlsConfig(certificates=(pair,), unknown_name="refuse"))
    anyone = client_context(ca, check_hostname=False)
    # Refused during the ClientHello. uvloop closes the connection without flushing the
    # unrecognized_name alert OpenSSL made, so the client reads an EOF, not the alert.
    with pytest.raises(ssl.SSLError):
        await asyncio.to_thread(handshake, server.tls_ports[0], anyone, "unknown.test")
    names, *_ = await asyncio.to_thread(handshake, server.tls_ports[0], anyone, "a.test")
    assert names == ["a.test"]
    assert server.tls.tally.failed["unknown_name"] == 1


async def test_sessions_are_resumed_and_rotation_changes_the_ticket_key(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    pair = write_pair(ca, tmp_path / "a", "a.test")
    server = await tls_gateway(TlsConfig(certificates=(pair,)))
    port, context = server.tls_ports[0], client_context(ca)
    _, resumed, session, _ = await asyncio.to_thread(handshake, port, context, "a.test")
    assert not resumed
    _, resumed, _, _ = await asyncio.to_thread(handshake, port, context, "a.test", session)
    assert resumed
    server.tls.store.rotate()
    _, resumed, _, _ = await asyncio.to_thread(handshake, port, context, "a.test", session)
    assert not resumed  # the old ticket's key is gone
    assert sum(server.tls.tally.resumed.values()) == 1


async def test_no_tickets_when_off(tls_gateway, echo, ca: trustme.CA, tmp_path: Path) -> None:
    pair = write_pair(ca, tmp_path / "a", "a.test")
    server = await tls_gateway(TlsConfig(certificates=(pair,), session_tickets=False))
    port, context = server.tls_ports[0], client_context(ca)
    _, _, session, _ = await asyncio.to_thread(handshake, port, context, "a.test")
    _, resumed, _, _ = await asyncio.to_thread(handshake, port, context, "a.test", session)
    assert not resumed


async def test_tls_1_1_and_plain_http_and_garbage_are_refused_and_counted(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    pair = write_pair(ca, tmp_path / "a", "a.test")
    server = await tls_gateway(TlsConfig(certificates=(pair,), handshake_timeout=0.5))
    port = server.tls_ports[0]
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.check_hostname, old.verify_mode = False, ssl.CERT_NONE
    with warnings.catch_warnings():  # TLS 1.0 and 1.1 are deprecated: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")  # this client would send it; the gateway refuses
    with pytest.raises(ssl.SSLError):  # refused, with an alert that says why
        await asyncio.to_thread(handshake, port, old, "a.test")
    for data in (b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n", b"\x00garbage" * 20):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        async with asyncio.timeout(5):
            answer = await reader.read()  # to the close
        writer.close()
        if data.startswith(b"GET"):
            assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")  # as nginx answers
        else:
            assert answer == b""  # not TLS, not HTTP: nothing to say
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"\x16\x03\x01\x00")  # a ClientHello that never finishes
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # closed after handshake_timeout
    writer.close()
    failed = server.tls.tally.failed
    assert failed["plain_http"] == 1
    assert failed["protocol"] == 2  # TLS 1.1, garbage
    assert failed["timeout"] == 1


async def test_a_changed_file_is_served_to_new_connections_and_a_bad_one_refused(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    pair = write_pair(ca, tmp_path / "a", "a.test")
    server = await tls_gateway(TlsConfig(certificates=(pair,), watch_interval=0))
    store = server.tls.store
    port, context = server.tls_ports[0], client_context(ca, check_hostname=False)
    # A connection opened before the change keeps serving across it.
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="a.test"
    )
    writer.write(request)
    assert (await read_answer(reader)).startswith(b"HTTP/1.1 200")
    before = store.loaded[(pair.cert_file, pair.key_file)]

    renewed = write_pair(ca, tmp_path / "a", "a.test", "b.test")  # same files, new content
    report = store.reload()
    assert [c.names for c in report.changed] == [("a.test", "b.test")]
    names, *_ = await asyncio.to_thread(handshake, port, context, "b.test")
    assert names == ["a.test", "b.test"]
    writer.write(request)  # the connection opened before still answers
    assert (await read_answer(reader)).startswith(b"HTTP/1.1 200")
    writer.close()

    Path(renewed.key_file).write_text("not a key\n")  # a bad new file: refused, old serves
    report = store.reload()
    assert [(r.file, r.reason) for r in report.refused] == [
        (renewed.key_file, report.refused[0].reason)
    ]
    assert "cannot load the pair" in report.refused[0].reason
    assert store.reload_failures == 1
    names, *_ = await asyncio.to_thread(handshake, port, context, "b.test")
    assert names == ["a.test", "b.test"]
    assert store.loaded[(pair.cert_file, pair.key_file)] is not before
    store.reload()  # the same bad file again: not counted twice
    assert store.reload_failures == 1


async def test_limits_count_connections_in_their_handshake(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    pair = write_pair(ca, tmp_path / "a", "a.test")
    server = await tls_gateway(
        TlsConfig(certificates=(pair,)), limits=ListenerLimits(max_connections=2)
    )
    port = server.tls_ports[0]
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    gate = server._gate
    assert gate is not None
    await eventually(lambda: gate.open == 2, what="both connections counted against the limit")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # over the limit: closed before any handshake
    writer.close()
    for _, w in held:
        w.close()


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """One answer framed by Content-Length, head and body."""
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return head + await reader.readexactly(length)


class _Static(aiohttp.abc.AbstractResolver):
    """Resolves the test's names to loopback (aiohttp sends SNI for the URL's host)."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list:
        return [
            {
                "hostname": host,
                "host": self.names[host],
                "port": port,
                "family": socket.AF_INET,
                "proto": 0,
                "flags": 0,
            }
        ]

    async def close(self) -> None:
        pass


# -- answers around HTTPS: ACME challenges, redirects, HSTS --------------------------------------


async def test_acme_challenges_are_answered_on_the_plain_listener_only(
    tls_gateway, pool: Pool, upstream, ca: trustme.CA, tmp_path: Path
) -> None:
    route = {"https_redirect": True}  # the challenge path is answered before any redirect
    pool.set_service(routing("web", hosts=["a.test"], route_extra=route))
    await upstream("web", "u1")
    challenges = tmp_path / "acme" / "challenges"
    challenges.mkdir(parents=True)
    (challenges / "tok_EN-1").write_bytes(b"tok_EN-1.thumbprint")
    pair = write_pair(ca, tmp_path / "a", "a.test")
    managed = str(tmp_path / "acme" / "certificates")
    server = await tls_gateway(TlsConfig(certificates=(pair,), managed_dir=managed))
    port = server.port
    answer = await raw_request(
        port,
        b"GET /.well-known/acme-challenge/tok_EN-1 HTTP/1.1\r\nHost: a.test\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\ntok_EN-1.thumbprint")
    for target in (b"tok_EN-2", b"..%2Fcertificates", b"a/b", b""):
        answer = await raw_request(
            port,
            b"GET /.well-known/acme-challenge/"
            + target
            + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 404 "), (target, answer)
    # Over TLS the path is the service's like any other.
    _, _, _, answer = await asyncio.to_thread(
        handshake,
        server.tls_ports[0],
        client_context(ca),
        "a.test",
        None,
        b"GET /.well-known/acme-challenge/tok_EN-1 HTTP/1.1\r\nHost: a.test\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert b'"upstream": "u1"' in answer


async def test_https_redirect_and_hsts(
    tls_gateway, pool: Pool, upstream, ca: trustme.CA, tmp_path: Path
) -> None:
    extra = {"https_redirect": True, "hsts": {"max_age": "1h", "include_subdomains": True}}
    pool.set_service(routing("web", hosts=["a.test"], route_extra=extra))
    pool.set_service(routing("other", hosts=["b.test"]))
    await upstream("web", "u1")
    await upstream("other", "u2")
    pair = write_pair(ca, tmp_path / "a", "a.test", "b.test")
    server = await tls_gateway(TlsConfig(certificates=(pair,)))
    tls_port = server.tls_ports[0]
    answer = await raw_request(
        server.port,
        b"POST /x?y=1 HTTP/1.1\r\nHost: a.test:8080\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 308 Permanent Redirect\r\n")
    assert f"\r\nLocation: https://a.test:{tls_port}/x?y=1\r\n".encode() in answer
    assert b"Strict-Transport-Security" not in answer  # never over plain HTTP
    answer = await raw_request(
        server.port, b"GET / HTTP/1.1\r\nHost: b.test\r\nConnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 200 ")  # a service without the redirect
    _, _, _, answer = await asyncio.to_thread(
        handshake, tls_port, client_context(ca), "a.test", None,
        b"GET /x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    )  # fmt: skip
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert b"\r\nStrict-Transport-Security: max-age=3600; includeSubDomains\r\n" in answer
    _, _, _, answer = await asyncio.to_thread(
        handshake, tls_port, client_context(ca), "b.test", None,
        b"GET / HTTP/1.1\r\nHost: b.test\r\nConnection: close\r\n\r\n",
    )  # fmt: skip
    assert b"Strict-Transport-Security" not in answer


# -- records: what a TLS connection carries after its handshake ---------------------------------

BIG = 8 * 1024 * 1024


def big_app() -> web.Application:
    """``/big``: 8 MiB, the same bytes every time."""
    body = bytes(range(256)) * (BIG // 256)

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/big", big)
    return app


def exchange(port: int, context: ssl.SSLContext, data: bytes, pause: float = 0.0) -> bytes:
    """Send ``data`` at once, wait ``pause`` before reading, read to the close; a close
    without close_notify raises (``suppress_ragged_eofs=False``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="a.test", suppress_ragged_eofs=False) as tls:
            tls.sendall(data)
            time.sleep(pause)
            answer = bytearray()
            while chunk := tls.recv(1 << 20):
                answer += chunk
            return bytes(answer)


async def test_a_large_answer_to_a_slow_reader_arrives_whole_and_ends_with_close_notify(
    tls_gateway, upstream, pool: Pool, ca: trustme.CA, tmp_path: Path
) -> None:
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", app=big_app())
    server = await tls_gateway(TlsConfig(certificates=(write_pair(ca, tmp_path, "a.test"),)))
    request = b"GET /big HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
    # The client reads nothing for a second: the gateway's writes pause, then resume.
    answer = await asyncio.to_thread(
        exchange, server.tls_ports[0], client_context(ca), request, 1.0
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == bytes(range(256)) * (BIG // 256)


async def test_pipelined_requests_in_one_record_are_answered_in_order(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    server = await tls_gateway(TlsConfig(certificates=(write_pair(ca, tmp_path, "a.test"),)))
    requests = b"".join(
        f"GET /{i} HTTP/1.1\r\nHost: a.test\r\n{close}\r\n".encode()
        for i, close in ((1, ""), (2, ""), (3, "Connection: close\r\n"))
    )
    answer = await asyncio.to_thread(exchange, server.tls_ports[0], client_context(ca), requests)
    assert answer.count(b"HTTP/1.1 200 ") == 3
    paths = [answer.index(f'"path": "/{i}"'.encode()) for i in (1, 2, 3)]
    assert paths == sorted(paths)


async def test_a_clients_close_notify_is_answered_with_one_and_the_connection_closed(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    server = await tls_gateway(TlsConfig(certificates=(write_pair(ca, tmp_path, "a.test"),)))
    port, context = server.tls_ports[0], client_context(ca)

    def keep_then_unwrap() -> bytes:
        raw = socket.create_connection(("127.0.0.1", port), timeout=5)
        with context.wrap_socket(raw, server_hostname="a.test") as tls:
            tls.sendall(b"GET /k HTTP/1.1\r\nHost: a.test\r\n\r\n")
            answer = tls.recv(65536)
            plain = tls.unwrap()  # sends close_notify, returns on the gateway's
            assert plain.recv(1) == b""  # then the gateway closed the connection
            return answer

    answer = await asyncio.to_thread(keep_then_unwrap)
    assert answer.startswith(b"HTTP/1.1 200 ")
    await eventually(lambda: not server.connections, what="the connection closed")


async def test_a_websocket_over_tls_is_relayed_both_ways_and_closed_with_its_code(
    tls_gateway, upstream, pool: Pool, ca: trustme.CA, tmp_path: Path
) -> None:
    codes: list[int | None] = []

    async def echo_socket(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            await ws.send_bytes(message.data[::-1])
        codes.append(ws.close_code)
        return ws

    app = web.Application()
    app.router.add_get("/ws", echo_socket)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", app=app)
    server = await tls_gateway(TlsConfig(certificates=(write_pair(ca, tmp_path, "a.test"),)))
    connector = aiohttp.TCPConnector(
        resolver=_Static({"a.test": "127.0.0.1"}), ssl=client_context(ca)
    )
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.ws_connect(f"wss://a.test:{server.tls_ports[0]}/ws") as ws:
            for size in (5, 70_000, 1_000_000):  # one record, several, many
                payload = os.urandom(size)
                await ws.send_bytes(payload)
                answer = await ws.receive(timeout=10)
                assert answer.data == payload[::-1]
            await ws.close(code=4000)
        # aiohttp's upstream answers any close with 1000; had its frame not come back
        # through the gateway, the client would have given up with 1006
        assert ws.close_code == 1000
    assert codes == [4000]  # the client's close frame reached the upstream whole


async def test_an_idle_tls_connection_is_never_parked_and_serves_after_its_idle_spell(
    tls_gateway, echo, ca: trustme.CA, tmp_path: Path
) -> None:
    # Its TLS state lives in the transport: parking (``proxy.parking``) takes plain HTTP
    # connections only, and a plain one beside it is parked.
    pair = write_pair(ca, tmp_path / "a", "a.test")
    limits = ListenerLimits(park_after=0.1)
    server = await tls_gateway(TlsConfig(certificates=(pair,)), limits=limits)
    request = b"GET /x HTTP/1.1\r\nHost: a.test\r\n\r\n"
    secure = await asyncio.open_connection(
        "127.0.0.1", server.tls_ports[0], ssl=client_context(ca), server_hostname="a.test"
    )
    plain = await asyncio.open_connection("127.0.0.1", server.port)
    gate = server._gate
    assert gate is not None
    try:
        for reader, writer in (secure, plain):
            writer.write(request)
            async with asyncio.timeout(5):
                assert (await read_response(reader))[0].startswith(b"HTTP/1.1 200")
        await eventually(lambda: gate.parked == 1, what="the plain connection parked")
        await asyncio.sleep(0.5)  # idle five times park_after: the TLS one would be parked
        assert gate.parked == 1  # the plain one alone
        assert server.connections == 2

        reader, writer = secure
        writer.write(request)
        async with asyncio.timeout(5):
            assert (await read_response(reader))[0].startswith(b"HTTP/1.1 200")
    finally:
        for _, writer in (secure, plain):
            writer.close()
