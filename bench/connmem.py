"""What one idle keep-alive client connection holds in the gateway's memory, object by object.

    .venv/bin/python bench/connmem.py [--connections 2000] [--top 12]

The data plane runs in this process (a ``TrafficServer`` over one upstream on loopback that
answers ``ok``); a child process opens the connections, sends one ``GET /`` on each, reads the
answer and holds them. Between before and after: the Python heap traced by ``tracemalloc``,
and the objects the cyclic collector tracks, by type, with ``sys.getsizeof``. Per connection,
so that a change to what a connection keeps shows at once, to the byte, where the RSS
figures of ``run.py``'s idle step move by a few hundred bytes from run to run. It runs the
compiled data plane when it is built (``GATEWAY_NATIVE=0`` for the pure one). Not a test, and
nothing is written to ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import subprocess
import sys
import tracemalloc
from dataclasses import replace
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway import native

native.use()  # the compiled modules if built, as the gateway runs them
from gateway.config import ListenerLimits, ProxyConfig, RouteConfig, ServiceRouting  # noqa: E402
from gateway.pool.pool import Pool  # noqa: E402
from gateway.pool.upstream import Health, Upstream  # noqa: E402
from gateway.proxy.handler import Proxy  # noqa: E402
from gateway.server import TrafficServer  # noqa: E402

FRAMES = 3
"""Frames of each allocation site shown, innermost first."""

CLIENT = r"""
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = s.recv(4096)
        if not chunk:
            sys.exit("the gateway closed a connection")
        data += chunk
    held.append(s)
print("held", flush=True)
sys.stdin.readline()
"""


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _objects() -> tuple[collections.Counter[str], collections.Counter[str]]:
    count: collections.Counter[str] = collections.Counter()
    size: collections.Counter[str] = collections.Counter()
    for o in gc.get_objects():
        kind = f"{type(o).__module__}.{type(o).__qualname__}"
        count[kind] += 1
        size[kind] += sys.getsizeof(o)
    return count, size


async def measure(connections: int, top: int) -> None:
    upstream = await asyncio.start_server(_answer, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    pool = Pool()
    pool.set_service(ServiceRouting(name="bench", route=RouteConfig(path_prefix="/")))
    pool.add_upstream(Upstream(id="up", service="bench", host="127.0.0.1", port=port))
    pool.set_health("bench", "up", Health.HEALTHY)
    settings = ProxyConfig(limits=ListenerLimits(max_connections=connections + 100))
    settings = replace(settings, listen="127.0.0.1:0")
    server = TrafficServer(Proxy(pool, settings, []), settings)
    await server.start()
    client = None
    try:
        gc.collect()
        count0, size0 = _objects()
        tracemalloc.start(FRAMES)
        traced0 = tracemalloc.get_traced_memory()[0]
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, str(server.port), str(connections),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert client.stdout is not None
        assert client.stdin is not None
        line = await asyncio.wait_for(client.stdout.readline(), 120)
        if not line.startswith(b"held"):
            sys.exit("connmem: the client did not hold its connections")
        await asyncio.sleep(0.5)  # the last answers' callbacks
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - traced0
        sites = tracemalloc.take_snapshot().statistics("traceback")
        tracemalloc.stop()
        count1, size1 = _objects()
        print(native.running)
        print(f"{connections:,} idle connections: {traced / connections:,.0f} bytes each traced")
        print("objects the collector tracks, gained per connection (count x type: bytes):")
        gained = sorted(size1, key=lambda k: size0[k] - size1[k])
        for kind in gained[:top]:
            n = (count1[kind] - count0[kind]) / connections
            if n > 0.005:
                each = (size1[kind] - size0[kind]) / connections
                print(f"  {n:5.2f} x {kind}: {each:,.0f}")
        print("where the traced bytes were allocated, per connection (file:line: bytes):")
        for stat in sites[:top]:
            if stat.size / connections >= 8:
                where = " < ".join(
                    f"{Path(f.filename).name}:{f.lineno}" for f in reversed(stat.traceback)
                )
                each, blocks = stat.size / connections, stat.count / connections
                print(f"  {where}: {each:,.0f} ({blocks:.2f} blocks)")
        client.stdin.write(b"\n")
        await client.stdin.drain()
        await asyncio.wait_for(client.wait(), 30)
    finally:
        if client is not None and client.returncode is None:
            client.kill()
            await client.wait()
        await server.stop()
        upstream.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    uvloop.run(measure(args.connections, args.top))


if __name__ == "__main__":
    main()
