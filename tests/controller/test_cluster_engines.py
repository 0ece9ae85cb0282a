"""The leader's Docker Engines (``controller/cluster/engines.py``) on a real etcd: one cluster
id for every node and term, a backend of its own per term, closed as the term ends."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from controller.cluster.engines import Engines, cluster_id
from controller.etcd import EtcdClient
from tests.support.etcd_cluster import EtcdCluster


class Backend:
    """What ``Engines`` uses of a Docker backend."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.connected = self.closed = False

    async def connect(self) -> None:
        self.connected = True

    async def close(self) -> None:
        self.closed = True


async def test_every_node_and_term_labels_with_one_cluster_id(cluster: EtcdCluster) -> None:
    prefix = f"/engines-{uuid.uuid4().hex[:8]}/"
    clients = [EtcdClient(cluster.endpoints, timeout=1.0) for _ in range(3)]
    try:
        # Three nodes asking at once (a first term, and two more): one id wins.
        ids = await asyncio.gather(*(cluster_id(c, prefix) for c in clients))
        assert len(set(ids)) == 1
        made: list[Backend] = []

        def make(instance: str) -> Any:
            made.append(Backend(instance))
            return made[-1]

        engines = Engines(clients[0], prefix, make)
        first = await engines.open()
        assert first.connected
        assert engines.current == [first]
        await engines.close()  # the term ended: talks to no engine
        assert first.closed
        assert engines.current == []
        other = Engines(clients[1], prefix, make)  # the next leader
        second = await other.open()
        assert second is not first
        assert [b.instance for b in made] == [ids[0], ids[0]]
        await other.close()
    finally:
        for c in clients:
            await c.close()
