"""gRPC through the real gateway (issue 55): grpcio clients over h2c to a service with
``upstream_protocol: http2`` whose replicas are grpcio servers (``grpc_replica.py``, started
by the process backend): the four kinds of call, a replica's status and message, the
gateway's own errors as trailers-only answers, ``grpc-timeout``, and the gRPC probe."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from gateway.health import grpc_probe
from gateway.health.probe_client import ProbeError
from tests.support.eventually import eventually
from tests.support.h2_client import H2Client

from .conftest import Gateways, Handle, serving

grpc = pytest.importorskip("grpc")

REPLICA = f"{sys.executable} {Path(__file__).with_name('grpc_replica.py')} $PORT"
TCP_PROBE = {"type": "tcp", "interval": 0.1, "timeout": 0.5, "healthy_threshold": 1}
T = TypeVar("T")


def grpc_spec(replicas: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "replicas": replicas,
        "replica": {"commands": [REPLICA]},
        "probes": [TCP_PROBE],
        "upstream_protocol": "http2",
        "rollout": {"start_timeout": 10, "drain_timeout": 5, "stop_grace": 1},
        **extra,
    }


async def call(port: int, use: Callable[[Any], T]) -> T:
    """``use(channel)`` on a grpcio channel to the gateway, off the loop (grpcio's sync API
    blocks; the gateway runs on this loop)."""

    def run() -> T:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            return use(channel)

    return await asyncio.to_thread(run)


@pytest.fixture
async def gw(gateways: Gateways) -> Handle:
    handle = await gateways.start()
    await serving(handle, grpc_spec())
    return handle


async def test_the_four_kinds_of_call(gw: Handle) -> None:
    port = gw.gateway.traffic.port

    def unary(channel: Any) -> bytes:
        return channel.unary_unary("/test.Echo/Unary")(b"hi", timeout=5)

    def server_streaming(channel: Any) -> list[bytes]:
        return list(channel.unary_stream("/test.Echo/Split")(b"abc", timeout=5))

    def client_streaming(channel: Any) -> bytes:
        return channel.stream_unary("/test.Echo/Join")(iter([b"a", b"b", b"c"]), timeout=5)

    def bidi(channel: Any) -> list[bytes]:
        return list(channel.stream_stream("/test.Echo/Chat")(iter([b"x", b"y"]), timeout=5))

    assert await call(port, unary) == b"v1:hi"
    assert await call(port, server_streaming) == [b"a", b"b", b"c"]
    assert await call(port, client_streaming) == b"abc"
    assert await call(port, bidi) == [b"X", b"Y"]


async def test_a_large_stream_both_ways(gw: Handle) -> None:
    """More than the windows hold, each way: flow control, not buffering, carries it."""
    big = bytes(range(256)) * 1024  # 256 KiB a message

    def chat(channel: Any) -> list[int]:
        answers = channel.stream_stream("/test.Echo/Chat")(iter([big] * 4), timeout=10)
        return [len(a) for a in answers]

    assert await call(gw.gateway.traffic.port, chat) == [len(big)] * 4


async def test_a_replicas_status_and_message_reach_the_client(gw: Handle) -> None:
    def not_found(channel: Any) -> tuple[Any, str]:
        try:
            channel.unary_unary("/test.Echo/Unary")(b"not-found", timeout=5)
        except grpc.RpcError as e:
            return e.code(), e.details()
        raise AssertionError("the call succeeded")

    code, details = await call(gw.gateway.traffic.port, not_found)
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "no such thing: not-found")


async def test_nothing_routable_is_unavailable_with_the_gateways_reason(
    gateways: Gateways,
) -> None:
    handle = await gateways.start()
    # A static address nothing listens on: never healthy, never routable.
    await handle.controller.apply(
        grpc_spec(backend="static", replica={"addresses": ["127.0.0.1:9"]})
    )
    port = handle.gateway.traffic.port

    def unary(channel: Any) -> tuple[Any, str]:
        try:
            channel.unary_unary("/test.Echo/Unary")(b"hi", timeout=5)
        except grpc.RpcError as e:
            return e.code(), e.details()
        raise AssertionError("the call succeeded")

    code, details = await call(port, unary)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "no routable upstream" in details, details


def message(data: bytes) -> bytes:
    """One gRPC message as framed on the wire (uncompressed)."""
    return b"\0" + len(data).to_bytes(4, "big") + data


async def test_grpc_timeout_bounds_the_call(gw: Handle) -> None:
    """The gateway's own deadline (a raw client: grpcio would give up on its own first)."""
    client = await H2Client.connect(gw.gateway.traffic.port)
    try:
        stream = client.request(
            "/test.Echo/Unary",
            method="POST",
            headers=[
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("grpc-timeout", "200m"),
            ],
            body=message(b"sleep:3"),
        )
        (answer,) = await client.get(stream, within=5)
    finally:
        await client.close()
    assert answer.status == 200
    assert answer.headers.get(b"grpc-status") == b"4", answer
    assert answer.headers.get(b"content-type") == b"application/grpc"
    assert not answer.body


async def test_grpc_timeout_bounds_the_wait_for_a_replica(gateways: Gateways) -> None:
    """Nothing routable and a long ``queue_timeout``: the call is held for a replica until
    its own deadline, then answered DEADLINE_EXCEEDED (not UNAVAILABLE at the queue's end)."""
    handle = await gateways.start()
    # A static address nothing listens on: never healthy, never routable.
    await handle.controller.apply(
        grpc_spec(backend="static", replica={"addresses": ["127.0.0.1:9"]}, queue_timeout=30)
    )
    client = await H2Client.connect(handle.gateway.traffic.port)
    loop = asyncio.get_running_loop()
    try:
        began = loop.time()
        stream = client.request(
            "/test.Echo/Unary",
            method="POST",
            headers=[
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("grpc-timeout", "300m"),
            ],
            body=message(b"hi"),
        )
        (answer,) = await client.get(stream, within=10)
        waited = loop.time() - began
    finally:
        await client.close()
    assert (answer.status, answer.headers.get(b"grpc-status")) == (200, b"4"), answer
    assert b"while it waited for a replica" in answer.headers[b"grpc-message"]
    assert 0.3 <= waited < 5, waited


async def test_a_grpc_error_is_never_a_json_body(gw: Handle) -> None:
    """An HTTP/2 request to no route: JSON for a plain client, trailers-only for gRPC."""
    await gw.controller.apply(grpc_spec(route={"path_prefix": "/test.Echo/"}))
    client = await H2Client.connect(gw.gateway.traffic.port)
    try:
        plain = client.request("/nowhere")
        rpc = client.request(
            "/nowhere.Service/Call",
            method="POST",
            headers=[("content-type", "application/grpc+proto"), ("te", "trailers")],
            body=message(b""),
        )
        answers = await client.get(plain, rpc, within=5)
    finally:
        await client.close()
    assert (answers[0].status, answers[0].body[:1]) == (404, b"{")
    assert (answers[1].status, bytes(answers[1].body)) == (200, b"")
    assert answers[1].headers[b"grpc-status"] == b"12"  # UNIMPLEMENTED


async def test_a_grpc_probe_asks_the_health_service(gateways: Gateways) -> None:
    """``{type: grpc, service}``: ``grpc.health.v1.Health/Check`` gates the replica; a
    service the replica does not know fails the probe with its status."""
    handle = await gateways.start()
    probe = {"type": "grpc", "service": "test.Echo", "interval": 0.1, "healthy_threshold": 1}
    await serving(handle, grpc_spec(probes=[probe]))

    def unary(channel: Any) -> bytes:
        return channel.unary_unary("/test.Echo/Unary")(b"hi", timeout=5)

    assert await call(handle.gateway.traffic.port, unary) == b"v1:hi"
    (replica,) = handle.replicas()
    host, _, port = replica.address.rpartition(":")
    assert await grpc_probe.check(host, int(port), "test.Echo", authority=replica.address) == 1
    assert await grpc_probe.check(host, int(port), "", authority=replica.address) == 1
    with pytest.raises(ProbeError, match="grpc-status 5"):  # NOT_FOUND
        await grpc_probe.check(host, int(port), "nope", authority=replica.address)


async def test_a_rolling_update_under_unary_calls_fails_none(gateways: Gateways) -> None:
    handle = await gateways.start()
    await serving(handle, grpc_spec(2))
    port = handle.gateway.traffic.port
    stop = threading.Event()
    seen: list[bytes] = []
    failures: list[str] = []

    def loop(channel: Any) -> None:
        unary = channel.unary_unary("/test.Echo/Unary")
        while not stop.is_set():
            try:
                seen.append(unary(b"x", timeout=5))
            except grpc.RpcError as e:
                failures.append(f"{e.code()}: {e.details()}")

    calls = asyncio.ensure_future(call(port, loop))
    try:
        await eventually(lambda: len(seen) >= 20, what="calls answered by v1")
        v2 = grpc_spec(2)
        v2["replica"]["env"] = {"NAME": "v2"}
        await serving(handle, v2, revision=2)
        await eventually(lambda: seen[-1:] == [b"v2:x"], what="calls answered by v2")
    finally:
        stop.set()
        await calls
    assert not failures, failures[:5]
    assert b"v1:x" in seen


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({"auth": {"type": "bearer"}}, "UNAUTHENTICATED"),
        (
            {"rate_limits": [{"path_prefix": "/", "key": "ip", "rps": 0.01, "burst": 1}]},
            "RESOURCE_EXHAUSTED",
        ),
    ],
)
async def test_auth_and_rate_limits_answer_in_grpc(
    gateways: Gateways, extra: dict[str, Any], code: str
) -> None:
    handle = await gateways.start()
    await serving(handle, grpc_spec(**extra))

    def twice(channel: Any) -> list[Any]:
        codes = []
        for _ in range(2):
            try:
                channel.unary_unary("/test.Echo/Unary")(b"hi", timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        return codes

    codes = await call(handle.gateway.traffic.port, twice)
    assert codes[-1] == getattr(grpc.StatusCode, code), codes


async def test_a_refused_grpc_head_is_answered_in_grpc(gw: Handle) -> None:
    """A head the codec refuses (a field over ``max_header_size``: 431 to a plain client)."""
    client = await H2Client.connect(gw.gateway.traffic.port)
    try:
        stream = client.request(
            "/test.Echo/Unary",
            method="POST",
            headers=[
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("x-big", "x" * 20_000),
            ],
            body=message(b"hi"),
        )
        (answer,) = await client.get(stream, within=5)
    finally:
        await client.close()
    assert (answer.status, bytes(answer.body)) == (200, b"")
    assert answer.headers[b"grpc-status"] == b"13", answer  # INTERNAL, as gRPC maps 431


async def scraped(handle: Handle, family: str) -> dict[str, float]:
    """The samples of ``family`` on the admin listener's ``/metrics``, by their labels."""
    url = f"http://127.0.0.1:{handle.gateway.admin.port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    return {
        line.rsplit(" ", 1)[0][len(family) :]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(family + "{")
    }


async def test_grpc_statuses_and_protocols_in_metrics_and_the_access_log(
    gateways: Gateways, tmp_path: Path
) -> None:
    """A replica's OK and NOT_FOUND, the gateway's DEADLINE_EXCEEDED and UNIMPLEMENTED
    (no route): counted by status and written in the JSON access log; the HTTP/1.1 request
    and the HTTP/2 ones counted by protocol."""
    log = tmp_path / "access.log"
    handle = await gateways.start(access_log={"enabled": True, "format": "json", "path": str(log)})
    await serving(handle, grpc_spec(route={"path_prefix": "/test.Echo/"}))
    port = handle.gateway.traffic.port

    def calls(channel: Any) -> list[Any]:
        codes = []
        for request in (b"hi", b"not-found"):
            try:
                channel.unary_unary("/test.Echo/Unary")(request, timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        return codes

    assert await call(port, calls) == [grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND]
    client = await H2Client.connect(port)
    try:
        rpc = [("content-type", "application/grpc"), ("te", "trailers")]
        late = client.request(
            "/test.Echo/Unary",
            method="POST",
            headers=[*rpc, ("grpc-timeout", "200m")],
            body=message(b"sleep:3"),
        )
        nowhere = client.request(
            "/nowhere.Service/Call", method="POST", headers=rpc, body=message(b"")
        )
        await client.get(late, nowhere, within=5)
    finally:
        await client.close()
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/test.Echo/Unary") as response,
    ):
        await response.read()

    expected = {'service="web",grpc_status="0"': 1, 'service="web",grpc_status="5"': 1,
                'service="web",grpc_status="4"': 1, 'service="",grpc_status="12"': 1}  # fmt: skip

    async def counted() -> bool:
        grpc_answers = await scraped(handle, "gateway_grpc_responses_total")
        return {
            ",".join(sorted(key.strip("{}").split(","))): n for key, n in grpc_answers.items()
        } == {",".join(sorted(want.split(","))): n for want, n in expected.items()}

    await eventually(counted, what="the gRPC answers counted by status")
    protocols = await scraped(handle, "gateway_downstream_requests_total")
    assert protocols['{protocol="h2"}'] == 4, protocols
    assert protocols['{protocol="http/1.1"}'] == 1, protocols

    def logged() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    await eventually(lambda: len(logged()) == 5, what="five lines in the access log")
    statuses = sorted((line.get("grpc_status", -1), line.get("protocol")) for line in logged())
    assert statuses == [(-1, None), (0, "h2"), (4, "h2"), (5, "h2"), (12, "h2")]
