"""The admin listener: health of the gateway itself, metrics, and the admin API.

Its own listener (loopback by default), never the traffic one.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway.config import parse_address

from ..operations import Controller

CONTROLLER = web.AppKey("controller", Controller)
READY: web.AppKey[Callable[[], bool]] = web.AppKey("ready")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    if request.app[READY]():
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "starting"}, status=503)


def build_admin_app(controller: Controller, ready: Callable[[], bool]) -> web.Application:
    app = web.Application()
    app[CONTROLLER] = controller
    app[READY] = ready
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


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
