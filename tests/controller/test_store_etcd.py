"""The store in etcd (controller/store/etcd.py), on a real etcd.

The SQLite store's behaviour tests (tests/controller/test_store.py) that use only the store run
here again against ``EtcdStore``, with every write flushed to etcd; after each of them a fresh
store loads the prefix and must hold exactly the rows of the one that wrote them. Then what is
etcd's own: the fence, an unreachable etcd, ids across leaders, a newer schema refused.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from controller.errors import Deposed, NotFound, StoreUnavailable
from controller.etcd import Compare, EtcdClient
from controller.store import Store
from controller.store.etcd import MAX_OPS, EtcdStore
from tests.controller.test_store import (
    FakeClock,
    test_apply_revision_supersedes_the_active_rollout,
    test_at_most_one_active_rollout,
    test_config_applied_is_replaced_and_outlives_a_delete,
    test_create_rollout_to_an_existing_revision,
    test_delete_keeps_history_and_numbering_continues,
    test_events_are_ordered_and_paged,
    test_finish_rollout_moves_the_service,
    test_put_update_and_list_services,
    test_replicas_put_replace_remove,
    test_revision_numbers_are_per_service,
    test_update_rollout,
    test_usable_from_another_thread,
)
from tests.etcd_cluster import EtcdCluster

T = TypeVar("T")

BEHAVIOUR = (
    test_apply_revision_supersedes_the_active_rollout,
    test_at_most_one_active_rollout,
    test_config_applied_is_replaced_and_outlives_a_delete,
    test_create_rollout_to_an_existing_revision,
    test_delete_keeps_history_and_numbering_continues,
    test_events_are_ordered_and_paged,
    test_finish_rollout_moves_the_service,
    test_put_update_and_list_services,
    test_replicas_put_replace_remove,
    test_revision_numbers_are_per_service,
    test_update_rollout,
    test_usable_from_another_thread,
)
_prefixes = itertools.count()
TABLES = ("services", "revisions", "rollouts", "events", "replicas", "config_applied", "tokens")


class Loop:
    """An event loop in a thread: the store's etcd calls, run from synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), 1) as cluster:
        yield cluster


@pytest.fixture
def loop() -> Iterator[Loop]:
    runner = Loop()
    yield runner
    runner.close()


class Stores:
    """EtcdStores on one prefix, each with its own client, on the test's loop."""

    def __init__(self, etcd: EtcdCluster, loop: Loop) -> None:
        self.etcd = etcd
        self.loop = loop
        self.prefix = f"/test-store-{next(_prefixes)}/"
        self.clients: list[EtcdClient] = []

    def make(
        self, fence: Callable[[], list[Compare]] | None = None, lead: bool = True
    ) -> EtcdStore:
        async def build() -> EtcdStore:
            client = EtcdClient(self.etcd.endpoints, timeout=1.0)
            self.clients.append(client)
            store = EtcdStore(client, self.prefix, FakeClock())
            if lead:
                await store.lead(fence or (lambda: []))
            return store

        return self.loop.run(build())

    def flush(self, store: EtcdStore) -> None:
        self.loop.run(store.flush())

    def close(self) -> None:
        for client in self.clients:
            self.loop.run(client.close())


@pytest.fixture
def stores(etcd: EtcdCluster, loop: Loop) -> Iterator[Stores]:
    made = Stores(etcd, loop)
    yield made
    made.close()


def rows(store: Store) -> dict[str, list[tuple[object, ...]]]:
    with store._read() as conn:
        return {t: conn.execute(f"SELECT * FROM main.{t} ORDER BY 1, 2").fetchall() for t in TABLES}


class Flushing:
    """An EtcdStore whose every call is followed by a flush, as the leader's loop does."""

    def __init__(self, store: EtcdStore, flush: Callable[[EtcdStore], None]) -> None:
        self._store = store
        self._flush = flush

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                if self._store.pending:
                    self._flush(self._store)

        return call


@pytest.fixture
def store(stores: Stores) -> Iterator[Any]:
    written = stores.make()
    yield Flushing(written, stores.flush)
    loaded = stores.make()
    assert rows(loaded) == rows(written), "etcd does not hold what the store wrote"


@pytest.mark.parametrize("behaviour", BEHAVIOUR, ids=lambda f: f.__name__)
def test_the_sqlite_store_behaviour_on_etcd(behaviour: Callable[[Any], None], store: Any) -> None:
    behaviour(store)


def test_a_node_that_does_not_lead_refuses_writes_and_changes_nothing(stores: Stores) -> None:
    follower = stores.make(lead=False)
    with pytest.raises(StoreUnavailable, match="does not lead"):
        follower.put_service("web", "{}", 1)
    assert rows(follower)["services"] == []
    assert follower.pending == 0


def test_a_fenced_write_refused_drops_the_pending_writes_and_raises_deposed(
    stores: Stores, loop: Loop
) -> None:
    term = {"ok": True}
    key = b"/fence-" + stores.prefix.encode()
    loop.run(stores.make(lead=False).client.put(key, b"1"))  # the fence key exists: create rev

    def fence() -> list[Compare]:
        return [Compare(key, "VALUE", "EQUAL", b"1" if term["ok"] else b"2")]

    leader = stores.make(fence)
    leader.put_service("web", "{}", 1)
    stores.flush(leader)
    term["ok"] = False  # another node leads now
    leader.update_service("web", desired_replicas=3)
    with pytest.raises(Deposed):
        stores.flush(leader)
    assert leader.pending == 0
    with pytest.raises(StoreUnavailable):
        leader.put_service("other", "{}", 1)  # stale until it leads again
    fresh = stores.make()
    row = fresh.service("web")
    assert row is not None
    assert row.desired_replicas == 1


def test_etcd_unreachable_keeps_the_writes_pending_until_it_returns(
    tmp_path: Path, loop: Loop
) -> None:
    with EtcdCluster(tmp_path / "etcd", 1) as cluster:
        made = Stores(cluster, loop)
        try:
            leader = made.make()
            leader.put_service("web", "{}", 1)
            cluster.stop_all()
            leader.update_service("web", desired_replicas=2)
            with pytest.raises(StoreUnavailable, match="unreachable"):
                made.flush(leader)
            assert leader.pending >= 1
            assert not leader.connected
            cluster.start_member(0)
            cluster.wait_healthy()
            made.flush(leader)
            assert leader.pending == 0
            assert leader.connected
            row = made.make().service("web")
            assert row is not None
            assert row.desired_replicas == 2
        finally:
            made.close()


def test_ids_continue_across_leaders_and_trimming(stores: Stores) -> None:
    first = stores.make()
    first.put_service("web", "{}", 1)
    ids = [first.add_event("web", "x", f"e{i}").id for i in range(5)]
    stores.flush(first)
    second = stores.make()
    assert second.add_event("web", "x", "next").id == ids[-1] + 1
    stores.flush(second)
    assert second.add_revision("web", "k2", "{}").number == 1
    stores.flush(second)
    third = stores.make()
    assert third.add_revision("web", "k3", "{}").number == 2


def test_a_write_bigger_than_one_transaction_is_sent_whole(stores: Stores) -> None:
    leader = stores.make()
    leader.put_service("web", "{}", 1)
    for i in range(MAX_OPS * 2 + 5):
        leader.add_event("web", "x", f"e{i}")
    assert leader.pending > 1
    stores.flush(leader)
    leader.delete_service("web")  # one write: the service and its replicas, tokens...
    stores.flush(leader)
    assert rows(stores.make()) == rows(leader)


def test_a_state_written_by_a_newer_gateway_is_refused(stores: Stores, loop: Loop) -> None:
    client = stores.make(lead=False).client
    loop.run(client.put((stores.prefix + "state/schema_version").encode(), b"999"))
    with pytest.raises(StoreUnavailable, match="newer"):
        stores.make()


def test_missing_rows_raise_not_found_as_on_sqlite(store: Any) -> None:
    with pytest.raises(NotFound):
        store.update_service("nope", desired_replicas=1)
