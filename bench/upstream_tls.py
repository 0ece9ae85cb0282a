"""CPU per request through the gateway to a TLS replica (``upstream_tls``) against a plain one.

    .venv/bin/python bench/upstream_tls.py --duration 8 --repeat 3 [--pure]

One nginx upstream (``run.py``'s, pinned to the load core with wrk) listening twice: plain,
and over TLS (TLS 1.2 and 1.3, a self-signed ECDSA P-256 certificate for ``bench.test``).
Two gateways, one process each, pinned to the proxy core, each with ``run.py``'s static
service: ``plain`` to the plain port, ``tls`` to the TLS port with ``upstream_tls: {ca: the
certificate, server_name: bench.test}`` (verified). Interleaved, the order alternating each
repetition, ``wrk -t1 -c64`` to each (plain HTTP from the client; connections to the
upstream kept alive, so the handshakes are a few per run: what is measured is the records'
encryption and decryption and the SSL transport). CPU per request is the gateway's own
user+sys time over the requests done. Medians and the per-repetition ratios go to the
``upstream-tls`` section of bench/RESULTS.md. The gateways run their data plane as built
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
from system import Failure, Procs, free_ports, missing_tool, stop_on_signals, work_dir
from targets import (
    NGINX_TLS,
    SERVER_NAME,
    UPSTREAM_NGINX,
    Limits,
    Target,
    alternating_wrk,
    gateway_ciphers,
    gateway_config,
    make_certificate,
    native_status,
    start_configured,
)

REPO = Path(__file__).resolve().parent.parent


def start_upstream(procs: Procs, plain: int, tls: int, cpu: int, lim: Limits) -> None:
    """``run.py``'s nginx upstream, listening on ``plain`` and over TLS on ``tls``."""
    (procs.tmp / "www").mkdir()
    certificate = make_certificate(procs.tmp, "ecdsa")
    listen = f"        listen 127.0.0.1:{plain} reuseport backlog=4096;"
    text = UPSTREAM_NGINX.format(
        tmp=procs.tmp, port=plain, max_connections=lim.max_connections, nofile=lim.nofile
    )
    tls_listen = NGINX_TLS.format(
        port=tls, cert=certificate.cert, key=certificate.key, ciphers=gateway_ciphers()
    )
    assert listen in text
    text = text.replace(listen, f"{listen}\n{tls_listen}")
    conf = procs.tmp / "upstream.conf"
    conf.write_text(text)
    argv = ["nginx", "-e", str(procs.tmp / "upstream.error.log"), "-p", str(procs.tmp)]
    procs.start("upstream", [*argv, "-c", str(conf)], cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--proxy-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument("--pure", action="store_true", help="the pure Python data plane")
    parser.add_argument("--output", type=Path, default=results.RESULTS)
    args = parser.parse_args(argv)
    tool = missing_tool()
    if tool is not None:
        print(f"bench: {tool} not found", file=sys.stderr)
        return 2
    stop_on_signals()
    tmp = work_dir("upstream-tls")
    procs = Procs(tmp)
    lim = Limits(max_connections=1024, nofile=4096, access_log=False)
    try:
        up, up_tls, p1, a1, p2, a2 = free_ports(6)
        (tmp / "admin-token").write_text(os.urandom(16).hex())
        start_upstream(procs, up, up_tls, args.load_cpu, lim)
        plain = gateway_config(tmp, "plain", p1, a1, up, lim)
        tls = gateway_config(tmp, "tls", p2, a2, up_tls, lim)
        tls["services"][0]["upstream_tls"] = {
            "ca": str(tmp / "tls-cert.pem"),
            "server_name": SERVER_NAME,
        }
        targets: list[Target] = [
            start_configured(procs, "plain", plain, args.proxy_cpu, args.pure),
            start_configured(procs, "tls", tls, args.proxy_cpu, args.pure),
        ]
        figures = alternating_wrk(procs, targets, args.repeat, args.duration, args.load_cpu)
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
    per_rep = [t[1] / p[1] for p, t in zip(figures["plain"], figures["tls"], strict=True)]
    sources = hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted((REPO / "gateway").rglob("*.py")))
    ).hexdigest()[:12]
    text = "\n".join(
        [
            "## TLS to the replicas: CPU per request (bench/upstream_tls.py)",
            "",
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
            f"`bench/upstream_tls.py --duration {args.duration:g} --repeat {args.repeat}"
            f"{' --pure' if args.pure else ''}`, gateway sources {sources}, "
            f"data plane: {native_status(args.pure)}; load average {os.getloadavg()[0]:.2f}.",
            "wrk -t1 -c64 over plain HTTP to each gateway; `tls` speaks TLS (verified, ECDSA "
            "P-256, kept alive) to the same nginx; medians of the repetitions.",
            "",
            "| gateway | requests/s | CPU us/request |",
            "| --- | ---: | ---: |",
            *(f"| {n} | {r:,.0f} | {c:.1f} |" for n, r, c in rows),
            "",
            f"tls / plain CPU per request: **{statistics.median(per_rep):.3f}** (median of the "
            "repetitions' ratios: " + ", ".join(f"{x:.3f}" for x in per_rep) + ").",
        ]
    )
    results.publish("upstream-tls", text, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
