"""Parked connections: what parking idle keep-alive connections saves, and what it costs.

    .venv/bin/python bench/parking.py --repeat 3 [--connections 1000 --every 2 --duration 10]

Starts, as ``run.py`` does, the upstream (nginx) and wrk's client on the load core, and on
the proxy core nginx (1 worker) and two gateways as users run them
(``targets.gateway_config``): ``gateway`` (``park_after`` at its default, 1 s) and
``gateway-unparked`` (``park_after: 0``, connections never parked). Each repetition, the
order rotating, runs on each target:

- **sparse**: ``--connections`` keep-alive connections, each sending ``GET /`` every
  ``--every`` seconds (staggered) for ``--duration`` seconds: with ``--every`` above
  ``park_after``, ``gateway`` parks each connection after its first answer and resumes it
  for the next request (then, back that soon, it waits twice as long before it is parked
  again). The target's CPU time per request.
- **busy**: ``wrk -t1 -c64`` for ``--duration`` seconds: connections never idle, never
  parked. CPU time per request.

Then each target holds ``--idle-connections`` idle keep-alive connections (``idle.idle_step``,
as ``run.py``'s idle step): KiB per connection. Ratios per repetition, of each gateway to
nginx and of ``gateway`` to ``gateway-unparked``. Writes the ``parking`` section of
``--output`` (default ``bench/out/parking.md``, gitignored).

As a script with ``--client``, it is the sparse client: it prints one JSON line when its
connections are open, runs, then prints ``{"requests": n, "failed": n, "late": n}`` (late:
answers that took over a second) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import results
from idle import IdleResult, idle_step, json_lines
from system import (
    Failure,
    Procs,
    cpu_seconds,
    free_ports,
    missing_tool,
    process_tree,
    raise_nofile,
    stop_on_signals,
    wait_serving,
    work_dir,
)
from targets import (
    Limits,
    Target,
    gateway_config,
    native_status,
    start_configured,
    start_nginx,
    start_upstream,
    wrk_cpu,
)

REPO = Path(__file__).resolve().parent.parent
REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: bench-parking\r\n\r\n"


# ---------------------------------------------------------------------------------------------
# the sparse client


async def _answer(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    if head.split(b" ", 2)[1] != b"200":
        raise ValueError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            await reader.readexactly(int(value))
            return
    raise ValueError("no Content-Length")


async def _client(port: int, connections: int, every: float, duration: float) -> None:
    gate = asyncio.Semaphore(128)

    async def open_one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with gate:
            return await asyncio.open_connection("127.0.0.1", port)

    pairs = await asyncio.gather(*(open_one() for _ in range(connections)))
    print(json.dumps({"open": len(pairs)}), flush=True)
    counts = {"requests": 0, "failed": 0, "late": 0}
    loop = asyncio.get_running_loop()
    end = loop.time() + duration

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(random.uniform(0, every))  # staggered
        while loop.time() < end:
            started = loop.time()
            writer.write(REQUEST)
            try:
                async with asyncio.timeout(10):
                    await _answer(reader)
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
                counts["failed"] += 1
                return
            counts["requests"] += 1
            if loop.time() - started > 1:
                counts["late"] += 1
            await asyncio.sleep(every)

    await asyncio.gather(*(one(r, w) for r, w in pairs))
    print(json.dumps(counts), flush=True)
    for _, writer in pairs:
        writer.close()
    await asyncio.sleep(0.2)


def sparse(procs: Procs, target: Target, args: argparse.Namespace) -> float:
    """CPU microseconds of ``target`` per request of the sparse client."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--client", "--port",
            str(target.port), "--connections", str(args.connections), "--every",
            str(args.every), "--duration", str(args.duration)]  # fmt: skip
    client = procs.start(f"sparse-{target.name}", argv, args.load_cpu)
    pids = process_tree(target.proc.pid)
    try:
        end = time.monotonic() + 60
        while not json_lines(client.log):
            if client.popen.poll() is not None or time.monotonic() > end:
                raise Failure(f"sparse client for {target.name}:\n{client.tail()}")
            time.sleep(0.05)
        before = cpu_seconds(pids)
        client.popen.wait(args.duration + 30)
        used = cpu_seconds(pids) - before
    except subprocess.TimeoutExpired:
        raise Failure(f"sparse client for {target.name} did not finish") from None
    finally:
        procs.finish(client)
    counts = json_lines(client.log)[-1]
    if counts.get("failed") or not counts.get("requests"):
        raise Failure(f"{target.name}: sparse client: {counts}")
    return used / counts["requests"] * 1e6


# ---------------------------------------------------------------------------------------------
# the driver


@dataclass
class Figures:
    sparse: dict[str, list[float]] = field(default_factory=dict)
    busy: dict[str, list[float]] = field(default_factory=dict)
    idle: dict[str, IdleResult] = field(default_factory=dict)


def measure(procs: Procs, args: argparse.Namespace, targets: dict[str, Target]) -> Figures:
    figures = Figures()
    names = list(targets)
    for name in names:  # warm-up: every code path run once
        sparse(procs, targets[name], argparse.Namespace(**{**vars(args), "duration": 3}))
        wrk_cpu(procs, targets[name], 2, args.load_cpu)
    for rep in range(args.repeat):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            figures.sparse.setdefault(name, []).append(sparse(procs, targets[name], args))
            _, busy = wrk_cpu(procs, targets[name], args.duration, args.load_cpu)
            figures.busy.setdefault(name, []).append(busy)
            print(
                f"bench: rep {rep + 1} {name:17} sparse {figures.sparse[name][-1]:7.1f} us/req "
                f"busy {busy:6.1f} us/req",
                file=sys.stderr,
            )
    if args.idle_connections:
        for name, target in targets.items():
            figures.idle[name] = idle_step(procs, target, args.idle_connections, args.load_cpu)
    return figures


def _ratios(mine: list[float], base: list[float]) -> str:
    each = [a / b for a, b in zip(mine, base, strict=True)]
    return ", ".join(f"{r:.2f}" for r in each) + f" (median {statistics.median(each):.2f})"


def report(args: argparse.Namespace, figures: Figures, load: tuple[float, ...]) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Parked connections (bench/parking.py)",
        "",
        f"{when}, `bench/parking.py --repeat {args.repeat} --connections {args.connections} "
        f"--every {args.every:g} --duration {args.duration:g} --idle-connections "
        f"{args.idle_connections}`; data plane: {native_status(False)}. Load average at the "
        f"start: {load[0]:.2f}. nginx (1 worker) and the gateways (one process each, access log "
        f"to a file, defaults but `park_after`) on CPU {args.proxy_cpu}; the clients and the "
        f"upstream on CPU {args.load_cpu}. `gateway`: `park_after` 1 s (its default); "
        f"`gateway-unparked`: `park_after: 0`.",
        "",
        f"Sparse: {args.connections:,} keep-alive connections, a `GET /` on each every "
        f"{args.every:g} s: `gateway` parks each after its first answer and resumes it for "
        f"the next request, after which a connection back that soon waits twice as long "
        f"before it is parked again. Busy: `wrk -t1 -c64`. CPU microseconds of the target per "
        f"request:",
        "",
        "| target | sparse, per repetition | busy, per repetition |",
        "| --- | --- | --- |",
    ]
    for name in figures.sparse:
        s = ", ".join(f"{v:.1f}" for v in figures.sparse[name])
        b = ", ".join(f"{v:.1f}" for v in figures.busy[name])
        lines.append(f"| {name} | {s} | {b} |")
    lines += ["", "| ratio | sparse | busy |", "| --- | --- | --- |"]
    pairs = [("gateway", "nginx"), ("gateway-unparked", "nginx"), ("gateway", "gateway-unparked")]
    for mine, base in pairs:
        lines.append(
            f"| {mine}/{base} | {_ratios(figures.sparse[mine], figures.sparse[base])} | "
            f"{_ratios(figures.busy[mine], figures.busy[base])} |"
        )
    if figures.idle:
        lines += [
            "",
            f"Idle keep-alive connections (`idle.py`, {args.idle_connections:,} opened 128 at "
            "a time, each after one `GET /`, RSS read 2 s after the last):",
            "",
            "| target | held | RSS before (MiB) | RSS with (MiB) | KiB/conn | RSS after close |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, r in figures.idle.items():
            kib = f"{r.kib_per_connection:.2f}" if r.kib_per_connection is not None else "-"
            lines.append(
                f"| {name} | {r.connections:,} | {r.rss_before:.1f} | {r.rss_with:.1f} | "
                f"{kib} | {r.rss_after:.1f} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument(
        "--every", type=float, default=2.0, help="seconds between a connection's requests"
    )
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--idle-connections", type=int, default=10_000, help="0 skips")
    p.add_argument("--proxy-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1)
    p.add_argument("--output", type=Path, default=REPO / "bench" / "out" / "parking.md")
    args = p.parse_args(argv)
    if args.connections < 1 or args.every <= 0 or args.duration <= 0 or args.repeat < 1:
        p.error("--connections, --every, --duration and --repeat must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        asyncio.run(_client(args.port, args.connections, args.every, args.duration))
        return 0
    tool = missing_tool()
    if tool is not None:
        print(f"bench: {tool} not found", file=sys.stderr)
        return 2
    stop_on_signals()
    nofile = raise_nofile()
    lim = Limits(max(4096, min(nofile, args.idle_connections + 10_000)), nofile, True)
    load = os.getloadavg()
    tmp = work_dir("parking")
    procs = Procs(tmp)
    token = tmp / "admin-token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    try:
        up, ngx, p1, a1, p2, a2 = free_ports(6)
        upstream = start_upstream(procs, up, args.load_cpu, lim)
        wait_serving(upstream.proc, upstream.url())
        targets = {"nginx": start_nginx(procs, ngx, up, args.proxy_cpu, lim)}
        for name, port, admin, park_after in (
            ("gateway", p1, a1, None),
            ("gateway-unparked", p2, a2, 0),
        ):
            config = gateway_config(tmp, name, port, admin, up, lim)
            if park_after is not None:
                config["proxy"]["limits"]["park_after"] = park_after
            targets[name] = start_configured(procs, name, config, args.proxy_cpu, pure=False)
        wait_serving(targets["nginx"].proc, targets["nginx"].url())
        figures = measure(procs, args, targets)
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all_uninterrupted()
        shutil.rmtree(tmp, ignore_errors=True)
    results.publish("parking", report(args, figures, load), args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
