"""The admin listener: health of the gateway itself, metrics, and the admin API.

An ``aiohttp.web`` app of its own on its own listener (loopback by default), never the
traffic one. Middlewares wrap every route, outermost first: errors (every refusal and every
unexpected failure becomes a JSON body ``{"error": code, "message": text, ...}``; no traceback
reaches a client), auth (every path but ``/healthz``, ``/readyz``, ``/metrics`` and the web
console's, ``console.py``, needs ``Authorization: Bearer <token>``, compared in constant time),
the body (read whole before the route's handler: 413 past ``client_max_size``, at once when
declared so; 408 if it takes over ``BODY_TIMEOUT``), then the caller's (the cluster's
forwarding to the leader). The token is never logged, and neither is a request's headers.

``Expect: 100-continue`` is answered before any middleware (aiohttp's order), by ``_expect``:
a wrong token (401) or a body declared over the limit (413) is refused before ``100
Continue``, so its body is never sent; any other expectation is 417.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway import listening_socket, parse_address, stop_accepting

from ..errors import ControllerError, StoreUnavailable
from ..operations import Controller
from . import console
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
from .origin import origin_middleware
from .tokens import TOKEN_OPERATIONS

__all__ = ["CONTROLLER", "HTTP_SETTINGS", "READY", "AdminServer", "build_admin_app",
           "is_loopback"]  # fmt: skip

log = logging.getLogger("gateway.admin")

MAX_BODY = 1024 * 1024
"""Bytes: a spec is a few kilobytes; anything near this is a mistake or an attack."""
MAX_BODY_SIZE = web.AppKey("max_body_size", int)
BODY_TIMEOUT = 30.0
"""Seconds a request's body may take to arrive whole."""
SSE_KEEPALIVE = 15.0
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", *console.PATHS})
"""Paths that need no token (the console's page and files hold no data). Everything else
(every /api/ route) needs one."""

HTTP_SETTINGS: Mapping[str, Any] = MappingProxyType(
    {
        "access_log": None,
        "keepalive_timeout": 75.0,  # idle this long: closed, as is a head not whole by then
        "max_line_size": 8190,  # the request line; else aiohttp's 400, as below
        "max_field_size": 8190,  # one header field
        "max_headers": 100,  # header fields
        "shutdown_timeout": 10.0,  # answers under way finish within it on stop, then cancelled
    }
)
"""The admin listener's HTTP settings: ``web.AppRunner``'s (and the tests' server's)
keyword arguments, with ``handler_cancellation=True`` besides."""

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
    417: "expectation_failed",
    500: "internal_error",
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


def _too_large(request: web.Request) -> web.Response:
    limit = request.app[MAX_BODY_SIZE]
    response = error_response(
        413, "payload_too_large", f"the body is larger than the {limit} bytes accepted"
    )
    response.force_close()  # the rest of the body is not read
    return response


def _http_error_response(request: web.Request, error: web.HTTPException) -> web.Response:
    """The JSON answer to a refusal of aiohttp's (no route, another method, a body too
    large)."""
    headers = None
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        message = f"{request.method} is not allowed on {request.path} (allowed: {allowed})"
        headers = {"Allow": allowed}
    elif isinstance(error, web.HTTPNotFound):
        message = f"no route {request.method} {request.path}"
    elif isinstance(error, web.HTTPRequestEntityTooLarge):
        return _too_large(request)
    else:
        message = error.text or error.reason
    code = _HTTP_CODES.get(error.status, f"http_{error.status}")
    return error_response(error.status, code, message, headers=headers)


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
        return _http_error_response(request, e)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("admin %s %s failed", request.method, request.path)
        return error_response(500, "internal_error", "internal error (see the gateway log)")


def _unauthorized() -> ApiError:
    return ApiError(
        401,
        "unauthorized",
        "missing or wrong bearer token",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _authorized(request: web.Request, expected: bytes | None) -> bool:
    if expected is None or request.path in OPEN_PATHS:
        return True
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)


def auth_middleware(token: str | None) -> Middleware:
    expected = None if token is None else token.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _authorized(request, expected):
            raise _unauthorized()
        return await handler(request)

    return auth


@web.middleware
async def body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The body, read whole before the handler (which then reads it from memory)."""
    if request.body_exists:
        declared = request.content_length
        if declared is not None and declared > request.app[MAX_BODY_SIZE]:
            return _too_large(request)
        try:
            async with asyncio.timeout(BODY_TIMEOUT):
                await request.read()  # web.HTTPRequestEntityTooLarge past client_max_size
        except TimeoutError:
            response = error_response(
                408, "request_timeout", f"the body was not received within {BODY_TIMEOUT:g} s"
            )
            response.force_close()
            return response
    return await handler(request)


def _expect(token: str | None) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """The routes' answer to ``Expect``: ``100 Continue`` only to a request whose body the
    app would read."""
    expected = None if token is None else token.encode()

    async def expect(request: web.Request) -> web.StreamResponse | None:
        value = request.headers.get("Expect", "")
        if value.lower() != "100-continue":
            refusal = error_response(417, "expectation_failed", f"Expect: {value} is not supported")
        elif not _authorized(request, expected):
            e = _unauthorized()
            refusal = error_response(e.status, e.code, e.message, headers=e.headers)
        elif (request.content_length or 0) > request.app[MAX_BODY_SIZE]:
            refusal = _too_large(request)
        else:
            if request.version >= (1, 1):
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # as aiohttp's own: the answer has not begun
            return None
        refusal.force_close()  # its body is never sent
        return refusal

    return expect


def _metrics_handler(render: Callable[[str], tuple[bytes, str]]) -> Handler:
    async def metrics(request: web.Request) -> web.StreamResponse:
        body, content_type = render(request.headers.get("Accept") or "")
        return web.Response(body=body, headers={"Content-Type": content_type})

    return metrics


async def _stop_streams(app: web.Application) -> None:
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
) -> web.Application:
    """The admin app. ``token`` None: no auth (only allowed on a loopback listener).

    ``metrics`` (an ``Accept`` header to a body and its content type) is served at
    ``/metrics`` without auth; ``extra_routes`` are mounted and documented like the built-in
    ones. ``middlewares`` run inside auth and the body's (the cluster's forwarding to the
    leader: ``admin.cluster``).
    """
    app = web.Application(
        middlewares=[
            errors_middleware,
            auth_middleware(token),
            origin_middleware(token is not None),
            body_middleware,
            *middlewares,
        ],
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
    operations = [
        *OPERATIONS_TABLE,
        *TOKEN_OPERATIONS,
        *console.console_operations(),
        *extra_routes,
    ]
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
    expect = _expect(token)
    for op in operations:
        app.router.add_route(op.method, op.path, checked(op), expect_handler=expect)
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
    """The admin app on its listener: ``sock`` when given (bound by the caller, who may
    bind it before the app exists), else one bound on ``listen`` at ``start``.

    ``stop`` stops accepting, ends the event streams (``on_shutdown``), lets the answers
    under way finish within ``HTTP_SETTINGS``' ``shutdown_timeout``, then cancels them.
    """

    def __init__(
        self, app: web.Application, listen: str, sock: socket.socket | None = None
    ) -> None:
        self.app = app
        self.host, self._port = parse_address(listen, listen=True)
        self._sock = sock
        self._listening: socket.socket | None = None
        """The socket served (None: a name, bound by ``TCPSite``)."""
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        runner = web.AppRunner(self.app, handler_cancellation=True, **HTTP_SETTINGS)
        await runner.setup()
        site: web.BaseSite
        try:
            sock = self._sock
            if sock is None:  # an IP address bound here, a name resolved by TCPSite
                sock = listening_socket(self.host, self._port, False)
            if sock is not None:
                site = web.SockSite(runner, sock)
            else:
                site = web.TCPSite(runner, self.host, self._port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._listening = sock
        self._port = runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            if self._listening is not None:
                # Accepted as the listener closes, a connection would be left open on
                # asyncio's loop (``stop_accepting``); made before ``cleanup``, it is closed
                # with the others (its handler is there a turn after its transport).
                await stop_accepting([self._listening])
                await asyncio.sleep(0)
            await runner.cleanup()
