"""The gateway's CPU per request, HTTP/2 (h2c) against HTTP/1.1, in the same run: a bounded
loop on loopback (``bench/run.py --h2`` compares HTTP/2 with nginx, by h2load).

    .venv/bin/python bench/h2_inbound.py [--seconds 5] [--streams 64] [--profile]

nginx is the upstream (as ``run.py`` starts it); the gateway runs in this process with the
config users get (``targets.gateway_config``), compiled unless ``GATEWAY_NATIVE=0``. Once it
serves: ``wrk -t1 -c8`` for ``--seconds`` (HTTP/1.1), then an HTTP/2 client in a process of
its own (python-hyper's ``h2``: one connection, ``--streams`` requests in flight) for as
long. For each, the CPU time this process used (the gateway, its access log's thread
included) over the requests answered. The HTTP/2 client is interpreted Python and may be
the bottleneck: its rate is no measure of the gateway's, its CPU per request is. Everything
it starts is stopped by pid. ``--profile``: the HTTP/2 load's time in this process by
``cProfile``, summed by where the functions live (a library, the gateway's interpreted
modules, compiled code as the interpreted calls into it see it): the shares of a profile,
not a cost per request (the profiler's own overhead is in them).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from system import (
    Failure,
)
from targets import run_in_process, until_routable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gateway import native  # noqa: E402

native.use()  # the compiled modules if built, as the gateway runs them (before any import)
from controller.config import load_config  # noqa: E402
from controller.serving import run_gateway  # noqa: E402


def client(port: int, seconds: float, streams: int) -> int:
    """An HTTP/2 client keeping ``streams`` GETs of ``/`` in flight on one connection for
    ``seconds``: the answers it read, whole."""
    import h2.config
    import h2.connection
    import h2.events

    sock = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    head = [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "bench")]
    in_flight = done = 0
    end = time.monotonic() + seconds
    while True:
        now = time.monotonic()
        while now < end and in_flight < streams:
            conn.send_headers(conn.get_next_available_stream_id(), head, end_stream=True)
            in_flight += 1
        sock.sendall(conn.data_to_send())
        if now >= end and not in_flight:
            break
        data = sock.recv(65536)
        if not data:
            raise SystemExit("the gateway closed the connection")
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                in_flight -= 1
                done += 1
    sock.close()
    return done


def where(filename: str, function: str) -> str:
    """The part of the process a profiled function belongs to."""
    if filename == "~":
        return f"built-in or compiled: {function.split(' of ')[0].strip('<>')}"
    for library in ("h2", "hyperframe", "hpack", "asyncio", "uvloop"):
        if f"/{library}/" in filename:
            return library
    if "/gateway/" in filename:
        return "gateway/" + filename.rsplit("/gateway/", 1)[1] + " (interpreted)"
    return "other"


def shares(profile: cProfile.Profile, top: int = 12) -> None:
    """Print the profile's own time by ``where``, largest first."""
    import pstats

    stats = pstats.Stats(profile)
    total: collections.Counter[str] = collections.Counter()
    for (filename, _, function), row in stats.stats.items():  # type: ignore[attr-defined]
        total[where(filename, function)] += row[2]
    whole = sum(total.values()) or 1.0
    print("| where | share of the profile |")
    print("| --- | ---: |")
    for name, spent in total.most_common(top):
        print(f"| {name} | {spent / whole:.1%} |")


async def measure(
    config: Path, port: int, seconds: float, streams: int, profile: bool = False
) -> None:
    stop = asyncio.Event()
    results: dict[str, tuple[int, float]] = {}
    profiler = cProfile.Profile() if profile else None

    async def started(gateway: object) -> None:
        try:
            url = f"http://127.0.0.1:{port}/"
            await until_routable(url)
            cpu = time.process_time()
            wrk = await asyncio.create_subprocess_exec(
                "wrk", "-t1", "-c8", f"-d{seconds:g}", url, stdout=subprocess.PIPE
            )
            out, _ = await wrk.communicate()
            count = re.search(rb"(\d+) requests in", out)
            if count is None:
                raise Failure(f"wrk said: {out.decode()}")
            results["HTTP/1.1 (wrk -t1 -c8)"] = (int(count[1]), time.process_time() - cpu)
            cpu = time.process_time()
            if profiler is not None:
                profiler.enable()
            load = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--client",
                str(port),
                f"--seconds={seconds}",
                f"--streams={streams}",
                stdout=subprocess.PIPE,
            )
            out, _ = await load.communicate()
            if profiler is not None:
                profiler.disable()
            if load.returncode:
                raise Failure("the HTTP/2 client failed")
            results[f"HTTP/2 h2c (1 connection, {streams} streams)"] = (
                int(out),
                time.process_time() - cpu,
            )
        finally:
            stop.set()

    await run_gateway(load_config(config), stop, started=started)
    print(f"{native.running.split(':')[0]}, {seconds:g} s each")
    print("| load | requests | gateway CPU per request |")
    print("| --- | ---: | ---: |")
    for name, (count, cpu) in results.items():
        print(f"| {name} | {count:,} | {cpu / count * 1e6:.1f} us |")
    if profiler is not None:
        print("\nHTTP/2, profiled (the CPU per request above includes the profiler's cost):")
        shares(profiler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="where the HTTP/2 load's time goes")
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        print(client(args.client, args.seconds, args.streams))
        return 0
    return run_in_process(
        "h2_inbound",
        lambda config, port: measure(config, port, args.seconds, args.streams, args.profile),
    )


if __name__ == "__main__":
    sys.exit(main())
