"""The targets of the benchmark, and wrk against them.

- the upstream: nginx (1 worker) answering ``/`` with a 13-byte body and ``/big`` with a
  10 MiB file (sendfile); measured on its own as ``direct``;
- nginx as a reverse proxy (1 worker, upstream keepalive 64);
- HAProxy (1 thread, ``http-reuse always``);
- the gateway (1 process) as users run it: a generated config with one ``static`` service,
  an http probe, and every other setting at its default (access log, metrics, retries,
  passive outlier detection), except that it accepts enough connections for the idle step.

With a ``Certificate`` (``run.py --tls``), nginx and the gateway also listen with TLS on a
second port, with that certificate and the gateway's TLS settings (``gateway.tls.context``):
TLS 1.2 and 1.3, its TLS 1.2 cipher list in its order, the server's order preferred, session
tickets and (nginx) a shared session cache.

``wrk`` runs one at a time; while it runs, the target's CPU time is read before and after and
its RSS is sampled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from interpreter import Interpreter
from system import (
    Failure,
    Proc,
    Procs,
    RssSampler,
    cpu_seconds,
    free_ports,
    get,
    missing_tool,
    process_tree,
    stop_on_signals,
    wait_serving,
    wakeup_interrupts,
    work_dir,
)

BIG_SIZE = 10 * 1024 * 1024

UPSTREAM_NGINX = """\
worker_processes 1;
worker_rlimit_nofile {nofile};
daemon off;
pid {tmp}/upstream.pid;
error_log {tmp}/upstream.error.log warn;
events {{ worker_connections {max_connections}; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/upstream-body;
    keepalive_requests 100000000;
    keepalive_timeout 75s;
    sendfile on;
    tcp_nopush on;
    server {{
        listen 127.0.0.1:{port} reuseport backlog=4096;
        location = / {{ default_type text/plain; return 200 "Hello, world\\n"; }}
        location = /big {{ root {tmp}/www; default_type application/octet-stream; }}
    }}
}}
"""

PROXY_NGINX = """\
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
    server {{
        listen 127.0.0.1:{port} backlog=4096;
{tls}
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
    }}
}}
"""

# HAProxy reserves two descriptors per connection (client and server side) and, by default,
# refuses to start when the open-file limit is below that; with `http-reuse always` the server
# side is a few shared connections, so `no strict-limits` lets maxconn match the others.
PROXY_HAPROXY = """\
global
    nbthread 1
    maxconn {max_connections}
    no strict-limits
defaults
    mode http
    {log}
    timeout connect 5s
    timeout client 75s
    timeout server 60s
    timeout http-keep-alive 75s
    option http-keep-alive
    option forwardfor
    http-reuse always
frontend fe
    bind 127.0.0.1:{port}
    default_backend be
backend be
    server up 127.0.0.1:{upstream}
"""


NGINX_TLS = """\
        listen 127.0.0.1:{port} ssl backlog=4096;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_ciphers {ciphers};
        ssl_prefer_server_ciphers on;
        ssl_session_cache shared:SSL:10m;
        ssl_session_timeout 1h;
        ssl_session_tickets on;"""

SERVER_NAME = "bench.test"


@dataclass(frozen=True)
class Certificate:
    """A self-signed certificate for ``SERVER_NAME``, served by nginx and the gateway alike."""

    cert: Path
    key: Path
    key_type: str
    """``rsa`` (2048 bits) or ``ecdsa`` (P-256)."""


def make_certificate(tmp: Path, key_type: str) -> Certificate:
    """A certificate made with ``openssl req``, valid for a day."""
    cert, key = tmp / "tls-cert.pem", tmp / "tls-key.pem"
    new_key = ["-newkey", "rsa:2048"] if key_type == "rsa" else [
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]  # fmt: skip
    subprocess.run(
        ["openssl", "req", "-x509", *new_key, "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", f"/CN={SERVER_NAME}",
         "-addext", f"subjectAltName=DNS:{SERVER_NAME}"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    key.chmod(0o600)
    return Certificate(cert, key, key_type)


def gateway_ciphers() -> str:
    """The TLS 1.2 cipher list of the gateway's server contexts, in its order (TLS 1.3's
    suites are OpenSSL's defaults on both sides)."""
    from gateway.tls.context import server_context  # the bench runs from the repository

    names = [c["name"] for c in server_context(tickets=True, alpn=("http/1.1",)).get_ciphers()]
    return ":".join(n for n in names if not n.startswith("TLS_"))


def client_tls() -> ssl.SSLContext:
    """A client context that trusts any certificate: the bench's own checks of TLS ports."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


@dataclass(frozen=True)
class Limits:
    """What every target is configured to accept: enough for the idle connections step."""

    max_connections: int
    nofile: int
    access_log: bool


@dataclass
class Target:
    name: str
    port: int
    proc: Proc
    kind: str = ""
    """``direct``, ``nginx``, ``haproxy`` or ``gateway`` (several gateways may run)."""
    interpreter: Interpreter | None = None
    native: bool = False
    """A gateway running its compiled data plane (``gateway/native.py``)."""
    tls_port: int | None = None
    """Its TLS listener, if it has one (``run.py --tls``)."""

    def url(self, path: str = "/", tls: bool = False) -> str:
        if tls:
            return f"https://127.0.0.1:{self.tls_port}{path}"
        return f"http://127.0.0.1:{self.port}{path}"


def start_upstream(procs: Procs, port: int, cpu: int, limits: Limits) -> Target:
    (procs.tmp / "www").mkdir()
    with (procs.tmp / "www" / "big").open("wb") as f:
        f.write(os.urandom(BIG_SIZE))
    conf = procs.tmp / "upstream.conf"
    conf.write_text(
        UPSTREAM_NGINX.format(
            tmp=procs.tmp, port=port, max_connections=limits.max_connections, nofile=limits.nofile
        )
    )
    argv = ["nginx", "-e", str(procs.tmp / "upstream.error.log"), "-p", str(procs.tmp)]
    proc = procs.start("upstream", [*argv, "-c", str(conf)], cpu)
    return Target("direct", port, proc, "direct")


def start_nginx(
    procs: Procs,
    port: int,
    upstream: int,
    cpu: int,
    limits: Limits,
    tls: tuple[Certificate, int] | None = None,
) -> Target:
    """nginx as a reverse proxy on ``port``; with ``tls`` (a certificate and a port), also
    with TLS on that port."""
    conf = procs.tmp / "nginx.conf"
    log = f"{procs.tmp}/nginx.access.log" if limits.access_log else "off"
    tls_block = ""
    if tls is not None:
        certificate, tls_port = tls
        tls_block = NGINX_TLS.format(
            port=tls_port, cert=certificate.cert, key=certificate.key, ciphers=gateway_ciphers()
        )
    conf.write_text(
        PROXY_NGINX.format(
            tmp=procs.tmp,
            port=port,
            upstream=upstream,
            access_log=log,
            max_connections=limits.max_connections,
            nofile=limits.nofile,
            tls=tls_block,
        )
    )
    argv = ["nginx", "-e", str(procs.tmp / "nginx.error.log"), "-p", str(procs.tmp)]
    proc = procs.start("nginx", [*argv, "-c", str(conf)], cpu)
    return Target("nginx", port, proc, "nginx", tls_port=tls[1] if tls else None)


def start_haproxy(procs: Procs, port: int, upstream: int, cpu: int, limits: Limits) -> Target:
    conf = procs.tmp / "haproxy.cfg"  # its access log goes to stdout, i.e. haproxy.log
    log = "log stdout format raw local0\n    option httplog" if limits.access_log else ""
    conf.write_text(
        PROXY_HAPROXY.format(
            port=port, upstream=upstream, log=log, max_connections=limits.max_connections
        )
    )
    proc = procs.start("haproxy", ["haproxy", "-db", "-f", str(conf)], cpu)
    return Target("haproxy", port, proc, "haproxy")


def gateway_config(
    tmp: Path,
    name: str,
    port: int,
    admin: int,
    upstream: int,
    limits: Limits,
    tls: tuple[Certificate, int] | None = None,
) -> dict:
    """The gateway's config: defaults everywhere but the addresses, the probe's pace and the
    connection limit (raised, as for nginx and HAProxy, for the idle connections step); with
    ``tls``, a TLS listener on its port serving its certificate (TLS settings at their
    defaults: tickets on)."""
    config: dict = {
        "listen": f"127.0.0.1:{port}",
        "admin": {"listen": f"127.0.0.1:{admin}", "token_file": str(tmp / "admin-token")},
        "state_dir": str(tmp / f"{name}-state"),
        "access_log": (
            {"enabled": True, "path": str(tmp / f"{name}.access.log")}
            if limits.access_log
            else {"enabled": False}
        ),
        "proxy": {"limits": {"max_connections": limits.max_connections}},
        "replicas_on_exit": "stop",
        "services": [
            {
                "name": "bench",
                "route": {"path_prefix": "/"},
                "backend": "static",
                "replica": {"addresses": [f"127.0.0.1:{upstream}"]},
                "probes": [
                    {
                        "type": "http",
                        "path": "/",
                        "interval": "1s",
                        "timeout": "1s",
                        "healthy_threshold": 1,
                    }
                ],
            }
        ],
    }
    if tls is not None:
        certificate, tls_port = tls
        config["listen_tls"] = [f"127.0.0.1:{tls_port}"]
        config["tls"] = {
            "certificates": [{"cert_file": str(certificate.cert), "key_file": str(certificate.key)}]
        }
    return config


def start_gateway(
    procs: Procs,
    name: str,
    interpreter: Interpreter,
    ports: tuple[int, int, int],
    cpu: int | None,
    limits: Limits,
    workers: int = 1,
    pure: bool = False,
    tls: tuple[Certificate, int] | None = None,
) -> Target:
    """The gateway ``name`` run by ``interpreter``; ``ports`` are (traffic, admin, upstream);
    ``tls`` (a certificate and a port) adds a TLS listener.

    ``cpu`` None leaves it unpinned; ``workers`` > 1 adds ``--workers N`` (worker processes,
    children of the gateway's process, so ``process_tree`` of its pid covers them). It runs
    the compiled data plane if the interpreter has it (``interpreter.native``), unless
    ``pure``: then the pure Python modules (``GATEWAY_NATIVE=0``)."""
    port, admin, upstream = ports
    conf = procs.tmp / f"{name}.yaml"  # JSON is YAML
    token = procs.tmp / "admin-token"
    if not token.exists():
        token.write_text(os.urandom(16).hex())
        token.chmod(0o600)
    config = gateway_config(procs.tmp, name, port, admin, upstream, limits, tls)
    conf.write_text(json.dumps(config))
    argv = [str(interpreter.gateway), "serve", "-c", str(conf)]
    if workers != 1:
        argv += ["--workers", str(workers)]
    native = interpreter.compiled and not pure
    proc = procs.start(name, argv, cpu, env={"GATEWAY_NATIVE": "1" if native else "0"})
    tls_port = tls[1] if tls else None
    return Target(name, port, proc, "gateway", interpreter, native, tls_port)


def start_configured(
    procs: Procs,
    name: str,
    config: dict,
    cpu: int,
    pure: bool,
    headers: dict[str, str] | None = None,
) -> Target:
    """A gateway of this venv on ``config`` (a dict), returned once its traffic port answers
    200 (with ``headers``): its service's probe passed. ``pure``: the pure Python modules."""
    conf = procs.tmp / f"{name}.json"
    conf.write_text(json.dumps(config))
    gateway = Path(sys.executable).parent / "gateway"
    env = {"GATEWAY_NATIVE": "0"} if pure else {}
    proc = procs.start(name, [str(gateway), "serve", "-c", str(conf)], cpu, env=env)
    port = int(config["listen"].rsplit(":", 1)[1])
    target = Target(name, port, proc, "gateway")
    end = time.monotonic() + 30
    while True:
        request = urllib.request.Request(target.url(), headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=1) as response:
                if response.status == 200:
                    return target
        except OSError:
            pass
        if time.monotonic() > end or proc.popen.poll() is not None:
            raise Failure(f"{name} not serving:\n{proc.tail()}")
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# wrk

_UNITS_TIME = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_UNITS_SIZE = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}


@dataclass(frozen=True)
class Run:
    """One wrk run and what the target's process tree did meanwhile."""

    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    bytes_per_s: float
    errors: int
    cpu_us: float | None = None
    """The target process tree's user+sys CPU per completed request, in microseconds."""
    rss_mib: float | None = None
    """The largest VmRSS of the target's process tree sampled during the run."""
    error_kinds: str = ""
    """What ``errors`` counts, as wrk says it: ``timeout 74``, ``non-2xx 3``."""
    wakeups: float | None = None
    """Wake-up interrupts (``system.WAKEUP_INTERRUPTS``, every core) per completed request."""


def parse_wrk(text: str) -> Run:
    def latency(pct: str) -> float:
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s|m|h)\s*$", text, re.M)
        return float(m.group(1)) * _UNITS_TIME[m.group(2)] if m else float("nan")

    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m|h)", text)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    transfer = re.search(r"Transfer/sec:\s+([\d.]+)([KMGT]?B)", text)
    if not (done and rps and transfer):
        raise Failure(f"cannot read wrk's output:\n{text}")
    # wrk's timeout is its default, 2 s: a slower answer counts as a timeout error
    kinds = [(k, int(n)) for k, n in re.findall(r"(connect|read|write|timeout) (\d+)", text)]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if non2xx:
        kinds.append(("non-2xx", int(non2xx.group(1))))
    errors = sum(n for _, n in kinds)
    seconds = float(done.group(2)) * _UNITS_TIME[done.group(3)] / 1e3
    per_s = float(transfer.group(1)) * _UNITS_SIZE[transfer.group(2)]
    return Run(
        int(done.group(1)), seconds, float(rps.group(1)), latency("50"), latency("99"), per_s,
        errors, error_kinds=", ".join(f"{k} {n}" for k, n in kinds if n),
    )  # fmt: skip


def wrk(
    procs: Procs,
    target: Target,
    path: str,
    connections: int,
    duration: float,
    cpu: int,
    tls: bool = False,
    headers: tuple[str, ...] = (),
) -> Run:
    """``wrk -t1 -c<connections> -d<duration> --latency`` on ``target`` (over HTTPS on its
    TLS port with ``tls``: wrk keeps each connection, so one handshake per connection),
    each request with ``headers`` (``"Name: value"``), bounded in time."""
    url = target.url(path, tls)
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency"]
    for header in headers:
        argv += ["-H", header]
    argv.append(url)
    pids = process_tree(target.proc.pid)
    before = cpu_seconds(pids)
    interrupts = wakeup_interrupts()
    with RssSampler(pids) as rss:
        proc = procs.start(f"wrk-{target.name}", argv, cpu)
        try:
            proc.popen.wait(duration + 30)
        except subprocess.TimeoutExpired:
            raise Failure(f"wrk did not finish within {duration + 30:g}s") from None
        finally:
            procs.finish(proc)
    used = cpu_seconds(pids) - before
    interrupts_after = wakeup_interrupts()
    text = proc.log.read_text()
    if proc.popen.returncode != 0:
        raise Failure(f"wrk exited with {proc.popen.returncode}:\n{text}")
    run = parse_wrk(text)
    cpu_us = used / run.requests * 1e6 if run.requests else None
    wakeups = None
    if run.requests and interrupts is not None and interrupts_after is not None:
        wakeups = (interrupts_after - interrupts) / run.requests
    return dataclasses.replace(run, cpu_us=cpu_us, rss_mib=rss.max, wakeups=wakeups)


def wrk_cpu(
    procs: Procs, target: Target, duration: float, cpu: int, headers: tuple[str, ...] = ()
) -> tuple[float, float]:
    """(requests/s, CPU microseconds per request of ``target``) of one ``wrk -c64`` run, each
    request with ``headers`` (``"Name: value"``)."""
    pids = process_tree(target.proc.pid)
    before = cpu_seconds(pids)
    argv = ["wrk", "-t1", "-c64", f"-d{duration:g}s", "--latency"]
    for header in headers:
        argv += ["-H", header]
    proc = procs.start(f"wrk-{target.name}", [*argv, target.url()], cpu)
    proc.popen.wait(duration + 30)
    procs.finish(proc)
    used = cpu_seconds(pids) - before
    run = parse_wrk(proc.log.read_text())
    if run.errors:
        raise Failure(f"{target.name}: wrk errors: {run.error_kinds}")
    return run.rps, used / run.requests * 1e6


def alternating_wrk(
    procs: Procs,
    targets: list[Target],
    repeat: int,
    duration: float,
    cpu: int,
    headers: tuple[str, ...] = (),
) -> dict[str, list[tuple[float, float]]]:
    """Each target warmed up (2 s of ``wrk_cpu``), then ``repeat`` rounds of one ``wrk_cpu``
    run each, the order turning by one each round (two targets: alternating), a line per run
    on stderr: (requests/s, CPU µs a request) per target, a pair per round."""
    for target in targets:
        wrk_cpu(procs, target, 2, cpu, headers)
    figures: dict[str, list[tuple[float, float]]] = {target.name: [] for target in targets}
    for rep in range(repeat):
        turn = rep % len(targets)
        for target in targets[turn:] + targets[:turn]:
            rps, used = wrk_cpu(procs, target, duration, cpu, headers)
            figures[target.name].append((rps, used))
            print(f"bench: rep {rep + 1} {target.name:8} {rps:>9,.0f} rps  "
                  f"CPU {used:6.1f} us/req", file=sys.stderr)  # fmt: skip
    return figures


def native_status(pure: bool) -> str:
    """What ``gateway native status`` says of the venv's gateway (pure: GATEWAY_NATIVE=0)."""
    gateway = Path(sys.executable).parent / "gateway"
    env = {**os.environ, "GATEWAY_NATIVE": "0" if pure else ""}
    out = subprocess.run(
        [str(gateway), "native", "status"], capture_output=True, text=True, env=env
    )
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def run_in_process(name: str, measure: Callable[[Path, int], Awaitable[None]]) -> int:
    """``measure(config, port)`` on uvloop in this process, ``config`` a gateway's (access
    log, metrics, probes: ``gateway_config``) in front of an nginx upstream on ``port``'s
    neighbour; everything started is stopped by pid. The exit status of a bench's ``main``."""
    import uvloop

    tool = missing_tool()
    if tool is not None:
        print(f"{name}: {tool} is not installed", file=sys.stderr)
        return 2
    stop_on_signals()
    tmp = work_dir(name)
    procs = Procs(tmp)
    port, admin, upstream_port = free_ports(3)
    limits = Limits(max_connections=1024, nofile=4096, access_log=True)
    try:
        upstream = start_upstream(procs, upstream_port, 1, limits)
        wait_serving(upstream.proc, upstream.url())
        (tmp / "admin-token").write_text(os.urandom(16).hex())
        (tmp / "admin-token").chmod(0o600)
        config = tmp / "gateway.yaml"  # JSON is YAML
        config.write_text(
            json.dumps(gateway_config(tmp, "gateway", port, admin, upstream_port, limits))
        )
        uvloop.run(measure(config, port))
    except Failure as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all_uninterrupted()
    return 0


async def until_routable(url: str) -> None:
    """Until ``url`` answers 200 through the gateway (its probe passed, the upstream is
    routable), polled every 0.1 s for 10 s at most."""
    import asyncio

    for _ in range(100):
        try:
            status, _ = await asyncio.to_thread(get, url)
        except OSError:
            status = 0
        if status == 200:
            return
        await asyncio.sleep(0.1)
    raise Failure("the gateway did not serve within 10 s")
