"""The OpenAPI 3.1 document of the admin API, generated from its route table and its schemas.

Each route is declared once, as an ``Operation`` (handlers.py): the app mounts it and this
module describes it, with the JSON schemas pydantic makes of the request and response models
(``bodies.py``) and of ``ServiceSpec``, whose fields and validators state what they check
there (``controller.schema``, ``gateway.config``). This module adds only what the API itself
decides: the backends this gateway has, and what the apply route does with a spec's name and
working directory. So the document says what the routes really accept and return; a test
sends real requests and checks each response against it, and the fuzz holds the API to it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp.typedefs import Handler
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from ..documents import MAX_DEPTH, MAX_NODES
from ..spec import NAME_PATTERN, ServiceSpec
from .bodies import REQUEST_MODELS, RESPONSE_MODELS, SPEC_MARK, ErrorBody

REF = "#/components/schemas/{model}"
JSON = "application/json"
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")
SSE = "text/event-stream"

ERROR_TEXT = {
    400: "The body is not valid JSON or YAML, or a query parameter is unknown or given twice",
    401: "Missing or wrong bearer token",
    403: "A browser sent the request for another site (`cross_site_request`: `Sec-Fetch-Site` "
    "or `Origin`), or, with no token configured, to a host name other than localhost "
    "(`untrusted_host`)",
    404: "No such service, revision, replica or upstream",
    405: "Method not allowed on this path",
    409: "The action does not fit the service's current state (or, on a PUT, the spec's name "
    "is not the path's)",
    413: "The body is larger than the admin API accepts (`payload_too_large`), or its document "
    f"is nested deeper than {MAX_DEPTH} levels or has more than {MAX_NODES} nodes, a YAML "
    "alias counting as all it repeats (`document_too_large`, `limit` names which)",
    415: "The body's content type is not accepted",
    422: "An invalid spec or request: each field path and reason in `errors`",
    500: "An unexpected error (logged by the gateway; no details are given)",
    503: "The state store is unavailable",
}
SUCCESS_TEXT = {202: "Accepted: it goes on in the background", 503: "Not ready yet"}


@dataclass(frozen=True)
class Query:
    name: str
    schema: dict[str, Any]
    description: str


@dataclass(frozen=True)
class Operation:
    """One route: what the app mounts and what the document says of it."""

    method: str
    path: str
    handler: Handler
    summary: str
    responses: Mapping[int, type[BaseModel] | None]
    """Success statuses and their JSON body's model."""
    errors: tuple[int, ...] = ()
    """Error statuses this route can answer besides 400 (a query parameter not in ``query``),
    401, 405, 500 and 503."""
    body: type[BaseModel] | Literal["spec"] | None = None
    body_required: bool = True
    query: tuple[Query, ...] = ()
    headers: tuple[Query, ...] = ()
    """Request headers the route reads."""
    stream: type[BaseModel] | None = None
    """Server-sent events whose ``data`` is this model's JSON."""
    auth: bool = True

    @property
    def operation_id(self) -> str:
        return self.handler.__name__


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _spec_refs(node: Any) -> Any:
    """A spec in a response refers to the ServiceSpec schema."""
    if isinstance(node, list):
        return [_spec_refs(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get(SPEC_MARK):
        return {"$ref": REF.format(model="ServiceSpec")}
    return {k: _spec_refs(v) for k, v in node.items()}


def _backends(spec: dict[str, Any], backends: Iterable[str]) -> None:
    """Only the backends this gateway has: a spec naming another one is refused, so the
    branches of ``ServiceSpec``'s rules that name another go."""
    have = set(backends)
    backend = spec["properties"]["backend"]
    backend["enum"] = [b for b in backend["enum"] if b in have]
    if backend["default"] not in have:
        spec["required"] = [*spec.get("required", []), "backend"]
    rules = []
    for rule in spec.get("allOf", []):
        if "anyOf" in rule:
            options = [o for o in rule["anyOf"] if _names_backend(o) in (None, *have)]
            rule = {**rule, "anyOf": options} if options else False
        rules.append(rule)
    spec["allOf"] = rules


def _names_backend(schema: dict[str, Any]) -> str | None:
    const: str | None = schema.get("properties", {}).get("backend", {}).get("const")
    return const


def _through_the_api(schemas: dict[str, Any]) -> None:
    """What the apply route (``handlers.put_service``) makes of a spec: without a name, it takes
    the path's; a relative working directory has no file to be relative to here, and is refused
    (``handlers._refuse_relative_paths``)."""
    spec = schemas["ServiceSpec"]
    spec["required"] = [r for r in spec["required"] if r != "name"]
    spec["properties"]["name"]["description"] = (
        "Required in a spec file; through the API, the path's name."
    )
    working_dir = schemas["ReplicaTemplate"]["properties"]["working_dir"]
    for option in working_dir["anyOf"]:
        if option.get("type") == "string":
            option["pattern"] = "^/"
    working_dir["description"] = (
        "An absolute path (a spec file's relative one is resolved against the file by the "
        "config loader and the CLI)."
    )


def component_schemas(backends: Iterable[str] = ("process", "static")) -> dict[str, Any]:
    """The models' schemas (what their fields and validators check stated in them), for the
    ``backends`` this gateway has, and as the API takes a spec."""
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ServiceSpec, "validation")]
    models += [(m, "validation") for m in REQUEST_MODELS]
    models += [(m, "serialization") for m in RESPONSE_MODELS]
    _, defs = models_json_schema(models, ref_template=REF)
    schemas: dict[str, Any] = _spec_refs(defs.get("$defs", {}))
    _backends(schemas["ServiceSpec"], backends)
    _through_the_api(schemas)
    return schemas


PATH_PARAMETERS = {"name": {"type": "string", "pattern": NAME_PATTERN, "maxLength": 63}}
"""Path parameters' schemas, by name; any other is a string."""


def _operation(op: Operation) -> dict[str, Any]:
    params: list[dict[str, Any]] = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": PATH_PARAMETERS.get(name, {"type": "string"}),
        }
        for name in re.findall(r"{(\w+)(?::[^}]*)?}", op.path)
    ]
    params += [
        {"name": q.name, "in": "query", "required": False, "schema": q.schema,
         "description": q.description}
        for q in op.query
    ]  # fmt: skip
    params += [
        {"name": h.name, "in": "header", "required": False, "schema": h.schema,
         "description": h.description}
        for h in op.headers
    ]  # fmt: skip
    responses: dict[str, Any] = {}
    for status, model in op.responses.items():
        response: dict[str, Any] = {"description": SUCCESS_TEXT.get(status, "OK")}
        if op.stream is not None:
            response["content"] = {
                SSE: {
                    "schema": {"type": "string"},
                    "x-data-schema": _ref(op.stream),
                }
            }
            response["description"] = (
                "Server-sent events: `event` is the entry's kind, `id` its id, `data` its JSON; "
                "comment lines keep the connection alive."
            )
        elif model is not None:
            response["content"] = {JSON: {"schema": _ref(model)}}
        responses[str(status)] = response
    errors = {400, 405, 500, *op.errors}  # 400: any route, for a query it does not take
    if op.auth:
        errors |= {401, 503}
    if op.path.startswith("/api/"):
        errors.add(403)  # origin.py: what a browser sends for another site
    for status in sorted(errors):
        responses[str(status)] = {
            "description": ERROR_TEXT[status],
            "content": {JSON: {"schema": _ref(ErrorBody)}},
        }
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "parameters": params,
        "responses": responses,
        "security": [{"bearer": []}] if op.auth else [],
    }
    if op.body is not None:
        schema = {"$ref": REF.format(model="ServiceSpec")} if op.body == "spec" else _ref(op.body)
        types = (JSON, *YAML_TYPES) if op.body == "spec" else (JSON,)
        out["requestBody"] = {
            "required": op.body_required,
            "content": {t: {"schema": schema} for t in types},
        }
    return out


def build_document(
    operations: list[Operation], backends: Iterable[str] = ("process", "static")
) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        path = re.sub(r"{(\w+):[^}]*}", r"{\1}", op.path)
        paths.setdefault(path, {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gateway admin API",
            "version": "1",
            "description": "Drive and watch services, revisions and rollouts. Every /api/ "
            "route needs `Authorization: Bearer <token>`; every error is JSON "
            '`{"error": code, "message": text, ...}`.',
        },
        "paths": paths,
        "components": {
            "schemas": component_schemas(backends),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
