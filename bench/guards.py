"""CPU per request of a service with auth and a rate limit on, against the same service plain.

    .venv/bin/python bench/guards.py --duration 8 --repeat 5 [--pure]

One upstream (nginx, pinned to the load core with wrk) and two gateways, one process each,
pinned to the proxy core: ``plain`` (the service as ``run.py`` configures it) and
``guarded`` (the same service with ``auth: {type: bearer}``, 100 tokens, and a rate limit
keyed by ``ip`` high enough never to refuse). Interleaved, the order alternating each
repetition, ``wrk -t1 -c64`` sends every request with ``Authorization: Bearer <token>`` to
both (the plain gateway passes it on; the guarded one checks and strips it); CPU per
request is the gateway's own user+sys time over the requests done. Medians and the ratio go
to the ``guards`` section of bench/RESULTS.md. The gateways run their data plane as built
(compiled if ``gateway native status`` says so), or pure with ``--pure``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import shutil
import statistics
import sys
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

TOKEN = "bench-token-" + "7" * 40
BEARER = (f"Authorization: Bearer {TOKEN}",)
"""wrk's header: every request carries the token."""
REPO = Path(__file__).resolve().parent.parent


def guarded_config(config: dict, tmp: Path, only: str | None = None) -> dict:
    tokens = tmp / "tokens"
    tokens.write_text("".join(f"other-token-{i:040d}\n" for i in range(99)) + TOKEN + "\n")
    service = config["services"][0]
    if only != "rate-limit":
        service["auth"] = {"type": "bearer", "tokens_file": str(tokens)}
    if only != "auth":
        service["rate_limits"] = [{"path_prefix": "/", "key": "ip", "rps": 1e6, "burst": 1_000_000}]
    return config


def start(procs: Procs, name: str, config: dict, cpu: int, pure: bool) -> Target:
    """Serving once its probe passed: 200 with the token."""
    return start_configured(
        procs, name, config, cpu, pure, headers={"Authorization": f"Bearer {TOKEN}"}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--proxy-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument("--pure", action="store_true", help="the pure Python data plane")
    parser.add_argument(
        "--only", choices=["auth", "rate-limit"], help="guard with one of the two (no output)"
    )
    parser.add_argument("--output", type=Path, default=results.RESULTS)
    args = parser.parse_args(argv)
    tool = missing_tool()
    if tool is not None:
        print(f"bench: {tool} not found", file=sys.stderr)
        return 2
    stop_on_signals()
    tmp = work_dir("guards")
    procs = Procs(tmp)
    lim = Limits(max_connections=1024, nofile=4096, access_log=False)
    try:
        up, p1, a1, p2, a2 = free_ports(5)
        (tmp / "admin-token").write_text(os.urandom(16).hex())
        upstream = start_upstream(procs, up, args.load_cpu, lim)
        plain = gateway_config(tmp, "plain", p1, a1, up, lim)
        guarded = guarded_config(gateway_config(tmp, "guarded", p2, a2, up, lim), tmp, args.only)
        targets = [
            start(procs, "plain", plain, args.proxy_cpu, args.pure),
            start(procs, "guarded", guarded, args.proxy_cpu, args.pure),
        ]
        del upstream
        figures = alternating_wrk(procs, targets, args.repeat, args.duration, args.load_cpu, BEARER)
    except Failure as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all_uninterrupted()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for name, runs in figures.items():
        rows.append((name, statistics.median(r for r, _ in runs),
                     statistics.median(c for _, c in runs)))  # fmt: skip
    ratio = rows[1][2] / rows[0][2]
    per_rep = [g[1] / p[1] for p, g in zip(figures["plain"], figures["guarded"], strict=True)]
    # The package the gateways import: this checkout's, or PYTHONPATH's (a clean copy of a
    # commit, built there, when this checkout is shared and holds others' edits).
    root = Path(os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or REPO)
    sources = hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted((root / "gateway").rglob("*.py")))
    ).hexdigest()[:12]
    text = "\n".join(
        [
            "## Auth and a rate limit: CPU per request (bench/guards.py)",
            "",
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
            f"`bench/guards.py --duration {args.duration:g} --repeat {args.repeat}"
            f"{' --pure' if args.pure else ''}`, gateway sources {sources}, "
            f"data plane: {native_status(args.pure)}; load average {os.getloadavg()[0]:.2f}.",
            "wrk -t1 -c64, every request with a bearer token; medians of the repetitions.",
            "",
            "| gateway | requests/s | CPU us/request |",
            "| --- | ---: | ---: |",
            *(f"| {n} | {r:,.0f} | {c:.1f} |" for n, r, c in rows),
            "",
            f"guarded / plain CPU per request: **{ratio:.3f}** (per repetition: "
            + ", ".join(f"{x:.3f}" for x in per_rep)
            + ").",
        ]
    )
    if args.only:
        print(text)  # a decomposition: not the section's figures
        return 0
    results.publish("guards", text, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
