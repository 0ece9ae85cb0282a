"""The replica of the zero-downtime harness: a small aiohttp server that says who answered.

    PORT=9000 REVISION=1 REPLICA_ID=web-1-abc .venv/bin/python bench/replica_app.py

Every answer carries ``X-Revision`` (the revision number the backend passes as ``REVISION``),
``X-Replica`` (``REPLICA_ID``) and ``X-Version`` (``VERSION``, what makes one revision's
template differ from the next), and every body names the revision too:

- ``GET /``: ``rev <revision> <replica>`` and a newline;
- ``GET /slow?s=N``: the same after holding the request open for N seconds;
- ``GET /sse?n=N&interval=S``: N server-sent events ``id: i`` / ``data: <revision> <i>``, one
  every S seconds, then ``event: end`` / ``data: N``;
- ``POST /upload``: consumes the body as it arrives; ``{"length", "sha256", "revision", ...}``;
- ``GET /ws``: a WebSocket that first sends ``{"revision", "replica"}`` (JSON), then echoes each
  message as it is;
- ``GET /healthz``: ``ok`` (the probe path; 500 with ``FAIL_PROBE``);
- ``GET /metrics``: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` of
  ``/slow`` (as a model server's, for ``load_metrics``).

Behaviour from the environment (all optional):

- ``STARTUP_DELAY``: seconds before the port is bound (a slow start-up);
- ``CRASH_AFTER``: ``0`` exits at once with code 3 (before binding); N > 0 exits abruptly
  (``os._exit(1)``, in-flight connections die with the process) N seconds after binding, its
  last line saying when (``at`` a Unix time, which the exit's reason in the journal repeats);
- ``FAIL_PROBE``: non-empty: the probe path answers 500 (it runs, but never becomes ready);
- ``BATCH``: at most this many ``/slow`` requests run at once, the rest wait their turn (a
  model server's batch and queue);
- ``PIDDIR``: a directory where ``<REPLICA_ID>.pid`` is written at start, so the harness can
  find (and, at the end, clean up) every replica it caused to be started.

SIGTERM and SIGINT stop it gracefully (in-flight requests get up to 5 s).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import WSMsgType, web

REVISION = os.environ.get("REVISION", "0")
REPLICA = os.environ.get("REPLICA_ID", f"pid{os.getpid()}")
VERSION = os.environ.get("VERSION", "")
FAIL_PROBE = bool(os.environ.get("FAIL_PROBE"))


def _headers() -> dict[str, str]:
    return {"X-Revision": REVISION, "X-Replica": REPLICA, "X-Version": VERSION}


def _line() -> str:
    return f"rev {REVISION} {REPLICA}\n"


def _number(request: web.Request, name: str, default: float, high: float) -> float:
    try:
        value = float(request.query.get(name, default))
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name}: not a number\n", headers=_headers()) from None
    return min(max(value, 0.0), high)


async def index(request: web.Request) -> web.Response:
    return web.Response(text=_line(), headers=_headers())


class Batch:
    """``/slow`` requests running and waiting, at most ``size`` running (0: no bound)."""

    def __init__(self, size: int) -> None:
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(size) if size > 0 else None

    async def __aenter__(self) -> None:
        if self._slots is not None:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
        self.running += 1

    async def __aexit__(self, *exc: object) -> None:
        self.running -= 1
        if self._slots is not None:
            self._slots.release()


BATCH = Batch(int(os.environ.get("BATCH", "0")))


async def slow(request: web.Request) -> web.Response:
    seconds = _number(request, "s", 1.0, 600.0)
    async with BATCH:
        await asyncio.sleep(seconds)
    return web.Response(text=f"slept {seconds:g} {_line()}", headers=_headers())


async def metrics(request: web.Request) -> web.Response:
    lines = [
        f"vllm:num_requests_running {BATCH.running}",
        f"vllm:num_requests_waiting {BATCH.waiting}",
        "vllm:kv_cache_usage_perc 0",
    ]
    return web.Response(text="\n".join(lines) + "\n")


async def sse(request: web.Request) -> web.StreamResponse:
    count = int(_number(request, "n", 10, 100_000))
    interval = _number(request, "interval", 0.1, 60.0)
    response = web.StreamResponse(
        headers={**_headers(), "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for i in range(count):
        await response.write(f"id: {i}\ndata: {REVISION} {i}\n\n".encode())
        await asyncio.sleep(interval)
    await response.write(f"event: end\ndata: {count}\n\n".encode())
    await response.write_eof()
    return response


async def upload(request: web.Request) -> web.Response:
    digest = hashlib.sha256()
    length = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        digest.update(chunk)
        length += len(chunk)
    body = {
        "length": length,
        "sha256": digest.hexdigest(),
        "revision": int(REVISION),
        "replica": REPLICA,
    }
    return web.json_response(body, headers=_headers())


async def websocket(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    ws.headers.update(_headers())
    await ws.prepare(request)
    await ws.send_str(json.dumps({"revision": int(REVISION), "replica": REPLICA}))
    async for msg in ws:
        if msg.type is WSMsgType.TEXT:
            await ws.send_str(msg.data)
        elif msg.type is WSMsgType.BINARY:
            await ws.send_bytes(msg.data)
    return ws


async def healthz(request: web.Request) -> web.Response:
    if FAIL_PROBE:
        return web.Response(status=500, text="failing on purpose\n", headers=_headers())
    return web.Response(text="ok\n", headers=_headers())


def build_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/", index)
    app.router.add_get("/slow", slow)
    app.router.add_get("/sse", sse)
    app.router.add_post("/upload", upload)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


def _crash() -> None:
    # The moment, for the harness: a backend may hear of the exit later (a container's).
    at = time.time()
    print(
        f"replica {REPLICA}: crashing on purpose (CRASH_AFTER) at {at:.3f}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


async def main() -> None:
    piddir = os.environ.get("PIDDIR")
    if piddir:
        Path(piddir, f"{REPLICA}.pid").write_text(str(os.getpid()))
    crash_after = float(os.environ.get("CRASH_AFTER", "-1"))
    if crash_after == 0:
        print(f"replica {REPLICA}: exiting at once (CRASH_AFTER=0)", file=sys.stderr, flush=True)
        sys.exit(3)
    await asyncio.sleep(float(os.environ.get("STARTUP_DELAY", "0")))
    host = os.environ.get("HOST", "127.0.0.1")
    port = int(os.environ["PORT"])
    runner = web.AppRunner(build_app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if crash_after > 0:
        loop.call_later(crash_after, _crash)
    print(f"replica {REPLICA} (revision {REVISION}) serving on {host}:{port}", flush=True)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
