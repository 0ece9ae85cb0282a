"""TLS to replicas (``wire.upstream_tls``, ``proxy.connector``): a context made once per
config and again when its files change; the connections' keys apart per config; a
connector's TLS connections to a real TLS upstream on loopback, the answers relayed, a
failed verification a connect error that says why, and a kept connection never handed to
another config or a plain request."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme

from gateway.config import UpstreamTlsConfig
from gateway.errors import UpstreamConnectError
from gateway.pool.upstream import address_of
from gateway.proxy.connector import Connector
from gateway.wire.upstream_tls import RECHECK, UpstreamTls, UpstreamTlsError
from tests.support.raw_servers import RawServers

from .test_connector import run

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def write_ca(ca: trustme.CA, path: Path) -> str:
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture
async def tls_upstream(ca: trustme.CA) -> AsyncIterator[tuple[int, list[int]]]:
    """A TLS upstream for ``127.0.0.1`` (signed by ``ca``) answering OK to every request;
    the list counts its handshakes done."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    handshakes: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handshakes.append(1)
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(OK)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    servers = RawServers()
    server = await servers.start(serve, ssl=context)
    yield server.sockets[0].getsockname()[1], handshakes
    await servers.close()


def test_a_context_is_made_once_and_again_when_a_file_changes(
    ca: trustme.CA, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_ca(ca, tmp_path / "ca.pem")
    tls = UpstreamTls(UpstreamTlsConfig(ca=path), "http/1.1")
    first = tls.context(100.0)
    assert tls.context(100.0 + RECHECK / 2) is first
    assert tls.context(100.0 + RECHECK) is first  # looked at: unchanged
    write_ca(trustme.CA(), tmp_path / "ca.pem")
    os.utime(path, (1, 1))  # a change within the clock's resolution still shows
    assert tls.context(100.0 + RECHECK * 1.5) is first  # not looked at yet
    second = tls.context(100.0 + RECHECK * 2)
    assert second is not first
    Path(path).write_text("broken\n")
    os.utime(path, (2, 2))
    with caplog.at_level(logging.WARNING):
        assert tls.context(100.0 + RECHECK * 3) is second  # the last good one stays
    assert "upstream_tls.ca" in caplog.text


def test_a_context_that_cannot_be_made_says_which_file_and_why(tmp_path: Path) -> None:
    tls = UpstreamTls(UpstreamTlsConfig(ca=str(tmp_path / "none.pem")), "h2")
    with pytest.raises(UpstreamTlsError, match=r"upstream_tls\.ca: cannot read") as caught:
        tls.context(0.0)
    assert caught.value.field == "ca"


def test_each_config_keeps_its_connections_apart_from_plain_ones() -> None:
    a = UpstreamTls.of(UpstreamTlsConfig(server_name="a.test"), "http/1.1")
    assert UpstreamTls.of(UpstreamTlsConfig(server_name="a.test"), "http/1.1") is a
    b = UpstreamTls.of(UpstreamTlsConfig(server_name="b.test"), "http/1.1")
    h2 = UpstreamTls.of(UpstreamTlsConfig(server_name="a.test"), "h2")
    address = address_of("127.0.0.1", 443)
    keys = {address, a.key(address), b.key(address), h2.key(address)}
    assert len(keys) == 4


class _Chose:
    def __init__(self, protocol: str | None) -> None:
        self.protocol = protocol

    def selected_alpn_protocol(self) -> str | None:
        return self.protocol


def test_h2_not_chosen_by_alpn_is_a_refusal() -> None:
    h2 = UpstreamTls(UpstreamTlsConfig(), "h2")
    assert h2.refusal(_Chose("h2")) is None  # type: ignore[arg-type]
    assert h2.refusal(_Chose(None)) == (  # type: ignore[arg-type]
        "the replica did not agree on h2 by ALPN (it chose none)"
    )
    http1 = UpstreamTls(UpstreamTlsConfig(), "http/1.1")
    assert http1.refusal(_Chose(None)) is None  # type: ignore[arg-type]


async def test_connections_over_tls_are_kept_and_reused_under_their_config_only(
    ca: trustme.CA, tmp_path: Path, tls_upstream: tuple[int, list[int]]
) -> None:
    port, handshakes = tls_upstream
    trusted = UpstreamTls(UpstreamTlsConfig(ca=write_ca(ca, tmp_path / "ca.pem")), "http/1.1")
    unchecked = UpstreamTls(UpstreamTlsConfig(verify=False), "http/1.1")
    connector = Connector()
    try:
        conn = await connector.connect("127.0.0.1", port, 5, trusted)
        assert await run(conn) == b"ok"
        connector.release(conn)
        address = address_of("127.0.0.1", port)
        assert connector.idle(address) is None  # never to a plain request
        assert connector.idle(unchecked.key(address)) is None  # nor to another config
        again = await connector.acquire("127.0.0.1", port, 5, trusted)
        assert again is conn
        assert await run(again) == b"ok"
        other = await connector.acquire("127.0.0.1", port, 5, unchecked)
        assert other is not conn
        assert await run(other) == b"ok"
        assert len(handshakes) == 2
    finally:
        connector.close()


async def test_a_failed_verification_is_a_connect_error_that_says_why(
    tmp_path: Path, tls_upstream: tuple[int, list[int]]
) -> None:
    port, _ = tls_upstream
    other = write_ca(trustme.CA(), tmp_path / "other.pem")
    connector = Connector()
    for config, why in [
        (UpstreamTlsConfig(ca=other), "certificate verify failed"),
        (UpstreamTlsConfig(server_name="elsewhere.test"), "certificate failed verification"),
    ]:
        with pytest.raises(UpstreamConnectError, match="failed verification") as caught:
            await connector.connect("127.0.0.1", port, 5, UpstreamTls(config, "http/1.1"))
        assert caught.value.kind == "connect"
        assert why in str(caught.value) or "verif" in str(caught.value)
    assert repr(connector) == "<Connector idle=0 busy=0>"
    connector.close()
