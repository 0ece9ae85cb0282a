"""Memory per process: the gateway's worker and main processes against an nginx worker.

    .venv/bin/python bench/memory.py --duration 6 --repeat 3 [--connections 10000]
        [--idle-connections 10000]

Starts, as ``run.py`` does, the upstream (nginx, with wrk on the load core), nginx as a proxy
(1 worker), ``floor`` (``floor_server.py``: a fixed 200 from uvloop and llhttp on this
interpreter, what any server on that interpreter, loop and parser holds) and two gateways as
users run them (``targets.gateway_config``), all on the proxy core: ``gateway`` (one process)
and ``gateway-w2`` (``--workers 2``: a main process that runs the controller, the probes and
the admin API, and two worker processes that serve). For every process of each tree it reads
VmRSS and, from ``/proc/PID/smaps_rollup``, the USS (private pages: what another worker adds)
and the PSS; idle (after a settle), then under ``wrk -t1 -c64`` (the largest of samples every
0.25 s), interleaved over ``--repeat`` repetitions, the order rotating. Then each target in
turn holds ``--idle-connections`` idle keep-alive connections (``idle.idle_step``, as
``run.py``'s idle step): KiB per connection. And, in fresh interpreters, what importing a
worker's and the main process's modules costs (VmRSS after ``import gateway.workers.worker`` /
``controller.serving``, the composition root).

Every target is configured for the same capacity: ``--connections`` client connections (the
gateway's default ``max_connections``, 10,000). A gateway worker's ``max_connections`` counts
client connections; nginx's ``worker_connections`` counts every connection its worker holds,
the proxied ones to the upstream too, and nginx allocates its connection and event tables for
all of them as it starts (about 0.4 KiB each): nginx gets twice ``--connections``. The budget
(docs/decisions.md): a worker's USS at most twice an nginx worker's so configured; the RSS of
each is reported beside it, and where both workers' pages are (``/proc/PID/smaps``, by what
maps them) after the last repetition's load.

Writes the ``memory`` section of ``--output`` (default ``bench/out/memory.md``, gitignored).
The gateways run their data plane as built (``gateway native status``): it never builds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import results
from idle import IdleResult, idle_step
from interpreter import Interpreter
from system import (
    Failure,
    Procs,
    free_ports,
    missing_tool,
    process_tree,
    raise_nofile,
    stop_on_signals,
    wait_serving,
    work_dir,
)
from targets import Limits, Target, native_status, start_gateway, start_nginx, start_upstream

REPO = Path(__file__).resolve().parent.parent
FLOOR = REPO / "bench" / "floor_server.py"


@dataclass
class Mem:
    """MiB of one process: resident, private (USS) and proportional (PSS)."""

    rss: float
    uss: float
    pss: float


def mem(pid: int) -> Mem | None:
    """One process's figures from ``smaps_rollup`` (None once it is gone)."""
    kib: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        with contextlib.suppress(ValueError, IndexError):
            kib[key] = int(rest.split()[0])
    uss = kib.get("Private_Clean", 0) + kib.get("Private_Dirty", 0)
    return Mem(kib.get("Rss", 0) / 1024, uss / 1024, kib.get("Pss", 0) / 1024)


MAPPED = (
    ("OpenSSL (libcrypto, libssl, `_ssl`)", ("libcrypto.", "libssl.", "/_ssl.")),
    ("libpython", ("libpython",)),
    ("the compiled data plane", ("_native__mypyc",)),
    ("uvloop's `loop.so`", ("/uvloop/loop.",)),
    ("libc, libm, ld.so", ("/libc.so", "/libm.so", "/ld-linux")),
)
"""What a worker maps, by the file's path; the rest: the process's own data (heap, anonymous
memory, stack), its program (``nginx``, ``python``) and other files."""
OWN = "its own data (heap, anonymous, stack)"


def mapped(pid: int) -> dict[str, tuple[float, float]]:
    """MiB resident and private of one process, by what maps the pages (``MAPPED``)."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
        program = Path(os.readlink(f"/proc/{pid}/exe")).name
    except OSError:
        return {}
    out: dict[str, tuple[float, float]] = {}
    what = ""
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            path = head[5] if len(head) == 6 else ""
            what = next((name for name, keys in MAPPED if any(k in path for k in keys)), "")
            if not what:
                if not path or path.startswith("["):
                    what = OWN
                elif Path(path).name == program:
                    what = f"the program (`{program}`)"
                else:
                    what = "other files (extension modules, libraries)"
        elif line.startswith(("Rss:", "Private_Clean:", "Private_Dirty:")) and what:
            rss, private = out.get(what, (0.0, 0.0))
            kib = int(line.split()[1]) / 1024
            if line.startswith("Rss:"):
                out[what] = (rss + kib, private)
            else:
                out[what] = (rss, private + kib)
    return out


def roles(target: Target) -> dict[str, int]:
    """The processes of a target's tree by role: ``main`` and ``worker-N`` (nginx: its
    master is ``main``; a gateway without workers has only ``main``)."""
    pids = process_tree(target.proc.pid)
    # The root is taskset's exec of the target itself: the same pid.
    out = {"main": pids[0]}
    for i, pid in enumerate(sorted(pids[1:]), 1):
        out[f"worker-{i}"] = pid
    return out


class Sampler:
    """The largest RSS and USS of each process, sampled every ``interval`` s from a thread."""

    def __init__(self, pids: dict[str, int], interval: float = 0.25) -> None:
        self.pids = pids
        self.interval = interval
        self.max: dict[str, Mem] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            for role, pid in self.pids.items():
                now = mem(pid)
                if now is None:
                    continue
                top = self.max.setdefault(role, now)
                top.rss, top.uss, top.pss = (max(top.rss, now.rss), max(top.uss, now.uss),
                                             max(top.pss, now.pss))  # fmt: skip
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Figures:
    idle: dict[str, dict[str, Mem]] = field(default_factory=dict)
    """target -> role -> figures, idle before the load."""
    loaded: dict[str, list[dict[str, Mem]]] = field(default_factory=dict)
    """target -> per repetition, role -> the largest figures under load."""
    rps: dict[str, list[float]] = field(default_factory=dict)
    conns: dict[str, IdleResult] = field(default_factory=dict)
    imports: dict[str, float] = field(default_factory=dict)
    mapped: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    """``target role`` -> ``mapped`` of that worker after the last repetition's load."""


def wrk_sampled(procs: Procs, target: Target, duration: int, cpu: int) -> tuple[float, dict]:
    """``wrk -t1 -c64`` on ``target`` while its processes are sampled."""
    argv = ["wrk", "-t1", "-c64", f"-d{duration}s", target.url()]
    with Sampler(roles(target)) as sampler:
        proc = procs.start(f"wrk-{target.name}", argv, cpu)
        try:
            proc.popen.wait(duration + 30)
        finally:
            procs.finish(proc)
    text = proc.log.read_text()
    rps = next((float(w.split()[1]) for w in text.splitlines() if w.startswith("Requests/sec")),
               0.0)  # fmt: skip
    return rps, sampler.max


def import_rss(module: str, pure: bool, worker: bool = False) -> float:
    """VmRSS (MiB) of a fresh interpreter once ``module`` is imported, after
    ``gateway.native.use()`` as the gateway's entry points call it; with ``worker``, as a
    worker process starts (``python -OO -X no_debug_ranges``, handed the sources' digest: the
    supervisor's ``native.sources()``)."""
    code = ("import sys, gateway.native; gateway.native.use(sources=(sys.argv[1:] or [None])[0]); "
            f"import {module}, re; s = open('/proc/self/status').read(); "
            "print(int(re.search(r'VmRSS:\\s+(\\d+)', s).group(1)))")  # fmt: skip
    env = {**os.environ, "GATEWAY_NATIVE": "0" if pure else ""}
    argv = [sys.executable, "-c", code]
    if worker:
        sources = subprocess.run(
            [sys.executable, "-c", "import gateway.native as n; print(n.sources() or '')"],
            capture_output=True, text=True, env=env, cwd=REPO, timeout=60, check=True,
        ).stdout.strip()  # fmt: skip
        argv = [sys.executable, "-OO", "-X", "no_debug_ranges", "-c", code,
                *([sources] if sources else [])]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
                         check=True)  # fmt: skip
    return int(out.stdout.strip()) / 1024


def measure(procs: Procs, args: argparse.Namespace, targets: dict[str, Target]) -> Figures:
    figures = Figures()
    worker = "gateway.workers.worker"
    figures.imports["`uvloop`"] = import_rss("uvloop", args.pure)
    figures.imports[f"`{worker}`"] = import_rss(worker, args.pure)
    figures.imports[f"`{worker}` as a worker starts"] = import_rss(worker, args.pure, worker=True)
    figures.imports["`controller.serving`"] = import_rss("controller.serving", args.pure)
    for target in targets.values():  # warm-up, then the idle figures
        wrk_sampled(procs, target, args.warmup, args.load_cpu)
    for name, target in targets.items():
        figures.idle[name] = {r: m for r, p in roles(target).items() if (m := mem(p))}
    order = list(targets)
    for rep in range(args.repeat):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            rps, top = wrk_sampled(procs, targets[name], args.duration, args.load_cpu)
            figures.loaded.setdefault(name, []).append(top)
            figures.rps.setdefault(name, []).append(rps)
            if rep == args.repeat - 1 and name != "gateway":
                role = "main" if name == "floor" else "worker-1"
                figures.mapped[f"{name} {role}"] = mapped(roles(targets[name])[role])
            worst = ", ".join(f"{r} {m.rss:.1f}/{m.uss:.1f}" for r, m in top.items())
            print(f"bench: rep {rep + 1} {name:10} {rps:>9,.0f} rps  RSS/USS MiB: {worst}",
                  file=sys.stderr)  # fmt: skip
    if args.idle_connections:
        for name in ("nginx", "gateway"):
            result = idle_step(procs, targets[name], args.idle_connections, args.load_cpu)
            figures.conns[name] = result
            print(f"bench: idle {name}: {result.kib_per_connection or 0:.2f} KiB/conn",
                  file=sys.stderr)  # fmt: skip
    return figures


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(args: argparse.Namespace, figures: Figures, load: tuple[float, ...]) -> str:
    def loaded(name: str, role: str, attr: str) -> list[float]:
        return [getattr(rep[role], attr) for rep in figures.loaded.get(name, []) if role in rep]

    def worker_roles(name: str) -> list[str]:
        return sorted(r for r in figures.idle.get(name, {}) if r.startswith("worker"))

    rows = []
    for name in figures.idle:
        for role in ["main", *worker_roles(name)]:
            idle = figures.idle[name].get(role)
            if idle is None:
                continue
            label = "master" if name == "nginx" and role == "main" else role
            rows.append(
                f"| {name} | {label} | {idle.rss:.1f} | {idle.uss:.1f} | {idle.pss:.1f} | "
                f"{_median(loaded(name, role, 'rss')):.1f} | "
                f"{_median(loaded(name, role, 'uss')):.1f} |"
            )
    ratio_rows, budget = [], []
    ngx = "worker-1"
    for name in ("floor", "gateway", "gateway-w2"):
        for role in ["main"] if name != "gateway-w2" else worker_roles(name):
            for attr in ("rss", "uss"):
                mine, theirs = loaded(name, role, attr), loaded("nginx", ngx, attr)
                each = [a / b for a, b in zip(mine, theirs, strict=False) if b > 0]
                text = ", ".join(f"{r:.2f}" for r in each)
                what = role if name == "gateway-w2" else "the process"
                ratio_rows.append(f"| {name} {what} / nginx worker | {attr.upper()} | {text} | "
                                  f"**{_median(each):.2f}** |")  # fmt: skip
                if name == "gateway-w2" and attr == "uss":
                    verdict = "met" if _median(each) <= 2 else "**not met**"
                    budget.append(f"{role} {_median(each):.2f} ({verdict})")
    found = {k for m in figures.mapped.values() for k in m}
    first = [OWN, *(name for name, _ in MAPPED)]
    kinds = [k for k in first if k in found] + sorted(found.difference(first))
    mapped_rows = [
        f"| {kind} | "
        + " | ".join(
            f"{m[kind][0]:.2f} | {m[kind][1]:.2f}" if kind in m else "- | -"
            for m in figures.mapped.values()
        )
        + " |"
        for kind in kinds
    ]
    mapped_rows.append(
        "| all | "
        + " | ".join(
            f"{sum(v[0] for v in m.values()):.2f} | {sum(v[1] for v in m.values()):.2f}"
            for m in figures.mapped.values()
        )
        + " |"
    )
    conn_rows = [
        f"| {name} | {r.connections:,} | {r.rss_before:.1f} | {r.rss_with:.1f} | "
        f"{r.kib_per_connection or 0:.2f} | {r.rss_after:.1f} |"
        for name, r in figures.conns.items()
    ]
    imports = ", ".join(f"{m} {v:.1f}" for m, v in figures.imports.items())
    plane = native_status(args.pure)
    lines = [
        "## Memory per process (bench/memory.py)",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, `bench/memory.py "
        f"--duration {args.duration} --repeat {args.repeat} --idle-connections "
        f"{args.idle_connections} --connections {args.connections}"
        f"{' --pure' if args.pure else ''}`; data plane: {plane}. "
        f"Load average at the start and the end: {load[0]:.2f}, {os.getloadavg()[0]:.2f}. "
        "nginx (1 worker), `floor` (`bench/floor_server.py`: a fixed 200 from uvloop and "
        f"llhttp), `gateway` (1 process) and `gateway-w2` (`--workers 2`) on CPU "
        f"{args.proxy_cpu}, wrk and the upstream on CPU {args.load_cpu}; access logs to a "
        "file, the gateways at their defaults (probes, metrics, retries, passive ejection) but "
        f"`max_connections` {args.connections:,}, nginx's `worker_connections` "
        f"{2 * args.connections:,} (it counts the connections to the upstream too).",
        "",
        "MiB per process. USS: private pages (`Private_Clean + Private_Dirty` of "
        "`smaps_rollup`), what one more worker costs; RSS also counts the shared libraries "
        "(libpython, uvloop, OpenSSL) each process maps. Idle: after the warm-up; under load: "
        f"the largest of samples every 0.25 s during `wrk -t1 -c64 -d{args.duration}s`, "
        "median over repetitions.",
        "",
        "| target | process | RSS idle | USS idle | PSS idle | RSS under load | USS under load |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "Ratios under load, per repetition, and their median:",
        "",
        "| ratio | of | per repetition | median |",
        "| --- | --- | --- | ---: |",
        *ratio_rows,
        "",
        "The budget (docs/decisions.md), a worker's USS at most twice an nginx worker's: "
        + ", ".join(budget)
        + ".",
        "",
        "Where each worker's pages are, after the last repetition's load (MiB, "
        "`/proc/PID/smaps`, by what maps them; resident, then private):",
        "",
        "| mapped by | " + " | ".join(f"{w} RSS | private" for w in figures.mapped) + " |",
        "| --- |" + " ---: | ---: |" * len(figures.mapped),
        *mapped_rows,
        "",
        f"Imports alone, VmRSS (MiB) of a fresh interpreter after importing: {imports}.",
    ]
    if conn_rows:
        lines += [
            "",
            f"Idle keep-alive connections (`idle.py`, {args.idle_connections:,} held, each "
            "after one `GET /`); the single-process gateway:",
            "",
            "| target | held | RSS before | RSS with | KiB/conn | RSS after close |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
            *conn_rows,
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=int, default=6)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--connections", type=int, default=10_000,
                   help="client connections each target is configured for (nginx: twice "
                   "this, its worker_connections counting the upstream's too)")  # fmt: skip
    p.add_argument("--idle-connections", type=int, default=10_000,
                   help="held in the idle step, at most --connections; 0 skips")  # fmt: skip
    p.add_argument("--pure", action="store_true", help="the pure Python data plane")
    p.add_argument("--proxy-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1)
    p.add_argument("--output", type=Path, default=REPO / "bench" / "out" / "memory.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tool = missing_tool()
    if tool is not None:
        print(f"bench: {tool} not found", file=sys.stderr)
        return 2
    stop_on_signals()
    nofile = raise_nofile()
    if args.idle_connections > args.connections:
        print("bench: --idle-connections is at most --connections", file=sys.stderr)
        return 2
    lim = Limits(args.connections, nofile, True)
    nginx_lim = Limits(2 * args.connections, nofile, True)
    status = native_status(args.pure)
    version = sys.version.split()[0]
    python = Interpreter(Path(sys.executable), sys.executable, version, False, False, "-", status)
    load = os.getloadavg()
    tmp = work_dir("memory")
    procs = Procs(tmp)
    try:
        up, ngx, p1, a1, p2, a2, fl = free_ports(7)
        upstream = start_upstream(procs, up, args.load_cpu, nginx_lim)
        wait_serving(upstream.proc, upstream.url())
        targets = {
            "nginx": start_nginx(procs, ngx, up, args.proxy_cpu, nginx_lim),
            "floor": Target(
                "floor",
                fl,
                procs.start("floor", [sys.executable, "-OO", str(FLOOR), str(fl)], args.proxy_cpu),
            ),
            "gateway": start_gateway(
                procs, "gateway", python, (p1, a1, up), args.proxy_cpu, lim, pure=args.pure
            ),
            "gateway-w2": start_gateway(
                procs,
                "gateway-w2",
                python,
                (p2, a2, up),
                args.proxy_cpu,
                lim,
                workers=2,
                pure=args.pure,
            ),
        }
        for target in targets.values():
            wait_serving(target.proc, target.url())
        figures = measure(procs, args, targets)
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all_uninterrupted()
        shutil.rmtree(tmp, ignore_errors=True)
    results.publish("memory", report(args, figures, load), args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
