"""The traffic listener: the aiohttp app around ``Proxy.handle``, and its start-up and shutdown.

Each client connection is served by ``TrafficProtocol``, aiohttp's ``RequestHandler`` with
three additions that aiohttp has no setting for:

- a header timeout: a connection must deliver each request head within
  ``limits.header_timeout`` (counted from the connection, or from the first byte of a later
  request on a kept-alive connection), else it is closed; this is what stops slowloris;
- ``limits.max_connections``: a connection beyond it is answered 503 and closed at once;
- an oversized request line is answered 414 and an oversized header field 431 (aiohttp says
  400 to both), as JSON like every error the gateway makes.

Shutdown (``TrafficServer.stop``) runs in aiohttp's order, which is the drain order:
stop accepting, close idle keep-alive connections, close relayed WebSockets with 1001, let
in-flight requests finish for up to ``shutdown_timeout``, cancel what remains, and only then
close the proxy's upstream session (``cleanup_ctx``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_request import BaseRequest
from yarl import URL

from .config import ListenerLimits, ProxyConfig, parse_address
from .proxy import Proxy

log = logging.getLogger(__name__)

PROXY = web.AppKey("proxy", Proxy)

# An oversized request line reaches us as the line itself (pure-Python parser) or as the
# request target (llhttp); an oversized header as its name or value, which never starts
# with "METHOD " nor, in practice, with "/".
_REQUEST_LINE = re.compile(rb"^(/|[A-Z]+ )")

_REFUSAL = json.dumps(
    {"error": "too_many_connections", "message": "the gateway is at its connection limit"}
).encode()
_TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL)
)


def handler_args(limits: ListenerLimits) -> dict[str, Any]:
    """Settings of each client connection's ``RequestHandler``."""
    return {
        "keepalive_timeout": limits.keepalive_timeout,
        "max_line_size": limits.max_header_size,
        "max_field_size": limits.max_header_size,
        "access_log": None,  # the access log is a RequestObserver
        "auto_decompress": False,  # bodies cross the proxy as they are
    }


def build_app(proxy: Proxy) -> web.Application:
    """The traffic app: every method and path goes to ``proxy.handle``.

    ``client_max_size`` is left alone: it only limits ``request.read()``, which the proxy
    never calls (bodies are streamed; the limit is each service's ``max_body_size``).
    """
    app = web.Application(handler_args=handler_args(proxy.config.limits))
    app[PROXY] = proxy
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    app.cleanup_ctx.append(_proxy_session)
    app.on_shutdown.append(_going_away)
    return app


async def _proxy_session(app: web.Application) -> AsyncIterator[None]:
    proxy = app[PROXY]
    await proxy.start()
    yield
    await proxy.close()


async def _going_away(app: web.Application) -> None:
    app[PROXY].going_away()


def _error(status: int, code: str, message: str) -> web.Response:
    response = web.json_response({"error": code, "message": message}, status=status)
    response.force_close()
    return response


class _ConnectionGate:
    """Counts open client connections against ``limit``."""

    __slots__ = ("limit", "open")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0


class TrafficProtocol(web.RequestHandler):
    """aiohttp's connection handler plus a header timeout, a connection cap, 414 and 431."""

    def __init__(
        self,
        manager: web.Server,
        *,
        gate: _ConnectionGate,
        header_timeout: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads = 0
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._gate.open >= self._gate.limit:
            self._refused = True
            log.debug("connection refused: %d open", self._gate.open)
            tcp = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
            tcp.write(_TOO_MANY_CONNECTIONS)
            tcp.close()
            return
        self._gate.open += 1
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._gate.open -= 1
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # aiohttp's start() waits on ``_waiter`` exactly when it is idle between requests:
        # the bytes now arriving begin a new request head.
        idle = self._waiter is not None and not self._waiter.done()
        super().data_received(data)
        if self._request_count != self._heads:
            self._heads = self._request_count
            self._disarm()
        elif idle and data and self._head_timer is None:
            self._arm()

    def _arm(self) -> None:
        if self._header_timeout > 0:
            self._head_timer = self._loop.call_later(self._header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._request_count == self._heads:
            log.debug("request head not received within %ss: closing", self._header_timeout)
            self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        log.debug("bad request head from %s: %s", request.remote, exc)
        if isinstance(exc, LineTooLong):
            line = exc.args[0] if exc.args else b""
            if isinstance(line, bytes | bytearray) and _REQUEST_LINE.match(line):
                return _error(414, "uri_too_long", "the request line is too long")
            return _error(431, "header_too_large", "a request header field is too large")
        if "Too many headers" in exc.message:
            return _error(431, "header_too_large", "too many request header fields")
        return _error(exc.code or 400, "bad_request", "the request is not valid HTTP/1.1")


class _TrafficSite(web.BaseSite):
    """A TCP site whose connections are served by ``TrafficProtocol``."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        protocol: Callable[[], TrafficProtocol],
    ) -> None:
        super().__init__(runner, backlog=1024)
        self._host = host
        self._port = port
        self._protocol = protocol

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host, port=self._port))

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = server = await loop.create_server(
            self._protocol, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
        if server.sockets:
            self._port = server.sockets[0].getsockname()[1]


def _listen_address(listen: str) -> tuple[str, int]:
    return parse_address(listen, listen=True)


class TrafficServer:
    """The traffic listener on ``config.listen``, serving ``proxy``."""

    def __init__(self, proxy: Proxy, config: ProxyConfig) -> None:
        self.proxy = proxy
        self.config = config
        self._runner: web.AppRunner | None = None
        self._site: _TrafficSite | None = None

    @property
    def port(self) -> int:
        """The bound port (useful when ``listen`` asked for port 0)."""
        if self._site is None:
            raise RuntimeError("TrafficServer is not started")
        return self._site.port

    async def start(self) -> None:
        if self._runner is not None:
            return
        runner = web.AppRunner(
            build_app(self.proxy),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.config.shutdown_timeout,
        )
        await runner.setup()
        server = runner.server
        assert server is not None
        limits = self.config.limits
        gate = _ConnectionGate(limits.max_connections)
        kwargs = handler_args(limits)
        loop = asyncio.get_running_loop()

        def protocol() -> TrafficProtocol:
            return TrafficProtocol(
                server, loop=loop, gate=gate, header_timeout=limits.header_timeout, **kwargs
            )

        host, port = _listen_address(self.config.listen)
        site = _TrafficSite(runner, host, port, protocol)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._site = runner, site

    async def stop(self) -> None:
        """Stop accepting, finish in-flight requests (up to shutdown_timeout), then close."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await self.proxy.close()

    def __repr__(self) -> str:
        state = "stopped" if self._runner is None else f"port={self.port}"
        return f"<TrafficServer {self.config.listen} {state}>"
