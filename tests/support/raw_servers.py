"""Raw TCP for a test on asyncio's loop: ``closed_by_peer``, whether a server closed a
client's connection."""

from __future__ import annotations

import asyncio
import socket


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
