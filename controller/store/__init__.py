"""The store: the controller's durable state in one SQLite file.

It holds services (the last applied spec, the serving and target revision, the desired count),
their revisions, the rollout history, events, and the replicas the backends run; for each
service applied from the gateway config, the digest of the document last applied from there
(so that start-up applies a config entry again only once its content changed); and the bearer
tokens added through the admin API, by digest.

``Store`` is one class, a section per table, over the ``Database`` it holds (``database``: the
connection, ``BEGIN IMMEDIATE`` transactions, SQLite errors translated to ``StoreUnavailable``
and ``Conflict``, the migration on open; ``migrations``: the versions). ``rows``: the frozen
rows it returns and the columns they are read from.

Invariants:

- Every write is one transaction, compound operations (``apply_revision``, ``create_rollout``,
  ``finish_rollout``, ``delete_service``) included. A crash at any moment, SIGKILL too, leaves
  either the old state or the new one; a write that returned is durable.
- A service's revisions are numbered 1, 2, 3... without gaps for the life of the file. A
  deleted service stays as a tombstone (``deleted``) with its revisions, rollouts, events and
  config record, for audit, so that a re-created service continues from the highest number it
  ever used, and so that a service deleted through the API is told apart from a new name. Its
  replicas and tokens go with it.
- A service has at most one active (progressing or paused) rollout; a unique partial index
  holds it. Starting a rollout supersedes the active one in the same transaction and sets the
  service's target revision; finishing it sets the serving revision and the target to match:
  outside a rollout, ``target_revision == serving_revision``.
- Foreign keys tie rollouts, replicas and the serving and target revision to existing revisions.
- A missing service, revision or rollout raises ``NotFound``.
- Event ids are never reused, even after trimming, so ``after_id`` paging holds. Events
  outlive their services: any service name is accepted.

Synchronous on purpose: writes are rare control-plane events. One lock serialises the
connection, which any thread may use (``asyncio.to_thread`` is fine). Timestamps are wall-clock
seconds from the injected ``clock``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from controller.errors import Conflict, NotFound
from controller.planning.model import RolloutKind

from . import migrations
from .database import Database
from .migrations import SCHEMA_VERSION
from .rows import (
    ACTIVE_STATUSES,
    EVENT_COLS,
    FINISHED_STATUSES,
    REPLICA_COLS,
    REVISION_COLS,
    ROLLOUT_COLS,
    ROLLOUT_KINDS,
    ROLLOUT_STATUSES,
    SERVICE_COLS,
    TOKEN_COLS,
    ConfigAppliedRow,
    EventRow,
    ReplicaRow,
    RevisionRow,
    RolloutRow,
    RolloutStatus,
    ServiceRow,
    TokenRow,
    event_row,
    replica_row,
    revision_row,
    rollout_row,
    service_row,
    sql_list,
)


class _Unset:
    """Marks an ``update_service`` field left alone (``None`` is a value there)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()


class Store:
    """The controller's state in one SQLite file. See the package docstring for the contract.

    ``readonly=True`` opens the file with SQLite's ``mode=ro``: reads work, every write raises
    ``StoreUnavailable``, and a file that needs a migration is refused.

    Events are trimmed per service: every ``trim_every`` events of a service, the write that
    adds one drops its oldest beyond ``max_events_per_service`` (and opening trims every
    service), so a service holds at most that many plus ``trim_every``. ``trim_per_write``
    bounds what one trim deletes (the etcd store's transactions have a size): the rest goes
    with the next trims.
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
        trim_per_write: int | None = None,
    ) -> None:
        self._clock = clock
        self._trim_per_write = -1 if trim_per_write is None else trim_per_write
        self.max_events_per_service = max_events_per_service
        self._trim_every = trim_every
        self._since_trim: dict[str, int] = {}
        self.trimmed_events = 0
        """Events dropped by trimming, by this instance."""
        self.database = Database(
            path, clock, readonly=readonly, busy_timeout=busy_timeout, committing=self._committing
        )
        """The connection and its transactions, with their counters (``writes``...)."""
        if not readonly:
            try:
                with self.database.write() as conn:
                    self._trim(conn, None)
            except BaseException:
                self.close()
                raise

    def _committing(self, conn: sqlite3.Connection) -> None:
        """Called in each write transaction before its COMMIT; raising rolls it back. The etcd
        store (``store.etcd``) turns the rows the transaction changed into etcd operations."""

    def schema_version(self) -> int:
        """The version the file is at (``migrations``): ``SCHEMA_VERSION`` once open."""
        with self.database.read() as conn:
            return migrations.version(conn)

    def close(self) -> None:
        """Close the connection. Idempotent; any later call raises ``StoreUnavailable``."""
        self.database.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        db = self.database
        return (
            f"Store(path={str(db.path)!r}, schema_version={SCHEMA_VERSION},"
            f" journal_mode={db.journal_mode!r}, readonly={db.readonly},"
            f" writes={db.writes}, failed_writes={db.failed_writes},"
            f" trimmed_events={self.trimmed_events}, closed={db.closed})"
        )

    # -- services ------------------------------------------------------------------------------

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
        with self.database.write() as conn:
            conn.execute(
                f"INSERT INTO services ({SERVICE_COLS}) VALUES (?, ?, ?, ?, ?, ?, 0, ?)"
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
        with self.database.write() as conn:
            _live_service(conn, name)
            sets = "".join(f"{column} = ?, " for column in changes)
            conn.execute(
                f"UPDATE services SET {sets}updated_at = ? WHERE name = ?",
                (*changes.values(), self._clock(), name),
            )
            return _live_service(conn, name)

    def service(self, name: str, *, include_deleted: bool = False) -> ServiceRow | None:
        """The service, or None if there is none or it was deleted (unless asked for)."""
        with self.database.read() as conn:
            row = conn.execute(
                f"SELECT {SERVICE_COLS} FROM services WHERE name = ?", (name,)
            ).fetchone()
        if row is None or (row[6] and not include_deleted):
            return None
        return service_row(row)

    def services(self) -> list[ServiceRow]:
        """Live services, by name."""
        with self.database.read() as conn:
            rows = conn.execute(
                f"SELECT {SERVICE_COLS} FROM services WHERE deleted = 0 ORDER BY name"
            ).fetchall()
        return [service_row(r) for r in rows]

    def delete_service(self, name: str) -> bool:
        """Tombstone a service in one transaction; False if it was not live (idempotent).

        The row stays with ``deleted`` set, no serving or target revision and no desired
        replicas; its replica rows are removed and an active rollout is aborted. Revisions,
        rollouts and events are kept for audit.
        """
        with self.database.write() as conn:
            live = conn.execute(
                "SELECT 1 FROM services WHERE name = ? AND deleted = 0", (name,)
            ).fetchone()
            if live is None:
                return False
            now = self._clock()
            conn.execute("DELETE FROM replicas WHERE service = ?", (name,))
            conn.execute("DELETE FROM tokens WHERE service = ?", (name,))
            conn.execute(
                "UPDATE rollouts SET status = 'aborted', reason = 'service deleted',"
                f" finished_at = ? WHERE service = ? AND status IN ({sql_list(ACTIVE_STATUSES)})",
                (now, name),
            )
            conn.execute(
                "UPDATE services SET deleted = 1, serving_revision = NULL,"
                " target_revision = NULL, desired_replicas = 0, paused = 0, updated_at = ?"
                " WHERE name = ?",
                (now, name),
            )
            return True

    # -- revisions -----------------------------------------------------------------------------

    def add_revision(self, service: str, template_key: str, spec_json: str) -> RevisionRow:
        """Add the next revision (max ever used + 1, from 1) of a live service."""
        with self.database.write() as conn:
            _live_service(conn, service)
            return _insert_revision(conn, service, template_key, spec_json, self._clock())

    def revision(self, service: str, number: int) -> RevisionRow | None:
        with self.database.read() as conn:
            row = conn.execute(
                f"SELECT {REVISION_COLS} FROM revisions WHERE service = ? AND number = ?",
                (service, number),
            ).fetchone()
        return None if row is None else revision_row(row)

    def revisions(self, service: str) -> list[RevisionRow]:
        """All revisions of a service ever made, ascending."""
        with self.database.read() as conn:
            rows = conn.execute(
                f"SELECT {REVISION_COLS} FROM revisions WHERE service = ? ORDER BY number",
                (service,),
            ).fetchall()
        return [revision_row(r) for r in rows]

    def revision_by_key(self, service: str, template_key: str) -> RevisionRow | None:
        """The latest revision of the service with this template key."""
        with self.database.read() as conn:
            row = conn.execute(
                f"SELECT {REVISION_COLS} FROM revisions WHERE service = ? AND template_key = ?"
                " ORDER BY number DESC LIMIT 1",
                (service, template_key),
            ).fetchone()
        return None if row is None else revision_row(row)

    # -- rollouts ------------------------------------------------------------------------------

    def create_rollout(
        self,
        service: str,
        from_revision: int | None,
        to_revision: int,
        kind: RolloutKind,
        *,
        spec_json: str | None = None,
        desired_replicas: int | None = None,
        strategy_json: str | None = None,
    ) -> RolloutRow:
        """Start a rollout to an existing revision, in one transaction.

        The active rollout, if any, is superseded; the service's target revision becomes
        ``to_revision`` (and its spec and desired count, when given). ``strategy_json``: how
        it moves (``RolloutRow.strategy_json``).
        """
        _check_kind(kind)
        with self.database.write() as conn:
            _live_service(conn, service)
            return self._start_rollout(
                conn,
                service,
                from_revision,
                to_revision,
                kind,
                spec_json,
                desired_replicas,
                strategy_json,
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
        with self.database.write() as conn:
            conn.execute(
                f"INSERT INTO services ({SERVICE_COLS}) VALUES (?, ?, NULL, NULL, ?, 0, 0, ?)"
                " ON CONFLICT (name) DO UPDATE SET deleted = 0",
                (service, spec_json, desired_replicas, self._clock()),
            )
            revision = _insert_revision(conn, service, template_key, spec_json, self._clock())
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
        strategy_json: str | None = None,
    ) -> RolloutRow:
        _require_revision(conn, service, from_revision)
        _require_revision(conn, service, to_revision)
        now = self._clock()
        conn.execute(
            "UPDATE rollouts SET status = 'superseded', finished_at = ?, reason = ?"
            f" WHERE service = ? AND status IN ({sql_list(ACTIVE_STATUSES)})",
            (now, f"superseded by a {kind} to revision {to_revision}", service),
        )
        cursor = conn.execute(
            "INSERT INTO rollouts (service, from_revision, to_revision, kind, status,"
            " started_at, strategy_json) VALUES (?, ?, ?, ?, 'progressing', ?, ?)",
            (service, from_revision, to_revision, kind, now, strategy_json),
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
            strategy_json,
        )

    def update_rollout(
        self,
        id: int,
        *,
        status: RolloutStatus | None = None,
        reason: str | None = None,
        retries_used: int | None = None,
        finished: bool = False,
        strategy_json: str | None = None,
    ) -> RolloutRow:
        """Change a rollout's record; ``finished`` stamps ``finished_at``; ``strategy_json``
        replaces how it moves (``RolloutRow.strategy_json``), in the same transaction. Not
        the service: to end a rollout and move the service, use ``finish_rollout``."""
        if status is not None:
            _check_status(status)
        with self.database.write() as conn:
            _rollout_in(conn, id)
            conn.execute(
                "UPDATE rollouts SET status = coalesce(?, status), reason = coalesce(?, reason),"
                " retries_used = coalesce(?, retries_used),"
                " strategy_json = coalesce(?, strategy_json),"
                " finished_at = CASE WHEN ? THEN ? ELSE finished_at END WHERE id = ?",
                (status, reason, retries_used, strategy_json, finished, self._clock(), id),
            )
            return _rollout_in(conn, id)

    def finish_rollout(
        self, id: int, status: RolloutStatus, reason: str, serving_revision: int | None
    ) -> RolloutRow:
        """End an active rollout and move its service, in one transaction.

        The rollout gets ``status`` (complete, failed, aborted or rolled_back), ``reason`` and
        ``finished_at``; the service serves ``serving_revision`` (None: nothing) and targets
        the same. ``Conflict`` if the rollout is no longer active (superseded, say).
        """
        _check_status(status, FINISHED_STATUSES)
        with self.database.write() as conn:
            rollout = _rollout_in(conn, id)
            if not rollout.active:
                raise Conflict(f"rollout {id} is already {rollout.status}", rollout=id)
            _require_revision(conn, rollout.service, serving_revision)
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
            return _rollout_in(conn, id)

    def rollout(self, id: int) -> RolloutRow | None:
        with self.database.read() as conn:
            row = conn.execute(
                f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE id = ?", (id,)
            ).fetchone()
        return None if row is None else rollout_row(row)

    def rollouts(self, service: str, limit: int = 100) -> list[RolloutRow]:
        """The service's rollouts, newest first."""
        with self.database.read() as conn:
            rows = conn.execute(
                f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE service = ? ORDER BY id DESC LIMIT ?",
                (service, limit),
            ).fetchall()
        return [rollout_row(r) for r in rows]

    def active_rollout(self, service: str) -> RolloutRow | None:
        """The service's progressing or paused rollout (there is at most one)."""
        with self.database.read() as conn:
            row = conn.execute(
                f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE service = ?"
                f" AND status IN ({sql_list(ACTIVE_STATUSES)}) ORDER BY id DESC LIMIT 1",
                (service,),
            ).fetchone()
        return None if row is None else rollout_row(row)

    # -- events --------------------------------------------------------------------------------

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
        with self.database.write() as conn:
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
        """Drop the oldest events beyond the bound: of ``service``, or of every service."""
        if service is None:
            names = [r[0] for r in conn.execute("SELECT DISTINCT service FROM events")]
        else:
            names = [service]
        for name in names:
            cursor = conn.execute(
                "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE service = ?"
                " AND id <= (SELECT id FROM events WHERE service = ? ORDER BY id DESC"
                " LIMIT 1 OFFSET ?) ORDER BY id LIMIT ?)",
                (name, name, self.max_events_per_service, self._trim_per_write),
            )
            self.trimmed_events += max(cursor.rowcount, 0)

    def events(
        self, service: str | None = None, after_id: int = 0, limit: int = 500
    ) -> list[EventRow]:
        """Events with ``id > after_id`` (of one service, or all), ascending, at most ``limit``."""
        with self.database.read() as conn:
            if service is None:
                rows = conn.execute(
                    f"SELECT {EVENT_COLS} FROM events WHERE id > ? ORDER BY id LIMIT ?",
                    (after_id, limit),
                ).fetchall()
            else:
                rows = conn.execute(
                    f"SELECT {EVENT_COLS} FROM events WHERE service = ? AND id > ?"
                    " ORDER BY id LIMIT ?",
                    (service, after_id, limit),
                ).fetchall()
        return [event_row(r) for r in rows]

    # -- replicas ------------------------------------------------------------------------------

    def put_replica(
        self, service: str, replica_id: str, revision: int, backend: str, handle_json: str
    ) -> ReplicaRow:
        """Record (or replace) a replica of a live service's existing revision."""
        with self.database.write() as conn:
            _live_service(conn, service)
            _require_revision(conn, service, revision)
            conn.execute(
                f"INSERT INTO replicas ({REPLICA_COLS}) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (service, replica_id) DO UPDATE SET revision = excluded.revision,"
                " backend = excluded.backend, handle_json = excluded.handle_json",
                (service, replica_id, revision, backend, handle_json, self._clock()),
            )
            row = conn.execute(
                f"SELECT {REPLICA_COLS} FROM replicas WHERE service = ? AND replica_id = ?",
                (service, replica_id),
            ).fetchone()
            return replica_row(row)

    def remove_replica(self, service: str, replica_id: str) -> bool:
        """Forget a replica; False if it was not recorded."""
        with self.database.write() as conn:
            cursor = conn.execute(
                "DELETE FROM replicas WHERE service = ? AND replica_id = ?", (service, replica_id)
            )
            return cursor.rowcount > 0

    def replicas(self, service: str) -> list[ReplicaRow]:
        """The service's recorded replicas, oldest first."""
        with self.database.read() as conn:
            rows = conn.execute(
                f"SELECT {REPLICA_COLS} FROM replicas WHERE service = ?"
                " ORDER BY created_at, replica_id",
                (service,),
            ).fetchall()
        return [replica_row(r) for r in rows]

    # -- config applied ------------------------------------------------------------------------

    def config_applied(self, service: str) -> ConfigAppliedRow | None:
        """What the gateway config last applied to the service (deleted or not), if ever."""
        with self.database.read() as conn:
            row = conn.execute(
                "SELECT service, source, digest, applied_at FROM config_applied WHERE service = ?",
                (service,),
            ).fetchone()
        return None if row is None else ConfigAppliedRow(*row)

    def record_config_applied(self, service: str, source: str, digest: str) -> ConfigAppliedRow:
        """Record that the config's document ``digest`` from ``source`` was applied to a live
        service (replacing the previous record)."""
        with self.database.write() as conn:
            _live_service(conn, service)
            row = ConfigAppliedRow(service, source, digest, self._clock())
            conn.execute(
                "INSERT INTO config_applied (service, source, digest, applied_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (service) DO UPDATE SET"
                " source = excluded.source, digest = excluded.digest,"
                " applied_at = excluded.applied_at",
                (row.service, row.source, row.digest, row.applied_at),
            )
            return row

    # -- tokens --------------------------------------------------------------------------------
    # Kept by their SHA-256 digest only, never the token itself, so neither the file nor a
    # backup of it gives a token away. A SHA-256 is enough: the tokens the gateway makes are
    # 256 random bits, and tokens a user brings are API keys of the same kind, not passwords a
    # dictionary could guess; a slow salted hash (bcrypt, scrypt) guards low-entropy secrets
    # and would cost every request milliseconds, where the data plane looks the digest up in
    # a dict.

    def tokens(self, service: str) -> list[TokenRow]:
        """The service's tokens in the order they were added (the API shows only ids)."""
        with self.database.read() as conn:
            rows = conn.execute(
                f"SELECT {TOKEN_COLS} FROM tokens WHERE service = ? ORDER BY rowid",
                (service,),
            ).fetchall()
        return [TokenRow(*row) for row in rows]

    def add_token(self, service: str, token_id: str, digest: str, label: str) -> TokenRow:
        """Keep a token of a live service by its digest; ``Conflict`` if it is there already."""
        with self.database.write() as conn:
            _live_service(conn, service)
            if conn.execute(
                "SELECT 1 FROM tokens WHERE service = ? AND digest = ?", (service, digest)
            ).fetchone():
                raise Conflict(f"service {service!r} has this token already", service=service)
            row = TokenRow(token_id, service, digest, label, self._clock())
            conn.execute(
                f"INSERT INTO tokens ({TOKEN_COLS}) VALUES (?, ?, ?, ?, ?)",
                (row.id, row.service, row.digest, row.label, row.created_at),
            )
            return row

    def revoke_token(self, service: str, token_id: str) -> TokenRow:
        """Forget a token; ``NotFound`` if the service has none by that id."""
        with self.database.write() as conn:
            row = conn.execute(
                f"SELECT {TOKEN_COLS} FROM tokens WHERE service = ? AND id = ?",
                (service, token_id),
            ).fetchone()
            if row is None:
                raise NotFound(f"service {service!r} has no token {token_id!r}", service=service)
            conn.execute("DELETE FROM tokens WHERE service = ? AND id = ?", (service, token_id))
            return TokenRow(*row)


# -- the checks the writes share (the caller holds the transaction) ----------------------------


def _live_service(conn: sqlite3.Connection, name: str) -> ServiceRow:
    """The service's row; ``NotFound`` if there is none or it was deleted."""
    row = conn.execute(
        f"SELECT {SERVICE_COLS} FROM services WHERE name = ? AND deleted = 0", (name,)
    ).fetchone()
    if row is None:
        raise NotFound(f"no service {name!r}", service=name)
    return service_row(row)


def _require_revision(conn: sqlite3.Connection, service: str, number: int | None) -> None:
    """``NotFound`` unless the revision exists (None: nothing to check)."""
    if number is None:
        return
    row = conn.execute(
        "SELECT 1 FROM revisions WHERE service = ? AND number = ?", (service, number)
    ).fetchone()
    if row is None:
        raise NotFound(f"no revision {number} of service {service!r}", service=service)


def _insert_revision(
    conn: sqlite3.Connection, service: str, template_key: str, spec_json: str, now: float
) -> RevisionRow:
    """Insert the service's next revision."""
    # Inside BEGIN IMMEDIATE no other writer can take the same number.
    (top,) = conn.execute(
        "SELECT coalesce(max(number), 0) FROM revisions WHERE service = ?", (service,)
    ).fetchone()
    row = RevisionRow(service, int(top) + 1, template_key, spec_json, now)
    conn.execute(
        f"INSERT INTO revisions ({REVISION_COLS}) VALUES (?, ?, ?, ?, ?)",
        (row.service, row.number, row.template_key, row.spec_json, row.created_at),
    )
    return row


def _rollout_in(conn: sqlite3.Connection, id: int) -> RolloutRow:
    row = conn.execute(f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE id = ?", (id,)).fetchone()
    if row is None:
        raise NotFound(f"no rollout {id}", rollout=id)
    return rollout_row(row)


def _check_kind(kind: str) -> None:
    if kind not in ROLLOUT_KINDS:
        raise ValueError(f"rollout kind must be one of {ROLLOUT_KINDS}, not {kind!r}")


def _check_status(status: str, allowed: Sequence[str] = ROLLOUT_STATUSES) -> None:
    if status not in allowed:
        raise ValueError(f"rollout status must be one of {tuple(allowed)}, not {status!r}")


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
    "TokenRow",
]
