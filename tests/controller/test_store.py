"""Tests of controller/store/: schema, persistence, atomic compound writes, unavailability."""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.errors import Conflict, NotFound, StoreUnavailable
from controller.store import SCHEMA_VERSION, Store
from controller.store.migrations import MIGRATIONS as _MIGRATIONS

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


@pytest.fixture
def store(db: Path) -> Iterator[Store]:
    with Store(db, clock=FakeClock()) as s:
        yield s


@pytest.fixture
def make_store(db: Path) -> Iterator[Callable[..., Store]]:
    """A store with the given options (``max_events_per_service``...), on either store kind."""
    made: list[Store] = []

    def make(**options: Any) -> Store:
        made.append(Store(db, clock=FakeClock(), **options))
        return made[-1]

    yield make
    for s in made:
        s.close()


def raw(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True)


def snapshot(db: Path) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every table, to show that a failed write changed nothing."""
    conn = raw(db)
    try:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]
        return {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in tables}
    finally:
        conn.close()


def every_row(store: Store) -> dict[str, list[tuple[object, ...]]]:
    """``snapshot`` of the store's file; of the etcd store's in-memory mirror (whose tests also
    check that etcd holds what the mirror does), its tables but the schema's version."""
    if str(store.database.path) != ":memory:":
        return snapshot(store.database.path)
    with store.database.read() as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM main.sqlite_master WHERE type = 'table'"
                " AND name != 'schema_version' ORDER BY name"
            )
        ]
        return {t: conn.execute(f"SELECT * FROM main.{t} ORDER BY 1, 2").fetchall() for t in tables}


# -- schema and reopening -------------------------------------------------------------------


def test_schema_created(store: Store, db: Path) -> None:
    assert store.schema_version() == SCHEMA_VERSION == 4
    conn = raw(db)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {
            "schema_version",
            "services",
            "revisions",
            "rollouts",
            "events",
            "replicas",
            "config_applied",
        } <= tables
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()
    # Per-connection settings can only be read on the store's own connection.
    assert store.database._conn.execute("PRAGMA foreign_keys").fetchone() == (1,)
    assert store.database._conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    assert store.database._conn.execute("PRAGMA busy_timeout").fetchone() == (5000,)
    assert store.database.journal_mode == "wal"


def test_reopen_is_idempotent_and_keeps_everything(make_store: Callable[..., Store]) -> None:
    s = make_store()
    rev, ro = s.apply_revision("web", '{"v": 1}', "k1", 2, None)
    s.finish_rollout(ro.id, "complete", "", rev.number)
    s.apply_revision("web", '{"v": 2}', "k2", 3, rev.number)
    s.put_replica("web", "web-1", 1, "process", '{"pid": 10}')
    s.add_event("web", "apply", "applied", revision=2)
    before = every_row(s)
    s.close()
    s = make_store()  # the file opened again; on etcd, a new writer loads the prefix
    assert every_row(s) == before
    assert s.schema_version() == SCHEMA_VERSION
    service = s.service("web")
    assert service is not None
    assert (service.serving_revision, service.target_revision) == (1, 2)
    assert service.spec_json == '{"v": 2}'
    assert service.desired_replicas == 3
    assert [r.number for r in s.revisions("web")] == [1, 2]
    assert [r.status for r in s.rollouts("web")] == ["progressing", "complete"]
    assert [r.replica_id for r in s.replicas("web")] == ["web-1"]
    assert [e.message for e in s.events("web")] == ["applied"]


def test_refuses_a_newer_schema(db: Path) -> None:
    Store(db).close()
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("INSERT INTO schema_version VALUES (99, 0)")
    conn.close()
    with pytest.raises(StoreUnavailable, match="version 99"):
        Store(db)


def test_migrates_a_version_1_database_and_keeps_its_data(db: Path) -> None:
    """A database written before the config_applied table gains it and loses nothing."""
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL)")
        for statement in _MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version VALUES (1, 0)")
        conn.execute("INSERT INTO services VALUES ('web', '{}', NULL, NULL, 2, 0, 0, 0)")
    conn.close()
    with Store(db, clock=FakeClock()) as s:
        assert s.schema_version() == SCHEMA_VERSION == 4
        service = s.service("web")
        assert service is not None
        assert service.desired_replicas == 2
        assert s.config_applied("web") is None
        s.record_config_applied("web", "services/web.yaml", "abc")
    with Store(db) as s:
        row = s.config_applied("web")
        assert row is not None
        assert (row.source, row.digest) == ("services/web.yaml", "abc")


def test_config_applied_is_replaced_and_outlives_a_delete(store: Store) -> None:
    store.put_service("web", "{}", 1)
    first = store.record_config_applied("web", "services/web.yaml", "d1")
    second = store.record_config_applied("web", "gateway.yaml services[0]", "d2")
    assert second.applied_at > first.applied_at
    assert store.config_applied("web") == second
    assert store.delete_service("web")
    assert store.config_applied("web") == second  # tells a deleted service from a new one
    assert store.config_applied("other") is None


def test_config_applied_only_for_a_live_service(store: Store) -> None:
    with pytest.raises(NotFound):
        store.record_config_applied("ghost", "services/ghost.yaml", "d")
    store.put_service("web", "{}", 1)
    store.delete_service("web")
    with pytest.raises(NotFound):
        store.record_config_applied("web", "services/web.yaml", "d")
    assert store.config_applied("ghost") is None
    assert store.config_applied("web") is None
    with store.database.read() as conn:
        assert conn.execute("SELECT count(*) FROM main.config_applied").fetchone() == (0,)


def test_repr_says_the_file_and_whether_closed(db: Path) -> None:
    s = Store(db)
    s.put_service("web", "{}", 1)
    text = repr(s)
    assert "state.db" in text
    assert f"schema_version={SCHEMA_VERSION}" in text
    assert "writes=" in text
    assert "closed=False" in text
    s.close()
    assert "closed=True" in repr(s)


def test_a_closed_store_refuses_every_call(make_store: Callable[..., Store]) -> None:
    s = make_store()
    s.put_service("web", "{}", 1)
    s.close()
    s.close()  # idempotent
    with pytest.raises(StoreUnavailable, match="closed"):
        s.services()
    with pytest.raises(StoreUnavailable, match="closed"):
        s.put_service("api", "{}", 1)
    assert [r.name for r in make_store().services()] == ["web"]  # what it wrote stays


def test_usable_from_another_thread(store: Store) -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            store.put_service("web", "{}", 1)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors == []
    assert store.service("web") is not None


# -- services -------------------------------------------------------------------------------


def test_put_update_and_list_services(store: Store) -> None:
    store.put_service("web", '{"a": 1}', 2)
    store.put_service("api", "{}", 1, paused=True)
    assert [s.name for s in store.services()] == ["api", "web"]
    api = store.service("api")
    assert api is not None
    assert api.paused
    assert not api.deleted

    rev = store.add_revision("web", "k1", "{}")
    updated = store.update_service("web", serving_revision=rev.number, desired_replicas=4)
    assert (updated.serving_revision, updated.desired_replicas) == (1, 4)
    assert updated.spec_json == '{"a": 1}'
    updated = store.update_service("web", serving_revision=None)
    assert updated.serving_revision is None

    with pytest.raises(NotFound):
        store.update_service("nope", paused=True)
    with pytest.raises(NotFound):
        store.add_revision("nope", "k", "{}")
    with pytest.raises(Conflict):  # the foreign key: revision 7 does not exist
        store.update_service("web", target_revision=7)
    assert store.service("missing") is None


def test_delete_keeps_history_and_numbering_continues(store: Store) -> None:
    r1, ro1 = store.apply_revision("web", "{}", "k1", 1, None)
    store.finish_rollout(ro1.id, "complete", "", r1.number)
    _, ro2 = store.apply_revision("web", "{}", "k2", 1, r1.number)
    store.put_replica("web", "web-a", r1.number, "process", "{}")
    store.add_event("web", "apply", "two")

    assert store.delete_service("web") is True
    assert store.service("web") is None
    assert store.services() == []
    tomb = store.service("web", include_deleted=True)
    assert tomb is not None
    assert tomb.deleted
    assert (tomb.serving_revision, tomb.target_revision) == (None, None)
    assert store.replicas("web") == []
    assert [r.number for r in store.revisions("web")] == [1, 2]
    aborted = store.rollout(ro2.id)
    assert aborted is not None
    assert (aborted.status, aborted.reason) == ("aborted", "service deleted")
    assert aborted.finished_at is not None
    assert store.active_rollout("web") is None
    assert len(store.events("web")) == 1
    assert store.delete_service("web") is False  # idempotent
    assert store.delete_service("never") is False
    with pytest.raises(NotFound):
        store.put_replica("web", "web-b", 1, "process", "{}")

    # Re-created by put_service, then by apply: numbers continue from the max ever used.
    store.put_service("web", "{}", 1)
    assert store.add_revision("web", "k3", "{}").number == 3
    store.delete_service("web")
    r4, ro4 = store.apply_revision("web", '{"new": 1}', "k1", 2, None)
    assert r4.number == 4
    assert ro4.from_revision is None
    service = store.service("web")
    assert service is not None
    assert (service.target_revision, service.serving_revision, service.deleted) == (4, None, False)
    # The latest revision with a key wins.
    by_key = store.revision_by_key("web", "k1")
    assert by_key is not None
    assert by_key.number == 4
    assert store.revision_by_key("web", "zzz") is None


def test_revision_numbers_are_per_service(store: Store) -> None:
    store.put_service("a", "{}", 1)
    store.put_service("b", "{}", 1)
    numbers = [store.add_revision(s, "k", "{}").number for s in ("a", "a", "b", "a", "b")]
    assert numbers == [1, 2, 1, 3, 2]
    assert [r.number for r in store.revisions("a")] == [1, 2, 3]
    rev = store.revision("b", 2)
    assert rev is not None
    assert (rev.service, rev.template_key) == ("b", "k")
    assert store.revision("b", 3) is None


# -- rollouts -------------------------------------------------------------------------------


def test_apply_revision_supersedes_the_active_rollout(store: Store) -> None:
    r1, ro1 = store.apply_revision("web", '{"v": 1}', "k1", 2, None)
    assert (r1.number, ro1.status, ro1.kind, ro1.to_revision) == (1, "progressing", "rollout", 1)
    assert store.active_rollout("web") == ro1

    _, ro2 = store.apply_revision("web", '{"v": 2}', "k2", 5, r1.number)
    old = store.rollout(ro1.id)
    assert old is not None
    assert old.status == "superseded"
    assert old.finished_at is not None
    assert "revision 2" in old.reason
    assert store.active_rollout("web") == ro2
    assert (ro2.from_revision, ro2.to_revision) == (1, 2)
    service = store.service("web")
    assert service is not None
    assert (service.target_revision, service.spec_json, service.desired_replicas) == (
        2,
        '{"v": 2}',
        5,
    )
    assert [r.id for r in store.rollouts("web")] == [ro2.id, ro1.id]
    assert [r.id for r in store.rollouts("web", limit=1)] == [ro2.id]
    with pytest.raises(NotFound):
        store.apply_revision("web", "{}", "k3", 1, from_revision=42)


def test_apply_revision_failing_midway_writes_nothing(store: Store) -> None:
    """A fault between the statements of one transaction rolls all of them back.

    The real connection is wrapped so that the rollout insert fails as a full disk would; the
    revision insert that ran before it in the same transaction must be gone too (on etcd: from
    the mirror, and nothing is sent).
    """
    _, ro1 = store.apply_revision("web", '{"v": 1}', "k1", 1, None)
    before = every_row(store)

    class FailingConnection:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if sql.startswith("INSERT INTO rollouts"):
                raise sqlite3.OperationalError("database or disk is full")
            return self.conn.execute(sql, *args)

        def __getattr__(self, name: str) -> object:
            return getattr(self.conn, name)

    real = store.database._conn
    store.database._conn = FailingConnection(real)  # type: ignore[assignment]
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.apply_revision("web", '{"v": 2}', "k2", 3, 1)
    finally:
        store.database._conn = real
    assert "disk is full" in str(info.value.details["reason"])
    assert every_row(store) == before
    assert store.active_rollout("web") == ro1
    # The store goes on working, and the number that was never committed is reused.
    r2, _ = store.apply_revision("web", '{"v": 2}', "k2", 3, 1)
    assert r2.number == 2


def test_create_rollout_to_an_existing_revision(store: Store) -> None:
    r1, ro1 = store.apply_revision("web", '{"v": 1}', "k1", 1, None)
    store.finish_rollout(ro1.id, "complete", "", r1.number)
    r2, ro2 = store.apply_revision("web", '{"v": 2}', "k2", 1, r1.number)
    undo = store.create_rollout("web", r2.number, r1.number, "undo", spec_json='{"v": 1}')
    assert (undo.kind, undo.status) == ("undo", "progressing")
    superseded = store.rollout(ro2.id)
    assert superseded is not None
    assert superseded.status == "superseded"
    service = store.service("web")
    assert service is not None
    assert (service.target_revision, service.spec_json) == (1, '{"v": 1}')
    with pytest.raises(NotFound):
        store.create_rollout("web", 1, 99, "rollback")
    with pytest.raises(NotFound):
        store.create_rollout("nope", None, 1, "rollout")
    with pytest.raises(ValueError, match="kind"):
        store.create_rollout("web", 1, 2, "sideways")  # type: ignore[arg-type]


def test_a_rollout_keeps_its_strategy_state_with_its_record(store: Store) -> None:
    """Written with the rollout (create) and with the decision that changes it (update), in
    the one transaction of each; the other updates leave it as it is."""
    r1, ro1 = store.apply_revision("web", '{"v": 1}', "k1", 1, None)
    assert ro1.strategy_json is None
    store.finish_rollout(ro1.id, "complete", "", r1.number)
    r2 = store.add_revision("web", "k2", '{"v": 2}')
    begun = '{"strategy":"canary","step":0,"weight":0}'
    ro2 = store.create_rollout("web", r1.number, r2.number, "rollout", strategy_json=begun)
    assert ro2.strategy_json == begun
    assert store.active_rollout("web") == ro2
    held = '{"strategy":"canary","step":1,"weight":50}'
    paused = store.update_rollout(ro2.id, status="paused", reason="why", strategy_json=held)
    assert (paused.status, paused.strategy_json) == ("paused", held)
    counted = store.update_rollout(ro2.id, retries_used=2)
    assert counted.strategy_json == held
    done = store.finish_rollout(ro2.id, "complete", "", r2.number)
    assert done.strategy_json == held  # kept in the history
    with store.database.read() as conn:
        query = "SELECT strategy_json FROM main.rollouts WHERE id = ?"
        (text,) = conn.execute(query, (ro2.id,)).fetchone()
    assert text == held


def test_a_version_3_database_gains_the_strategy_column_and_keeps_its_rollouts(
    db: Path,
) -> None:
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL)")
        for number, statements in enumerate(_MIGRATIONS[:3], 1):
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version VALUES (?, 0)", (number,))
        conn.execute("INSERT INTO services VALUES ('web', '{}', NULL, 1, 2, 0, 0, 0)")
        conn.execute("INSERT INTO revisions VALUES ('web', 1, 'k1', '{}', 0)")
        conn.execute(
            "INSERT INTO rollouts (service, from_revision, to_revision, kind, status, started_at)"
            " VALUES ('web', NULL, 1, 'rollout', 'progressing', 5)"
        )
    conn.close()
    with Store(db, clock=FakeClock()) as s:
        assert s.schema_version() == SCHEMA_VERSION == 4
        active = s.active_rollout("web")
        assert active is not None
        assert (active.started_at, active.strategy_json) == (5, None)


def test_update_rollout(store: Store) -> None:
    _, ro = store.apply_revision("web", "{}", "k1", 1, None)
    paused = store.update_rollout(ro.id, status="paused", reason="new replica failed")
    assert (paused.status, paused.reason, paused.finished_at) == (
        "paused",
        "new replica failed",
        None,
    )
    assert store.active_rollout("web") == paused
    counted = store.update_rollout(ro.id, retries_used=2)
    assert (counted.retries_used, counted.status, counted.reason) == (
        2,
        "paused",
        "new replica failed",
    )
    done = store.update_rollout(ro.id, status="aborted", finished=True)
    assert done.finished_at is not None
    assert store.active_rollout("web") is None
    with pytest.raises(NotFound):
        store.update_rollout(12345, reason="x")
    with pytest.raises(ValueError, match="status"):
        store.update_rollout(ro.id, status="bogus")  # type: ignore[arg-type]


def test_at_most_one_active_rollout(store: Store) -> None:
    _, ro1 = store.apply_revision("web", "{}", "k1", 1, None)
    store.apply_revision("web", "{}", "k2", 1, 1)
    with pytest.raises(Conflict):
        store.update_rollout(ro1.id, status="progressing")


def test_finish_rollout_moves_the_service(store: Store) -> None:
    r1, ro1 = store.apply_revision("web", "{}", "k1", 2, None)
    done = store.finish_rollout(ro1.id, "complete", "all ready", r1.number)
    assert (done.status, done.reason) == ("complete", "all ready")
    assert done.finished_at is not None
    service = store.service("web")
    assert service is not None
    assert (service.serving_revision, service.target_revision) == (1, 1)

    r2, ro2 = store.apply_revision("web", "{}", "k2", 2, r1.number)
    failed = store.finish_rollout(ro2.id, "failed", "retries spent", r1.number)
    assert failed.status == "failed"
    service = store.service("web")
    assert service is not None
    # The service keeps serving, and targets, the old revision.
    assert (service.serving_revision, service.target_revision) == (1, 1)
    assert store.active_rollout("web") is None

    with pytest.raises(Conflict, match="already failed"):
        store.finish_rollout(ro2.id, "complete", "", r2.number)
    _, ro3 = store.apply_revision("web", "{}", "k3", 2, r1.number)
    with pytest.raises(ValueError, match="status"):
        store.finish_rollout(ro3.id, "progressing", "", 3)
    with pytest.raises(NotFound):
        store.finish_rollout(ro3.id, "complete", "", 99)
    with pytest.raises(NotFound):
        store.finish_rollout(999, "complete", "", 1)
    still = store.rollout(ro3.id)
    assert still is not None
    assert still.status == "progressing"


# -- events ---------------------------------------------------------------------------------


def test_events_are_ordered_and_paged(store: Store) -> None:
    for i in range(7):
        store.add_event("web" if i % 2 == 0 else "api", "k", f"m{i}", revision=1, replica="r")
    every = store.events()
    assert [e.message for e in every] == [f"m{i}" for i in range(7)]
    assert [e.id for e in every] == sorted(e.id for e in every)
    assert [e.message for e in store.events("web")] == ["m0", "m2", "m4", "m6"]
    first = store.events(limit=3)
    rest = store.events(after_id=first[-1].id)
    assert [e.message for e in first + rest] == [e.message for e in every]
    assert [e.message for e in store.events("web", after_id=every[2].id, limit=1)] == ["m4"]
    assert (every[0].revision, every[0].replica) == (1, "r")
    assert every[1].at > every[0].at


def test_events_are_trimmed_per_service(make_store: Callable[..., Store]) -> None:
    s = make_store(max_events_per_service=5, trim_every=10)
    for i in range(25):
        s.add_event("web", "k", f"w{i}")
    s.add_event("api", "k", "a0")
    # Trimmed at the 10th and 20th insert: the last 5 then, plus 5 since.
    assert [e.message for e in s.events("web")] == [f"w{i}" for i in range(15, 25)]
    assert s.trimmed_events == 15
    assert [e.message for e in s.events("api")] == ["a0"]
    # Ids are never reused after trimming, so a pager's after_id stays valid.
    assert s.add_event("web", "k", "w25").id == 27


def test_opening_the_file_trims_every_service(db: Path) -> None:
    with Store(db, max_events_per_service=5, trim_every=10) as s:
        for i in range(25):
            s.add_event("web", "k", f"w{i}")
    with Store(db, max_events_per_service=5) as s:  # opening trims every service
        assert [e.message for e in s.events("web")] == [f"w{i}" for i in range(20, 25)]
        # Ids are never reused after trimming, so a pager's after_id stays valid.
        assert s.add_event("web", "k", "w25").id == 26


# -- replicas -------------------------------------------------------------------------------


def test_replicas_put_replace_remove(store: Store) -> None:
    store.apply_revision("web", "{}", "k1", 2, None)
    store.apply_revision("web", "{}", "k2", 2, 1)
    a = store.put_replica("web", "web-a", 1, "process", '{"pid": 1}')
    store.put_replica("web", "web-b", 2, "process", '{"pid": 2}')
    assert [(r.replica_id, r.revision) for r in store.replicas("web")] == [
        ("web-a", 1),
        ("web-b", 2),
    ]
    replaced = store.put_replica("web", "web-a", 2, "process", '{"pid": 3}')
    assert (replaced.revision, replaced.handle_json, replaced.created_at) == (
        2,
        '{"pid": 3}',
        a.created_at,
    )
    assert store.remove_replica("web", "web-a") is True
    assert store.remove_replica("web", "web-a") is False
    assert [r.replica_id for r in store.replicas("web")] == ["web-b"]
    with pytest.raises(NotFound):
        store.put_replica("web", "web-c", 9, "process", "{}")
    assert store.replicas("other") == []


# -- an unusable database -------------------------------------------------------------------
# Tests run as root, and root ignores file modes, so a chmod'ed directory cannot simulate a
# read-only disk here. Instead: SQLite's own read-only mode (the ``readonly`` flag, a real
# SQLITE_READONLY from the library), a real SQLITE_FULL from a page-count cap, and a chmod
# test that runs only where it means something.


def test_readonly_store_reads_and_refuses_writes(make_store: Callable[..., Store]) -> None:
    """SQLite's read-only mode; on etcd, a node that does not lead (its mirror loaded)."""
    s = make_store()
    s.apply_revision("web", "{}", "k1", 1, None)
    s.add_event("web", "k", "m")
    s.close()
    ro = make_store(readonly=True)
    before = every_row(ro)
    assert ro.service("web") is not None
    assert len(ro.events()) == 1
    writes = [
        lambda: ro.apply_revision("web", "{}", "k2", 1, 1),
        lambda: ro.put_service("api", "{}", 1),
        lambda: ro.add_event("web", "k", "m2"),
        lambda: ro.delete_service("web"),
    ]
    for write in writes:
        with pytest.raises(StoreUnavailable) as info:
            write()
        assert re.search("readonly|not leading", str(info.value.details["reason"]))
        assert info.value.status == 503
    assert ro.database.failed_writes == len(writes)
    assert every_row(ro) == before


def test_readonly_store_needs_an_existing_current_file(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="unable to open"):
        Store(tmp_path / "missing.db", readonly=True)
    sqlite3.connect(tmp_path / "empty.db").close()
    with pytest.raises(StoreUnavailable, match="schema version 0"):
        Store(tmp_path / "empty.db", readonly=True)


def test_disk_full_raises_and_keeps_the_old_state(store: Store, db: Path) -> None:
    store.apply_revision("web", "{}", "k1", 1, None)
    before = snapshot(db)
    (pages,) = store.database._conn.execute("PRAGMA page_count").fetchone()
    store.database._conn.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(StoreUnavailable) as info:
        store.apply_revision("web", "x" * 200_000, "k2", 1, 1)
    assert "full" in str(info.value.details["reason"])
    assert snapshot(db) == before
    store.database._conn.execute("PRAGMA max_page_count = 1073741823")
    assert store.apply_revision("web", "x" * 200_000, "k2", 1, 1)[0].number == 2


def test_unopenable_paths(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="unable to open"):
        Store(tmp_path / "no" / "such" / "dir.db")
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreUnavailable, match="not a database"):
        Store(garbage)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes")
def test_readonly_directory(tmp_path: Path) -> None:  # pragma: no cover - not as root
    directory = tmp_path / "ro"
    directory.mkdir()
    db = directory / "state.db"
    Store(db).close()
    db.chmod(0o400)
    directory.chmod(0o500)
    try:
        with pytest.raises(StoreUnavailable):
            Store(db).put_service("web", "{}", 1)
    finally:
        directory.chmod(0o700)
        db.chmod(0o600)


# -- crash safety ---------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from controller.store import Store

    store = Store(Path(sys.argv[1]))
    for i in range(10**9):
        name = ("web", "api")[i % 2]
        service = store.service(name)
        store.apply_revision(
            name, f'{{"i": {i}}}', f"k{i}", 1 + i % 3, service and service.target_revision
        )
        if i % 7 == 0:
            store.add_event(name, "apply", f"applied {i}")
        print(name, flush=True)  # acknowledged: committed
    """
)


def check_consistent(db: Path, acknowledged: dict[str, int]) -> None:
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        conn.close()
    with Store(db) as s:
        for name in ("web", "api"):
            revisions = s.revisions(name)
            numbers = [r.number for r in revisions]
            assert numbers == list(range(1, len(numbers) + 1))
            # Durable: every apply the writer saw return is there.
            assert len(numbers) >= acknowledged[name]
            rollouts = s.rollouts(name, limit=10**6)
            # Atomic: one rollout per revision, never one without the other.
            assert len(rollouts) == len(revisions)
            known = set(numbers)
            for rollout in rollouts:
                assert rollout.to_revision in known
                assert rollout.from_revision is None or rollout.from_revision in known
            if not revisions:
                assert s.service(name) is None
                continue
            service = s.service(name)
            assert service is not None
            assert service.target_revision == numbers[-1]
            assert service.spec_json == revisions[-1].spec_json
            active = s.active_rollout(name)
            assert active is not None
            assert active.to_revision == numbers[-1]
            assert [r.status for r in rollouts[1:]] == ["superseded"] * (len(rollouts) - 1)


def test_sigkill_at_a_random_moment_leaves_a_consistent_store(db: Path) -> None:
    rng = random.Random(7)
    acknowledged = {"web": 0, "api": 0}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(5):
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(db)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        try:
            for line in itertools.islice(child.stdout, rng.randint(5, 60)):
                acknowledged[line.strip()] += 1
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        check_consistent(db, acknowledged)
    assert sum(acknowledged.values()) > 0
