"""Listening sockets: each listener bound on a socket of ours where its address is an IP.

The traffic listeners (``server.TrafficServer``, a worker's) listen through ``listen``; this
module imports no data plane, so a process that serves no traffic (the main process of
``--workers N``) does not load it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable

BACKLOG = 1024


def _family(host: str) -> socket.AddressFamily | None:
    """The address family of ``host`` if it is an IP address, else None (a name)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family
    return None


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket | None:
    """A socket listening on ``(host, port)`` if ``host`` is an IP address, set as
    ``create_server`` sets its own (SO_REUSEADDR, SO_REUSEPORT when asked, IPV6_V6ONLY on
    IPv6), its bind error in the same words; None for a name, which ``create_server``
    resolves. uvloop resolves even an address in libuv's thread pool: four threads, with
    their stacks and malloc arena, started in every serving process for the one lookup."""
    family = _family(host)
    if family is None:
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            where = (host, port)
            reason = (exc.strerror or str(exc)).lower()
            raise OSError(
                exc.errno, f"error while attempting to bind on address {where!r}: {reason}"
            ) from None
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def listen(
    loop: asyncio.AbstractEventLoop,
    protocol: Callable[[], asyncio.BaseProtocol],
    address: tuple[str, int],
    reuse_port: bool,
    sock: socket.socket | None = None,
) -> asyncio.Server:
    """``loop.create_server`` on ``address``: on a socket of ours for an IP address (the
    server owns it then), else on the name, resolved. ``sock``: one bound earlier by
    ``listening_socket`` for ``address``, served as it is."""
    host, port = address
    if sock is None:
        sock = listening_socket(host, port, reuse_port)
    if sock is not None:
        return await loop.create_server(protocol, sock=sock, backlog=BACKLOG)
    return await loop.create_server(
        protocol, host, port, backlog=BACKLOG, reuse_address=True, reuse_port=reuse_port or None
    )


async def stop_accepting(sockets: Iterable[socket.socket]) -> None:
    """Stop accepting on a server's listening ``sockets``, then let the connections accepted
    before be made: the caller closes the server after, and finds every one of them.

    asyncio's selector loop accepts in the sockets' reader callback and makes each transport
    a loop turn later, in a task. ``Server.close`` in between leaves that connection's socket
    open for good: its transport fails ``Server._attach``'s assertion, the task drops it
    without a word (CPython gh-109564), and the collector finds it unclosed later. With the
    reader gone no connection is accepted any more, and a turn later the accepted ones have
    their transports (their ``connection_made`` comes at the turn after). uvloop makes a
    connection as it accepts it: it has no reader to remove, and nothing to wait for."""
    loop = asyncio.get_running_loop()
    for sock in sockets:
        try:
            loop.remove_reader(sock.fileno())
        except NotImplementedError:  # a loop that accepts otherwise (no readers)
            break
    await asyncio.sleep(0)
