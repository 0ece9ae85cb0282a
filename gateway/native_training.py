"""The load a profile-guided build of the compiled modules trains on (``native.build``).

``python -m gateway.native_training`` runs in the build's stage, on modules compiled with
GCC's ``-fprofile-generate``: the counters of the branches taken are written when the
process ends, and the second compilation lays the code out and inlines by them. So the
load is the data plane's everyday work, in one process on loopback: an upstream, the
traffic listener in front of it with the observers a worker has (the request tally and
the access log, to a file), and clients on keep-alive
connections (short answers, chunked ones read in several pieces, a larger body, a request
with a body) and on a new connection each (``Connection: close``). It refuses to run on the
pure Python modules: a profile of nothing would be trained on nothing.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from .config import ProxyConfig, ServiceRouting, parse_settings
from .observability.accesslog import AccessLog
from .observability.tally import RequestTally
from .pool.events import RequestObserver
from .pool.pool import Pool
from .pool.upstream import Health, Upstream
from .proxy import handler
from .proxy.handler import Proxy
from .server import TrafficServer

KEEP_ALIVE_CLIENTS = 64
REQUESTS_EACH = 250
CLOSE_CLIENTS = 4
CONNECTIONS_EACH = 150
PATHS = (b"/",) * 13 + (b"/chunked", b"/big", b"/echo")
"""Most answers short and whole, as under the bench's load: the profile weighs the paths by
how often they run."""
BIG = b"x" * 65536
CHUNKS = 12


async def _upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers ``/`` with a short body, ``/chunked`` in chunks written one by one,
    ``/big`` with 64 KiB and ``/echo`` with the request's body, keep-alive until EOF."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length) if length else b""
            if path == b"/chunked":
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(CHUNKS):
                    event = b"data: %d\n\n" % i
                    writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(0)
                writer.write(b"0\r\n\r\n")
                continue
            answer = BIG if path == b"/big" else body if path == b"/echo" else b"Hello, world\n"
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%b"
                % (len(answer), answer)
            )
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _read_answer(reader: asyncio.StreamReader) -> int:
    """One answer's status, its body read and dropped."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    fields = head.lower()
    if b"transfer-encoding: chunked" in fields:
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return status
    at = fields.find(b"content-length:")
    if at >= 0:
        end = fields.index(b"\r\n", at)
        await reader.readexactly(int(fields[at + 15 : end]))
    return status


def _request(path: bytes, close: bool = False) -> bytes:
    extra = b"Connection: close\r\n" if close else b""
    if path == b"/echo":
        return (
            b"POST /echo HTTP/1.1\r\nHost: training\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 1024\r\n%b\r\n%b" % (extra, b"y" * 1024)
        )
    return b"GET %b HTTP/1.1\r\nHost: training\r\nUser-Agent: training\r\n%b\r\n" % (path, extra)


async def _keep_alive_client(port: int, index: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    failed = 0
    try:
        for i in range(REQUESTS_EACH):
            writer.write(_request(PATHS[(index + i) % len(PATHS)]))
            failed += await _read_answer(reader) != 200
    finally:
        writer.close()
    return failed


async def _close_client(port: int) -> int:
    failed = 0
    for i in range(CONNECTIONS_EACH):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_request(PATHS[i % 3], close=True))
            failed += await _read_answer(reader) != 200
        finally:
            writer.close()
    return failed


async def train(log_dir: Path, access_log: AccessLog | None = None) -> int:
    """Serve the load once, logging to ``access_log`` (by default one into ``log_dir``); the
    number of answers that were not 200 (0 when all went through)."""
    loop = asyncio.get_running_loop()
    upstream = await asyncio.start_server(_upstream, "127.0.0.1", 0)
    upstream_port = upstream.sockets[0].getsockname()[1]
    pool = Pool(clock=loop.time)
    pool.set_service(
        parse_settings(ServiceRouting, {"name": "training", "route": {"path_prefix": "/"}})
    )
    pool.add_upstream(
        Upstream(id="training-1", service="training", host="127.0.0.1", port=upstream_port)
    )
    pool.set_health("training", "training-1", Health.HEALTHY)
    settings = parse_settings(ProxyConfig, {"listen": "127.0.0.1:0"})
    if access_log is None:
        access_log = AccessLog(path=str(log_dir / "access.log"))
    observers: list[RequestObserver] = [RequestTally(), access_log]
    access_log.start()
    server = TrafficServer(Proxy(pool, settings, observers), settings)
    await server.start()
    try:
        clients = [_keep_alive_client(server.port, i) for i in range(KEEP_ALIVE_CLIENTS)]
        clients += [_close_client(server.port) for _ in range(CLOSE_CLIENTS)]
        return sum(await asyncio.gather(*clients))
    finally:
        await server.stop()
        await access_log.stop()
        upstream.close()
        await upstream.wait_closed()


def main() -> int:
    if handler.__file__ is None or handler.__file__.endswith(".py"):
        print("native_training: the modules are not compiled: nothing to train", file=sys.stderr)
        return 2
    import uvloop

    with tempfile.TemporaryDirectory(prefix="gateway-training-") as tmp:
        failed = uvloop.run(train(Path(tmp)))
    if failed:
        print(f"native_training: {failed} answers were not 200", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
