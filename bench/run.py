"""The data plane benchmark: wrk against the upstream, nginx, HAProxy and the gateway.

One command, one run, everything on loopback and bounded in time::

    .venv/bin/python bench/run.py --duration 8 --repeat 3
    .venv/bin/python bench/run.py --python .venv/bin/python --python /usr/bin/python3.11
    .venv/bin/python bench/run.py --pure    # also the pure Python data plane, same run
    .venv/bin/python bench/run.py --tls     # TLS termination: nginx and the gateway (tls.py)
    .venv/bin/python bench/run.py --sse     # server-sent events: latency per event (sse.py)
    .venv/bin/python bench/run.py --split   # CPU per request with a canary split (split.py)
    .venv/bin/python bench/run.py --h2      # HTTP/2 and gRPC against nginx (h2_nginx.py)

It starts, in a fresh temporary directory, the upstream (nginx, 1 worker, pinned with wrk to
the load core) and, each pinned to the proxy core, nginx as a reverse proxy (1 worker,
upstream keepalive), HAProxy (1 thread, if installed) and the gateway (1 process) as users run
it: access log to a file, metrics, probes and retries on. Access logs are on for nginx and
HAProxy too. ``--python`` (repeatable) names the interpreter(s) that run the gateway: each
one is a target of its own (``bench/interpreter.py``), running the data plane compiled with
mypyc as ``dev.py`` does (built for it if need be; ``gateway/native.py``). ``--pure`` adds,
for each, the same gateway on the pure Python modules.

Then, interleaved (the order of the targets rotates each repetition), for each target:
``wrk -t1 --latency`` at 64 connections (requests/s, p50, p99, CPU per request from the
target's own ``/proc/<pid>/stat``, RSS sampled during the run), at 256 connections
(requests/s, CPU per request) and at 1 connection (latency), and on the 10 MiB body (MiB/s).
After the repetitions, each target in turn holds 10,000 idle keep-alive connections
(``bench/idle.py``) while its RSS is read. Medians over the repetitions go to
``bench/RESULTS.md`` with the ratios gateway/nginx, and to standard output.

``--tls`` runs the TLS comparison instead (``bench/tls.py``): nginx with ``listen ssl`` and the
gateway with ``listen_tls``, the same certificate and settings, over HTTPS; it writes the
``tls`` section of ``--output`` and leaves the rest. ``--sse`` (``bench/sse.py``),
``--split`` (the setup of ``bench/split.py``) and ``--h2`` (``bench/h2_nginx.py``: h2load,
nginx's ``http2`` and ``grpc_pass``) are steps of their own in the same way: each writes its
section (``sse``, ``split-step``, ``h2``) and nothing else.

Every process it starts gets its own process group and is stopped by pid in a ``finally``
block, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import h2_nginx
import interpreter
import results
import split
import sse
import tls
from idle import IdleResult, idle_step
from system import (
    Failure,
    Procs,
    free_ports,
    get,
    memory_mib,
    missing_tool,
    process_tree,
    raise_nofile,
    stop_on_signals,
    wait_serving,
    work_dir,
)
from targets import (
    BIG_SIZE,
    Certificate,
    Limits,
    Run,
    Target,
    gateway_config,
    make_certificate,
    native_status,
    start_gateway,
    start_haproxy,
    start_nginx,
    start_upstream,
    wrk,
    wrk_cpu,
)

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("direct", "nginx", "haproxy", "gateway")
CLOSE = ("Connection: close",)
"""The headers of the ``close`` load: a new connection for every request, as clients that
keep none (scripts, probes, some load balancers) make."""


# ---------------------------------------------------------------------------------------------
# the figures


@dataclass
class Figures:
    """Per target, per load, the runs of each repetition; and the memory read once per target."""

    runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)
    peak_rss: dict[str, float] = field(default_factory=dict)
    idle: dict[str, IdleResult] = field(default_factory=dict)

    def add(self, target: str, kind: str, run: Run) -> None:
        self.runs.setdefault(target, {}).setdefault(kind, []).append(run)

    def median(self, target: str, kind: str, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs.get(target, {}).get(kind, [])]
        values = [v for v in values if v is not None and v == v]
        return statistics.median(values) if values else None


@dataclass(frozen=True)
class Measure:
    """One column: its heading, how to read it for a target, and how to print it."""

    head: str
    value: Callable[[str], float | None]
    digits: int = 0
    proxy_only: bool = False
    """Meaningless for ``direct`` (added latency) or not comparable with it (CPU, memory:
    direct's figures are the upstream's, which every proxy also needs)."""
    ratio: bool = True


def measures(figures: Figures, low: int, high: int, stream: bool) -> dict[str, list[Measure]]:
    """The two tables, speed and memory, as lists of columns."""
    m = figures.median
    lo, hi = f"c{low}", f"c{high}"
    direct_p50 = m("direct", "c1", "p50_ms")

    def added_us(name: str) -> float | None:
        p50 = m(name, "c1", "p50_ms")
        if name == "direct" or p50 is None or not direct_p50:
            return None
        return (p50 - direct_p50) * 1e3

    def mib_per_s(name: str) -> float | None:
        value = m(name, "big", "bytes_per_s")
        return value / 1024**2 if value else None

    def idle(attr: str) -> Callable[[str], float | None]:
        return lambda name: getattr(figures.idle[name], attr) if name in figures.idle else None

    speed = [
        Measure(f"rps {lo}", lambda n: m(n, lo, "rps")),
        Measure(f"rps {hi}", lambda n: m(n, hi, "rps")),
        Measure(f"p50 {lo} (ms)", lambda n: m(n, lo, "p50_ms"), 2),
        Measure(f"p99 {lo} (ms)", lambda n: m(n, lo, "p99_ms"), 2),
        Measure("rps c1", lambda n: m(n, "c1", "rps")),
        Measure("p50 c1 (ms)", lambda n: m(n, "c1", "p50_ms"), 3),
        Measure("p99 c1 (ms)", lambda n: m(n, "c1", "p99_ms"), 3),
        Measure("added p50 c1 (us)", added_us, proxy_only=True),
        Measure(f"CPU us/req {lo}", lambda n: m(n, lo, "cpu_us"), 1, proxy_only=True),
        Measure(f"CPU us/req {hi}", lambda n: m(n, hi, "cpu_us"), 1, proxy_only=True),
        Measure(f"wake-ups/req {lo}", lambda n: m(n, lo, "wakeups"), 2, ratio=False),
        Measure("rps close", lambda n: m(n, "close", "rps")),
        Measure("CPU us/req close", lambda n: m(n, "close", "cpu_us"), 1, proxy_only=True),
    ]
    if stream:
        speed.append(Measure("10 MiB MiB/s", mib_per_s))
    memory = [
        Measure("RSS idle (MiB)", idle("rss_before"), 1, proxy_only=True),
        Measure(f"RSS under load {lo} (MiB)", lambda n: m(n, lo, "rss_mib"), 1, proxy_only=True),
        Measure("peak RSS (MiB)", lambda n: figures.peak_rss.get(n), 1, proxy_only=True),
        Measure("RSS idle conns (MiB)", idle("rss_with"), 1, proxy_only=True),
        Measure("growth (MiB)", idle("growth"), 1, proxy_only=True, ratio=False),
        Measure("KiB/conn", idle("kib_per_connection"), 2, proxy_only=True),
        Measure("RSS after close (MiB)", idle("rss_after"), 1, proxy_only=True, ratio=False),
    ]
    return {"speed": speed, "memory": memory}


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b is not None and b > 0 else "-"


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def table(columns: list[Measure], targets: list[str]) -> str:
    rows = []
    for name in targets:
        label = "direct (the upstream's own)" if name == "direct" else name
        rows.append([label, *(_fmt(c.value(name), c.digits) for c in columns)])
    return _markdown(["target", *(c.head for c in columns)], rows)


def ratio_pairs(targets: list[str]) -> list[tuple[str, str]]:
    """gateway/nginx first, then against direct and HAProxy; a second gateway against the
    first (the gain of one interpreter over the other)."""
    gateways = [t for t in targets if t.startswith("gateway")]
    pairs = [(g, other) for g in gateways for other in ("nginx", "direct", "haproxy")]
    pairs += [(g, gateways[0]) for g in gateways[1:]]
    return [(a, b) for a, b in pairs if b in targets]


def ratios(columns: list[Measure], targets: list[str]) -> str:
    """Each pair's ratios; a pair with none that means anything (memory against direct) is left
    out."""
    columns = [c for c in columns if c.ratio]
    rows = []
    for a, b in ratio_pairs(targets):
        cells = []
        for c in columns:
            if b == "direct" and c.proxy_only:
                cells.append("-")
            else:
                cells.append(_ratio(c.value(a), c.value(b)))
        if any(cell != "-" for cell in cells):
            rows.append([f"{a}/{b}", *cells])
    heads = [c.head.split(" (")[0] for c in columns]  # a ratio has no unit
    return _markdown(["ratio", *heads], rows)


def paired(figures: Figures, targets: list[str], low: int) -> str:
    """The targets' ratios to nginx repetition by repetition, and their median.

    A repetition runs every target within minutes of the others, so the ratio of its two runs
    cancels much of what the machine's other work does to both; the tables above give the
    ratio of medians, which one repetition's outlier on either side can move."""
    lo = f"c{low}"

    def each(name: str, kind: str, attr: str) -> list[float | None]:
        return [getattr(r, attr) for r in figures.runs.get(name, {}).get(kind, [])]

    def added(name: str) -> list[float | None]:
        own, direct = each(name, "c1", "p50_ms"), each("direct", "c1", "p50_ms")
        return [
            p - d if p is not None and d is not None else None
            for p, d in zip(own, direct, strict=False)
        ]

    figures_of: list[tuple[str, Callable[[str], list[float | None]]]] = [
        (f"CPU us/req {lo}", lambda n: each(n, lo, "cpu_us")),
        (f"p99 {lo}", lambda n: each(n, lo, "p99_ms")),
        ("added p50 c1", added),
        ("CPU us/req close", lambda n: each(n, "close", "cpu_us")),
    ]
    if "nginx" not in targets:
        return ""
    rows = []
    for name in (t for t in targets if t.startswith("gateway")):
        cells = []
        for _, of in figures_of:
            ratios = [
                a / b
                for a, b in zip(of(name), of("nginx"), strict=False)
                if a is not None and b is not None and b > 0
            ]
            text = ", ".join(f"{r:.2f}" for r in ratios)
            cells.append(f"{text} (median {statistics.median(ratios):.2f})" if ratios else "-")
        rows.append([f"{name}/nginx", *cells])
    heads = ["per repetition", *(head for head, _ in figures_of)]
    return _markdown(heads, rows) if rows else ""


def idle_notes(figures: Figures, targets: list[str]) -> str:
    rows = []
    for name in targets:
        r = figures.idle.get(name)
        if r is None:
            continue
        errors = ", ".join(f"{k} {v}" for k, v in r.errors.items()) or "-"
        alive = _fmt(r.alive)
        rows.append(
            [name, f"{r.connections:,}", alive, f"{r.seconds:.1f}", f"{r.fds_with:,}", errors]
        )
    head = ["target", "held", "still open at the end", "opened in (s)", "fds held", "failures"]
    return _markdown(head, rows)


def raw(figures: Figures, targets: list[str]) -> str:
    head = ["target", "run", "rep", "rps", "p50 (ms)", "p99 (ms)", "MiB/s", "CPU us/req",
            "RSS max (MiB)", "errors"]  # fmt: skip
    rows = []
    for name in targets:
        for kind, runs in figures.runs.get(name, {}).items():
            for i, r in enumerate(runs, 1):
                rows.append([
                    name, kind, str(i), f"{r.rps:,.0f}", f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}",
                    f"{r.bytes_per_s / 1024**2:,.1f}", _fmt(r.cpu_us, 1), _fmt(r.rss_mib, 1),
                    f"{r.errors} ({r.error_kinds})" if r.errors else "0",
                ])  # fmt: skip
    return _markdown(head, rows)


# ---------------------------------------------------------------------------------------------
# the machine


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


def machine(sources: str, gateways: list[Target]) -> list[str]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    git = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    lines = [f"- CPUs: nproc {len(os.sched_getaffinity(0))} ({cpu}); kernel {platform.release()}"]
    for g in gateways:
        if g.interpreter is not None:
            if g.native:
                plane = "compiled with mypyc"
            elif g.interpreter.compiled:
                plane = "pure Python (--pure)"
            else:
                plane = g.interpreter.native  # "pure Python: why it is not compiled"
            lines.append(f"- `{g.name}`: {g.interpreter.label}; data plane {plane}")
    return [
        *lines,
        f"- the bench itself and the idle client: Python {platform.python_version()} "
        f"({sys.executable})",
        f"- aiohttp {metadata.version('aiohttp')}, uvloop {metadata.version('uvloop')}",
        f"- {_version(['nginx', '-v'])}; {_version(['haproxy', '-v'])}; {_version(['wrk', '-v'])}",
        f"- gateway at git {git or '?'}, sources (gateway/, controller/) digest {sources}",
    ]


# ---------------------------------------------------------------------------------------------
# the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=int, default=10, help="seconds per wrk run (10)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions (3)")
    p.add_argument("--connections", type=int, default=64,
                   help="connections for latency, CPU and RSS under load (64)")  # fmt: skip
    p.add_argument("--high-connections", type=int, default=256,
                   help="connections for the second requests/s figure (256)")  # fmt: skip
    p.add_argument("--stream-connections", type=int, default=4, help="connections, 10 MiB (4)")
    p.add_argument("--close-connections", type=int, default=8,
                   help="connections of the connection-per-request load (8)")  # fmt: skip
    p.add_argument("--idle-connections", type=int, default=10_000,
                   help="idle keep-alive connections held per target (10000; 0 skips)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2, help="seconds of load before measuring (2)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset")
    p.add_argument("--python", type=Path, action="append", default=[],
                   help="interpreter that runs the gateway (default: this one); "
                        "repeat it to compare interpreters in one run")  # fmt: skip
    p.add_argument(
        "--pure",
        action="store_true",
        help="also each gateway on its pure Python modules (GATEWAY_NATIVE=0)",
    )
    p.add_argument("--no-stream", action="store_true", help="skip the 10 MiB body")
    p.add_argument("--tls", action="store_true",
                   help="TLS termination instead: nginx and the gateway over HTTPS")  # fmt: skip
    p.add_argument("--tls-key", choices=("rsa", "ecdsa"), default="rsa",
                   help="the certificate's key: RSA 2048 (default) or ECDSA P-256")  # fmt: skip
    p.add_argument("--handshake-clients", type=int, default=8,
                   help="openssl s_time processes at once, for --tls (8)")  # fmt: skip
    p.add_argument("--sse", action="store_true",
                   help="server-sent events instead: latency per event, nginx with "
                        "proxy_buffering off and the gateway (sse.py)")  # fmt: skip
    p.add_argument("--sse-streams", type=int, default=100, help="streams at once, --sse (100)")
    p.add_argument("--sse-interval", type=float, default=5.0,
                   help="ms between two events of a stream, --sse (5)")  # fmt: skip
    p.add_argument("--split", action="store_true",
                   help="CPU per request with a canary split (25%%) against the plain "
                        "service instead (the setup of split.py)")  # fmt: skip
    p.add_argument(
        "--h2",
        action="store_true",
        help="HTTP/2 and gRPC instead: h2load -c8 -m8 and a grpcio client against "
        "nginx (http2, grpc_pass) and the gateway, with wrk -c64 beside (h2_nginx.py)",
    )
    p.add_argument(
        "--grpc-threads",
        type=int,
        default=8,
        help="threads of the grpcio client, one call at a time each, --h2 (8)",
    )
    p.add_argument("--no-compile", action="store_true",
                   help="run the data plane as built (else pure): never build it")  # fmt: skip
    p.add_argument("--access-log", choices=("off", "file"), default="file",
                   help="access logs of nginx, HAProxy and the gateway: a file in the tmp "
                        "dir (default), or off")  # fmt: skip
    p.add_argument("--proxy-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1, help="wrk and the upstream")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "RESULTS.md")
    p.add_argument("--keep-tmp", action="store_true", help="keep configs and logs")
    args = p.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    unknown = set(args.targets) - set(TARGETS)
    if unknown or "direct" not in args.targets:
        p.error(f"--targets: choose from {', '.join(TARGETS)}; 'direct' is required")
    if not 1 <= args.duration <= 600 or not 1 <= args.warmup <= 600 or args.repeat < 1:
        p.error(
            "--duration and --warmup must be in [1, 600] (whole seconds, as wrk takes them) "
            "and --repeat at least 1"
        )
    if len({1, args.connections, args.high_connections}) != 3:
        p.error("--connections and --high-connections must differ from each other and from 1")
    if args.idle_connections < 0:
        p.error("--idle-connections must be 0 or more")
    pythons = []
    for python in args.python or [Path(sys.executable)]:
        found = shutil.which(python) if "/" not in str(python) else str(python)
        if not found or not Path(found).exists():
            p.error(f"--python {python}: not found")
        pythons.append(Path(found))
    args.python = pythons
    return args


def limits(args: argparse.Namespace) -> Limits:
    """Connection limits for every target, high enough for the idle step and within
    RLIMIT_NOFILE (raised to its hard limit here, for every child)."""
    nofile = raise_nofile()
    needed = args.idle_connections + 1000
    if args.idle_connections and nofile < needed:
        raise Failure(
            f"--idle-connections {args.idle_connections} needs an open-file limit of {needed} "
            f"or more; the hard limit is {nofile} (raise it, or pass a smaller number)"
        )
    return Limits(max(4096, min(nofile, args.idle_connections + 10_000)), nofile,
                  args.access_log == "file")  # fmt: skip


def command_line() -> str:
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(REPO)
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(REPO)
    return shlex.join([str(exe), str(script), *sys.argv[1:]])


def start_targets(
    procs: Procs,
    args: argparse.Namespace,
    lim: Limits,
    pythons: list[interpreter.Interpreter],
    certificate: Certificate | None = None,
) -> dict[str, Target]:
    """Start every target and wait until each serves ``/`` (and ``/big`` whole); with a
    ``certificate``, nginx and the gateways also listen with TLS (HAProxy is left out)."""
    runs = [(python, pure) for python in pythons for pure in (False, True) if pure <= args.pure]
    n_gateways = len(runs) if "gateway" in args.targets else 0
    up, nginx, haproxy, nginx_tls, *rest = free_ports(4 + 3 * n_gateways)
    targets = {"direct": start_upstream(procs, up, args.load_cpu, lim)}
    wait_serving(targets["direct"].proc, targets["direct"].url())
    if "nginx" in args.targets:
        tls_nginx = (certificate, nginx_tls) if certificate else None
        targets["nginx"] = start_nginx(procs, nginx, up, args.proxy_cpu, lim, tls_nginx)
    if "haproxy" in args.targets and certificate is None:
        targets["haproxy"] = start_haproxy(procs, haproxy, up, args.proxy_cpu, lim)
    for i, (python, pure) in enumerate(runs[:n_gateways]):
        name = "gateway" if len(pythons) == 1 else f"gateway-{python.tag}"
        if pure:
            name += "-pure"
        if name in targets:
            name = f"{name}-{i + 1}"
        ports = (rest[3 * i], rest[3 * i + 1], up)
        tls_gateway = (certificate, rest[3 * i + 2]) if certificate else None
        targets[name] = start_gateway(
            procs, name, python, ports, args.proxy_cpu, lim, pure=pure, tls=tls_gateway
        )
    for target in targets.values():
        wait_serving(target.proc, target.url())  # the gateway: until its probe passed
        if not args.no_stream:
            status, body = get(target.url("/big"), timeout=30)
            if status != 200 or len(body) != BIG_SIZE:
                raise Failure(f"{target.name}: /big gave {status}, {len(body)} bytes")
    return targets


def measure(procs: Procs, args: argparse.Namespace, targets: dict[str, Target]) -> Figures:
    """The interleaved wrk runs, then the peak RSS, then the idle connections step."""
    figures = Figures()
    order = list(targets)
    for name in order:
        wrk(procs, targets[name], "/", args.connections, args.warmup, args.load_cpu)
    loads = [(f"c{args.connections}", "/", args.connections, ()),
             (f"c{args.high_connections}", "/", args.high_connections, ()), ("c1", "/", 1, ()),
             ("close", "/", args.close_connections, CLOSE)]  # fmt: skip
    if not args.no_stream:
        loads.append(("big", "/big", args.stream_connections, ()))
    for rep in range(args.repeat):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            for kind, path, conns, headers in loads:
                run = wrk(
                    procs, targets[name], path, conns, args.duration, args.load_cpu, headers=headers
                )
                figures.add(name, kind, run)
                print(
                    f"bench: rep {rep + 1}/{args.repeat} {name:8} {kind:4} "
                    f"{run.rps:>9,.0f} rps  p50 {run.p50_ms:7.3f} ms  "
                    f"p99 {run.p99_ms:7.3f} ms  {run.bytes_per_s / 1024**2:8,.1f} MiB/s  "
                    f"CPU {_fmt(run.cpu_us, 1):>6} us/req  RSS {_fmt(run.rss_mib, 1):>6} MiB  "
                    f"errors {run.errors}",
                    file=sys.stderr,
                )
    for name, target in targets.items():  # before the idle step, which has its own figures
        figures.peak_rss[name] = memory_mib(process_tree(target.proc.pid), "VmHWM")
    if args.idle_connections:
        for name, target in targets.items():
            result = idle_step(procs, target, args.idle_connections, args.load_cpu)
            figures.idle[name] = result
            print(
                f"bench: idle {name:8} {result.connections:,} held ({result.alive} still open) "
                f"RSS {result.rss_before:.1f} -> {result.rss_with:.1f} MiB "
                f"({result.kib_per_connection or 0:.2f} KiB/conn), after close "
                f"{result.rss_after:.1f} MiB",
                file=sys.stderr,
            )
            if result.connections < args.idle_connections:  # reported in the table, not fatal
                print(f"bench: {name}: failures {result.errors}", file=sys.stderr)
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tool = missing_tool()
    if tool is not None:
        print(f"bench: {tool} not found (apt-get install wrk nginx-light)", file=sys.stderr)
        return 2
    if "haproxy" in args.targets and shutil.which("haproxy") is None:
        print("bench: haproxy not installed; skipping it", file=sys.stderr)
        args.targets.remove("haproxy")
    if args.tls and missing_tool(("openssl",)):
        print("bench: openssl not found (apt-get install openssl)", file=sys.stderr)
        return 2
    if args.no_compile:
        interpreter._native = _native_as_built  # see _native_as_built
    try:
        lim = limits(args)
        pythons = [interpreter.resolve(p) for p in args.python] if "gateway" in args.targets else []
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    stop_on_signals()
    if args.h2 and missing_tool(("h2load",)):
        print("bench: h2load not found (apt-get install nghttp2-client)", file=sys.stderr)
        return 2
    if args.sse or args.split or args.h2:
        return step(args, lim, pythons[0])
    started_at = datetime.datetime.now(datetime.UTC)
    load = os.getloadavg()
    tmp = work_dir("bench")
    procs = Procs(tmp)
    sources = source_digest()
    tls_figures = None
    try:
        certificate = make_certificate(tmp, args.tls_key) if args.tls else None
        targets = start_targets(procs, args, lim, pythons, certificate)
        print(f"bench: {', '.join(targets)} serving; tmp {tmp}", file=sys.stderr)
        if args.tls:
            tls_figures = tls.measure(procs, args, targets)
        else:
            figures = measure(procs, args, targets)
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        procs.stop_all_uninterrupted()
        if args.keep_tmp:
            print(f"bench: configs and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    if tls_figures is not None:
        gateways = [t for t in targets.values() if t.kind == "gateway"]
        head = tls_head(args, started_at, load, machine(sources, gateways))
        names = [name for name, t in targets.items() if t.tls_port is not None]
        results.publish("tls", tls.report(args, names, tls_figures, head), args.output)
        return 0
    report = render(args, list(targets.values()), figures, started_at, sources, load)
    # Other benches own marked sections of the same file: keep them.
    kept = results.sections(args.output.read_text()) if args.output.exists() else ""
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report.rstrip("\n") + "\n" + ("\n" + kept if kept else ""))
    print(tables(args, [t.name for t in targets.values()], figures))
    print(f"\nbench: written to {args.output}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# the steps of their own: --sse, --split


def measure_split(procs: Procs, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """``split.py``'s comparison: two gateways (one process each, the proxy core) over the
    same two upstreams, ``plain`` (one revision) and ``split`` (a canary held at
    ``split.WEIGHT`` %); per repetition, the order alternating, (requests/s, CPU us/request)
    of ``wrk -t1 -c64``."""
    others = Procs(work_dir("split-upstream"))  # the second nginx, in a directory of its own
    lim = Limits(max_connections=1024, nofile=4096, access_log=args.access_log == "file")
    figures: dict[str, list[tuple[float, float]]] = {"plain": [], "split": []}
    try:
        up, up2, p1, a1, p2, a2 = free_ports(6)
        token = os.urandom(16).hex()
        (procs.tmp / "admin-token").write_text(token)
        start_upstream(procs, up, args.load_cpu, lim)
        start_upstream(others, up2, args.load_cpu, lim)
        plain = gateway_config(procs.tmp, "plain", p1, a1, up, lim)
        canary = gateway_config(procs.tmp, "split", p2, a2, up, lim)
        plain["services"][0]["replica"]["addresses"].append(f"127.0.0.1:{up2}")
        service = canary["services"][0]
        service["replicas"] = 1  # the canary's replica takes the second address
        service["replica"]["addresses"].append(f"127.0.0.1:{up2}")
        pure = args.pure
        gateways = [split.start(procs, "plain", plain, args.proxy_cpu, pure),
                    split.start(procs, "split", canary, args.proxy_cpu, pure)]  # fmt: skip
        split.hold_canary(canary, token, split.WEIGHT)
        for target in gateways:
            wrk_cpu(procs, target, args.warmup, args.load_cpu)
        for rep in range(args.repeat):
            for target in gateways if rep % 2 == 0 else gateways[::-1]:
                rps, cpu = wrk_cpu(procs, target, args.duration, args.load_cpu)
                figures[target.name].append((rps, cpu))
                print(f"bench: split rep {rep + 1} {target.name:6} {rps:>9,.0f} rps  "
                      f"CPU {cpu:6.1f} us/req", file=sys.stderr)  # fmt: skip
        view = split.admin(canary, token, "GET", "/api/services/bench")
        if (view.get("rollout") or {}).get("weight") != split.WEIGHT:
            raise Failure("the canary did not hold its weight through the runs")
    finally:
        others.stop_all_uninterrupted()
        shutil.rmtree(others.tmp, ignore_errors=True)
    return figures


def split_report(
    args: argparse.Namespace, figures: dict[str, list[tuple[float, float]]], head: list[str]
) -> str:
    rows = [
        f"| {name} | {statistics.median(r for r, _ in runs):,.0f} | "
        f"{statistics.median(c for _, c in runs):.1f} |"
        for name, runs in figures.items()
    ]
    ratios = [s[1] / p[1] for p, s in zip(figures["plain"], figures["split"], strict=True)]
    return "\n".join([
        "## A canary split: CPU per request (bench/run.py --split)",
        "",
        *head,
        "",
        f"`wrk -t1 -c64`, {args.duration} s a run; `split` holds a canary at {split.WEIGHT}% "
        "(two revisions, every request draws its side, then the policy picks within it), "
        "`plain` is the same service over the same two upstreams with one revision. "
        "Medians of the repetitions, the order alternating.",
        "",
        "| gateway | requests/s | CPU us/request |",
        "| --- | ---: | ---: |",
        *rows,
        "",
        "split/plain CPU per request, per repetition: "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f" (median **{statistics.median(ratios):.3f}**).",
    ])  # fmt: skip


def step(args: argparse.Namespace, lim: Limits, python: interpreter.Interpreter) -> int:
    """``--sse``, ``--split`` or ``--h2``: a comparison of its own, written to its own
    section."""
    name = "sse" if args.sse else "h2" if args.h2 else "split-step"
    started_at = datetime.datetime.now(datetime.UTC)
    load = os.getloadavg()
    tmp = work_dir(name)
    procs = Procs(tmp)
    sources = source_digest()
    gateways: list[Target] = []
    try:
        if args.sse:
            targets = sse.start(procs, args, python, lim)
            gateways = [t for t in targets.values() if t.kind == "gateway"]
            sse_figures = sse.measure(procs, args, targets)
        elif args.h2:
            proxies = h2_nginx.start(procs, args, python, lim)
            gateways = [proxies["gateway"].target]
            h2_figures = h2_nginx.measure(procs, args, proxies)
        else:
            split_figures = measure_split(procs, args)
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        procs.stop_all_uninterrupted()
        if args.keep_tmp:
            print(f"bench: configs and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    at = f"{started_at:%Y-%m-%d %H:%M} UTC"
    placement = (f"The proxies pinned to CPU {args.proxy_cpu}, the load (and the upstreams) to "
                 f"CPU {args.load_cpu}.")  # fmt: skip
    if args.split:
        placement += f" Data plane: {native_status(args.pure)}."
    head = [
        f"Run {at} with:",
        "",
        "```sh",
        command_line(),
        "```",
        "",
        f"Repetitions: {args.repeat}. {placement} Access logs "
        f"{'to a file' if args.access_log == 'file' else 'off'}. Load average (1 min) at the "
        f"start and the end: {load[0]:.2f}, {os.getloadavg()[0]:.2f}: the 2 cores are shared "
        "with other work, so the ratios per repetition say more than the medians.",
        "",
        *machine(sources, gateways),
    ]
    if args.sse:
        text = sse.report(args, sse_figures, head)
    elif args.h2:
        text = h2_nginx.report(args, h2_figures, head)
    else:
        text = split_report(args, split_figures, head)
    results.publish(name, text, args.output)
    return 0


def _native_as_built(gateway: Path) -> str:
    """``interpreter._native`` without the build: the status of what is built. The compiled
    modules live in the checkout (``gateway/_native/``), which others may be testing; a stale
    build then runs the pure modules, and the report says so."""
    out = subprocess.run(
        [str(gateway), "native", "status"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "GATEWAY_NATIVE": ""},
    )  # fmt: skip
    return out.stdout.strip() or f"pure Python: status failed: {out.stderr.strip()}"


def tls_head(
    args: argparse.Namespace,
    at: datetime.datetime,
    load: tuple[float, float, float],
    machine_lines: list[str],
) -> list[str]:
    """How the TLS run was made: the command, the settings, the machine."""
    key = "RSA 2048" if args.tls_key == "rsa" else "ECDSA P-256"
    return [
        f"Run {at:%Y-%m-%d %H:%M} UTC with:",
        "",
        "```sh",
        command_line(),
        "```",
        "",
        f"Medians of {args.repeat} interleaved repetitions of {args.duration} s each. nginx "
        "(1 worker, `listen ssl`) and the gateway (`listen_tls`, 1 process) pinned to CPU "
        f"{args.proxy_cpu}; wrk, `openssl s_time` and the upstream (nginx, plain HTTP) to CPU "
        f"{args.load_cpu}. One self-signed {key} certificate for both; TLS 1.2 and 1.3, the "
        "gateway's TLS 1.2 cipher list in its order for nginx (`ssl_ciphers`, "
        "`ssl_prefer_server_ciphers on`), OpenSSL's TLS 1.3 suites for both; session tickets "
        "on for both, nginx with `ssl_session_cache shared:SSL:10m`. Access logs to a file for "
        "both. `c64`: `wrk -t1 -c64` over HTTPS on the 13-byte body (connections kept), and "
        "the same on the plain port (`plain`): TLS's own cost a request is their difference; "
        f"`new`/`resumed`: {args.handshake_clients} `openssl s_time -new`/`-reuse` processes "
        "at once, each a sequence of connect, handshake (full, or resuming the session of its "
        "first connection), `GET / HTTP/1.0`, read to the close: connections per second over "
        "the wall time, and the target's CPU per connection (handshake, request, proxying); "
        f"`10 MiB`: `wrk -t1 -c{args.stream_connections}` on the 10 MiB body over HTTPS "
        "(MiB/s, and the target's CPU per body). "
        f"Load average (1 min) at the start and the end: {load[0]:.2f}, "
        f"{os.getloadavg()[0]:.2f}: the 2 cores are shared with other work, so the ratios per "
        "repetition say more than the medians. Method: `bench/README.md`, TLS.",
        "",
        *machine_lines,
    ]


def tables(args: argparse.Namespace, order: list[str], figures: Figures) -> str:
    """The speed and memory tables, each followed by its ratios."""
    columns = measures(figures, args.connections, args.high_connections, not args.no_stream)
    lo, idle = args.connections, args.idle_connections
    memory_text = (
        f"RSS: of the target's process tree, in MiB. Idle: before the idle step; under load: "
        f"the largest of samples every 0.2 s during the c{lo} run (median over repetitions); "
        f"peak: VmHWM after the repetitions (the 10 MiB runs included); idle conns: with "
        f"{idle:,} idle keep-alive connections open, each after one request; growth: that "
        f"minus idle, per connection in KiB/conn; after close: 2 s after the client closed "
        f"them. For `direct`, these are the upstream's own."
        if idle
        else "Idle connections step skipped (`--idle-connections 0`)."
    )
    parts = [
        "### Speed",
        "",
        table(columns["speed"], order),
        "",
        ratios(columns["speed"], order),
        "",
        paired(figures, order, args.connections),
        "",
        "### Memory",
        "",
        memory_text,
        "",
        table(columns["memory"], order),
        "",
        ratios(columns["memory"], order),
    ]
    if figures.idle:
        parts += ["", idle_notes(figures, order)]
    return "\n".join(parts)


def render(
    args: argparse.Namespace,
    targets: list[Target],
    figures: Figures,
    at: datetime.datetime,
    sources: str,
    load: tuple[float, float, float],
) -> str:
    """The head of RESULTS.md: how the run was made, the tables, the machine, every run."""
    stream = not args.no_stream
    order = [t.name for t in targets]
    gateways = [t for t in targets if t.kind == "gateway"]
    failing = [
        (f"{name} {kind} rep {i}", r)
        for name, kinds in figures.runs.items()
        for kind, rs in kinds.items()
        for i, r in enumerate(rs, 1)
        if r.errors
    ]
    errors = sum(r.errors for _, r in failing)
    where = "; ".join(f"{run}: {r.errors} ({r.error_kinds})" for run, r in failing)
    where = f" ({where})" if where else ""
    lo, hi = args.connections, args.high_connections
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
            f"wrk -t1, {lo} (c{lo}), {hi} (c{hi}) and 1 connection (c1) on a 13-byte "
            f"body{f', {args.stream_connections} connections on a 10 MiB body' if stream else ''},"
            f" and {args.close_connections} connections each sending `Connection: close`"
            " (close: a new connection for every request)."
            f" Proxies pinned to CPU {args.proxy_cpu}; wrk and the upstream (nginx, 1 worker) "
            f"to CPU {args.load_cpu}. The gateway as users run it: an http probe every second, "
            "metrics, retries and passive outlier detection at their defaults, access log "
            f"{'to a file' if args.access_log == 'file' else 'off'}; access logs of nginx and "
            f"HAProxy: {'a file too' if args.access_log == 'file' else 'off too'}. CPU us/req: "
            "the target's own user+sys time during the run over the requests wrk completed "
            "(for `direct`, the upstream's). Added p50 c1: p50 at one connection minus direct's. "
            f"Socket errors and non-2xx answers in all runs: {errors}{where}. Load average (1 min) "
            f"at the start and the end: {load[0]:.2f}, {os.getloadavg()[0]:.2f}: anything above 0 "
            "is other work sharing the 2 cores. Method and caveats: `bench/README.md`.",
            "",
            tables(args, order, figures),
            "",
            "## Machine",
            "",
            *machine(sources, gateways),
            "",
            "## Every run",
            "",
            raw(figures, order),
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
