"""The store in etcd, for a cluster: the same rows and rules as on one node, written by the leader.

``EtcdStore`` is the SQLite ``Store`` over an in-memory database (the **mirror**) plus an
**outbox**: reads and the validation of writes (``NotFound``, ``Conflict``, revision numbering,
one active rollout, foreign keys) are exactly the SQLite store's, on the mirror; each write
transaction's changed rows (captured by temporary triggers) become one pending etcd
transaction, and ``flush`` sends the pending ones in order, each carrying the leader's fence.

Keys, under ``<prefix>state/`` (values are JSON):

- ``<table>/<primary key>``: one row, ``{column: value}``. A composite key is its columns'
  values joined by ``/``, each percent-encoded (``revisions/web/3``, ``replicas/web/web-3-a1b2c3``).
  Tables: ``services``, ``revisions``, ``rollouts``, ``events``, ``replicas``,
  ``config_applied``, ``tokens``.
- ``sequence/<table>``: the last id AUTOINCREMENT gave (``rollouts``, ``events``), so ids are
  never reused across leaders, trimming included.
- ``schema_version``: the store's schema version; a prefix written by a newer gateway is
  refused, as a newer SQLite file is.

Who writes: only the node that leads (``lead``), so its mirror is the truth while it leads and
nothing else writes under it; ``lead`` loads the mirror fresh from one consistent read. A node
that does not lead has no use for the state (its admin API forwards to the leader) and refuses
writes.

Durability: a write returns once applied to the mirror; it is in etcd after ``flush``. The
leader flushes within tens of milliseconds, before placing or stopping a replica (its own
fenced writes), and before it answers an admin write. Outcomes of ``flush``:

- committed: nothing pending;
- the fence failed (another node leads): every pending write is dropped, the mirror is stale
  until the next ``lead``, and ``Deposed`` is raised;
- etcd unreachable: the pending writes stay, in order, and ``StoreUnavailable`` says why; the
  next flush sends them (the fence still decides whether they count).

Consecutive pending writes go out together, in as few transactions as etcd's limit of operations
per transaction allows (``MAX_OPS``); a single write with more rows than that (only the trim of
a long event history, or deleting a service with many events) is split, the one case where a
write is not atomic in etcd.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from controller.errors import Deposed, StoreUnavailable
from controller.etcd import Compare, Delete, EtcdClient, EtcdUnavailable, Op, Put

from . import Store
from .schema import SCHEMA_VERSION

PRIMARY_KEYS: dict[str, tuple[str, ...]] = {
    "services": ("name",),
    "revisions": ("service", "number"),
    "rollouts": ("id",),
    "events": ("id",),
    "replicas": ("service", "replica_id"),
    "config_applied": ("service",),
    "tokens": ("id",),
}
SEQUENCED = ("rollouts", "events")
MAX_OPS = 120
"""Operations per etcd transaction (etcd's default ``--max-txn-ops`` is 128)."""
Fence = Callable[[], Sequence[Compare]]


def row_key(table: str, pk: Sequence[object]) -> str:
    return table + "/" + "/".join(quote(str(v), safe="") for v in pk)


def split_key(key: str) -> tuple[str, tuple[str, ...]] | None:
    table, _, rest = key.partition("/")
    if table not in PRIMARY_KEYS:
        return None
    parts = tuple(unquote(p) for p in rest.split("/"))
    return (table, parts) if len(parts) == len(PRIMARY_KEYS[table]) else None


class EtcdStore(Store):
    """See the module docstring. ``lead`` before writing; ``flush`` to make writes durable."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        clock: Callable[[], float] = time.time,
        *,
        max_events_per_service: int = 10_000,
        trim_every: int = 100,
    ) -> None:
        self.client = client
        self.base = prefix + "state/"
        self.fence: Fence | None = None
        self.leading = False
        self.stale = True
        """The mirror is not the state (never loaded, or a fence failed): no write."""
        self.connected = True
        self.unreachable = ""
        """Why the last etcd call failed (empty after one succeeded)."""
        self.requests = 0
        self.etcd_revision = 0
        self._pending: list[list[Op]] = []
        self._applying = False
        self._capturing = False
        super().__init__(
            Path(":memory:"),
            clock,
            max_events_per_service=max_events_per_service,
            trim_every=trim_every,
        )
        with self._read() as conn:
            self._capture(conn)
        self._capturing = True

    # -- capture ------------------------------------------------------------------------------

    def _capture(self, conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TEMP TABLE changes (tbl TEXT NOT NULL, pk TEXT NOT NULL)")
        for table, columns in PRIMARY_KEYS.items():
            for event, row in (("INSERT", "NEW"), ("UPDATE", "NEW"), ("DELETE", "OLD")):
                pk = ", ".join(f"{row}.{c}" for c in columns)
                conn.execute(
                    f"CREATE TEMP TRIGGER capture_{table}_{event.lower()} AFTER {event}"
                    f" ON main.{table} BEGIN INSERT INTO changes (tbl, pk)"
                    f" VALUES ('{table}', json_array({pk})); END"
                )

    def _write_allowed(self) -> None:
        if not self.leading:
            raise StoreUnavailable(
                "this node does not lead: the leader writes the cluster's state",
                reason="not leading",
            )
        if self.stale:
            raise StoreUnavailable(
                "the state is being loaded again (this node's leadership changed)",
                reason="stale",
            )

    def _committing(self, conn: sqlite3.Connection) -> None:
        """Called inside each write transaction, before COMMIT: its rows become etcd ops."""
        if not self._capturing:
            return  # the schema and the first trim, made in the mirror before capture began
        changed = conn.execute("SELECT DISTINCT tbl, pk FROM changes").fetchall()
        if not changed:
            return
        conn.execute("DELETE FROM changes")
        if self._applying:
            return
        self._write_allowed()
        ops: list[Op] = []
        tables = set()
        for table, pk_json in changed:
            pk = json.loads(pk_json)
            columns = PRIMARY_KEYS[table]
            where = " AND ".join(f"{c} = ?" for c in columns)
            cursor = conn.execute(f"SELECT * FROM main.{table} WHERE {where}", pk)
            found = cursor.fetchone()
            key = (self.base + row_key(table, pk)).encode()
            if found is None:
                ops.append(Delete(key))
            else:
                names = [d[0] for d in cursor.description]
                value = json.dumps(dict(zip(names, found, strict=True)), separators=(",", ":"))
                ops.append(Put(key, value.encode()))
            tables.add(table)
        for table in SEQUENCED:
            if table in tables:
                seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", (table,))
                row = seq.fetchone()
                if row is not None:
                    key = (self.base + "sequence/" + table).encode()
                    ops.append(Put(key, str(int(row[0])).encode()))
        self._pending.append(ops)

    # -- leading and loading ------------------------------------------------------------------

    async def lead(self, fence: Fence) -> None:
        """Become the writer: load the mirror fresh from etcd; every later write carries
        ``fence``. Raises ``StoreUnavailable`` if etcd cannot be read, or its state is newer."""
        self.leading = False
        self._pending.clear()
        await self.load()
        self.fence = fence
        self.leading = True

    def follow(self) -> None:
        """No longer the writer: pending writes are dropped (the next leader decides again)."""
        self.leading = False
        self.fence = None
        self.stale = True
        self._pending.clear()

    async def load(self) -> int:
        """Replace the mirror with what etcd holds under the prefix, at one revision."""
        self.stale = True
        try:
            self.requests += 1
            kvs, revision = await self.client.get(self.base.encode(), prefix=True)
        except EtcdUnavailable as e:
            self._unreachable(e)
            raise StoreUnavailable(f"etcd is unreachable: {e}", reason=str(e)) from e
        self._reached()
        rows: dict[str, list[tuple[str, ...] | dict[str, Any]]] = {}
        sequences: dict[str, int] = {}
        version = 0
        for kv in kvs:
            key = kv.key.decode()[len(self.base) :]
            if key == "schema_version":
                version = int(kv.value)
            elif key.startswith("sequence/"):
                sequences[key.removeprefix("sequence/")] = int(kv.value)
            elif split_key(key) is not None:
                rows.setdefault(key.partition("/")[0], []).append(json.loads(kv.value))
        if version > SCHEMA_VERSION:
            raise StoreUnavailable(
                f"the cluster's state under {self.base} is at schema version {version},"
                f" newer than this gateway ({SCHEMA_VERSION})",
                reason="schema version",
            )
        self._replace(rows, sequences)
        if version < SCHEMA_VERSION:
            self.requests += 1
            await self._send([Put((self.base + "schema_version").encode(), b"%d" % SCHEMA_VERSION)])
        self.etcd_revision = revision
        self.stale = False
        return revision

    def _replace(self, rows: dict[str, list[Any]], sequences: dict[str, int]) -> None:
        with self._read() as conn:
            conn.execute("PRAGMA foreign_keys = OFF")
            self._applying = True
            try:
                conn.execute("BEGIN IMMEDIATE")
                for table in PRIMARY_KEYS:
                    conn.execute(f"DELETE FROM main.{table}")
                for table, items in rows.items():
                    for item in items:
                        columns = list(item)
                        conn.execute(
                            f"INSERT INTO main.{table} ({', '.join(columns)})"
                            f" VALUES ({', '.join('?' for _ in columns)})",
                            [item[c] for c in columns],
                        )
                conn.execute("DELETE FROM sqlite_sequence")
                for table in SEQUENCED:
                    ids = conn.execute(f"SELECT max(id) FROM main.{table}").fetchone()[0] or 0
                    seq = max(ids, sequences.get(table, 0))
                    if seq:
                        conn.execute(
                            "INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", (table, seq)
                        )
                conn.execute("DELETE FROM changes")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            finally:
                self._applying = False
                conn.execute("PRAGMA foreign_keys = ON")
        self._since_trim.clear()

    # -- flushing -----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> None:
        """Send the pending writes, in order (see the module docstring for the outcomes)."""
        while self._pending:
            if not self.leading or self.fence is None:
                self._pending.clear()
                raise Deposed("this node does not lead: its pending writes were dropped")
            ops: dict[bytes, Op] = {}
            taken = 0
            for write in self._pending:
                merged = {**ops}
                for op in write:  # a key written twice goes once, as its last write left it
                    merged.pop(op.key, None)
                    merged[op.key] = op
                if ops and len(merged) > MAX_OPS:
                    break
                ops = merged
                taken += 1
            batch = list(ops.values())
            await self._send(batch[:MAX_OPS])
            if len(batch) > MAX_OPS:  # one write bigger than a transaction: the rest next
                self._pending[0] = batch[MAX_OPS:]
                continue
            del self._pending[:taken]

    async def _send(self, ops: list[Op]) -> None:
        try:
            fence = list(self.fence()) if self.fence is not None else []
        except Deposed:
            self._deposed()
            raise
        try:
            self.requests += 1
            result = await self.client.txn(fence, ops)
        except EtcdUnavailable as e:
            self._unreachable(e)
            raise StoreUnavailable(
                f"etcd is unreachable; {len(self._pending)} writes wait: {e}", reason=str(e)
            ) from e
        self._reached()
        if not result.succeeded:
            self._deposed()
            raise Deposed("another node leads: this node's writes were refused (fence)")
        self.etcd_revision = result.revision

    def _deposed(self) -> None:
        self.follow()

    def _unreachable(self, error: Exception) -> None:
        self.connected = False
        self.unreachable = str(error)

    def _reached(self) -> None:
        self.connected = True
        self.unreachable = ""

    def __repr__(self) -> str:
        return (
            f"EtcdStore(prefix={self.base!r}, leading={self.leading}, stale={self.stale},"
            f" pending={len(self._pending)}, requests={self.requests},"
            f" revision={self.etcd_revision})"
        )


__all__ = ["MAX_OPS", "PRIMARY_KEYS", "EtcdStore", "row_key", "split_key"]
