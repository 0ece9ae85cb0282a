"""The data plane benchmark: wrk against the upstream, nginx, HAProxy and the gateway.

One command, one run, everything on loopback and bounded in time::

    .venv/bin/python bench/run.py --duration 8 --repeat 3

It starts, in a fresh temporary directory:

- the upstream: nginx (1 worker) answering ``/`` with a 13-byte body and ``/big`` with a
  10 MiB file (sendfile), pinned with wrk to the load core;
- nginx as a reverse proxy (1 worker, upstream keepalive 64), HAProxy (1 thread, if
  installed) and the gateway (1 process, generated config, an http probe every second), each
  pinned to the proxy core.

Then, interleaved (the order of the targets rotates each repetition), for each target:
``wrk -t1 -c64 --latency`` (requests/s, p50, p99, and the proxy's CPU per request from
``/proc/<pid>/stat``), ``wrk -t1 -c1 --latency`` (latency at one connection) and, on the
10 MiB body, ``wrk -t1 -c4`` (MiB/s). Medians over the repetitions go to ``bench/RESULTS.md``
and to standard output.

Every process it starts gets its own process group and is stopped by pid in a ``finally``
block, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import results

REPO = Path(__file__).resolve().parent.parent
BODY = b"Hello, world\n"
BIG_SIZE = 10 * 1024 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGETS = ("direct", "nginx", "haproxy", "gateway")

UPSTREAM_NGINX = """\
worker_processes 1;
daemon off;
pid {tmp}/upstream.pid;
error_log {tmp}/upstream.error.log warn;
events {{ worker_connections 4096; }}
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
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx.error.log warn;
events {{ worker_connections 4096; }}
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

PROXY_HAPROXY = """\
global
    nbthread 1
    maxconn 4096
defaults
    mode http
    {log}
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    option http-keep-alive
    option forwardfor
    http-reuse always
frontend fe
    bind 127.0.0.1:{port}
    default_backend be
backend be
    server up 127.0.0.1:{upstream}
"""


class Failure(Exception):
    """The benchmark cannot go on; ``str()`` says why."""


# ---------------------------------------------------------------------------------------------
# processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Procs:
    """Everything the benchmark started; ``stop_all`` ends each one by its process group."""

    tmp: Path
    started: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], cpu: int | None) -> Proc:
        if cpu is not None:
            argv = ["taskset", "-c", str(cpu), *argv]
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.tmp,
            )  # fmt: skip
        proc = Proc(name, popen, log)
        self.started.append(proc)
        return proc

    def stop(self, proc: Proc, grace: float = 5.0) -> None:
        if proc.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.popen.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.popen.wait(grace)

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            try:
                self.stop(proc)
            except Exception as e:  # keep stopping the others
                print(f"bench: could not stop {proc.name} (pid {proc.pid}): {e}", file=sys.stderr)
        # a group whose leader already left may still hold children
        for proc in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (an nginx master and its worker, say)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system time of these processes (all their threads), in seconds."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / CLK_TCK


def peak_rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
    return total / 1024


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_serving(proc: Proc, url: str, deadline: float = 30.0) -> None:
    """Poll ``url`` until it answers 200 with the tiny body; bounded by ``deadline``."""
    end = time.monotonic() + deadline
    last = "no answer"
    while time.monotonic() < end:
        if proc.popen.poll() is not None:
            raise Failure(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            status, body = get(url, timeout=1.0)
            if status == 200 and body == BODY:
                return
            last = f"{status} {body[:200]!r}"
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    raise Failure(f"{proc.name} not serving {url} after {deadline:.0f}s ({last}):\n{proc.tail()}")


# ---------------------------------------------------------------------------------------------
# the targets


@dataclass
class Target:
    name: str
    port: int
    proc: Proc

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def start_upstream(procs: Procs, port: int, cpu: int) -> Target:
    (procs.tmp / "www").mkdir()
    with (procs.tmp / "www" / "big").open("wb") as f:
        f.write(os.urandom(BIG_SIZE))
    conf = procs.tmp / "upstream.conf"
    conf.write_text(UPSTREAM_NGINX.format(tmp=procs.tmp, port=port))
    argv = ["nginx", "-e", str(procs.tmp / "upstream.error.log"), "-p", str(procs.tmp)]
    proc = procs.start("upstream", [*argv, "-c", str(conf)], cpu)
    return Target("direct", port, proc)


def start_nginx(procs: Procs, port: int, upstream: int, cpu: int, access_log: bool) -> Target:
    conf = procs.tmp / "nginx.conf"
    log = f"{procs.tmp}/nginx.access.log" if access_log else "off"
    conf.write_text(PROXY_NGINX.format(tmp=procs.tmp, port=port, upstream=upstream, access_log=log))
    argv = ["nginx", "-e", str(procs.tmp / "nginx.error.log"), "-p", str(procs.tmp)]
    return Target("nginx", port, procs.start("nginx", [*argv, "-c", str(conf)], cpu))


def start_haproxy(procs: Procs, port: int, upstream: int, cpu: int, access_log: bool) -> Target:
    conf = procs.tmp / "haproxy.cfg"  # its access log goes to stdout, i.e. haproxy.log
    log = "log stdout format raw local0\n    option httplog" if access_log else ""
    conf.write_text(PROXY_HAPROXY.format(port=port, upstream=upstream, log=log))
    return Target("haproxy", port, procs.start("haproxy", ["haproxy", "-db", "-f", str(conf)], cpu))


def gateway_config(tmp: Path, port: int, admin: int, upstream: int, access_log: bool) -> dict:
    return {
        "listen": f"127.0.0.1:{port}",
        "admin": {"listen": f"127.0.0.1:{admin}", "token_file": str(tmp / "admin-token")},
        "state_dir": str(tmp / "state"),
        "log_level": "warning",
        "access_log": (
            {"enabled": True, "path": str(tmp / "gateway.access.log")}
            if access_log
            else {"enabled": False}
        ),
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


def start_gateway(
    procs: Procs, port: int, admin: int, upstream: int, cpu: int, access_log: bool
) -> Target:
    conf = procs.tmp / "gateway.yaml"  # JSON is YAML
    token = procs.tmp / "admin-token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    conf.write_text(json.dumps(gateway_config(procs.tmp, port, admin, upstream, access_log)))
    gateway = Path(sys.executable).parent / "gateway"
    argv = [str(gateway) if gateway.exists() else "gateway", "serve", "-c", str(conf)]
    return Target("gateway", port, procs.start("gateway", argv, cpu))


# ---------------------------------------------------------------------------------------------
# wrk

_UNITS_TIME = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_UNITS_SIZE = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}


@dataclass(frozen=True)
class Run:
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    bytes_per_s: float
    errors: int
    cpu_us: float | None
    """The target process tree's user+sys CPU per completed request, in microseconds."""


def parse_wrk(text: str) -> Run:
    def latency(pct: str) -> float:
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s|m|h)\s*$", text, re.M)
        return float(m.group(1)) * _UNITS_TIME[m.group(2)] if m else float("nan")

    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m|h)", text)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    transfer = re.search(r"Transfer/sec:\s+([\d.]+)([KMGT]?B)", text)
    if not (done and rps and transfer):
        raise Failure(f"cannot read wrk's output:\n{text}")
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", text))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors += int(non2xx.group(1)) if non2xx else 0
    seconds = float(done.group(2)) * _UNITS_TIME[done.group(3)] / 1e3
    per_s = float(transfer.group(1)) * _UNITS_SIZE[transfer.group(2)]
    return Run(
        int(done.group(1)), seconds, float(rps.group(1)), latency("50"), latency("99"), per_s,
        errors, None,
    )  # fmt: skip


def wrk(
    procs: Procs, target: Target, path: str, connections: int, duration: float, cpu: int
) -> Run:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency", target.url(path)]
    pids = process_tree(target.proc.pid)
    before = cpu_seconds(pids)
    proc = procs.start(f"wrk-{target.name}", argv, cpu)
    try:
        proc.popen.wait(duration + 30)
    except subprocess.TimeoutExpired:
        raise Failure(f"wrk did not finish within {duration + 30:g}s") from None
    finally:
        procs.stop(proc)
        procs.started.remove(proc)
    used = cpu_seconds(pids) - before
    text = proc.log.read_text()
    if proc.popen.returncode != 0:
        raise Failure(f"wrk exited with {proc.popen.returncode}:\n{text}")
    run = parse_wrk(text)
    cpu_us = used / run.requests * 1e6 if run.requests else None
    return dataclasses.replace(run, cpu_us=cpu_us)


# ---------------------------------------------------------------------------------------------
# the report


@dataclass
class Figures:
    """Per target, per measurement, the runs of each repetition."""

    runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)
    peak_rss: dict[str, float] = field(default_factory=dict)

    def add(self, target: str, kind: str, run: Run) -> None:
        self.runs.setdefault(target, {}).setdefault(kind, []).append(run)

    def median(self, target: str, kind: str, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs.get(target, {}).get(kind, [])]
        values = [v for v in values if v is not None and v == v]
        return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def table(figures: Figures, targets: list[str], stream: bool) -> str:
    head = [
        "target", "rps c64", "p50 c64 (ms)", "p99 c64 (ms)", "rps c1", "p50 c1 (ms)",
        "p99 c1 (ms)", "added p50 c1 (us)", "CPU us/req", "peak RSS (MiB)",
    ]  # fmt: skip
    if stream:
        head.append("10 MiB MiB/s c4")
    direct_p50 = figures.median("direct", "c1", "p50_ms")
    rows = []
    for name in targets:
        m = figures.median
        p50_c1 = m(name, "c1", "p50_ms")
        added = (p50_c1 - direct_p50) * 1e3 if p50_c1 is not None and direct_p50 else None
        label = "direct (upstream's own CPU)" if name == "direct" else name
        row = [
            label, _fmt(m(name, "c64", "rps")), _fmt(m(name, "c64", "p50_ms"), 2),
            _fmt(m(name, "c64", "p99_ms"), 2), _fmt(m(name, "c1", "rps")), _fmt(p50_c1, 3),
            _fmt(m(name, "c1", "p99_ms"), 3), "-" if name == "direct" else _fmt(added),
            _fmt(m(name, "c64", "cpu_us"), 1), _fmt(figures.peak_rss.get(name), 1),
        ]  # fmt: skip
        if stream:
            mib = m(name, "big", "bytes_per_s")
            row.append(_fmt(mib / 1024**2 if mib else None))
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ratios(figures: Figures, targets: list[str], stream: bool) -> str:
    m = figures.median
    direct_p50 = m("direct", "c1", "p50_ms")

    def added(name: str) -> float | None:
        p50 = m(name, "c1", "p50_ms")
        return p50 - direct_p50 if p50 is not None and direct_p50 else None

    measures: list[tuple[str, Callable[[str], float | None]]] = [
        ("rps c64", lambda n: m(n, "c64", "rps")),
        ("p50 c64", lambda n: m(n, "c64", "p50_ms")),
        ("p99 c64", lambda n: m(n, "c64", "p99_ms")),
        ("rps c1", lambda n: m(n, "c1", "rps")),
        ("p50 c1", lambda n: m(n, "c1", "p50_ms")),
        ("p99 c1", lambda n: m(n, "c1", "p99_ms")),
        ("added p50 c1", added),
        ("CPU us/req", lambda n: m(n, "c64", "cpu_us")),
    ]
    if stream:
        measures.append(("10 MiB MiB/s", lambda n: m(n, "big", "bytes_per_s")))
    pairs = [("gateway", "nginx"), ("gateway", "direct"), ("gateway", "haproxy")]
    pairs = [(a, b) for a, b in pairs if a in targets and b in targets]
    head = ["ratio", *(name for name, _ in measures)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for a, b in pairs:
        cells = []
        for name, get_value in measures:
            if b == "direct" and name in ("added p50 c1", "CPU us/req"):
                cells.append("-")  # direct adds nothing; its CPU is the upstream's, not a proxy's
                continue
            cells.append(_ratio(get_value(a), get_value(b)))
        lines.append(f"| {a}/{b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def raw(figures: Figures, targets: list[str]) -> str:
    lines = ["| target | run | rep | rps | p50 (ms) | p99 (ms) | MiB/s | CPU us/req | errors |"]
    lines.append("|" + " --- |" * 9)
    for name in targets:
        for kind, runs in figures.runs.get(name, {}).items():
            for i, r in enumerate(runs, 1):
                lines.append(
                    f"| {name} | {kind} | {i} | {r.rps:,.0f} | {r.p50_ms:.3f} | {r.p99_ms:.3f} "
                    f"| {r.bytes_per_s / 1024**2:,.1f} | {_fmt(r.cpu_us, 1)} | {r.errors} |"
                )
    return "\n".join(lines)


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except OSError:
        return "not installed"
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0] if text else "?"


def source_digest() -> str:
    """A short digest of the gateway's Python sources, as the run found them (the work tree
    may differ from the commit that ``git describe`` names)."""
    digest = hashlib.sha256()
    for package in ("gateway", "controller"):
        for path in sorted((REPO / package).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def machine(sources: str) -> list[str]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    config = sysconfig.get_config_var("CONFIG_ARGS") or ""
    pgo = "--enable-optimizations" in config
    lto = "--with-lto" in config
    git = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    return [
        f"- CPUs: nproc {len(os.sched_getaffinity(0))} ({cpu}); kernel {platform.release()}",
        f"- Python {platform.python_version()} ({sys.executable}; PGO {'on' if pgo else 'off'}, "
        f"LTO {'on' if lto else 'off'})",
        f"- aiohttp {metadata.version('aiohttp')}, uvloop {metadata.version('uvloop')}",
        f"- {_version(['nginx', '-v'])}; {_version(['haproxy', '-v'])}; {_version(['wrk', '-v'])}",
        f"- gateway at git {git or '?'}, sources (gateway/, controller/) digest {sources}",
    ]


# ---------------------------------------------------------------------------------------------
# the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (10)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions (3)")
    p.add_argument("--connections", type=int, default=64, help="connections, tiny body (64)")
    p.add_argument("--stream-connections", type=int, default=4, help="connections, 10 MiB (4)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset")
    p.add_argument("--no-stream", action="store_true", help="skip the 10 MiB body")
    p.add_argument("--access-log", choices=("off", "file"), default="off",
                   help="proxies' access logs: off (default) or a file in the tmp dir")  # fmt: skip
    p.add_argument("--proxy-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1, help="wrk and the upstream")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "RESULTS.md")
    p.add_argument("--keep-tmp", action="store_true", help="keep configs and logs")
    args = p.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    unknown = set(args.targets) - set(TARGETS)
    if unknown or "direct" not in args.targets:
        p.error(f"--targets: choose from {', '.join(TARGETS)}; 'direct' is required")
    if args.duration <= 0 or args.duration > 600 or args.repeat < 1:
        p.error("--duration must be in (0, 600] and --repeat at least 1")
    return args


def command_line() -> str:
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(REPO)
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(REPO)
    return shlex.join([str(exe), str(script), *sys.argv[1:]])


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("wrk", "nginx", "taskset"):
        if shutil.which(tool) is None:
            print(f"bench: {tool} not found (apt-get install wrk nginx-light)", file=sys.stderr)
            return 2
    if "haproxy" in args.targets and shutil.which("haproxy") is None:
        print("bench: haproxy not installed; skipping it", file=sys.stderr)
        args.targets.remove("haproxy")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)  # even when started in the background
    started_at = datetime.datetime.now(datetime.UTC)
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    tmp.chmod(0o755)  # nginx workers run as nobody when started by root
    procs = Procs(tmp)
    access_log = args.access_log == "file"
    figures = Figures()
    try:
        up, nginx, haproxy, gw, admin = free_ports(5)
        targets = {"direct": start_upstream(procs, up, args.load_cpu)}
        wait_serving(targets["direct"].proc, targets["direct"].url())
        if "nginx" in args.targets:
            targets["nginx"] = start_nginx(procs, nginx, up, args.proxy_cpu, access_log)
        if "haproxy" in args.targets:
            targets["haproxy"] = start_haproxy(procs, haproxy, up, args.proxy_cpu, access_log)
        sources = source_digest()
        if "gateway" in args.targets:
            targets["gateway"] = start_gateway(procs, gw, admin, up, args.proxy_cpu, access_log)
        for target in targets.values():
            wait_serving(target.proc, target.url())  # the gateway: until its probe passed
            if not args.no_stream:
                status, body = get(target.url("/big"), timeout=30)
                if status != 200 or len(body) != BIG_SIZE:
                    raise Failure(f"{target.name}: /big gave {status}, {len(body)} bytes")
        order = [t for t in TARGETS if t in targets]
        print(f"bench: {', '.join(order)} serving; tmp {tmp}", file=sys.stderr)
        for name in order:
            wrk(procs, targets[name], "/", args.connections, args.warmup, args.load_cpu)
        for rep in range(args.repeat):
            shift = rep % len(order)
            for name in order[shift:] + order[:shift]:
                target = targets[name]
                runs = [("c64", "/", args.connections), ("c1", "/", 1)]
                if not args.no_stream:
                    runs.append(("big", "/big", args.stream_connections))
                for kind, path, conns in runs:
                    run = wrk(procs, target, path, conns, args.duration, args.load_cpu)
                    figures.add(name, kind, run)
                    print(
                        f"bench: rep {rep + 1}/{args.repeat} {name:8} {kind:4} "
                        f"{run.rps:>9,.0f} rps  p50 {run.p50_ms:7.3f} ms  "
                        f"p99 {run.p99_ms:7.3f} ms  {run.bytes_per_s / 1024**2:8,.1f} MiB/s  "
                        f"CPU {_fmt(run.cpu_us, 1):>6} us/req  errors {run.errors}",
                        file=sys.stderr,
                    )
        for name, target in targets.items():
            figures.peak_rss[name] = peak_rss_mib(process_tree(target.proc.pid))
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut this short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        procs.stop_all()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if args.keep_tmp:
            print(f"bench: configs and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    report = render(args, order, figures, started_at, sources, load)
    # Other benches own marked sections of the same file: keep them.
    kept = results.sections(args.output.read_text()) if args.output.exists() else ""
    args.output.write_text(report.rstrip("\n") + "\n" + ("\n" + kept if kept else ""))
    print(table(figures, order, not args.no_stream))
    print()
    print(ratios(figures, order, not args.no_stream))
    print(f"\nbench: written to {args.output}", file=sys.stderr)
    return 0


def render(
    args: argparse.Namespace,
    order: list[str],
    figures: Figures,
    at: datetime.datetime,
    sources: str,
    load: tuple[float, float, float],
) -> str:
    stream = not args.no_stream
    errors = sum(r.errors for kinds in figures.runs.values() for rs in kinds.values() for r in rs)
    return "\n".join(
        [
            "# Benchmark results",
            "",
            f"Run {at:%Y-%m-%d %H:%M} UTC with:",
            "",
            "```sh",
            command_line(),
            "```",
            "",
            f"Medians of {args.repeat} interleaved repetitions of {args.duration:g} s each; "
            f"wrk -t1, {args.connections} connections (c64) and 1 connection (c1) on a 13-byte "
            f"body{f', {args.stream_connections} connections on a 10 MiB body' if stream else ''}."
            f" Proxies pinned to CPU {args.proxy_cpu}; wrk and the upstream (nginx, 1 worker) "
            f"to CPU {args.load_cpu}. CPU us/req: the proxy's own user+sys time during the c64 "
            "run over the requests wrk completed (for `direct`, the upstream's). Added p50 c1: "
            "p50 at one connection minus direct's. Peak RSS: VmHWM at the end of the run. "
            f"Access logs: {args.access_log}. Socket errors and non-2xx answers in all runs: "
            f"{errors}. Load average (1 min) at the start and the end: {load[0]:.2f}, "
            f"{os.getloadavg()[0]:.2f}: anything above 0 is other work sharing the 2 cores. "
            "Method and caveats: `bench/README.md`.",
            "",
            table(figures, order, stream),
            "",
            ratios(figures, order, stream),
            "",
            "## Machine",
            "",
            *machine(sources),
            "",
            "## Every run",
            "",
            raw(figures, order),
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
