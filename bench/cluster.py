"""A cluster of three gateway nodes on three etcd members: rollout and failover times.

    .venv/bin/python bench/cluster.py --repeat 5

Each repetition starts three etcd members and three nodes on 127.0.0.2, .3 and .4 (the harness
of tests/e2e/test_cluster.py, lease TTL 2 s), applies a service of three replicas, then:

- **apply to routable everywhere**: ``PUT`` of revision 2 through one node, then each node's
  traffic port is read every 20 ms until it answers revision 2; the time until every node did,
  and until the rollout completed;
- **etcd requests per rollout**: the etcd members' own count of requests handled
  (``grpc_server_handled_total`` on each member's ``/metrics``) over the rollout, less the
  cluster's idle rate (leases, capacity and reports) over as long;
- **failover**: SIGKILL of the leader, then a ``scale`` sent to the survivors every 50 ms; the
  time until one was carried out (the new leader's first action).

Medians of the repetitions go to the ``cluster`` section of bench/RESULTS.md.

    .venv/bin/python bench/cluster.py --chaos --repeat 10 [--faults leader_kill,etcd_all]

``--chaos``: issue 54's chaos suite (``tests/e2e/chaos.py``, the topology and the faults of
``tests/e2e/test_cluster_chaos.py``): three etcd members, three nodes of two workers, a Docker
service of 4 replicas over two engines (the test engine, ``$GATEWAY_TEST_DOCKER_HOST`` with
``$GATEWAY_TEST_IMAGE``, and a second ``dockerd`` this bench starts: root) and a process
service of 3, load on both through every survivor. One cluster for every round; ``--repeat``
rounds of each fault, interleaved, each fault in the middle of a rollout of both services.
Per fault: requests, failed ones (on the survivors; in flight on a process that died, apart),
the time to a new leader and to the rollout complete, p50 and p99 (nearest rank: of fewer than
100 rounds, p99 is the slowest). Written to the ``cluster-chaos`` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import results  # noqa: E402

from tests.e2e.chaos import ETCD_DOWN, FAULTS, Chaos, Round  # noqa: E402
from tests.e2e.cluster_nodes import LEASE_TTL, SERVER, Nodes  # noqa: E402
from tests.e2e.test_docker_engines import second_dockerd  # noqa: E402
from tests.support.etcd_cluster import EtcdCluster  # noqa: E402

PROBE = {"type": "http", "path": "/", "interval": 0.1, "timeout": 0.5,
         "healthy_threshold": 2, "unhealthy_threshold": 2}  # fmt: skip


def spec(site: Path, version: str, replicas: int = 3) -> dict[str, Any]:
    directory = site / version
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "index.html").write_text(version)
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "replicas": replicas,
        "replica": {"commands": [SERVER], "working_dir": str(directory)},
        "probes": [PROBE],
        "rollout": {"drain_timeout": 5, "stop_grace": 1, "retry_backoff": 0.2},
    }


def handled(etcd: EtcdCluster) -> int:
    """Requests the etcd members handled so far (their own metric, summed)."""
    total = 0
    for endpoint in etcd.endpoints:
        with urllib.request.urlopen(endpoint + "/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("grpc_server_handled_total{"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def answers(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return str(answer.read().decode())
    except OSError:
        return ""


async def serving(nodes: Nodes, revision: int, replicas: int) -> None:
    while True:
        status, view = await nodes.api("GET", "/api/services/web")
        if (
            status == 200
            and view["serving_revision"] == revision
            and view["rollout"] is None
            and view["ready"] == replicas
        ):
            return
        await asyncio.sleep(0.05)


async def repetition(base: Path) -> dict[str, float]:
    etcd = EtcdCluster(base / "etcd", 3).start()
    nodes = Nodes(base / "nodes", etcd)
    try:
        await nodes.start_all()
        site = base / "site"
        await nodes.api("PUT", "/api/services/web", spec(site, "v1"))
        await serving(nodes, 1, 3)
        await asyncio.sleep(1)
        idle_start, idle_at = handled(etcd), time.monotonic()
        await asyncio.sleep(3)
        idle_rate = (handled(etcd) - idle_start) / (time.monotonic() - idle_at)

        before, start = handled(etcd), time.monotonic()
        status, body = await nodes.api("PUT", "/api/services/web", spec(site, "v2"))
        assert status == 200, body
        routable: dict[str, float] = {}
        while len(routable) < len(nodes.nodes):
            for node in nodes.nodes:
                if node.name not in routable and answers(node.url) == "v2":
                    routable[node.name] = time.monotonic() - start
            await asyncio.sleep(0.02)
        await serving(nodes, 2, 3)
        complete = time.monotonic() - start
        requests = handled(etcd) - before - idle_rate * complete

        leader = nodes.leader()
        assert leader is not None
        survivors = [n for n in nodes.nodes if n is not leader]
        nodes.kill(leader)
        killed = time.monotonic()
        replicas = 3
        while True:
            status, _ = await nodes.api(
                "POST", "/api/services/web/scale", {"replicas": replicas + 1}, node=survivors[0]
            )
            if status == 200:
                failover = time.monotonic() - killed
                break
            await asyncio.sleep(0.05)
        return {
            "routable_everywhere": max(routable.values()),
            "rollout_complete": complete,
            "etcd_requests": requests,
            "idle_requests_per_s": idle_rate,
            "failover": failover,
        }
    finally:
        await nodes.close()
        etcd.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    parser.add_argument("--chaos", action="store_true", help="issue 54's faults mid-rollout")
    parser.add_argument("--faults", default=",".join(FAULTS), help="with --chaos: which")
    args = parser.parse_args()
    if args.chaos:
        return await chaos(args)
    runs = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
            run = await repetition(Path(tmp))
        runs.append(run)
        print(f"repetition {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in run.items()))
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    each = {k: ", ".join(f"{r[k]:.2f}" for r in runs) for k in runs[0]}
    each["etcd_requests"] = ", ".join(f"{r['etcd_requests']:.0f}" for r in runs)
    plane = (
        "pure Python data plane (GATEWAY_NATIVE=0)"
        if os.environ.get("GATEWAY_NATIVE") == "0"
        else "data plane compiled where built"
    )
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = "\n".join(
        [
            "## A cluster of three nodes on etcd (bench/cluster.py)",
            "",
            f"{when}, `bench/cluster.py --repeat {args.repeat}`: three etcd members and three"
            f" nodes on 127.0.0.2-4, lease TTL {LEASE_TTL} s, a service of three replicas"
            f" (one per node), {plane}. Medians, and each repetition.",
            "",
            "| figure | median | repetitions |",
            "| --- | --- | --- |",
            f"| `PUT` of revision 2 to revision 2 answered on every node | "
            f"{median['routable_everywhere']:.2f} s | {each['routable_everywhere']} |",
            f"| `PUT` to rollout complete (3 replicas replaced) | "
            f"{median['rollout_complete']:.2f} s | {each['rollout_complete']} |",
            f"| etcd requests for the rollout (idle rate subtracted) | "
            f"{median['etcd_requests']:.0f} | {each['etcd_requests']} |",
            f"| idle etcd requests per second (3 nodes) | "
            f"{median['idle_requests_per_s']:.1f} | {each['idle_requests_per_s']} |",
            f"| leader SIGKILL to the new leader's first action (a scale carried out) | "
            f"{median['failover']:.2f} s | {each['failover']} |",
        ]
    )
    print(body)
    if not args.no_write:
        results.write_section("cluster", body)
    return 0


def rank(values: list[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0-100) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def seconds(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{rank(values, 50):.2f} / {rank(values, 99):.2f}"


async def chaos(args: argparse.Namespace) -> int:
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        print(f"unknown faults {unknown}: choose among {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    rounds: dict[str, list[Round]] = {f: [] for f in faults}
    started = time.monotonic()
    with second_dockerd() as second, tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        async with Chaos.started(Path(tmp), second) as cluster:
            for i in range(args.repeat):
                for fault in faults:
                    result = await cluster.round(fault)
                    rounds[fault].append(result)
                    print(f"round {i + 1}, {result.line()}", flush=True)
                # Each repetition's table is written: a run cut short keeps what it measured.
                body = chaos_table(args, rounds, i + 1, (time.monotonic() - started) / 60)
                if not args.no_write:
                    results.write_section("cluster-chaos", body)
    print(body)
    failed = sum(len(r.failed) for rs in rounds.values() for r in rs)
    return 1 if failed else 0


def chaos_table(
    args: argparse.Namespace, rounds: dict[str, list[Round]], done: int, took: float
) -> str:
    """The ``cluster-chaos`` section: ``done`` of ``args.repeat`` repetitions."""
    runs = f"{done} of {args.repeat} repetitions, " if done < args.repeat else ""
    plane = (
        "pure Python data plane (GATEWAY_NATIVE=0)"
        if os.environ.get("GATEWAY_NATIVE") == "0"
        else "data plane compiled where built"
    )
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Chaos: faults mid-rollout on a cluster of three nodes (bench/cluster.py --chaos)",
        "",
        f"{when}, `bench/cluster.py --chaos --repeat {args.repeat}` ({runs}{took:.0f} min),"
        f" {plane}:"
        f" three etcd members, three nodes on 127.0.0.2-4 with `workers: 2` and lease TTL"
        f" {LEASE_TTL} s, a Docker service of 4 replicas over two engines and a process"
        f" service of 3 replicas on the nodes, each loaded through every surviving node (2"
        f" clients per service per node). Each round: a rollout of both services, the fault"
        f" once the Docker service's first new replica is placed and the process service's"
        f" first new one ready, the rollout complete, 20 more requests per load, then the"
        f" cluster made whole again. Failed: requests that failed on the"
        f" survivors; in flight on what died: those in flight on a process that died as it"
        f" died (a worker, a container of the stopped engine). New leader: from the fault (for"
        f" etcd stopped {ETCD_DOWN:.0f} s: from its return) until the survivors agree on a"
        f" leader. Rollout: from the first `PUT` until both services serve the new revision"
        f" whole. p50 / p99 of {done} rounds (nearest rank: p99 is the slowest).",
        "",
        "| fault | rounds | requests | failed | in flight on what died"
        " | new leader p50 / p99 | rollout complete p50 / p99 | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for fault, ran in rounds.items():
        leaders = [r.new_leader for r in ran if r.new_leader is not None]
        notes = sorted({n for r in ran for n in r.notes if "containers on b" not in n})
        on_b = [n.split()[0] for r in ran for n in r.notes if "containers on b" in n]
        if on_b:
            notes.append(f"containers on b at the fault: {', '.join(on_b)}")
        lines.append(
            f"| {FAULTS[fault]} | {len(ran)} | {sum(r.requests for r in ran):,}"
            f" | {sum(len(r.failed) for r in ran)}"
            f" | {sum(len(r.in_flight) for r in ran)}"
            f" | {seconds(leaders)} | {seconds([r.rollout for r in ran])}"
            f" | {'; '.join(notes) or '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
