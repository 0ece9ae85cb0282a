"""The admin API over a controller on the fake backend: every route, and every refusal.

Each refused request (bad token, bad spec, wrong state, too big) is checked to leave the
services exactly as they were.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from typing import Any

import pytest
import yaml
from aiohttp import web

from controller.admin.app import build_admin_app, is_loopback
from controller.admin.openapi import Operation
from controller.documents import MAX_DEPTH, MAX_NODES
from controller.journal import Journal
from controller.planning.model import ReplicaState
from gateway import Health
from tests.bombs import BOMBS, FLAT_MIB
from tests.support.admin_client import AdminClient, AdminClientFactory
from tests.support.eventually import eventually

from .conftest import Harness, spec

TOKEN = "s3cret-t0ken-value"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Api:
    """A test client that sends the token, and a snapshot of what a refusal must not change."""

    def __init__(self, client: AdminClient, h: Harness) -> None:
        self.client = client
        self.h = h

    async def call(
        self, method: str, path: str, body: Any = None, *, status: int = 200, **kwargs: Any
    ) -> Any:
        headers = {**AUTH, **kwargs.pop("headers", {})}
        if body is not None:
            data = json.dumps(body).encode()
            kwargs["data"] = io.BytesIO(data) if len(data) > 2**20 else data
            headers.setdefault("Content-Type", "application/json")
        response = await self.client.request(method, path, headers=headers, **kwargs)
        text = await response.text()
        assert response.status == status, text
        assert response.content_type == "application/json", text
        assert "Traceback" not in text
        return json.loads(text)

    def fingerprint(self) -> Any:
        """Everything a refused request must leave as it was."""
        store = self.h.store
        services = {
            name: (
                s.desired,
                s.spec,
                s.observed.rollout,
                tuple(sorted(s.revisions)),
                len(s.observed.replicas),
            )
            for name, s in self.h.controller.reconciler.services.items()
        }
        rows = [(r.name, r.spec_json, r.target_revision) for r in store.services()]
        revisions = {r.name: len(store.revisions(r.name)) for r in store.services()}
        return services, rows, revisions, len(self.h.backend.attempts)


@pytest.fixture
async def api(h: Harness, admin_client: AdminClientFactory) -> Api:
    app = build_admin_app(h.controller, lambda: True, TOKEN, sse_keepalive=0.05)
    client = await admin_client(app)
    return Api(client, h)


async def serving(api: Api, name: str = "web", replicas: int = 2, **extra: Any) -> None:
    result = await api.call("PUT", f"/api/services/{name}", spec(name, replicas, **extra))
    assert result["action"] == "created"
    await api.h.settle()
    await api.h.pass_probes(name)
    assert api.h.state(name).observed.serving_revision == 1


# -- auth -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": TOKEN},
    ],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/services"),
        ("GET", "/api/openapi.json"),
        ("PUT", "/api/services/web"),
        ("DELETE", "/api/services/web"),
        ("GET", "/api/events"),
        ("GET", "/api/nothing-here"),
    ],
)
async def test_every_api_route_needs_the_token(
    api: Api, method: str, path: str, headers: dict[str, str]
) -> None:
    before = api.fingerprint()
    response = await api.client.request(method, path, headers=headers, json=spec("web"))
    assert response.status == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    body = await response.json()
    assert body == {"error": "unauthorized", "message": "missing or wrong bearer token"}
    assert api.fingerprint() == before


async def test_health_and_readiness_need_no_token(api: Api) -> None:
    assert await (await api.client.get("/healthz")).json() == {"status": "ok"}
    assert await (await api.client.get("/readyz")).json() == {"status": "ready"}


async def test_readyz_is_503_while_starting(h: Harness, admin_client: AdminClientFactory) -> None:
    client = await admin_client(build_admin_app(h.controller, lambda: False, TOKEN))
    response = await client.get("/readyz")
    assert response.status == 503
    assert await response.json() == {"status": "starting"}


async def test_no_token_configured_means_no_auth(
    h: Harness, admin_client: AdminClientFactory
) -> None:
    client = await admin_client(build_admin_app(h.controller, lambda: True, None))
    response = await client.get("/api/services")
    assert response.status == 200


async def test_the_token_is_never_logged(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    await serving(api)
    await api.call("GET", "/api/services/web")
    await api.client.get("/api/services", headers={"Authorization": "Bearer nope"})
    await api.call("PUT", "/api/services/web", {"name": "web"}, status=422)
    assert caplog.records
    assert TOKEN not in caplog.text


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1:8081")
    assert is_loopback("127.0.0.2:0")
    assert is_loopback("[::1]:8081")
    assert is_loopback("localhost:8081")
    assert not is_loopback("0.0.0.0:8081")
    assert not is_loopback("[::]:8081")
    assert not is_loopback("10.0.0.1:8081")
    assert not is_loopback("admin.example.com:8081")


async def test_metrics_and_extra_routes_plug_in(
    h: Harness, admin_client: AdminClientFactory
) -> None:
    def metrics(accept: str) -> tuple[bytes, str]:
        return f"up 1 {accept}\n".encode(), "text/plain"

    async def extra(request: web.Request) -> web.Response:
        return web.json_response({"extra": True})

    app = build_admin_app(
        h.controller,
        lambda: True,
        TOKEN,
        metrics=metrics,
        extra_routes=[Operation("GET", "/api/extra", extra, "An extra admin route.", {200: None})],
    )
    client = await admin_client(app)
    assert await (await client.get("/metrics", headers={"Accept": "a/b"})).text() == "up 1 a/b\n"
    assert (await client.get("/api/extra")).status == 401
    assert await (await client.get("/api/extra", headers=AUTH)).json() == {"extra": True}
    doc = await (await client.get("/api/openapi.json", headers=AUTH)).json()
    assert doc["paths"]["/metrics"]["get"]["security"] == []
    assert doc["paths"]["/api/extra"]["get"]["summary"] == "An extra admin route."


# -- services ---------------------------------------------------------------------------------


async def test_apply_creates_a_service_and_shows_it(api: Api) -> None:
    result = await api.call("PUT", "/api/services/web", spec("web", 2))
    assert result == {
        "action": "created",
        "service": "web",
        "revision": 1,
        "previous_revision": None,
        "rollout_id": 1,
        "changes": [],
        "dry_run": False,
    }
    await api.h.settle()
    view = await api.call("GET", "/api/services/web")
    assert view["status"] == "progressing"
    assert view["target_revision"] == 1
    assert view["serving_revision"] is None
    assert view["desired"] == 2
    assert view["ready"] == 0
    assert view["conditions"] == {"degraded": True, "reason": "0 of 2 replicas ready"}
    assert view["rollout"]["progress"] == [{"revision": 1, "ready": 0, "live": 2, "desired": 2}]
    assert {r["state"] for r in view["replicas"]} == {"starting"}
    assert {r["health"] for r in view["replicas"]} == {"unknown"}

    await api.h.pass_probes("web")
    view = await api.call("GET", "/api/services/web")
    assert view["status"] == "ready"
    assert view["serving_revision"] == 1
    assert view["rollout"] is None
    assert view["conditions"] == {"degraded": False, "reason": None}
    assert view["spec"]["replica"]["env"] == {"VERSION": "v1"}
    replica = view["replicas"][0]
    assert replica["state"] == "ready"
    assert replica["health"] == "healthy"
    assert replica["inflight"] == 0
    assert replica["address"].startswith("127.0.0.1:")
    assert abs(replica["since"] - api.h.clock.now) < 1  # the harness's wall clock is its clock

    listed = await api.call("GET", "/api/services")
    assert [s["name"] for s in listed["services"]] == ["web"]


async def test_inflight_requests_show_per_replica(api: Api) -> None:
    await serving(api)
    lease = api.h.pool.service("web").lease()
    assert lease is not None
    with lease:
        view = await api.call("GET", "/api/services/web")
    inflight = {r["id"]: r["inflight"] for r in view["replicas"]}
    assert inflight[lease.upstream.id] == 1
    assert sum(inflight.values()) == 1


async def test_apply_accepts_yaml(api: Api) -> None:
    body = yaml.safe_dump(spec("web", 1, rollout={"drain_timeout": "5s"}))
    for content_type in ("application/yaml", "application/x-yaml", "text/yaml"):
        response = await api.client.put(
            "/api/services/web", data=body, headers={**AUTH, "Content-Type": content_type}
        )
        assert response.status == 200, await response.text()
    assert api.h.state("web").spec.rollout.drain_timeout == 5.0


async def test_a_spec_without_a_name_takes_the_paths(api: Api) -> None:
    body = spec("web", 1)
    del body["name"]
    result = await api.call("PUT", "/api/services/web", body)
    assert result["service"] == "web"


async def test_an_invalid_spec_names_every_field_and_changes_nothing(api: Api) -> None:
    await serving(api)
    before = api.fingerprint()
    bad = spec("web", 2, rollout={"drain_timeout": "soon"})
    bad["replicas"] = -1
    bad["route"] = {"path_prefix": 5}
    bad["surprise"] = True
    body = await api.call("PUT", "/api/services/web", bad, status=422)
    assert body["error"] == "invalid_spec"
    fields = {e["field"] for e in body["errors"]}
    assert {"replicas", "rollout.drain_timeout", "route.path_prefix", "surprise"} <= fields
    assert all(e["reason"] for e in body["errors"])
    assert api.fingerprint() == before


@pytest.mark.parametrize(
    "body",
    [[1, 2], "web", None, {"name": "web", "replica": {"commands": ["x"]}}],
    ids=["list", "string", "null", "no-route"],
)
async def test_specs_that_are_not_specs_are_422(api: Api, body: Any) -> None:
    before = api.fingerprint()
    response = await api.client.put(
        "/api/services/web",
        data=json.dumps(body),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert response.status == 422
    assert (await response.json())["error"] == "invalid_spec"
    assert api.fingerprint() == before


async def test_a_name_that_differs_from_the_path_is_409(api: Api) -> None:
    # Both names are valid, so the spec is: it does not fit its target (RFC 9110 9.3.4).
    await serving(api)
    before = api.fingerprint()
    body = await api.call("PUT", "/api/services/web", spec("api", 2), status=409)
    assert body["error"] == "conflict"
    assert body["errors"] == [{"field": "name", "reason": "'api' differs from 'web' in the path"}]
    assert api.fingerprint() == before
    assert "api" not in api.h.controller.service_names()


@pytest.mark.parametrize("working_dir", ["site", "./site", "../site", ""])
@pytest.mark.parametrize("query", ["", "?dry_run=1"])
async def test_a_relative_working_dir_is_422_naming_the_field(
    api: Api, working_dir: str, query: str
) -> None:
    # The CLI and the config loader resolve it against the spec's file; the API has no file,
    # and the gateway's own working directory means nothing to its client.
    await serving(api)
    before = api.fingerprint()
    bad = spec("web", 2)
    bad["replica"]["working_dir"] = working_dir
    body = await api.call("PUT", f"/api/services/web{query}", bad, status=422)
    assert body["error"] == "invalid_spec"
    assert [e["field"] for e in body["errors"]] == ["replica.working_dir"]
    assert "absolute" in body["errors"][0]["reason"]
    assert api.fingerprint() == before


async def test_an_absolute_working_dir_is_taken_as_it_is(api: Api) -> None:
    good = spec("web", 1)
    good["replica"]["working_dir"] = "/srv/site"
    await api.call("PUT", "/api/services/web", good)
    assert api.h.state("web").spec.replica.working_dir == "/srv/site"


async def test_an_unconfigured_backend_is_422(api: Api) -> None:
    body = spec("web", 1)
    body["backend"] = "static"
    body["replica"] = {"addresses": ["127.0.0.1:9"]}
    before = api.fingerprint()
    result = await api.call("PUT", "/api/services/web", body, status=422)
    assert result["errors"] == [{"field": "backend", "reason": "'static' is not configured"}]
    assert api.fingerprint() == before


@pytest.mark.parametrize(
    ("data", "content_type"),
    [("{not json", "application/json"), ("a: [b", "application/yaml"), (b"\xff\xfe", "")],
)
async def test_a_body_that_does_not_parse_is_400(api: Api, data: Any, content_type: str) -> None:
    before = api.fingerprint()
    headers = {**AUTH, "Content-Type": content_type} if content_type else AUTH
    response = await api.client.put("/api/services/web", data=data, headers=headers)
    assert response.status == 400
    assert (await response.json())["error"] == "bad_request"
    assert api.fingerprint() == before


@pytest.mark.parametrize("path", ["/api/services/web/tokens", "/api/services/web/rollout/undo"])
async def test_an_optional_body_of_white_space_is_400_and_no_body_is_none(
    api: Api, path: str
) -> None:
    # The body may be left out; white space is a body, and not JSON (the fuzzer's "\r\n\r\n"
    # was taken as none: a token added).
    await serving(api, auth={"type": "bearer"})
    before = api.fingerprint()
    tokens = await api.call("GET", "/api/services/web/tokens")
    for blank in ("\r\n\r\n", " "):
        headers = {**AUTH, "Content-Type": "application/json"}
        response = await api.client.post(path, data=blank, headers=headers)
        assert response.status == 400, await response.text()
        assert (await response.json())["error"] == "bad_request"
    assert await api.call("GET", "/api/services/web/tokens") == tokens
    assert api.fingerprint() == before
    if path.endswith("/tokens"):  # no body at all: a token made here
        added = await api.call("POST", path, status=201)
        assert added["secret"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/services/web", "[" * 100_000),
        ("/api/services/web", '{"replica": ' * 5_000),
        ("/api/services/web/scale", '{"replicas": ' + "[" * 900 + "]" * 900 + "}"),
    ],
    ids=["unclosed", "objects", "closed"],
)
async def test_a_body_nested_too_deeply_is_413_naming_the_limit(
    api: Api, path: str, body: str
) -> None:
    # Refused while parsing, at 64 levels (a 500 when the parser ran out of stack, then a 400).
    if path.endswith("/scale"):
        await serving(api)
    method = "POST" if path.endswith("/scale") else "PUT"
    headers = {**AUTH, "Content-Type": "application/json"}
    response = await api.client.request(method, path, data=body, headers=headers)
    assert response.status == 413, await response.text()
    assert await response.json() == {
        "error": "document_too_large",
        "message": "the body is nested deeper than 64 levels",
        "limit": "depth",
        "allowed": 64,
    }


@pytest.mark.parametrize("name", [*BOMBS, "flat_mib"])
async def test_a_bomb_is_413_naming_the_limit_and_changes_nothing(api: Api, name: str) -> None:
    # Issue 53: a 324-byte YAML alias bomb grew the gateway past 4 GB and was never answered.
    await serving(api)
    before = api.fingerprint()
    content_type, body = FLAT_MIB if name == "flat_mib" else BOMBS[name]
    headers = {**AUTH, "Content-Type": content_type}
    for method, path in [("PUT", "/api/services/web"), ("POST", "/api/services/web/scale")]:
        response = await api.client.request(method, path, data=body, headers=headers)
        assert response.status == 413, await response.text()
        answer = await response.json()
        assert answer["error"] == "document_too_large"
        assert answer["limit"] in ("depth", "nodes")
        assert answer["allowed"] == {"depth": MAX_DEPTH, "nodes": MAX_NODES}[answer["limit"]]
    assert api.fingerprint() == before


async def test_an_oversized_body_is_413(api: Api) -> None:
    await serving(api)
    before = api.fingerprint()
    big = spec("web", 2)
    big["replica"]["env"]["BIG"] = "x" * (2 * 1024 * 1024)
    body = await api.call("PUT", "/api/services/web", big, status=413)
    assert body["error"] == "payload_too_large"
    assert body["message"] == "the body is larger than the 1048576 bytes accepted"
    huge = {"replicas": 3, "x": "y" * 2**21}
    await api.call("POST", "/api/services/web/scale", huge, status=413)
    assert api.fingerprint() == before


async def test_wrong_method_is_405_with_allow(api: Api) -> None:
    response = await api.client.patch("/api/services/web", headers=AUTH, json={})
    assert response.status == 405
    body = await response.json()
    assert body["error"] == "method_not_allowed"
    assert {"GET", "PUT", "DELETE"} <= {m.strip() for m in response.headers["Allow"].split(",")}
    response = await api.client.get("/api/services/web/scale", headers=AUTH)
    assert response.status == 405
    assert (await response.json())["error"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/services/nope"),
        ("DELETE", "/api/services/nope"),
        ("POST", "/api/services/nope/scale"),
        ("POST", "/api/services/nope/rollout/pause"),
        ("POST", "/api/services/nope/rollout/resume"),
        ("POST", "/api/services/nope/rollout/abort"),
        ("POST", "/api/services/nope/rollout/undo"),
        ("GET", "/api/services/nope/revisions"),
        ("GET", "/api/services/nope/rollouts"),
        ("GET", "/api/services/nope/replicas/x/logs"),
        ("POST", "/api/services/nope/upstreams/x/drain"),
        ("POST", "/api/services/nope/upstreams/x/undrain"),
        ("GET", "/api/services/web/replicas/nope/logs"),
        ("POST", "/api/services/web/upstreams/nope/drain"),
        ("POST", "/api/services/web/upstreams/nope/undrain"),
        ("POST", "/api/services/web/rollout/sideways"),
        ("GET", "/api/no-such-route"),
    ],
)
async def test_unknown_things_are_404(api: Api, method: str, path: str) -> None:
    await serving(api)
    before = api.fingerprint()
    body = await api.call(method, path, {"replicas": 1}, status=404)
    assert body["error"] == "not_found"
    assert body["message"]
    assert api.fingerprint() == before


async def test_dry_run_says_what_would_happen_and_changes_nothing(api: Api) -> None:
    result = await api.call("PUT", "/api/services/web?dry_run=1", spec("web", 2))
    assert (result["action"], result["revision"], result["dry_run"]) == ("created", 1, True)
    assert api.h.controller.service_names() == []
    assert api.h.store.services() == []

    await serving(api)
    before = api.fingerprint()
    result = await api.call("PUT", "/api/services/web?dry_run=1", spec("web", 2, "v2"))
    assert result == {
        "action": "rollout",
        "service": "web",
        "revision": 2,
        "previous_revision": 1,
        "rollout_id": None,
        "changes": ["replica.env"],
        "dry_run": True,
    }
    result = await api.call("PUT", "/api/services/web?dry_run=true", spec("web", 5))
    assert (result["action"], result["changes"]) == ("scaled", ["replicas"])
    result = await api.call("PUT", "/api/services/web?dry_run=1", spec("web", 2))
    assert result["action"] == "unchanged"
    bad = await api.call("PUT", "/api/services/web?dry_run=1", spec("web", -2), status=422)
    assert bad["errors"][0]["field"] == "replicas"
    await api.h.settle()
    assert api.fingerprint() == before
    # And the real thing agrees with the dry run.
    result = await api.call("PUT", "/api/services/web", spec("web", 2, "v2"))
    assert (result["action"], result["revision"], result["rollout_id"]) == ("rollout", 2, 2)


async def test_dry_run_of_a_recreated_service_continues_its_revision_numbers(api: Api) -> None:
    await serving(api)
    await api.call("PUT", "/api/services/web", spec("web", 2, "v2"))
    await api.call("DELETE", "/api/services/web", status=202)
    for _ in range(20):
        if "web" not in api.h.controller.reconciler.services:
            break
        await api.h.advance(31)  # drains time out; the fake backend stops at once
    assert "web" not in api.h.controller.service_names()
    await api.call("GET", "/api/services/web", status=404)
    planned = await api.call("PUT", "/api/services/web?dry_run=1", spec("web", 1))
    applied = await api.call("PUT", "/api/services/web", spec("web", 1))
    assert planned["revision"] == applied["revision"] == 3


async def test_delete_drains_then_forgets(api: Api) -> None:
    await serving(api)
    lease = api.h.pool.service("web").lease()  # holds one drain open
    assert lease is not None
    with lease:
        body = await api.call("DELETE", "/api/services/web", status=202)
        assert body == {"service": "web", "status": "deleting"}
        await api.h.settle()
        view = await api.call("GET", "/api/services/web")
        assert view["status"] == "deleting"
        assert {r["state"] for r in view["replicas"]} == {"draining", "stopped"}
        before = api.fingerprint()
        conflict = await api.call("PUT", "/api/services/web", spec("web", 3), status=409)
        assert conflict["error"] == "conflict"
        assert "being deleted" in conflict["message"]
        assert api.fingerprint() == before
    await api.h.settle()
    await api.call("GET", "/api/services/web", status=404)
    assert (await api.call("GET", "/api/services"))["services"] == []


async def test_scale(api: Api) -> None:
    await serving(api)
    result = await api.call("POST", "/api/services/web/scale", {"replicas": 3})
    assert (result["action"], result["changes"]) == ("scaled", ["replicas"])
    await api.h.settle()
    assert api.h.state("web").desired.replicas == 3
    assert len(api.h.backend.started) == 3


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"replicas": -1}, 422, "replicas"),
        ({"replicas": "many"}, 422, "replicas"),
        ({"replicas": 101}, 422, "replicas"),
        ({"replicas": 2, "extra": 1}, 422, "extra"),
        ({}, 422, "replicas"),
        (None, 400, None),
        # Strict about JSON types, as the document is: a boolean is no integer (false was
        # taken as 0 and scaled the service down), a string no number.
        ({"replicas": False}, 422, "replicas"),
        ({"replicas": True}, 422, "replicas"),
        ({"replicas": "2"}, 422, "replicas"),
        ({"replicas": 2.5}, 422, "replicas"),
    ],
)
async def test_a_bad_scale_request_is_refused(
    api: Api, body: Any, status: int, field: str | None
) -> None:
    await serving(api)
    before = api.fingerprint()
    result = await api.call("POST", "/api/services/web/scale", body, status=status)
    if field is not None:
        assert result["error"] == "invalid_request"
        assert field in {e["field"] for e in result["errors"]}
    assert api.fingerprint() == before


async def test_a_count_the_services_spec_does_not_allow_is_409(api: Api) -> None:
    # {"replicas": 2} is a valid request; a service on a fixed port runs one replica. The
    # request conflicts with the service as it is (the fuzz's stateful phase found a 422).
    body = spec("web", 1)
    body["replica"]["port"] = 20500
    await api.call("PUT", "/api/services/web", body)
    await api.h.settle()
    before = api.fingerprint()
    result = await api.call("POST", "/api/services/web/scale", {"replicas": 2}, status=409)
    assert result["error"] == "conflict"
    assert [e["field"] for e in result["errors"]] == ["replicas"]
    assert "fixed port" in result["errors"][0]["reason"]
    assert api.fingerprint() == before


async def test_a_whole_number_written_as_a_float_is_an_integer(api: Api) -> None:
    # JSON has one number type; JSON Schema's integer is any number without a fraction.
    await serving(api)
    await api.call("POST", "/api/services/web/scale", {"replicas": 3.0})
    assert api.h.state("web").desired.replicas == 3


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"replicas": True}, "replicas"),
        ({"replicas": "2"}, "replicas"),
        ({"route": {"path_prefix": "/web", "strip_prefix": 1}}, "route.strip_prefix"),
        ({"route": {"path_prefix": "/web", "strip_prefix": "yes"}}, "route.strip_prefix"),
        ({"probes": [{"type": "tcp", "jitter": True}]}, "probes.0.jitter"),
        ({"probes": [{"type": "tcp", "healthy_threshold": "2"}]}, "probes.0.healthy_threshold"),
        ({"rollout": {"max_surge": False, "max_unavailable": 1}}, "rollout.max_surge"),
        ({"retries": {"on_status": 0}}, "retries.on_status"),
        ({"limits": {"max_body_size": "1024"}}, "limits.max_body_size"),
    ],
)
async def test_a_spec_is_strict_about_json_types(
    api: Api, change: dict[str, Any], field: str
) -> None:
    await serving(api)
    before = api.fingerprint()
    body = await api.call("PUT", "/api/services/web", {**spec("web", 2), **change}, status=422)
    assert body["error"] == "invalid_spec"
    assert [e["field"] for e in body["errors"]] == [field]
    assert api.fingerprint() == before


async def test_yaml_is_as_strict_as_json(api: Api) -> None:
    body = yaml.safe_dump({**spec("web", 1), "replicas": True})
    response = await api.client.put(
        "/api/services/web", data=body, headers={**AUTH, "Content-Type": "application/yaml"}
    )
    assert response.status == 422
    assert (await response.json())["errors"][0]["field"] == "replicas"
    dated = "name: web\nroute: {path_prefix: /web}\nreplica: {commands: [serve]}\nx: 2026-01-01\n"
    response = await api.client.put(
        "/api/services/web", data=dated, headers={**AUTH, "Content-Type": "application/yaml"}
    )
    assert response.status == 422
    assert api.h.controller.service_names() == []


@pytest.mark.parametrize("path", ["/api/services/web%0A", "/api/services/%20"])
async def test_a_name_must_be_a_dns_label_to_its_end(api: Api, path: str) -> None:
    # The check used re.match with $, which lets a name end in a newline.
    body = spec("web", 1)
    del body["name"]
    result = await api.call("PUT", path, body, status=422)
    assert [e["field"] for e in result["errors"]] == ["name"]
    assert api.h.controller.service_names() == []


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("PUT", "/api/services/web?dry_run=yes"),
        ("PUT", "/api/services/web?dry_run=TRUE"),
        ("GET", "/api/services/web/rollouts?limit=%205"),
        ("GET", "/api/services/web/rollouts?limit=1_0"),
    ],
)
async def test_query_parameters_outside_the_document_are_422(
    api: Api, method: str, path: str
) -> None:
    await serving(api)
    before = api.fingerprint()
    body = spec("web", 3) if method == "PUT" else None
    result = await api.call(method, path, body, status=422)
    assert result["error"] == "invalid_request"
    assert api.fingerprint() == before


@pytest.mark.parametrize(
    ("method", "path", "code", "name"),
    [
        ("PUT", "/api/services/web?dryrun=1", "unknown_parameter", "dryrun"),
        ("PUT", "/api/services/web?dry_run=1&force", "unknown_parameter", "force"),
        ("PUT", "/api/services/web?dry_run=0&dry_run=1", "repeated_parameter", "dry_run"),
        ("PUT", "/api/services/web?dry%5Frun=0&dry_run=1", "repeated_parameter", "dry_run"),
        ("POST", "/api/services/web/scale?dry_run=1", "unknown_parameter", "dry_run"),
        ("GET", "/api/services/web?verbose", "unknown_parameter", "verbose"),
        ("GET", "/api/services/web/rollouts?limit=1&Limit=2", "unknown_parameter", "Limit"),
        ("GET", "/api/events?service=web&since=3", "unknown_parameter", "since"),
        ("GET", "/healthz?probe=1", "unknown_parameter", "probe"),
    ],
)
async def test_a_query_parameter_the_route_does_not_declare_is_400_naming_it(
    api: Api, method: str, path: str, code: str, name: str
) -> None:
    await serving(api)
    before = api.fingerprint()
    body = spec("web", 3) if method == "PUT" else {"replicas": 3} if method == "POST" else None
    result = await api.call(method, path, body, status=400)
    assert (result["error"], result["parameter"]) == (code, name)
    assert repr(name) in result["message"]
    await api.h.settle()
    assert api.fingerprint() == before


async def test_an_extra_route_takes_only_its_declared_query(
    h: Harness, admin_client: AdminClientFactory
) -> None:
    from controller.admin.handlers import unknown_query
    from controller.admin.openapi import Query

    async def extra(request: web.Request) -> web.Response:
        return web.json_response(dict(request.query))

    declared = Query("page", {"type": "integer"}, "Which page")
    op = Operation("GET", "/api/extra", extra, "An extra route", {200: None}, query=(declared,))
    assert unknown_query(op, ["page"]) is None
    client = await admin_client(build_admin_app(h.controller, lambda: True, TOKEN,
                                                extra_routes=[op]))  # fmt: skip
    assert await (await client.get("/api/extra?page=2", headers=AUTH)).json() == {"page": "2"}
    refused = await client.get("/api/extra?pages=2", headers=AUTH)
    assert refused.status == 400
    assert (await refused.json())["message"] == (
        "unknown query parameter 'pages' (this route takes: page)"
    )
    assert (await client.get("/api/extra?pages=2")).status == 401  # the token comes first


# -- rollouts ---------------------------------------------------------------------------------


async def test_pause_resume_abort_and_their_conflicts(api: Api) -> None:
    await serving(api)
    before = api.fingerprint()
    for action in ("pause", "resume", "abort"):
        body = await api.call("POST", f"/api/services/web/rollout/{action}", status=409)
        assert body == {"error": "conflict", "message": "service 'web' has no rollout in progress"}
    assert api.fingerprint() == before

    await api.call("PUT", "/api/services/web", spec("web", 2, "v2"))
    await api.h.settle()
    paused = await api.call("POST", "/api/services/web/rollout/pause")
    assert (paused["id"], paused["status"], paused["to_revision"]) == (2, "paused", 2)
    assert paused["reason"] == "paused by request"
    body = await api.call("POST", "/api/services/web/rollout/pause", status=409)
    assert body["message"] == "rollout 2 is paused"
    assert (await api.call("GET", "/api/services/web"))["status"] == "paused"

    resumed = await api.call("POST", "/api/services/web/rollout/resume")
    assert resumed["status"] == "progressing"
    assert resumed["progress"][0]["revision"] == 2
    assert {p["revision"] for p in resumed["progress"]} == {1, 2}

    rollback = await api.call("POST", "/api/services/web/rollout/abort")
    assert (rollback["kind"], rollback["from_revision"], rollback["to_revision"]) == (
        "rollback",
        2,
        1,
    )
    history = await api.call("GET", "/api/services/web/rollouts")
    # Revision 1 is still at full strength, so its rollback may complete before this read.
    assert history["rollouts"][0]["id"] == 3
    assert history["rollouts"][0]["status"] in ("progressing", "complete")
    assert [(r["id"], r["status"]) for r in history["rollouts"][1:]] == [
        (2, "aborted"),
        (1, "complete"),
    ]
    assert history["rollouts"][1]["reason"] == "aborted by request"


async def test_undo_to_the_previous_or_a_given_revision(api: Api) -> None:
    await serving(api)
    body = await api.call("POST", "/api/services/web/rollout/undo", status=409)
    assert body["message"] == "service 'web' has no revision before 1"
    await api.call("PUT", "/api/services/web", spec("web", 2, "v2"))
    for _ in range(5):
        await api.h.settle()
        await api.h.pass_probes("web", revision=2)
    assert api.h.state("web").observed.serving_revision == 2
    body = await api.call("POST", "/api/services/web/rollout/undo", {"revision": 9}, status=404)
    assert body["message"] == "service 'web' has no revision 9"
    body = await api.call("POST", "/api/services/web/rollout/undo", {"revision": 0}, status=422)
    assert body["errors"][0]["field"] == "revision"
    undo = await api.call("POST", "/api/services/web/rollout/undo")
    assert (undo["kind"], undo["from_revision"], undo["to_revision"]) == ("undo", 2, 1)
    again = await api.call("POST", "/api/services/web/rollout/undo", {"revision": 2})
    assert again["to_revision"] == 2


async def test_revisions_and_rollout_history(api: Api) -> None:
    await serving(api)
    await api.call("PUT", "/api/services/web", spec("web", 2, "v2"))
    revisions = await api.call("GET", "/api/services/web/revisions")
    assert revisions["service"] == "web"
    assert [(r["number"], r["serving"], r["target"]) for r in revisions["revisions"]] == [
        (1, True, False),
        (2, False, True),
    ]
    assert revisions["revisions"][1]["spec"]["replica"]["env"] == {"VERSION": "v2"}
    rollouts = await api.call("GET", "/api/services/web/rollouts?limit=1")
    assert [r["id"] for r in rollouts["rollouts"]] == [2]
    body = await api.call("GET", "/api/services/web/rollouts?limit=0", status=422)
    assert body["errors"] == [{"field": "limit", "reason": "must be from 1 to 1000"}]


async def test_a_failed_rollout_shows_its_reason(api: Api) -> None:
    await serving(api, rollout={"retries": 0})
    api.h.backend.exit_on_start(3)
    await api.call("PUT", "/api/services/web", spec("web", 2, "v2", rollout={"retries": 0}))
    await api.h.settle()
    history = await api.call("GET", "/api/services/web/rollouts")
    failed = next(r for r in history["rollouts"] if r["id"] == 2)
    assert failed["status"] == "failed"
    assert failed["reason"] == "replica exited with code 3 (after 1 failure)"
    assert failed["finished_at"] is not None
    view = await api.call("GET", "/api/services/web")
    assert (view["serving_revision"], view["target_revision"], view["ready"]) == (1, 1, 2)
    failures = [r for r in view["replicas"] if r["state"] == "failed"]
    assert [(r["revision"], r["exit_code"], r["failure"]) for r in failures] == [
        (2, 3, "replica exited with code 3")
    ]


async def test_a_start_that_cannot_be_placed_shows_its_backoff(api: Api) -> None:
    await serving(api)
    view = await api.call("GET", "/api/services/web")
    assert view["backoff"] is None
    api.h.backend.set_capacity(2)
    await api.call("POST", "/api/services/web/scale", {"replicas": 3})
    await api.h.settle()
    failed_at = api.h.clock.now  # the harness's wall clock is its clock
    view = await api.call("GET", "/api/services/web")
    assert view["backoff"] == {
        "failures": 1,
        "reason": "no capacity: 2 of 2 slots in use",
        "last_failure_at": failed_at,
        "retry_at": failed_at + 1,  # retry_backoff
    }
    await api.h.advance(1)  # the retry fails too: the backoff doubles
    view = await api.call("GET", "/api/services/web")
    assert (view["backoff"]["failures"], view["backoff"]["retry_at"]) == (2, failed_at + 1 + 2)
    await api.call("POST", "/api/services/web/scale", {"replicas": 2})
    view = await api.call("GET", "/api/services/web")  # it wants no start: nothing waits
    assert (view["ready"], view["backoff"]) == (2, None)
    api.h.backend.set_capacity(None)
    await api.call("POST", "/api/services/web/scale", {"replicas": 3})
    await api.h.advance(2)
    await api.h.pass_probes("web")
    view = await api.call("GET", "/api/services/web")
    assert (view["ready"], view["backoff"]) == (3, None)


# -- replicas and upstreams -------------------------------------------------------------------


async def test_replica_logs(api: Api) -> None:
    await serving(api)
    replica = api.h.replicas("web")[0]
    api.h.backend.set_logs(replica.id, [f"line {i}" for i in range(10)])
    body = await api.call("GET", f"/api/services/web/replicas/{replica.id}/logs?tail=3")
    assert body == {
        "service": "web",
        "replica": replica.id,
        "lines": ["line 7", "line 8", "line 9"],
        "node": None,  # on one gateway; in a cluster, the node whose log it is
    }
    body = await api.call("GET", f"/api/services/web/replicas/{replica.id}/logs")
    assert len(body["lines"]) == 10
    for tail in ("0", "x", "100001"):
        path = f"/api/services/web/replicas/{replica.id}/logs?tail={tail}"
        body = await api.call("GET", path, status=422)
        assert body["errors"][0]["field"] == "tail"


async def test_drain_and_undrain_an_upstream(api: Api) -> None:
    await serving(api)
    replica = api.h.replicas("web")[0]
    drained = await api.call("POST", f"/api/services/web/upstreams/{replica.id}/drain")
    assert (drained["id"], drained["state"], drained["admin"]) == (
        replica.id,
        "draining",
        "draining",
    )
    assert replica.id not in {u.id for u in api.h.pool.service("web").snapshot.routable}
    undrained = await api.call("POST", f"/api/services/web/upstreams/{replica.id}/undrain")
    assert (undrained["state"], undrained["admin"]) == ("healthy", "active")
    assert replica.id in {u.id for u in api.h.pool.service("web").snapshot.routable}


async def test_undrain_of_a_replica_the_controller_is_stopping_is_409(api: Api) -> None:
    await serving(api)
    pool = api.h.pool.service("web")
    first, second = pool.lease(), pool.lease()  # hold the drain open, whichever it takes
    assert first is not None
    assert second is not None
    with first, second:
        await api.call("POST", "/api/services/web/scale", {"replicas": 1})
        await api.h.settle()
        leaving = api.h.replicas("web", ReplicaState.DRAINING)
        assert len(leaving) == 1
        before = api.fingerprint()
        path = f"/api/services/web/upstreams/{leaving[0].id}/undrain"
        body = await api.call("POST", path, status=409)
        assert body["error"] == "conflict"
        assert api.fingerprint() == before


async def test_an_unhealthy_replica_shows_in_the_view(api: Api) -> None:
    await serving(api)
    replica = api.h.replicas("web")[0]
    api.h.pool.set_health("web", replica.id, Health.UNHEALTHY, "probe failed")
    await api.h.settle()
    view = await api.call("GET", "/api/services/web")
    states = {r["id"]: (r["state"], r["health"]) for r in view["replicas"]}
    assert states[replica.id] == ("unhealthy", "unhealthy")


# -- events -----------------------------------------------------------------------------------


async def read_events(response: Any, until: str) -> list[dict[str, Any]]:
    """Events of a stream as {id, event, data} up to one of kind ``until``; comments skipped."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    while not events or events[-1]["event"] != until:
        line = (await asyncio.wait_for(response.content.readline(), 5)).decode().rstrip("\n")
        if not line:
            if current:
                events.append(current)
                current = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(": ")
            current[key] = json.loads(value) if key == "data" else value
    return events


async def test_events_stream_the_transitions_of_one_service(api: Api) -> None:
    response = await api.client.get("/api/events?service=web", headers=AUTH)
    assert response.status == 200
    assert response.content_type == "text/event-stream"
    assert await response.content.readline() == b": watching\n"
    await api.call("PUT", "/api/services/api", spec("api", 1))
    await api.call("PUT", "/api/services/web", spec("web", 1))
    await api.h.settle()
    await api.h.pass_probes("web")
    events = await read_events(response, until="rollout_complete")
    kinds = [e["event"] for e in events]
    assert kinds[0] == "service_created"
    assert kinds.index("replica_started") < kinds.index("replica_ready")
    assert {e["data"]["service"] for e in events} == {"web"}
    assert all(e["id"] == str(e["data"]["id"]) for e in events)
    assert all(e["event"] == e["data"]["kind"] for e in events)
    response.close()


async def test_events_send_keepalives_and_end_when_the_client_goes(api: Api) -> None:
    journal = api.h.controller.journal
    response = await api.client.get("/api/events", headers=AUTH)
    assert await response.content.readline() == b": watching\n"
    assert await response.content.readline() == b"\n"
    assert await asyncio.wait_for(response.content.readline(), 5) == b": keepalive\n"
    assert len(journal._watchers) == 1
    response.close()
    # The handler is cancelled on the server's next turn.
    await eventually(lambda: not journal._watchers, what="the watcher to go")


async def test_events_end_when_the_admin_app_shuts_down(
    h: Harness, admin_client: AdminClientFactory
) -> None:
    app = build_admin_app(h.controller, lambda: True, TOKEN, sse_keepalive=30)
    client = await admin_client(app)
    response = await client.get("/api/events", headers=AUTH)
    assert await response.content.readline() == b": watching\n"
    await client.server.close()  # AdminServer.stop: aiohttp's runner cleanup
    assert await asyncio.wait_for(response.content.read(), 5) == b"\n"
    assert not h.controller.journal._watchers


async def test_events_show_health_transitions(api: Api) -> None:
    # The data plane's view: a starting replica failing its probes changes no replica state
    # (no replica_* entry), an ejection neither; both are transitions an operator watches.
    await api.call("PUT", "/api/services/web", spec("web", 1))
    await api.h.settle()
    starting = api.h.replicas("web")[0]
    response = await api.client.get("/api/events?service=web", headers=AUTH)
    assert await response.content.readline() == b": watching\n"
    api.h.pool.set_health("web", starting.id, Health.UNHEALTHY, "probe failed: 503")
    [sick] = (await read_events(response, until="upstream_unhealthy"))[-1:]
    assert sick["data"]["message"] == (
        f"upstream {starting.id} unknown -> unhealthy: probe failed: 503"
    )
    assert (sick["data"]["replica"], sick["data"]["revision"]) == (starting.id, 1)
    api.h.pool.set_health("web", starting.id, Health.HEALTHY, "probe passed")
    await api.h.settle()
    kinds = [e["event"] for e in await read_events(response, until="upstream_healthy")]
    assert "replica_ready" in kinds  # the controller's view follows, as before
    assert api.h.pool.eject("web", starting.id, "5 consecutive 5xx") is not None
    ejected = (await read_events(response, until="upstream_ejected"))[-1]
    assert ejected["data"]["message"] == f"upstream {starting.id} ejected: 5 consecutive 5xx"
    response.close()


async def test_health_transitions_are_recorded_once_however_many_apps(
    api: Api, admin_client: AdminClientFactory
) -> None:
    await admin_client(build_admin_app(api.h.controller, lambda: True, TOKEN))
    await api.call("PUT", "/api/services/web", spec("web", 1))
    await api.h.settle()
    replica = api.h.replicas("web")[0]
    api.h.pool.set_health("web", replica.id, Health.UNHEALTHY, "probe failed")
    rows = [e for e in api.h.store.events("web") if e.kind == "upstream_unhealthy"]
    assert len(rows) == 1


async def test_a_watcher_that_comes_back_gets_what_it_missed(api: Api) -> None:
    response = await api.client.get("/api/events?service=web", headers=AUTH)
    await api.call("PUT", "/api/services/web", spec("web", 1))
    await api.h.settle()
    seen = await read_events(response, until="replica_started")
    response.close()
    await api.call("PUT", "/api/services/api", spec("api", 1))
    await api.h.pass_probes("web")  # while nobody watches
    await api.h.settle()
    missed = [e for e in api.h.store.events("web") if e.id > int(seen[-1]["id"])]
    assert missed

    headers = {**AUTH, "Last-Event-ID": seen[-1]["id"]}
    response = await api.client.get("/api/events?service=web", headers=headers)
    again = await read_events(response, until=missed[-1].kind)
    assert [int(e["id"]) for e in again] == [e.id for e in missed]
    await api.call("POST", "/api/services/web/scale", {"replicas": 2})  # and then live
    live = await read_events(response, until="service_updated")
    assert int(live[0]["id"]) > missed[-1].id
    response.close()


async def test_the_history_a_watcher_can_come_back_to_is_bounded(h: Harness) -> None:
    journal = Journal(h.store, h.clock, history=3)
    ids = [journal.record("web", "service_updated", f"m{i}").id for i in range(5)]
    assert [e.id for e in journal.since(ids[2])] == ids[3:]
    assert [e.id for e in journal.since(ids[0])] == ids[2:]  # older than it holds: all of it
    assert journal.since(ids[4]) == []
    assert "history=3" in repr(journal)


@pytest.mark.parametrize("last", ["x", "1.5", "", "9" * 30])
async def test_a_last_event_id_that_is_no_id_is_422(api: Api, last: str) -> None:
    body = await api.call("GET", "/api/events", headers={"Last-Event-ID": last}, status=422)
    assert body["errors"][0]["field"] == "Last-Event-ID"


# -- failures ---------------------------------------------------------------------------------


async def test_an_unavailable_store_is_503_with_the_reason(api: Api) -> None:
    await serving(api)
    api.h.store.close()
    body = await api.call("GET", "/api/services/web/revisions", status=503)
    assert body["error"] == "store_unavailable"
    assert body["message"] == "the store is closed"
    assert body["reason"] == "closed"
    body = await api.call("PUT", "/api/services/web", spec("web", 2, "v2"), status=503)
    assert body["error"] == "store_unavailable"
    assert api.h.state("web").desired.revision == 1
    response = await api.client.get("/api/services/web/rollouts", headers=AUTH)
    assert response.headers["Retry-After"] == "1"


async def test_an_unexpected_error_is_a_bare_500(
    api: Api, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def boom() -> list[str]:
        raise RuntimeError("internal detail /etc/secret")

    monkeypatch.setattr(api.h.controller, "service_names", boom)
    with caplog.at_level(logging.ERROR):
        body = await api.call("GET", "/api/services", status=500)
    assert body == {"error": "internal_error", "message": "internal error (see the gateway log)"}
    assert "internal detail" in caplog.text  # for the operator, not for the client


# -- what a browser sends for another site (origin.py) -----------------------------------------


@pytest.fixture
async def open_api(h: Harness, admin_client: AdminClientFactory) -> Api:
    """The API with no token configured, as on the demo's loopback listener."""
    app = build_admin_app(h.controller, lambda: True, None)
    return Api(await admin_client(app), h)


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"Sec-Fetch-Site": "cross-site"}, "cross_site_request"),  # a form's POST from a page
        ({"Sec-Fetch-Site": "same-site"}, "cross_site_request"),  # another port of the host
        ({"Origin": "http://attacker.example"}, "cross_site_request"),
        ({"Origin": "null"}, "cross_site_request"),  # a sandboxed page or a file
        ({"Host": "rebound.example:8081"}, "untrusted_host"),  # DNS rebinding to 127.0.0.1
    ],
    ids=["cross_site", "same_site", "origin", "null_origin", "rebinding"],
)
async def test_a_write_a_browser_sends_for_another_site_is_403_and_changes_nothing(
    open_api: Api, h: Harness, headers: dict[str, str], code: str
) -> None:
    await h.controller.apply(spec("web", 2))
    await h.settle()
    before = open_api.fingerprint()
    for path, body in (("/api/services/web/scale", {"replicas": 0}), ("/api/services/web", None)):
        method = "POST" if body is not None else "DELETE"
        error = await open_api.call(method, path, body, status=403, headers=headers)
        assert error["error"] == code, error
    # text/plain, as a form may send it: refused before the body is read as JSON
    response = await open_api.client.post(
        "/api/services/web/scale",
        data='{"replicas": 0}',
        headers={**headers, "Content-Type": "text/plain"},
    )
    assert response.status == 403
    await h.settle()
    assert open_api.fingerprint() == before


async def test_the_page_of_the_listener_itself_and_clients_that_are_not_browsers_are_served(
    open_api: Api, h: Harness
) -> None:
    await h.controller.apply(spec("web", 2))
    await h.settle()
    own = f"http://{open_api.client.host}:{open_api.client.port}"
    for headers in (
        {},  # the CLI, curl
        {"Sec-Fetch-Site": "same-origin", "Origin": own},  # the console, on this listener
        {"Sec-Fetch-Site": "none"},  # typed into the address bar
        {"Host": f"localhost:{open_api.client.port}"},
    ):
        await open_api.call("POST", "/api/services/web/scale", {"replicas": 3}, headers=headers)
    assert h.controller.reconciler.services["web"].desired.replicas == 3


async def test_with_a_token_a_host_name_is_taken(api: Api, h: Harness) -> None:
    """A name is refused only while no token is configured: a browser cannot send one."""
    await h.controller.apply(spec("web", 1))
    await h.settle()
    await api.call("GET", "/api/services/web", headers={"Host": "gateway.internal:8081"})
