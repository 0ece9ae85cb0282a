"""Header injection: nothing a client sends can put CR/LF in a header the gateway writes.

X-Forwarded-For is the peer address, X-Forwarded-Host the (validated) Host, X-Request-Id the
client's only when it is well formed. A Host that is not ``host[:port]`` and a header value
that is not UTF-8 (aiohttp's writer would drop its bytes, so the upstream would see another
value than the one the gateway routed on) are refused with 400.
"""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from gateway.config import ProbeConfig, parse_settings
from gateway.wire import headers
from tests.gateway.conftest import routing

from .conftest import send_raw

VALID_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


@pytest.fixture
async def served(pool, recording, gateway):
    pool.set_service(routing("web", prefix="/"))
    rec = await recording("web", "u1")
    return await gateway(), rec


@pytest.mark.parametrize(
    "client_id",
    [b"a" * 129, b"id with spaces", b"id\tx", b"x;y", b"caf\xc3\xa9", b"", b"%0d%0aX-Evil:1"],
)
async def test_a_malformed_request_id_is_replaced(served, client_id):
    gw, rec = served
    raw = (
        b"GET / HTTP/1.1\r\nHost: h\r\nX-Request-Id: "
        + client_id
        + b"\r\nConnection: close\r\n\r\n"
    )
    answer = await send_raw(gw.port, raw)
    assert answer.statuses == [200]
    [sent] = rec.requests[0].header(b"x-request-id")
    assert sent != client_id.strip()
    assert VALID_ID.fullmatch(sent)
    assert f"X-Request-Id: {sent.decode()}".encode() in answer.data


async def test_a_well_formed_request_id_is_kept(served):
    gw, rec = served
    raw = b"GET / HTTP/1.1\r\nHost: h\r\nX-Request-Id: abc-123.x:y_z\r\nConnection: close\r\n\r\n"
    await send_raw(gw.port, raw)
    assert rec.requests[0].header(b"x-request-id") == [b"abc-123.x:y_z"]


def test_request_id_is_matched_whole_not_up_to_a_newline():
    # ``re.match(r"^...$")`` accepts "abc\n": "$" also matches before a final newline.
    for bad in ("abc\n", "abc\r\n", "abc\nX-Evil: 1"):
        assert headers.request_id(bad) != bad


async def test_forwarded_headers_are_the_gateways_own(served):
    gw, rec = served
    raw = (
        b"GET / HTTP/1.1\r\nHost: shop.example:8080\r\nX-Forwarded-For: 6.6.6.6\r\n"
        b"X-Forwarded-Host: evil.example\r\nX-Forwarded-Proto: https\r\nConnection: close\r\n\r\n"
    )
    await send_raw(gw.port, raw)
    sent = rec.requests[0]
    assert sent.header(b"x-forwarded-for") == [b"127.0.0.1"]
    assert sent.header(b"x-forwarded-host") == [b"shop.example:8080"]
    assert sent.header(b"x-forwarded-proto") == [b"http"]
    assert b"\r\n\r\n" not in sent.head[:-4]


@pytest.mark.parametrize(
    "host",
    [b"a@admin.example", b"admin.example/x", b"admin.example:80@x", b"a b", b"x,y", b"[::1"],
)
async def test_a_host_that_is_not_host_port_is_refused(served, host):
    gw, rec = served
    answer = await send_raw(gw.port, b"GET / HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
    assert answer.statuses == [400]
    assert answer.closed
    assert rec.raw == []


async def test_a_host_with_invalid_utf8_cannot_route_one_way_and_forward_another(
    pool, recording, gateway
):
    """Routed on "admin.exampl\\udcffe" (no match: the public service), the upstream would
    have been sent "admin.example" with that byte dropped by aiohttp's writer."""
    pool.set_service(routing("admin", hosts=["admin.example"]))
    pool.set_service(routing("public", prefix="/"))
    admin = await recording("admin", "a1")
    public = await recording("public", "p1")
    gw = await gateway()
    for raw in (
        b"GET / HTTP/1.1\r\nHost: admin.exampl\xffe\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nX-User: ad\xffmin\r\n\r\n",
    ):
        answer = await send_raw(gw.port, raw)
        assert answer.statuses == [400]
    assert admin.raw == []
    assert public.raw == []


async def test_utf8_header_values_cross_unchanged(served):
    gw, rec = served
    await send_raw(
        gw.port, "GET / HTTP/1.1\r\nHost: h\r\nX-Name: café\r\nConnection: close\r\n\r\n".encode()
    )
    assert rec.requests[0].header(b"x-name") == ["café".encode()]


@pytest.mark.parametrize(
    "probe_headers",
    [
        {"X-A": "b\r\nX-Injected: 1"},
        {"X-A": "b\nc"},
        {"X-A": "\x00"},
        {"X A": "b"},
        {"X-A\r\n": "b"},
    ],
)
def test_probe_headers_cannot_carry_a_line_break(probe_headers):
    with pytest.raises(ValidationError):
        parse_settings(ProbeConfig, {"headers": probe_headers})
