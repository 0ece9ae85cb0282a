"""The store's migrations: its schema as one tuple of statements per version, applied in order.

Never edit a released entry: append a new one. ``SCHEMA_VERSION`` is the number of entries; a
file records the versions applied to it in its ``schema_version`` table.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Final

from .rows import ACTIVE_STATUSES, ROLLOUT_KINDS, ROLLOUT_STATUSES, sql_list

# ``executescript`` is avoided because it commits on its own.
MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
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
            kind TEXT NOT NULL CHECK (kind IN ({sql_list(ROLLOUT_KINDS)})),
            status TEXT NOT NULL CHECK (status IN ({sql_list(ROLLOUT_STATUSES)})),
            reason TEXT NOT NULL DEFAULT '',
            retries_used INTEGER NOT NULL DEFAULT 0 CHECK (retries_used >= 0),
            started_at REAL NOT NULL,
            finished_at REAL,
            FOREIGN KEY (service, from_revision) REFERENCES revisions (service, number),
            FOREIGN KEY (service, to_revision) REFERENCES revisions (service, number)
        )""",
        "CREATE INDEX rollouts_by_service ON rollouts (service, id)",
        f"""CREATE UNIQUE INDEX rollouts_one_active ON rollouts (service)
            WHERE status IN ({sql_list(ACTIVE_STATUSES)})""",
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
    (
        # Bearer tokens added through the admin API, by their SHA-256 digest only.
        """CREATE TABLE tokens (
            id TEXT PRIMARY KEY,
            service TEXT NOT NULL REFERENCES services (name),
            digest TEXT NOT NULL,
            label TEXT NOT NULL DEFAULT '',
            created_at REAL NOT NULL,
            UNIQUE (service, digest)
        )""",
    ),
    (
        # A staged rollout's strategy state (step, weight, promotion, its times, the last
        # analysis), JSON as ``controller.planning.model.strategy_state`` writes it: a canary in
        # progress goes on at its step after a restart. NULL: none kept (a rolling update of
        # an older controller).
        "ALTER TABLE rollouts ADD COLUMN strategy_json TEXT",
    ),
)
SCHEMA_VERSION: Final = len(MIGRATIONS)

CREATE_VERSION_TABLE: Final = (
    "CREATE TABLE IF NOT EXISTS schema_version"
    " (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
)


def version(conn: sqlite3.Connection) -> int:
    """The highest version applied to the file; 0 for a new one."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if exists is None:
        return 0
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def upgrade(conn: sqlite3.Connection, start: int, clock: Callable[[], float]) -> None:
    """Apply the versions after ``start``, each recorded with the ``clock`` time it was
    applied at; the caller holds the transaction."""
    for number in range(start + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[number - 1]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (number, clock())
        )
