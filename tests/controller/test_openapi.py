"""The OpenAPI document against what the admin API really does.

Every route is called for real (on the fake backend) and each JSON response, errors included,
is validated against the schema the document gives for that path, method and status. The
validator below covers the JSON Schema keywords pydantic emits and refuses any other, so a
keyword it does not know can never make a check pass by being ignored.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from controller.admin import console
from controller.admin.app import OPEN_PATHS, build_admin_app
from tests.support.admin_client import AdminClient, AdminClientFactory

from .conftest import Harness, spec

TOKEN = "openapi-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


ANNOTATIONS = {"title", "description", "default", "examples", "format", "deprecated"}
TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


class SchemaError(AssertionError):
    pass


class Validator:
    """JSON Schema (2020-12, the subset pydantic writes) over the document's components."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def resolve(self, ref: str) -> Any:
        assert ref.startswith("#/"), ref
        node: Any = self.document
        for part in ref[2:].split("/"):
            node = node[part]
        return node

    def errors(self, schema: Any, value: Any, at: str = "$") -> list[str]:
        if schema is True:
            return []
        if schema is False:
            return [f"{at}: no value allowed"]
        unknown = {k for k in schema if not k.startswith("x-")} - ANNOTATIONS - set(CHECKS)
        if unknown:
            raise SchemaError(f"the validator does not know {sorted(unknown)} (at {at})")
        out: list[str] = []
        for keyword, check in CHECKS.items():
            if keyword in schema:
                out += check(self, schema, value, at)
        return out

    def validate(self, schema: Any, value: Any) -> None:
        errors = self.errors(schema, value)
        if errors:
            raise SchemaError("; ".join(errors[:10]))


def _ref(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    return v.errors(v.resolve(s["$ref"]), value, at)


def _type(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    types = s["type"] if isinstance(s["type"], list) else [s["type"]]
    return [] if any(TYPES[t](value) for t in types) else [f"{at}: not of type {types}"]


def _properties(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    if not isinstance(value, dict):
        return []
    out = []
    for key, item in value.items():
        if key in s["properties"]:
            out += v.errors(s["properties"][key], item, f"{at}.{key}")
    return out


def _additional(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    if not isinstance(value, dict):
        return []
    known = set(s.get("properties", {}))
    out = []
    for key, item in value.items():
        if key not in known:
            out += v.errors(s["additionalProperties"], item, f"{at}.{key}")
    return out


def _required(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    if not isinstance(value, dict):
        return []
    return [f"{at}: {key} is required" for key in s["required"] if key not in value]


def _items(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    if not isinstance(value, list):
        return []
    return [e for i, item in enumerate(value) for e in v.errors(s["items"], item, f"{at}[{i}]")]


def _any_of(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    if any(not v.errors(option, value, at) for option in s["anyOf"]):
        return []
    return [f"{at}: matches none of anyOf"]


def _enum(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    return [] if value in s["enum"] else [f"{at}: {value!r} not in {s['enum']}"]


def _const(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    return [] if value == s["const"] else [f"{at}: {value!r} is not {s['const']!r}"]


def _bound(keyword: str, ok: Callable[[Any, Any], bool]) -> Any:
    def check(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
        if not TYPES["number"](value) or ok(value, s[keyword]):
            return []
        return [f"{at}: {value} fails {keyword} {s[keyword]}"]

    return check


def _pattern(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    # ECMA-262's $ is the end of the string; Python's also matches before a last newline.
    if not isinstance(value, str) or re.search(re.sub(r"\$$", r"\\Z", s["pattern"]), value):
        return []
    return [f"{at}: {value!r} does not match {s['pattern']}"]


def _all_of(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    return [e for option in s["allOf"] for e in v.errors(option, value, at)]


def _not(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    return [f"{at}: matches what it must not"] if not v.errors(s["not"], value, at) else []


def _size(keyword: str, kind: type, ok: Callable[[int, int], bool]) -> Any:
    def check(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
        if not isinstance(value, kind) or ok(len(value), s[keyword]):
            return []
        return [f"{at}: length {len(value)} fails {keyword} {s[keyword]}"]

    return check


def _property_names(v: Validator, s: dict[str, Any], value: Any, at: str) -> list[str]:
    if not isinstance(value, dict):
        return []
    return [e for key in value for e in v.errors(s["propertyNames"], key, f"{at}.{key}")]


CHECKS: dict[str, Callable[[Validator, dict[str, Any], Any, str], list[str]]] = {
    "$ref": _ref,
    "type": _type,
    "properties": _properties,
    "additionalProperties": _additional,
    "required": _required,
    "items": _items,
    "anyOf": _any_of,
    "enum": _enum,
    "const": _const,
    "minimum": _bound("minimum", lambda x, b: x >= b),
    "maximum": _bound("maximum", lambda x, b: x <= b),
    "exclusiveMinimum": _bound("exclusiveMinimum", lambda x, b: x > b),
    "pattern": _pattern,
    "allOf": _all_of,
    "not": _not,
    "minItems": _size("minItems", list, lambda n, b: n >= b),
    "maxItems": _size("maxItems", list, lambda n, b: n <= b),
    "minLength": _size("minLength", str, lambda n, b: n >= b),
    "maxLength": _size("maxLength", str, lambda n, b: n <= b),
    "maxProperties": _size("maxProperties", dict, lambda n, b: n <= b),
    "propertyNames": _property_names,
}


# -- the document -----------------------------------------------------------------------------


class Checked:
    """Calls routes and checks each response against the document; records what it saw."""

    def __init__(self, client: AdminClient, document: dict[str, Any]) -> None:
        self.client = client
        self.document = document
        self.validator = Validator(document)
        self.seen: set[tuple[str, str, int]] = set()

    def operation(self, method: str, template: str) -> dict[str, Any]:
        op: dict[str, Any] = self.document["paths"][template][method.lower()]
        return op

    async def call(
        self,
        method: str,
        template: str,
        body: Any = None,
        *,
        status: int = 200,
        query: str = "",
        headers: dict[str, str] | None = None,
        **params: str,
    ) -> Any:
        path = template.format(**params) + query
        sent = {**AUTH, **(headers or {})}
        data: Any = None
        if body is not None:
            data = body if isinstance(body, str | bytes) else json.dumps(body)
            if len(data) > 2**20:
                data = io.BytesIO(data.encode() if isinstance(data, str) else data)
            sent.setdefault("Content-Type", "application/json")
        response = await self.client.request(method, path, data=data, headers=sent)
        text = await response.text()
        assert response.status == status, text
        ops = self.document["paths"][template]
        # A method the path lacks has no operation: its 405 is the one every operation gives.
        op = ops.get(method.lower()) or (next(iter(ops.values())) if status == 405 else None)
        assert op is not None, f"{method} {template} is not documented"
        responses = op["responses"]
        assert str(status) in responses, f"{method} {template} {status} is not documented"
        content = responses[str(status)].get("content")
        if content is None:
            return None
        assert response.content_type in content, (response.content_type, list(content))
        value = json.loads(text)
        self.validator.validate(content[response.content_type]["schema"], value)
        self.seen.add((method, template, status))
        return value


@pytest.fixture
async def checked(h: Harness, admin_client: AdminClientFactory) -> Checked:
    def metrics(accept: str) -> tuple[bytes, str]:
        return b"# metrics\n", "text/plain"

    app = build_admin_app(h.controller, lambda: True, TOKEN, metrics=metrics, sse_keepalive=0.05)
    client = await admin_client(app)
    response = await client.get("/api/openapi.json", headers=AUTH)
    assert response.status == 200
    return Checked(client, await response.json())


def test_the_validator_refuses_what_it_should(h: Harness) -> None:
    from controller.admin.handlers import OPERATIONS_TABLE
    from controller.admin.openapi import build_document

    v = Validator(build_document(OPERATIONS_TABLE))
    scale = {"$ref": "#/components/schemas/ScaleRequest"}
    v.validate(scale, {"replicas": 3})
    bad: Any
    for bad in ({}, {"replicas": -1}, {"replicas": "3"}, {"replicas": 1, "more": 2}, [], None):
        with pytest.raises(SchemaError):
            v.validate(scale, bad)
    service = {"$ref": "#/components/schemas/ServiceSpec"}
    v.validate(service, spec("web", 2, rollout={"drain_timeout": "30s", "min_ready": 1.5}))
    for bad in (
        spec("web", 2, rollout={"drain_timeout": "soon"}),
        spec("web", 2, rollout={"drain_timeout": -1}),
        {**spec("web"), "replicas": "two"},
        {"name": "web"},
    ):
        with pytest.raises(SchemaError):
            v.validate(service, bad)
    relative = spec("web", 2)
    relative["replica"]["working_dir"] = "site"
    with pytest.raises(SchemaError, match="working_dir"):
        v.validate(service, relative)
    with pytest.raises(SchemaError, match="does not know"):
        v.validate({"oneOf": [{"type": "string"}]}, "x")


async def test_the_document_describes_every_route_of_the_app(checked: Checked) -> None:
    doc = checked.document
    assert doc["openapi"] == "3.1.0"
    app = checked.client.app
    assert app is not None
    mounted = set()
    for route in app.router.routes():
        assert route.resource is not None
        mounted.add((route.method.lower(), route.resource.canonical))
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert mounted == documented
    for path, ops in doc["paths"].items():
        for op in ops.values():
            open_path = path in OPEN_PATHS
            assert op["security"] == ([] if open_path else [{"bearer": []}]), path
            if not open_path:
                assert "401" in op["responses"]
            assert "405" in op["responses"]
            assert "500" in op["responses"]
    spec_body = doc["paths"]["/api/services/{name}"]["put"]["requestBody"]["content"]
    assert set(spec_body) == {"application/json", "application/yaml", "application/x-yaml",
                              "text/yaml"}  # fmt: skip


async def test_every_response_matches_the_document(h: Harness, checked: Checked) -> None:
    c = checked
    svc = "/api/services/{name}"
    await c.call("GET", "/healthz", headers={"Authorization": ""})
    await c.call("GET", "/readyz")
    await c.call("GET", "/api/services")
    await c.call("GET", "/api/hosts")
    await c.call("GET", "/api/services", status=401, headers={"Authorization": "Bearer no"})
    await c.call("GET", svc, status=404, name="web")
    await c.call("PATCH", svc, status=405, name="web")

    # Apply, dry-run, and every kind of refusal of a spec.
    await c.call("PUT", svc, spec("web", 2), query="?dry_run=1", name="web")
    await c.call("PUT", svc, spec("web", 2), name="web")
    await c.call("PUT", svc, "{nope", status=400, name="web")
    await c.call("PUT", svc, spec("web", 2), query="?dryrun=1", status=400, name="web")
    await c.call("GET", "/api/hosts", query="?verbose=1", status=400)
    await c.call("PUT", svc, spec("web", -1), status=422, name="web")
    await c.call("PUT", svc, spec("other"), status=409, name="web")
    await c.call("PUT", svc, {**spec("web"), "replicas": True}, status=422, name="web")
    await c.call("PUT", svc, {**spec("web"), "x": "y" * 2**20}, status=413, name="web")
    await h.settle()
    view = await c.call("GET", svc, name="web")
    assert view["rollout"] is not None
    assert view["replicas"]
    await h.pass_probes("web")
    await c.call("GET", svc, name="web")
    await c.call("GET", "/api/services")

    # Bearer tokens (auth is routing: applied at once, no rollout).
    tokens = svc + "/tokens"
    await c.call("POST", tokens, status=409, name="web")  # no auth on the service yet
    await c.call("PUT", svc, {**spec("web", 2), "auth": {"type": "bearer"}}, name="web")
    added = await c.call("POST", tokens, status=201, name="web")
    await c.call("POST", tokens, {"token": "t" * 32, "label": "ci"}, status=201, name="web")
    await c.call("POST", tokens, {"token": "t" * 32}, status=409, name="web")
    await c.call("POST", tokens, {"token": "short"}, status=422, name="web")
    await c.call("GET", tokens, name="web")
    await c.call("GET", tokens, status=404, name="nope")
    revoke = tokens + "/{token}"
    await c.call("DELETE", revoke, name="web", token=added["token"]["id"])
    await c.call("DELETE", revoke, status=404, name="web", token="tok_nope")
    await c.call("DELETE", revoke, status=409, name="web", token="file:0123")

    # Rollout control.
    await c.call("POST", svc + "/rollout/pause", status=409, name="web")
    await c.call("POST", svc + "/rollout/promote", status=409, name="web")
    await c.call("PUT", svc, spec("web", 2, "v2"), name="web")
    await h.settle()
    await c.call("POST", svc + "/rollout/pause", name="web")
    await c.call("POST", svc + "/rollout/resume", name="web")
    await c.call("POST", svc + "/rollout/resume", status=409, name="web")
    await c.call("POST", svc + "/rollout/promote", name="web")
    await c.call("POST", svc + "/rollout/abort", name="web")
    await c.call("POST", svc + "/rollout/undo", {"revision": 2}, name="web")
    await c.call("POST", svc + "/rollout/undo", {"revision": "x"}, status=422, name="web")
    await c.call("POST", svc + "/rollout/undo", {"revision": 7}, status=404, name="web")
    await c.call("GET", svc + "/revisions", name="web")
    await c.call("GET", svc + "/rollouts", name="web")
    await c.call("GET", svc + "/rollouts", query="?limit=x", status=422, name="web")

    # Scale, replicas, upstreams.
    await c.call("POST", svc + "/scale", {"replicas": 3}, name="web")
    await c.call("POST", svc + "/scale", {"replicas": -3}, status=422, name="web")
    await c.call("POST", svc + "/scale", status=400, name="web")
    await h.settle()
    replica = h.replicas("web")[0].id
    h.backend.set_logs(replica, ["hello"])
    logs = svc + "/replicas/{replica}/logs"
    await c.call("GET", logs, query="?tail=5", name="web", replica=replica)
    await c.call("GET", logs, status=404, name="web", replica="nope")
    await c.call("GET", logs, query="?tail=-1", status=422, name="web", replica=replica)
    drain = svc + "/upstreams/{upstream}/drain"
    undrain = svc + "/upstreams/{upstream}/undrain"
    await c.call("POST", drain, name="web", upstream=replica)
    await c.call("POST", undrain, name="web", upstream=replica)
    await c.call("POST", drain, status=404, name="web", upstream="nope")
    await c.call("POST", undrain, status=404, name="web", upstream="nope")

    # The store going away.
    await c.call("GET", "/api/openapi.json")  # no schema for the document itself: not checked
    h.store.close()
    await c.call("GET", svc + "/rollouts", status=503, name="web")
    await c.call("DELETE", svc, status=202, name="web")

    ops = {(m.upper(), p) for p, o in c.document["paths"].items() for m in o}
    ops -= {("GET", "/metrics"), ("GET", "/api/events"), ("GET", "/api/openapi.json")}
    ops -= {("GET", path) for path in console.PATHS}  # not JSON: test_admin_console.py
    succeeded = {(m, p) for m, p, s in c.seen if s < 300}
    assert ops <= succeeded, ops - succeeded
    assert {s for _, _, s in c.seen} >= {200, 202, 400, 401, 404, 405, 409, 413, 422, 503}
    for path, ops in c.document["paths"].items():
        for op in ops.values():  # any route refuses a query parameter it does not declare
            assert "400" in op["responses"], path


async def test_server_sent_events_match_the_document(h: Harness, checked: Checked) -> None:
    op = checked.operation("GET", "/api/events")
    content = op["responses"]["200"]["content"]["text/event-stream"]
    schema = content["x-data-schema"]
    response = await checked.client.get("/api/events?service=web", headers=AUTH)
    assert response.status == 200
    await checked.call("PUT", "/api/services/{name}", spec("web", 1), name="web")
    await h.settle()
    await h.pass_probes("web")
    seen = 0
    while seen < 3:
        line = await asyncio.wait_for(response.content.readline(), 5)
        if line.startswith(b"data: "):
            checked.validator.validate(schema, json.loads(line[6:]))
            seen += 1
    response.close()


# -- the document states what the server enforces ----------------------------------------------


def _document() -> dict[str, Any]:
    from controller.admin.handlers import OPERATIONS_TABLE
    from controller.admin.openapi import build_document

    return build_document(OPERATIONS_TABLE)


def test_the_document_states_the_name_rule_where_a_name_is_given() -> None:
    from controller.spec import NAME_PATTERN

    doc = _document()
    name = doc["components"]["schemas"]["ServiceSpec"]["properties"]["name"]
    assert (name["pattern"], name["maxLength"]) == (NAME_PATTERN, 63)
    # Left out of a PUT body, the name is the path's.
    assert "name" not in doc["components"]["schemas"]["ServiceSpec"]["required"]
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for param in op["parameters"]:
                if param["name"] == "name":
                    assert param["schema"]["pattern"] == NAME_PATTERN, path


def test_the_document_offers_metric_queue_only_with_load_metrics() -> None:
    doc = _document()
    metric = doc["components"]["schemas"]["ScalingConfig"]["properties"]["metric"]
    assert metric["enum"] == ["concurrency", "rps", "queue"]
    v = Validator(doc)
    service = {"$ref": "#/components/schemas/ServiceSpec"}
    scaling = {"metric": "queue", "target": 4}
    queue = {**spec("web", 1), "replicas": {"min": 1, "max": 2}, "scaling": scaling}
    with pytest.raises(SchemaError):
        v.validate(service, queue)
    v.validate(service, {**queue, "load_metrics": {"format": "vllm"}})
    v.validate(service, {**queue, "scaling": {"metric": "rps"}})
    v.validate(service, {**queue, "scaling": {"target": 4}})


def test_the_document_names_only_the_backends_the_gateway_has() -> None:
    from controller.admin.handlers import OPERATIONS_TABLE
    from controller.admin.openapi import build_document

    doc = build_document(OPERATIONS_TABLE, backends=["process"])
    spec_schema = doc["components"]["schemas"]["ServiceSpec"]
    assert spec_schema["properties"]["backend"]["enum"] == ["process"]
    v = Validator(doc)
    v.validate({"$ref": "#/components/schemas/ServiceSpec"}, spec("web", 1))
    static = {**spec("web", 1), "backend": "static", "replica": {"addresses": ["h:1"]}}
    with pytest.raises(SchemaError):
        v.validate({"$ref": "#/components/schemas/ServiceSpec"}, static)


def _spec_with(field: str, value: Any) -> dict[str, Any]:
    base = spec("web", 1)
    match field:
        case "name":
            base["name"] = value
        case "command":
            base["replica"]["commands"] = [value]
        case "env_name":
            base["replica"]["env"] = {value: "x"}
        case "env_value":
            base["replica"]["env"] = {"V": value}
        case "host":
            base["route"] = {"hosts": [value]}
        case "path_prefix":
            base["route"] = {"path_prefix": value}
        case "probe_path":
            base["probes"] = [{"path": value}]
        case "header_name":
            base["probes"] = [{"headers": {value: "x"}}]
        case "header_value":
            base["probes"] = [{"headers": {"X-A": value}}]
        case "interval":
            base["probes"] = [{"interval": value}]
        case "duration":
            base["queue_timeout"] = value
        case "address":
            base.update(backend="static", replica={"addresses": [value]})
        case "rate_key":
            base.update(auth={"type": "bearer"}, rate_limits=[{"rps": 1, "key": value}])
        case "rate_prefix":
            base["rate_limits"] = [{"rps": 1, "path_prefix": value}]
        case "affinity_key":
            base["load_balancing"] = {"policy": "hash", "key": value}
        case "auth_header":
            base["auth"] = {"header": value}
        case "tokens_file":
            base["auth"] = {"tokens_file": value}
    return base


FIELD_PATTERNS = {
    "name": r"^[a-z0-9][a-z0-9-]{0,3}$",
    "command": r"^\s{0,2}[\x00-\x7f\x85\xa0\u2000]{0,4}\s{0,2}$",
    "env_name": r"^[A-Za-z0-9_\n=]{0,5}$",
    "env_value": r"^[\x00a-z]{0,4}$",
    "host": r"^[*.A-Za-z0-9_-]{0,12}$",
    "path_prefix": r"^[/a-z.%?# \\]{0,8}$",
    "probe_path": r"^[/a-z \r\n]{0,5}$",
    "header_name": r"^[!#$%&'*+.^_`|~0-9A-Za-z:\n -]{0,5}$",
    "header_value": r"^[\x00-\x20\x7fa-z]{0,4}$",
    "interval": r"^\s?[0-9.]{0,5}(ms|s|m|h)?\s?$",
    "duration": r"^\s?[0-9\u0660.]{0,4}(ms|s|m|h)?\s?$",
    "address": r"^[\[\]:a-z0-9 .]{0,10}$",
    "rate_key": r"^(ip|token|cookie|header|[a-z:\n -]){0,4}$",
    "rate_prefix": r"^[/a-z?# \t\n]{0,5}$",
    "affinity_key": r"^(ip|token|cookie|header|[a-zA-Z:\n -]){0,4}$",
    "auth_header": r"^[!#$%&'*+.^_`|~0-9A-Za-z:\n -]{0,5}$",
    "tokens_file": r"^[/a-z\x00.]{0,5}$",
}
"""Per field: strings near the edge of its rule (both sides of it), to draw from."""


@pytest.mark.parametrize("field", FIELD_PATTERNS)
def test_the_document_and_the_server_agree_on_each_string_rule(field: str) -> None:
    # The document says what a valid value is; the server's validators decide. For strings
    # drawn near each rule's edge, both must say the same.
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from controller.spec import ServiceSpec

    v = Validator(_document())
    spec_schema = {"$ref": "#/components/schemas/ServiceSpec"}

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(st.from_regex(FIELD_PATTERNS[field], fullmatch=True))
    def agree(value: str) -> None:
        data = _spec_with(field, value)
        documented = not v.errors(spec_schema, data)
        try:
            ServiceSpec.model_validate_json(json.dumps(data), strict=True)
            taken = True
        except ValueError:
            taken = False
        assert documented == taken, (field, value, v.errors(spec_schema, data))

    agree()


def test_the_white_space_of_the_patterns_is_pythons() -> None:
    # A command must hold more than what str.strip removes; the document's class says which.
    import sys

    from gateway import WHITE_SPACE

    space = re.compile(f"[{WHITE_SPACE}]")
    wrong = [
        hex(c)
        for c in range(sys.maxunicode + 1)
        if bool(space.fullmatch(chr(c))) != chr(c).isspace()
    ]
    assert wrong == []
