"""Raw TCP for a test on asyncio's loop: ``RawServers``, servers closed with every
connection they accepted, ``cleanup_runner``, an aiohttp runner's cleanup that leaves none
open either, and ``closed_by_peer``, whether a server closed a client's connection.

``Server.close`` closes the listening sockets only; a handler cancelled at the loop's close
(waiting on its reader) or never started leaves its connection open, and the collector finds
its transport and socket unclosed later, in another test. ``RawServers.close`` stops
accepting first (``gateway.stop_accepting``: a server closed as it accepts leaves that
socket open on asyncio's loop), cancels the handlers still running and closes every
connection's writer: each one is known from its ``connection_made``, before its handler
runs.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway import stop_accepting

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None]


class RawServers:
    """``await servers.start(handler)``: a server on loopback; ``await servers.close()``."""

    def __init__(self) -> None:
        self._servers: list[asyncio.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(
        self, handler: Handler, host: str = "127.0.0.1", **kwargs: Any
    ) -> asyncio.Server:
        """``asyncio.start_server(handler, host, 0, **kwargs)``, its connections tracked."""

        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                result = handler(reader, writer)
                if result is not None:
                    await result
            finally:
                self._tasks.discard(task)

        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
            self._writers.add(writer)  # in connection_made: before the handler's task runs
            return run(reader, writer)

        server = await asyncio.start_server(connected, host, 0, **kwargs)
        self._servers.append(server)
        return server

    async def close(self) -> None:
        servers, self._servers = self._servers, []
        await stop_accepting([sock for server in servers for sock in server.sockets])
        for server in servers:
            server.close()
        await asyncio.sleep(0)  # the connection_made of those accepted last: tracked now
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        writers, self._writers = list(self._writers), set()
        for writer in writers:
            writer.close()
        closing = [asyncio.ensure_future(w.wait_closed()) for w in writers]
        if closing:
            await asyncio.wait(closing, timeout=1)
        for writer, closed in zip(writers, closing, strict=True):
            writer.transport.abort()  # unsent data a peer never read: closed even so
            if closed.done() and not closed.cancelled():
                closed.exception()  # retrieved: a reset peer is no news here
            else:
                closed.cancel()
        for server in servers:
            await server.wait_closed()


async def cleanup_runner(runner: web.BaseRunner) -> None:
    """``runner.cleanup()``, its sites stopped accepting first and the connections they
    accepted made (``gateway.stop_accepting``, then a turn for ``connection_made``): its
    cleanup closes the listeners as they may be accepting, and a connection accepted in that
    turn stayed open (CPython gh-109564), as the admin listener's did. For a server that a
    client (a prober) may connect to as it stops."""
    sockets = []
    for site in runner.sites:
        server = getattr(site, "_server", None)  # the site's asyncio.Server: no public name
        if server is not None:
            sockets += server.sockets
    await stop_accepting(sockets)
    await asyncio.sleep(0)
    await runner.cleanup()


async def closed_by_peer(sock: socket.socket, within: float = 2.0) -> bool:
    """Whether the other end of ``sock`` (a connected client socket) closes or resets it
    within ``within`` seconds, with nothing sent first."""
    sock.setblocking(False)
    try:
        async with asyncio.timeout(within):
            return await asyncio.get_running_loop().sock_recv(sock, 1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
