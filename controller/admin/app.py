"""The admin listener: health of the gateway itself, metrics, and the admin API.

Its own listener (loopback by default), never the traffic one. Two middlewares wrap every
route: errors (outermost: every refusal and every unexpected failure becomes a JSON body
``{"error": code, "message": text, ...}``; no traceback reaches a client) and auth (every path
but ``/healthz``, ``/readyz`` and ``/metrics`` needs ``Authorization: Bearer <token>``,
compared in constant time). The token is never logged, and neither is a request's headers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from gateway import parse_address

from ..errors import ControllerError, StoreUnavailable
from ..operations import Controller
from .handlers import (
    CONTROLLER,
    DOCUMENT,
    KEEPALIVE,
    OPERATIONS,
    OPERATIONS_TABLE,
    READY,
    STOPPING,
    ApiError,
)
from .openapi import Handler, Operation
from .tokens import TOKEN_OPERATIONS

__all__ = ["CONTROLLER", "READY", "AdminServer", "build_admin_app", "is_loopback"]

log = logging.getLogger("gateway.admin")

MAX_BODY = 1024 * 1024
"""Bytes: a spec is a few kilobytes; anything near this is a mistake or an attack."""
SSE_KEEPALIVE = 15.0
MAX_BODY_SIZE = web.AppKey("max_body_size", int)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
"""Paths that need no token. Everything else (every /api/ route) needs one."""

_HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def error_response(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body: dict[str, Any] = {"error": code, "message": message}
    for key, value in (details or {}).items():
        if key not in body:
            body[key] = value
    return web.json_response(
        text=json.dumps(body, default=str), status=status, headers=headers or None
    )


def _http_message(request: web.Request, error: web.HTTPException) -> str:
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        return f"{request.method} is not allowed on {request.path} (allowed: {allowed})"
    if isinstance(error, web.HTTPNotFound):
        return f"no route {request.method} {request.path}"
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        return f"the body is larger than the {request.app[MAX_BODY_SIZE]} bytes accepted"
    return error.reason


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.code, e.message, e.details, e.headers)
    except ControllerError as e:
        headers = {"Retry-After": "1"} if isinstance(e, StoreUnavailable) else None
        if e.status >= 500:
            log.warning("admin %s %s: %s", request.method, request.path, e.message)
        return error_response(e.status, e.code, e.message, e.details, headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        code = _HTTP_CODES.get(e.status, f"http_{e.status}")
        return error_response(e.status, code, _http_message(request, e), headers=headers)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("admin %s %s failed", request.method, request.path)
        return error_response(500, "internal_error", "internal error (see the gateway log)")


def auth_middleware(token: str | None) -> Callable[..., Any]:
    expected = None if token is None else token.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), expected
            ):
                raise ApiError(
                    401,
                    "unauthorized",
                    "missing or wrong bearer token",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return auth


def _operation(route: Operation | web.RouteDef) -> Operation:
    if isinstance(route, Operation):
        return route
    handler: Handler = route.handler
    summary = (handler.__doc__ or route.path).strip().split("\n")[0]
    return Operation(
        route.method, route.path, handler, summary, {200: None}, auth=route.path not in OPEN_PATHS
    )


async def _stop_streams(app: web.Application) -> None:
    app[STOPPING].set()


def build_admin_app(
    controller: Controller,
    ready: Callable[[], bool],
    token: str | None = None,
    *,
    metrics_handler: Handler | None = None,
    extra_routes: Iterable[Operation | web.RouteDef] = (),
    client_max_size: int = MAX_BODY,
    sse_keepalive: float = SSE_KEEPALIVE,
    middlewares: Iterable[Callable[..., Any]] = (),
) -> web.Application:
    """The admin app. ``token`` None: no auth (only allowed on a loopback listener).

    ``metrics_handler`` is mounted at ``/metrics`` without auth; ``extra_routes`` (operations,
    or aiohttp route defs such as ``web.get(path, handler)``) are mounted and documented like
    the built-in ones, with auth unless their path is in OPEN_PATHS. ``middlewares`` run
    inside auth (the cluster's forwarding to the leader: ``admin.cluster``).
    """
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware(token), *middlewares],
        client_max_size=client_max_size,
    )
    # /api/events shows the data plane's health transitions too (once, however many apps).
    controller.journal.follow(controller.pool)
    app[CONTROLLER] = controller
    if token:  # it opens the preview routes allowed by token (``PreviewConfig``)
        controller.executor.admin_digest = hashlib.sha256(token.encode()).hexdigest()
    app[READY] = ready
    app[STOPPING] = asyncio.Event()
    app[KEEPALIVE] = sse_keepalive
    app[MAX_BODY_SIZE] = client_max_size
    operations = [*OPERATIONS_TABLE, *TOKEN_OPERATIONS, *(_operation(r) for r in extra_routes)]
    if metrics_handler is not None:
        operations.append(
            Operation(
                "GET",
                "/metrics",
                metrics_handler,
                "Prometheus metrics (text exposition format)",
                {200: None},
                auth=False,
            )
        )
    app[OPERATIONS] = operations
    app[DOCUMENT] = {}
    for op in operations:
        app.router.add_route(op.method, op.path, op.handler)
    app.on_shutdown.append(_stop_streams)
    return app


def is_loopback(listen: str) -> bool:
    """Whether a listen address only accepts connections from this host."""
    host, _ = parse_address(listen, listen=True)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AdminServer:
    def __init__(self, app: web.Application, listen: str) -> None:
        self.app = app
        self.host, self._port = parse_address(listen, listen=True)
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._port)
        await site.start()
        server = site._server
        if server is not None and self._port == 0:
            sockets = getattr(server, "sockets", None) or []
            if sockets:
                self._port = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
