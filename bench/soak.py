"""Soak: the gateway under constant load for ten minutes, its RSS sampled throughout.

    .venv/bin/python bench/soak.py                 # 20 segments of 30 s: 10 minutes
    .venv/bin/python bench/soak.py --minutes 1     # a quick check

It starts the upstream (nginx, as in ``run.py``) and the gateway as users run it (access log
to a file, metrics, probes, retries), then keeps ``wrk -t1 -c64`` on it in back-to-back
segments of ``--segment`` seconds (each wrk run bounded), while a thread samples the gateway's
VmRSS every ``--sample`` seconds. A leak shows as a steady climb once the caches, pools and
allocator arenas have filled, so the slope is fitted (least squares) only after the first
minute of warm-up. It reports the first, last, lowest and highest RSS, that slope in MiB per
minute, the RSS per segment, and writes the ``soak`` section of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
from pathlib import Path

import interpreter
import results
from system import (
    Failure,
    Procs,
    RssSampler,
    free_ports,
    missing_tool,
    raise_nofile,
    stop_on_signals,
    wait_serving,
    work_dir,
)
from targets import Limits, Run, start_gateway, start_upstream, wrk

FLAT_MIB = 2.0
"""Growth after warm-up (the fitted slope over the measured span) below which RSS is flat."""


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, MiB)`` samples, in MiB per minute."""
    if len(samples) < 2:
        return None
    xs, ys = [t for t, _ in samples], [mib for _, mib in samples]
    return statistics.linear_regression(xs, ys).slope * 60


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the load (10)")
    p.add_argument("--segment", type=int, default=30, help="seconds per wrk run (30)")
    p.add_argument("--connections", type=int, default=64, help="wrk connections (64)")
    p.add_argument("--sample", type=float, default=2.0, help="seconds between RSS samples (2)")
    p.add_argument("--warmup", type=float, default=1.0,
                   help="minutes left out of the slope (1; at most half the run)")  # fmt: skip
    p.add_argument("--python", type=Path, default=Path(sys.executable),
                   help="interpreter that runs the gateway (default: this one)")  # fmt: skip
    p.add_argument("--proxy-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1, help="wrk and the upstream")
    p.add_argument("--output", type=Path, default=results.RESULTS)
    args = p.parse_args(argv)
    if not 0 < args.minutes <= 120 or not 1 <= args.segment <= 600 or args.sample <= 0:
        p.error("--minutes in (0, 120], --segment in [1, 600], --sample above 0")
    return args


def soak(
    procs: Procs, args: argparse.Namespace, python: interpreter.Interpreter
) -> tuple[list[tuple[float, float]], list[Run]]:
    """Run the load; return the RSS samples (seconds since the start, MiB) and every segment."""
    up, port, admin = free_ports(3)
    limits = Limits(max_connections=10_000, nofile=raise_nofile(), access_log=True)
    upstream = start_upstream(procs, up, args.load_cpu, limits)
    wait_serving(upstream.proc, upstream.url())
    gateway = start_gateway(procs, "gateway", python, (port, admin, up), args.proxy_cpu, limits)
    wait_serving(gateway.proc, gateway.url())
    segments = max(1, round(args.minutes * 60 / args.segment))
    runs = []
    with RssSampler([gateway.proc.pid], args.sample) as rss:
        for i in range(segments):
            run = wrk(procs, gateway, "/", args.connections, args.segment, args.load_cpu)
            runs.append(run)
            print(
                f"soak: {i + 1}/{segments} {run.rps:,.0f} rps, errors {run.errors}, "
                f"RSS {rss.samples[-1][1]:.1f} MiB",
                file=sys.stderr,
            )
    start = rss.samples[0][0]
    return [(t - start, mib) for t, mib in rss.samples], runs


def report(
    args: argparse.Namespace,
    python: interpreter.Interpreter,
    samples: list[tuple[float, float]],
    runs: list[Run],
    at: datetime.datetime,
) -> str:
    span = samples[-1][0]
    warmup = min(args.warmup * 60, span / 2)
    after = [(t, mib) for t, mib in samples if t >= warmup]
    slope = slope_mib_per_min(after)
    growth = slope * (span - warmup) / 60 if slope is not None else None
    mibs = [mib for _, mib in samples]
    verdict = (
        "not enough samples"
        if growth is None
        else f"{'flat' if abs(growth) < FLAT_MIB else 'GROWING'}: {growth:+.1f} MiB fitted "
        f"over the {(span - warmup) / 60:.1f} min after warm-up (flat: under {FLAT_MIB:g} MiB)"
    )
    errors = sum(r.errors for r in runs)
    lines = [
        f"## Soak: {args.minutes:g} min at constant load (`.venv/bin/python bench/soak.py"
        + (f" --minutes {args.minutes:g}" if args.minutes != 10 else "")
        + "`)",
        "",
        f"{at:%Y-%m-%d %H:%M} UTC. The gateway as users run it (access log to a file, metrics, "
        f"an http probe every second, retries) on CPU {args.proxy_cpu}, run by "
        f"{python.label}, {python.plane}; `wrk -t1 -c{args.connections}` "
        f"in {len(runs)} segments of {args.segment:g} s on CPU {args.load_cpu} "
        "with the upstream (nginx). VmRSS of the "
        f"gateway sampled every {args.sample:g} s ({len(samples)} samples); slope fitted by "
        f"least squares after {warmup / 60:.1f} min of warm-up.",
        "",
        "| requests | rps (median segment) | errors | first RSS | last RSS | min RSS | max RSS "
        "| slope after warm-up | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {sum(r.requests for r in runs):,} | {statistics.median(r.rps for r in runs):,.0f} "
        f"| {errors} | {mibs[0]:.1f} MiB | {mibs[-1]:.1f} MiB | {min(mibs):.1f} MiB "
        f"| {max(mibs):.1f} MiB "
        f"| {'-' if slope is None else f'{slope:+.2f} MiB/min'} | {verdict} |",
        "",
        "RSS (MiB) at the end of each segment: "
        + ", ".join(
            f"{min(samples, key=lambda s: abs(s[0] - (i + 1) * args.segment))[1]:.1f}"
            for i in range(len(runs))
        )
        + ".",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tool = missing_tool()
    if tool is not None:
        print(f"soak: {tool} not found (apt-get install wrk nginx-light)", file=sys.stderr)
        return 2
    stop_on_signals()
    at = datetime.datetime.now(datetime.UTC)
    tmp = work_dir("soak")
    procs = Procs(tmp)
    try:
        python = interpreter.resolve(args.python)
        samples, runs = soak(procs, args, python)
    except Failure as e:
        print(f"soak: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("soak: interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        procs.stop_all_uninterrupted()
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, python, samples, runs, at)
    results.publish("soak", text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
