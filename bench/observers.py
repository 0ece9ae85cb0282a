"""Micro-benchmark: what the request observers cost per request on the event loop.

    .venv/bin/python bench/observers.py [-n 200000]

Times ``on_request`` of ``GatewayMetrics`` (a revision's counts made at its first record)
and of ``AccessLog`` (a bounded queue put; its writer thread formats and writes to /dev/null
meanwhile, so the GIL it takes shows in the numbers), and both together as the proxy calls
them. Also how fast the writer formats lines. The records are synthetic: no sockets, so the
numbers are the observers' own cost, to be set against a proxied request's hundreds of us.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable

from gateway import native

native.use()  # the compiled modules if built, as the gateway runs them
from gateway.config import RouteConfig, ServiceRouting  # noqa: E402
from gateway.observability.accesslog import AccessLog, format_json, format_plain  # noqa: E402
from gateway.observability.metrics import GatewayMetrics  # noqa: E402
from gateway.pool.events import RequestRecord  # noqa: E402
from gateway.pool.pool import Pool  # noqa: E402
from gateway.pool.upstream import Health, Upstream  # noqa: E402

PLAIN = RequestRecord(
    request_id="0f1e2d3c4b5a69788796a5b4c3d2e1f0",
    service="web",
    revision=3,
    upstream_id="web-3-a1b2c3",
    method="GET",
    path="/api/items/42",
    status=200,
    duration=0.0042,
    ttfb=0.0031,
    bytes_in=0,
    bytes_out=1234,
    retries=0,
)
RETRIED = PLAIN._replace(retries=1, retry_reasons=("connect",))


def per_call_ns(fn: Callable[[RequestRecord], None], record: RequestRecord, n: int) -> float:
    """Median over 5 runs of the mean time of one call, in ns."""
    runs = []
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(n):
            fn(record)
        runs.append((time.perf_counter_ns() - start) / n)
    return statistics.median(runs)


def baseline(record: RequestRecord) -> None:
    pass


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=200_000)
    n = parser.parse_args().n

    pool = Pool()
    pool.set_service(ServiceRouting(name="web", route=RouteConfig(path_prefix="/")))
    pool.add_upstream(Upstream("web-3-a1b2c3", "web", "127.0.0.1", 1, revision=3))
    pool.set_health("web", "web-3-a1b2c3", Health.HEALTHY)
    metrics = GatewayMetrics()
    metrics.attach(pool)
    metrics.on_request(PLAIN)  # the first record of a revision makes its children
    metrics.on_request(RETRIED)

    rows = [
        ("loop overhead (empty call)", per_call_ns(baseline, PLAIN, n)),
        ("GatewayMetrics.on_request", per_call_ns(metrics.on_request, PLAIN, n)),
        ("GatewayMetrics.on_request, 1 retry", per_call_ns(metrics.on_request, RETRIED, n)),
    ]

    devnull = open(os.devnull, "w")
    access = AccessLog("json", stream=devnull, queue_size=1 << 20)
    access.start()

    def both(record: RequestRecord) -> None:
        # What Exchange.record does: each observer in turn, guarded.
        for observer in (metrics, access):
            try:
                observer.on_request(record)
            except Exception:
                pass

    # With the writer thread running: it takes the GIL to format and write meanwhile.
    rows += [
        ("AccessLog.on_request (queue put)", per_call_ns(access.on_request, PLAIN, n)),
        ("both, as Exchange.record calls them", per_call_ns(both, PLAIN, n)),
    ]
    await access.stop(grace=60)
    print(f"per request, n={n} (median of 5 runs), Python {sys.version.split()[0]}")
    for name, ns in rows:
        print(f"  {name:<40} {ns / 1000:7.2f} us")
    print(f"  access log: written={access.written} dropped={access.dropped}")

    for label, fmt in (("plain", format_plain), ("json", format_json)):
        start = time.perf_counter()
        for _ in range(n):
            fmt(1.7e9, PLAIN)
        rate = n / (time.perf_counter() - start)
        print(f"  writer thread: format {label:<5} {rate / 1000:7.0f} k lines/s")
    devnull.close()


if __name__ == "__main__":
    asyncio.run(main())
