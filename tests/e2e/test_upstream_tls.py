"""TLS to the replicas (``upstream_tls``) through the real gateway: HTTPS replicas on
loopback (aiohttp with an ``ssl`` context, certificates made by trustme) for HTTP/1.1, and
grpcio replicas with ``grpc.ssl_server_credentials`` for ``upstream_protocol: http2``.

Requests are routed over TLS; a replica whose certificate is not trusted, or not for the
name checked, never becomes healthy (its probe says why) and gets no traffic; ``verify:
false`` takes any certificate (and the service's view says so); a client certificate is
presented where the replica requires one; a replica that does not agree on h2 by ALPN is
never used for HTTP/2."""

from __future__ import annotations

import asyncio
import hashlib
import io
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from tests.support.eventually import eventually
from tests.support.raw_servers import cleanup_runner

from .conftest import Gateways, Handle, serving

grpc = pytest.importorskip("grpc")

GRPC_REPLICA = f"{sys.executable} {Path(__file__).with_name('grpc_replica.py')} $PORT"
HTTP_PROBE: dict[str, Any] = {
    "type": "http",
    "path": "/",
    "interval": 0.1,
    "timeout": 1,
    "healthy_threshold": 1,
}
GRPC_PROBE: dict[str, Any] = {**HTTP_PROBE, "type": "grpc"}
del GRPC_PROBE["path"]
ROLLOUT = {"start_timeout": 10, "drain_timeout": 2, "stop_grace": 1}
BIG = bytes(range(256)) * 4096 * 3
"""3 MiB: above the splice's threshold both ways (``wire.splice.RAW_BODY_MIN``)."""


class Pem:
    """PEM files written for one test: a CA's certificate, and certificates it issued."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def ca(self, ca: trustme.CA, name: str = "ca") -> str:
        path = self.directory / f"{name}.pem"
        ca.cert_pem.write_to_path(str(path))
        return str(path)

    def pair(self, ca: trustme.CA, stem: str, *names: str) -> tuple[str, str]:
        """A certificate for ``names`` (and its key), as files ``<stem>.crt`` and ``.key``."""
        issued = ca.issue_cert(*names)
        cert, key = self.directory / f"{stem}.crt", self.directory / f"{stem}.key"
        cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
        issued.private_key_pem.write_to_path(str(key))
        return str(cert), str(key)


class HttpsReplica:
    """An HTTPS replica on loopback: answers ``<name>`` and the client certificate's names
    it was shown (``client=-`` without one); records the SNI each handshake sent."""

    def __init__(self, name: str, cert: str, key: str, *, client_ca: str | None = None) -> None:
        self.name = name
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(client_ca)
        self.server_names: list[str | None] = []
        self.context.sni_callback = lambda _obj, sni, _ctx: self.server_names.append(sni)
        self.served = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> HttpsReplica:
        app = web.Application(client_max_size=2 * len(BIG))
        app.router.add_get("/", self._answer)
        app.router.add_get("/big", self._big)
        app.router.add_post("/digest", self._digest)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.context)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await cleanup_runner(self._runner)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _big(self, request: web.Request) -> web.Response:
        return web.Response(body=io.BytesIO(BIG))

    async def _digest(self, request: web.Request) -> web.Response:
        return web.Response(text=hashlib.sha256(await request.read()).hexdigest())

    async def _answer(self, request: web.Request) -> web.Response:
        self.served += 1
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        names = [v for k, v in (peer or {}).get("subjectAltName", ()) if k == "DNS"]
        return web.Response(text=f"{self.name} client={','.join(names) or '-'}")


def static_spec(addresses: list[str], upstream_tls: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "backend": "static",
        "replicas": len(addresses),
        "replica": {"addresses": addresses},
        "probes": [HTTP_PROBE],
        "upstream_tls": upstream_tls,
        "retries": {"attempts": 2},
        "rollout": ROLLOUT,
        **extra,
    }


async def get(handle: Handle, path: str = "/", count: int = 1) -> list[tuple[int, str]]:
    async with aiohttp.ClientSession() as session:
        out = []
        for _ in range(count):
            async with session.get(handle.url + path) as answer:
                out.append((answer.status, await answer.text()))
        return out


def probe_failure(handle: Handle, address: str, name: str = "web") -> str:
    """The last failure the probes of the replica at ``address`` met ("" if none)."""
    for replica in handle.replicas(name=name):
        if replica.address == address:
            return replica.probe_failure or ""
    return ""


def healthy(handle: Handle, address: str, name: str = "web") -> bool:
    pool = handle.gateway.pool.services[name]
    return any(u.address == address and u.routable for u in pool.snapshot.upstreams)


@pytest.fixture
def pem(tmp_path: Path) -> Pem:
    return Pem(tmp_path / "pem")


@pytest.fixture
async def replicas() -> AsyncIterator[Callable[..., Any]]:
    """``await start(name, cert, key, client_ca=None)``: an ``HttpsReplica``, stopped at the
    end of the test."""
    started: list[HttpsReplica] = []

    async def start(name: str, cert: str, key: str, **settings: Any) -> HttpsReplica:
        replica = await HttpsReplica(name, cert, key, **settings).__aenter__()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.__aexit__(None)


@pytest.mark.parametrize("workers", [1, 2])
async def test_https_replicas_are_routed_and_an_untrusted_one_never_healthy(
    gateways: Gateways, ca: trustme.CA, pem: Pem, replicas: Any, workers: int
) -> None:
    good = await replicas("good", *pem.pair(ca, "good", "127.0.0.1"))
    bad = await replicas("bad", *pem.pair(trustme.CA(), "bad", "127.0.0.1"))
    gw = await gateways.start(workers=workers)
    await gw.controller.apply(static_spec([good.address, bad.address], {"ca": pem.ca(ca)}))

    await eventually(lambda: healthy(gw, good.address), what="the trusted replica healthy")
    reason = await eventually(
        lambda: probe_failure(gw, bad.address), what="the untrusted replica's probe failure"
    )
    assert "certificate failed verification" in reason, reason
    assert not healthy(gw, bad.address)
    admin = f"http://127.0.0.1:{gw.gateway.admin.port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{admin}/api/services/web") as answer:
            view = await answer.json()
    shown = {r["address"]: r["probe_failure"] for r in view["replicas"]}
    assert shown[good.address] is None
    assert "certificate failed verification" in shown[bad.address], shown

    answers = await get(gw, count=20)
    assert set(answers) == {(200, "good client=-")}, answers
    assert bad.served == 0
    # The name checked, and sent, is the replica's host: an IP address (checked, not sent).
    assert set(good.server_names) == {None}


async def test_the_server_name_is_sent_and_checked(
    gateways: Gateways, ca: trustme.CA, pem: Pem, replicas: Any
) -> None:
    replica = await replicas("named", *pem.pair(ca, "named", "replica.test"))
    gw = await gateways.start()
    tls = {"ca": pem.ca(ca), "server_name": "replica.test"}
    await serving(gw, static_spec([replica.address], tls))
    assert await get(gw, count=3) == [(200, "named client=-")] * 3
    assert set(replica.server_names) == {"replica.test"}

    wrong = {
        **static_spec([replica.address], {**tls, "server_name": "wrong.test"}),
        "name": "wrong",
        "route": {"path_prefix": "/wrong"},
    }
    await gw.controller.apply(wrong)
    reason = await eventually(
        lambda: probe_failure(gw, replica.address, "wrong"), what="the wrong name's failure"
    )
    assert "certificate failed verification" in reason, reason
    assert "wrong.test" in reason or "mismatch" in reason, reason
    assert not healthy(gw, replica.address, "wrong")
    [(status, _)] = await get(gw, "/wrong")
    assert status == 503


async def test_verify_false_takes_any_certificate_and_the_view_says_so(
    gateways: Gateways, pem: Pem, replicas: Any
) -> None:
    replica = await replicas("anyone", *pem.pair(trustme.CA(), "anyone", "elsewhere.test"))
    gw = await gateways.start()
    await serving(gw, static_spec([replica.address], {"verify": False}))
    assert await get(gw, count=3) == [(200, "anyone client=-")] * 3

    admin = f"http://127.0.0.1:{gw.gateway.admin.port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{admin}/api/services/web") as answer:
            view = await answer.json()
    assert answer.status == 200, view
    assert view["spec"]["upstream_tls"]["verify"] is False
    assert any("upstream_tls.verify is false" in w for w in view["warnings"]), view["warnings"]


async def test_a_client_certificate_is_presented_where_the_replica_requires_one(
    gateways: Gateways, ca: trustme.CA, pem: Pem, replicas: Any
) -> None:
    client_ca = trustme.CA()
    replica = await replicas(
        "mtls", *pem.pair(ca, "mtls", "127.0.0.1"), client_ca=pem.ca(client_ca, "client-ca")
    )
    cert, key = pem.pair(client_ca, "client", "gateway.client")
    gw = await gateways.start()
    await serving(gw, static_spec([replica.address], {"ca": pem.ca(ca), "cert": cert, "key": key}))
    assert await get(gw, count=3) == [(200, "mtls client=gateway.client")] * 3

    # The same replica, for a service that presents no certificate: refused by the replica.
    anonymous = {
        **static_spec([replica.address], {"ca": pem.ca(ca)}),
        "name": "anonymous",
        "route": {"path_prefix": "/anonymous"},
    }
    await gw.controller.apply(anonymous)
    reason = await eventually(
        lambda: probe_failure(gw, replica.address, "anonymous"), what="the refused probe"
    )
    assert "does the replica require a client certificate?" in reason, reason
    assert not healthy(gw, replica.address, "anonymous")


async def test_a_replica_that_does_not_agree_on_h2_is_never_healthy(
    gateways: Gateways, ca: trustme.CA, pem: Pem, replicas: Any
) -> None:
    replica = await replicas("h1only", *pem.pair(ca, "h1only", "127.0.0.1"))
    gw = await gateways.start()
    data = static_spec([replica.address], {"ca": pem.ca(ca)}, upstream_protocol="http2")
    await gw.controller.apply({**data, "probes": [GRPC_PROBE]})
    reason = await eventually(lambda: probe_failure(gw, replica.address), what="the h2 refusal")
    assert "did not agree on h2 by ALPN" in reason, reason
    assert not healthy(gw, replica.address)


@pytest.mark.parametrize("workers", [1, 2])
async def test_grpc_over_tls_to_replicas_that_require_a_client_certificate(
    gateways: Gateways, ca: trustme.CA, pem: Pem, workers: int
) -> None:
    client_ca = trustme.CA()
    server_cert, server_key = pem.pair(ca, "grpc", "127.0.0.1")
    cert, key = pem.pair(client_ca, "client", "gateway.client")
    gw = await gateways.start(workers=workers)
    await serving(
        gw,
        {
            "name": "web",
            "route": {"path_prefix": "/"},
            "replicas": 2,
            "replica": {
                "commands": [GRPC_REPLICA],
                "env": {
                    "TLS_CERT": server_cert,
                    "TLS_KEY": server_key,
                    "TLS_CLIENT_CA": pem.ca(client_ca, "client-ca"),
                },
            },
            "probes": [GRPC_PROBE],
            "upstream_protocol": "http2",
            "upstream_tls": {"ca": pem.ca(ca), "cert": cert, "key": key},
            "rollout": ROLLOUT,
        },
    )

    def unary() -> list[bytes]:
        with grpc.insecure_channel(f"127.0.0.1:{gw.gateway.traffic.port}") as channel:
            call = channel.unary_unary("/test.Echo/Unary")
            return [call(b"hello %d" % i, timeout=5) for i in range(8)]

    answers = await asyncio.to_thread(unary)
    assert answers == [b"v1:hello %d" % i for i in range(8)]


async def test_the_default_tcp_probe_makes_the_handshake_too(
    gateways: Gateways, ca: trustme.CA, pem: Pem, replicas: Any
) -> None:
    good = await replicas("good", *pem.pair(ca, "good", "127.0.0.1"))
    bad = await replicas("bad", *pem.pair(trustme.CA(), "bad", "127.0.0.1"))
    gw = await gateways.start()
    data = static_spec([good.address, bad.address], {"ca": pem.ca(ca)})
    del data["probes"]  # the default: a TCP probe, which passes once the handshake does
    await gw.controller.apply(data)
    await eventually(lambda: healthy(gw, good.address), what="the trusted replica healthy")
    reason = await eventually(lambda: probe_failure(gw, bad.address), what="the bad handshake")
    assert reason.startswith("tcp probe: TLS: the replica's certificate failed verification")
    assert not healthy(gw, bad.address)


async def test_large_bodies_go_both_ways_over_tls(
    gateways: Gateways, ca: trustme.CA, pem: Pem, replicas: Any
) -> None:
    replica = await replicas("big", *pem.pair(ca, "big", "127.0.0.1"))
    gw = await gateways.start()
    await serving(gw, static_spec([replica.address], {"ca": pem.ca(ca)}))
    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # on a kept connection after the first
            async with session.get(gw.url + "/big") as answer:
                assert answer.status == 200
                assert await answer.read() == BIG
            async with session.post(gw.url + "/digest", data=io.BytesIO(BIG)) as answer:
                assert answer.status == 200
                assert await answer.text() == hashlib.sha256(BIG).hexdigest()
