"""Services and their revisions.

A service's row holds its last applied spec, serving and target revision and desired count. A
deleted service stays as a tombstone (``deleted``) with its revisions, so that a re-created
service continues from the highest revision number it ever used: revisions are numbered 1, 2,
3... without gaps for the life of the file.
"""

from __future__ import annotations

import sqlite3
from typing import Final

from controller.errors import NotFound

from .database import Database
from .rows import (
    ACTIVE_STATUSES,
    REVISION_COLS,
    SERVICE_COLS,
    RevisionRow,
    ServiceRow,
    revision_row,
    service_row,
    sql_list,
)


class _Unset:
    """Marks an ``update_service`` field left alone (``None`` is a value there)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()


def live_service(conn: sqlite3.Connection, name: str) -> ServiceRow:
    """The service's row; ``NotFound`` if there is none or it was deleted."""
    row = conn.execute(
        f"SELECT {SERVICE_COLS} FROM services WHERE name = ? AND deleted = 0", (name,)
    ).fetchone()
    if row is None:
        raise NotFound(f"no service {name!r}", service=name)
    return service_row(row)


def require_revision(conn: sqlite3.Connection, service: str, number: int | None) -> None:
    """``NotFound`` unless the revision exists (None: nothing to check)."""
    if number is None:
        return
    row = conn.execute(
        "SELECT 1 FROM revisions WHERE service = ? AND number = ?", (service, number)
    ).fetchone()
    if row is None:
        raise NotFound(f"no revision {number} of service {service!r}", service=service)


def insert_revision(
    conn: sqlite3.Connection, service: str, template_key: str, spec_json: str, now: float
) -> RevisionRow:
    """Insert the service's next revision; the caller holds the write transaction."""
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


class Services(Database):
    """The ``services`` and ``revisions`` tables."""

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
        with self._write() as conn:
            live_service(conn, name)
            sets = "".join(f"{column} = ?, " for column in changes)
            conn.execute(
                f"UPDATE services SET {sets}updated_at = ? WHERE name = ?",
                (*changes.values(), self._clock(), name),
            )
            return live_service(conn, name)

    def service(self, name: str, *, include_deleted: bool = False) -> ServiceRow | None:
        """The service, or None if there is none or it was deleted (unless asked for)."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {SERVICE_COLS} FROM services WHERE name = ?", (name,)
            ).fetchone()
        if row is None or (row[6] and not include_deleted):
            return None
        return service_row(row)

    def services(self) -> list[ServiceRow]:
        """Live services, by name."""
        with self._read() as conn:
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
        with self._write() as conn:
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

    # -- revisions ---------------------------------------------------------------------------

    def add_revision(self, service: str, template_key: str, spec_json: str) -> RevisionRow:
        """Add the next revision (max ever used + 1, from 1) of a live service."""
        with self._write() as conn:
            live_service(conn, service)
            return insert_revision(conn, service, template_key, spec_json, self._clock())

    def revision(self, service: str, number: int) -> RevisionRow | None:
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {REVISION_COLS} FROM revisions WHERE service = ? AND number = ?",
                (service, number),
            ).fetchone()
        return None if row is None else revision_row(row)

    def revisions(self, service: str) -> list[RevisionRow]:
        """All revisions of a service ever made, ascending."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {REVISION_COLS} FROM revisions WHERE service = ? ORDER BY number",
                (service,),
            ).fetchall()
        return [revision_row(r) for r in rows]

    def revision_by_key(self, service: str, template_key: str) -> RevisionRow | None:
        """The latest revision of the service with this template key."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {REVISION_COLS} FROM revisions WHERE service = ? AND template_key = ?"
                " ORDER BY number DESC LIMIT 1",
                (service, template_key),
            ).fetchone()
        return None if row is None else revision_row(row)
