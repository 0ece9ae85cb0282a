"""WebSocket relay: two connected WebSockets pumped into each other until one side closes.

Every frame crosses as it is: text, binary, ping and pong (neither side answers pings on its
own, so a ping measures the whole path). A close crosses with its code and reason: when one
side closes with code X, the other side is closed with X and the first close is answered
with X as well. The upstream's side is always closed first: closing the client's side ends
its connection, and aiohttp's ``handler_cancellation`` then cancels the handler. A side that
vanishes without a close frame closes the other with 1014 (bad gateway) towards the client
or 1001 (going away) towards the upstream. ``going_away()`` (a drain timeout, a shutdown)
closes both sides with 1001.

Invariant: the relay ends only when both sides are closed, and it never swallows the
cancellation of the task that runs it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web

log = logging.getLogger(__name__)

ClientSide = web.WebSocketResponse[Literal[True]]
UpstreamSide = aiohttp.ClientWebSocketResponse[Literal[True]]
Side = ClientSide | UpstreamSide

_UNSENDABLE = frozenset({1004, 1005, 1006, 1015})


def sendable(code: int | None) -> int:
    """``code`` if it may be sent in a close frame, else 1000 (RFC 6455 7.4)."""
    if code is None or not 1000 <= code <= 4999 or code in _UNSENDABLE:
        return WSCloseCode.OK
    return code


class Relay:
    """Pumps ``client`` and ``upstream`` into each other; ``run()`` until both are closed."""

    def __init__(self, client: ClientSide, upstream: UpstreamSide) -> None:
        self.client = client
        self.upstream = upstream
        self.bytes_in = 0
        """Payload bytes of data messages from the client."""
        self.bytes_out = 0
        """Payload bytes of data messages to the client."""
        self.closed = False
        """Both sides were closed by the relay (a cancellation after that is the end)."""
        self._closing = False
        self._group: asyncio.TaskGroup | None = None

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            group.create_task(self._pump(self.client, self.upstream, to_client=False))
            group.create_task(self._pump(self.upstream, self.client, to_client=True))
        self._group = None

    def going_away(self) -> None:
        """Close both sides with 1001, in the background (a drain timeout, a shutdown)."""
        if self._closing or self._group is None:
            return
        self._closing = True
        self._group.create_task(self._close_both(WSCloseCode.GOING_AWAY, b"going away"))

    async def _close_both(self, code: int, reason: bytes) -> None:
        # The upstream first: closing the client's side ends its connection, and with
        # ``handler_cancellation`` that cancels the task this relay runs in.
        await self.upstream.close(code=code, message=reason)
        await self.client.close(code=code, message=reason)
        self.closed = True

    async def _pump(self, src: Side, dst: Side, *, to_client: bool) -> None:
        # What the far side hears when ``src`` vanishes without a close frame.
        abnormal = WSCloseCode.BAD_GATEWAY if to_client else WSCloseCode.GOING_AWAY
        while True:
            msg = await src.receive()
            kind = msg.type
            try:
                if kind is WSMsgType.TEXT:
                    await dst.send_str(msg.data)
                elif kind is WSMsgType.BINARY:
                    await dst.send_bytes(msg.data)
                elif kind is WSMsgType.PING:
                    await dst.ping(msg.data)
                    continue
                elif kind is WSMsgType.PONG:
                    await dst.pong(msg.data)
                    continue
                elif kind is WSMsgType.CLOSE:
                    await self._propagate(src, dst, msg.data, msg.extra or "")
                    return
                else:
                    # CLOSING/CLOSED: closed by us (the other pump, going_away) or by a lost
                    # connection; ERROR: a broken frame, already answered on ``src``.
                    await self._propagate(src, dst, abnormal, "")
                    return
            except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
                # ``dst`` went away under us: close ``src`` for the reason it did.
                log.debug("websocket relay: send failed: %r", exc)
                other = WSCloseCode.GOING_AWAY if to_client else WSCloseCode.BAD_GATEWAY
                await self._propagate(dst, src, other, "")
                return
            if to_client:
                self.bytes_out += len(msg.data)
            else:
                self.bytes_in += len(msg.data)

    async def _propagate(self, src: Side, dst: Side, code: int, reason: str) -> None:
        """``src`` ended with ``code``: close ``dst`` with it, then answer ``src``'s close."""
        if self._closing:
            return
        self._closing = True
        code = sendable(code)
        await self._close_both(code, reason.encode()[:123])
