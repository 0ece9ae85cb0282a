"""End to end: W3C Trace Context through the real gateway to a real replica (one that answers
with the headers it got). The replica always gets one valid traceparent: the client's trace
with the gateway's hop as its parent id, or a new trace; tracestate goes on with a valid
one; the request id (answers, error bodies, the access log) is the trace id and the hop's
span id. With ``tracing.propagate: false`` both headers pass through untouched."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.eventually import eventually

from .conftest import Gateways, serving
from .test_auth import echo_spec

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"
VALID = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-0[01]")


async def get(session: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, Any, Any]:
    async with session.get(url, headers=headers) as response:
        return response.status, response.headers.copy(), await response.json()


def received(body: dict[str, Any]) -> tuple[str, str, str]:
    """The replica's traceparent: its trace id, parent id and flags (it must be valid)."""
    match = VALID.fullmatch(body["headers"]["traceparent"])
    assert match is not None, body["headers"]
    trace_id, parent_id = match[1], match[2]
    assert trace_id != "0" * 32
    assert parent_id != "0" * 16
    return trace_id, parent_id, body["headers"]["traceparent"][-2:]


async def test_trace_context_goes_upstream_and_into_the_request_id(
    gateways: Gateways, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    gw = await gateways.start(access_log={"enabled": True, "format": "json", "path": str(log)})
    await serving(gw, echo_spec(tmp_path, route={"path_prefix": "/echo"}))
    async with aiohttp.ClientSession() as s:
        # The client's trace continued: the same trace id, the gateway's hop as the parent.
        status, headers, body = await get(
            s, gw.url + "/echo", traceparent=TRACEPARENT, tracestate="congo=t61rcWkgMzE,rojo=1"
        )
        assert status == 200
        trace_id, parent_id, flags = received(body)
        assert (trace_id, flags) == (TRACE, "01")
        assert parent_id != PARENT
        assert body["headers"]["tracestate"] == "congo=t61rcWkgMzE,rojo=1"
        request_id = f"{trace_id}-{parent_id}"
        assert headers["X-Request-Id"] == body["headers"]["x-request-id"] == request_id

        # None: a new trace (sampled at 1 % by default), and no tracestate.
        _, headers, body = await get(s, gw.url + "/echo")
        trace_id, parent_id, _ = received(body)
        assert trace_id != TRACE
        assert headers["X-Request-Id"] == f"{trace_id}-{parent_id}"

        # Invalid (upper-case hex): replaced by a new trace, its tracestate dropped.
        _, _, body = await get(
            s, gw.url + "/echo", traceparent=TRACEPARENT.upper(), tracestate="rojo=1"
        )
        trace_id, _, _ = received(body)
        assert trace_id not in (TRACE, TRACE.upper())
        assert "tracestate" not in body["headers"]

        # The gateway's own error answer carries the trace id in its request id.
        status, headers, body = await get(s, gw.url + "/nowhere", traceparent=TRACEPARENT)
        assert status == 404
        assert body["request_id"] == headers["X-Request-Id"]
        assert body["request_id"].startswith(TRACE + "-")
        error_id = body["request_id"]

    def logged() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    await eventually(
        lambda: {request_id, error_id} <= {r["request_id"] for r in logged()},
        timeout=5,
        what="the access log's lines of both requests",
    )


async def test_propagate_false_passes_trace_headers_untouched(
    gateways: Gateways, tmp_path: Path
) -> None:
    gw = await gateways.start(tracing={"propagate": False})
    await serving(gw, echo_spec(tmp_path))
    async with aiohttp.ClientSession() as s:
        _, headers, body = await get(
            s, gw.url + "/echo", traceparent=TRACEPARENT.upper(), tracestate="rojo=1"
        )
        assert body["headers"]["traceparent"] == TRACEPARENT.upper()
        assert body["headers"]["tracestate"] == "rojo=1"
        assert len(headers["X-Request-Id"]) == 32  # the gateway's own id, as before
        _, _, body = await get(s, gw.url + "/echo")
        assert "traceparent" not in body["headers"]
        assert "tracestate" not in body["headers"]
