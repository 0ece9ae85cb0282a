"""controller/node.py: a term's start on a real etcd, bounded and cancelled with the term.

A start that waits for ever (here: the peers' reports never loaded) must neither keep the
node half leading nor outlive its term: it logs "could not take the lead", is undone (the node
follows), and is begun again while the node is still elected."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from controller.backends.fake import FakeBackend
from controller.cluster.config import EtcdConfig, NodeConfig
from controller.cluster.election import leader_key
from controller.cluster.leadership import Record
from controller.etcd import EtcdClient
from controller.journal import Journal
from controller.node import ClusterNode
from controller.operations import Controller
from controller.store.etcd import EtcdStore
from gateway import Pool
from tests.support.etcd_cluster import EtcdCluster
from tests.support.eventually import eventually

_prefixes = itertools.count()
NodeFactory = Callable[[str], Awaitable[ClusterNode]]


@pytest.fixture
async def make_node(cluster: EtcdCluster) -> AsyncIterator[NodeFactory]:
    prefix = f"/node/{next(_prefixes)}/"
    nodes: list[ClusterNode] = []

    async def make(name: str) -> ClusterNode:
        loop = asyncio.get_running_loop()
        client = EtcdClient(cluster.endpoints, timeout=1.0)
        store = EtcdStore(client, prefix)
        pool = Pool()
        journal = Journal(store, time.time)
        local = FakeBackend(capacity=4)
        controller = Controller(pool, {"process": local}, store, journal, loop.time, time.time)

        async def apply_config() -> None:
            pass

        node = ClusterNode(
            etcd=EtcdConfig(endpoints=tuple(cluster.endpoints), prefix=prefix),
            node=NodeConfig(name=name, lease_ttl=2),
            address="http://127.0.0.1:1",
            listen=("127.0.0.1:1",),
            client=client,
            store=store,
            pool=pool,
            controller=controller,
            journal=journal,
            local=local,
            apply_config=apply_config,
        )
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        async with asyncio.timeout(10):
            await node.stop(keep_replicas=False)
        await node.client.close()


def leads(node: ClusterNode) -> Callable[[], bool]:
    """For ``eventually``: whether ``node`` leads (its election in the failure if not)."""

    def check() -> bool:
        assert node.leading(), f"the node does not lead: {node.election}"
        return True

    return check


@dataclass
class Hang:
    """The peers' ``loaded`` of a node waits the first ``count`` times until ``release``."""

    count: int
    release: asyncio.Event = field(default_factory=asyncio.Event)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a start waits there: past the fenced writes of ``store.lead``."""


def hang_first_loads(node: ClusterNode, count: int) -> Hang:
    hang = Hang(count)
    loaded = node.peers.loaded
    calls = itertools.count()

    async def hanging() -> None:
        if next(calls) < count:
            hang.entered.set()
            await hang.release.wait()
        await loaded()

    node.peers.loaded = hanging  # type: ignore[method-assign]
    return hang


def took_the_lead_failed(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "could not take the lead" in r.getMessage()]


async def test_a_start_that_hangs_is_bounded_undone_and_begun_again(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Still elected, a start that outlives its bound is given up and begun again. Unbounded,
    the node held the leader record and renewed it while it never acted."""
    caplog.set_level(logging.INFO)
    node = await make_node("n1")
    hang_first_loads(node, 1)
    node._start_bound = lambda: 1.0  # type: ignore[method-assign]
    await node.start()
    await eventually(lambda: took_the_lead_failed(caplog), what="a failed start logged")
    assert "its start took longer than 1 s" in took_the_lead_failed(caplog)[0]
    await eventually(leads(node), what="the node leading")
    assert node.terms == 2
    assert node.backend is not None
    assert node.publisher is not None


async def test_a_start_that_hangs_ends_with_its_term_and_the_node_follows(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A start still waiting when another node takes over is cancelled at once (not at its
    bound, 8 s here) and undone: the node follows, and takes over again once the other's
    record goes silent."""
    caplog.set_level(logging.INFO)
    node = await make_node("n1")
    hang = hang_first_loads(node, 10)
    await node.start()
    async with asyncio.timeout(10):
        await hang.entered.wait()  # the start waits: it has done its fenced writes
    assert node.terms == 1
    assert node.role == "follower"
    assert not node.leading()
    # Another node takes over while the start waits: the start is cancelled and undone.
    other = Record("n2", 1, 2.0, 1)
    await node.client.put(leader_key(node.prefix), other.encode())
    await eventually(lambda: took_the_lead_failed(caplog), timeout=5, what="a failed start logged")
    assert "the term ended as it began (n2 leads)" in took_the_lead_failed(caplog)[0]
    await eventually(lambda: node.follower._tasks, timeout=5, what="the node following")
    assert node.role == "follower"
    assert node.backend is None
    assert node.peers._task is None
    assert not node._in_term
    # n2's record goes silent: the node takes over and, its loads answered, leads.
    hang.release.set()
    await eventually(leads(node), timeout=15, what="the node leading")
    assert node.publisher is not None
