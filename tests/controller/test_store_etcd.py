"""The store in etcd (controller/store/etcd.py), on a real etcd.

The SQLite store's behaviour tests (tests/controller/test_store.py) that use only the store run
here again against ``EtcdStore``, with every write flushed to etcd; after each of them a fresh
store loads the prefix and must hold exactly the rows of the one that wrote them (the last
still open). Those about the SQLite file itself skip, saying why. Then what is etcd's own:
the fence, an unreachable etcd, ids across leaders, a newer schema refused.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import sqlite3
import subprocess
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from controller.errors import Deposed, NotFound, StoreUnavailable, WriteTooLarge
from controller.etcd import Compare, Delete, EtcdClient, Put
from controller.store import Store
from controller.store.etcd import MAX_BYTES, MAX_OPS, PRIMARY_KEYS, TRIM_PER_WRITE, EtcdStore
from controller.store.etcd_keys import row_key, split_key
from controller.store.etcd_outbox import Outbox, op_size
from tests.controller import test_store
from tests.controller.test_store import FakeClock
from tests.support.etcd_cluster import EtcdCluster

T = TypeVar("T")

SQLITE_ONLY = {
    "test_schema_created": "SQLite-only: the file's tables, its journal mode and its connection's"
    " pragmas (etcd's schema version: test_a_state_written_by_a_newer_gateway_is_refused)",
    "test_refuses_a_newer_schema": "SQLite-only: a newer version written into the file (etcd:"
    " test_a_state_written_by_a_newer_gateway_is_refused)",
    "test_migrates_a_version_1_database_and_keeps_its_data": "SQLite-only: an old file migrated"
    " (etcd holds rows, loaded into a mirror made at the current schema)",
    "test_a_version_3_database_gains_the_strategy_column_and_keeps_its_rollouts": "SQLite-only:"
    " an old file migrated (etcd holds rows, loaded into a mirror made at the current schema)",
    "test_repr_says_the_file_and_whether_closed": "SQLite-only: the repr names the file",
    "test_opening_the_file_trims_every_service": "SQLite-only: opening the file trims; a new"
    " leader's load trims nothing, its writes do (test_trimming_events_fits_each_write_in_one"
    "_transaction)",
    "test_readonly_store_needs_an_existing_current_file": "SQLite-only: a read-only open of a"
    " missing or unmigrated file",
    "test_disk_full_raises_and_keeps_the_old_state": "SQLite-only: a full disk under the file"
    " (etcd's limit is a transaction's size: test_a_write_bigger_than_one_transaction_is"
    "_refused_and_applies_nothing)",
    "test_unopenable_paths": "SQLite-only: paths that cannot be opened as a database",
    "test_readonly_directory": "SQLite-only: file modes",
    "test_sigkill_at_a_random_moment_leaves_a_consistent_store": "SQLite-only: a writer process"
    " killed in a transaction of the file (etcd: a flush is one etcd transaction)",
}
"""test_store.py's tests that are about SQLite itself, by name, with why they do not apply."""


def _behaviour() -> list[Any]:
    """Every test of test_store.py, those that need only ``store`` run on etcd; a test added
    there later runs here too, or is skipped with its reason."""
    params = []
    for name, test in sorted(vars(test_store).items()):
        if not name.startswith("test_") or not callable(test):
            continue
        needs = list(inspect.signature(test).parameters)
        why = SQLITE_ONLY.get(name) or (None if needs in FIXTURES else f"needs {needs}")
        marks = [pytest.mark.skip(reason=why)] if why else []
        params.append(pytest.param(test, id=name, marks=marks))
    return params


FIXTURES = (["store"], ["make_store"])
"""The fixtures a behaviour may take to run on etcd: both are defined below."""
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


@pytest.fixture
def loop() -> Iterator[Loop]:
    runner = Loop()
    yield runner
    runner.close()


class Stores:
    """EtcdStores on one prefix, each with its own client, on the test's loop."""

    def __init__(self, etcd: EtcdCluster, loop: Loop, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self.etcd = etcd
        self.loop = loop
        self.prefix = f"/test-store-{next(_prefixes)}/"
        self.clients: list[EtcdClient] = []

    def make(
        self,
        fence: Callable[[], list[Compare]] | None = None,
        lead: bool = True,
        **options: Any,
    ) -> EtcdStore:
        async def build() -> EtcdStore:
            client = EtcdClient(self.etcd.endpoints, timeout=self.timeout)
            self.clients.append(client)
            store = EtcdStore(client, self.prefix, FakeClock(), **options)
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
    with store.database.read() as conn:
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
def make_store(stores: Stores) -> Iterator[Callable[..., Any]]:
    """Writers with the given options, flushed after each call; afterwards a fresh load, and a
    follower that watched all along, must hold exactly the last one's rows."""
    follower = stores.make(lead=False)
    heard = Heard()
    task = asyncio.run_coroutine_threadsafe(follower.watch(heard, retry=0.1), stores.loop.loop)
    made: list[EtcdStore] = []

    def make(*, readonly: bool = False, **options: Any) -> Any:
        """``readonly``: a node that does not lead, its mirror loaded."""
        made.append(stores.make(lead=not readonly, **options))
        if readonly:
            stores.loop.run(made[-1].load())
        return Flushing(made[-1], stores.flush)

    try:
        yield make
        opened = [m for m in made if not m.database.closed]
        if opened:
            written = opened[-1]
            loaded = stores.make()
            assert rows(loaded) == rows(written), "etcd does not hold what the store wrote"
            assert heard.until(lambda: rows(follower) == rows(written)), "the follower lags"
    finally:
        task.cancel()


@pytest.fixture
def store(make_store: Callable[..., Any]) -> Any:
    """The writer, flushed after each call (see ``make_store``)."""
    return make_store()


@pytest.mark.parametrize("behaviour", _behaviour())
def test_the_sqlite_store_behaviour_on_etcd(
    behaviour: Callable[[Any], None], request: pytest.FixtureRequest
) -> None:
    needs = list(inspect.signature(behaviour).parameters)
    behaviour(request.getfixturevalue(needs[0]))


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
        made = Stores(cluster, loop, timeout=1.0)  # its flushes fail while etcd is down
        follower = made.make(lead=False)
        heard = Heard()
        task = asyncio.run_coroutine_threadsafe(follower.watch(heard, retry=0.1), loop.loop)
        try:
            leader = made.make()
            leader.put_service("web", "{}", 1)
            cluster.stop_all()
            leader.update_service("web", desired_replicas=2)
            with pytest.raises(StoreUnavailable, match="unreachable"):
                made.flush(leader)
            assert leader.pending == 2  # both, in order
            assert not leader.connected
            assert leader.unreachable
            cluster.start_member(0)
            cluster.wait_healthy()
            made.flush(leader)
            assert leader.pending == 0
            assert leader.connected
            row = made.make().service("web")
            assert row is not None
            assert row.desired_replicas == 2
            # The follower's watch broke with etcd, and opened again once it was back.
            assert heard.until(lambda: rows(follower) == rows(leader))
            assert follower.connected
        finally:
            task.cancel()
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


def test_a_write_bigger_than_one_transaction_is_refused_and_applies_nothing(
    stores: Stores,
) -> None:
    leader = stores.make()
    leader.put_service("web", "{}", 1)
    for i in range(MAX_OPS + 5):
        leader.add_token("web", f"t{i}", f"d{i}", "")
    stores.flush(leader)
    before = rows(leader)
    # One write: the service, its tokens... more rows than one etcd transaction takes.
    with pytest.raises(WriteTooLarge, match=f"more than etcd takes \\({MAX_OPS}") as refused:
        leader.delete_service("web")
    assert (refused.value.limit, refused.value.allowed) == ("operations", MAX_OPS)
    assert refused.value.status == 413
    assert leader.pending == 0
    assert rows(leader) == before  # nothing of it in the mirror
    assert rows(stores.make()) == before  # nor in etcd
    with pytest.raises(WriteTooLarge) as big:
        leader.add_revision("web", "k", '"' + "x" * MAX_BYTES + '"')
    assert big.value.limit == "bytes"
    assert rows(leader) == before


def test_trimming_events_fits_each_write_in_one_transaction(stores: Stores) -> None:
    leader = stores.make(max_events_per_service=10_000, trim_every=1_000)
    for i in range(MAX_OPS * 2 + 5):
        leader.add_event("web", "x", f"e{i}")
    stores.flush(leader)
    assert leader.pending == 0
    # Lowered bound, as after a config change: each trim deletes at most TRIM_PER_WRITE.
    small = stores.make(max_events_per_service=5, trim_every=1)
    small.add_event("web", "x", "next")
    assert small.trimmed_events == TRIM_PER_WRITE
    small.add_event("web", "x", "next")
    small.add_event("web", "x", "next")
    assert len(small.events("web")) == 5
    stores.flush(small)
    assert rows(stores.make()) == rows(small)


def test_a_state_written_by_a_newer_gateway_is_refused(stores: Stores, loop: Loop) -> None:
    client = stores.make(lead=False).client
    loop.run(client.put((stores.prefix + "state/schema_version").encode(), b"999"))
    with pytest.raises(StoreUnavailable, match="newer"):
        stores.make()


def test_missing_rows_raise_not_found_as_on_sqlite(store: Any) -> None:
    with pytest.raises(NotFound):
        store.update_service("nope", desired_replicas=1)


# -- the outbox, without etcd ---------------------------------------------------------------


def put(key: str, size: int = 1) -> Put:
    return Put(key.encode(), b"x" * size)


def test_the_outbox_merges_consecutive_writes_and_sends_a_key_once() -> None:
    box = Outbox(max_ops=4)
    box.append([put("a"), put("b")])
    box.append([Delete(b"a"), put("c")])
    box.append([put("d"), put("e"), put("f")])
    batch = box.batch()
    assert batch is not None
    assert batch.ops == [put("b"), Delete(b"a"), put("c")]  # a: its last write, once
    assert batch.writes == 2
    box.committed(batch)
    assert len(box) == 1
    last = box.batch()
    assert last is not None
    assert last.ops == [put("d"), put("e"), put("f")]
    box.committed(last)
    assert box.batch() is None


def test_the_outbox_refuses_a_write_bigger_than_a_transaction() -> None:
    box = Outbox(max_ops=3, max_bytes=100)
    assert box.refusal([put("a"), put("b"), put("a"), put("c")]) is None  # a key once
    too_many = box.refusal([put(f"k{i}") for i in range(4)])
    assert too_many is not None
    assert (too_many.limit, too_many.size, too_many.allowed) == ("operations", 4, 3)
    too_big = box.refusal([put("a", 60), put("b", 60)])
    assert too_big is not None
    assert (too_big.limit, too_big.size, too_big.allowed) == ("bytes", 122, 100)


def test_the_outbox_counts_bytes() -> None:
    box = Outbox(max_ops=100, max_bytes=100)
    box.append([put("a", 60)])
    box.append([put("b", 60)])
    first = box.batch()
    assert first is not None
    assert [op.key for op in first.ops] == [b"a"]
    box.committed(first)
    assert op_size(put("a", 60)) == 61


def test_a_batch_taken_before_a_clear_removes_nothing_after_it() -> None:
    box = Outbox()
    box.append([put("old")])
    batch = box.batch()
    assert batch is not None
    box.clear()  # the node stopped leading while the batch was sent
    box.append([put("new")])
    box.committed(batch)
    assert len(box) == 1


def test_row_keys_round_trip_with_slashes_in_values() -> None:
    key = row_key("replicas", ("a/b", "c%d"))
    assert key == "replicas/a%2Fb/c%25d"
    assert split_key(key) == ("replicas", ("a/b", "c%d"))
    assert split_key("revisions/web/3") == ("revisions", ("web", "3"))
    assert split_key("revisions/web") is None
    assert split_key("sequence/events") is None


# -- more of etcd ---------------------------------------------------------------------------


def test_a_failed_write_leaves_nothing_pending(stores: Stores) -> None:
    """test_store.py's fault between the statements of one transaction: the revision inserted
    before the failing rollout insert is neither in the mirror nor pending."""
    leader = stores.make()
    _, ro1 = leader.apply_revision("web", '{"v": 1}', "k1", 1, None)
    stores.flush(leader)
    before = rows(leader)

    class FailingConnection:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if sql.startswith("INSERT INTO rollouts"):
                raise sqlite3.OperationalError("database or disk is full")
            return self.conn.execute(sql, *args)

        def __getattr__(self, name: str) -> object:
            return getattr(self.conn, name)

    real = leader.database._conn
    leader.database._conn = FailingConnection(real)  # type: ignore[assignment]
    try:
        with pytest.raises(StoreUnavailable):
            leader.apply_revision("web", '{"v": 2}', "k2", 3, 1)
    finally:
        leader.database._conn = real
    with pytest.raises(NotFound):
        leader.update_rollout(ro1.id + 100, status="paused")
    assert leader.pending == 0
    assert rows(leader) == before
    r2, _ = leader.apply_revision("web", '{"v": 2}', "k2", 3, 1)
    assert r2.number == 2
    stores.flush(leader)
    assert rows(stores.make()) == rows(leader)


def test_a_follower_follows_the_writer_by_watch(stores: Stores, loop: Loop) -> None:
    writer = stores.make()
    writer.put_service("web", "{}", 1)
    stores.flush(writer)
    follower = stores.make(lead=False)
    heard: list[set[str]] = []
    changed = threading.Condition()

    def on_change(tables: set[str]) -> None:
        with changed:
            heard.append(tables)
            changed.notify_all()

    def caught_up() -> bool:
        with changed:
            return changed.wait_for(lambda: rows(follower) == rows(writer), timeout=10)

    task = asyncio.run_coroutine_threadsafe(follower.watch(on_change, retry=0.1), loop.loop)
    try:
        assert caught_up()
        writer.apply_revision("web", '{"v": 1}', "k1", 2, None)
        for i in range(3):
            writer.add_event("web", "x", f"e{i}")
        stores.flush(writer)
        assert caught_up()
        writer.delete_service("web")
        stores.flush(writer)
        assert caught_up()
        assert {"revisions", "rollouts", "events"} <= set().union(*heard)
        assert follower.etcd_revision == writer.etcd_revision
        assert follower.pending == 0
        with pytest.raises(StoreUnavailable, match="does not lead"):
            follower.put_service("api", "{}", 1)
    finally:
        task.cancel()


def test_losing_one_member_of_three_changes_nothing(tmp_path: Path, loop: Loop) -> None:
    with EtcdCluster(tmp_path / "etcd", 3) as cluster:
        made = Stores(cluster, loop, timeout=3.0)  # the members may elect a new raft leader
        try:
            leader = made.make()
            leader.put_service("web", "{}", 1)
            made.flush(leader)
            cluster.kill_member(0)
            leader.apply_revision("web", '{"v": 1}', "k1", 2, None)
            made.flush(leader)
            assert leader.connected
            assert rows(made.make()) == rows(leader)
        finally:
            made.close()


class Heard:
    """``on_change`` for a follower's watch: the tables of each call, and a wait for a state."""

    def __init__(self) -> None:
        self.tables: list[set[str]] = []
        self.changed = threading.Condition()

    def __call__(self, tables: set[str]) -> None:
        with self.changed:
            self.tables.append(tables)
            self.changed.notify_all()

    def until(self, check: Callable[[], bool]) -> bool:
        with self.changed:
            return self.changed.wait_for(check, timeout=10)


def test_a_follower_behind_a_compaction_loads_again(
    stores: Stores, loop: Loop, etcd: EtcdCluster
) -> None:
    writer = stores.make()
    writer.put_service("web", "{}", 1)
    stores.flush(writer)
    follower = stores.make(lead=False)
    loop.run(follower.load())
    for i in range(5):
        writer.add_event("web", "x", f"e{i}")
        stores.flush(writer)
    subprocess.run(
        ["etcdctl", "--endpoints", ",".join(etcd.endpoints), "compact", str(writer.etcd_revision)],
        check=True,
        capture_output=True,
        env={**os.environ, "ETCDCTL_API": "3"},
    )
    heard = Heard()
    task = asyncio.run_coroutine_threadsafe(follower.watch(heard, retry=0.1), loop.loop)
    try:
        assert heard.until(lambda: rows(follower) == rows(writer))
        assert set(PRIMARY_KEYS) in heard.tables  # a load: every table may have changed
        assert follower._loads == 2
    finally:
        task.cancel()


def test_a_deposed_leader_follows_and_its_dropped_writes_leave_its_mirror(
    stores: Stores, loop: Loop
) -> None:
    term = {"ok": True}
    key = b"/fence-" + stores.prefix.encode()
    loop.run(stores.make(lead=False).client.put(key, b"1"))

    def fence() -> list[Compare]:
        return [Compare(key, "VALUE", "EQUAL", b"1" if term["ok"] else b"2")]

    leader = stores.make(fence)
    heard = Heard()
    task = asyncio.run_coroutine_threadsafe(leader.watch(heard, retry=0.1), loop.loop)
    try:
        leader.put_service("web", "{}", 1)
        stores.flush(leader)
        term["ok"] = False
        leader.put_service("lost", "{}", 1)
        with pytest.raises(Deposed):
            stores.flush(leader)
        assert heard.until(lambda: leader.service("lost") is None and not leader.stale)
        other = stores.make()  # the next leader
        other.put_service("api", "{}", 2)
        stores.flush(other)
        assert heard.until(lambda: rows(leader) == rows(other))
    finally:
        task.cancel()


def test_flushes_at_once_send_each_write_once_in_order(stores: Stores, loop: Loop) -> None:
    leader = stores.make()
    leader.put_service("web", "{}", 1)
    for i in range(10):
        leader.add_event("web", "x", f"e{i}")

    async def both() -> None:
        first = asyncio.create_task(leader.flush())
        await asyncio.sleep(0)
        leader.update_service("web", desired_replicas=4)  # while the first one is sent
        await leader.flush()  # returns once this write is in etcd too
        await first

    requests = leader.requests
    loop.run(both())
    assert leader.pending == 0
    assert leader.requests - requests == 2
    assert rows(stores.make()) == rows(leader)
