"""CPU per request of a service with a canary split active, against the same service plain.

    .venv/bin/python bench/split.py --duration 8 --repeat 5 [--pure]

Two identical upstreams (nginx, pinned to the load core with wrk) and two gateways, one
process each, pinned to the proxy core, each with the static service of ``run.py`` at both
upstreams' addresses: ``plain``, two replicas, one revision; ``split``, one replica of each
of two revisions (the second's probe differs, so it is a revision of its own) in a canary
held at 25 % (a step without a pause), so every request draws a side of the split, then the
policy picks within it. Interleaved, the
order alternating each repetition, ``wrk -t1 -c64``; CPU per request is the gateway's own
user+sys time over the requests done. Medians and the ratio go to the ``split`` section of
bench/RESULTS.md. The gateways run their data plane as built (compiled if ``gateway native
status`` says so), or pure with ``--pure``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import results
from system import (
    Failure,
    Procs,
    free_ports,
    missing_tool,
    stop_on_signals,
    work_dir,
)
from targets import (
    Limits,
    Target,
    alternating_wrk,
    gateway_config,
    native_status,
    start_configured,
    start_upstream,
)

REPO = Path(__file__).resolve().parent.parent
WEIGHT = 25
"""The canary's weight, percent (``--weight``)."""


def start(procs: Procs, name: str, config: dict, cpu: int, pure: bool) -> Target:
    """Serving once its probe passed."""
    return start_configured(procs, name, config, cpu, pure)


def admin(config: dict, token: str, method: str, path: str, body: dict | None = None) -> dict:
    url = f"http://{config['admin']['listen']}{path}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: dict = json.loads(response.read() or b"{}")
        return answer


def hold_canary(config: dict, token: str, weight: int) -> None:
    """Apply a second revision as a canary held at ``weight`` percent; wait for the split."""
    spec = json.loads(json.dumps(config["services"][0]))
    spec["probes"][0]["interval"] = "1.1s"  # another revision, the same address
    spec["rollout"] = {"strategy": "canary", "steps": [{"weight": weight}]}
    admin(config, token, "PUT", f"/api/services/{spec['name']}", spec)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        view = admin(config, token, "GET", f"/api/services/{spec['name']}")
        rollout = view.get("rollout") or {}
        if rollout.get("weight") == weight:
            return
        time.sleep(0.2)
    raise Failure(f"the canary is not held at {weight}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--proxy-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument("--pure", action="store_true", help="the pure Python data plane")
    parser.add_argument("--weight", type=int, default=WEIGHT, help="the canary's weight (25)")
    parser.add_argument("--output", type=Path, default=results.RESULTS)
    args = parser.parse_args(argv)
    tool = missing_tool()
    if tool is not None:
        print(f"bench: {tool} not found", file=sys.stderr)
        return 2
    stop_on_signals()
    tmp = work_dir("split")
    procs = Procs(tmp)
    others = Procs(work_dir("split-upstream"))  # the second nginx, in a directory of its own
    lim = Limits(max_connections=1024, nofile=4096, access_log=False)
    try:
        up, up2, p1, a1, p2, a2 = free_ports(6)
        token = os.urandom(16).hex()
        (tmp / "admin-token").write_text(token)
        upstream = start_upstream(procs, up, args.load_cpu, lim)
        second = start_upstream(others, up2, args.load_cpu, lim)
        plain = gateway_config(tmp, "plain", p1, a1, up, lim)
        split = gateway_config(tmp, "split", p2, a2, up, lim)
        # The same two upstreams behind both: plain, two replicas (one per address); split,
        # one replica of each revision (the canary's takes the second address).
        plain["services"][0]["replica"]["addresses"].append(f"127.0.0.1:{up2}")
        service = split["services"][0]
        service["replicas"] = 1
        service["replica"]["addresses"].append(f"127.0.0.1:{up2}")
        targets = [
            start(procs, "plain", plain, args.proxy_cpu, args.pure),
            start(procs, "split", split, args.proxy_cpu, args.pure),
        ]
        hold_canary(split, token, args.weight)
        del upstream, second
        figures = alternating_wrk(procs, targets, args.repeat, args.duration, args.load_cpu)
        view = admin(split, token, "GET", "/api/services/bench")
        if (view.get("rollout") or {}).get("weight") != args.weight:
            raise Failure("the canary did not hold its weight through the runs")
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all_uninterrupted()
        others.stop_all_uninterrupted()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(others.tmp, ignore_errors=True)
    rows = []
    for name, runs in figures.items():
        rows.append((name, statistics.median(r for r, _ in runs),
                     statistics.median(c for _, c in runs)))  # fmt: skip
    ratio = rows[1][2] / rows[0][2]
    per_rep = [s[1] / p[1] for p, s in zip(figures["plain"], figures["split"], strict=True)]
    sources = hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted((REPO / "gateway").rglob("*.py")))
    ).hexdigest()[:12]
    text = "\n".join(
        [
            "## A canary split: CPU per request (bench/split.py)",
            "",
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
            f"`bench/split.py --duration {args.duration:g} --repeat {args.repeat}"
            f"{' --pure' if args.pure else ''} --weight {args.weight}`, gateway sources {sources}, "
            f"data plane: {native_status(args.pure)}; load average {os.getloadavg()[0]:.2f}.",
            f"wrk -t1 -c64; the split gateway holds a canary at {args.weight}% (two revisions, "
            "every request draws its side); medians of the repetitions.",
            "",
            "| gateway | requests/s | CPU us/request |",
            "| --- | ---: | ---: |",
            *(f"| {n} | {r:,.0f} | {c:.1f} |" for n, r, c in rows),
            "",
            f"split / plain CPU per request: **{ratio:.3f}** (per repetition: "
            + ", ".join(f"{x:.3f}" for x in per_rep)
            + ").",
        ]
    )
    results.publish("split", text, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
