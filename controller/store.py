"""The store: the controller's durable state in one SQLite file.

It holds services (the last applied spec, the serving and target revision, the desired count),
their revisions, the rollout history, events, and the replicas the backends run; and, for each
service applied from the gateway config, the digest of the document last applied from there
(start-up applies a config entry again only once its content changed).

Invariants:

- Every write is one ``BEGIN IMMEDIATE`` transaction, compound operations (``apply_revision``,
  ``create_rollout``, ``finish_rollout``, ``delete_service``) included. A crash at any moment,
  SIGKILL too, leaves either the old state or the new one. WAL with ``synchronous=FULL``: a
  write that returned is durable.
- A service's revisions are numbered 1, 2, 3... without gaps for the life of the file. A
  deleted service stays as a tombstone (``deleted``) with its revisions, rollouts and events,
  for audit and so that a re-created service continues from the highest number it ever used.
- A service has at most one active (progressing or paused) rollout; a unique partial index
  holds it. Starting a rollout supersedes the active one in the same transaction, and sets the
  service's target revision. Finishing it sets the serving revision, and the target to match:
  outside a rollout, ``target_revision == serving_revision``.
- Foreign keys tie rollouts, replicas and the serving and target revision to existing revisions.
- SQLite errors are translated here, once: a database that cannot be opened or written
  (read-only, disk full, I/O error, locked past ``busy_timeout``, not a database) raises
  ``StoreUnavailable`` with the reason; a broken constraint ``Conflict``; a missing service,
  revision or rollout ``NotFound``.

Synchronous on purpose: writes are rare control-plane events. One lock serialises the
connection, which any thread may use (``asyncio.to_thread`` is fine). Timestamps are wall-clock
seconds from the injected ``clock``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

from controller.errors import Conflict, NotFound, StoreUnavailable
from controller.model import RolloutKind

RolloutStatus = Literal[
    "progressing", "paused", "complete", "failed", "aborted", "superseded", "rolled_back"
]
ROLLOUT_KINDS: Final[tuple[str, ...]] = get_args(RolloutKind)
ROLLOUT_STATUSES: Final[tuple[str, ...]] = get_args(RolloutStatus)
ACTIVE_STATUSES: Final = ("progressing", "paused")
FINISHED_STATUSES: Final = ("complete", "failed", "aborted", "rolled_back")
"""What ``finish_rollout`` accepts; ``superseded`` is set only by a newer rollout."""


def _sql_list(values: Sequence[str]) -> str:
    return ", ".join(f"'{v}'" for v in values)


# One tuple of statements per schema version, applied in order. Never edit a released entry:
# append a new one. ``executescript`` is avoided because it commits on its own.
_MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (
        """CREATE TABLE services (
            name TEXT PRIMARY KEY,
            spec_json TEXT NOT NULL,
            serving_revision INTEGER,
            target_revision INTEGER,
            desired_replicas INTEGER NOT NULL CHECK (desired_replicas >= 0),
            paused INTEGER NOT NULL DEFAULT 0 CHECK (paused IN (0, 1)),
            deleted INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1)),
            updated_at REAL NOT NULL,
            FOREIGN KEY (name, serving_revision) REFERENCES revisions (service, number),
            FOREIGN KEY (name, target_revision) REFERENCES revisions (service, number)
        )""",
        """CREATE TABLE revisions (
            service TEXT NOT NULL REFERENCES services (name),
            number INTEGER NOT NULL CHECK (number >= 1),
            template_key TEXT NOT NULL,
            spec_json TEXT NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (service, number)
        )""",
        "CREATE INDEX revisions_by_key ON revisions (service, template_key, number)",
        f"""CREATE TABLE rollouts (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            service TEXT NOT NULL REFERENCES services (name),
            from_revision INTEGER,
            to_revision INTEGER NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ({_sql_list(ROLLOUT_KINDS)})),
            status TEXT NOT NULL CHECK (status IN ({_sql_list(ROLLOUT_STATUSES)})),
            reason TEXT NOT NULL DEFAULT '',
            retries_used INTEGER NOT NULL DEFAULT 0 CHECK (retries_used >= 0),
            started_at REAL NOT NULL,
            finished_at REAL,
            FOREIGN KEY (service, from_revision) REFERENCES revisions (service, number),
            FOREIGN KEY (service, to_revision) REFERENCES revisions (service, number)
        )""",
        "CREATE INDEX rollouts_by_service ON rollouts (service, id)",
        f"""CREATE UNIQUE INDEX rollouts_one_active ON rollouts (service)
            WHERE status IN ({_sql_list(ACTIVE_STATUSES)})""",
        # AUTOINCREMENT: ids are never reused, even after trimming, so after_id paging holds.
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            service TEXT NOT NULL,
            kind TEXT NOT NULL,
            message TEXT NOT NULL,
            revision INTEGER,
            replica TEXT
        )""",
        "CREATE INDEX events_by_service ON events (service, id)",
        """CREATE TABLE replicas (
            service TEXT NOT NULL REFERENCES services (name),
            replica_id TEXT NOT NULL,
            revision INTEGER NOT NULL,
            backend TEXT NOT NULL,
            handle_json TEXT NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (service, replica_id),
            FOREIGN KEY (service, revision) REFERENCES revisions (service, number)
        )""",
    ),
    (
        # Per service, what the gateway config last applied: a service is in it once applied
        # from the config, and stays (a tombstone's record tells a delete apart from a new name).
        """CREATE TABLE config_applied (
            service TEXT PRIMARY KEY REFERENCES services (name),
            source TEXT NOT NULL,
            digest TEXT NOT NULL,
            applied_at REAL NOT NULL
        )""",
    ),
)
SCHEMA_VERSION: Final = len(_MIGRATIONS)

# Primary result codes meaning "the database cannot be used now", not "the caller is wrong".
_UNAVAILABLE_CODES: Final = frozenset(
    {
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_CORRUPT,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_NOTADB,
    }
)
# For errors that carry no result code (raised by Python code, or older builds).
_UNAVAILABLE_MESSAGES: Final = (
    "readonly",
    "read-only",
    "disk i/o",
    "disk is full",
    "unable to open",
    "locked",
    "not a database",
    "malformed",
)


def _unavailable(error: sqlite3.Error) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    if isinstance(code, int) and (code & 0xFF) in _UNAVAILABLE_CODES:
        return True
    message = str(error).lower()
    return any(m in message for m in _UNAVAILABLE_MESSAGES)


class _Unset:
    """Marks an ``update_service`` field left alone (``None`` is a value there)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()


@dataclass(frozen=True, slots=True)
class ServiceRow:
    name: str
    spec_json: str
    serving_revision: int | None
    target_revision: int | None
    desired_replicas: int
    paused: bool
    deleted: bool
    updated_at: float


@dataclass(frozen=True, slots=True)
class RevisionRow:
    service: str
    number: int
    template_key: str
    spec_json: str
    created_at: float


@dataclass(frozen=True, slots=True)
class RolloutRow:
    id: int
    service: str
    from_revision: int | None
    to_revision: int
    kind: RolloutKind
    status: RolloutStatus
    reason: str
    retries_used: int
    started_at: float
    finished_at: float | None

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_STATUSES


@dataclass(frozen=True, slots=True)
class EventRow:
    id: int
    at: float
    service: str
    kind: str
    message: str
    revision: int | None
    replica: str | None


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    service: str
    replica_id: str
    revision: int
    backend: str
    handle_json: str
    created_at: float


@dataclass(frozen=True, slots=True)
class ConfigAppliedRow:
    """The document last applied to a service from the gateway config, and from where."""

    service: str
    source: str
    """The file (or the config's inline entry) it came from, as the log names it."""
    digest: str
    """sha256 of the document, as ``controller.config`` computes it."""
    applied_at: float


_SERVICE_COLS: Final = (
    "name, spec_json, serving_revision, target_revision, desired_replicas, paused, deleted,"
    " updated_at"
)
_REVISION_COLS: Final = "service, number, template_key, spec_json, created_at"
_ROLLOUT_COLS: Final = (
    "id, service, from_revision, to_revision, kind, status, reason, retries_used, started_at,"
    " finished_at"
)
_EVENT_COLS: Final = "id, at, service, kind, message, revision, replica"
_REPLICA_COLS: Final = "service, replica_id, revision, backend, handle_json, created_at"


def _service(r: Sequence[Any]) -> ServiceRow:
    return ServiceRow(r[0], r[1], r[2], r[3], r[4], bool(r[5]), bool(r[6]), r[7])


def _revision(r: Sequence[Any]) -> RevisionRow:
    return RevisionRow(*r)


def _rollout(r: Sequence[Any]) -> RolloutRow:
    return RolloutRow(*r)


def _event(r: Sequence[Any]) -> EventRow:
    return EventRow(*r)


def _replica(r: Sequence[Any]) -> ReplicaRow:
    return ReplicaRow(*r)


def _check_kind(kind: str) -> None:
    if kind not in ROLLOUT_KINDS:
        raise ValueError(f"rollout kind must be one of {ROLLOUT_KINDS}, not {kind!r}")


def _check_status(status: str, allowed: Sequence[str] = ROLLOUT_STATUSES) -> None:
    if status not in allowed:
        raise ValueError(f"rollout status must be one of {tuple(allowed)}, not {status!r}")


class Store:
    """The controller's state in one SQLite file. See the module docstring for the contract.

    ``readonly=True`` opens the file with SQLite's ``mode=ro``: reads work, every write raises
    ``StoreUnavailable``, and a file that needs a migration is refused.
    """

    def __init__(
        self,
        path: Path,
        clock: Callable[[], float] = time.time,
        *,
        readonly: bool = False,
        busy_timeout: float = 5.0,
        max_events_per_service: int = 10_000,
        trim_every: int = 100,
    ) -> None:
        self.path = path
        self.readonly = readonly
        self.max_events_per_service = max_events_per_service
        self._clock = clock
        self._trim_every = trim_every
        self._lock = threading.RLock()
        self._closed = False
        self._since_trim: dict[str, int] = {}
        self.writes = 0
        """Transactions committed by this instance."""
        self.failed_writes = 0
        self.trimmed_events = 0
        self.journal_mode = ""
        self._conn = self._connect(busy_timeout)
        try:
            self._migrate()
            if not readonly:
                with self._write() as conn:
                    self._trim(conn, None)
        except BaseException:
            self._conn.close()
            self._closed = True
            raise

    # -- connection and transactions ---------------------------------------------------------

    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        if self.readonly:
            target, uri = self.path.resolve().as_uri() + "?mode=ro", True
        else:
            target, uri = str(self.path), False
        with self._translating():
            # isolation_level=None: no implicit transactions; _write opens them explicitly, so
            # a read-modify-write (the next revision number) happens under one write lock.
            conn = sqlite3.connect(
                target,
                uri=uri,
                timeout=busy_timeout,
                isolation_level=None,
                check_same_thread=False,
            )
        try:
            with self._translating():
                conn.execute("PRAGMA foreign_keys = ON")
                conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
                conn.execute("PRAGMA synchronous = FULL")
                if self.readonly:
                    mode = conn.execute("PRAGMA journal_mode").fetchone()
                else:
                    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
                self.journal_mode = str(mode[0])
        except BaseException:
            conn.close()
            raise
        return conn

    @contextlib.contextmanager
    def _translating(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as e:
            translated = self._translate(e)
            if translated is e:
                raise
            raise translated from e

    def _translate(self, error: sqlite3.Error) -> Exception:
        if isinstance(error, sqlite3.IntegrityError):
            return Conflict(f"store constraint failed: {error}", reason=str(error))
        if isinstance(error, sqlite3.DatabaseError | sqlite3.InterfaceError) and _unavailable(
            error
        ):
            return StoreUnavailable(
                f"state database {self.path} is unavailable: {error}",
                reason=str(error),
                path=str(self.path),
            )
        return error

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._closed:
                raise StoreUnavailable("the store is closed", reason="closed", path=str(self.path))
            with self._translating():
                yield self._conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction: committed whole, or rolled back whole and the error translated."""
        with self._read() as conn:
            # IMMEDIATE takes the write lock up front: reads inside see what the write is based on.
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                self.failed_writes += 1
                if conn.in_transaction:
                    # SQLite may already have rolled back (disk full, I/O error); a failing
                    # ROLLBACK must not hide the error that caused it.
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise
            self.writes += 1

    def _migrate(self) -> None:
        if self.readonly:
            with self._read() as conn:
                version = self._version(conn)
            if version != SCHEMA_VERSION:
                raise StoreUnavailable(
                    f"read-only state database {self.path} is at schema version {version},"
                    f" this controller needs {SCHEMA_VERSION}",
                    reason="schema version",
                    path=str(self.path),
                )
            return
        with self._write() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_version"
                " (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
            )
            version = self._version(conn)
            if version > SCHEMA_VERSION:
                raise StoreUnavailable(
                    f"state database {self.path} is at schema version {version}, newer than"
                    f" this controller ({SCHEMA_VERSION})",
                    reason="schema version",
                    path=str(self.path),
                )
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[number - 1]:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                    (number, self._clock()),
                )

    @staticmethod
    def _version(conn: sqlite3.Connection) -> int:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
        ).fetchone()
        if exists is None:
            return 0
        row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def schema_version(self) -> int:
        with self._read() as conn:
            return self._version(conn)

    def close(self) -> None:
        """Close the connection. Idempotent; any later call raises ``StoreUnavailable``."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Store(path={str(self.path)!r}, schema_version={SCHEMA_VERSION},"
            f" journal_mode={self.journal_mode!r}, readonly={self.readonly},"
            f" writes={self.writes}, failed_writes={self.failed_writes},"
            f" trimmed_events={self.trimmed_events}, closed={self._closed})"
        )

    # -- services ----------------------------------------------------------------------------

    def put_service(
        self,
        name: str,
        spec_json: str,
        desired_replicas: int,
        serving_revision: int | None = None,
        target_revision: int | None = None,
        paused: bool = False,
    ) -> None:
        """Insert or replace a service's row (every field); a deleted service comes back."""
        with self._write() as conn:
            conn.execute(
                f"INSERT INTO services ({_SERVICE_COLS}) VALUES (?, ?, ?, ?, ?, ?, 0, ?)"
                " ON CONFLICT (name) DO UPDATE SET spec_json = excluded.spec_json,"
                " serving_revision = excluded.serving_revision,"
                " target_revision = excluded.target_revision,"
                " desired_replicas = excluded.desired_replicas, paused = excluded.paused,"
                " deleted = 0, updated_at = excluded.updated_at",
                (
                    name,
                    spec_json,
                    serving_revision,
                    target_revision,
                    desired_replicas,
                    paused,
                    self._clock(),
                ),
            )

    def update_service(
        self,
        name: str,
        *,
        spec_json: str | _Unset = UNSET,
        serving_revision: int | _Unset | None = UNSET,
        target_revision: int | _Unset | None = UNSET,
        desired_replicas: int | _Unset = UNSET,
        paused: bool | _Unset = UNSET,
    ) -> ServiceRow:
        """Change the given fields of a live service; raises ``NotFound`` if there is none."""
        fields = {
            "spec_json": spec_json,
            "serving_revision": serving_revision,
            "target_revision": target_revision,
            "desired_replicas": desired_replicas,
            "paused": paused,
        }
        changes = {k: v for k, v in fields.items() if not isinstance(v, _Unset)}
        with self._write() as conn:
            self._live_service(conn, name)
            sets = "".join(f"{column} = ?, " for column in changes)
            conn.execute(
                f"UPDATE services SET {sets}updated_at = ? WHERE name = ?",
                (*changes.values(), self._clock(), name),
            )
            return self._live_service(conn, name)

    def service(self, name: str, *, include_deleted: bool = False) -> ServiceRow | None:
        """The service, or None if there is none or it was deleted (unless asked for)."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {_SERVICE_COLS} FROM services WHERE name = ?", (name,)
            ).fetchone()
        if row is None or (row[6] and not include_deleted):
            return None
        return _service(row)

    def services(self) -> list[ServiceRow]:
        """Live services, by name."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {_SERVICE_COLS} FROM services WHERE deleted = 0 ORDER BY name"
            ).fetchall()
        return [_service(r) for r in rows]

    def delete_service(self, name: str) -> bool:
        """Tombstone a service in one transaction; False if it was not live (idempotent).

        The row stays with ``deleted`` set, no serving or target revision and no desired
        replicas; its replica rows are removed and an active rollout is aborted. Revisions,
        rollouts and events are kept for audit.
        """
        with self._write() as conn:
            live = conn.execute(
                "SELECT 1 FROM services WHERE name = ? AND deleted = 0", (name,)
            ).fetchone()
            if live is None:
                return False
            now = self._clock()
            conn.execute("DELETE FROM replicas WHERE service = ?", (name,))
            conn.execute(
                "UPDATE rollouts SET status = 'aborted', reason = 'service deleted',"
                f" finished_at = ? WHERE service = ? AND status IN ({_sql_list(ACTIVE_STATUSES)})",
                (now, name),
            )
            conn.execute(
                "UPDATE services SET deleted = 1, serving_revision = NULL,"
                " target_revision = NULL, desired_replicas = 0, paused = 0, updated_at = ?"
                " WHERE name = ?",
                (now, name),
            )
            return True

    @staticmethod
    def _live_service(conn: sqlite3.Connection, name: str) -> ServiceRow:
        row = conn.execute(
            f"SELECT {_SERVICE_COLS} FROM services WHERE name = ? AND deleted = 0", (name,)
        ).fetchone()
        if row is None:
            raise NotFound(f"no service {name!r}", service=name)
        return _service(row)

    # -- what the config applied -------------------------------------------------------------

    def config_applied(self, service: str) -> ConfigAppliedRow | None:
        """What the gateway config last applied to the service (deleted or not), if ever."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT service, source, digest, applied_at FROM config_applied WHERE service = ?",
                (service,),
            ).fetchone()
        return None if row is None else ConfigAppliedRow(*row)

    def record_config_applied(self, service: str, source: str, digest: str) -> ConfigAppliedRow:
        """Record that the config's document ``digest`` from ``source`` was applied to a live
        service (replacing the previous record)."""
        with self._write() as conn:
            self._live_service(conn, service)
            row = ConfigAppliedRow(service, source, digest, self._clock())
            conn.execute(
                "INSERT INTO config_applied (service, source, digest, applied_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (service) DO UPDATE SET"
                " source = excluded.source, digest = excluded.digest,"
                " applied_at = excluded.applied_at",
                (row.service, row.source, row.digest, row.applied_at),
            )
            return row

    # -- revisions ---------------------------------------------------------------------------

    def add_revision(self, service: str, template_key: str, spec_json: str) -> RevisionRow:
        """Add the next revision (max ever used + 1, from 1) of a live service."""
        with self._write() as conn:
            self._live_service(conn, service)
            return self._add_revision(conn, service, template_key, spec_json)

    def _add_revision(
        self, conn: sqlite3.Connection, service: str, template_key: str, spec_json: str
    ) -> RevisionRow:
        # Inside BEGIN IMMEDIATE no other writer can take the same number.
        (top,) = conn.execute(
            "SELECT coalesce(max(number), 0) FROM revisions WHERE service = ?", (service,)
        ).fetchone()
        row = RevisionRow(service, int(top) + 1, template_key, spec_json, self._clock())
        conn.execute(
            f"INSERT INTO revisions ({_REVISION_COLS}) VALUES (?, ?, ?, ?, ?)",
            (row.service, row.number, row.template_key, row.spec_json, row.created_at),
        )
        return row

    def revision(self, service: str, number: int) -> RevisionRow | None:
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {_REVISION_COLS} FROM revisions WHERE service = ? AND number = ?",
                (service, number),
            ).fetchone()
        return None if row is None else _revision(row)

    def revisions(self, service: str) -> list[RevisionRow]:
        """All revisions of a service ever made, ascending."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {_REVISION_COLS} FROM revisions WHERE service = ? ORDER BY number",
                (service,),
            ).fetchall()
        return [_revision(r) for r in rows]

    def revision_by_key(self, service: str, template_key: str) -> RevisionRow | None:
        """The latest revision of the service with this template key."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {_REVISION_COLS} FROM revisions WHERE service = ? AND template_key = ?"
                " ORDER BY number DESC LIMIT 1",
                (service, template_key),
            ).fetchone()
        return None if row is None else _revision(row)

    @staticmethod
    def _require_revision(conn: sqlite3.Connection, service: str, number: int | None) -> None:
        if number is None:
            return
        row = conn.execute(
            "SELECT 1 FROM revisions WHERE service = ? AND number = ?", (service, number)
        ).fetchone()
        if row is None:
            raise NotFound(f"no revision {number} of service {service!r}", service=service)

    # -- rollouts ----------------------------------------------------------------------------

    def create_rollout(
        self,
        service: str,
        from_revision: int | None,
        to_revision: int,
        kind: RolloutKind,
        *,
        spec_json: str | None = None,
        desired_replicas: int | None = None,
    ) -> RolloutRow:
        """Start a rollout to an existing revision, in one transaction.

        The active rollout, if any, is superseded; the service's target revision becomes
        ``to_revision`` (and its spec and desired count, when given).
        """
        _check_kind(kind)
        with self._write() as conn:
            self._live_service(conn, service)
            return self._start_rollout(
                conn, service, from_revision, to_revision, kind, spec_json, desired_replicas
            )

    def apply_revision(
        self,
        service: str,
        spec_json: str,
        template_key: str,
        desired_replicas: int,
        from_revision: int | None,
        kind: RolloutKind = "rollout",
    ) -> tuple[RevisionRow, RolloutRow]:
        """Apply a spec with a new template, in one transaction.

        Creates the service if it is new (or deleted), adds its next revision, supersedes the
        active rollout, starts one from ``from_revision`` to the new revision, and sets the
        service's spec, desired count and target revision.
        """
        _check_kind(kind)
        with self._write() as conn:
            conn.execute(
                f"INSERT INTO services ({_SERVICE_COLS}) VALUES (?, ?, NULL, NULL, ?, 0, 0, ?)"
                " ON CONFLICT (name) DO UPDATE SET deleted = 0",
                (service, spec_json, desired_replicas, self._clock()),
            )
            revision = self._add_revision(conn, service, template_key, spec_json)
            rollout = self._start_rollout(
                conn, service, from_revision, revision.number, kind, spec_json, desired_replicas
            )
            return revision, rollout

    def _start_rollout(
        self,
        conn: sqlite3.Connection,
        service: str,
        from_revision: int | None,
        to_revision: int,
        kind: RolloutKind,
        spec_json: str | None,
        desired_replicas: int | None,
    ) -> RolloutRow:
        self._require_revision(conn, service, from_revision)
        self._require_revision(conn, service, to_revision)
        now = self._clock()
        conn.execute(
            "UPDATE rollouts SET status = 'superseded', finished_at = ?, reason = ?"
            f" WHERE service = ? AND status IN ({_sql_list(ACTIVE_STATUSES)})",
            (now, f"superseded by a {kind} to revision {to_revision}", service),
        )
        cursor = conn.execute(
            "INSERT INTO rollouts (service, from_revision, to_revision, kind, status,"
            " started_at) VALUES (?, ?, ?, ?, 'progressing', ?)",
            (service, from_revision, to_revision, kind, now),
        )
        conn.execute(
            "UPDATE services SET target_revision = ?, spec_json = coalesce(?, spec_json),"
            " desired_replicas = coalesce(?, desired_replicas), updated_at = ? WHERE name = ?",
            (to_revision, spec_json, desired_replicas, now, service),
        )
        assert cursor.lastrowid is not None
        return RolloutRow(
            cursor.lastrowid,
            service,
            from_revision,
            to_revision,
            kind,
            "progressing",
            "",
            0,
            now,
            None,
        )

    def update_rollout(
        self,
        id: int,
        *,
        status: RolloutStatus | None = None,
        reason: str | None = None,
        retries_used: int | None = None,
        finished: bool = False,
    ) -> RolloutRow:
        """Change a rollout's record; ``finished`` stamps ``finished_at``. Not the service:
        to end a rollout and move the service, use ``finish_rollout``."""
        if status is not None:
            _check_status(status)
        with self._write() as conn:
            self._rollout_in(conn, id)
            conn.execute(
                "UPDATE rollouts SET status = coalesce(?, status), reason = coalesce(?, reason),"
                " retries_used = coalesce(?, retries_used),"
                " finished_at = CASE WHEN ? THEN ? ELSE finished_at END WHERE id = ?",
                (status, reason, retries_used, finished, self._clock(), id),
            )
            return self._rollout_in(conn, id)

    def finish_rollout(
        self, id: int, status: RolloutStatus, reason: str, serving_revision: int | None
    ) -> RolloutRow:
        """End an active rollout and move its service, in one transaction.

        The rollout gets ``status`` (complete, failed, aborted or rolled_back), ``reason`` and
        ``finished_at``; the service serves ``serving_revision`` (None: nothing) and targets
        the same. ``Conflict`` if the rollout is no longer active (superseded, say).
        """
        _check_status(status, FINISHED_STATUSES)
        with self._write() as conn:
            rollout = self._rollout_in(conn, id)
            if not rollout.active:
                raise Conflict(f"rollout {id} is already {rollout.status}", rollout=id)
            self._require_revision(conn, rollout.service, serving_revision)
            now = self._clock()
            conn.execute(
                "UPDATE rollouts SET status = ?, reason = ?, finished_at = ? WHERE id = ?",
                (status, reason, now, id),
            )
            conn.execute(
                "UPDATE services SET serving_revision = ?, target_revision = ?, updated_at = ?"
                " WHERE name = ?",
                (serving_revision, serving_revision, now, rollout.service),
            )
            return self._rollout_in(conn, id)

    @staticmethod
    def _rollout_in(conn: sqlite3.Connection, id: int) -> RolloutRow:
        row = conn.execute(f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE id = ?", (id,)).fetchone()
        if row is None:
            raise NotFound(f"no rollout {id}", rollout=id)
        return _rollout(row)

    def rollout(self, id: int) -> RolloutRow | None:
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE id = ?", (id,)
            ).fetchone()
        return None if row is None else _rollout(row)

    def rollouts(self, service: str, limit: int = 100) -> list[RolloutRow]:
        """The service's rollouts, newest first."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE service = ? ORDER BY id DESC LIMIT ?",
                (service, limit),
            ).fetchall()
        return [_rollout(r) for r in rows]

    def active_rollout(self, service: str) -> RolloutRow | None:
        """The service's progressing or paused rollout (there is at most one)."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE service = ?"
                f" AND status IN ({_sql_list(ACTIVE_STATUSES)}) ORDER BY id DESC LIMIT 1",
                (service,),
            ).fetchone()
        return None if row is None else _rollout(row)

    # -- events ------------------------------------------------------------------------------

    def add_event(
        self,
        service: str,
        kind: str,
        message: str,
        revision: int | None = None,
        replica: str | None = None,
    ) -> EventRow:
        """Record an event. Any service name is accepted: events outlive services.

        Every ``trim_every`` events of a service, the same transaction drops its oldest beyond
        ``max_events_per_service`` (and all services are trimmed on open), so a service holds
        at most that many plus ``trim_every``.
        """
        with self._write() as conn:
            at = self._clock()
            cursor = conn.execute(
                "INSERT INTO events (at, service, kind, message, revision, replica)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (at, service, kind, message, revision, replica),
            )
            count = self._since_trim.get(service, 0) + 1
            if count >= self._trim_every:
                self._trim(conn, service)
                count = 0
            assert cursor.lastrowid is not None
            event = EventRow(cursor.lastrowid, at, service, kind, message, revision, replica)
        # Counted only once committed: a rolled-back insert must not skip a trim.
        self._since_trim[service] = count
        return event

    def _trim(self, conn: sqlite3.Connection, service: str | None) -> None:
        if service is None:
            names = [r[0] for r in conn.execute("SELECT DISTINCT service FROM events")]
        else:
            names = [service]
        for name in names:
            cursor = conn.execute(
                "DELETE FROM events WHERE service = ? AND id <= (SELECT id FROM events"
                " WHERE service = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (name, name, self.max_events_per_service),
            )
            self.trimmed_events += max(cursor.rowcount, 0)

    def events(
        self, service: str | None = None, after_id: int = 0, limit: int = 500
    ) -> list[EventRow]:
        """Events with ``id > after_id`` (of one service, or all), ascending, at most ``limit``."""
        with self._read() as conn:
            if service is None:
                rows = conn.execute(
                    f"SELECT {_EVENT_COLS} FROM events WHERE id > ? ORDER BY id LIMIT ?",
                    (after_id, limit),
                ).fetchall()
            else:
                rows = conn.execute(
                    f"SELECT {_EVENT_COLS} FROM events WHERE service = ? AND id > ?"
                    " ORDER BY id LIMIT ?",
                    (service, after_id, limit),
                ).fetchall()
        return [_event(r) for r in rows]

    # -- replicas ----------------------------------------------------------------------------

    def put_replica(
        self, service: str, replica_id: str, revision: int, backend: str, handle_json: str
    ) -> ReplicaRow:
        """Record (or replace) a replica of a live service's existing revision."""
        with self._write() as conn:
            self._live_service(conn, service)
            self._require_revision(conn, service, revision)
            conn.execute(
                f"INSERT INTO replicas ({_REPLICA_COLS}) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (service, replica_id) DO UPDATE SET revision = excluded.revision,"
                " backend = excluded.backend, handle_json = excluded.handle_json",
                (service, replica_id, revision, backend, handle_json, self._clock()),
            )
            row = conn.execute(
                f"SELECT {_REPLICA_COLS} FROM replicas WHERE service = ? AND replica_id = ?",
                (service, replica_id),
            ).fetchone()
            return _replica(row)

    def remove_replica(self, service: str, replica_id: str) -> bool:
        """Forget a replica; False if it was not recorded."""
        with self._write() as conn:
            cursor = conn.execute(
                "DELETE FROM replicas WHERE service = ? AND replica_id = ?", (service, replica_id)
            )
            return cursor.rowcount > 0

    def replicas(self, service: str) -> list[ReplicaRow]:
        """The service's recorded replicas, oldest first."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {_REPLICA_COLS} FROM replicas WHERE service = ?"
                " ORDER BY created_at, replica_id",
                (service,),
            ).fetchall()
        return [_replica(r) for r in rows]


__all__ = [
    "ACTIVE_STATUSES",
    "FINISHED_STATUSES",
    "ROLLOUT_KINDS",
    "ROLLOUT_STATUSES",
    "SCHEMA_VERSION",
    "UNSET",
    "ConfigAppliedRow",
    "EventRow",
    "ReplicaRow",
    "RevisionRow",
    "RolloutKind",
    "RolloutRow",
    "RolloutStatus",
    "ServiceRow",
    "Store",
]
