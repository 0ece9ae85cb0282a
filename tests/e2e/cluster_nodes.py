"""Three gateway nodes on one machine: real processes on 127.0.0.2, .3 and .4, one etcd cluster.

``Nodes`` writes a config per node (traffic and admin on free ports of the node's loopback
address, ``state.store: etcd``, a short lease TTL so failovers take seconds), starts each as
``python -m controller.main serve`` and stops, kills, pauses and continues them by pid. Its
``api`` talks to any node's admin API (a node that does not lead forwards to the leader).

Teardown stops every node, then every replica any node ran (their pids are in etcd's running
records, or, for one a node killed before it wrote the record, found by its log file; each
replica is its own process group), so a test leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from controller.backends.procfs import leaders_writing_to
from tests.e2e.conftest import gateway_process
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import GiveUp, eventually
from tests.support.ports import free_port, port_block

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
SERVER = f"{sys.executable} -m http.server $PORT --bind $HOST"
"""A replica: a stdlib static file server on the node's address and the port it was given."""
LEASE_TTL = 2


@dataclass
class Node:
    name: str
    host: str
    port: int
    admin_port: int
    directory: Path
    process: asyncio.subprocess.Process | None = None
    paused: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def log(self) -> str:
        try:
            return (self.directory / "gateway.log").read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Nodes:
    base: Path
    etcd: EtcdCluster
    prefix: str = "/gateway-test/"
    count: int = 3
    capacity: int = 4
    workers: int = 1
    """Each node's worker processes (``workers``)."""
    ports: int = field(default_factory=lambda: port_block(600))
    """The first port of the replicas' ranges, 200 a node on from it (three nodes' worth)."""
    docker: dict[str, Any] | None = None
    """Every node's ``backends.docker`` (None: none)."""
    nodes: list[Node] = field(default_factory=list)
    services: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The ``services:`` of a node's config, by node name (none by default)."""

    def __post_init__(self) -> None:
        for i in range(self.count):
            host = HOSTS[i]
            directory = self.base / f"node{i + 1}"
            directory.mkdir(parents=True, exist_ok=True)
            self.nodes.append(Node(f"n{i + 1}", host, free_port(host), free_port(host), directory))

    def config(self, node: Node, index: int) -> dict[str, Any]:
        low = self.ports + index * 200
        return {
            "listen": f"{node.host}:{node.port}",
            "admin": {"listen": f"{node.host}:{node.admin_port}", "token_env": None},
            "state_dir": str(node.directory / "state"),
            "log_level": "info",
            "replicas_on_exit": "stop",
            "workers": self.workers,
            "access_log": {"enabled": False},
            "state": {
                "store": "etcd",
                "etcd": {"endpoints": self.etcd.endpoints, "prefix": self.prefix},
            },
            "node": {"name": node.name, "address": node.host, "lease_ttl": LEASE_TTL},
            "backends": {
                "process": {"capacity": self.capacity, "port_range": f"{low}-{low + 199}"},
                **({"docker": self.docker} if self.docker is not None else {}),
            },
            "services": self.services.get(node.name, []),
        }

    async def start(self, index: int) -> Node:
        node = self.nodes[index]
        path = node.directory / "gateway.yaml"
        path.write_text(yaml.safe_dump(self.config(node, index)))
        node.process = await gateway_process(path, node.directory / "gateway.log")
        node.paused = False
        await eventually(
            lambda: asyncio.to_thread(lambda: self._ready(node)),
            timeout=20,
            what=f"{node.name} ready",
        )
        return node

    async def start_all(self) -> None:
        # At once, as the nodes of a cluster start: each waits for its own readiness.
        await asyncio.gather(*(self.start(i) for i in range(self.count)))
        await eventually(
            lambda: asyncio.to_thread(lambda: self.leader() is not None),
            timeout=10,
            what="a leader",
        )

    def _ready(self, node: Node) -> bool:
        if node.process is not None and node.process.returncode is not None:
            raise GiveUp(f"{node.name} exited: {node.log[-3000:]}")
        try:
            with urllib.request.urlopen(node.admin + "/readyz", timeout=1) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    # -- the admin API ------------------------------------------------------------------------

    def cluster(self, node: Node) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(node.admin + "/api/cluster", timeout=2) as answer:
                data: dict[str, Any] = json.loads(answer.read())
                return data
        except OSError:
            return None

    def leader(self, among: list[Node] | None = None) -> Node | None:
        """The node that leads, as the live nodes agree (None: no agreement yet)."""
        views = [self.cluster(n) for n in (among or self.live())]
        names = {v["leader"] for v in views if v is not None}
        if len(names) != 1 or None in names:
            return None
        name = names.pop()
        return next((n for n in self.nodes if n.name == name), None)

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive and not n.paused]

    async def api(
        self, method: str, path: str, body: Any = None, node: Node | None = None
    ) -> tuple[int, Any]:
        target = node or self.live()[0]
        timeout = aiohttp.ClientTimeout(total=15)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.request(method, target.admin + path, json=body) as answer:
                text = await answer.text()
                try:
                    return answer.status, json.loads(text)
                except ValueError:
                    return answer.status, text

    async def service(self, name: str = "web", node: Node | None = None) -> dict[str, Any]:
        status, body = await self.api("GET", f"/api/services/{name}", node=node)
        assert status == 200, body
        return dict(body)

    # -- faults -------------------------------------------------------------------------------

    async def stop(self, node: Node) -> None:
        """SIGTERM, then its exit (a leader resigns: another leads at once)."""
        assert node.process is not None
        node.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(node.process.wait(), 15)

    def kill(self, node: Node) -> None:
        assert node.process is not None
        node.process.kill()

    def pause(self, node: Node) -> None:
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGSTOP)
        node.paused = True

    def resume(self, node: Node) -> None:
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGCONT)
        node.paused = False

    # -- helpers ------------------------------------------------------------------------------

    def replica_pids(self) -> dict[str, int]:
        """Every replica's pid, from etcd's running records."""
        endpoint = next(
            (e for i, e in enumerate(self.etcd.endpoints) if self.etcd.healthy(i)), None
        )
        if endpoint is None:
            return {}
        key = (self.prefix + "running/").encode()
        end = key[:-1] + bytes([key[-1] + 1])
        body = json.dumps(
            {
                "key": base64.b64encode(key).decode(),
                "range_end": base64.b64encode(end).decode(),
            }
        ).encode()
        request = urllib.request.Request(endpoint + "/v3/kv/range", data=body)
        with urllib.request.urlopen(request, timeout=5) as answer:
            data = json.loads(answer.read())
        pids: dict[str, int] = {}
        for kv in data.get("kvs", []):
            record = json.loads(base64.b64decode(kv["value"]))
            rid = base64.b64decode(kv["key"]).decode().rsplit("/", 1)[-1]
            if isinstance(record.get("pid"), int):
                pids[rid] = record["pid"]
        return pids

    async def close(self) -> None:
        pids: set[int] = set()
        with contextlib.suppress(Exception):
            pids = set(self.replica_pids().values())
        for node in self.nodes:
            if node.process is None or node.process.returncode is not None:
                continue
            if node.paused:
                self.resume(node)
            node.process.send_signal(signal.SIGTERM)
        for node in self.nodes:
            if node.process is None:
                continue
            try:
                await asyncio.wait_for(node.process.wait(), 15)
            except TimeoutError:
                node.process.kill()
                await node.process.wait()
        with contextlib.suppress(Exception):
            pids |= set(self.replica_pids().values())
        # And those with no record: spawned by a node killed before it wrote one.
        for node in self.nodes:
            pids |= set(leaders_writing_to(node.directory / "state" / "logs", ".log"))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def started(base: Path, members: int = 3, **options: Any) -> AsyncIterator[Nodes]:
    """``members`` etcd members and three nodes (``options`` for ``Nodes``) under ``base``,
    started; closed on the way out, replicas and all."""
    etcd = EtcdCluster(base / "etcd", members).start()
    cluster = Nodes(base / "nodes", etcd, **options)
    try:
        await cluster.start_all()
        yield cluster
    finally:
        await cluster.close()
        etcd.close()
