"""The gateway's CPU per gRPC unary call over h2c, and the calls' latency through the gateway
against straight to the replica: a bounded loop on loopback (``bench/run.py --h2`` compares
the CPU per call with nginx's ``grpc_pass``).

    .venv/bin/python bench/grpc_unary.py [--seconds 5] [--threads 4]

The replica is the tests' grpcio server (``tests/e2e/grpc_replica.py``, a generic handler:
``test.Echo/Unary`` echoes its request); the gateway runs in this process with the config
users get (``targets.gateway_config``, access log on), its service set to
``upstream_protocol: http2`` with a TCP probe, compiled unless ``GATEWAY_NATIVE=0``. A
grpcio client in a process of its own (``--threads`` threads on one channel, each one call
at a time) calls for ``--seconds`` straight to the replica, then as long through the
gateway: calls per second and mean latency of each, and the CPU time this process used (the
gateway, its access log's thread included) over the calls it relayed. grpcio's client is
itself the bottleneck at this scale: the latencies compare the two ways, the CPU per call
is the gateway's. Everything it starts is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import uvloop
from system import Failure, Procs, free_ports, stop_on_signals, work_dir
from targets import Limits, gateway_config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from controller.config import load_config  # noqa: E402
from controller.serving import run_gateway  # noqa: E402

REPLICA = REPO / "tests" / "e2e" / "grpc_replica.py"


def client(port: int, seconds: float, threads: int) -> str:
    """Unary calls to ``port`` for ``seconds`` from ``threads`` threads on one channel:
    ``calls seconds failed``."""
    import grpc

    counts = [0] * threads
    failed = [0] * threads
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary("/test.Echo/Unary")
        unary(b"warm", timeout=10, wait_for_ready=True)
        start = time.monotonic()
        end = start + seconds

        def loop(i: int) -> None:
            while time.monotonic() < end:
                try:
                    unary(b"x" * 64, timeout=10)
                    counts[i] += 1
                except grpc.RpcError:
                    failed[i] += 1

        workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        took = time.monotonic() - start
    return f"{sum(counts)} {took} {sum(failed)}"


async def run_client(port: int, seconds: float, threads: int) -> tuple[int, float]:
    load = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", str(port), f"--seconds={seconds}",
        f"--threads={threads}", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await load.communicate()
    if load.returncode:
        raise Failure("the gRPC client failed")
    calls, took, _failed = out.split()
    return int(calls), float(took)


async def measure(config: Path, port: int, replica: int, seconds: float, threads: int) -> None:
    stop = asyncio.Event()
    results: dict[str, tuple[int, float, float | None]] = {}

    async def started(gateway: object) -> None:
        try:
            calls, took = await run_client(replica, seconds, threads)
            results["straight to the replica"] = (calls, took, None)
            cpu = time.process_time()
            calls, took = await run_client(port, seconds, threads)
            results["through the gateway (h2c both legs)"] = (
                calls,
                took,
                time.process_time() - cpu,
            )
        finally:
            stop.set()

    await run_gateway(load_config(config), stop, started=started)
    native = os.environ.get("GATEWAY_NATIVE", "auto")
    print(f"GATEWAY_NATIVE={native}, {seconds:g} s each, {threads} client threads")
    print("| unary calls | calls/s | mean latency | gateway CPU per call |")
    print("| --- | ---: | ---: | ---: |")
    for name, (calls, took, cpu) in results.items():
        per = "" if cpu is None else f"{cpu / calls * 1e6:.0f} us"
        print(f"| {name} | {calls / took:,.0f} | {took * threads / calls * 1e3:.2f} ms | {per} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        print(client(args.client, args.seconds, args.threads))
        return 0
    stop_on_signals()
    tmp = work_dir("grpc_unary")
    procs = Procs(tmp)
    port, admin, replica_port = free_ports(3)
    limits = Limits(max_connections=1024, nofile=4096, access_log=True)
    try:
        procs.start("replica", [sys.executable, str(REPLICA), str(replica_port)], cpu=None)
        (tmp / "admin-token").write_text(os.urandom(16).hex())
        (tmp / "admin-token").chmod(0o600)
        config = gateway_config(tmp, "gateway", port, admin, replica_port, limits)
        (service,) = config["services"]
        service["upstream_protocol"] = "http2"
        service["probes"] = [{"type": "tcp", "interval": "1s", "healthy_threshold": 1}]
        path = tmp / "gateway.yaml"  # JSON is YAML
        path.write_text(json.dumps(config))
        uvloop.run(measure(path, port, replica_port, args.seconds, args.threads))
    except Failure as e:
        print(f"grpc_unary: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all_uninterrupted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
