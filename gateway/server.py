"""The traffic listener: ``ClientConnection``s around ``Proxy.handle``, start-up and shutdown.

The listener is a plain ``loop.create_server`` whose protocol is ``proxy.http1_downstream``'s
``ClientConnection`` (llhttp parsing, limits, deadlines); each request runs ``Proxy.handle``.
A connection that speaks HTTP/2 (its preface, or ALPN ``h2``) is handed to an
``H2Connection`` (``proxy.h2_downstream``), imported at the first: a gateway that serves
HTTP/1.1 alone does not load it.

``bind`` takes the addresses (listening sockets, held, not accepting yet) before ``start``
serves them: the composition root binds before it touches any state, so a second gateway on
the same port fails with nothing touched. ``start`` binds what ``bind`` did not.

Shutdown (``TrafficServer.stop``) is the drain order: stop accepting, close idle keep-alive
connections, parked ones included (busy ones close after their answer), send GOAWAY on
HTTP/2 connections (closed once their open streams are answered), close relayed WebSockets
with 1001, let in-flight requests finish for up to ``shutdown_timeout``, cancel what
remains, and only then close the proxy's upstream connections.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from typing import TYPE_CHECKING

from .config import ProxyConfig, parse_address
from .listening import listen, listening_socket, stop_accepting
from .proxy.handler import Proxy
from .proxy.http1_downstream import ClientConnection, ConnectionGate
from .proxy.parking import Parking

if TYPE_CHECKING:
    from .proxy.h2_downstream import H2Connection
    from .tls import Termination

log = logging.getLogger(__name__)


class TrafficServer:
    """The traffic listener on ``config.listen``, serving ``proxy``."""

    def __init__(
        self,
        proxy: Proxy,
        config: ProxyConfig,
        *,
        address: tuple[str, int] | None = None,
        reuse_port: bool = False,
        tls: Termination | None = None,
        tls_addresses: list[tuple[str, int]] | None = None,
    ) -> None:
        self.proxy = proxy
        self.config = config
        self.address = address or parse_address(config.listen, listen=True)
        """Where to listen: ``config.listen`` unless a worker is given the reserved port."""
        self.reuse_port = reuse_port
        """Bind with SO_REUSEPORT, beside the other workers' listeners on the same port."""
        self.tls = tls
        """The certificates and handshake counts of the HTTPS listeners (``listen_tls``)."""
        if tls_addresses is None:
            tls_addresses = [parse_address(a, listen=True) for a in config.listen_tls]
        self.tls_addresses = tls_addresses if tls is not None else []
        self._server: asyncio.Server | None = None
        self._tls_servers: list[asyncio.Server] = []
        self._bound: list[socket.socket | None] = []
        """The sockets of ``bind``, for ``address`` then ``tls_addresses`` (None: a name),
        each until ``start`` serves it."""
        self._port = 0
        self.tls_ports: list[int] = []
        """The bound ports of the HTTPS listeners, in ``tls_addresses`` order."""
        self._connections: set[ClientConnection] = set()
        self._h2_connections: set[H2Connection] = set()
        self._gate: ConnectionGate | None = None

    @property
    def port(self) -> int:
        """The bound port (useful when ``listen`` asked for port 0)."""
        if not self._port:
            raise RuntimeError("TrafficServer is not bound")
        return self._port

    @property
    def connections(self) -> int:
        """Open client connections: in the loop (HTTP/2 ones too), and parked
        (``proxy.parking``)."""
        gate = self._gate
        parked = gate.parked if gate is not None else 0
        return len(self._connections) + len(self._h2_connections) + parked

    @property
    def http2(self) -> int:
        """Of ``connections``, those that speak HTTP/2."""
        return len(self._h2_connections)

    @property
    def parked(self) -> int:
        """Of ``connections``, those parked."""
        return self._gate.parked if self._gate is not None else 0

    def bind(self) -> None:
        """Bind ``address`` and the HTTPS addresses, and hold the sockets: they queue
        connections from now on, and ``start`` accepts them. A name is left to ``start``,
        which resolves it. If one address fails, none is held."""
        if self._bound or self._server is not None:
            return
        bound: list[socket.socket | None] = []
        try:
            for address in (self.address, *self.tls_addresses):
                bound.append(listening_socket(*address, self.reuse_port))
        except BaseException:
            for sock in bound:
                if sock is not None:
                    sock.close()
            raise
        self._bound = bound
        if bound[0] is not None:
            self._port = bound[0].getsockname()[1]

    def unbind(self) -> None:
        """Close the sockets ``bind`` holds that no server took (all of them unless started)."""
        bound, self._bound = self._bound, []
        for sock in bound:
            if sock is not None:
                sock.close()

    def _served(self, index: int) -> socket.socket | None:
        """The socket ``bind`` made for the ``index``-th address, handed to its server."""
        sock, self._bound[index] = self._bound[index], None
        return sock

    async def start(self) -> None:
        if self._server is not None:
            return
        self.bind()
        await self.proxy.start()
        limits = self.config.limits
        connector = self.proxy.connector
        gate = ConnectionGate(
            limits.max_connections,
            connector.batch,
            self.config.tracing.propagate,
            connector.buffers,
        )
        connections = self._connections
        handle = self.proxy.handle
        begin = self.proxy.begin
        if self.config.http2.cleartext:
            gate.http2 = self._http2
        gate.model_prefix = self.proxy.model_prefix
        gate.timed_out = self.proxy.forwarding.client_timeout

        # A partial, not a closure: this module is not compiled, and a closure would run an
        # interpreted frame for every connection.
        protocol = functools.partial(ClientConnection, handle, limits, gate, connections, begin)

        loop = asyncio.get_running_loop()
        server = await listen(loop, protocol, self.address, self.reuse_port, self._served(0))
        if server.sockets:
            self._port = server.sockets[0].getsockname()[1]
            if limits.park_after:

                def resumed(park_after: float) -> ClientConnection:
                    """A parked connection's protocol, when its client sends again."""
                    conn = protocol()
                    conn.park_after = park_after
                    return conn

                family = server.sockets[0].family
                gate.parking = Parking(loop, resumed, family, gate, limits.park_after)
        self._server = server
        self._gate = gate
        tls = self.tls
        if tls is not None and self.tls_addresses:
            from .tls import tls_connections  # here: a listener without TLS loads none of it

            tls.start()
            secure = tls_connections(
                protocol,
                tls.store,
                self.config.tls.handshake_timeout,
                gate,
                tls.tally,
                self._http2 if "h2" in self.config.tls.alpn else None,
            )
            for i, address in enumerate(self.tls_addresses, 1):
                tls_server = await listen(loop, secure, address, self.reuse_port, self._served(i))
                self._tls_servers.append(tls_server)
                self.tls_ports.append(tls_server.sockets[0].getsockname()[1])
            self.proxy.https_port = self.tls_ports[0]

    def _http2(self, transport: asyncio.Transport, secure: bool, read: bytes | None) -> None:
        """Serve ``transport`` over HTTP/2 (``ConnectionGate.http2``)."""
        from .proxy.h2_downstream import H2Connection  # here: loads h2 at the first

        gate = self._gate
        assert gate is not None
        conn = H2Connection(
            self.proxy.handle,
            self.proxy.begin,
            self.config.limits,
            self.config.http2,
            gate,
            self._h2_connections,
        )
        conn.take_over(transport, secure, read)

    async def stop(self) -> None:
        """Stop accepting, finish in-flight requests (up to shutdown_timeout), then close."""
        self.unbind()
        server, self._server = self._server, None
        tls_servers, self._tls_servers = self._tls_servers, []
        # Connections accepted (or resumed from parking) as the listeners close are made
        # first, so that they are closed with the others below (``stop_accepting``).
        listening = [s for srv in (server, *tls_servers) if srv is not None for s in srv.sockets]
        await stop_accepting(listening)
        for tls_server in tls_servers:
            tls_server.close()
        if server is not None:
            server.close()
            if self._gate is not None and self._gate.parking is not None:
                self._gate.parking.close()
            await asyncio.sleep(0)  # their ``connection_made``: in ``_connections`` now
            for conn in list(self._connections):
                conn.close()
            h2_connections = self._h2_connections
            for h2_conn in list(h2_connections):
                h2_conn.close()  # GOAWAY
            self.proxy.going_away()
            # A request with a task of its own, or one served without (``Proxy.begin``).
            waits = {
                c.task if c.task is not None else c.request_over()
                for c in self._connections
                if c.task is not None or c.exchange is not None
            }
            waits.update(c.request_over() for c in h2_connections if c.busy)
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
                    for h2_conn in list(h2_connections):
                        tasks.update(h2_conn.cancel_streams())
                    if tasks:
                        await asyncio.wait(tasks, timeout=5)
            for conn in list(self._connections):
                conn.abort()
            for h2_conn in list(h2_connections):
                h2_conn.abort()
            await server.wait_closed()
        for tls_server in tls_servers:
            await tls_server.wait_closed()
        if self.tls is not None:
            await self.tls.stop()
        await self.proxy.close()

    def __repr__(self) -> str:
        state = "stopped" if self._server is None else f"port={self._port}"
        return f"<TrafficServer {self.config.listen} {state}>"
