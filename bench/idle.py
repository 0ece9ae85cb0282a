"""Idle keep-alive connections: what holding many open clients costs a target in memory.

As a script, it is the client::

    python bench/idle.py --port 8080 --connections 10000

It opens the connections to ``127.0.0.1:PORT`` (``--concurrency`` at a time; with ``--tls``,
each a TLS connection that trusts any certificate, on uvloop, whose TLS transport does not
zero a 256 KiB read buffer per connection as asyncio's does), sends one
``GET /`` on each and reads the whole answer, so that every connection went through a full
request and sits idle in keep-alive, as a browser's or an SDK's would. It prints one JSON line,
``{"open": n, "failed": n, ...}``, then holds them until a line arrives on its standard input
(or ``--hold`` seconds pass), prints ``{"alive": n}``, the connections the target has not
closed meanwhile, closes them all and exits. It never sends anything else.

``idle_step`` drives it from ``run.py``: the target's RSS before, with the connections open,
and after they are closed (on the target's TLS port with ``tls``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from system import Failure, Procs, memory_mib, open_fds, process_tree

if TYPE_CHECKING:
    from targets import Target

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: bench-idle\r\n\r\n"


# ---------------------------------------------------------------------------------------------
# the client


async def _open_one(
    port: int, timeout: float, tls: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    async with asyncio.timeout(timeout):
        name = "bench.test" if tls is not None else None
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=tls, server_hostname=name
        )
        try:
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1]
            if status != b"200":
                raise ValueError(f"status {status.decode()}")
            length = None
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
                if name.strip().lower() == b"connection" and b"close" in value.lower():
                    raise ValueError("the target asked to close the connection")
            if length is None:  # chunked: small here, read to the last chunk
                await reader.readuntil(b"0\r\n\r\n")
            else:
                await reader.readexactly(length)
        except BaseException:
            writer.close()
            raise
        return reader, writer


async def _client(
    port: int, connections: int, concurrency: int, hold: float, tls: ssl.SSLContext | None
) -> None:
    gate = asyncio.Semaphore(concurrency)
    errors: dict[str, int] = {}

    async def one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        async with gate:
            try:
                return await _open_one(port, timeout=30, tls=tls)
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
                key = type(e).__name__ + (f": {e}" if isinstance(e, ValueError) else "")
                errors[key] = errors.get(key, 0) + 1
                return None

    start = time.monotonic()
    results = await asyncio.gather(*(one() for _ in range(connections)))
    held = [r for r in results if r is not None]
    report = {
        "open": len(held),
        "failed": connections - len(held),
        "errors": errors,
        "seconds": round(time.monotonic() - start, 2),
    }
    print(json.dumps(report), flush=True)
    loop = asyncio.get_running_loop()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(hold):
            await loop.run_in_executor(None, sys.stdin.readline)
    await asyncio.sleep(0)  # let pending EOFs land
    alive = sum(1 for reader, _ in held if not reader.at_eof() and reader.exception() is None)
    print(json.dumps({"alive": alive}), flush=True)
    for _, writer in held:
        writer.close()
    await asyncio.sleep(0.5)  # let the closes go out before the process ends


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--connections", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=128, help="connections opened at once")
    p.add_argument("--hold", type=float, default=120.0, help="longest hold, in seconds")
    p.add_argument("--tls", action="store_true", help="TLS connections (any certificate)")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if not args.tls:
        asyncio.run(_client(args.port, args.connections, args.concurrency, args.hold, None))
        return
    import uvloop  # the gateway's own event loop, so installed wherever the bench runs

    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    uvloop.run(_client(args.port, args.connections, args.concurrency, args.hold, context))


# ---------------------------------------------------------------------------------------------
# the driver


@dataclass(frozen=True)
class IdleResult:
    connections: int
    """Connections that completed their request and were held."""
    alive: int | None
    """Of those, still open when the client let go (None: it did not say)."""
    seconds: float
    """Time to open them all."""
    rss_before: float
    rss_with: float
    rss_after: float
    """MiB: the target's RSS before, with the connections held, and 2 s after closing them."""
    fds_with: int
    errors: dict[str, int]

    @property
    def growth(self) -> float:
        return self.rss_with - self.rss_before

    @property
    def kib_per_connection(self) -> float | None:
        return self.growth * 1024 / self.connections if self.connections else None


def json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def idle_step(
    procs: Procs,
    target: Target,
    connections: int,
    cpu: int,
    settle: float = 2.0,
    tls: bool = False,
) -> IdleResult:
    """Hold ``connections`` idle keep-alive connections to ``target`` (TLS ones on its TLS
    port with ``tls``); read its RSS meanwhile.

    Bounded: the client is given 120 s to open everything, and is stopped by pid whatever
    happens.
    """
    pids = process_tree(target.proc.pid)
    rss_before = memory_mib(pids)
    port = target.tls_port if tls else target.port
    argv = [sys.executable, str(Path(__file__).resolve()), "--port", str(port),
            "--connections", str(connections), *(["--tls"] if tls else [])]  # fmt: skip
    name = f"idle-{'tls-' if tls else ''}{target.name}"
    client = procs.start(name, argv, cpu, stdin=subprocess.PIPE)
    try:
        end = time.monotonic() + 120
        while not (lines := json_lines(client.log)):
            if client.popen.poll() is not None or time.monotonic() > end:
                raise Failure(f"idle client for {target.name} gave nothing:\n{client.tail()}")
            time.sleep(0.2)
        opened = lines[0]
        time.sleep(settle)  # let the target finish its bookkeeping for the last ones
        pids = process_tree(target.proc.pid)
        rss_with, fds_with = memory_mib(pids), open_fds(pids)
        assert client.popen.stdin is not None
        client.popen.stdin.write(b"\n")
        client.popen.stdin.flush()
        client.popen.wait(30)
    finally:
        procs.finish(client)
    alive = next((line["alive"] for line in json_lines(client.log) if "alive" in line), None)
    time.sleep(settle)
    return IdleResult(
        connections=opened["open"], alive=alive, seconds=opened["seconds"], rss_before=rss_before,
        rss_with=rss_with, rss_after=memory_mib(process_tree(target.proc.pid)), fds_with=fds_with,
        errors=opened["errors"],
    )  # fmt: skip


if __name__ == "__main__":
    main()
