"""Autoscaling end to end: a real gateway, real replica processes (the process backend), real
traffic on loopback. Short windows and delays, so each test takes seconds.

- load stepping 0 -> high -> 0 drives 0 -> N -> 0 replicas with no failed request (the
  held ones included), in one process and with two workers;
- a scaled-to-zero service answers its first request once a replica is up: the hold time is
  the replica's start and probe time plus the sampling and the planning;
- a cold start that cannot be placed answers the held request 503 with the reason, within
  ``queue_timeout``;
- a scale-down drains the replica with the fewest requests in flight, and a long request on
  a drained replica finishes;
- ``metric: queue``: a model replica reporting more ``vllm:num_requests_waiting`` than the
  target scales the service 1 -> 2, its figures scraped by the gateway (``load_metrics``).
"""

from __future__ import annotations

import asyncio
import io
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.admin.views import service_view
from controller.cli.render import service_detail, service_table
from controller.planning.model import ReplicaState
from tests.support.eventually import eventually

from .conftest import Gateways, Handle, Load, spec

SLOW_SERVER = """
import os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DELAY = float(os.environ.get("DELAY", "0.2"))

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        _, _, query = self.path.partition("?s=")
        time.sleep(float(query) if query else DELAY)
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""

SCALING: dict[str, Any] = {
    "target": 2,
    "window": "2s",
    "scale_up_delay": "0.5s",
    "scale_down_delay": "2s",
}


def autoscaled(tmp_path: Path, replicas: str, delay: float = 0.2, **extra: Any) -> dict[str, Any]:
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SERVER)
    data = spec(str(tmp_path), 1, commands=[f"{sys.executable} {script} $PORT"])
    data["replicas"] = replicas
    data["scaling"] = SCALING
    data["replica"]["env"] = {"DELAY": str(delay)}
    return data | extra


MODEL_REPLICA = f"{sys.executable} {Path(__file__).parent / 'model_replica.py'}"


def live(gw: Handle) -> int:
    return sum(1 for r in gw.replicas() if r.live)


def events(gw: Handle, kind: str) -> list[str]:
    journal = gw.controller.journal
    return [e.message for e in journal.since(0) if e.kind == kind and e.service == "web"]


async def at_zero(gw: Handle) -> None:
    await eventually(
        lambda: (
            gw.state().desired.replicas == 0
            and live(gw) == 0
            and not gw.replicas(ReplicaState.DRAINING, ReplicaState.STOPPING)
        ),
        timeout=20,
        what="scaled to zero",
    )


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
async def test_load_stepping_up_and_down_scales_0_to_n_to_0_with_no_failed_request(
    gateways: Gateways, tmp_path: Path, workers: int
) -> None:
    """With ``workers: 2`` the requests are held and counted in the worker processes, and
    reach the controller in their reports."""
    gw = await gateways.start(workers=workers)
    await gw.controller.apply(autoscaled(tmp_path, "0..4"))
    await at_zero(gw)  # it began with one replica, idle: gone after scale_down_delay

    most = {"desired": 0, "ready": 0}

    def track() -> bool:
        most["desired"] = max(most["desired"], gw.state().desired.replicas)
        most["ready"] = max(most["ready"], gw.ready())
        return most["ready"] >= 3

    # 8 clients, 0.2 s a request: about 8 in flight, 4 replicas at target 2.
    async with Load(gw.url, clients=8, limit=60) as load:
        await eventually(track, timeout=20, what="3 or more replicas ready under load")
        await load.more(100)
    assert not load.failures, load.summary()
    assert most["desired"] >= 3, most
    await at_zero(gw)
    autoscaled_events = events(gw, "autoscaled")
    assert any(m.startswith("cold start:") for m in autoscaled_events), autoscaled_events
    assert any("> target 2" in m for m in autoscaled_events), autoscaled_events
    assert any(m.startswith("idle for 2 s") for m in autoscaled_events), autoscaled_events
    assert events(gw, "cold_start"), "the cold start's duration is journalled"
    # Visible: the service view and `gateway status` give the last decision and why.
    view = service_view(gw.controller, gw.state()).model_dump(mode="json")
    assert view["desired"] == 0
    # The last step to zero reads either way: idle for scale_down_delay, or (from several
    # replicas at once) no load below target.
    decision = view["autoscaling"]["decision"]
    assert decision.startswith("idle for 2 s: ") or decision.endswith("-> 0"), decision
    shown = io.StringIO()
    service_table([view], shown)
    service_detail(view, False, shown)
    assert "web: autoscaled 0..4, " in shown.getvalue()
    assert "last decision (" in shown.getvalue()


async def test_the_first_request_to_a_service_at_zero_is_held_and_answered(
    gateways: Gateways, tmp_path: Path
) -> None:
    gw = await gateways.start()
    await gw.controller.apply(autoscaled(tmp_path, "0..2", delay=0.0))
    await at_zero(gw)
    before = {r.id for r in gw.replicas()}
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.get(gw.url + "/") as response:
            body = await response.text()
            held = time.monotonic() - started
    assert response.status == 200, body
    assert body == "ok"
    (replica,) = [r for r in gw.replicas() if r.id not in before]
    assert replica.ready_since is not None
    start_and_probe = replica.ready_since - replica.created
    # The hold is the cold start: the replica's start and probes, plus the sample that sees
    # the held request (at once, on_waiting) and the routing once it is ready.
    print(f"\nhold {held:.3f} s; replica start + probe {start_and_probe:.3f} s")
    assert held >= start_and_probe * 0.9
    assert held <= start_and_probe + 1.0, (held, start_and_probe)
    (cold,) = events(gw, "cold_start")
    assert f"replica {replica.id} ready" in cold
    # A manual scale of an autoscaled service is refused, saying what to change.
    scale = f"http://127.0.0.1:{gw.gateway.admin.port}/api/services/web/scale"
    async with aiohttp.ClientSession() as http, http.post(scale, json={"replicas": 3}) as refused:
        answer = await refused.json()
    assert refused.status == 409, answer
    assert "autoscaled (replicas 0..2)" in answer["message"], answer
    assert "fixed count" in answer["message"], answer
    admin = f"http://127.0.0.1:{gw.gateway.admin.port}/metrics"
    async with aiohttp.ClientSession() as http, http.get(admin) as response:
        metrics = await response.text()
    assert 'gateway_service_cold_starts_total{service="web"} 1.0' in metrics
    assert 'gateway_service_cold_start_duration_seconds_count{service="web"} 1.0' in metrics
    assert 'gateway_service_held_requests{service="web"} 0.0' in metrics
    assert 'gateway_service_desired_replicas{service="web"} 1.0' in metrics


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_cold_start_with_no_capacity_answers_503_with_the_reason(
    gateways: Gateways, tmp_path: Path, workers: int
) -> None:
    """With ``workers: 2`` the request is held in a worker, which hears the reason with the
    pool's snapshot."""
    queue_timeout = 5.0
    gw = await gateways.start(capacity=0, workers=workers)
    await gw.controller.apply(autoscaled(tmp_path, "0..2", queue_timeout=queue_timeout))
    await eventually(lambda: gw.state().desired.replicas == 0, timeout=20, what="idle at zero")
    await eventually(lambda: gw.state().observed.degraded is None, what="not degraded at zero")
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.get(gw.url + "/") as response:
            body = await response.json()
            took = time.monotonic() - started
    assert response.status == 503, body
    assert response.headers["Retry-After"]
    assert "no capacity" in body["reason"], body
    assert "no capacity" in body["message"], body
    assert took < queue_timeout, took
    print(f"\n503 after {took:.3f} s: {body['message']}")
    assert gw.state().observed.degraded is not None
    assert "no capacity" in (gw.state().observed.degraded or "")


async def test_a_scale_down_drains_and_the_long_requests_on_it_finish(
    gateways: Gateways, tmp_path: Path
) -> None:
    gw = await gateways.start()
    data = autoscaled(tmp_path, "1..3", delay=0.2)
    data["rollout"]["drain_timeout"] = 30
    await gw.controller.apply(data)
    await eventually(lambda: gw.ready() == 1, what="one replica")
    # Short requests from 6 clients: 6 in flight at target 2 wants 3 replicas.
    async with Load(gw.url, clients=6, limit=60) as load:
        await eventually(lambda: gw.ready() == 3, timeout=20, what="3 replicas under load")
        await load.more(20)
    # The short load ended; three long requests, one per replica.
    pool = gw.controller.pool.service("web")
    await eventually(lambda: not sum(pool.inflight_all().values()), what="nothing in flight")
    async with aiohttp.ClientSession() as http:

        async def long_request() -> tuple[int, str, float]:
            started = time.monotonic()
            async with http.get(gw.url + "/?s=6") as response:
                return response.status, await response.text(), time.monotonic() - started

        longs = []
        for _ in range(3):  # least outstanding: one on each replica
            longs.append(asyncio.ensure_future(long_request()))
            await eventually(
                lambda: sum(pool.inflight_all().values()) == len(longs),
                what="each long request in flight",
            )
        assert sorted(pool.inflight_all().values()) == [1, 1, 1], pool.inflight_all()
        # 3 in flight: wants 2; the scale-down drains a replica that holds one of them.
        await eventually(lambda: gw.state().desired.replicas < 3, timeout=15, what="a scale-down")
        draining = gw.replicas(ReplicaState.DRAINING)
        assert draining, "the replica scaled down drains"
        assert pool.inflight_all().get(draining[0].id) == 1
        results = await asyncio.gather(*longs)
    assert not load.failures, load.summary()
    assert all(status == 200 and body == "ok" for status, body, _ in results), results
    assert all(took >= 5.9 for _, _, took in results), results
    drained = events(gw, "replica_draining")
    assert any("scaled down" in m for m in drained), drained
    assert not events(gw, "replica_drain_timeout")


async def test_replicas_reporting_a_queue_above_target_scale_up_from_1_to_2(
    gateways: Gateways, tmp_path: Path
) -> None:
    """The replica reports 0 waiting: its figures reach the samples and the count stays;
    it reports 6 (target 4): the autoscaler goes 1 -> 2 and says why."""
    waiting = tmp_path / "waiting"
    waiting.write_text("0")
    gw = await gateways.start()
    data = spec(str(tmp_path), 1, commands=[MODEL_REPLICA])
    data["replicas"] = "1..2"
    data["replica"]["env"] = {"WAITING_FILE": str(waiting)}
    data["scaling"] = {"metric": "queue", "target": 4, "scale_up_delay": "0.5s"}
    data["load_metrics"] = {"format": "vllm", "interval": 0.1, "max_age": 0.5}
    await gw.controller.apply(data)

    def reported(count: int, figure: float) -> bool:
        samples = gw.state().observed.samples
        last = samples[-1] if samples else None
        return last is not None and (last.reported, last.waiting) == (count, figure)

    await eventually(lambda: reported(1, 0.0), what="the replica's figures: 0 waiting")
    assert gw.state().desired.replicas == 1
    raised = time.time()
    waiting.write_text("6")
    await eventually(lambda: gw.ready() == 2, what="2 replicas ready")
    assert gw.state().desired.replicas == 2
    (entry,) = [e for e in gw.controller.journal.since(0) if e.kind == "autoscaled"]
    assert entry.message.startswith("queue 6 per replica over 0.5 s > target 4: 1 -> 2"), entry
    # The figure reaches a decision within a scrape, a sample and scale_up_delay's mean.
    print(f"\nqueue 0 -> 6: 1 -> 2 decided {entry.at - raised:.3f} s later")
    await eventually(lambda: reported(2, 12.0), what="both replicas' figures")
