"""Fixtures for the hostile-input and fault tests (issue 7).

The data-plane fixtures of ``tests/gateway`` (a pool, a started gateway, real upstreams) are
reused as they are. Added here: an upstream that records every byte it is sent, raw-socket
helpers that speak to the gateway without a well-behaved HTTP client, and the process's
resident memory, so that a test can show the gateway's memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.pool.pool import Pool
from tests.gateway.conftest import (  # noqa: F401 - fixtures, registered by import
    add,
    client,
    gateway,
    pool,
    raw_upstream,
    recorder,
    upstream,
)
from tests.support.raw_servers import RawServers

MiB = 1024 * 1024


def rss(pid: int | str = "self") -> int:
    """Resident memory of this process (gateway and test client alike), or of ``pid``, in
    bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@dataclass
class Received:
    """One request as an upstream got it: the head and the body, de-chunked."""

    head: bytes
    body: bytes

    @property
    def request_line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]

    def header(self, name: bytes) -> list[bytes]:
        out = []
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower():
                out.append(value.strip())
        return out


@dataclass
class RecordingUpstream:
    """A raw HTTP/1.1 upstream on loopback that records each request and answers 200 "ok".

    It frames requests itself (Content-Length or chunked) so that what it records is what
    crossed the wire from the gateway, byte for byte.
    """

    port: int = 0
    requests: list[Received] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    """Everything received, per connection."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(self.raw)
        self.raw.append(b"")
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.raw[index] += head
                received = Received(head, b"")
                lengths = received.header(b"content-length")
                if b"chunked" in b",".join(received.header(b"transfer-encoding")).lower():
                    body = b""
                    while True:
                        size_line = await reader.readuntil(b"\r\n")
                        self.raw[index] += size_line
                        size = int(size_line.split(b";")[0], 16)
                        chunk = await reader.readexactly(size + 2)
                        self.raw[index] += chunk
                        if size == 0:
                            break
                        body += chunk[:-2]
                    received.body = body
                elif lengths:
                    received.body = await reader.readexactly(int(lengths[0]))
                    self.raw[index] += received.body
                self.requests.append(received)
                self.arrived.set()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def recording(
    pool: Pool,  # noqa: F811 - the fixture imported above
) -> AsyncIterator[Callable[..., Awaitable[RecordingUpstream]]]:
    """``await recording(service, upstream_id)``: a RecordingUpstream, healthy in the pool."""
    servers = RawServers()

    async def start(service: str = "web", upstream_id: str = "u1") -> RecordingUpstream:
        rec = RecordingUpstream()
        server = await servers.start(rec.serve)
        rec.port = server.sockets[0].getsockname()[1]
        add(pool, service, upstream_id, rec.port)
        return rec

    yield start
    await servers.close()


@dataclass
class Answer:
    """What a raw client got: every byte until the gateway closed (or the wait ended)."""

    data: bytes
    closed: bool

    @property
    def status(self) -> int:
        return int(self.data.split(b" ", 2)[1]) if self.data.startswith(b"HTTP/") else 0

    @property
    def statuses(self) -> list[int]:
        return [
            int(line.split(b" ", 2)[1])
            for line in self.data.split(b"\r\n")
            if line.startswith(b"HTTP/") and line[5:8] in (b"1.1", b"1.0", b"0.9")
        ]


async def send_raw(port: int, data: bytes, wait: float = 3.0) -> Answer:
    """Send ``data`` on a fresh connection; read until the gateway closes it, or ``wait``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    closed = False
    try:
        writer.write(data)
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                while chunk := await reader.read(65536):
                    got += chunk
                closed = True
    except ConnectionResetError:
        closed = True
    finally:
        writer.close()
    return Answer(got, closed)
