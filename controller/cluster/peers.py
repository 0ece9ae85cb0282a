"""On the leader: the nodes that report (``<prefix>reports/<node>``) are peers of its pool.

Each follower's report (``pools.Follower``) says which upstreams it routes to and which
draining ones it holds nothing of. Taken in here, a report makes its node a peer of the
leader's ``Pool`` (``peer_joined``, a negative int stable per node name, so it never meets a
worker's pid): a drain begun there waits for the node's idle report of it (``peer_idle``,
with the drain's ``since``). A report's key is bound to its node's lease, so when the node
dies the key goes and the node leaves (``peer_left``): it holds nothing, no drain waits for
it. With etcd unreachable the peers stay as they are; drains then end by their timeout.

The reports' demand goes to a ``DemandTable``: ``elsewhere(service)`` is the other nodes'
traffic that the autoscaler adds to the leader's own, and a node that begins holding
requests of a service calls ``on_waiting`` (a cold start goes at once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from controller.cluster.demand import DemandTable
from controller.cluster.feed import RETRY, Feed
from controller.cluster.membership import NodeReport, PeerTable
from controller.cluster.pools import reports_key
from controller.etcd import EtcdClient
from controller.planning.autoscaler import Sample
from controller.tasks import cancel_task, guarded_task
from gateway import Pool

log = logging.getLogger(__name__)


class Peers:
    """The reporting nodes as peers of the leader's ``pool``.

    ``node`` is the leader's own name: its report (left from when it followed) is not a
    peer's. ``on_change(node)`` is called after each report taken in or gone, for the loop
    that waits for a replacement to be routable everywhere; ``on_waiting(service)`` when a
    node begins holding requests of ``service``. ``clock``: the loop's monotonic time.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        pool: Pool,
        node: str = "",
        *,
        on_change: Callable[[str], object] | None = None,
        on_waiting: Callable[[str], object] | None = None,
        clock: Callable[[], float] | None = None,
        retry: tuple[float, float] = RETRY,
    ) -> None:
        self.pool = pool
        self.node = node
        self.on_change = on_change
        self.on_waiting = on_waiting
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.table = PeerTable()
        self.demand = DemandTable()
        self.feed = Feed(client, reports_key(prefix), self._load, self.change, retry=retry)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the reports, then watch them, in the background (``loaded`` says when the
        nodes that report are peers: a drain begun before waits for none of them)."""
        self.feed.revision = 0  # the table starts empty: load it whole
        self.feed.loaded.clear()
        self._task = guarded_task(self.feed.run(), f"cluster peers {self.feed.prefix!r}")

    async def stop(self) -> None:
        """Stop, and let every node go: no drain of the pool waits for them any more."""
        await cancel_task(self._task)
        self._task = None
        for node in list(self.table.reports):
            self._left(node)

    async def loaded(self) -> None:
        """Return once the reports were loaded: every node that reported is a peer."""
        await self.feed.loaded.wait()

    @property
    def requests(self) -> int:
        """etcd requests made: loads and watches opened."""
        return self.feed.requests

    @property
    def nodes(self) -> list[str]:
        """The nodes that report, by name."""
        return sorted(self.table.reports)

    def routable_everywhere(self, service: str, upstream_id: str) -> bool:
        """Routable on every node that reports: one that has not reported the upstream yet
        does not route to it. True when no node reports (the leader alone serves)."""
        return self.table.routable_everywhere(service, upstream_id)

    def elsewhere(self, service: str) -> Sample:
        """``service``'s traffic on the nodes that report, as of now (``DemandTable.merged``)."""
        return self.demand.merged(service, self.clock())

    def _load(self, values: dict[str, bytes]) -> None:
        for node in list(self.table.reports.keys() - values.keys()):
            self._left(node)
        for node, value in values.items():
            self.change(node, value)

    def change(self, node: str, value: bytes | None) -> None:
        """``node``'s report is now ``value`` (None: gone, and the node with it)."""
        if node == self.node:
            return
        if value is None:
            self._left(node)
            return
        try:
            report = NodeReport.decode(value)
        except ValueError as exc:
            log.error("report of node %s unreadable: %s", node, exc)
            return
        peer = self.table.number(node)
        if self.table.update(node, report):
            log.info("node %s reports (pool peer %d)", node, peer)
            self.pool.peer_joined(peer)
        for (service, uid), since in report.idle.items():
            self.pool.peer_idle(peer, service, uid, since)
        began = self.demand.update(node, report.demand, self.clock(), report.fresh_for)
        if self.on_change is not None:
            self.on_change(node)
        if self.on_waiting is not None:
            for service in began:
                self.on_waiting(service)

    def _left(self, node: str) -> None:
        self.demand.remove(node)
        if self.table.remove(node):
            log.info("node %s no longer reports: it holds nothing", node)
            self.pool.peer_left(self.table.number(node))
            if self.on_change is not None:
                self.on_change(node)

    def __repr__(self) -> str:
        return f"<Peers nodes={self.nodes} {self.feed!r}>"
