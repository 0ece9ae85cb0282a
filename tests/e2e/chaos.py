"""Issue 54's chaos suite: one cluster, seven faults, each injected in the middle of a rollout.

The topology: three etcd members; three nodes on 127.0.0.2, .3 and .4, each with ``workers:
2`` and a lease TTL of 2 s; a Docker service ``web`` of 4 replicas over two engines (host
``a``: the test engine, host ``b``: the second ``dockerd`` of test_docker_engines; room for 5
on each, so that one engine alone holds the service and its rollout's surge) and a process
service ``pages`` of 3 replicas on the nodes. Both services are loaded through every node that
survives the fault, and every request and every failure is counted.

A round (``Chaos.round``): load on the survivors; ``PUT`` of a new revision of ``web``, then of
``pages`` once a new ``web`` replica is placed; the fault once a new ``pages`` replica is ready
(so both rollouts are under way); the time from the fault to a new leader where the fault hits
leadership; the time from the first ``PUT`` until both rollouts are complete; more load on
the result; then the cluster is made whole again (a node, a member or an engine started
again) and waits until it is steady, for the next round. ``tests/e2e/test_cluster_chaos.py``
runs each fault once; ``bench/cluster.py --chaos`` runs them ``--repeat`` times.

A failed request is ``in_flight`` when it was in flight on a process that died as it died (a
worker SIGKILLed, a container of the engine stopped): sent before that process was gone and
answered after the fault began. Those are the only failures allowed; every other is
``failed``. (A connection the kernel queued on a SIGKILLed worker's listener is lost with it,
as with SO_REUSEPORT a closed listener's queue is not handed to the others unless
``net.ipv4.tcp_migrate_req`` is 1.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.controller.test_backend_docker import engine_or_skip, remove_labelled
from tests.e2e.cluster_nodes import LEASE_TTL, SERVER, Node, Nodes
from tests.e2e.conftest import PROBE, ROLLOUT, Outcome, alive, children
from tests.e2e.test_cluster_docker import cluster_id, engines, loaded, unloaded
from tests.e2e.test_cluster_workers import replica_ports
from tests.e2e.test_docker_engines import Engine, docker_spec, remove_labelled_on
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import eventually

FAULTS: dict[str, str] = {
    "leader_kill": "SIGKILL of the leader",
    "leader_pause": "SIGSTOP of the leader past its TTL, then SIGCONT",
    "node_kill": "SIGKILL of a node that runs replicas (not the leader)",
    "etcd_member": "SIGKILL of one etcd member (the members' leader)",
    "etcd_all": "every etcd member stopped (SIGSTOP) for 10 s",
    "engine_stop": "Docker Engine b stopped (SIGTERM to its dockerd)",
    "worker_kill": "SIGKILL of a worker process of the leader's node",
}
ETCD_DOWN = 10.0
WEB, PAGES = 4, 3
ROLLOUT_WITHIN = 120.0


@dataclass
class Round:
    fault: str
    requests: int
    failed: list[Outcome]
    """Failed requests on the survivors, other than ``in_flight``: the goal is none."""
    in_flight: list[Outcome]
    """Failed requests that were in flight on a process that died as it died."""
    new_leader: float | None
    """Seconds from the fault (for etcd: from its return) to a leader the survivors agree on."""
    rollout: float
    """Seconds from the first ``PUT`` until both rollouts were complete."""
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        leader = "-" if self.new_leader is None else f"{self.new_leader:.2f} s"
        sample = "; ".join(f"{o.status} {o.error[:60] or o.body[:60]}" for o in self.failed[:3])
        return (
            f"{self.fault}: {len(self.failed)} failed, {len(self.in_flight)} in flight on what"
            f" died, of {self.requests}; new leader {leader}; rollout {self.rollout:.2f} s"
            + (f"; {', '.join(self.notes)}" if self.notes else "")
            + (f"; failures: {sample}" if sample else "")
        )


def pages_spec(site: Path, version: str) -> dict[str, Any]:
    """``pages``: a process replica on each node, answering ``version`` at /pages/."""
    directory = site / version
    if not (directory / "index.html").exists():  # never rewritten under traffic
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "index.html").write_text(version)
    return {
        "name": "pages",
        "route": {"path_prefix": "/pages", "strip_prefix": True},
        "replicas": PAGES,
        "replica": {"commands": [SERVER], "working_dir": str(directory)},
        "probes": [PROBE],
        "retries": {"attempts": 3},
        "rollout": ROLLOUT,
    }


def web_spec(version: str) -> dict[str, Any]:
    """``web``: 4 containers over the engines, answering ``version`` at /."""
    return docker_spec(version, WEB) | {"retries": {"attempts": 3}}


def metric(node: Node, prefix: str) -> float | None:
    with urllib.request.urlopen(node.admin + "/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
    return None


def workers_of(node: Node) -> list[int]:
    """The pids of ``node``'s worker processes."""
    assert node.process is not None
    found = []
    for pid in children(node.process.pid):
        with contextlib.suppress(OSError):
            if b"gateway.workers" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(pid)
    return sorted(found)


def etcd_leader(etcd: EtcdCluster) -> int:
    """The index of the member that leads the etcd cluster."""
    ids: dict[int, int] = {}
    leader = None
    for i, member in enumerate(etcd.members):
        request = urllib.request.Request(member.endpoint + "/v3/maintenance/status", data=b"{}")
        with urllib.request.urlopen(request, timeout=2) as answer:
            status = json.loads(answer.read())
        ids[int(status["header"]["member_id"])] = i
        leader = int(status["leader"])
    assert leader in ids, (leader, ids)
    return ids[leader]


@dataclass
class Chaos:
    nodes: Nodes
    second: Engine
    site: Path
    version: int = 0
    revisions: dict[str, int] = field(default_factory=dict)

    @classmethod
    @contextlib.asynccontextmanager
    async def started(cls, base: Path, second: Engine) -> AsyncIterator[Chaos]:
        """The topology, serving revision 1 of both services; torn down at the end (every
        process by pid, the containers by the cluster's label on both engines)."""
        await engine_or_skip()
        etcd = EtcdCluster(base / "etcd", 3).start()
        docker = engines(second, capacity=WEB + 1)  # one engine holds the rollout alone
        nodes = Nodes(base / "nodes", etcd, workers=2, ports=replica_ports(), docker=docker)
        chaos = cls(nodes, second, base / "sites")
        instance = None
        try:
            await nodes.start_all()
            started = time.monotonic()
            for name, status in (await chaos.put(nodes.nodes[0])).items():
                assert status in (200, 201), (name, status)
            await chaos.complete(nodes.nodes, started + ROLLOUT_WITHIN)
            await chaos.steady()
            yield chaos
        finally:
            try:
                with contextlib.suppress(Exception):
                    instance = await cluster_id(nodes)
            finally:
                await nodes.close()
                etcd.close()
            if instance is not None:  # the nodes leave the containers: removed by label
                await remove_labelled(instance)
                if second.process is not None and second.process.poll() is None:
                    await remove_labelled_on(second.unix, instance)

    # -- the services ------------------------------------------------------------------------

    async def put(self, through: Node, only: str | None = None) -> dict[str, int]:
        """``PUT`` of the next revision of both services (or ``only`` one, the version as it
        is); the status of each."""
        if only is None:
            self.version += 1
        version = f"r{self.version}"
        specs = {"web": web_spec(version), "pages": pages_spec(self.site, version)}
        statuses = {}
        for name, spec in specs.items():
            if only is not None and name != only:
                continue
            status, body = await self.nodes.api("PUT", f"/api/services/{name}", spec, through)
            assert status in (200, 201), (name, status, body)
            self.revisions[name] = int(body["revision"])
            statuses[name] = status
        return statuses

    async def view(self, name: str, among: list[Node]) -> dict[str, Any] | None:
        """The service's view through the first of ``among`` that answers (None: none did)."""
        for node in among:
            with contextlib.suppress(OSError, TimeoutError, ValueError):
                status, body = await self.nodes.api("GET", f"/api/services/{name}", node=node)
                if status == 200:
                    return dict(body)
        return None

    async def done(self, name: str, among: list[Node]) -> bool:
        """``name`` serves its last revision, every replica ready, none other live, no rollout."""
        seen = await self.view(name, among)
        if seen is None:
            return False
        revision, desired = self.revisions[name], (WEB if name == "web" else PAGES)
        live = [r for r in seen["replicas"] if r["state"] not in ("stopped", "failed")]
        return bool(
            seen["serving_revision"] == revision
            and seen["rollout"] is None
            and seen["ready"] == desired
            and len(live) == desired
            and all(r["revision"] == revision and r["state"] == "ready" for r in live)
        )

    async def complete(self, among: list[Node], deadline: float) -> None:
        for name in ("web", "pages"):
            await eventually(
                lambda name=name: self.done(name, among),
                timeout=max(1.0, deadline - time.monotonic()),
                what=f"{name}'s rollout to revision {self.revisions[name]} complete",
                every=0.1,
            )

    async def new_replicas(self, name: str, states: tuple[str, ...]) -> int:
        seen = await self.view(name, self.nodes.live())
        if seen is None:
            return 0
        revision = self.revisions[name]
        return sum(
            1 for r in seen["replicas"] if r["revision"] == revision and r["state"] in states
        )

    async def mid_rollout(self, through: Node) -> None:
        """Both rollouts under way: ``web``'s first new replica placed, ``pages`` put then,
        and its first new replica ready."""
        await eventually(
            lambda: self.new_replicas("web", ("starting", "ready")),
            timeout=60,
            what="web's first new replica",
            every=0.05,
        )
        await self.put(through, only="pages")
        await eventually(
            lambda: self.new_replicas("pages", ("ready",)),
            timeout=60,
            what="pages' first new replica ready",
            every=0.05,
        )

    async def on_b(self) -> int:
        """``web``'s live replicas on engine b."""
        instance = await cluster_id(self.nodes)
        from controller.backends.docker import EngineClient

        client = EngineClient(self.second.unix)
        try:
            found = await client.containers({"gateway.instance": instance or ""})
            return sum(1 for c in found if c["State"] == "running")
        finally:
            await client.close()

    # -- leadership --------------------------------------------------------------------------

    async def leader(self, among: list[Node]) -> Node | None:
        return await asyncio.to_thread(self.nodes.leader, among)

    async def led_by_other(self, old: Node | None, among: list[Node], since: float) -> float:
        """Seconds from ``since`` until ``among`` agree on a leader other than ``old``."""

        async def led() -> bool:
            leader = await self.leader(among)
            return leader is not None and leader is not old

        await eventually(led, timeout=LEASE_TTL + 30, what="a new leader", every=0.05)
        return time.monotonic() - since

    async def steady(self) -> None:
        """Three nodes in the cluster, one leader all agree on, engine b up as the leader sees
        it, and both services complete."""
        nodes = self.nodes

        def whole() -> bool:
            leader = nodes.leader()
            if leader is None or len(nodes.live()) != 3:
                return False
            view = nodes.cluster(leader) or {}
            if len(view.get("nodes", [])) != 3:
                return False
            return metric(leader, 'gateway_docker_host_up{host="b"}') == 1.0

        await eventually(lambda: asyncio.to_thread(whole), timeout=90, what="the cluster whole")
        await self.complete(nodes.nodes, time.monotonic() + ROLLOUT_WITHIN)

    # -- a round -----------------------------------------------------------------------------

    async def round(self, fault: str) -> Round:
        """One rollout of both services with ``fault`` in its middle; the cluster whole again
        after it."""
        nodes = self.nodes
        assert fault in FAULTS, fault
        leader = await self.leader(nodes.nodes)
        assert leader is not None
        others = [n for n in nodes.nodes if n is not leader]
        victim: Node | None = {
            "leader_kill": leader,
            "leader_pause": leader,
            "node_kill": others[0],
        }.get(fault)
        survivors = [n for n in nodes.nodes if n is not victim]
        notes: list[str] = []
        loads = await loaded(survivors, web_clients=2, limit=300)
        dead_from = dead_until = None
        new_leader = None
        restore: Callable[[], Any] | None = None
        try:
            began = time.monotonic()
            await self.put(leader if victim is leader else survivors[0])
            await self.mid_rollout(survivors[0])
            at = time.monotonic()
            if fault == "leader_kill":
                assert victim is not None
                nodes.kill(victim)
                new_leader = await self.led_by_other(victim, survivors, at)
            elif fault == "leader_pause":
                assert victim is not None
                logged = len(victim.log)
                nodes.pause(victim)
                new_leader = await self.led_by_other(victim, survivors, at)
                nodes.resume(victim)
                await eventually(
                    lambda: asyncio.to_thread(
                        lambda: (
                            (nodes.cluster(victim) or {}).get("leader")
                            == (nodes.leader(survivors) or victim).name
                            != victim.name
                        )
                    ),
                    timeout=20,
                    what=f"{victim.name} to follow",
                )
            elif fault == "node_kill":
                assert victim is not None
                nodes.kill(victim)
            elif fault == "etcd_member":
                member = await asyncio.to_thread(etcd_leader, nodes.etcd)

                def restore() -> None:
                    nodes.etcd.start_member(member)
                    nodes.etcd.wait_healthy()

                nodes.etcd.kill_member(member)
                notes.append(f"member m{member}")
            elif fault == "etcd_all":

                def restore() -> None:
                    for i in range(len(nodes.etcd.members)):
                        nodes.etcd.continue_member(i)

                for i in range(len(nodes.etcd.members)):
                    nodes.etcd.pause_member(i)
                while time.monotonic() < at + ETCD_DOWN:  # the outage's length: load goes on
                    await loads[0][1].more(5)
                for i in range(len(nodes.etcd.members)):
                    nodes.etcd.continue_member(i)
                back = time.monotonic()
                new_leader = await self.led_by_other(None, survivors, back)
            elif fault == "engine_stop":
                notes.append(f"{await self.on_b()} containers on b")
                restore = self.second.start
                dead_from = time.monotonic()
                await asyncio.to_thread(self.second.stop)  # off the loop: the load goes on
                dead_until = time.monotonic()
            elif fault == "worker_kill":
                pid = workers_of(leader)[0]
                dead_from = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                # Until its sockets are closed the kernel still hands it new connections
                # (SO_REUSEPORT), lost with it: those are in flight on what died too.
                await eventually(lambda: not alive(pid), timeout=10, what="the worker gone")
                dead_until = time.monotonic()
            await self.complete(survivors, began + ROLLOUT_WITHIN)
            rollout = time.monotonic() - began
            if fault == "leader_pause":
                assert victim is not None
                notes.extend(acted(victim.log[logged:], victim.name))
            marks = [load.mark() for _, load in loads]
            for _, load in loads:
                await load.more(20)
        finally:
            await unloaded(loads)
            # Whole again, for the next round (also after a round that failed).
            if victim is not None and victim.paused:
                nodes.resume(victim)
            if victim is not None and not victim.alive:
                await nodes.start(nodes.nodes.index(victim))
            if restore is not None:
                await asyncio.to_thread(restore)
            await self.steady()
        outcomes = [o for _, load in loads for o in load.outcomes]
        in_flight, failed = [], []
        for o in outcomes:
            if not o.failed:
                continue
            died = dead_from is not None and dead_until is not None
            if died and o.at <= dead_until and o.at + o.took >= dead_from:
                in_flight.append(o)
            else:
                failed.append(o)
        for (name, load), mark in zip(loads, marks, strict=True):
            wanted = f"r{self.version}"
            if load.bodies(mark) != {wanted}:
                notes.append(f"{name} answered {sorted(load.bodies(mark))} after the rollout")
        return Round(fault, len(outcomes), failed, in_flight, new_leader, rollout, notes)


LEADER_ACTIONS = (
    "controller.cluster.backend: placed ",
    "controller.backends.docker.backend: started replica ",
    "controller.backends.docker.backend: adopted replica ",
)
"""Log lines only a leader writes: a placement on a node, a container started or adopted."""


def acted(log: str, name: str) -> list[str]:
    """What a leader paused past its term did from its SIGSTOP until the rollout completed:
    any of ``LEADER_ACTIONS`` is a fault, unless it led again (a term begun after)."""
    actions = [line for line in log.splitlines() if any(a in line for a in LEADER_ACTIONS)]
    if not actions:
        return []
    if f"{name} leads (term" in log:
        return [f"the paused leader led again and acted ({len(actions)} actions)"]
    return [f"the paused leader acted after SIGCONT: {actions[0][-120:]}"]
