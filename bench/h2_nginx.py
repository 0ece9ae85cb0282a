"""HTTP/2 and gRPC against nginx (``bench/run.py --h2``): CPU per request of each proxy, in
one run, with the HTTP/1.1 figure of the same processes beside it.

Three targets start as ``run.py`` starts its own: the upstream (nginx, 1 worker, the load
core) with a grpcio replica (``tests/e2e/grpc_replica.py``, the load core) beside it, and,
each pinned to the proxy core, nginx (1 worker; an HTTP/1.1 listener, an h2c listener,
``http2`` on ``listen`` before 1.25.1 and ``http2 on`` after, and ``grpc_pass`` with
keepalive for ``/test.Echo/``) and the gateway (1 process, the config users get: a second
service for ``/test.Echo/`` with ``upstream_protocol: http2`` and a TCP probe). The same
upstream and the same replica behind both; access logs as ``--access-log`` says.

Each repetition, the order alternating, for each proxy:

- ``h2`` : ``h2load -c8 -m8 -t1`` (64 streams over 8 connections, h2c with prior
  knowledge) on ``/`` (13 bytes) for ``--duration`` seconds;
- ``grpc``: a grpcio client (its own process, ``--grpc-threads`` threads on one channel,
  each one unary call of 64 bytes at a time, ``test.Echo/Unary``) for as long;
- ``http1``: ``wrk -t1 -c64`` on ``/``, as ``run.py``'s c64 load.

For each, the proxy's CPU (user+sys of its process tree, from ``/proc``) over the requests or
calls answered. grpcio's client is the bottleneck of the ``grpc`` load: its rate is no
measure of a proxy's, the CPU per call is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpc_unary import client
from interpreter import Interpreter
from results import figure as _f
from results import median as _median
from system import Failure, Procs, cpu_seconds, free_ports, process_tree, wait_serving
from targets import Limits, Target, gateway_config, start_upstream, wrk

REPO = Path(__file__).resolve().parent.parent
REPLICA = REPO / "tests" / "e2e" / "grpc_replica.py"
GRPC_PREFIX = "/test.Echo/"
TARGET = 2.0
"""The first target (issue 55): the gateway's CPU per request at most this times nginx's."""
STREAMS = (8, 8)
"""h2load's connections and streams in flight on each (``-c8 -m8``)."""

NGINX_H2 = """\
worker_processes 1;
worker_rlimit_nofile {nofile};
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx.error.log warn;
events {{ worker_connections {max_connections}; }}
http {{
    access_log {access_log};
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    keepalive_requests 100000000;
    keepalive_timeout 75s;
    upstream up {{
        server 127.0.0.1:{upstream};
        keepalive 64;
        keepalive_requests 100000000;
    }}
    upstream grpc_up {{
        server 127.0.0.1:{replica};
        keepalive 16;
        keepalive_requests 100000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        listen 127.0.0.1:{h2_port}{listen_http2} backlog=4096;
{http2_on}
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffer_size 64k;
            proxy_buffers 16 64k;
            proxy_busy_buffers_size 128k;
            proxy_max_temp_file_size 0;
        }}
        location {grpc_prefix} {{
            grpc_pass grpc://grpc_up;
        }}
    }}
}}
"""


def nginx_version() -> tuple[int, ...]:
    out = subprocess.run(["nginx", "-v"], capture_output=True, text=True)
    found = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", out.stderr + out.stdout)
    if found is None:
        raise Failure(f"cannot read nginx's version: {out.stderr.strip()}")
    return tuple(int(n) for n in found.groups())


def start_nginx_h2(
    procs: Procs, ports: tuple[int, int], upstream: int, replica: int, cpu: int, lim: Limits
) -> Target:
    """nginx on ``ports`` (HTTP/1.1, h2c): ``/`` to ``upstream``, gRPC to ``replica``.
    Before 1.25.1 ``http2`` is a parameter of ``listen``; after, a directive."""
    port, h2_port = ports
    modern = nginx_version() >= (1, 25, 1)
    conf = procs.tmp / "nginx.conf"
    conf.write_text(
        NGINX_H2.format(
            tmp=procs.tmp, port=port, h2_port=h2_port, upstream=upstream, replica=replica,
            access_log=f"{procs.tmp}/nginx.access.log" if lim.access_log else "off",
            max_connections=lim.max_connections, nofile=lim.nofile, grpc_prefix=GRPC_PREFIX,
            listen_http2="" if modern else " http2",
            http2_on="" if not modern else "        http2 on;",
        )
    )  # fmt: skip
    argv = ["nginx", "-e", str(procs.tmp / "nginx.error.log"), "-p", str(procs.tmp)]
    proc = procs.start("nginx", [*argv, "-c", str(conf)], cpu)
    return Target("nginx", port, proc, "nginx")


def start_gateway_h2(
    procs: Procs,
    python: Interpreter,
    ports: tuple[int, int],
    upstream: int,
    replica: int,
    cpu: int,
    lim: Limits,
) -> Target:
    """The gateway as users run it, with a second service: gRPC over h2c to ``replica``."""
    port, admin = ports
    token = procs.tmp / "admin-token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    config = gateway_config(procs.tmp, "gateway", port, admin, upstream, lim)
    config["services"].append({
        "name": "grpc",
        "route": {"path_prefix": GRPC_PREFIX},
        "backend": "static",
        "replica": {"addresses": [f"127.0.0.1:{replica}"]},
        "upstream_protocol": "http2",
        "probes": [{"type": "tcp", "interval": "1s", "healthy_threshold": 1}],
    })  # fmt: skip
    conf = procs.tmp / "gateway.yaml"  # JSON is YAML
    conf.write_text(json.dumps(config))
    env = {"GATEWAY_NATIVE": "1" if python.compiled else "0"}
    proc = procs.start("gateway", [str(python.gateway), "serve", "-c", str(conf)], cpu, env=env)
    return Target("gateway", port, proc, "gateway", python, python.compiled)


@dataclass
class Proxy:
    target: Target
    h2_port: int


def start(
    procs: Procs, args: argparse.Namespace, python: Interpreter, lim: Limits
) -> dict[str, Proxy]:
    """The upstream, the gRPC replica, nginx and the gateway, each serving (the gateway: both
    services' probes passed)."""
    up, replica, ngx, ngx_h2, gw, admin = free_ports(6)
    upstream = start_upstream(procs, up, args.load_cpu, lim)
    wait_serving(upstream.proc, upstream.url())
    procs.start("grpc-replica", [sys.executable, str(REPLICA), str(replica)], args.load_cpu)
    nginx = start_nginx_h2(procs, (ngx, ngx_h2), up, replica, args.proxy_cpu, lim)
    gateway = start_gateway_h2(procs, python, (gw, admin), up, replica, args.proxy_cpu, lim)
    proxies = {"nginx": Proxy(nginx, ngx_h2), "gateway": Proxy(gateway, gw)}
    for proxy in proxies.values():
        wait_serving(proxy.target.proc, proxy.target.url())
        grpc_ready(proxy.h2_port)
    return proxies


# ---------------------------------------------------------------------------------------------
# the loads


@dataclass(frozen=True)
class H2Run:
    """One load on one proxy: what it completed and the proxy's CPU meanwhile."""

    done: int
    seconds: float
    failed: int
    cpu_us: float | None
    """The proxy's user+sys CPU per completed request or call, in microseconds."""
    mean_ms: float | None = None

    @property
    def rate(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0


def parse_h2load(text: str) -> tuple[int, float, int, float | None]:
    """(requests succeeded, seconds, requests not succeeded, mean ms) of h2load's summary."""
    finished = re.search(r"finished in ([\d.]+)(ms|s),", text)
    counts = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded", text)
    if finished is None or counts is None:
        raise Failure(f"cannot read h2load's output:\n{text}")
    seconds = float(finished[1]) / (1e3 if finished[2] == "ms" else 1)
    total, succeeded = int(counts[1]), int(counts[4])
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", text)
    mean_ms = None
    if mean is not None:
        mean_ms = float(mean[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean[2]]
    return succeeded, seconds, total - succeeded, mean_ms


def measured(procs: Procs, proxy: Proxy, name: str, argv: list[str], cpu: int, wait: float) -> str:
    """Run ``argv`` (pinned to ``cpu``) to its end; its output, and the proxy's CPU seconds
    meanwhile appended as a last line ``cpu <s>``."""
    pids = process_tree(proxy.target.proc.pid)
    before = cpu_seconds(pids)
    proc = procs.start(f"{name}-{proxy.target.name}", argv, cpu)
    try:
        proc.popen.wait(wait)
    except subprocess.TimeoutExpired:
        raise Failure(f"{name} did not finish within {wait:g} s") from None
    finally:
        procs.finish(proc)
    used = cpu_seconds(pids) - before
    text = proc.log.read_text()
    if proc.popen.returncode != 0:
        raise Failure(f"{name} exited with {proc.popen.returncode}:\n{text}")
    return f"{text}\ncpu {used}"


def _used(text: str) -> float:
    return float(text.rsplit("\ncpu ", 1)[1])


def h2load(procs: Procs, proxy: Proxy, seconds: int, cpu: int) -> H2Run:
    conns, streams = STREAMS
    url = f"http://127.0.0.1:{proxy.h2_port}/"
    argv = ["h2load", f"-c{conns}", f"-m{streams}", "-t1", f"-D{seconds}", url]
    text = measured(procs, proxy, "h2load", argv, cpu, seconds + 30)
    done, took, failed, mean_ms = parse_h2load(text)
    return H2Run(done, took, failed, _used(text) / done * 1e6 if done else None, mean_ms)


def grpc_calls(procs: Procs, proxy: Proxy, seconds: int, threads: int, cpu: int) -> H2Run:
    argv = [sys.executable, __file__, "--client", str(proxy.h2_port), f"--seconds={seconds}",
            f"--threads={threads}"]  # fmt: skip
    text = measured(procs, proxy, "grpc", argv, cpu, seconds + 60)
    calls, took, failed = text.split("\n", 1)[0].split()
    done, seconds = int(calls), float(took)
    if not done:
        return H2Run(0, seconds, int(failed), None)
    return H2Run(
        done, seconds, int(failed), _used(text) / done * 1e6, seconds * threads / done * 1e3
    )


def http1(procs: Procs, proxy: Proxy, seconds: int, cpu: int) -> H2Run:
    run = wrk(procs, proxy.target, "/", 64, seconds, cpu)
    return H2Run(run.requests, run.seconds, run.errors, run.cpu_us, run.p50_ms)


def grpc_ready(port: int, deadline: float = 30.0) -> None:
    """Until a unary call through ``port`` succeeds (the gateway: its probe passed)."""
    import grpc

    end = time.monotonic() + deadline
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(f"{GRPC_PREFIX}Unary")
        while True:
            try:
                unary(b"ready", timeout=2)
                return
            except grpc.RpcError as e:
                if time.monotonic() > end:
                    raise Failure(f"no gRPC call through port {port} succeeded: {e}") from None
                time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# the run and its report

LOADS = ("h2", "grpc", "http1")


@dataclass
class H2Figures:
    """Per proxy, per load, the runs of each repetition."""

    runs: dict[str, dict[str, list[H2Run]]] = field(default_factory=dict)

    def add(self, proxy: str, load: str, run: H2Run) -> None:
        self.runs.setdefault(proxy, {}).setdefault(load, []).append(run)

    def of(self, proxy: str, load: str) -> list[H2Run]:
        return self.runs.get(proxy, {}).get(load, [])


def measure(procs: Procs, args: argparse.Namespace, proxies: dict[str, Proxy]) -> H2Figures:
    figures = H2Figures()
    order = list(proxies)
    for proxy in proxies.values():  # warm-up, not counted
        h2load(procs, proxy, args.warmup, args.load_cpu)
        http1(procs, proxy, args.warmup, args.load_cpu)
    for rep in range(args.repeat):
        for name in order if rep % 2 == 0 else order[::-1]:
            proxy = proxies[name]
            runs = {
                "h2": h2load(procs, proxy, args.duration, args.load_cpu),
                "grpc": grpc_calls(procs, proxy, args.duration, args.grpc_threads, args.load_cpu),
                "http1": http1(procs, proxy, args.duration, args.load_cpu),
            }
            for load, run in runs.items():
                figures.add(name, load, run)
                print(f"bench: h2 rep {rep + 1} {name:8} {load:5} {run.rate:>9,.0f}/s "
                      f"CPU {run.cpu_us or 0:6.1f} us  failed {run.failed}",
                      file=sys.stderr)  # fmt: skip
    return figures


HEADS = {
    "h2": "h2load -c8 -m8 (h2c, 64 streams)",
    "grpc": "gRPC unary (grpcio client)",
    "http1": "HTTP/1.1 wrk -c64",
}


def report(args: argparse.Namespace, figures: H2Figures, head: list[str]) -> str:
    rows = []
    for name in ("nginx", "gateway"):
        for load in LOADS:
            runs = figures.of(name, load)
            if not runs:
                continue
            rows.append(
                f"| {name} | {HEADS[load]} | {_f(_median([r.rate for r in runs]))} "
                f"| {_f(_median([r.mean_ms for r in runs]), 2)} "
                f"| {_f(_median([r.cpu_us for r in runs]), 1)} | {sum(r.failed for r in runs)} |"
            )
    ratios, verdicts = [], []
    for load in LOADS:
        pairs = zip(figures.of("gateway", load), figures.of("nginx", load), strict=False)
        each = [g.cpu_us / n.cpu_us for g, n in pairs if g.cpu_us and n.cpu_us]
        if each:
            text = ", ".join(f"{r:.2f}" for r in each)
            median = statistics.median(each)
            ratios.append(f"| {HEADS[load]} | {text} | **{median:.2f}** |")
            if load != "http1":
                met = "met" if median <= TARGET else "not met"
                verdicts.append(f"{HEADS[load]} {median:.2f}x nginx, {met}")
    return "\n".join([
        "## HTTP/2 and gRPC against nginx: CPU per request (bench/run.py --h2)",
        "",
        *head,
        "",
        f"Loads, each {args.duration} s, on each proxy in turn (the order alternating each "
        f"repetition): `h2load -c8 -m8 -t1` on `/` (13 bytes, h2c with prior knowledge); a "
        f"grpcio client, {args.grpc_threads} threads on one channel, unary calls of 64 bytes "
        "(`test.Echo/Unary` of `tests/e2e/grpc_replica.py`; nginx: `grpc_pass` with upstream "
        "keepalive; the gateway: a service with `upstream_protocol: http2`); `wrk -t1 -c64` "
        "on `/` over HTTP/1.1, as the head's c64. CPU: the proxy's user+sys over the "
        "requests or calls answered. Rate: per second; latency: h2load's mean, the gRPC "
        "client's mean, wrk's p50. Medians of the repetitions.",
        "",
        "| proxy | load | rate | latency (ms) | CPU us/request | failed |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "gateway/nginx CPU per request, per repetition (paired):",
        "",
        "| load | per repetition | median |",
        "| --- | --- | ---: |",
        *ratios,
        "",
        f"Issue 55's first target is {TARGET:g}x nginx's CPU per request (its goal, nginx's "
        f"cost): {'; '.join(verdicts) or 'no figures'}.",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """The gRPC client process (``--client``); the bench itself is ``run.py --h2``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--client", type=int, required=True)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args(argv)
    print(client(args.client, args.seconds, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
