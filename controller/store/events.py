"""Events: what happened to a service, kept per service up to a bound.

Event ids are never reused, even after trimming, so ``after_id`` paging holds. Events outlive
their services: any service name is accepted.
"""

from __future__ import annotations

import sqlite3

from .database import Database
from .rows import EVENT_COLS, EventRow, event_row


class Events(Database):
    """The ``events`` table. ``max_events_per_service``, ``trimmed_events``, ``_trim_every``
    and ``_since_trim`` are set by the store before it opens."""

    max_events_per_service: int
    trimmed_events: int
    """Events dropped by trimming, by this instance."""
    _trim_every: int
    _since_trim: dict[str, int]

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
        """Drop the oldest events beyond the bound: of ``service``, or of every service."""
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
