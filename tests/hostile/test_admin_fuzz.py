"""The admin API under attack: auth on every route, no admin route on the traffic listener,
spec size limits, a fuzz from its own OpenAPI document, and racing applies.

The fuzz uses schemathesis: it derives requests (valid and invalid) for every operation from
the document the API serves, alone and chained (the stateful phase), and runs every check on
each answer: no 5xx, the status, content type and schema the document gives, a request the
document allows is taken and one it forbids refused, so the document and the API agree.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis

from controller.admin.app import OPEN_PATHS, AdminServer, build_admin_app
from controller.backends import FakeBackend
from controller.journal import Journal
from controller.operations import Controller
from controller.scaling import MAX_REPLICAS
from controller.spec import MAX_COMMANDS, MAX_ENV
from controller.store import Store
from gateway import Pool
from tests.controller.conftest import admin_client, h, spec  # noqa: F401 - fixtures

TOKEN = "hostile-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def admin(h, admin_client):  # noqa: F811
    app = build_admin_app(h.controller, lambda: True, TOKEN, sse_keepalive=0.05)
    return await admin_client(app)


def _concrete(path: str) -> str:
    return re.sub(r"{\w+(:[^}]*)?}", "web", path)


async def test_every_route_of_the_route_table_needs_the_token(h, admin):  # noqa: F811
    await admin.put("/api/services/web", json=spec("web"), headers=AUTH)
    routes = [(r.method, r.resource.canonical) for r in admin.app.router.routes() if r.resource]
    assert len(routes) >= 15
    for method, path in routes:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": f"Bearer {TOKEN} "[:-2]},
        ):
            response = await admin.request(method, _concrete(path), headers=headers)
            if path in OPEN_PATHS:
                assert response.status < 400 or path == "/readyz", (method, path)
                continue
            assert response.status == 401, (method, path, headers)
            assert (await response.json())["error"] == "unauthorized"
            response.close()


async def test_the_token_compare_is_constant_time():
    source = (Path(__file__).parents[2] / "controller/admin/app.py").read_text()
    assert "hmac.compare_digest" in source
    assert "== expected" not in source


async def test_no_admin_route_is_reachable_from_the_traffic_listener(tmp_path, aiohttp_server):
    from controller.config import load_config
    from controller.serving import run_gateway

    config = {
        "listen": "127.0.0.1:0",
        "admin": {"listen": "127.0.0.1:0", "token_env": None},
        "state_dir": str(tmp_path / "state"),
        "access_log": {"enabled": False},
    }
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(config))
    stop = asyncio.Event()
    ports: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_gateway(
            load_config(path), stop, lambda g: ports.set_result((g.traffic.port, g.admin.port))
        )
    )
    try:
        traffic, admin_port = await asyncio.wait_for(ports, 10)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{admin_port}/api/services") as r:
                assert r.status == 200  # no token configured, loopback: the admin API is there
            for method, target in [("GET", "/api/services"), ("PUT", "/api/services/x"),
                                   ("GET", "/api/openapi.json"), ("GET", "/healthz"),
                                   ("GET", "/metrics"), ("GET", "/svc/../api/services"),
                                   ("GET", "/%2e%2e/api/services")]:  # fmt: skip
                async with session.request(method, f"http://127.0.0.1:{traffic}{target}") as r:
                    body = await r.json()
                    assert (r.status, body["error"]) == (404, "no_route"), target
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


LIMITS = {
    "name_too_long": {"name": "a" * 64},
    "name_not_a_label": {"name": "Web_1"},
    "too_many_replicas": {"replicas": MAX_REPLICAS + 1},
    "too_many_commands": {"replica": {"commands": ["serve"] * (MAX_COMMANDS + 1)}},
    "command_too_long": {"replica": {"commands": ["x" * 8193]}},
    "command_with_nul": {"replica": {"commands": ["serve\x00 --evil"]}},
    "too_many_env": {
        "replica": {"commands": ["serve"], "env": {f"V{i}": "x" for i in range(MAX_ENV + 1)}}
    },
    "env_value_too_long": {"replica": {"commands": ["serve"], "env": {"V": "x" * 32769}}},
    "env_bad_name": {"replica": {"commands": ["serve"], "env": {"A=B": "x"}}},
    "env_sets_port": {"replica": {"commands": ["serve"], "env": {"PORT": "1"}}},
    "too_many_probes": {"probes": [{"type": "tcp"}] * 9},
    "probe_header_injection": {"probes": [{"headers": {"X-A": "b\r\nX-Evil: 1"}}]},
    "prefix_with_dots": {"route": {"path_prefix": "/a/../b"}},
    "host_not_a_name": {"route": {"hosts": ["evil.com/x"]}},
}


@pytest.mark.parametrize("change", LIMITS.values(), ids=LIMITS.keys())
async def test_specs_over_their_limits_are_refused_with_422(h, admin, change):  # noqa: F811
    data = {**spec("web"), **change}
    if "name" in change:
        target = f"/api/services/{change['name']}"
    else:
        target = "/api/services/web"
    response = await admin.put(target, data=json.dumps(data), headers=AUTH)
    assert response.status in (404, 422), await response.text()
    body = await response.json()
    assert body["error"] in ("invalid_spec", "not_found")
    assert h.controller.service_names() == []
    assert h.store.services() == []


async def test_a_body_over_a_mebibyte_is_413(h, admin):  # noqa: F811
    data = io.BytesIO(json.dumps({**spec("web"), "x": "y" * (1 << 20)}).encode())
    response = await admin.put("/api/services/web", data=data, headers=AUTH)
    assert response.status == 413


async def test_twenty_racing_applies_to_one_service_are_serialised(h, admin):  # noqa: F811
    await admin.put("/api/services/web", json=spec("web", 2, "v0"), headers=AUTH)
    await h.settle()
    versions = [f"v{i}" for i in range(1, 21)]

    async def put(version: str) -> dict[str, Any]:
        response = await admin.put("/api/services/web", json=spec("web", 2, version), headers=AUTH)
        assert response.status == 200, await response.text()
        return await response.json()

    results = await asyncio.gather(*(put(v) for v in versions))
    await h.settle()
    revisions = h.store.revisions("web")
    assert [r.number for r in revisions] == list(range(1, 22))  # contiguous, none lost
    assert sorted(r["revision"] for r in results) == list(range(2, 22))
    rollouts = h.store.rollouts("web", limit=100)
    assert sum(r.active for r in rollouts) == 1
    active = h.store.active_rollout("web")
    service = h.store.service("web")
    state = h.state("web")
    # The final target is one of the applied specs, the same in the store and in memory.
    assert service.target_revision == active.to_revision == state.desired.revision
    target_env = json.loads(h.store.revision("web", service.target_revision).spec_json)
    assert target_env["replica"]["env"]["VERSION"] in versions
    assert state.observed.rollout.id == active.id
    assert {r.status for r in rollouts if not r.active} <= {"superseded", "complete"}


# -- the fuzz ---------------------------------------------------------------------------------


@pytest.fixture
def admin_in_thread(tmp_path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The admin API on the fake backend, served by a loop in a thread of its own (the fuzz
    is synchronous: schemathesis drives it with requests)."""
    started = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        store = Store(tmp_path / "fuzz.db")
        pool = Pool()
        journal = Journal(store, time.time)
        loop = asyncio.get_running_loop()
        controller = Controller(
            pool, {"process": FakeBackend()}, store, journal, loop.time, time.time
        )
        app = build_admin_app(controller, lambda: True, TOKEN)
        server = AdminServer(app, "127.0.0.1:0")
        await server.start()
        box["port"] = server.port
        box["stop"] = stop = asyncio.Event()
        box["loop"] = loop
        started.set()
        await stop.wait()
        await server.stop()
        await controller.close()
        store.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    base = f"http://127.0.0.1:{box['port']}"
    import requests

    document = requests.get(f"{base}/api/openapi.json", headers=AUTH, timeout=5).json()
    try:
        yield base, document
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)


def _a_path(value: object) -> bool:
    """A path ``upstream_tls`` takes: absolute, without NUL."""
    return isinstance(value, str) and value.startswith("/") and "\x00" not in value


FUZZ_CONFIG = """
# Hypothesis's own health checks judge the generator, not the API: a spec's patterns (name,
# image, volume, memory, GPU ids) with their length bounds make it throw away many drawn
# strings (filter_too_much failed PUT /api/services/{name} in one CI run), and two busy cores
# make it slow. Neither is a finding about the API.
suppress-health-check = ["filter_too_much", "too_slow"]

[generation]
max-examples = 25
database = "none"

[phases.examples]
enabled = true
[phases.coverage]
enabled = true
[phases.fuzzing]
enabled = true
[phases.stateful]
enabled = true

[output.sanitization]
enabled = false
"""
"""Every phase (examples, coverage, fuzzing and stateful: chains of calls along the links the
document implies) and, by schemathesis's default, every check: the document's statuses,
content types and schemas, valid requests taken (ST202), invalid ones refused (ST203),
auth not ignored, a deleted service gone, Allow on a 405... Failures show the request as
sent: schemathesis would otherwise mask fields named like secrets (auth, cookie, token), and a
masked body cannot be replayed."""


@pytest.mark.slow
@pytest.mark.timeout(300)  # about 20 s alone; the whole suite on two cores is slower
def test_the_api_fuzzed_from_its_own_openapi_document(admin_in_thread):
    from schemathesis.config import SchemathesisConfig
    from schemathesis.engine import Status, events, from_schema

    base, document = admin_in_thread
    config = SchemathesisConfig.from_str(FUZZ_CONFIG)
    schema = schemathesis.openapi.from_dict(document, config=config)
    schema.config.update(base_url=base, headers=AUTH, request_timeout=10)
    # An endless stream: there is no response to check.
    schema = schema.exclude(path="/api/events")

    @schema.hook
    def map_body(ctx: Any, body: Any) -> Any:
        """The rules of a spec JSON Schema cannot state (it compares no two fields), kept by
        the generated bodies: a replica range's min is at most its max, a canary's step
        weights rise and 100 comes last. The API refuses bodies that break them (422: tested
        in tests/controller/test_autoscaler.py and test_spec_rollout.py). Nor can it state
        that the files ``upstream_tls`` names exist and hold PEM (refused at the apply, 422:
        tests/controller/test_spec_upstream_tls.py): the drawn paths name none, and go."""
        if not isinstance(body, dict):
            return body
        tls = body.get("upstream_tls")
        if isinstance(tls, dict):  # only valid paths go: an invalid body stays invalid
            if _a_path(tls.get("ca")):
                tls["ca"] = None
            if _a_path(tls.get("cert")) and _a_path(tls.get("key")):
                tls["cert"] = tls["key"] = None
        replicas = body.get("replicas")
        if isinstance(replicas, dict):
            low, high = replicas.get("min"), replicas.get("max")
            if isinstance(low, int | float) and isinstance(high, int | float) and low > high:
                body["replicas"] = {**replicas, "min": high, "max": low}
        # The coverage phase varies one property at a time and may break a rule between two
        # that the document does state (a fixed process port with more than one replica):
        # the port goes, as the rule's message says to do.
        replica = body.get("replica")
        count = body.get("replicas")
        top = count.get("max") if isinstance(count, dict) else count
        if isinstance(replica, dict) and replica.get("port") is not None:
            if isinstance(top, int | float) and top > 1:
                replica["port"] = None
        rollout = body.get("rollout")
        steps = rollout.get("steps") if isinstance(rollout, dict) else None
        if isinstance(steps, list) and all(
            isinstance(step, dict) and isinstance(step.get("weight"), int | float) for step in steps
        ):
            kept: dict[float, Any] = {}
            for step in sorted(steps, key=lambda step: step["weight"]):
                kept.setdefault(step["weight"], step)
            rollout["steps"] = list(kept.values())
        return body

    failures: list[str] = []
    phases: dict[str, Status] = {}
    checked: set[str] = set()
    calls = 0
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            calls += len(event.recorder.interactions)
            for check in (c for cs in event.recorder.checks.values() for c in cs):
                checked.add(check.name)
                info = check.failure_info
                if check.status is Status.FAILURE and info is not None:
                    failures.append(f"{event.recorder.label}: {info.failure}\n{info.code_sample}")
        elif isinstance(event, events.PhaseFinished):
            phases[event.phase.name.value] = event.status
        elif isinstance(event, events.NonFatalError | events.FatalError):
            failures.append(f"error: {event}")
    assert not failures, "\n".join(failures)
    assert phases.get("stateful") is Status.SUCCESS, phases
    assert checked >= {
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "positive_data_acceptance",
        "negative_data_rejection",
        "ignored_auth",
        "use_after_free",
        "ensure_resource_availability",
        "unsupported_method",
    }, checked
    print(f"\nfuzz: {calls} requests, every check passed; phases {phases}")
    assert calls > 500
