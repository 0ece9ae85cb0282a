"""Autoscaling under a stepped load: replicas and latency over time, as a table.

    .venv/bin/python bench/autoscale.py [--step S] [--target T] [--results yes|no]
    .venv/bin/python bench/autoscale.py --metric queue [--batch B] [--target T]

Starts the real gateway as a process of its own (``python -m controller.main serve``: the
process backend, loopback listeners, a temporary state directory, an admin token), applies
one autoscaled service of ``bench/replica_app.py`` replicas (``replicas: 0..8``, concurrency
target ``--target``, short windows so a run takes a minute and a half; each replica takes
``STARTUP_DELAY`` 0.5 s to bind) and runs closed-loop clients, each sending ``GET
/slow?s=0.2`` (a 200 ms answer, as a model call would be) one after the other, stepped:
0 (the service at zero), 1, 4, 12, 24, 8, then 0 clients, ``--step`` seconds each, then
waits for it to be back at zero.

``--metric queue``: the replicas run at most ``--batch`` requests at once (``BATCH``), the
rest wait, and say both counts in vLLM's names at ``/metrics``, which the gateway scrapes
(``load_metrics``, every 0.2 s); the service scales on the requests waiting per replica,
target ``--target``; the table goes to the ``autoscale-queue`` section.

Every second it reads the service from the admin API (desired and ready replicas, requests
held, the autoscaler's last decision) and tallies the requests that ended in that second
(count, failures, p50 and p99 latency). The table (one row per 2 s) goes to stdout and, with
``--results yes`` (the default), to the ``autoscale`` section of ``bench/RESULTS.md``.
Bounded: every wait has a deadline; the gateway is stopped with SIGTERM (it stops its
replicas, ``replicas_on_exit: stop``), then SIGKILL of its process group if it lingers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import RESULTS, publish  # noqa: E402

STEPS = (0, 1, 4, 12, 24, 8, 0)
"""Concurrent clients, one step each."""
REQUEST = "/slow?s=0.2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Second:
    """What happened in one second of the run."""

    at: int
    clients: int = 0
    desired: int = 0
    ready: int = 0
    held: int = 0
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    decision: str = ""
    polled: bool = False


class Bench:
    def __init__(self, step: float, target: float, metric: str = "concurrency", batch: int = 2):
        self.step = step
        self.target = target
        self.metric = metric
        self.batch = batch
        self.dir = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
        self.port = free_port()
        self.admin_port = free_port()
        self.token = secrets.token_urlsafe(24)
        self.process: asyncio.subprocess.Process | None = None
        self.session: aiohttp.ClientSession | None = None
        self.start = 0.0
        self.seconds: dict[int, Second] = {}
        self.clients = 0
        self.decisions: list[tuple[float, str]] = []

    def second(self, at: float | None = None) -> Second:
        n = int((time.monotonic() if at is None else at) - self.start)
        if n not in self.seconds:
            self.seconds[n] = Second(n)
        return self.seconds[n]

    # -- the gateway ------------------------------------------------------------------------

    async def start_gateway(self) -> None:
        config = {
            "listen": f"127.0.0.1:{self.port}",
            "admin": {"listen": f"127.0.0.1:{self.admin_port}", "token_env": "BENCH_TOKEN"},
            "state_dir": str(self.dir / "state"),
            "backends": {"process": {"capacity": 10}},
            "access_log": {"enabled": False},
            "replicas_on_exit": "stop",
            "log_level": "warning",
        }
        path = self.dir / "gateway.json"
        path.write_text(json.dumps(config))
        env = {**os.environ, "BENCH_TOKEN": self.token, "PYTHONPATH": str(ROOT)}
        with open(self.dir / "gateway.log", "wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "controller.main",
                "serve",
                "-c",
                str(path),
                cwd=ROOT,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=aiohttp.ClientTimeout(total=10),
        )
        await self.until(self.admin_ready, 20, "the gateway's admin API")

    async def admin_ready(self) -> bool:
        assert self.session is not None
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with self.session.get(f"http://127.0.0.1:{self.admin_port}/readyz") as r:
                return r.status == 200
        return False

    async def apply(self) -> None:
        assert self.session is not None
        spec: dict[str, Any] = {
            "name": "web",
            "route": {"path_prefix": "/"},
            "replicas": "0..8",
            "scaling": {
                "metric": self.metric,
                "target": self.target,
                "window": "10s",
                "scale_up_delay": "2s",
                "scale_down_delay": "10s",
            },
            "replica": {
                "commands": [f"{sys.executable} {ROOT / 'bench' / 'replica_app.py'}"],
                "env": {"STARTUP_DELAY": "0.5"},
            },
            "probes": [{"type": "http", "path": "/healthz", "interval": 0.1, "timeout": 1}],
            "rollout": {"drain_timeout": 10, "stop_grace": 2},
        }
        if self.metric == "queue":
            spec["load_metrics"] = {"format": "vllm", "interval": 0.2, "max_age": 1}
            spec["replica"]["env"]["BATCH"] = str(self.batch)
        url = f"http://127.0.0.1:{self.admin_port}/api/services/web"
        async with self.session.put(url, json=spec) as response:
            assert response.status == 200, await response.text()

    async def view(self) -> dict[str, Any]:
        assert self.session is not None
        url = f"http://127.0.0.1:{self.admin_port}/api/services/web"
        async with self.session.get(url) as response:
            data: dict[str, Any] = await response.json()
            return data

    async def stop_gateway(self) -> None:
        if self.session is not None:
            await self.session.close()
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def until(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not await check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
            await asyncio.sleep(0.2)

    # -- the run ------------------------------------------------------------------------------

    async def at_zero(self) -> bool:
        view = await self.view()
        return view["desired"] == 0 and not [r for r in view["replicas"] if r["state"] in (
            "requested", "starting", "ready", "unhealthy", "draining", "stopping")]  # fmt: skip

    async def poll(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, KeyError):
                view = await self.view()
                s = self.second()
                s.clients = max(s.clients, self.clients)
                s.polled = True
                s.desired = view["desired"]
                s.ready = view["ready"]
                scaling = view.get("autoscaling") or {}
                s.held = max(s.held, scaling.get("held", 0))
                decision = scaling.get("decision") or ""
                if decision and (not self.decisions or self.decisions[-1][1] != decision):
                    self.decisions.append((time.monotonic() - self.start, decision))
                    s.decision = decision
            await asyncio.sleep(1.0)

    async def client(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        url = f"http://127.0.0.1:{self.port}{REQUEST}"
        while not stop.is_set():
            began = time.monotonic()
            failed = False
            try:
                async with http.get(url) as response:
                    await response.read()
                    failed = response.status != 200
            except (aiohttp.ClientError, OSError, TimeoutError):
                failed = True
            ended = time.monotonic()
            s = self.second(ended)
            s.latencies.append(ended - began)
            s.failed += failed

    async def run(self) -> str:
        await self.start_gateway()
        try:
            await self.apply()
            await self.until(self.at_zero, 60, "the service at zero (idle after it began)")
            self.start = time.monotonic()
            poller = asyncio.create_task(self.poll())
            timeout = aiohttp.ClientTimeout(total=60)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
                running: list[tuple[asyncio.Task[None], asyncio.Event]] = []
                for clients in STEPS:
                    while len(running) < clients:
                        stop = asyncio.Event()
                        running.append((asyncio.create_task(self.client(http, stop)), stop))
                    while len(running) > clients:
                        task, stop = running.pop()
                        stop.set()
                        await task
                    self.clients = clients
                    await asyncio.sleep(self.step)
                for task, stop in running:
                    stop.set()
                    await task
            await self.until(self.at_zero, 60, "the service back at zero")
            await asyncio.sleep(1.0)
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        finally:
            await self.stop_gateway()
        return self.report()

    def report(self) -> str:
        head = "| t (s) | clients | desired | ready | held | requests | failed | p50 ms | p99 ms |"
        rows = [head, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        last = max(self.seconds)
        total = failed = 0
        for start in range(0, last + 1, 2):
            group = [self.seconds[n] for n in (start, start + 1) if n in self.seconds]
            if not group:
                continue
            polled = [s for s in group if s.polled] or group
            latencies = sorted(x for s in group for x in s.latencies)
            total += len(latencies)
            failed += sum(s.failed for s in group)
            p50 = f"{statistics.median(latencies) * 1000:.0f}" if latencies else "-"
            p99 = f"{latencies[int(0.99 * (len(latencies) - 1))] * 1000:.0f}" if latencies else "-"
            rows.append(
                f"| {start} | {max(s.clients for s in group)} | {polled[-1].desired} | "
                f"{polled[-1].ready} | {max(s.held for s in group)} | {len(latencies)} | "
                f"{sum(s.failed for s in group)} | {p50} | {p99} |"
            )
        decisions = "\n".join(f"- {at:5.1f} s: {why}" for at, why in self.decisions)
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        command, replicas, metric = "", "", "concurrency"
        if self.metric == "queue":
            command = f" --metric queue --batch {self.batch} --target {self.target:g}"
            replicas = f", {self.batch} requests running at most, the rest waiting"
            metric = "queue (waiting requests per replica, scraped every 0.2 s)"
        return "\n".join(
            [
                f"## Autoscaling: a stepped load (`.venv/bin/python bench/autoscale.py{command}`)",
                "",
                f"{time.strftime('%Y-%m-%d', time.gmtime())}, {machine}. One service of "
                f"`bench/replica_app.py` replicas (0.5 s to bind{replicas}), `replicas: 0..8`, "
                f"{metric} target {self.target:g}, window 10 s, scale_up_delay 2 s, "
                "scale_down_delay "
                f"10 s; closed-loop clients sending `GET {REQUEST}`, {self.step:g} s per step "
                f"({', '.join(map(str, STEPS))} clients). Requests are counted in the 2 s in "
                "which they ended; desired and ready as read at the end of the 2 s, held at "
                f"the most. {total} requests, {failed} failed.",
                "",
                *rows,
                "",
                "The autoscaler's decisions (as the service view gave them):",
                "",
                decisions or "- none",
            ]
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=float, default=10.0, help="seconds per load step")
    parser.add_argument("--target", type=float, default=2.0, help="concurrency per replica")
    parser.add_argument("--metric", choices=("concurrency", "queue"), default="concurrency")
    parser.add_argument("--batch", type=int, default=2, help="queue: requests a replica runs")
    parser.add_argument("--results", choices=("yes", "no"), default="yes")
    args = parser.parse_args()
    text = asyncio.run(Bench(args.step, args.target, args.metric, args.batch).run())
    if args.results == "yes":
        section = "autoscale" if args.metric == "concurrency" else "autoscale-queue"
        publish(section, text, RESULTS)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
