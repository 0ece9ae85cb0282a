"""Replicas: what the backends run for a service, with the handle to find each one again
after a restart. A replica row names an existing revision of a live service."""

from __future__ import annotations

from .database import Database
from .rows import REPLICA_COLS, ReplicaRow, replica_row
from .services import live_service, require_revision


class Replicas(Database):
    """The ``replicas`` table."""

    def put_replica(
        self, service: str, replica_id: str, revision: int, backend: str, handle_json: str
    ) -> ReplicaRow:
        """Record (or replace) a replica of a live service's existing revision."""
        with self._write() as conn:
            live_service(conn, service)
            require_revision(conn, service, revision)
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
        with self._write() as conn:
            cursor = conn.execute(
                "DELETE FROM replicas WHERE service = ? AND replica_id = ?", (service, replica_id)
            )
            return cursor.rowcount > 0

    def replicas(self, service: str) -> list[ReplicaRow]:
        """The service's recorded replicas, oldest first."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {REPLICA_COLS} FROM replicas WHERE service = ?"
                " ORDER BY created_at, replica_id",
                (service,),
            ).fetchall()
        return [replica_row(r) for r in rows]
