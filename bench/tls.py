"""TLS termination: nginx (``listen ssl``) against the gateway (``listen_tls``), ``run.py --tls``.

Both terminate TLS with the same certificate (``targets.make_certificate``: RSA 2048 unless
``--tls-key ecdsa``), TLS 1.2 and 1.3, the gateway's cipher list and order, session tickets,
and for nginx a shared session cache; both proxy to the same upstream over plain HTTP, pinned
to the proxy core, with the load on the other one. Per repetition, interleaved, each target:

- ``c64``: ``wrk -t1 -c64`` over HTTPS (connections kept: one handshake each): requests/s,
  p99, CPU per request; and the same on the plain port (``plain``), so that what TLS itself
  costs each target a request is their difference;
- ``new`` and ``reuse``: a new TLS connection per request, ``openssl s_time -new`` (a full
  handshake each) and ``-reuse`` (each resumes the first one's session),
  ``--handshake-clients`` processes at once, each a sequence of connect, handshake,
  ``GET / HTTP/1.0`` (with a Host), read to the close: connections per second over the run's
  wall time, and the target's CPU per connection;
- ``big``: ``wrk -t1 -c4 /big`` over HTTPS, the 10 MiB body: MiB/s, and CPU per body.

Then each target holds ``--idle-connections`` idle TLS keep-alive connections (``idle.py
--tls``) while its RSS is read. The figures go to the ``tls`` section of ``--output``, with
every ratio to nginx repetition by repetition.
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from idle import IdleResult, idle_step
from results import median as _median
from system import Failure, Procs, cpu_seconds, process_tree
from targets import SERVER_NAME, Run, Target, client_tls, wrk

HANDSHAKE_KINDS = ("new", "reuse")


@dataclass(frozen=True)
class Handshakes:
    """One ``s_time`` run (several clients at once) and the target's CPU meanwhile."""

    connections: int
    seconds: float
    cpu_us: float | None
    """The target's user+sys CPU per connection, in microseconds."""
    bytes_per_connection: float

    @property
    def per_s(self) -> float:
        return self.connections / self.seconds if self.seconds else 0.0


@dataclass
class TlsFigures:
    runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)
    handshakes: dict[str, dict[str, list[Handshakes]]] = field(default_factory=dict)
    idle: dict[str, IdleResult] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)
    """What a client negotiates with each target: version, cipher, resumption."""


# s_time sends "GET <page> HTTP/1.0\r\n\r\n": no Host, which nginx would forward empty (its
# `proxy_set_header Host $http_host`) and the upstream refuse. The page carries one.
PAGE = f"/ HTTP/1.0\r\nHost: {SERVER_NAME}\r\nX-Bench: s_time"
REQUEST = f"GET {PAGE} HTTP/1.0\r\n\r\n".encode()

_S_TIME = re.compile(r"(\d+) connections in \d+ real seconds, (\d+) bytes read per connection")


def s_time(
    procs: Procs, target: Target, reuse: bool, duration: int, cpu: int, clients: int
) -> Handshakes:
    """``clients`` ``openssl s_time`` processes at once on ``target``'s TLS port."""
    argv = ["openssl", "s_time", "-connect", f"127.0.0.1:{target.tls_port}",
            "-reuse" if reuse else "-new", "-time", str(duration), "-www", PAGE]  # fmt: skip
    pids = process_tree(target.proc.pid)
    before = cpu_seconds(pids)
    started = time.monotonic()
    kind = "reuse" if reuse else "new"
    runs = [procs.start(f"s_time-{kind}-{target.name}-{i}", argv, cpu) for i in range(clients)]
    try:
        for run in runs:
            try:
                run.popen.wait(duration + 30)
            except subprocess.TimeoutExpired:
                raise Failure(f"s_time did not finish within {duration + 30}s") from None
    finally:
        for run in runs:
            procs.finish(run)
    seconds = time.monotonic() - started
    used = cpu_seconds(pids) - before
    connections, read = 0, 0
    for run in runs:
        found = _S_TIME.findall(run.log.read_text(errors="replace"))
        if run.popen.returncode != 0 or not found:
            raise Failure(f"s_time on {target.name} gave nothing:\n{run.tail()}")
        count, per = (int(v) for v in found[-1])
        connections += count
        read += count * per
    cpu_us = used / connections * 1e6 if connections else None
    return Handshakes(connections, seconds, cpu_us, read / connections if connections else 0)


def session(target: Target) -> str:
    """Check ``target``'s TLS port answers s_time's request with 200; say what was
    negotiated and whether a second connection resumed."""
    context = client_tls()
    said, reused, saved = "", False, None
    for attempt in range(2):
        with socket.create_connection(("127.0.0.1", target.tls_port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname=SERVER_NAME, session=saved) as tls:
                tls.sendall(REQUEST)
                answer = b""
                while chunk := tls.recv(65536):
                    answer += chunk
                if not answer.startswith(b"HTTP/1.1 200 "):
                    raise Failure(f"{target.name}: s_time's request got {answer[:100]!r}")
                if attempt == 0:
                    said = f"{tls.version()} {tls.cipher()[0]}"
                    saved = tls.session
                else:
                    reused = tls.session_reused
    return f"{said}, resumed {'yes' if reused else 'no'}"


def measure(procs: Procs, args: argparse.Namespace, targets: dict[str, Target]) -> TlsFigures:
    """The interleaved runs, then the idle TLS connections."""
    figures = TlsFigures()
    order = [name for name in targets if targets[name].tls_port is not None]
    for name in order:
        figures.sessions[name] = session(targets[name])
        wrk(procs, targets[name], "/", args.connections, args.warmup, args.load_cpu, tls=True)
    for rep in range(args.repeat):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            target = targets[name]
            loads = [("c64", "/", args.connections, True), ("plain", "/", args.connections, False)]
            if not args.no_stream:
                loads.append(("big", "/big", args.stream_connections, True))
            for kind, path, conns, over_tls in loads:
                run = wrk(procs, target, path, conns, args.duration, args.load_cpu, over_tls)
                figures.runs.setdefault(name, {}).setdefault(kind, []).append(run)
                print(
                    f"bench: tls rep {rep + 1}/{args.repeat} {name:8} {kind:5} "
                    f"{run.rps:>9,.0f} rps  p99 {run.p99_ms:7.3f} ms  "
                    f"{run.bytes_per_s / 1024**2:8,.1f} MiB/s  CPU {run.cpu_us or 0:6.1f} us/req"
                    f"  errors {run.errors}",
                    file=sys.stderr,
                )
            for kind in HANDSHAKE_KINDS:
                hs = s_time(procs, target, kind == "reuse", args.duration, args.load_cpu,
                            args.handshake_clients)  # fmt: skip
                figures.handshakes.setdefault(name, {}).setdefault(kind, []).append(hs)
                print(
                    f"bench: tls rep {rep + 1}/{args.repeat} {name:8} {kind:5} "
                    f"{hs.per_s:>9,.0f} conn/s  CPU {hs.cpu_us or 0:7.1f} us/conn  "
                    f"{hs.bytes_per_connection:.0f} B/conn",
                    file=sys.stderr,
                )
    if args.idle_connections:
        for name in order:
            result = idle_step(procs, targets[name], args.idle_connections, args.load_cpu,
                               tls=True)  # fmt: skip
            figures.idle[name] = result
            print(
                f"bench: tls idle {name:8} {result.connections:,} held ({result.alive} still "
                f"open) RSS {result.rss_before:.1f} -> {result.rss_with:.1f} MiB "
                f"({result.kib_per_connection or 0:.2f} KiB/conn)",
                file=sys.stderr,
            )
    return figures


# ---------------------------------------------------------------------------------------------
# the report


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


IDLE_HEAD = ["target", "held", "still open", "RSS before", "RSS with", "growth", "bytes/conn",
             "RSS after close", "opened in (s)", "failures"]  # fmt: skip

Series = Callable[[TlsFigures, str], list[float | None]]


def _columns() -> list[tuple[str, Series, int, str]]:
    """(heading, the figure per repetition, digits, the issue's target for gateway/nginx)."""

    def run(kind: str, attr: str) -> Series:
        return lambda f, n: [getattr(r, attr) for r in f.runs.get(n, {}).get(kind, [])]

    def hs(kind: str, attr: str) -> Series:
        return lambda f, n: [getattr(h, attr) for h in f.handshakes.get(n, {}).get(kind, [])]

    def mib(f: TlsFigures, n: str) -> list[float | None]:
        return [r.bytes_per_s / 1024**2 for r in f.runs.get(n, {}).get("big", [])]

    def cpu_big(f: TlsFigures, n: str) -> list[float | None]:
        return [r.cpu_us / 1e3 if r.cpu_us else None for r in f.runs.get(n, {}).get("big", [])]

    def tls_own(f: TlsFigures, n: str) -> list[float | None]:
        over, plain = run("c64", "cpu_us")(f, n), run("plain", "cpu_us")(f, n)
        return [a - b if a and b else None for a, b in zip(over, plain, strict=False)]

    return [
        ("rps c64", run("c64", "rps"), 0, ""),
        ("p99 c64 (ms)", run("c64", "p99_ms"), 2, ""),
        ("CPU us/req c64", run("c64", "cpu_us"), 1, "at most 1.2 (goal 1.0)"),
        ("CPU us/req c64 plain", run("plain", "cpu_us"), 1, ""),
        ("TLS's own us/req", tls_own, 1, ""),
        ("new conn/s", hs("new", "per_s"), 0, "at least 0.8"),
        ("CPU us/conn new", hs("new", "cpu_us"), 0, ""),
        ("resumed conn/s", hs("reuse", "per_s"), 0, "at least 0.8"),
        ("CPU us/conn resumed", hs("reuse", "cpu_us"), 0, ""),
        ("10 MiB MiB/s", mib, 0, "at least 0.8"),
        ("CPU ms/10 MiB", cpu_big, 1, ""),
    ]


def report(
    args: argparse.Namespace, targets: list[str], figures: TlsFigures, head: list[str]
) -> str:
    """The ``tls`` section: how it was run, medians, ratios per repetition, idle memory."""
    columns = _columns()
    rows = [
        [name, *(_fmt(_median(of(figures, name)), digits) for _, of, digits, _ in columns)]
        for name in targets
    ]
    ratio_rows = []
    for name in (t for t in targets if t.startswith("gateway")):
        for heading, of, _, goal in columns:
            ratios = [
                a / b
                for a, b in zip(of(figures, name), of(figures, "nginx"), strict=False)
                if a is not None and b
            ]
            if ratios:
                each = ", ".join(f"{r:.2f}" for r in ratios)
                median = statistics.median(ratios)
                ratio_rows.append([f"{name}/nginx", heading, each, f"{median:.2f}", goal or "-"])
    idle_rows = []
    for name in targets:
        r = figures.idle.get(name)
        if r is None:
            continue
        errors = ", ".join(f"{k} {v}" for k, v in r.errors.items()) or "-"
        per_conn = r.growth * 1024 * 1024 / r.connections if r.connections else None
        idle_rows.append([
            name, f"{r.connections:,}", _fmt(r.alive), f"{r.rss_before:.1f}", f"{r.rss_with:.1f}",
            f"{r.growth:.1f}", _fmt(per_conn), f"{r.rss_after:.1f}", f"{r.seconds:.1f}", errors,
        ])  # fmt: skip
    every = []
    for name in targets:
        for kind, runs in figures.runs.get(name, {}).items():
            for i, r in enumerate(runs, 1):
                every.append([
                    name, kind, str(i), f"{r.rps:,.0f}", f"{r.p99_ms:.3f}",
                    f"{r.bytes_per_s / 1024**2:,.1f}", _fmt(r.cpu_us, 1),
                    f"{r.errors} ({r.error_kinds})" if r.errors else "0",
                ])  # fmt: skip
        for kind, hss in figures.handshakes.get(name, {}).items():
            for i, h in enumerate(hss, 1):
                every.append([
                    name, kind, str(i), f"{h.per_s:,.0f} conn/s", "-", "-", _fmt(h.cpu_us, 1),
                    f"{h.connections:,} conns, {h.bytes_per_connection:.0f} B each",
                ])  # fmt: skip
    negotiated = "; ".join(f"{name}: {said}" for name, said in figures.sessions.items())
    parts = [
        "## TLS termination",
        "",
        *head,
        "",
        f"What a client negotiated (Python's ssl): {negotiated}.",
        "",
        _markdown(["target", *(c[0] for c in columns)], rows),
        "",
        "Ratios gateway/nginx, repetition by repetition (each repetition runs both within "
        "minutes, so its ratio cancels much of what other work on the host does to both), the "
        "median of those, and the issue's target:",
        "",
        _markdown(["pair", "figure", "per repetition", "median", "target"], ratio_rows),
    ]
    if idle_rows:
        parts += [
            "",
            f"Idle TLS connections (`idle.py --tls`): {args.idle_connections:,} opened, 128 at "
            "a time, each with one `GET /` over TLS, then held silent; RSS (MiB) of the "
            "target's process tree before, with them, and 2 s after they closed; bytes per "
            "connection is the growth over the connections held.",
            "",
            _markdown(IDLE_HEAD, idle_rows),
        ]
    parts += [
        "",
        "Every run:",
        "",
        _markdown(
            ["target", "run", "rep", "rps", "p99 (ms)", "MiB/s", "CPU us", "errors / notes"],
            every,
        ),
    ]
    return "\n".join(parts)
