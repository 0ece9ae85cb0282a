"""Hostile clients on the HTTPS listener (issue 23): what each sends, what the gateway does.

The gateway is a ``TrafficServer`` with a ``Termination`` in front of a real upstream, as in
``tests/gateway/test_tls.py`` (whose helpers these reuse); the attackers are raw sockets, real
``ssl`` clients and ``openssl s_client``, all on loopback. A handshake refused or cut off is
counted in ``Termination.tally`` by reason, which is what ``gateway_tls_handshake_failures_total``
reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import resource
import shutil
import socket
import ssl
import statistics
import time
from pathlib import Path

import pytest
import trustme
import uvloop

from gateway import Pool, ProxyConfig, TlsConfig
from gateway.config import ListenerLimits
from gateway.proxy import Proxy
from gateway.server import TrafficServer
from gateway.tls import FAILURE_REASONS, Termination
from tests.gateway.conftest import tls_gateway  # noqa: F401 - a fixture, registered by import
from tests.gateway.test_tls import (  # noqa: F401 - fixtures, registered by import
    client_context,
    echo,
    handshake,
    write_pair,
)
from tests.support.eventually import eventually

from .conftest import MiB, rss

REQUEST = b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n"


def client_hello(server_name: str = "a.test") -> bytes:
    """The bytes of a real ClientHello (TLS 1.2 and 1.3 offered), as Python's ssl sends it."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def closed_after(port: int, data: bytes, within: float) -> tuple[bytes, float]:
    """Send ``data`` on a new connection; what came back until the gateway closed, and when."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        writer.write(data)
        async with asyncio.timeout(within):
            with contextlib.suppress(ConnectionResetError):
                while chunk := await reader.read(65536):
                    got += chunk
    finally:
        writer.close()
    return got, time.perf_counter() - started


async def served(port: int, context: ssl.SSLContext) -> float:
    """A well-behaved client: handshake, one request, the answer. Seconds it took."""
    started = time.perf_counter()
    *_, answer = await asyncio.to_thread(handshake, port, context, "a.test")
    assert answer.startswith(b"HTTP/1.1 200 ")
    return time.perf_counter() - started


@pytest.fixture
async def https(tls_gateway, echo, ca: trustme.CA, tmp_path: Path):  # noqa: F811
    """``await https(**TlsConfig and ProxyConfig fields)``: a TLS gateway serving ``a.test``."""
    pair = write_pair(ca, tmp_path / "a", "a.test")

    async def start(handshake_timeout: float = 10.0, **config):
        tls = TlsConfig(certificates=(pair,), handshake_timeout=handshake_timeout)
        return await tls_gateway(tls, **config)

    return start


async def test_a_clienthello_trickled_a_byte_at_a_time_is_cut_off_and_costs_nothing_after(
    https, ca: trustme.CA
) -> None:
    """Slowloris on TLS: 100 connections each send a real ClientHello one byte every 50 ms
    (it would take 25 s); ``handshake_timeout`` (1 s) closes every one, well-behaved clients
    are served meanwhile. Three times: the last wave costs no more memory than the first kept
    (nothing accumulates), and afterwards every slot of ``max_connections`` (100) is free.
    The last wave, not the second: in a long test session the first wave may take memory the
    allocator had free, and the second then the pages the first did not need to map."""
    attackers = 100
    server = await https(
        handshake_timeout=1.0, limits=ListenerLimits(max_connections=attackers + 1)
    )
    port, context = server.tls_ports[0], client_context(ca)
    hello = client_hello()

    async def trickle() -> float:
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for byte in hello:  # never finished within the timeout
                if reader.at_eof():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)
            async with asyncio.timeout(10):
                await reader.read()  # the gateway's close
        except ConnectionError:
            pass
        finally:
            writer.close()
        return time.perf_counter() - started

    gate = server._gate
    assert gate is not None
    grew = []
    for wave in (1, 2, 3):
        gc.collect()
        before = rss()
        attacks = [asyncio.create_task(trickle()) for _ in range(attackers)]
        await eventually(
            lambda: gate.open == attackers, what=f"the {attackers} attackers counted by the gate"
        )
        # One slot is left: a client is served while the 100 hold theirs.
        during = [await served(port, context) for _ in range(5)]
        lasted = await asyncio.gather(*attacks)
        gc.collect()
        grew.append(rss() - before)
        print(
            f"\nTLS slowloris x{attackers}, wave {wave} (ClientHello of {len(hello)} bytes,"
            f" 1 byte / 50 ms): cut off after {min(lasted):.2f}-{max(lasted):.2f} s; a client"
            f" meanwhile {statistics.median(during) * 1000:.1f} ms; RSS of this process grew"
            f" {grew[-1] / MiB:.1f} MiB"
        )
        assert min(lasted) > 0.9
        assert max(lasted) < 3.0  # the 1 s timeout, not the 25 s the attack wanted
        assert server.tls.tally.failed["timeout"] == wave * attackers
        assert max(during) < 2.0
    assert grew[-1] < max(grew[0] / 2, 4 * MiB)  # the first wave's memory was reused

    # Nothing is left behind: every slot of max_connections takes a new client at once.
    held = await asyncio.gather(
        *(
            asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="a.test")
            for _ in range(attackers + 1)
        )
    )
    for _, writer in held:
        writer.close()
    assert sum(server.tls.tally.ok.values()) == 3 * 5 + attackers + 1


GARBAGE = {
    "random_bytes": bytes(range(256)) * 4,
    "ssh_banner": b"SSH-2.0-OpenSSH_9.6\r\n",
    "sslv2_hello": bytes.fromhex("801c01000200030000001001008000") + b"\x01" * 16,
    "record_too_long": b"\x16\x03\x01\xff\xff" + b"\0" * 64,
    "server_hello_to_a_server": b"\x16\x03\x03\x00\x04\x02\x00\x00\x00",
    "alert_first": b"\x15\x03\x03\x00\x02\x02\x28",
    "hello_then_garbage": client_hello()[:50] + b"\xff" * 2000,
}


@pytest.mark.parametrize("data", GARBAGE.values(), ids=GARBAGE.keys())
async def test_garbage_instead_of_a_clienthello_is_closed_at_once(
    https, ca: trustme.CA, recorder, data: bytes
) -> None:
    """Bytes that are no ClientHello: OpenSSL refuses them as soon as it reads them, long
    before the 10 s handshake timeout; nothing reaches an upstream; counted as ``protocol``."""
    server = await https(handshake_timeout=10.0)
    port = server.tls_ports[0]
    got, took = await closed_after(port, data, within=5)
    assert took < 1.0
    assert got == b"" or got[:1] == b"\x15"  # nothing, or a TLS alert: never HTTP
    assert server.tls.tally.failed == dict.fromkeys(FAILURE_REASONS, 0) | {"protocol": 1}
    assert recorder.records == []
    assert (await served(port, client_context(ca))) < 2.0  # and the next client is served


PLAIN = {
    "get": b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
    "post": b"POST /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\nhello",
    "head_http10": b"HEAD / HTTP/1.0\r\n\r\n",
    "put": b"PUT /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 0\r\n\r\n",
}


@pytest.mark.parametrize("data", PLAIN.values(), ids=PLAIN.keys())
async def test_plain_http_to_the_tls_port_is_answered_400_and_counted(
    https, recorder, data: bytes
) -> None:
    """Plain HTTP on the TLS port gets nginx's answer, 400 in plain text, at once, and the
    close; counted as ``plain_http``. Nothing reaches an upstream."""
    server = await https(handshake_timeout=10.0)
    got, took = await closed_after(server.tls_ports[0], data, within=5)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"\r\nConnection: close" in head
    assert body == b"The plain HTTP request was sent to an HTTPS port.\n"
    assert took < 1.0
    assert server.tls.tally.failed["plain_http"] == 1
    assert recorder.records == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_client_initiated_renegotiation_is_refused(https, ca: trustme.CA, tmp_path) -> None:
    """A TLS 1.2 client asks to renegotiate (``R`` in ``openssl s_client``), the CPU lever of
    CVE-2011-1473: the server context has ``OP_NO_RENEGOTIATION``, so OpenSSL answers with a
    ``no_renegotiation`` alert instead of a second handshake; only the first is counted."""
    server = await https()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    client = await asyncio.create_subprocess_exec(
        "openssl", "s_client", "-tls1_2", "-connect", f"127.0.0.1:{server.tls_ports[0]}",
        "-servername", "a.test", "-CAfile", str(ca_file), "-verify_return_error",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert client.stdin is not None
    assert client.stdout is not None
    try:
        async with asyncio.timeout(10):
            seen = await client.stdout.readuntil(b"---\n")  # the handshake was made
            while b"Verify return code: 0 (ok)" not in seen:
                seen += await client.stdout.readuntil(b"\n")
            client.stdin.write(b"R\n")  # s_client's command: renegotiate
            await client.stdin.drain()
            rest = await client.stdout.read()  # to the end: the server's refusal ends it
            await client.wait()
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()
    text = rest.decode(errors="replace")
    print(f"\nopenssl s_client -tls1_2, R: {text.strip().splitlines()[-1:]}")
    assert "RENEGOTIATING" in text
    assert "no renegotiation" in text
    tally = server.tls.tally
    assert tally.ok == {"TLSv1.2": 1}  # the first handshake only
    assert tally.resumed == {}
    assert (await served(server.tls_ports[0], client_context(ca))) < 2.0


async def test_a_flood_of_handshakes_beyond_max_connections_is_refused_at_accept(
    https, ca: trustme.CA
) -> None:
    """400 clients begin a handshake at once against ``max_connections: 50``: 50 are taken
    (handshakes in flight count against the limit), the other 350 are closed at accept
    before OpenSSL sees a byte (no handshake work, none counted as failed); once the 50 go,
    new clients are served again."""
    limit, clients = 50, 400
    server = await https(limits=ListenerLimits(max_connections=limit))
    port, context = server.tls_ports[0], client_context(ca)

    async def one() -> asyncio.StreamWriter | None:
        try:
            async with asyncio.timeout(10):
                _, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=context, server_hostname="a.test"
                )
            return writer
        except (ssl.SSLError, ConnectionError):
            return None

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one() for _ in range(clients)))
    took = time.perf_counter() - started
    held = [w for w in outcomes if w is not None]
    tally = server.tls.tally
    print(
        f"\n{clients} handshakes at once, max_connections {limit}: {len(held)} taken,"
        f" {clients - len(held)} refused at accept, in {took:.2f} s"
    )
    assert len(held) == limit
    assert sum(tally.ok.values()) == limit
    assert sum(tally.failed.values()) == 0  # the refused never reached OpenSSL
    for writer in held:
        writer.close()
    await eventually(lambda: server.connections == 0, what="the closes to reach the gateway")
    assert (await served(port, context)) < 2.0


async def test_many_idle_tls_connections_do_not_starve_a_new_client(https, ca: trustme.CA) -> None:
    """1,000 TLS connections that made one request and sit idle in keep-alive, and 500
    that opened TCP and never sent a ClientHello: a new client is still served at once, and
    the idle ones are still open (nothing was shed to serve it)."""
    idle, silent = 1000, 500
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * (idle + silent) + 200:
        pytest.skip(f"ulimit -n {soft} is too low for {idle + silent} connections on each side")
    server = await https(
        handshake_timeout=30.0, limits=ListenerLimits(max_connections=idle + silent + 10)
    )
    port, context = server.tls_ports[0], client_context(ca)
    baseline = [await served(port, context) for _ in range(10)]

    gate = asyncio.Semaphore(64)

    async def idle_one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with gate:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=context, server_hostname="a.test"
            )
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            return reader, writer

    before = rss()
    async with asyncio.timeout(40):
        kept = await asyncio.gather(*(idle_one() for _ in range(idle)))
        quiet = [await asyncio.open_connection("127.0.0.1", port) for _ in range(silent)]
    grown = rss() - before
    try:
        during = [await served(port, context) for _ in range(10)]
        alive = sum(not reader.at_eof() for reader, _ in kept)
    finally:
        for _, writer in kept + quiet:
            writer.close()
    print(
        f"\n{idle} idle TLS connections + {silent} silent: a new client p50"
        f" {statistics.median(during) * 1000:.1f} ms (baseline"
        f" {statistics.median(baseline) * 1000:.1f} ms); RSS of this process (gateway and"
        f" clients) grew {grown / MiB:.1f} MiB"
    )
    assert alive == idle
    assert max(during) < 2.0


def test_a_connection_closed_before_its_first_byte_is_counted_not_an_error_under_uvloop(
    ca: trustme.CA, tmp_path: Path
) -> None:
    """A port scanner, or a load balancer's TCP check: connect, close (FIN), no byte sent.
    Under uvloop, as the gateway runs, each such connection must be counted as ``closed``
    and nothing else: not an exception in the loop, which would log a traceback per connection
    (an attacker's way to flood the error log). The tests' other cases run on asyncio's loop,
    which behaves here; this one runs on uvloop."""
    pair = write_pair(ca, tmp_path / "a", "a.test")
    errors: list[str] = []

    async def scenario() -> dict[str, int]:
        asyncio.get_running_loop().set_exception_handler(
            lambda _, context: errors.append(repr(context.get("exception")))
        )
        settings = ProxyConfig(
            listen="127.0.0.1:0",
            listen_tls=("127.0.0.1:0",),
            tls=TlsConfig(certificates=(pair,)),
        )
        server = TrafficServer(Proxy(Pool(), settings, []), settings, tls=Termination(settings.tls))
        await server.start()
        try:
            for _ in range(20):
                # Blocking, on purpose: the kernel completes the connection from its backlog
                # and the FIN arrives before the gateway's loop accepts it.
                socket.create_connection(("127.0.0.1", server.tls_ports[0])).close()
                await asyncio.sleep(0.01)  # clients one after another, not one burst
            await eventually(
                lambda: sum(server.tls.tally.failed.values()) + len(errors) >= 20,
                timeout=1,
                every=0.01,
                what="the 20 closes to reach the gateway",
            )
            return dict(server.tls.tally.failed)
        finally:
            await server.stop()

    failed = uvloop.run(scenario())
    assert errors == []
    assert failed["closed"] == 20
