"""Worker processes: CPU per request of the gateway with 1 and with 2 workers, against nginx.

    .venv/bin/python bench/workers.py --duration 8 --repeat 3
    .venv/bin/python bench/workers.py --duration 8 --repeat 3 --output bench/RESULTS.md

It starts, in a fresh temporary directory, the upstream (nginx, 1 worker, with wrk on the load
core), nginx as a reverse proxy (1 worker, on the proxy core, as in ``run.py``) and three
gateways as users run them (``targets.gateway_config``: access log to a file, metrics, an http
probe every second, retries), each its own process with its own port:

- ``gateway-1-pinned``: ``--workers 1`` pinned to the proxy core, as ``run.py`` runs it;
- ``gateway-1``: ``--workers 1``, not pinned;
- ``gateway-2``: ``--workers 2`` (``--workers N`` to change it), not pinned: its workers are
  free to use both cores, which they share with wrk and the upstream;
- ``gateway-2-pinned``: ``--workers 2`` with the main process and both workers pinned to the
  proxy core: the same placement as ``gateway-1-pinned``, so the two differ only in the
  design (worker processes, snapshots, reports), not in contention for the cores. On a
  machine with no core to spare for the workers (2 cores, one taken by wrk and the upstream)
  this is the fair measure of what workers cost per request.

- ``gateway-2-spread``: ``--workers 2`` with one worker pinned to each core (``spread_cpus``:
  the cores other than the load core when there are enough, else every core from the proxy
  core on; the main process on the proxy core). On a 2-core machine worker 2 shares the load
  core with wrk and the upstream (no third core to give them); with 3 or more the load keeps
  a core of its own;
- ``nginx-2-spread``: nginx with 2 workers placed the same way (``worker_cpu_affinity``,
  ``listen ... reuseport`` as the gateway's workers bind): what the same placement does to a
  proxy that scales, the reference for what stops the gateway's scaling.

``gateway-1`` is the control for ``gateway-2``: the same placement (none), one worker count
apart. Then, interleaved (the order rotates each repetition), for each target: a warm-up
``wrk`` of ``--warmup`` seconds and a measured ``wrk -t1 -c64`` of ``--duration`` seconds.
CPU per request is the user+sys time of the target's whole process tree (for a gateway with
workers: the main process, which runs the controller, probes and admin API, plus every worker;
the tree is read when the run starts, since the workers are children) over the requests wrk
completed. For a gateway with workers each worker's CPU during the run is also read, as a
share of the workers' total, and the client connections each worker holds halfway through
the run (its socket descriptors matched against ``/proc/net/tcp``'s established connections
on the target's port): how evenly the kernel spread the connections (SO_REUSEPORT). The
machine's busy time (``/proc/stat``) during each run says whether both cores were saturated.

Medians over the repetitions, with the ratios gateway-2/gateway-1, each gateway/nginx, are
printed as markdown and written as the ``workers`` section of ``--output`` (default
``bench/out/workers.md``, so that the committed results change only when asked).
Every process it starts gets its own process group and is stopped by pid in a ``finally``
block, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import shutil
import statistics
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import interpreter
import results
from run import command_line, source_digest
from system import (
    CLK_TCK,
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
    PROXY_NGINX,
    Limits,
    Run,
    Target,
    start_gateway,
    start_nginx,
    start_upstream,
    wrk,
)

OUT = Path(__file__).resolve().parent / "out" / "workers.md"


# ---------------------------------------------------------------------------------------------
# what /proc says during a run


def _busy_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine so far, from ``/proc/stat``."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    total = sum(values[:8])  # user .. steal; guest time is already in user
    return total - idle, total


def _is_worker(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"gateway.workers" in argv  # python -m gateway.workers FD


def _workers(target: Target) -> list[int]:
    """The processes that serve: a gateway's workers, an nginx master's children."""
    tree = process_tree(target.proc.pid)
    if target.kind == "nginx":
        return sorted(tree[1:])
    return sorted(pid for pid in tree if _is_worker(pid))


def _established(port: int) -> set[str]:
    """Socket inodes of the established TCP connections whose local port is ``port``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def connections_per_worker(workers: list[int], port: int) -> list[int]:
    """How many of the client connections to ``port`` each worker holds now."""
    inodes = _established(port)
    out = []
    for pid in workers:
        held = 0
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            out.append(0)
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                held += 1
        out.append(held)
    return out


def spread_cpus(args: argparse.Namespace) -> list[int]:
    """The cores the ``-spread`` targets' workers go to, worker i on the i-th (wrapping):
    every core but the load core if that leaves one a worker, else every core."""
    cpus = sorted(os.sched_getaffinity(0))
    free = [c for c in cpus if c != args.load_cpu]
    chosen = free if len(free) >= args.workers else cpus
    start = chosen.index(args.proxy_cpu) if args.proxy_cpu in chosen else 0
    return chosen[start:] + chosen[:start]


def pin(pid: int, cpu: int) -> None:
    """Pin every thread of ``pid`` to ``cpu`` (``sched_setaffinity`` is per thread)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


@dataclass
class Measured:
    """One measured wrk run and what the target's processes did meanwhile."""

    run: Run
    busy: float
    """The machine's busy share (all cores) during the run, 0..1."""
    cores: float
    """The target's process tree's CPU time over the run's wall time: the cores it kept busy."""
    others: float
    """Cores kept busy by what this benchmark did not start: the machine's busy time less the
    CPU of every process it started (the targets, idle ones included, the upstream and wrk)."""
    main_us: float | None = None
    """CPU per request of the gateway's main process alone (with workers: not serving)."""
    shares: list[float] = field(default_factory=list)
    """Each worker's share of the workers' CPU during the run, largest first."""
    spread: list[int] = field(default_factory=list)
    """Client connections each worker held halfway through the run, largest first."""
    note: str = ""


def _children_cpu() -> float:
    """User+sys time of this process's children that have exited and been waited for (wrk)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured_wrk(
    procs: Procs, target: Target, connections: int, duration: float, load_cpu: int
) -> Measured:
    """``targets.wrk`` on ``target``, with each process of its tree read before and after, and
    the machine's busy time and the CPU of everything else this benchmark started."""
    root = target.proc.pid
    pids = process_tree(root)
    workers = _workers(target) if target.kind == "nginx" and len(pids) > 2 else []
    workers = workers or [pid for pid in pids if _is_worker(pid)]
    spread: list[int] = []
    halfway = threading.Timer(
        duration / 2, lambda: spread.extend(connections_per_worker(workers, target.port))
    )
    ours = sorted({pid for proc in procs.started for pid in process_tree(proc.pid)})
    before = {pid: cpu_seconds([pid]) for pid in pids}
    ours0, wrk0 = cpu_seconds(ours), _children_cpu()
    busy0, total0 = _busy_ticks()
    if len(workers) > 1:
        halfway.start()
    try:
        run = wrk(procs, target, "/", connections, duration, load_cpu)
    finally:
        halfway.cancel()
        if halfway.is_alive():
            halfway.join()
    busy1, total1 = _busy_ticks()
    ours1, wrk1 = cpu_seconds(ours), _children_cpu()
    after = {pid: cpu_seconds([pid]) for pid in pids}
    note = ""
    gone = [pid for pid in pids if not Path(f"/proc/{pid}").exists()]
    new = sorted(set(process_tree(root)) - set(pids))
    if gone or new:
        note = f"processes gone {gone}, new {new} during the run"
    ncpu = os.cpu_count() or 1
    wall = (total1 - total0) / CLK_TCK / ncpu  # the seconds /proc/stat covered
    busy = (busy1 - busy0) / max(1, total1 - total0)
    mine = ours1 - ours0 + wrk1 - wrk0
    tree = sum(after.values()) - sum(before.values())
    others = max(0.0, busy * ncpu - mine / wall) if wall > 0 else 0.0
    out = Measured(run, busy, tree / run.seconds, others, note=note)
    out.spread = sorted(spread, reverse=True)
    if len(workers) > 1 and run.requests:
        out.main_us = (after[root] - before[root]) / run.requests * 1e6
        used = [after[pid] - before[pid] for pid in workers]
        if sum(used) > 0:
            out.shares = sorted((u / sum(used) for u in used), reverse=True)
    return out


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Variant:
    name: str
    what: str
    workers: int
    pinned: bool
    spread: bool = False
    """One worker per core (``spread_cpus``), the main process on the proxy core."""


def variants(args: argparse.Namespace) -> list[Variant]:
    return [
        Variant("nginx", "nginx, 1 worker", 1, True),
        Variant("gateway-1-pinned", "gateway --workers 1", 1, True),
        Variant("gateway-1", "gateway --workers 1", 1, False),
        Variant(
            f"gateway-{args.workers}", f"gateway --workers {args.workers}", args.workers, False
        ),
        Variant(
            f"gateway-{args.workers}-pinned",
            f"gateway --workers {args.workers}",
            args.workers,
            True,
        ),
        Variant(
            f"gateway-{args.workers}-spread",
            f"gateway --workers {args.workers}, a worker per core",
            args.workers,
            False,
            spread=True,
        ),
        Variant(
            f"nginx-{args.workers}-spread",
            f"nginx, {args.workers} workers (reuseport), a worker per core",
            args.workers,
            False,
            spread=True,
        ),
    ]


def start_nginx_workers(
    procs: Procs, name: str, port: int, upstream: int, cpus: list[int], limits: Limits
) -> Target:
    """nginx as ``start_nginx`` starts it, with a worker on each of ``cpus``
    (``worker_cpu_affinity``) and a listener each (``reuseport``)."""
    masks = " ".join(format(1 << cpu, "b") for cpu in cpus)
    tmp = procs.tmp / name
    tmp.mkdir()
    conf = PROXY_NGINX.format(
        tmp=tmp, port=port, upstream=upstream, access_log=f"{tmp}/access.log",
        max_connections=limits.max_connections, nofile=limits.nofile, tls="",
    )  # fmt: skip
    conf = conf.replace("worker_processes 1;", f"worker_processes {len(cpus)};\n"
                        f"worker_cpu_affinity {masks};")  # fmt: skip
    conf = conf.replace("backlog=4096;", "reuseport backlog=4096;")
    (tmp / "nginx.conf").write_text(conf)
    argv = ["nginx", "-e", f"{tmp}/error.log", "-p", str(tmp), "-c", f"{tmp}/nginx.conf"]
    return Target(name, port, procs.start(name, argv, None), "nginx")


def start_targets(
    procs: Procs, args: argparse.Namespace, python: interpreter.Interpreter
) -> dict[str, Target]:
    limits = Limits(max_connections=10_000, nofile=raise_nofile(), access_log=True)
    up, nginx_port = free_ports(2)
    upstream = start_upstream(procs, up, args.load_cpu, limits)
    wait_serving(upstream.proc, upstream.url())
    targets = {"nginx": start_nginx(procs, nginx_port, up, args.proxy_cpu, limits)}
    for v in variants(args)[1:]:
        port, admin = free_ports(2)
        if v.name.startswith("nginx"):
            cpus = [spread_cpus(args)[i % len(spread_cpus(args))] for i in range(v.workers)]
            targets[v.name] = start_nginx_workers(procs, v.name, port, up, cpus, limits)
            continue
        cpu = args.proxy_cpu if v.pinned else None
        targets[v.name] = start_gateway(
            procs, v.name, python, (port, admin, up), cpu, limits, workers=v.workers
        )
    for target in targets.values():
        wait_serving(target.proc, target.url())
    cpus = spread_cpus(args)
    for v in variants(args):
        if v.workers > 1:
            found = _workers(targets[v.name])
            if len(found) != v.workers:
                raise Failure(f"{v.name}: {len(found)} worker processes, not {v.workers}")
            if v.spread and v.name.startswith("gateway"):
                pin(targets[v.name].proc.pid, args.proxy_cpu)
                for i, pid in enumerate(found):
                    pin(pid, cpus[i % len(cpus)])
    return targets


def measure(
    procs: Procs, args: argparse.Namespace, targets: dict[str, Target]
) -> dict[str, list[Measured]]:
    runs: dict[str, list[Measured]] = {name: [] for name in targets}
    order = list(targets)
    for rep in range(args.repeat):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            target = targets[name]
            wrk(procs, target, "/", args.connections, args.warmup, args.load_cpu)
            m = measured_wrk(procs, target, args.connections, args.duration, args.load_cpu)
            runs[name].append(m)
            r = m.run
            print(
                f"workers: rep {rep + 1}/{args.repeat} {name:17} {r.rps:>8,.0f} rps  "
                f"p50 {r.p50_ms:6.2f} ms  p99 {r.p99_ms:6.2f} ms  CPU {_fmt(r.cpu_us, 1):>5} "
                f"us/req  {m.cores:.2f} cores  busy {m.busy:4.0%}  others {m.others:.2f}  "
                f"shares {_shares(m.shares)}  conns {_spread(m.spread)}  errors {r.errors}"
                + (f"  ({m.note})" if m.note else ""),
                file=sys.stderr,
            )
    return runs


# ---------------------------------------------------------------------------------------------
# the report


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _shares(shares: list[float]) -> str:
    return " / ".join(f"{s:.0%}" for s in shares) if shares else "-"


def _spread(spread: list[int]) -> str:
    return " / ".join(str(n) for n in spread) if spread else "-"


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None and v == v]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def report(
    args: argparse.Namespace,
    runs: dict[str, list[Measured]],
    python: interpreter.Interpreter,
    at: datetime.datetime,
    load: tuple[float, float],
    sources: str,
) -> str:
    vs = variants(args)
    many = f"gateway-{args.workers}"

    def cpu(name: str) -> float | None:
        return _median([m.run.cpu_us for m in runs[name]])

    rows = []
    for v in vs:
        ms = runs[v.name]
        shares = (
            [statistics.median(m.shares[i] for m in ms) for i in range(v.workers)]
            if v.workers > 1 and all(len(m.shares) == v.workers for m in ms)
            else []
        )
        rows.append(
            [
                f"`{v.name}`",
                v.what,
                f"CPU {args.proxy_cpu}"
                if v.pinned
                else (
                    "CPUs " + ", ".join(map(str, spread_cpus(args)[: v.workers]))
                    if v.spread
                    else "no"
                ),
                _fmt(_median([m.run.rps for m in ms])),
                _fmt(_median([m.run.p50_ms for m in ms]), 2),
                _fmt(_median([m.run.p99_ms for m in ms]), 2),
                _fmt(cpu(v.name), 1),
                "-" if v.name == "nginx" else _ratio(cpu(v.name), cpu("nginx")),
                _fmt(_median([m.cores for m in ms]), 2),
                _fmt(_median([m.main_us for m in ms]), 2) if v.workers > 1 else "-",
                _shares(shares),
                " / ".join(
                    _fmt(_median([m.spread[i] for m in ms if len(m.spread) > i]))
                    for i in range(v.workers)
                )
                if v.workers > 1
                else "-",
                f"{_median([m.busy for m in ms]) or 0:.0%}",
                _fmt(_median([m.others for m in ms]), 2),
                str(sum(m.run.errors for m in ms)),
            ]
        )
    head = ["target", "what", "pinned", "rps", "p50 (ms)", "p99 (ms)", "CPU us/req",
            "CPU vs nginx", "cores used", "main process us/req", "worker CPU shares",
            "connections per worker", "machine busy", "other load (cores)", "errors"]  # fmt: skip
    table = "\n".join("| " + " | ".join(row) + " |" for row in [head, ["---"] * len(head), *rows])
    every = []
    for v in vs:
        cells = [
            f"{m.run.rps:,.0f} rps, {_fmt(m.run.cpu_us, 1)} us/req"
            + (f", shares {_shares(m.shares)}" if m.shares else "")
            + (f", connections {_spread(m.spread)}" if m.spread else "")
            + f", {m.cores:.2f} cores, busy {m.busy:.0%}, others {m.others:.2f}"
            + (f", errors {m.run.errors} ({m.run.error_kinds})" if m.run.errors else "")
            + (f", {m.note}" if m.note else "")
            for m in runs[v.name]
        ]
        every.append(f"- `{v.name}`: " + "; ".join(cells))
    return "\n".join(
        [
            "## Workers: CPU per request with 1 and 2 worker processes",
            "",
            f"Run {at:%Y-%m-%d %H:%M} UTC with:",
            "",
            "```sh",
            command_line(),
            "```",
            "",
            f"Medians of {args.repeat} interleaved repetitions; each measured run is "
            f"`wrk -t1 -c{args.connections}` for {args.duration:g} s on `/` (13-byte body), "
            f"after a {args.warmup:g} s warm-up of the same target. wrk and the upstream (nginx, "
            f"1 worker) on CPU {args.load_cpu}, nginx as a proxy (1 worker) on CPU "
            f"{args.proxy_cpu}; the machine has {os.cpu_count()} cores. Every gateway as users "
            "run it (access log to a file, metrics, an http probe every second, retries), run "
            f"by {python.label}, {python.plane}; sources {sources}. CPU us/req: user+sys "
            "time of the target's whole process tree (a gateway's main process and its "
            "workers) during the run over "
            "the requests wrk completed. Main process us/req: the part of it the main process "
            "(controller, probes, admin API, the workers' reports) took. Worker CPU shares: "
            "each worker's part of the workers' CPU, largest first. Cores used: the tree's CPU "
            "time over the run's wall time. Machine busy: the busy share of all "
            f"{os.cpu_count()} cores during the run (`/proc/stat`); other load: the cores kept "
            "busy meanwhile by processes this benchmark did not start (machine busy time less "
            "the CPU of the targets, the upstream and wrk): work of others on the machine. "
            "Load average "
            f"(1 min) at the start and the end: {load[0]:.2f}, {load[1]:.2f}.",
            "",
            table,
            "",
            f"CPU per request, {args.workers} workers over 1 worker: "
            f"**{_ratio(cpu(many + '-pinned'), cpu('gateway-1-pinned'))}** with both pinned to "
            f"CPU {args.proxy_cpu} (the same placement), "
            f"{_ratio(cpu(many), cpu('gateway-1'))} with neither pinned (the workers then "
            "compete with wrk and the upstream for the cores).",
            "",
            *scaling(args, runs),
            "",
            "Every run:",
            "",
            *every,
        ]
    )


def scaling(args: argparse.Namespace, runs: dict[str, list[Measured]]) -> list[str]:
    """Every core: a worker per core against one process on the proxy core, for the gateway
    and for nginx, repetition by repetition."""
    n = args.workers
    lines = []
    for many, one in ((f"gateway-{n}-spread", "gateway-1-pinned"), (f"nginx-{n}-spread", "nginx")):
        if many not in runs or one not in runs:
            continue
        pairs = list(zip(runs[many], runs[one], strict=False))
        rps = [a.run.rps / b.run.rps for a, b in pairs if b.run.rps]
        cpu = [a.run.cpu_us / b.run.cpu_us for a, b in pairs if a.run.cpu_us and b.run.cpu_us]
        lines.append(
            f"- `{many}` over `{one}`: requests/s "
            + ", ".join(f"{r:.2f}" for r in rps)
            + f" (median **{_median(list(rps)) or 0:.2f}**), CPU per request "
            + ", ".join(f"{r:.2f}" for r in cpu)
            + f" (median **{_median(list(cpu)) or 0:.2f}**)"
        )
    if not lines:
        return []
    cpus = spread_cpus(args)
    placed = ", ".join(f"worker {i + 1} on CPU {cpus[i % len(cpus)]}" for i in range(n))
    shared = args.load_cpu in cpus[:n]
    return [
        f"Every core ({placed}; wrk and the upstream on CPU {args.load_cpu}"
        f"{', shared with a worker' if shared else ', a core of their own'}), per repetition:",
        "",
        *lines,
    ]


# ---------------------------------------------------------------------------------------------
# the command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=int, default=8, help="seconds per measured run (8)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions (3)")
    p.add_argument("--warmup", type=int, default=2, help="seconds of warm-up before each run (2)")
    p.add_argument("--connections", type=int, default=64, help="wrk connections (64)")
    p.add_argument("--workers", type=int, default=2, help="worker count compared with 1 (2)")
    p.add_argument("--python", type=Path, default=Path(sys.executable),
                   help="interpreter that runs the gateway (default: this one)")  # fmt: skip
    p.add_argument("--proxy-cpu", type=int, default=0, help="nginx and gateway-1-pinned")
    p.add_argument("--load-cpu", type=int, default=1, help="wrk and the upstream")
    p.add_argument("--output", type=Path, default=OUT,
                   help="where the `workers` section goes (bench/out/workers.md)")  # fmt: skip
    p.add_argument("--keep-tmp", action="store_true", help="keep configs and logs")
    args = p.parse_args(argv)
    if not 1 <= args.duration <= 600 or not 1 <= args.repeat <= 50:
        p.error("--duration in [1, 600], --repeat in [1, 50]")
    if not 1 <= args.warmup <= 60 or not 2 <= args.workers <= 16:
        p.error("--warmup in [1, 60], --workers in [2, 16]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tool = missing_tool()
    if tool is not None:
        print(f"workers: {tool} not found (apt-get install wrk nginx-light)", file=sys.stderr)
        return 2
    stop_on_signals()
    at = datetime.datetime.now(datetime.UTC)
    load_start = os.getloadavg()[0]
    sources = source_digest()  # as the run starts, as run.py does
    tmp = work_dir("workers")
    procs = Procs(tmp)
    try:
        python = interpreter.resolve(args.python)
        targets = start_targets(procs, args, python)
        print(f"workers: {', '.join(targets)} serving; tmp {tmp}", file=sys.stderr)
        runs = measure(procs, args, targets)
    except Failure as e:
        print(f"workers: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("workers: interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        procs.stop_all_uninterrupted()
        if args.keep_tmp:
            print(f"workers: configs and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, runs, python, at, (load_start, os.getloadavg()[0]), sources)
    results.publish("workers", text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
