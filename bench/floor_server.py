"""The least an HTTP/1.1 server on uvloop and llhttp costs: ``bench/memory.py``'s floor.

    python -OO bench/floor_server.py PORT

Answers every request on ``127.0.0.1:PORT`` with the same 200 and a 13-byte body, keeping the
connection: no upstream, no configuration, no log. What a gateway worker holds beyond this
process is the gateway's own; what this process holds is what any server on the same
interpreter, event loop and parser holds.
"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop

RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\nContent-Type: text/plain\r\n\r\nHello, world\n"
)


class Fixed(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_complete(self) -> None:
        self.transport.write(RESPONSE)


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Fixed, "127.0.0.1", port, backlog=4096)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1])))
