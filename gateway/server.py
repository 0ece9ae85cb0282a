"""The traffic listener: ``ClientConnection``s around ``Proxy.handle``, start-up and shutdown.

The listener is a plain ``loop.create_server`` whose protocol is ``proxy.client``'s
``ClientConnection`` (llhttp parsing, limits, deadlines); each request runs ``Proxy.handle``.

Shutdown (``TrafficServer.stop``) is the drain order: stop accepting, close idle keep-alive
connections (busy ones close after their answer), close relayed WebSockets with 1001, let
in-flight requests finish for up to ``shutdown_timeout``, cancel what remains, and only then
close the proxy's upstream connections.
"""

from __future__ import annotations

import asyncio
import logging

from .config import ProxyConfig, parse_address
from .proxy.client import ClientConnection, ConnectionGate
from .proxy.handler import Proxy

log = logging.getLogger(__name__)

BACKLOG = 1024


class TrafficServer:
    """The traffic listener on ``config.listen``, serving ``proxy``."""

    def __init__(
        self,
        proxy: Proxy,
        config: ProxyConfig,
        *,
        address: tuple[str, int] | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.proxy = proxy
        self.config = config
        self.address = address or parse_address(config.listen, listen=True)
        """Where to listen: ``config.listen`` unless a worker is given the reserved port."""
        self.reuse_port = reuse_port
        """Bind with SO_REUSEPORT, beside the other workers' listeners on the same port."""
        self._server: asyncio.Server | None = None
        self._port = 0
        self._connections: set[ClientConnection] = set()

    @property
    def port(self) -> int:
        """The bound port (useful when ``listen`` asked for port 0)."""
        if not self._port:
            raise RuntimeError("TrafficServer is not started")
        return self._port

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        if self._server is not None:
            return
        await self.proxy.start()
        limits = self.config.limits
        gate = ConnectionGate(limits.max_connections, self.proxy.connector.batch)
        connections = self._connections
        handle = self.proxy.handle
        begin = self.proxy.begin

        def protocol() -> ClientConnection:
            return ClientConnection(handle, limits, gate, connections, begin)

        host, port = self.address
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            protocol,
            host,
            port,
            backlog=BACKLOG,
            reuse_address=True,
            reuse_port=self.reuse_port or None,
        )
        if server.sockets:
            self._port = server.sockets[0].getsockname()[1]
        self._server = server

    async def stop(self) -> None:
        """Stop accepting, finish in-flight requests (up to shutdown_timeout), then close."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            for conn in list(self._connections):
                conn.close()
            self.proxy.going_away()
            # A request with a task of its own, or one served without (``Proxy.begin``).
            waits = {
                c.task if c.task is not None else c.request_over()
                for c in self._connections
                if c.task is not None or c.exchange is not None
            }
            if waits:
                _, pending = await asyncio.wait(waits, timeout=self.config.shutdown_timeout)
                if pending:
                    log.warning("shutdown: cancelling %d requests still in flight", len(pending))
                    tasks = set()
                    for conn in list(self._connections):
                        if conn.task is not None and not conn.task.done():
                            conn.task.cancel()
                            tasks.add(conn.task)
                        elif conn.exchange is not None:
                            conn.exchange.cancel()
                    if tasks:
                        await asyncio.wait(tasks, timeout=5)
            for conn in list(self._connections):
                conn.abort()
            await server.wait_closed()
        await self.proxy.close()

    def __repr__(self) -> str:
        state = "stopped" if self._server is None else f"port={self._port}"
        return f"<TrafficServer {self.config.listen} {state}>"
