"""End to end: spans of the real gateway (in one process, and with two worker processes)
exported over OTLP/HTTP to a real receiver in the test, which decodes them with
opentelemetry-proto. A sampled request's server span continues the caller's trace, its
client span's id is the parent the upstream got; a retried request has two client spans; a
collector down or slow fails no request and its spans are counted as dropped."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from controller.rollout_traces import trace_id
from tests.support.eventually import eventually
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.ports import free_port
from tests.support.raw_servers import cleanup_runner

from .conftest import Gateways, Handle
from .test_auth import admin, echo_spec, metric

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE}-{PARENT}-01"
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")
SERVER, CLIENT = 2, 3
EXPORTED = "gateway_tracing_spans_exported_total"
DROPPED = "gateway_tracing_spans_dropped_total"


async def upstream(failing: bool) -> tuple[web.AppRunner, int]:
    """An upstream on loopback answering with the headers it got; ``failing``: 503 on
    ``/flaky`` (the other one's answer is 200)."""

    async def answer(request: web.Request) -> web.Response:
        if failing and request.path == "/flaky":
            return web.json_response({"failed": True}, status=503)
        return web.json_response({"headers": {k.lower(): v for k, v in request.headers.items()}})

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


@pytest.fixture
async def upstreams() -> AsyncIterator[list[int]]:
    """Two upstreams: the first answers, the second fails ``/flaky`` with 503."""
    started = [await upstream(False), await upstream(True)]
    yield [port for _, port in started]
    for runner, _ in started:
        await cleanup_runner(runner)


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    await receiver.start()
    yield receiver
    await receiver.stop()


def service(ports: list[int]) -> dict[str, Any]:
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "backend": "static",
        "replica": {"addresses": [f"127.0.0.1:{port}" for port in ports]},
        "load_balancing": "round_robin",
        "retries": {"attempts": 1, "on_status": True},
        "probes": [{"type": "tcp", "interval": 0.2, "healthy_threshold": 1}],
    }


async def start(
    gateways: Gateways, ports: list[int], workers: int, **tracing: Any
) -> tuple[Handle, str]:
    extra = {"workers": workers} if workers > 1 else {}
    gw = await gateways.start(services=[service(ports)], tracing=tracing, **extra)
    await eventually(lambda: len(gw.gateway.pool.services["web"].snapshot.routable) == 2)
    return gw, gw.url


def one(spans: list[ReceivedSpan], kind: int) -> ReceivedSpan:
    (found,) = [s for s in spans if s.kind == kind]
    return found


@pytest.mark.parametrize("workers", [1, 2])
async def test_spans_of_sampled_requests_reach_the_collector(
    gateways: Gateways, upstreams: list[int], receiver: OtlpReceiver, workers: int
) -> None:
    gw, url = await start(
        gateways,
        upstreams,
        workers,
        otlp_endpoint=f"http://127.0.0.1:{receiver.port}",
        service_name="edge",
        sample_ratio=0,
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/ok", headers={"traceparent": SAMPLED}) as response:
            assert response.status == 200
            request_id = response.headers["X-Request-Id"]
            sent = (await response.json())["headers"]["traceparent"]
        # Retried: each of these starts on another upstream (round robin), so one of the two
        # meets the failing one first.
        retried = [f"{i + 1:032x}" for i in range(2)]
        for trace in retried:
            headers = {"traceparent": f"00-{trace}-{PARENT}-01"}
            async with s.get(url + "/flaky", headers=headers) as response:
                assert response.status == 200
        async with s.get(url + "/ok") as response:  # sample_ratio 0: not recorded
            assert response.status == 200
            unsampled = response.headers["X-Request-Id"].partition("-")[0]

        def requests() -> int:  # the config's apply and rollout have spans of their own
            return sum(1 for span in receiver.spans if span.kind in (SERVER, CLIENT))

        await eventually(lambda: requests() >= 7, changed=receiver.changed, what="7 spans")
        assert await metric(s, gw, EXPORTED) == len(receiver.spans)
        assert await metric(s, gw, DROPPED) == 0

    # The caller's trace, the gateway's hop as its server span, a client span whose id went
    # upstream as the traceparent's parent.
    spans = receiver.by_trace(TRACE)
    assert len(spans) == 2
    server, client = one(spans, SERVER), one(spans, CLIENT)
    assert server.parent_id == PARENT
    assert request_id == f"{TRACE}-{server.span_id}"
    assert server.name == "GET web"
    assert server.service_name == "edge"
    assert server.error is False
    assert server.attributes["http.request.method"] == "GET"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["url.path"] == "/ok"
    assert server.attributes["gateway.service"] == "web"
    assert server.attributes["gateway.retries"] == 0
    assert server.start <= client.start <= client.end <= server.end
    assert abs(server.start / 1e9 - time.time()) < 60  # stamped with the wall clock
    match = TRACEPARENT.fullmatch(sent)
    assert match is not None
    assert match[1] == TRACE
    assert match[2] == client.span_id != server.span_id
    assert client.parent_id == server.span_id
    assert client.attributes["server.address"] == "127.0.0.1"
    assert client.attributes["server.port"] in upstreams
    assert not receiver.by_trace(unsampled)

    # A retry: two client spans, the first failed with the gateway's failure kind.
    counts = sorted(len(receiver.by_trace(trace)) for trace in retried)
    assert counts == [2, 3]
    (trace,) = [t for t in retried if len(receiver.by_trace(t)) == 3]
    spans = receiver.by_trace(trace)
    server = one(spans, SERVER)
    assert server.attributes["gateway.retries"] == 1
    first, second = sorted((s for s in spans if s.kind == CLIENT), key=lambda s: s.start)
    assert first.parent_id == second.parent_id == server.span_id
    assert first.error is True
    assert first.attributes["error.type"] == "status"
    assert first.attributes["http.response.status_code"] == 503
    assert first.attributes["server.port"] == upstreams[1]
    assert second.attributes["server.port"] == upstreams[0]
    assert second.attributes["http.response.status_code"] == 200
    assert second.error is False

    # The config file's service was applied: a span of its own kind.
    (applied,) = [s for s in receiver.spans if s.name == "apply web"]
    assert applied.attributes["gateway.apply.source"] == "config"
    assert "services[0]" in applied.attributes["gateway.apply.by"]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("collector", ["down", "slow"])
async def test_a_collector_down_or_slow_fails_no_request(
    gateways: Gateways,
    upstreams: list[int],
    receiver: OtlpReceiver,
    workers: int,
    collector: str,
) -> None:
    if collector == "down":
        endpoint = f"http://127.0.0.1:{free_port()}"
    else:
        receiver.hold = True  # takes each export and never answers
        endpoint = receiver.endpoint
    gw, url = await start(
        gateways, upstreams, workers, otlp_endpoint=endpoint, sample_ratio=1, timeout="300ms"
    )
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(40):
            async with s.get(url + "/ok") as response:
                statuses.append(response.status)
        assert statuses == [200] * 40

        async def dropped() -> float | None:
            return await metric(s, gw, DROPPED)

        await eventually(dropped, what="spans counted as dropped", timeout=10)
        assert await metric(s, gw, EXPORTED) == 0


async def test_an_apply_is_the_root_of_its_rollouts_trace(
    gateways: Gateways, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    gw = await gateways.start(tracing={"otlp_endpoint": receiver.endpoint})
    url = admin(gw) + "/api/services/web"
    agent = {"User-Agent": "gateway-cli"}
    async with aiohttp.ClientSession() as s:
        async with s.put(url, json=echo_spec(tmp_path, replicas=2), headers=agent) as answer:
            assert answer.status == 200, await answer.text()
        await eventually(lambda: gw.ready(1) == 2 and gw.state().observed.rollout is None)
        (rollout,) = gw.rollouts()
        trace = trace_id("web", rollout.id)

        def spans() -> list[ReceivedSpan]:
            return receiver.by_trace(trace)

        # The apply, its 4 phases, the rollout, and each replica with its start and probes.
        await eventually(lambda: len(spans()) == 12, changed=receiver.changed, what="12 spans")
        (apply,) = [s for s in spans() if s.name == "apply web"]
        assert apply.parent_id == ""
        assert apply.error is False
        assert apply.attributes["gateway.apply.source"] == "api"
        assert apply.attributes["gateway.apply.by"] == "gateway-cli at 127.0.0.1"
        assert apply.attributes["gateway.apply.action"] == "created"
        assert apply.attributes["gateway.rollout"] == rollout.id
        phases = [s for s in spans() if s.parent_id == apply.span_id]
        assert sorted(s.name for s in phases) == sorted(
            ["validate", "diff", "store write", "plan", "rollout web"]
        )
        (root,) = [s for s in spans() if s.name == "rollout web"]
        assert root.error is False
        assert root.attributes["gateway.outcome"] == "complete"
        assert root.attributes["gateway.revision"] == 1
        replicas = [s for s in spans() if s.name.startswith("replica ")]
        assert sorted(s.attributes["gateway.replica"] for s in replicas) == sorted(
            r.id for r in gw.replicas()
        )
        for replica in replicas:
            assert replica.parent_id == root.span_id
            assert root.start <= replica.start <= replica.end <= root.end
            assert replica.attributes["gateway.outcome"] == "ready"
            start, probe = sorted(
                (s for s in spans() if s.parent_id == replica.span_id), key=lambda s: s.start
            )
            assert (start.name, probe.name) == ("start", "probe to ready")
            assert replica.start == start.start <= start.end <= probe.start <= probe.end
            assert probe.end == replica.end
            assert probe.attributes["gateway.probes"] >= 1

        # The rollout's record leads to its trace.
        async with s.get(url + "/rollouts") as response:
            assert (await response.json())["rollouts"][0]["trace_id"] == trace

        # An apply that changes nothing, and one refused: each a trace of its own.
        async with s.put(url, json=echo_spec(tmp_path, replicas=2)) as answer:
            assert answer.status == 200
        async with s.put(url, json=echo_spec(tmp_path, replicas=-1)) as answer:
            assert answer.status == 422

    def applies() -> list[ReceivedSpan]:
        return [s for s in receiver.spans if s.name == "apply web" and s.trace_id != trace]

    await eventually(lambda: len(applies()) == 2, changed=receiver.changed, what="2 applies")
    unchanged, refused = sorted(applies(), key=lambda s: s.start)
    assert unchanged.trace_id != refused.trace_id
    assert unchanged.error is False
    assert unchanged.attributes["gateway.apply.action"] == "unchanged"
    assert "gateway.rollout" not in unchanged.attributes
    assert refused.error is True
    assert "replicas" in refused.attributes["gateway.apply.refused"]
    assert "gateway.apply.action" not in refused.attributes
