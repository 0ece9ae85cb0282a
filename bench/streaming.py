"""Streaming through the gateway: 1 GiB down and 1 GiB up, with the gateway's RSS sampled.

    .venv/bin/python bench/streaming.py [--mib 1024]

Starts an aiohttp upstream (``/download?mib=N`` streams N MiB, ``/upload`` counts what it
receives) and the gateway in front of it (static backend, an http probe), both on loopback,
then moves the body each way, first directly and then through the gateway, sampling the
gateway's resident set every 50 ms. Memory staying flat means the body is streamed, never
buffered: the peak RSS during a 1 GiB transfer should stay within a few MiB of the idle RSS.
Everything it starts is stopped by pid in a ``finally``; traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import interpreter
import results  # bench/ holds scripts, not a package
from system import free_ports

CHUNK = 256 * 1024
UPSTREAM = """
import sys
from aiohttp import web
CHUNK = b"\\0" * (256 * 1024)
async def root(request):
    return web.Response(text="ok")
async def download(request):
    mib = int(request.query.get("mib", "1"))
    resp = web.StreamResponse(headers={"Content-Length": str(mib * 1024 * 1024)})
    await resp.prepare(request)
    for _ in range(mib * 4):
        await resp.write(CHUNK)
    return resp
async def upload(request):
    total = 0
    async for chunk in request.content.iter_any():
        total += len(chunk)
    return web.json_response({"received": total})
app = web.Application(client_max_size=0)
app.router.add_get("/", root)
app.router.add_get("/download", download)
app.router.add_post("/upload", upload)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def sample(pid: int, peaks: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peaks.append(rss_mib(pid))
        await asyncio.sleep(0.05)


async def wait_ok(url: str, seconds: float = 30) -> None:
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"{url} did not answer 200 within {seconds:.0f}s")


async def download(base: str, mib: int) -> float:
    start = time.monotonic()
    received = 0
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as s:
        async with s.get(f"{base}/download?mib={mib}") as r:
            async for chunk in r.content.iter_any():
                received += len(chunk)
    if received != mib * 1024 * 1024:
        raise SystemExit(f"download short: {received} bytes")
    return mib / (time.monotonic() - start)


async def upload(base: str, mib: int) -> float:
    async def body():  # type: ignore[no-untyped-def]
        block = b"\1" * CHUNK
        for _ in range(mib * 4):
            yield block

    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.post(f"{base}/upload", data=body()) as r:
            doc = await r.json()
    if doc.get("received") != mib * 1024 * 1024:
        raise SystemExit(f"upload short: {doc}")
    return mib / (time.monotonic() - start)


async def measure(pid: int, run):  # type: ignore[no-untyped-def]
    peaks: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(pid, peaks, stop))
    try:
        rate = await run
    finally:
        stop.set()
        await sampler
    return rate, max(peaks)


async def main(mib: int) -> None:
    up_port, gw_port, admin_port = free_ports(3)
    tmp = Path(tempfile.mkdtemp(prefix="gw-stream-"))
    (tmp / "upstream.py").write_text(UPSTREAM)
    config = {
        "listen": f"127.0.0.1:{gw_port}",
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "state_dir": str(tmp / "state"),
        "log_level": "warning",
        "access_log": {"enabled": False},
        "services": [
            {
                "name": "stream",
                "route": {"path_prefix": "/"},
                "backend": "static",
                "replica": {"addresses": [f"127.0.0.1:{up_port}"]},
                "probes": [{"type": "http", "path": "/", "interval": "1s", "healthy_threshold": 1}],
                "limits": {"max_body_size": 0},
                "timeouts": {"read": "30s"},
            }
        ],
    }
    (tmp / "gateway.yaml").write_text(json.dumps(config))
    python = interpreter.resolve(Path(sys.executable))  # its data plane built if need be
    gateway = python.gateway
    procs = [
        subprocess.Popen([sys.executable, str(tmp / "upstream.py"), str(up_port)],
                         start_new_session=True),
        subprocess.Popen([str(gateway), "serve", "-c", str(tmp / "gateway.yaml")],
                         start_new_session=True),
    ]  # fmt: skip
    try:
        direct, through = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
        await wait_ok(direct + "/")
        await wait_ok(through + "/")
        gw = procs[1].pid
        idle = rss_mib(gw)
        d_down = await download(direct, mib)
        d_up = await upload(direct, mib)
        g_down, peak_down = await measure(gw, download(through, mib))
        g_up, peak_up = await measure(gw, upload(through, mib))
        rows = [
            ("download", d_down, g_down, peak_down),
            ("upload", d_up, g_up, peak_up),
        ]
        lines = [
            f"## Streaming {mib} MiB each way (`.venv/bin/python bench/streaming.py`)",
            "",
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, aiohttp upstream, one "
            f"transfer at a time; {python.plane}; the gateway's idle RSS {idle:.1f} MiB, "
            "sampled every 50 ms.",
            "",
            "| direction | direct MiB/s | gateway MiB/s | ratio | peak RSS MiB | growth MiB |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, direct_rate, gw_rate, peak in rows:
            lines.append(
                f"| {name} | {direct_rate:,.0f} | {gw_rate:,.0f} | {gw_rate / direct_rate:.2f} "
                f"| {peak:.1f} | {peak - idle:+.1f} |"
            )
        print("\n".join(lines))
        results.write_section("streaming", "\n".join(lines))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    asyncio.run(main(parser.parse_args().mib))
