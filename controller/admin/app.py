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
import socket
from collections.abc import Callable, Iterable
from typing import Any

from gateway import parse_address

from ..errors import ControllerError, StoreUnavailable
from ..operations import Controller
from . import web
from .handlers import (
    CONTROLLER,
    DOCUMENT,
    KEEPALIVE,
    OPERATIONS,
    OPERATIONS_TABLE,
    READY,
    STOPPING,
    ApiError,
    checked,
)
from .openapi import Operation
from .routes import Router
from .server import AdminListener
from .tokens import TOKEN_OPERATIONS
from .web import App, Handler, HTTPError, Middleware, Request, Response

__all__ = ["CONTROLLER", "READY", "AdminServer", "build_admin_app", "is_loopback"]

log = logging.getLogger("gateway.admin")

MAX_BODY = 1024 * 1024
"""Bytes: a spec is a few kilobytes; anything near this is a mistake or an attack."""
SSE_KEEPALIVE = 15.0
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
"""Paths that need no token. Everything else (every /api/ route) needs one."""

_HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
    417: "expectation_failed",
    431: "request_header_fields_too_large",
    500: "internal_error",
}


def error_response(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body: dict[str, Any] = {"error": code, "message": message}
    for key, value in (details or {}).items():
        if key not in body:
            body[key] = value
    return web.json_response(
        text=json.dumps(body, default=str), status=status, headers=headers or None
    )


def http_error_response(error: HTTPError) -> Response:
    """The JSON answer to a refusal of the HTTP layer (no route, a body too large, ...)."""
    code = _HTTP_CODES.get(error.status, f"http_{error.status}")
    return error_response(error.status, code, error.message, headers=error.headers)


async def errors_middleware(request: Request, handler: Handler) -> Response:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.code, e.message, e.details, e.headers)
    except ControllerError as e:
        headers = {"Retry-After": "1"} if isinstance(e, StoreUnavailable) else None
        if e.status >= 500:
            log.warning("admin %s %s: %s", request.method, request.path, e.message)
        return error_response(e.status, e.code, e.message, e.details, headers)
    except HTTPError as e:
        return http_error_response(e)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("admin %s %s failed", request.method, request.path)
        return error_response(500, "internal_error", "internal error (see the gateway log)")


def auth_middleware(token: str | None) -> Middleware:
    expected = None if token is None else token.encode()

    async def auth(request: Request, handler: Handler) -> Response:
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


def _metrics_handler(render: Callable[[str], tuple[bytes, str]]) -> Handler:
    async def metrics(request: Request) -> Response:
        body, content_type = render(request.headers.get("Accept") or "")
        return Response(body=body, headers={"Content-Type": content_type})

    return metrics


async def _stop_streams(app: App) -> None:
    app[STOPPING].set()


def build_admin_app(
    controller: Controller,
    ready: Callable[[], bool],
    token: str | None = None,
    *,
    metrics: Callable[[str], tuple[bytes, str]] | None = None,
    extra_routes: Iterable[Operation] = (),
    client_max_size: int = MAX_BODY,
    sse_keepalive: float = SSE_KEEPALIVE,
    middlewares: Iterable[Middleware] = (),
) -> App:
    """The admin app. ``token`` None: no auth (only allowed on a loopback listener).

    ``metrics`` (an ``Accept`` header to a body and its content type) is served at
    ``/metrics`` without auth; ``extra_routes`` are mounted
    and documented like the built-in ones. ``middlewares`` run inside auth (the cluster's
    forwarding to the leader: ``admin.cluster``).
    """
    router = Router()
    app = App(router, [errors_middleware, auth_middleware(token), *middlewares])
    app.max_body = client_max_size
    app.refusal = http_error_response
    # /api/events shows the data plane's health transitions too (once, however many apps).
    controller.journal.follow(controller.pool)
    app[CONTROLLER] = controller
    if token:  # it opens the preview routes allowed by token (``PreviewConfig``)
        controller.executor.admin_digest = hashlib.sha256(token.encode()).hexdigest()
    app[READY] = ready
    app[STOPPING] = asyncio.Event()
    app[KEEPALIVE] = sse_keepalive
    operations = [*OPERATIONS_TABLE, *TOKEN_OPERATIONS, *extra_routes]
    if metrics is not None:
        operations.append(
            Operation(
                "GET",
                "/metrics",
                _metrics_handler(metrics),
                "Prometheus metrics (text exposition format)",
                {200: None},
                auth=False,
            )
        )
    app[OPERATIONS] = operations
    app[DOCUMENT] = {}
    for op in operations:
        router.add_route(op.method, op.path, checked(op))
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
    """The admin app on its listen address (``server.AdminListener``)."""

    def __init__(self, app: App, listen: str, sock: socket.socket | None = None) -> None:
        """``sock``: a socket bound on ``listen`` earlier (``gateway.listening_socket``),
        served from ``start``."""
        self.app = app
        host, port = parse_address(listen, listen=True)
        self._listener = AdminListener(app, host, port, sock)

    @property
    def host(self) -> str:
        return self._listener.host

    @property
    def port(self) -> int:
        return self._listener.port

    async def start(self) -> None:
        await self._listener.start()

    async def stop(self) -> None:
        await self._listener.stop()
