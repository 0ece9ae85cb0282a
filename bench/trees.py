"""CPU per request of the gateway of several source trees, side by side in one run.

    .venv/bin/python bench/trees.py /tmp/before /tmp/after --repeat 12 --duration 5

Each argument is a tree of the repository (a ``git archive`` of a commit, say) with its own
compiled data plane (``gateway native build`` run in it). One upstream (nginx, pinned with
wrk to the load core) and one gateway per tree, one process each, pinned to the proxy core,
each run by this venv's ``gateway`` script with its tree first on ``PYTHONPATH`` and
``GATEWAY_NATIVE=1`` (a tree whose build is missing or stale fails to start), with
``run.py``'s config (``targets.gateway_config``: access log to a file, metrics, an http probe
every second, retries). Then ``wrk -t1 -c64`` against each in turn, the order rotated every
repetition; CPU per request is the gateway's own user+sys time over the requests done.

``--tracing N=JSON`` sets the ``tracing`` settings of the N-th tree (from 0; a tree may be
given twice, to run it with two settings); with ``--otlp-sink`` a local OTLP/HTTP receiver
that keeps nothing (``otlp_sink.py``, on the load core) is started, and each ``--tracing``
without an ``otlp_endpoint`` exports to it.

``run.py`` compares the gateway with nginx repetition by repetition; when the cores are
shared with other work, nginx's own figure moves as much as the gateway's, and two trees
measured in separate runs minutes apart differ by what the machine did meanwhile. Here the
trees' runs follow each other within seconds, and each repetition gives each tree's ratio to
the tree before it (before -> after, in the order given). It prints the figures and writes
nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from system import Failure, Procs, free_ports, missing_tool, stop_on_signals, wait_serving, work_dir
from targets import Limits, Target, gateway_config, start_upstream, wrk_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", type=Path, nargs="+", help="source trees, oldest first")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run (5)")
    parser.add_argument("--repeat", type=int, default=12, help="repetitions (12)")
    parser.add_argument("--proxy-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument(
        "--tracing", action="append", default=[], help="N=JSON: tree N's tracing settings"
    )
    parser.add_argument("--otlp-sink", action="store_true", help="export spans to a local sink")
    args = parser.parse_args(argv)
    tracing: dict[int, dict] = {}
    for given in args.tracing:
        index, _, settings = given.partition("=")
        tracing[int(index)] = json.loads(settings)
    if len(args.trees) < 2 or args.repeat < 1:
        parser.error("two trees or more, and --repeat 1 or more")
    tool = missing_tool()
    if tool is not None:
        print(f"bench: {tool} not found", file=sys.stderr)
        return 2
    trees = [tree.resolve() for tree in args.trees]
    names = [f"{i}:{tree.name}" for i, tree in enumerate(trees)]
    gateway = Path(sys.executable).parent / "gateway"
    stop_on_signals()
    tmp = work_dir("trees")
    procs = Procs(tmp)
    limits = Limits(max_connections=1024, nofile=4096, access_log=True)
    figures: dict[str, list[float]] = {name: [] for name in names}
    try:
        upstream, sink, *ports = free_ports(2 + 2 * len(trees))
        (tmp / "admin-token").write_text(os.urandom(16).hex())
        start_upstream(procs, upstream, args.load_cpu, limits)
        if args.otlp_sink:
            here = Path(__file__).parent
            sink_argv = [sys.executable, str(here / "otlp_sink.py"), str(sink)]
            procs.start("otlp-sink", sink_argv, args.load_cpu)
            for settings in tracing.values():
                settings.setdefault("otlp_endpoint", f"http://127.0.0.1:{sink}")
        targets = []
        for i, (name, tree) in enumerate(zip(names, trees, strict=True)):
            label = f"tree{i}"
            config = gateway_config(tmp, label, ports[2 * i], ports[2 * i + 1], upstream, limits)
            if i in tracing:
                config["tracing"] = tracing[i]
            conf = tmp / f"{label}.json"
            conf.write_text(json.dumps(config))
            env = {"PYTHONPATH": str(tree), "GATEWAY_NATIVE": "1"}
            proc = procs.start(
                label, [str(gateway), "serve", "-c", str(conf)], args.proxy_cpu, env=env
            )
            target = Target(name, ports[2 * i], proc, "gateway")
            wait_serving(proc, target.url())
            targets.append(target)
        for target in targets:  # warm-up
            wrk_cpu(procs, target, 2, args.load_cpu)
        for rep in range(args.repeat):
            turn = rep % len(targets)
            for target in targets[turn:] + targets[:turn]:
                rps, cpu = wrk_cpu(procs, target, args.duration, args.load_cpu)
                figures[target.name].append(cpu)
                print(f"rep {rep + 1} {target.name}: {rps:,.0f} rps, CPU {cpu:.2f} us/req, "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all_uninterrupted()
        shutil.rmtree(tmp, ignore_errors=True)
    for name in names:
        print(f"{name}: median CPU {statistics.median(figures[name]):.2f} us/req")
    for before, after in itertools.pairwise(names):
        ratios = [b / a for a, b in zip(figures[before], figures[after], strict=True)]
        each = ", ".join(f"{r:.3f}" for r in ratios)
        print(f"{after} / {before} per repetition: {each} (median {statistics.median(ratios):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
