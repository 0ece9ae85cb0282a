"""Server-sent events as LLM clients see them: the latency each event gains through a proxy.

    .venv/bin/python bench/run.py --sse --duration 8 --repeat 3

Run by ``run.py --sse`` (``measure`` and ``report`` here; ``python bench/sse.py upstream
PORT`` and ``python bench/sse.py client ...`` are its two helper processes). It starts:

- an SSE upstream (this file, uvloop, pinned to the load core): ``/sse?interval_ms=I&count=N``
  answers ``text/event-stream``, chunked, and writes one event of about 100 bytes every
  ``I`` ms (each stream on its own schedule, ``loop.call_at`` on a fixed grid, so streams do
  not tick together); ``/flood?seconds=S`` writes events back to back for ``S`` seconds, one
  ``transport.write`` each, pausing when the socket is full. Every event carries
  ``time.monotonic_ns()`` taken just before its write. ``/`` answers ``run.py``'s 13-byte
  body (the gateway's probe);
- nginx as a proxy (1 worker, ``proxy_buffering off``, HTTP/1.1 upstream keepalive, access
  log to a file) and the gateway (1 process, as users run it: ``targets.gateway_config``),
  each pinned to the proxy core;
- per run, the client (this file, uvloop, pinned to the load core): ``--sse-streams`` streams
  at once, or one flood stream. It decodes the chunked framing, splits the events and takes,
  for each, ``monotonic_ns()`` at the read that completed it minus the event's stamp: the
  time from the upstream's write to the client's read (CLOCK_MONOTONIC is one clock for every
  process of the machine).

Per repetition (the order rotating), each target (``direct``, ``nginx``, ``gateway``):
``many``: latency p50/p99/p99.9 and the target's CPU (user+sys of its process tree) per
event; ``one``: one flood stream, events/s. *Added* latency is the target's minus direct's
in the same repetition. Both helpers are Python on the load core, so their own delays are in
direct's figure too and cancel in the added latency. Then, ``at once``: nginx and the gateway
take half the ``many`` streams each at the same time (a client each), and each one's CPU per
event and its events' latency are taken over the same seconds: the machine's other work weighs
on both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from interpreter import Interpreter
from results import figure as _f
from results import median as _med
from system import BODY, Failure, Procs, cpu_split, free_ports, process_tree, wait_serving
from targets import Limits, Target, start_gateway

EVENT_PAD = 64
"""Bytes of padding per event: with the stamp and framing, an event of about 100 bytes."""

NGINX_SSE = """\
worker_processes 1;
worker_rlimit_nofile {nofile};
daemon off;
pid {tmp}/nginx-sse.pid;
error_log {tmp}/nginx-sse.error.log warn;
events {{ worker_connections {max_connections}; }}
http {{
    access_log {tmp}/nginx-sse.access.log;
    client_body_temp_path {tmp}/nginx-sse-body;
    proxy_temp_path {tmp}/nginx-sse-proxy;
    keepalive_requests 100000000;
    upstream up {{
        server 127.0.0.1:{upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


# ---------------------------------------------------------------------------------------------
# the upstream (its own process)


def _event(seq: int) -> bytes:
    payload = b'data: {"seq": %d, "stamp": %d, "token": "%s"}\n\n' % (
        seq, time.monotonic_ns(), b"x" * EVENT_PAD)  # fmt: skip
    return b"%x\r\n%s\r\n" % (len(payload), payload)


_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
_OK = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: text/plain\r\n\r\n%s" % (
    len(BODY), BODY)  # fmt: skip


class Upstream(asyncio.Protocol):
    """One connection: requests one after another (keep-alive), each answered in turn."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.buf = b""
        self.busy = False
        self.paused = False
        self.transport: asyncio.Transport | None = None
        self._flood_end = 0.0
        self._seq = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._flood_end:
            self.loop.call_soon(self._flood)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.busy or b"\r\n\r\n" not in self.buf or self.transport is None:
            return
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        target = head.split(b" ", 2)[1].decode()
        path, _, query = target.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        if path == "/sse":
            self.busy = True
            self._seq = 0
            self.transport.write(_HEAD)
            interval = float(params.get("interval_ms", "5")) / 1e3
            count = int(params.get("count", "100"))
            self._tick(self.loop.time() + interval, interval, count)
        elif path == "/flood":
            self.busy = True
            self._seq = 0
            self.transport.write(_HEAD)
            self._flood_end = self.loop.time() + float(params.get("seconds", "5"))
            self._flood()
        else:
            self.transport.write(_OK)
            self._next()

    def _tick(self, when: float, interval: float, count: int) -> None:
        def fire() -> None:
            if self.transport is None:
                return
            self._seq += 1
            self.transport.write(_event(self._seq))
            if self._seq >= count:
                self._done()
            else:
                self._tick(when + interval, interval, count)

        self.loop.call_at(when, fire)

    def _flood(self) -> None:
        transport = self.transport
        if transport is None or not self._flood_end:
            return
        for _ in range(32):  # then a turn of the loop for the rest
            if self.paused:
                return
            self._seq += 1
            transport.write(_event(self._seq))
        if self.loop.time() >= self._flood_end:
            self._flood_end = 0.0
            self._done()
        else:
            self.loop.call_soon(self._flood)

    def _done(self) -> None:
        if self.transport is not None:
            self.transport.write(b"0\r\n\r\n")
        self.busy = False
        self._next()


async def serve_upstream(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------------------------------
# the client (its own process)


class Stream(asyncio.Protocol):
    """One SSE stream: the head, then chunks, then events; a latency per event."""

    def __init__(self, request: bytes, latencies: list[int], done: asyncio.Future[None]) -> None:
        self.request = request
        self.latencies = latencies
        self.done = done
        self.buf = b""
        self.head = True
        self.events = 0
        self.first = 0
        self.last = 0
        self.data = bytearray()
        """Chunk payloads not yet split into events."""
        self.need = -1
        """Bytes of the current chunk still to come (+2 for its CRLF); -1: a size line next."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"stream closed early: {exc}"))

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        if not self.first:
            self.first = now
        self.last = now
        buf = self.buf + data
        if self.head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            if not buf.startswith(b"HTTP/1.1 200"):
                self.done.set_exception(ConnectionError(buf[:200].decode(errors="replace")))
                return
            self.head, buf = False, buf[end + 4 :]
        pos, n = 0, len(buf)
        while pos < n:
            if self.need < 0:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol], 16)
                pos = eol + 2
                if size == 0:
                    self._events(now)
                    if not self.done.done():
                        self.done.set_result(None)
                    return
                self.need = size + 2
            take = min(self.need, n - pos)
            self.data += buf[pos : pos + take]
            self.need -= take
            pos += take
            if self.need == 0:
                del self.data[-2:]  # the chunk's CRLF
                self.need = -1
        self.buf = buf[pos:]
        self._events(now)

    def _events(self, now: int) -> None:
        data = self.data
        end = data.rfind(b"\n\n")
        if end < 0:
            return
        latencies = self.latencies
        for event in bytes(data[:end]).split(b"\n\n"):
            at = event.find(b'"stamp": ')
            if at >= 0:
                stamp = int(event[at + 9 : event.index(b",", at)])
                latencies.append(now - stamp)
                self.events += 1
        del data[: end + 2]


async def run_client(port: int, streams: int, interval_ms: float, count: int, flood: float) -> dict:
    loop = asyncio.get_running_loop()
    latencies: list[int] = []
    if flood:
        target = f"/flood?seconds={flood:g}"
    else:
        target = f"/sse?interval_ms={interval_ms:g}&count={count}"
    request = f"GET {target} HTTP/1.1\r\nHost: sse.bench\r\nAccept: text/event-stream\r\n\r\n"
    protocols, dones = [], []
    for i in range(streams):
        done: asyncio.Future[None] = loop.create_future()
        _, protocol = await loop.create_connection(
            lambda done=done: Stream(request.encode(), latencies, done), "127.0.0.1", port
        )
        protocols.append(protocol)
        dones.append(done)
        if i % 16 == 15:
            await asyncio.sleep(interval_ms / 1e3 / 4)  # spread the streams' phases
    budget = (flood or count * interval_ms / 1e3) + 30
    results = await asyncio.wait_for(asyncio.gather(*dones, return_exceptions=True), budget)
    errors = [str(r) for r in results if isinstance(r, BaseException)]
    events = sum(p.events for p in protocols)
    spans = [(p.last - p.first) / 1e9 for p in protocols if p.last > p.first]
    latencies.sort()

    def pct(q: float) -> float | None:
        return (
            latencies[min(int(q * len(latencies)), len(latencies) - 1)] / 1e3 if latencies else None
        )

    return {
        "events": events,
        "seconds": max(spans, default=0.0),
        "p50_us": pct(0.5),
        "p99_us": pct(0.99),
        "p999_us": pct(0.999),
        "errors": errors[:3],
        "failed": len(errors),
    }


# ---------------------------------------------------------------------------------------------
# the driver (run.py --sse)


@dataclass
class SseRun:
    events: int
    seconds: float
    p50_us: float | None
    p99_us: float | None
    p999_us: float | None
    cpu_us: float | None
    """The target's CPU per event, microseconds."""
    failed: int
    user_us: float | None = None
    """Of ``cpu_us``, user time (the rest is the kernel's, for the target's system calls)."""

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


@dataclass
class SseFigures:
    many: dict[str, list[SseRun]] = field(default_factory=dict)
    one: dict[str, list[SseRun]] = field(default_factory=dict)
    together: dict[str, list[SseRun]] = field(default_factory=dict)
    """The proxies' ``many`` load served at the same time, half the streams each."""


def start_nginx_sse(procs: Procs, port: int, upstream: int, cpu: int, limits: Limits) -> Target:
    conf = procs.tmp / "nginx-sse.conf"
    conf.write_text(NGINX_SSE.format(tmp=procs.tmp, port=port, upstream=upstream,
                                     max_connections=limits.max_connections,
                                     nofile=limits.nofile))  # fmt: skip
    argv = ["nginx", "-e", str(procs.tmp / "nginx-sse.error.log"), "-p", str(procs.tmp),
            "-c", str(conf)]  # fmt: skip
    return Target("nginx", port, procs.start("nginx-sse", argv, cpu), "nginx")


def client_run(procs: Procs, target: Target, args: argparse.Namespace, flood: bool) -> SseRun:
    return clients_together(procs, [target], args, flood, args.sse_streams)[target.name]


def clients_together(
    procs: Procs, targets: list[Target], args: argparse.Namespace, flood: bool, streams: int
) -> dict[str, SseRun]:
    """A client for each of ``targets``, all started at once (``streams`` streams each, or a
    flood stream): each target's figures, its CPU over the same interval as the others'."""
    argv = [sys.executable, str(Path(__file__).resolve()), "client"]
    if flood:
        argv += ["--streams", "1", "--flood", str(args.duration)]
    else:
        count = int(args.duration * 1000 / args.sse_interval)
        argv += ["--streams", str(streams), "--interval-ms", str(args.sse_interval),
                 "--count", str(count)]  # fmt: skip
    pids = {t.name: process_tree(t.proc.pid) for t in targets}
    before = {name: cpu_split(p) for name, p in pids.items()}
    clients = [
        procs.start(f"sse-client-{t.name}", [*argv, "--port", str(t.port)], args.load_cpu)
        for t in targets
    ]
    try:
        for proc in clients:
            proc.popen.wait(args.duration + 60)
    except subprocess.TimeoutExpired:
        raise Failure(f"the SSE client did not finish:\n{proc.tail()}") from None
    finally:
        for proc in clients:
            procs.finish(proc)
    runs = {}
    for target, proc in zip(targets, clients, strict=True):
        user_after, sys_after = cpu_split(pids[target.name])
        user_before, sys_before = before[target.name]
        user = user_after - user_before
        used = user + sys_after - sys_before
        lines = [line for line in proc.log.read_text().splitlines() if line.startswith("{")]
        if not lines:
            raise Failure(f"the SSE client said nothing:\n{proc.tail()}")
        out = json.loads(lines[-1])
        if out["failed"]:
            raise Failure(f"{target.name}: {out['failed']} streams failed: {out['errors']}")
        events = out["events"]
        runs[target.name] = SseRun(
            events, out["seconds"], out["p50_us"], out["p99_us"], out["p999_us"],
            used / events * 1e6 if events else None, out["failed"],
            user / events * 1e6 if events else None,
        )  # fmt: skip
    return runs


def start(
    procs: Procs, args: argparse.Namespace, python: Interpreter, lim: Limits
) -> dict[str, Target]:
    """The SSE upstream, nginx with ``proxy_buffering off`` and the gateway, serving."""
    up, ngx, gw, admin = free_ports(4)
    argv = [sys.executable, str(Path(__file__).resolve()), "upstream", "--port", str(up)]
    upstream = Target("direct", up, procs.start("sse-upstream", argv, args.load_cpu), "direct")
    wait_serving(upstream.proc, upstream.url())
    targets = {"direct": upstream, "nginx": start_nginx_sse(procs, ngx, up, args.proxy_cpu, lim)}
    targets["gateway"] = start_gateway(procs, "gateway", python, (gw, admin, up),
                                       args.proxy_cpu, lim)  # fmt: skip
    for target in targets.values():
        wait_serving(target.proc, target.url())
    return targets


def measure(procs: Procs, args: argparse.Namespace, targets: dict[str, Target]) -> SseFigures:
    figures = SseFigures()
    order = list(targets)
    for rep in range(args.repeat):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            many = client_run(procs, targets[name], args, flood=False)
            one = client_run(procs, targets[name], args, flood=True)
            figures.many.setdefault(name, []).append(many)
            figures.one.setdefault(name, []).append(one)
            print(f"bench: sse rep {rep + 1} {name:8} {many.events:,} events p50 "
                  f"{many.p50_us or 0:,.0f} us p99 {many.p99_us or 0:,.0f} us CPU "
                  f"{many.cpu_us or 0:.1f} us/event (user {many.user_us or 0:.1f}); "
                  f"one stream {one.rate:,.0f} events/s",
                  file=sys.stderr)  # fmt: skip
        proxies = [targets[name] for name in ("nginx", "gateway") if name in targets]
        if len(proxies) == 2:
            runs = clients_together(procs, proxies, args, False, args.sse_streams // 2)
            for name, run in runs.items():
                figures.together.setdefault(name, []).append(run)
                print(f"bench: sse rep {rep + 1} {name:8} at once: {run.events:,} events "
                      f"CPU {run.cpu_us or 0:.1f} us/event (user {run.user_us or 0:.1f})",
                      file=sys.stderr)  # fmt: skip
    return figures


def _per_rep(a: list[float | None], b: list[float | None]) -> str:
    # A difference at or under 0 (direct slower than a proxy in a busy repetition) has no ratio.
    ratios = [x / y for x, y in zip(a, b, strict=False) if x is not None and y is not None
              and x > 0 and y > 0]  # fmt: skip
    if not ratios:
        return "-"
    return ", ".join(f"{r:.2f}" for r in ratios) + f" (median **{statistics.median(ratios):.2f}**)"


def report(args: argparse.Namespace, figures: SseFigures, head: list[str]) -> str:
    names = list(figures.many)

    def col(
        name: str, attr: str, runs: dict[str, list[SseRun]] | None = None
    ) -> list[float | None]:
        """``attr`` of ``name``'s runs in ``runs`` (the ``many`` runs by default)."""
        return [getattr(r, attr) for r in (figures.many if runs is None else runs).get(name, [])]

    def added(name: str, attr: str) -> list[float | None]:
        return [x - d if x is not None and d is not None else None
                for x, d in zip(col(name, attr), col("direct", attr), strict=False)]  # fmt: skip

    def system(name: str, runs: dict[str, list[SseRun]] | None = None) -> list[float | None]:
        pairs = zip(col(name, "cpu_us", runs), col(name, "user_us", runs), strict=False)
        return [c - u if c is not None and u is not None else None for c, u in pairs]

    def rate(name: str) -> list[float | None]:
        return [r.rate for r in figures.one.get(name, [])]

    rows = []
    for name in names:
        proxy = name != "direct"
        rows.append(
            f"| {name} | {_f(_med(col(name, 'p50_us')))} | {_f(_med(col(name, 'p99_us')))} | "
            f"{_f(_med(col(name, 'p999_us')))} | "
            f"{_f(_med(added(name, 'p50_us'))) if proxy else '-'} | "
            f"{_f(_med(added(name, 'p99_us'))) if proxy else '-'} | "
            f"{_f(_med(col(name, 'cpu_us')), 1) if proxy else '-'} | "
            f"{_f(_med(col(name, 'user_us')), 1) if proxy else '-'} | "
            f"{_f(_med(rate(name)))} |"
        )
    ratio_rows = []
    if "nginx" in names and "gateway" in names:
        for label, a, b in (
            ("added p50", added("gateway", "p50_us"), added("nginx", "p50_us")),
            ("added p99", added("gateway", "p99_us"), added("nginx", "p99_us")),
            ("p99", col("gateway", "p99_us"), col("nginx", "p99_us")),
            ("CPU per event", col("gateway", "cpu_us"), col("nginx", "cpu_us")),
            ("of which user time", col("gateway", "user_us"), col("nginx", "user_us")),
            ("of which system time", system("gateway"), system("nginx")),
            ("one stream, events/s", rate("gateway"), rate("nginx")),
            ("CPU per event, at once", col("gateway", "cpu_us", figures.together),
             col("nginx", "cpu_us", figures.together)),
            ("of which user time, at once", col("gateway", "user_us", figures.together),
             col("nginx", "user_us", figures.together)),
            ("of which system time, at once", system("gateway", figures.together),
             system("nginx", figures.together)),
            ("p50, at once", col("gateway", "p50_us", figures.together),
             col("nginx", "p50_us", figures.together)),
            ("p99, at once", col("gateway", "p99_us", figures.together),
             col("nginx", "p99_us", figures.together)),
        ):  # fmt: skip
            if a:
                ratio_rows.append(f"| gateway/nginx | {label} | {_per_rep(a, b)} |")
        for label, a, b in (
            ("one stream, events/s", rate("gateway"), rate("direct")),
            ("one stream, events/s (nginx)", rate("nginx"), rate("direct")),
        ):
            ratio_rows.append(f"| {'gateway' if 'nginx)' not in label else 'nginx'}/direct | "
                              f"{label.replace(' (nginx)', '')} | {_per_rep(a, b)} |")  # fmt: skip
    count = int(args.duration * 1000 / args.sse_interval)
    return "\n".join([
        "## Server-sent events (bench/run.py --sse)",
        "",
        *head,
        "",
        f"`many`: {args.sse_streams} streams at once, each an event of about 100 bytes every "
        f"{args.sse_interval:g} ms ({count:,} per stream; "
        f"{args.sse_streams * 1000 / args.sse_interval:,.0f} events/s in all). Latency: from "
        "the upstream's write of an event (its stamp) to the client's read that completed it, "
        "in microseconds, over every event of the run; medians over repetitions. Added: "
        "minus direct's in the same repetition. CPU: the proxy's user+sys time per event "
        "(user: of it, the user time; the rest is the kernel's, in the proxy's system "
        "calls). "
        f"`one`: a single stream written back to back for {args.duration} s (one write an "
        "event), events/s at the client. "
        f"`at once`: the `many` load to both proxies at the same time, "
        f"{args.sse_streams // 2} streams each (a client each, both on the load core), each "
        "proxy's CPU over the same seconds, and its events' latency: what the machine's other "
        "work takes, it takes from both, so these ratios move less from one repetition to the "
        "next.",
        "",
        "| target | p50 (us) | p99 (us) | p99.9 (us) | added p50 | added p99 | CPU us/event | "
        "user us/event | one stream events/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "Ratios per repetition (issue 29: at most 1 for latency and CPU, at least 1 for one "
        "stream's rate):",
        "",
        "| pair | figure | per repetition |",
        "| --- | --- | --- |",
        *ratio_rows,
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    import uvloop

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    up = sub.add_parser("upstream")
    up.add_argument("--port", type=int, required=True)
    cl = sub.add_parser("client")
    cl.add_argument("--port", type=int, required=True)
    cl.add_argument("--streams", type=int, default=100)
    cl.add_argument("--interval-ms", type=float, default=5.0)
    cl.add_argument("--count", type=int, default=1000)
    cl.add_argument("--flood", type=float, default=0.0, help="seconds of one flood stream")
    args = p.parse_args(argv)
    if args.role == "upstream":
        uvloop.run(serve_upstream(args.port))
    else:
        out = uvloop.run(run_client(args.port, args.streams, args.interval_ms, args.count,
                                    args.flood))  # fmt: skip
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
