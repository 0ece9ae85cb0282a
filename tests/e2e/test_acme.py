"""Automatic certificates end to end against real pebble (issue 23, item 3).

Pebble (Let's Encrypt's ACME test server, Debian package ``pebble``) runs on loopback with its
own TLS certificate from a CA made here, and validates every HTTP-01 challenge for real:
``-dnsserver`` points at the tiny DNS responder below (hand-written: an A query for a test
name is answered 127.0.0.1, AAAA and other types with no record, any other name with
NXDOMAIN), and ``httpPort`` at the gateway's plain listener, which serves the answers from
``<state_dir>/acme/challenges``. ``PEBBLE_VA_NOSLEEP=1`` takes out pebble's random waits;
``PEBBLE_VA_ALWAYS_VALID`` is never set. ``PEBBLE_WFE_NONCEREJECT=0``: by default pebble
refuses 5% of good nonces; the library retries one refusal, but two in a row would fail an
order at random, which the manager would retry and these tests would count as a failure.

Orders are counted in pebble's own log (``Added order``), besides the gateway's metric.
Skipped only when pebble is not installed, outside CI (``.ci/pebble.sh`` installs it).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import re
import shutil
import socket
import ssl
import struct
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from controller.acme.client import AcmeClient
from controller.acme.store import AcmeStore
from controller.config import AcmeConfig
from controller.journal import Entry
from tests.needs import missing
from tests.support.eventually import eventually
from tests.support.ports import free_port
from tests.support.raw_servers import cleanup_runner

from .conftest import Gateways, Handle, serving, spec

PEBBLE = shutil.which("pebble")
if PEBBLE is None:
    missing(
        "pebble is not installed (Debian package pebble; .ci/pebble.sh installs it)",
        module=True,
    )

HOST = "app.acme.test"
TEST_NAMES = frozenset({HOST})


# -- DNS: the test names are 127.0.0.1 ---------------------------------------------------------


class DnsResponder(asyncio.DatagramProtocol):
    """Answers A queries for ``names`` with 127.0.0.1 (RFC 1035 wire format, one question)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.queries: list[tuple[str, int]] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment] # a datagram one, not a subclass

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        qid, flags = struct.unpack("!HH", data[:4])
        i, labels = 12, []
        while data[i]:
            labels.append(data[i + 1 : i + 1 + data[i]].decode("ascii").lower())
            i += 1 + data[i]
        (qtype,) = struct.unpack("!H", data[i + 1 : i + 3])
        question = data[12 : i + 5]
        name = ".".join(labels)
        self.queries.append((name, qtype))
        known = name in self.names
        answer = b""
        if known and qtype == 1:  # A: a pointer to the question's name, IN, TTL 60, 4 bytes
            answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton("127.0.0.1")
        # QR, AA, RD copied, RA; NOERROR, or NXDOMAIN for a name it does not know.
        reply_flags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | (0 if known else 3)
        header = struct.pack("!HHHHHH", qid, reply_flags, 1, 1 if answer else 0, 0, 0)
        assert self.transport is not None
        self.transport.sendto(header + question + answer, addr)


# -- pebble -------------------------------------------------------------------------------------


def write_tls_files(directory: Path) -> Path:
    """Pebble's listener certificate (for 127.0.0.1) and the CA that signed it: the gateway's
    ``ca_bundle``. Returns the CA file."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pebble listener test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "cert.pem").write_bytes(leaf.public_bytes(pem))
    (directory / "key.pem").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return directory / "ca.pem"


class Pebble:
    """One pebble process on loopback; ``start`` again after ``stop`` is a new CA."""

    def __init__(self, directory: Path, dns_port: int) -> None:
        self.dir = directory
        self.dns_port = dns_port
        self.ca_bundle = write_tls_files(directory)
        self.port = free_port()
        self.management = free_port()
        self.process: asyncio.subprocess.Process | None = None
        self.log = directory / "pebble.log"

    @property
    def directory_url(self) -> str:
        return f"https://127.0.0.1:{self.port}/dir"

    async def start(self, http_port: int, validity: int | None = None) -> None:
        config: dict[str, Any] = {
            "listenAddress": f"127.0.0.1:{self.port}",
            "managementListenAddress": f"127.0.0.1:{self.management}",
            "certificate": str(self.dir / "cert.pem"),
            "privateKey": str(self.dir / "key.pem"),
            "httpPort": http_port,
            "tlsPort": free_port(),
            "ocspResponderURL": "",
            "externalAccountBindingRequired": False,
        }
        if validity is not None:
            config["certificateValidityPeriod"] = validity
        (self.dir / "pebble.json").write_text(json.dumps({"pebble": config}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PEBBLE_")}
        env |= {"PEBBLE_VA_NOSLEEP": "1", "PEBBLE_WFE_NONCEREJECT": "0"}
        assert PEBBLE is not None, "pebble is not installed: .ci/pebble.sh installs it"
        with self.log.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                PEBBLE, "-config", str(self.dir / "pebble.json"),
                "-dnsserver", f"127.0.0.1:{self.dns_port}",
                env=env, stdout=log, stderr=log,
            )  # fmt: skip
        await eventually(
            lambda: self.listening() or self.exited(), timeout=10, what="pebble to listen"
        )
        assert not self.exited(), self.log.read_text()[-2000:]

    def listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            socket.create_connection(("127.0.0.1", self.management), 0.2).close()
        except OSError:
            return False
        return True

    def exited(self) -> bool:
        return self.process is not None and self.process.returncode is not None

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            await asyncio.wait_for(self.process.wait(), 10)
        self.process = None

    def count(self, pattern: str) -> int:
        """Lines of pebble's log that match ``pattern``."""
        return len(re.findall(pattern, self.log.read_text()))

    def orders(self) -> int:
        return self.count(r"Added order ")

    async def root_pem(self) -> str:
        """The root of the chain pebble issues under (made anew at each start)."""
        context = ssl.create_default_context(cafile=str(self.ca_bundle))
        url = f"https://127.0.0.1:{self.management}/roots/0"
        async with aiohttp.ClientSession() as session, session.get(url, ssl=context) as r:
            assert r.status == 200
            return await r.text()


@pytest.fixture
async def dns() -> AsyncIterator[tuple[DnsResponder, int]]:
    loop = asyncio.get_running_loop()
    responder = DnsResponder(TEST_NAMES)
    transport, _ = await loop.create_datagram_endpoint(
        lambda: responder, local_addr=("127.0.0.1", 0)
    )
    yield responder, transport.get_extra_info("sockname")[1]
    transport.close()


@pytest.fixture
async def pebble(tmp_path: Path, dns: tuple[DnsResponder, int]) -> AsyncIterator[Pebble]:
    directory = tmp_path / "pebble"
    directory.mkdir()
    p = Pebble(directory, dns[1])
    yield p
    await p.stop()


# -- the gateway --------------------------------------------------------------------------------


def acme(pebble: Pebble, **settings: Any) -> dict[str, Any]:
    return {
        "directory": pebble.directory_url,
        "ca_bundle": str(pebble.ca_bundle),
        "email": "ops@acme.test",
        "retry_min": "0.5s",
        "retry_max": "1s",
        **settings,
    }


def web_spec(site: Callable[[str], str]) -> dict[str, Any]:
    data = spec(site("v1"))
    data["route"] = {"hosts": [HOST], "path_prefix": "/", "tls": "acme"}
    return data


async def start(gateways: Gateways, pebble: Pebble, plain: int, tls: int, **acme_settings: Any):
    return await gateways.start(
        listen=f"127.0.0.1:{plain}",
        listen_tls=[f"127.0.0.1:{tls}"],
        tls={"acme": acme(pebble, **acme_settings)},
    )


def entries(handle: Handle, kind: str) -> list[Entry]:
    return [e for e in handle.controller.journal.since(0) if e.kind == kind]


def stored(state_dir: Path) -> x509.Certificate:
    chain = (state_dir / "acme/certificates" / HOST / "fullchain.pem").read_bytes()
    return x509.load_pem_x509_certificate(chain)


async def admin_json(handle: Handle, path: str) -> Any:
    url = f"http://127.0.0.1:{handle.gateway.admin.port}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        assert r.status == 200, path
        return await (r.json() if path.startswith("/api") else r.text())


async def plain_get(port: int) -> tuple[int, str]:
    url = f"http://127.0.0.1:{port}/"
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers={"Host": HOST}) as r:
            return r.status, (await r.text()).strip()


async def https_get(port: int, root_pem: str) -> tuple[x509.Certificate, bytes]:
    """GET / for HOST over the gateway's TLS listener, trusting only pebble's root: the
    certificate it was served with, and the answer's status line and body."""
    context = ssl.create_default_context(cadata=root_pem)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=HOST), 5
    )
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        writer.write(f"GET / HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    return x509.load_der_x509_certificate(der), answer


async def api_events(handle: Handle, kind: str, count: int) -> list[dict[str, Any]]:
    """The first ``count`` entries of ``kind`` of the service web, as ``/api/events`` streams
    them (from the start of the journal: ``Last-Event-ID: 0``)."""
    url = f"http://127.0.0.1:{handle.gateway.admin.port}/api/events?service=web"
    found: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers={"Last-Event-ID": "0"}) as r:
            assert r.status == 200
            async with asyncio.timeout(10):
                async for line in r.content:
                    if line.startswith(b"data: "):
                        event = json.loads(line[6:])
                        if event["kind"] == kind:
                            found.append(event)
                            if len(found) == count:
                                return found
    raise AssertionError("the stream ended")


def metric(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match, f"{series} not in the metrics"
    return float(match.group(1))


# -- the tests ------------------------------------------------------------------------------------


async def test_a_certificate_is_issued_validated_for_real_and_served(
    gateways: Gateways, pebble: Pebble, dns: tuple[DnsResponder, int], site
) -> None:
    plain, tls = free_port(), free_port()
    await pebble.start(http_port=plain)
    handle = await start(gateways, pebble, plain, tls)
    await serving(handle, web_spec(site))
    [issued] = await eventually(
        lambda: entries(handle, "certificate_issued"), timeout=20, what="the certificate"
    )
    assert issued.service == "web"
    assert f"certificate for {HOST} issued by Pebble Intermediate CA" in issued.message
    assert [e["id"] for e in await api_events(handle, "certificate_issued", 1)] == [issued.id]
    # Validated for real: pebble resolved the name here and fetched the answer from the
    # gateway's plain listener.
    assert (HOST, 1) in dns[0].queries
    assert pebble.count(r"authz \S+ set VALID by completed challenge") == 1
    assert pebble.orders() == 1
    cert = stored(gateways.state_dir)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [HOST]
    # No challenge answer is left behind.
    assert list((gateways.state_dir / "acme/challenges").iterdir()) == []

    status = await admin_json(handle, "/api/certificates")
    [shown] = status["certificates"]
    assert (shown["name"], shown["state"], shown["names"], shown["services"]) == (
        HOST,
        "valid",
        [HOST],
        ["web"],
    )
    assert shown["not_after"] == cert.not_valid_after_utc.timestamp()
    metrics = await admin_json(handle, "/metrics")
    assert metric(metrics, 'gateway_acme_orders_total{outcome="issued"}') == 1
    # gateway status, the real command line.
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.main", "status",
        "--admin", f"http://127.0.0.1:{handle.gateway.admin.port}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    row = next(line for line in out.decode().splitlines() if line.startswith(HOST))
    assert row.split()[:3] == [HOST, "web", "valid"]

    # The data plane serves it over HTTPS, verified against pebble's root only.
    served, answer = await https_get(tls, await pebble.root_pem())
    assert served.serial_number == cert.serial_number
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert answer.rstrip().endswith(b"v1")


async def test_a_short_lived_certificate_is_renewed(
    gateways: Gateways, pebble: Pebble, site
) -> None:
    plain, tls = free_port(), free_port()
    # Pebble issues for 11 s: renewed at about 5.5 s, with as long again to spare on a busy
    # machine before an expired one would make it an issuance.
    await pebble.start(http_port=plain, validity=12)
    handle = await start(gateways, pebble, plain, tls, renew_at=0.5)
    await serving(handle, web_spec(site))
    await eventually(
        lambda: entries(handle, "certificate_issued"), timeout=20, what="the first certificate"
    )
    first = stored(gateways.state_dir)
    lifetime = (first.not_valid_after_utc - first.not_valid_before_utc).total_seconds()
    assert lifetime < 15
    [renewed] = await eventually(
        lambda: entries(handle, "certificate_renewed")[:1], timeout=20, what="a renewal"
    )
    assert f"certificate for {HOST} renewed by Pebble Intermediate CA" in renewed.message
    second = stored(gateways.state_dir)
    assert second.serial_number != first.serial_number
    assert second.not_valid_after_utc > first.not_valid_after_utc
    # Renewed at about half the lifetime (less jitter), before the first one expired.
    renewed_at = datetime.datetime.fromtimestamp(renewed.at, datetime.UTC)
    assert renewed_at < first.not_valid_after_utc
    assert pebble.orders() >= 2
    assert entries(handle, "certificate_failed") == []
    metrics = await admin_json(handle, "/metrics")
    assert metric(metrics, 'gateway_acme_orders_total{outcome="renewed"}') >= 1
    # The renewed certificate, or a later one, is what the data plane serves.
    served, _ = await https_get(tls, await pebble.root_pem())
    assert served.not_valid_after_utc >= second.not_valid_after_utc


async def test_an_unreachable_challenge_fails_is_retried_and_the_service_stays_up(
    gateways: Gateways, pebble: Pebble, dns: tuple[DnsResponder, int], site
) -> None:
    plain, tls, closed = free_port(), free_port(), free_port()
    await pebble.start(http_port=closed)  # nothing listens there
    handle = await start(gateways, pebble, plain, tls)
    await serving(handle, web_spec(site))
    await eventually(
        lambda: len(entries(handle, "certificate_failed")) >= 3, timeout=30, what="three failures"
    )
    first, second, third = entries(handle, "certificate_failed")[:3]
    for n, entry in enumerate((first, second, third), 1):
        assert entry.service == "web"
        assert f"certificate for {HOST} not obtained (failure {n})" in entry.message
        assert "could not validate the HTTP-01 challenge" in entry.message
        assert "onnection refused" in entry.message, entry.message
        assert "served as before, over plain HTTP" in entry.message
    # Backoff: 0.5 s, then 1 s (the cap), each less at most a quarter; an order takes time too.
    assert second.at - first.at >= 0.375
    assert third.at - second.at >= 0.75
    assert pebble.count(r"authz \S+ set VALID") == 0
    streamed = await api_events(handle, "certificate_failed", 3)
    assert [e["message"] for e in streamed] == [e.message for e in (first, second, third)]
    assert (HOST, 1) in dns[0].queries  # the name resolved; the port was closed
    # The service is served over plain HTTP all along.
    assert await plain_get(plain) == (200, "v1")
    assert handle.state().observed.degraded is None
    status = await admin_json(handle, "/api/certificates")
    [shown] = status["certificates"]
    assert shown["state"] == "failing"
    assert shown["failures"] >= 3
    assert "onnection refused" in shown["last_error"]
    assert shown["not_after"] is None
    metrics = await admin_json(handle, "/metrics")
    assert metric(metrics, 'gateway_acme_orders_total{outcome="failed"}') >= 3
    assert metric(metrics, 'gateway_acme_orders_total{outcome="issued"}') == 0
    assert metric(metrics, f'gateway_acme_certificate_failures{{name="{HOST}"}}') >= 3
    assert not (gateways.state_dir / "acme/certificates" / HOST).exists()


async def test_a_restart_reuses_the_stored_certificate_without_an_order(
    gateways: Gateways, pebble: Pebble, site
) -> None:
    plain, tls = free_port(), free_port()
    await pebble.start(http_port=plain)
    first = await start(gateways, pebble, plain, tls)
    await serving(first, web_spec(site))
    await eventually(
        lambda: entries(first, "certificate_issued"), timeout=20, what="the certificate"
    )
    cert = stored(gateways.state_dir)
    account = (gateways.state_dir / "acme/account/key.pem").read_bytes()
    await first.stop()
    assert (pebble.orders(), pebble.count(r"POST /sign-me-up")) == (1, 1)

    second = await start(gateways, pebble, plain, tls)
    await eventually(lambda: second.ready() == 1, timeout=15, what="web's replica ready again")
    assert second.gateway.acme is not None
    await eventually(
        lambda: [c.state for c in second.gateway.acme.status()] == ["valid"],
        timeout=10,
        what="the status",
    )
    [shown] = (await admin_json(second, "/api/certificates"))["certificates"]
    assert shown["not_after"] == cert.not_valid_after_utc.timestamp()
    assert (
        shown["next_order"]
        > cert.not_valid_before_utc.timestamp()
        + 0.6 * (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
    )
    served, answer = await https_get(tls, await pebble.root_pem())
    assert served.serial_number == cert.serial_number
    assert answer.startswith(b"HTTP/1.1 200")
    # Nothing was ordered, and the account was not registered again.
    assert (pebble.orders(), pebble.count(r"POST /sign-me-up")) == (1, 1)
    assert second.gateway.acme.orders == {"issued": 0, "renewed": 0, "failed": 0}
    assert entries(second, "certificate_issued") == []
    assert (gateways.state_dir / "acme/account/key.pem").read_bytes() == account
    assert stored(gateways.state_dir).serial_number == cert.serial_number


async def test_the_client_alone_reuses_its_account_and_registers_again_where_it_is_forgotten(
    tmp_path: Path, pebble: Pebble, dns: tuple[DnsResponder, int]
) -> None:
    """The ACME client without the gateway: pebble validates against a loopback server of
    the test that serves the store's challenge directory, as the data plane does."""
    store = AcmeStore(tmp_path / "acme")
    store.prepare()

    async def answer(request: web.Request) -> web.Response:
        path = store.challenges_dir / request.match_info["token"]
        return web.Response(body=path.read_bytes()) if path.exists() else web.Response(status=404)

    app = web.Application()
    app.router.add_get("/.well-known/acme-challenge/{token}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await pebble.start(http_port=port)
        config = AcmeConfig.model_validate(acme(pebble))
        issued = await AcmeClient(config, store).obtain(HOST)
        first = store.write_certificate(HOST, issued.fullchain_pem, issued.key_pem)
        assert first.certificate.names == (HOST,)
        assert list(store.challenges_dir.iterdir()) == []
        # Another client (a restart) takes the stored account: no new registration.
        again = AcmeClient(config, store)
        await again.obtain(HOST)
        assert (pebble.orders(), pebble.count(r"POST /sign-me-up")) == (2, 1)
        assert again.orders == 1
        # A CA that forgot the account (pebble keeps nothing across a restart): the same key
        # is registered again and the order goes through.
        key = store.account_key()
        await pebble.stop()
        await pebble.start(http_port=port)
        later = AcmeClient(config, store)
        issued = await later.obtain(HOST)
        assert store.account_key() == key
        assert pebble.count(r"POST /sign-me-up") == 2
        renewed = store.write_certificate(HOST, issued.fullchain_pem, issued.key_pem)
        assert renewed.issuer != first.issuer  # the restarted pebble's new intermediate
    finally:
        await cleanup_runner(runner)
