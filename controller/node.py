"""This process as a node of a cluster: what it does while it follows, and while it leads.

Every node, whatever its role:
- holds a lease (``LeaseKeeper``) and its record under ``<prefix>nodes/<name>`` (``NodeRegistry``);
- runs the replicas placed on it (``Agent``, through its local process backend);
- serves traffic from its own pool and probes for itself.

A node that **follows** has its pool follow the leader's records (``pools.Follower``) and
reports what it routes to, which drains it holds nothing of and its traffic per service; its
store mirror follows etcd by watch; its admin API forwards to the leader (``admin.cluster``),
but for a replica's logs, read on the node that runs it; it stores no event.

A node that **leads** (``Election``) loads the state fresh as the one writer, restores the
services (adopting the replicas the nodes run), runs the controller, places replicas on the
nodes (``ClusterBackend``), publishes its pool (``pools.Publisher``) and takes the other
nodes' reports as peers of its drains and as traffic its autoscaler reads (``peers.Peers``).
Every write it makes is fenced by its leadership. When it stops leading (its record not renewed
in time: a pause, a partition, etcd away; or another node took over) it stops the controller at
once, stops nothing else, and follows.

The order of each change of role is the one the parts require (see each): the pool is never
emptied, so traffic goes on through the change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import aiohttp

from controller.admin.cluster import NodeInfo
from controller.backends.process import ProcessBackend
from controller.cluster.agent import Agent
from controller.cluster.backend import ClusterBackend
from controller.cluster.config import EtcdConfig, NodeConfig
from controller.cluster.election import Election
from controller.cluster.engines import Engines
from controller.cluster.lease import LeaseEvent, LeaseKeeper
from controller.cluster.nodes import NodeRecord, NodeRegistry
from controller.cluster.peers import Peers
from controller.cluster.pools import Follower, Publisher
from controller.errors import Deposed, StoreUnavailable
from controller.etcd import Compare, EtcdClient
from controller.journal import Journal
from controller.operations import Controller
from controller.store.etcd import EtcdStore
from controller.tasks import cancel_task, guarded_task
from gateway import Pool

log = logging.getLogger("gateway.cluster")

Role = Literal["starting", "follower", "leader", "stopped"]
REPLICA_COUNT_INTERVAL = 2.0
"""Seconds between looks at how many replicas this node runs (a local count, no etcd read)."""
FLUSH_INTERVAL = 0.02
"""Seconds between the leader's flushes of its store writes to etcd, when there are any."""
START_RETRY = 1.0
"""Seconds before a node still elected begins again a term whose start failed."""
START_CALLS = 4
"""etcd calls' timeouts a term's start may take to load, beyond the grace it gives the nodes
to register: the bound of the start (each load is one call when etcd answers)."""


def _every_placed_node_registered(backend: ClusterBackend) -> bool:
    return set(backend.placed().values()) <= set(backend.nodes)


def _not_leading() -> list[Compare]:
    raise Deposed("this node does not lead")


def idle_backend(client: EtcdClient, prefix: str) -> ClusterBackend:
    """The controller's process backend before this node first leads: it places nothing."""
    return ClusterBackend(client, prefix, _not_leading)


class ClusterNode:
    """See the module docstring. ``start``, then ``stop``. The admin API's ``Membership``."""

    def __init__(
        self,
        *,
        etcd: EtcdConfig,
        node: NodeConfig,
        address: str,
        listen: Sequence[str],
        client: EtcdClient,
        store: EtcdStore,
        pool: Pool,
        controller: Controller,
        journal: Journal,
        local: ProcessBackend,
        apply_config: Callable[[], Awaitable[None]],
        engines: Engines | None = None,
    ) -> None:
        self.name = node.name
        self.engines = engines
        """The Docker Engines, talked to by this node while it leads (None: none configured)."""
        self.prefix = etcd.prefix
        self.client = client
        self.store = store
        self.pool = pool
        self.controller = controller
        self.journal = journal
        self.apply_config = apply_config
        self.forget_after = node.forget_after
        self.local = local
        self.role: Role = "starting"
        self.keeper = LeaseKeeper(client, ttl=node.lease_ttl)
        self.election = Election(client, self.keeper, node.name, self.prefix)
        self.registry = NodeRegistry(
            client,
            self.keeper,
            self.prefix,
            NodeRecord(
                name=node.name,
                address=address,
                listen=tuple(listen),
                started_at=time.time(),
                capacity=local.capacity,
            ),
        )
        self.agent = Agent(client, self.prefix, node.name, local, lambda: self.keeper.lease)
        self.follower = Follower(
            client,
            self.prefix,
            pool,
            node.name,
            lambda: self.keeper.lease,
            fresh_for=float(node.lease_ttl),
        )
        self.peers = Peers(
            client,
            self.prefix,
            pool,
            node.name,
            on_change=self._peer_changed,
            on_waiting=self._waiting,
        )
        # Held requests are demand on every node: the leader samples at once, a follower
        # reports at once. The other nodes' traffic is in every sample the leader takes (the
        # peers are empty while this node follows, and its reconciler samples only while it
        # leads).
        pool.on_waiting = self._waiting
        controller.reconciler.elsewhere = self.peers.elsewhere
        self.publisher: Publisher | None = None
        self.backend: ClusterBackend | None = None
        self._past_publishing = 0
        self.terms = 0
        """Times this node began to lead."""
        self._session: aiohttp.ClientSession | None = None
        self._roles: asyncio.Task[None] | None = None
        self._counting: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._in_term = False
        """A term's start began, and its end has not run yet (undone in ``_end_term``)."""
        self.journal.persist = False

    # -- Membership (the admin API) -----------------------------------------------------------

    @property
    def node(self) -> str:
        return self.name

    def leading(self) -> bool:
        return self.role == "leader" and self.election.leading

    def leader(self) -> NodeInfo | None:
        name = self.election.leader
        record = None if name is None else self.registry.nodes.get(name)
        if name is None or record is None:
            return None
        return self._info(record, name)

    def nodes(self) -> Sequence[NodeInfo]:
        leader = self.election.leader
        return [self._info(r, leader) for _, r in sorted(self.registry.nodes.items())]

    def _info(self, record: NodeRecord, leader: str | None) -> NodeInfo:
        return NodeInfo(
            name=record.name,
            address=record.address,
            leader=record.name == leader,
            started_at=record.started_at,
            replicas=record.replicas,
            capacity=record.capacity,
        )

    def store_reachable(self) -> bool:
        return not self.keeper.unreachable and self.store.connected

    def store_reason(self) -> str:
        return self.keeper.unreachable or self.store.unreachable

    def pool_requests(self) -> int:
        """etcd requests made to publish and follow pools, and to read the reports."""
        published = self.publisher.requests if self.publisher is not None else 0
        return self._past_publishing + published + self.follower.requests + self.peers.requests

    async def committed(self) -> None:
        await self.store.flush()

    def node_address(self, name: str) -> str | None:
        record = self.registry.nodes.get(name)
        return None if record is None else record.address

    def replica_node(self, service: str, replica_id: str) -> str | None:
        """From the replica's row (its handle names the node), in this node's mirror."""
        try:
            rows = self.store.replicas(service)
        except StoreUnavailable:
            return None
        for row in rows:
            if row.replica_id != replica_id:
                continue
            try:
                handle = json.loads(row.handle_json)
            except ValueError:
                return None
            node = handle.get("node") if isinstance(handle, dict) else None
            return node if isinstance(node, str) else None
        return None

    def local_logs(self, replica_id: str, tail: int) -> list[str] | None:
        if not self.local.has_logs(replica_id):
            return None
        return self.local.logs(replica_id, tail)

    def session(self) -> aiohttp.ClientSession:
        """The HTTP client that forwards admin requests to the leader."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    # -- life ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the cluster as a follower and campaign; return once this node serves what the
        cluster's state says (or, with etcd unreachable, at once: it serves once etcd answers)."""
        self.keeper.start()
        self.registry.start()
        self.keeper.subscribe(self._on_lease)
        await self.agent.open()
        await self.follower.start()
        self.role = "follower"
        self.election.start()
        self._roles = guarded_task(self._run_roles(), f"cluster:{self.name}:roles")
        self._counting = guarded_task(self._count_replicas(), f"cluster:{self.name}:replicas")

    async def stop(self, *, keep_replicas: bool = True) -> None:
        """Leave the cluster: hand the lead over at once (resign), stop following.

        ``keep_replicas``: the lease is left to expire and the node's record with it, so a
        node back within the TTL keeps running its replicas; otherwise the lease is revoked,
        the leader reports this node's replicas gone and places them elsewhere, and this
        node's agent stops them when it starts again."""
        await cancel_task(self._roles)
        await cancel_task(self._counting)
        await self._end_term("this node stops", follow=False)
        self.role = "stopped"
        with contextlib.suppress(Exception):
            await self.election.resign()
        await self.election.stop()
        await self.follower.stop()
        if not keep_replicas:
            await self.agent.stop_all()
        await self.agent.close()
        await self.registry.stop(deregister=not keep_replicas)
        await self.keeper.stop(revoke=not keep_replicas)
        if self._session is not None:
            await self._session.close()

    async def _run_roles(self) -> None:
        while True:
            await self.election.elected()
            failed = await self._take_lead()
            if failed is None:
                await self.election.deposed()
                log.warning("node %s no longer leads: %s", self.name, self.election.reason)
            else:
                log.warning("node %s: could not take the lead: %s", self.name, failed)
            await self._end_term(failed or self.election.reason)
            if failed is not None and self.election.leading:
                await asyncio.sleep(START_RETRY)  # still elected: begin again

    async def _take_lead(self) -> str | None:
        """Begin the term won; None once this node leads, otherwise why it could not. The
        start is cancelled if the term ends meanwhile (its record not renewed, another took
        over), and bounded: no await of it outlives the term, or waits for ever."""
        begin = asyncio.create_task(self._begin_term(), name=f"cluster:{self.name}:begin")
        deposed = asyncio.create_task(self.election.deposed(), name=f"cluster:{self.name}:term")
        try:
            await asyncio.wait((begin, deposed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_task(deposed)
            if not begin.done():
                await cancel_task(begin)
        if begin.cancelled():
            return f"the term ended as it began ({self.election.reason})"
        error = begin.exception()
        if error is None:
            return None
        if isinstance(error, (Deposed, StoreUnavailable)):
            return error.message
        if isinstance(error, TimeoutError):
            return f"its start took longer than {self._start_bound():g} s"
        log.error("node %s: the term's start failed", self.name, exc_info=error)
        return f"{type(error).__name__}: {error}"

    def _start_bound(self) -> float:
        return self._grace() + START_CALLS * self.client.timeout

    def _grace(self) -> float:
        return self.keeper.ttl + 2.0

    async def _begin_term(self) -> None:
        self._in_term = True  # from here on, _end_term undoes what was done
        self.terms += 1
        log.info("node %s leads (term %s)", self.name, self.election.term)
        async with asyncio.timeout(self._start_bound()):
            await self.follower.stop()
            await self.store.lead(self.election.fence)
            await self.peers.start()
            await self.peers.loaded()
            self.follower.handover()
            grace = self._grace()
            backend = ClusterBackend(
                self.client,
                self.prefix,
                self.election.fence,
                absent_grace=grace,
                forget_after=self.forget_after,
            )
            backend.set_exit_handler(self.controller.reconciler.on_exit)
            self.backend = backend  # closed by _end_term, even half open
            await backend.open()
            # After etcd was away every lease ended: the nodes register again as it returns.
            # Their replicas are adopted, not replaced, if they do within the grace.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await backend.wait(_every_placed_node_registered)
        self.controller.backends["process"] = backend  # type: ignore[index]
        if self.engines is not None:
            # Connected before restore: adoption finds the cluster's containers by their labels.
            docker = await self.engines.open()
            docker.set_exit_handler(self.controller.reconciler.on_exit)
            self.controller.backends["docker"] = docker  # type: ignore[index]
        self.controller.reconciler.gate = self.peers.routable_everywhere
        self.journal.persist = True
        self.role = "leader"
        self._flusher = guarded_task(self._flush(), f"cluster:{self.name}:flush")
        self.controller.restore()
        self._prune()
        await self._withdraw_unknown(backend)
        self.publisher = Publisher(
            self.client,
            self.prefix,
            self.pool,
            self.election.fence,
            drain_timeout=self._drain_timeout,
            prune=True,
        )
        await self.publisher.start()
        await self.apply_config()

    async def _end_term(self, reason: str, *, follow: bool = True) -> None:
        """Stop acting at once (the controller first), then follow. Undoes a start that
        failed or was cancelled half way as well."""
        if not self._in_term:
            return
        self._in_term = False
        self.role = "follower"
        self.journal.persist = False
        reconciler = self.controller.reconciler
        reconciler.gate = None
        await reconciler.close()
        self.controller.executor.running.clear()
        await cancel_task(self._flusher)
        self._flusher = None
        if self.publisher is not None:
            await self.publisher.stop()
            self._past_publishing += self.publisher.requests
            self.publisher = None
        if self.backend is not None:
            await self.backend.close()
            self.backend = None
        if self.engines is not None:
            await self.engines.close()
        await self.peers.stop()
        self.store.follow()
        if not follow:
            return
        await self.follower.start()
        log.info("node %s follows (%s)", self.name, reason)

    async def _count_replicas(self) -> None:
        """Keep the node's record saying how many replicas it runs (``gateway status``)."""
        said: int | None = None
        while True:
            count = self.local.in_use
            if count != said:
                with contextlib.suppress(Exception):
                    await self.registry.update(replicas=count)
                    said = count
            await asyncio.sleep(REPLICA_COUNT_INTERVAL)

    def _on_lease(self, event: LeaseEvent) -> None:
        if event.kind in ("granted", "restored"):
            self.agent.republish()  # the capacity record is bound to the lease

    # -- while leading --------------------------------------------------------------------------

    async def _flush(self) -> None:
        """The leader's store writes reach etcd within ``FLUSH_INTERVAL`` (an admin write
        waits for its own: ``committed``)."""
        while True:
            await asyncio.sleep(FLUSH_INTERVAL)
            if not self.store.pending:
                continue
            try:
                await self.store.flush()
            except Deposed:
                return  # the election says so too; _run_roles ends the term
            except StoreUnavailable as e:
                log.warning("node %s: state not written yet: %s", self.name, e.message)
                await asyncio.sleep(0.5)

    def _prune(self) -> None:
        """What this node's pool had from following that the restored state does not have."""
        running = self.controller.executor.running
        names = set(self.controller.service_names())
        for service, pool in list(self.pool.services.items()):
            if service not in names:
                self.pool.remove_service(service)
                continue
            for upstream in pool.snapshot.upstreams:
                if upstream.id not in running:
                    self.pool.remove_upstream(service, upstream.id, "not in the cluster's state")

    async def _withdraw_unknown(self, backend: ClusterBackend) -> None:
        """Placements the state has no replica of (a leader that died between placing one
        and recording it): stopped, so nothing runs that nobody owns."""
        known = self.controller.executor.running
        for replica_id in [r for r in backend.placed() if r not in known]:
            log.warning(
                "node %s: replica %s is placed but not in the state: stopped", self.name, replica_id
            )
            with contextlib.suppress(Exception):
                await backend.stop(replica_id, 10.0)

    def _drain_timeout(self, service: str, upstream_id: str) -> float | None:
        state = self.controller.reconciler.services.get(service)
        return None if state is None else float(state.spec.rollout.drain_timeout)

    def _peer_changed(self, node: str) -> None:
        if self.role == "leader":
            self.controller.reconciler.regate()

    def _waiting(self, service: str) -> None:
        """Requests of ``service`` began to be held, here or (said a report) on another node."""
        if self.role == "leader":
            self.controller.reconciler.on_waiting(service)
        else:
            self.follower.wake()
