"""Rollouts: the history of moving a service from one revision to another.

A service has at most one active (progressing or paused) rollout; a unique partial index holds
it. Starting a rollout supersedes the active one in the same transaction, and sets the
service's target revision. Finishing it sets the serving revision, and the target to match:
outside a rollout, ``target_revision == serving_revision``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from controller.errors import Conflict, NotFound
from controller.model import RolloutKind

from .database import Database
from .rows import (
    ACTIVE_STATUSES,
    FINISHED_STATUSES,
    ROLLOUT_COLS,
    ROLLOUT_KINDS,
    ROLLOUT_STATUSES,
    SERVICE_COLS,
    RevisionRow,
    RolloutRow,
    RolloutStatus,
    rollout_row,
    sql_list,
)
from .services import insert_revision, live_service, require_revision


def _check_kind(kind: str) -> None:
    if kind not in ROLLOUT_KINDS:
        raise ValueError(f"rollout kind must be one of {ROLLOUT_KINDS}, not {kind!r}")


def _check_status(status: str, allowed: Sequence[str] = ROLLOUT_STATUSES) -> None:
    if status not in allowed:
        raise ValueError(f"rollout status must be one of {tuple(allowed)}, not {status!r}")


def _rollout_in(conn: sqlite3.Connection, id: int) -> RolloutRow:
    row = conn.execute(f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE id = ?", (id,)).fetchone()
    if row is None:
        raise NotFound(f"no rollout {id}", rollout=id)
    return rollout_row(row)


class Rollouts(Database):
    """The ``rollouts`` table, and the service's revisions it moves."""

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
        with self._write() as conn:
            live_service(conn, service)
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
        with self._write() as conn:
            conn.execute(
                f"INSERT INTO services ({SERVICE_COLS}) VALUES (?, ?, NULL, NULL, ?, 0, 0, ?)"
                " ON CONFLICT (name) DO UPDATE SET deleted = 0",
                (service, spec_json, desired_replicas, self._clock()),
            )
            revision = insert_revision(conn, service, template_key, spec_json, self._clock())
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
        require_revision(conn, service, from_revision)
        require_revision(conn, service, to_revision)
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
        with self._write() as conn:
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
        with self._write() as conn:
            rollout = _rollout_in(conn, id)
            if not rollout.active:
                raise Conflict(f"rollout {id} is already {rollout.status}", rollout=id)
            require_revision(conn, rollout.service, serving_revision)
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
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE id = ?", (id,)
            ).fetchone()
        return None if row is None else rollout_row(row)

    def rollouts(self, service: str, limit: int = 100) -> list[RolloutRow]:
        """The service's rollouts, newest first."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE service = ? ORDER BY id DESC LIMIT ?",
                (service, limit),
            ).fetchall()
        return [rollout_row(r) for r in rows]

    def active_rollout(self, service: str) -> RolloutRow | None:
        """The service's progressing or paused rollout (there is at most one)."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE service = ?"
                f" AND status IN ({sql_list(ACTIVE_STATUSES)}) ORDER BY id DESC LIMIT 1",
                (service,),
            ).fetchone()
        return None if row is None else rollout_row(row)
