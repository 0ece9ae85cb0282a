"""The admin API's handlers and its route table (``OPERATIONS``).

Handlers are thin: they parse the request into a schema, call one ``Controller`` operation
and answer with a response model. Refusals are exceptions (``ApiError`` here, the
controller's ``ControllerError`` tree below it) that the error middleware in ``app.py`` turns
into JSON; an operation refused raises before it changed anything, so neither does the API.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import BaseModel, ValidationError

from .. import documents
from ..config import format_validation_error
from ..errors import Conflict, DocumentError, NotFound, SpecError
from ..journal import HISTORY, Entry
from ..operations import Controller
from ..planning.model import LEAVING, Rollout
from ..spec import ServiceSpec
from .bodies import (
    ApplyResultBody,
    DeleteResult,
    EventView,
    HostList,
    LogsView,
    Probe,
    RevisionList,
    RolloutList,
    RolloutView,
    ScaleRequest,
    ServiceList,
    ServiceView,
    UndoRequest,
    UpstreamView,
)
from .openapi import YAML_TYPES, Operation, Query, build_document
from .views import (
    host_views,
    revision_view,
    rollout_record,
    rollout_view,
    service_view,
    upstream_view,
)

CONTROLLER = web.AppKey("controller", Controller)
READY: web.AppKey[Callable[[], bool]] = web.AppKey("ready")
STOPPING = web.AppKey("stopping", asyncio.Event)
"""Set when the admin listener shuts down, so that event streams end instead of holding it."""
KEEPALIVE = web.AppKey("sse_keepalive", float)
OPERATIONS: web.AppKey[list[Operation]] = web.AppKey("operations")
DOCUMENT: web.AppKey[dict[str, str]] = web.AppKey("openapi_document")

DEFAULT_TAIL = 100
MAX_TAIL = 10_000
ReplicaLogs = Callable[[web.Request, str, str, int], Awaitable[tuple[list[str], str | None]]]
LOGS_ELSEWHERE: web.AppKey[ReplicaLogs] = web.AppKey("logs_elsewhere")
"""In a cluster (``admin.cluster``): a process replica's last lines, read on the node that runs
or ran it, and that node's name."""

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """A refusal by the API layer itself (auth, body, query); the middleware renders it."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: Mapping[str, str] | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})
        self.details = details


def invalid_request(field: str, reason: str) -> ApiError:
    return ApiError(
        422, "invalid_request", f"{field}: {reason}", errors=[{"field": field, "reason": reason}]
    )


def respond(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


def _controller(request: web.Request) -> Controller:
    return request.app[CONTROLLER]


def _parse(raw: bytes, content_type: str) -> Any:
    """The body as data, within the limits of ``documents`` (413 naming the one passed).
    Called in a thread (``read_model``, ``put_service``): no parser runs on the event loop."""
    kind: documents.Kind = "json"
    if content_type in YAML_TYPES or content_type == "text/x-yaml":
        kind = "yaml"
    try:
        return documents.parse(raw, kind, pause=_hand_over)
    except DocumentError as e:
        raise ApiError(e.status, e.code, f"the body is {e.message}", None, **e.details) from None


def _hand_over() -> None:
    """Let the event loop's thread take the GIL if it waits for it: a blocking call, for the
    thread that parses beside it."""
    time.sleep(0)


def strict(model: type[M], data: Any) -> M:
    """``data`` (parsed JSON or YAML) as ``model``, strict about JSON types: no boolean taken
    as an integer, no number as a string. Raises ``ValidationError``, or ``ApiError`` 422 for
    a value JSON has no type for (a YAML date, set or binary; NaN)."""
    try:
        text = json.dumps(_integral(data), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ApiError(
            422, "invalid_request", f"the body holds a value JSON has no type for: {e}"
        ) from None
    except RecursionError:
        raise ApiError(400, "bad_request", "the body is nested too deeply") from None
    # JSON mode: an array is a tuple, a string a Literal; strict: nothing else converts.
    return model.model_validate_json(text, strict=True)


def _integral(data: Any) -> Any:
    """``data`` with each whole float an int: JSON has one number type, and 2.0 is the
    integer 2 (JSON Schema says so too), which strict validation would refuse."""
    if isinstance(data, float) and data.is_integer():
        return int(data)
    if isinstance(data, dict):
        return {k: _integral(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_integral(v) for v in data]
    return data


async def read_model(request: web.Request, model: type[M], optional: bool = False) -> M:
    """The body as ``model``: 400 if it is not JSON, 413 past a limit, 422 naming each field if
    it is wrong. ``optional``: no body at all (zero bytes) stands for ``model()``; white space
    is a body, and not JSON. Parsed and validated in a thread."""
    raw = await request.read()  # raises 413 past client_max_size
    if optional and not raw:
        return model()
    if not raw.strip():
        raise ApiError(400, "bad_request", "a JSON body is required")
    return await asyncio.to_thread(_read_model, raw, request.content_type, model)


def _read_model(raw: bytes, content_type: str, model: type[M]) -> M:
    data = _parse(raw, content_type)
    try:
        return strict(model, data)
    except ValidationError as e:
        errors = format_validation_error(e)
        message = "; ".join(f"{x['field']}: {x['reason']}" for x in errors)
        raise ApiError(422, "invalid_request", message, errors=errors) from None


_INTEGER = re.compile(r"-?[0-9]+")


def tail_query(request: web.Request) -> int:
    """The ``tail`` of a logs route: how many of the last lines."""
    return _int_query(request, "tail", DEFAULT_TAIL, 1, MAX_TAIL)


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    if not _INTEGER.fullmatch(value):  # int() would take " 5", "+5" and "5_0"
        raise invalid_request(name, f"not an integer: {value!r}")
    number = int(value) if len(value) <= 18 else high + 1  # int() refuses 4,300 digits
    if not low <= number <= high:
        raise invalid_request(name, f"must be from {low} to {high}")
    return number


FLAGS = {"1": True, "true": True, "0": False, "false": False}
"""What a boolean query parameter may be (the document's enum)."""


def _flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name)
    if value is None:
        return False
    if value not in FLAGS:
        raise invalid_request(name, f"must be one of {', '.join(FLAGS)}, not {value!r}")
    return FLAGS[value]


def unknown_query(operation: Operation, names: Iterable[str]) -> ApiError | None:
    """The refusal of a query parameter ``operation`` does not declare, or of one given twice
    (which of its values counts would be a guess): 400 naming it. None if there is none."""
    known = {q.name for q in operation.query}
    seen: set[str] = set()
    for name in names:
        if name not in known:
            takes = ", ".join(sorted(known)) or "none"
            return ApiError(
                400,
                "unknown_parameter",
                f"unknown query parameter {name!r} (this route takes: {takes})",
                parameter=name,
            )
        if name in seen:
            return ApiError(
                400, "repeated_parameter", f"query parameter {name!r} is given twice",
                parameter=name,
            )  # fmt: skip
        seen.add(name)
    return None


def query_names(path_qs: str) -> list[str]:
    """The name of each query parameter of a request target, percent-decoded, repeats kept."""
    query = path_qs.partition("?")[2]
    return [name for name, _ in parse_qsl(query, keep_blank_values=True)]


def checked(operation: Operation) -> Handler:
    """``operation``'s handler, which first refuses a query the operation does not declare
    (``unknown_query``): what the app mounts for it."""
    handler = operation.handler

    async def dispatch(request: web.Request) -> web.StreamResponse:
        error = unknown_query(operation, query_names(request.path_qs))
        if error is not None:
            raise error
        return await handler(request)

    return dispatch


# -- the gateway itself -------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return respond(Probe(status="ok"))


async def readyz(request: web.Request) -> web.Response:
    if request.app[READY]():
        return respond(Probe(status="ready"))
    return respond(Probe(status="starting"), status=503)


async def openapi_json(request: web.Request) -> web.Response:
    cache = request.app[DOCUMENT]
    if "json" not in cache:  # built on first use: it costs more than building the app
        backends = _controller(request).backends
        cache["json"] = json.dumps(build_document(request.app[OPERATIONS], backends))
    return web.json_response(text=cache["json"])


async def list_hosts(request: web.Request) -> web.Response:
    return respond(HostList(hosts=host_views(_controller(request).backends)))


# -- services -----------------------------------------------------------------------------------


async def list_services(request: web.Request) -> web.Response:
    controller = _controller(request)
    views = [service_view(controller, controller.state(n)) for n in controller.service_names()]
    return respond(ServiceList(services=views))


async def get_service(request: web.Request) -> web.Response:
    controller = _controller(request)
    state = controller.state(request.match_info["name"])
    return respond(service_view(controller, state))


async def put_service(request: web.Request) -> web.Response:
    """Apply a spec; ``?dry_run=1`` says what it would do and changes nothing."""
    controller = _controller(request)
    name = request.match_info["name"]
    dry_run = _flag(request, "dry_run")
    raw = await request.read()
    if dry_run:
        result = controller.plan_apply(await _request_spec(request, raw, name))
    else:
        with controller.applying("api", _applier(request)) as span:
            span.named(name)
            with span.phase("validate"):
                spec = await _request_spec(request, raw, name)
            result = await controller.apply(spec, span)
    return respond(ApplyResultBody.model_validate(result.to_json() | {"dry_run": dry_run}))


async def _request_spec(request: web.Request, raw: bytes, name: str) -> ServiceSpec:
    spec = await asyncio.to_thread(_read_spec, raw, request.content_type, name)
    if spec.name != name:
        # RFC 9110 9.3.4: a PUT representation inconsistent with its target is a 409.
        reason = f"{spec.name!r} differs from {name!r} in the path"
        raise Conflict(f"name: {reason}", errors=[{"field": "name", "reason": reason}])
    _refuse_relative_paths(spec)
    return spec


def _applier(request: web.Request) -> str:
    """Who applies, as far as the request says: its client (``User-Agent``) and address."""
    agent = request.headers.get("User-Agent", "")[:100]
    return f"{agent} at {request.remote}" if agent else f"{request.remote}"


def _read_spec(raw: bytes, content_type: str, name: str) -> ServiceSpec:
    data = _parse(raw, content_type)
    if isinstance(data, dict):
        data.setdefault("name", name)
    return _spec(data)


def _spec(data: Any) -> ServiceSpec:
    """A spec from the API, strict about JSON types; SpecError names each field."""
    if not isinstance(data, dict):
        raise SpecError("a service spec must be a JSON or YAML object")
    try:
        return strict(ServiceSpec, data)
    except ValidationError as e:
        errors = format_validation_error(e)
        message = "; ".join(f"{x['field']}: {x['reason']}" for x in errors)
        raise SpecError(f"invalid spec: {message}", errors) from None


def _refuse_relative_paths(spec: ServiceSpec) -> None:
    """A relative ``working_dir`` has no file to be relative to here (the config loader and
    the CLI resolve it against the spec's file), and the gateway's own working directory is
    no meaning a client can know: the API takes absolute paths only."""
    working_dir = spec.replica.working_dir
    if working_dir is not None and not posixpath.isabs(working_dir):
        field = "replica.working_dir"
        reason = f"must be an absolute path, not {working_dir!r}"
        raise SpecError(f"invalid spec: {field}: {reason}", [{"field": field, "reason": reason}])


async def delete_service(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    await _controller(request).delete(name)
    return respond(DeleteResult(service=name, status="deleting"), status=202)


async def scale_service(request: web.Request) -> web.Response:
    controller = _controller(request)
    name = request.match_info["name"]
    controller.state(name)
    body = await read_model(request, ScaleRequest)
    try:
        result = await controller.scale(name, body.replicas)
    except SpecError as e:
        # The count is a valid one; the service's own spec does not allow it (a fixed port
        # runs one replica, a static service no more than its addresses): a conflict with
        # the service as it is, not an invalid request.
        reasons = [x["reason"] for x in e.errors] or [e.message]
        errors = [{"field": "replicas", "reason": r} for r in reasons]
        raise Conflict(f"replicas: {'; '.join(reasons)}", errors=errors) from None
    return respond(ApplyResultBody.model_validate(result.to_json()))


# -- rollouts -----------------------------------------------------------------------------------


def _rollout_response(request: web.Request, name: str, rollout: Rollout) -> web.Response:
    controller = _controller(request)
    return respond(rollout_view(controller, controller.state(name), rollout))


async def pause_rollout(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    return _rollout_response(request, name, await _controller(request).pause(name))


async def promote_rollout(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    return _rollout_response(request, name, await _controller(request).promote(name))


async def resume_rollout(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    return _rollout_response(request, name, await _controller(request).resume(name))


async def abort_rollout(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    return _rollout_response(request, name, await _controller(request).abort(name))


async def undo_rollout(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    _controller(request).state(name)
    body = await read_model(request, UndoRequest, optional=True)
    rollout = await _controller(request).undo(name, body.revision)
    return _rollout_response(request, name, rollout)


async def list_revisions(request: web.Request) -> web.Response:
    controller = _controller(request)
    state = controller.state(request.match_info["name"])
    rows = controller.store.revisions(state.name)
    return respond(
        RevisionList(service=state.name, revisions=[revision_view(state, r) for r in rows])
    )


async def list_rollouts(request: web.Request) -> web.Response:
    controller = _controller(request)
    state = controller.state(request.match_info["name"])
    limit = _int_query(request, "limit", 100, 1, 1000)
    rows = controller.store.rollouts(state.name, limit)
    return respond(RolloutList(service=state.name, rollouts=[rollout_record(r) for r in rows]))


# -- replicas and upstreams ---------------------------------------------------------------------


async def replica_logs(request: web.Request) -> web.Response:
    controller = _controller(request)
    state = controller.state(request.match_info["name"])
    replica_id = request.match_info["replica"]
    tail = tail_query(request)
    replica = state.replica(replica_id)
    if replica is None:
        raise NotFound(f"no replica {replica_id!r} in {state.name!r}", service=state.name)
    spec = state.revisions.get(replica.revision, state.spec)
    elsewhere = request.app.get(LOGS_ELSEWHERE)
    node = None
    if elsewhere is not None and spec.backend == "process":  # on the cluster's nodes
        lines, node = await elsewhere(request, state.name, replica_id, tail)
    else:
        backend = controller.backends.get(spec.backend)
        # The process backend reads its log files: off the loop.
        lines = [] if backend is None else await asyncio.to_thread(backend.logs, replica_id, tail)
    return respond(LogsView(service=state.name, replica=replica_id, lines=lines, node=node))


def _upstream_response(controller: Controller, name: str, upstream_id: str) -> web.Response:
    upstream = controller.pool.upstream(name, upstream_id)
    if upstream is None:
        raise NotFound(f"no upstream {upstream_id!r} in {name!r}", service=name)
    return respond(upstream_view(controller, upstream))


async def drain_upstream(request: web.Request) -> web.Response:
    controller = _controller(request)
    name, upstream_id = request.match_info["name"], request.match_info["upstream"]
    controller.drain_upstream(name, upstream_id)
    return _upstream_response(controller, name, upstream_id)


async def undrain_upstream(request: web.Request) -> web.Response:
    controller = _controller(request)
    name, upstream_id = request.match_info["name"], request.match_info["upstream"]
    replica = controller.state(name).replica(upstream_id)
    if replica is not None and replica.state in LEAVING:
        # The controller drains it to stop it; taking that back would strand the replica.
        raise Conflict(
            f"replica {upstream_id} is {replica.state.value}: the controller is stopping it"
        )
    controller.undrain_upstream(name, upstream_id)
    return _upstream_response(controller, name, upstream_id)


# -- events -------------------------------------------------------------------------------------


def _sse(entry: Entry) -> bytes:
    data = EventView.model_validate(entry.to_json()).model_dump_json()
    return f"id: {entry.id}\nevent: {entry.kind}\ndata: {data}\n\n".encode()


def _last_event_id(request: web.Request) -> int | None:
    value = request.headers.get("Last-Event-ID")
    if value is None:
        return None
    if not _INTEGER.fullmatch(value) or len(value) > 18:
        raise invalid_request("Last-Event-ID", f"not an event id: {value!r}")
    return int(value)


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events of every journal entry (of ``?service=NAME``), live, until the
    client goes away or the admin listener stops. A comment line keeps idle streams open.

    With ``Last-Event-ID`` (a client that comes back), the entries after that one that the
    journal still holds are sent first."""
    controller = _controller(request)
    service = request.query.get("service") or None
    last_id = _last_event_id(request)
    keepalive = request.app[KEEPALIVE]
    stopping = request.app[STOPPING]
    # Both at once, with no await between: an entry is either missed (and in ``missed``) or
    # in the queue, never both and never neither.
    queue = controller.journal.watch()
    missed = [] if last_id is None else controller.journal.since(last_id)
    try:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        await response.write(b": watching\n\n")
        for entry in missed:
            if service is None or entry.service == service:
                await response.write(_sse(entry))
        stop = asyncio.ensure_future(stopping.wait())
        get: asyncio.Future[Entry] | None = None
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait(
                    {get, stop}, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED
                )
                if stop in done:
                    break
                if get not in done:
                    get.cancel()
                    await response.write(b": keepalive\n\n")
                    continue
                entry = get.result()
                if service is None or entry.service == service:
                    await response.write(_sse(entry))
        finally:
            stop.cancel()
            if get is not None:
                get.cancel()
        return response
    finally:
        controller.journal.unwatch(queue)


# -- the route table ----------------------------------------------------------------------------

SERVICE = "/api/services/{name}"
TAIL = Query(
    "tail",
    {"type": "integer", "minimum": 1, "maximum": MAX_TAIL, "default": DEFAULT_TAIL},
    "How many of the last lines",
)
LAST_EVENT_ID = Query(
    "Last-Event-ID",
    {"type": "string", "pattern": "^-?[0-9]{1,18}$"},
    f"The id of the last event seen: the events after it that the gateway still holds (of the "
    f"last {HISTORY}) are sent first",
)

OPERATIONS_TABLE: list[Operation] = [
    Operation("GET", "/healthz", healthz, "The gateway process is alive", {200: Probe},
              auth=False),
    Operation("GET", "/readyz", readyz, "The gateway is serving", {200: Probe, 503: Probe},
              auth=False),
    Operation("GET", "/api/openapi.json", openapi_json, "This document", {200: None}),
    Operation("GET", "/api/services", list_services, "Every service", {200: ServiceList}),
    Operation("GET", "/api/hosts", list_hosts,
              "Where replicas run: each backend's hosts, their reachability and load",
              {200: HostList}),
    Operation("GET", SERVICE, get_service, "One service: revisions, replicas, rollout",
              {200: ServiceView}, errors=(404,)),
    Operation("PUT", SERVICE, put_service, "Apply a spec (JSON or YAML)", {200: ApplyResultBody},
              errors=(400, 409, 413, 422), body="spec",
              query=(Query("dry_run", {"type": "string", "enum": ["0", "1", "true", "false"]},
                           "Say what the apply would do and change nothing"),)),
    Operation("DELETE", SERVICE, delete_service, "Drain and stop every replica, then forget it",
              {202: DeleteResult}, errors=(404, 409)),
    Operation("POST", f"{SERVICE}/scale", scale_service, "Set the desired replica count",
              {200: ApplyResultBody}, errors=(400, 404, 409, 413, 422), body=ScaleRequest),
    Operation("POST", f"{SERVICE}/rollout/pause", pause_rollout, "Pause the active rollout",
              {200: RolloutView}, errors=(404, 409)),
    Operation("POST", f"{SERVICE}/rollout/resume", resume_rollout, "Resume a paused rollout",
              {200: RolloutView}, errors=(404, 409)),
    Operation("POST", f"{SERVICE}/rollout/promote", promote_rollout,
              "Skip the remaining steps: a canary to 100%, a blue/green switched at once",
              {200: RolloutView}, errors=(404, 409)),
    Operation("POST", f"{SERVICE}/rollout/abort", abort_rollout,
              "Stop the rollout and return to the revision it started from",
              {200: RolloutView}, errors=(404, 409)),
    Operation("POST", f"{SERVICE}/rollout/undo", undo_rollout,
              "Roll back to the previous revision (or `revision`) as a new rollout",
              {200: RolloutView}, errors=(400, 404, 409, 413, 422), body=UndoRequest,
              body_required=False),
    Operation("GET", f"{SERVICE}/revisions", list_revisions, "Every revision of the service",
              {200: RevisionList}, errors=(404,)),
    Operation("GET", f"{SERVICE}/rollouts", list_rollouts, "Rollout history, newest first",
              {200: RolloutList}, errors=(404, 422),
              query=(Query("limit", {"type": "integer", "minimum": 1, "maximum": 1000,
                                     "default": 100}, "How many rollouts"),)),
    Operation("GET", f"{SERVICE}/replicas/{{replica}}/logs", replica_logs,
              "The last lines of a replica's output", {200: LogsView}, errors=(404, 422),
              query=(TAIL,)),
    Operation("POST", f"{SERVICE}/upstreams/{{upstream}}/drain", drain_upstream,
              "Send no new requests to an upstream (manual maintenance)", {200: UpstreamView},
              errors=(404,)),
    Operation("POST", f"{SERVICE}/upstreams/{{upstream}}/undrain", undrain_upstream,
              "Take a manual drain back", {200: UpstreamView}, errors=(404, 409)),
    Operation("GET", "/api/events", events,
              "Server-sent events of every transition, health transitions included",
              {200: None}, errors=(422,), stream=EventView,
              query=(Query("service", {"type": "string"}, "Only this service's events"),),
              headers=(LAST_EVENT_ID,)),
]  # fmt: skip
