"""Inbound HTTP/2 against the real gateway and real replica processes (issue 55): streams on
one connection, each routed to a replica and answered; the same through worker processes,
which import ``h2`` only at their first HTTP/2 connection."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tests.support.eventually import eventually
from tests.support.h2_client import H2Client

from .conftest import Gateways, serving, spec


async def streams_answered(port: int, count: int) -> set[bytes]:
    """``count`` streams on one connection, all in flight at once: their bodies."""
    client = await H2Client.connect(port)
    try:
        streams = [client.request(f"/?n={i}") for i in range(count)]
        answers = await client.get(*streams, within=10)
    finally:
        await client.close()
    assert [a.status for a in answers] == [200] * count
    return {bytes(a.body) for a in answers}


async def test_streams_on_one_connection_reach_real_replicas(gateways: Gateways, site) -> None:
    gw = await gateways.start()
    await serving(gw, spec(site("v1"), 2))
    port = gw.gateway.traffic.port
    assert await streams_answered(port, 20) == {b"v1"}
    if shutil.which("curl") is None:
        pytest.skip("needs curl for the rest")
    process = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "-m",
        "10",
        "--http2-prior-knowledge",
        f"http://127.0.0.1:{port}/",
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    assert (process.returncode, out) == (0, b"v1")


async def test_worker_processes_serve_http2(gateways: Gateways, site) -> None:
    gw = await gateways.start(workers=2)
    await serving(gw, spec(site("v1"), 1))
    supervisor = gw.gateway.traffic
    port = supervisor.port
    for _ in range(3):  # connections land on either worker
        assert await streams_answered(port, 8) == {b"v1"}
    held = await H2Client.connect(port)  # counted in gateway_http2_connections
    try:
        await held.get(held.request("/"))
        await eventually(lambda: supervisor.http2 == 1, what="the workers report it")
    finally:
        await held.close()
    await eventually(lambda: supervisor.http2 == 0, what="the workers report it gone")
