"""The store in etcd, for a cluster: the SQLite store's rows and rules on an in-memory mirror.

``EtcdStore`` is the SQLite ``Store`` over an in-memory database with the same schema, the
**mirror**: reads, and the validation of writes (``NotFound``, ``Conflict``, revision numbering,
one active rollout, foreign keys), are exactly the SQLite store's. The key layout is in
``etcd_keys``, the rows' way between the mirror and etcd in ``etcd_rows``.

- **Writer** (``lead``): the node that leads loads the mirror fresh from one consistent read
  and alone writes while it leads. Each write transaction's changed rows (captured by temporary
  triggers) become one pending etcd transaction in the outbox (``etcd_outbox``). A write is
  decided locally and durable after ``flush``, which sends the pending writes in order, as few
  transactions as fit etcd's limits, each carrying the leader's fence; a write is never cut
  in two. A write bigger than one transaction (``MAX_OPS`` rows, ``MAX_BYTES``) is refused
  with ``WriteTooLarge`` and rolled back in the mirror; event trimming deletes at most
  ``TRIM_PER_WRITE`` events a write, so adding an event always fits. Outcomes:

  - committed: nothing pending;
  - the fence failed (another node leads): every pending write is dropped, the mirror is stale
    (no write until the next ``lead``), ``Deposed`` is raised;
  - etcd unreachable: the pending writes stay, in order, ``StoreUnavailable`` says why; the
    next flush sends them again (puts of whole rows: sending twice is harmless).

- **Follower** (``watch``): a node that does not lead keeps its mirror up to date from a watch
  of the prefix, from the revision it loaded, and hears which tables changed by ``on_change``;
  it applies nothing while it leads. A compacted watch, or a mirror made stale, loads again.
  A write on a node that does not lead raises ``StoreUnavailable``.

One lock (``database.lock``) serialises the mirror, which any thread may read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from controller.errors import Deposed, StoreUnavailable
from controller.etcd import (
    Compacted,
    Compare,
    EtcdClient,
    EtcdUnavailable,
    Op,
    Put,
    WatchEvent,
)

from . import ConfigAppliedRow, Store
from .etcd_keys import (
    PRIMARY_KEYS,
    SCHEMA_VERSION_KEY,
    SEQUENCE,
    SEQUENCED,
    STATE,
    decode_row,
    row_key,
    split_key,
)
from .etcd_outbox import MAX_BYTES, MAX_OPS, Outbox
from .etcd_rows import captured_ops, install_capture, put_row, set_sequence
from .migrations import SCHEMA_VERSION

log = logging.getLogger(__name__)

Fence = Callable[[], Sequence[Compare]]
TRIM_PER_WRITE = MAX_OPS - 8
"""Events a trim deletes in one write at most: the rest go with the next trims (the event added
and the counter take two operations of the transaction)."""
OnChange = Callable[[set[str]], None]


class EtcdStore(Store):
    """See the module docstring. ``lead`` before writing; ``flush`` to make writes durable;
    ``watch`` (a task) to follow while not leading."""

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
        self.base = prefix + STATE
        self.fence: Fence | None = None
        self.leading = False
        self.stale = True
        """The mirror is not the state (never loaded, or a fence failed)."""
        self.connected = True
        """The last etcd call succeeded."""
        self.unreachable = ""
        """Why the last etcd call failed (empty after one succeeded)."""
        self.requests = 0
        self.etcd_revision = 0
        """The etcd revision the mirror is known to be at."""
        self._outbox = Outbox()
        self._applying = False
        self._capturing = False
        self._loads = 0
        self._wake = asyncio.Event()
        self._flushing = asyncio.Lock()
        super().__init__(
            Path(":memory:"),
            clock,
            max_events_per_service=max_events_per_service,
            trim_every=trim_every,
            trim_per_write=TRIM_PER_WRITE,
        )
        with self.database.read() as conn:
            install_capture(conn)
        self._capturing = True

    # -- capture ------------------------------------------------------------------------------

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
        ops = captured_ops(conn, changed, self.base)
        refused = self._outbox.refusal(ops)
        if refused is not None:
            raise refused  # rolls the transaction back: the mirror stays as etcd holds it
        self._outbox.append(ops)

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

    # -- leading and loading ------------------------------------------------------------------

    async def lead(self, fence: Fence) -> None:
        """Become the writer: load the mirror fresh from etcd; every later write carries
        ``fence``. Raises ``StoreUnavailable`` if etcd cannot be read, or its state is newer."""
        self.leading = False
        with self.database.lock:
            self._outbox.clear()
        self.fence = fence
        try:
            await self._load(record_version=True)
        except BaseException:
            self.fence = None
            raise
        self.leading = True

    def follow(self) -> None:
        """No longer the writer: pending writes are dropped (the next leader decides again),
        the mirror is stale; a running ``watch`` loads it again."""
        self.leading = False
        self.fence = None
        self.stale = True
        with self.database.lock:
            self._outbox.clear()
        self._wake.set()

    async def load(self) -> int:
        """Replace the mirror with what etcd holds under the prefix, at one revision, and
        return that revision. Raises ``StoreUnavailable`` if etcd cannot be read, or its state
        is newer than this gateway."""
        return await self._load(record_version=False)

    async def _load(self, *, record_version: bool) -> int:
        """``load``; the writer (``record_version``) also records the schema version, fenced,
        under a new or older prefix."""
        self._loads += 1
        number = self._loads
        self.stale = True
        try:
            self.requests += 1
            kvs, revision = await self.client.get(self.base.encode(), prefix=True)
        except EtcdUnavailable as e:
            self._unreachable(e)
            raise StoreUnavailable(f"etcd is unreachable: {e}", reason=str(e)) from e
        self._reached()
        if number != self._loads:  # a later load began meanwhile: it decides
            return revision
        rows: dict[str, list[dict[str, object]]] = {}
        sequences: dict[str, int] = {}
        version = 0
        for kv in kvs:
            key = kv.key.decode()[len(self.base) :]
            if key == SCHEMA_VERSION_KEY:
                version = int(kv.value)
            elif key.startswith(SEQUENCE):
                sequences[key.removeprefix(SEQUENCE)] = int(kv.value)
            elif split_key(key) is not None:
                rows.setdefault(key.partition("/")[0], []).append(decode_row(kv.value))
        _check_version(version, self.base)
        with self._applying_transaction() as conn:
            for table in PRIMARY_KEYS:
                conn.execute(f"DELETE FROM main.{table}")
            for table, items in rows.items():
                for item in items:
                    put_row(conn, table, item)
            conn.execute("DELETE FROM sqlite_sequence")
            for table in SEQUENCED:
                ids = conn.execute(f"SELECT max(id) FROM main.{table}").fetchone()[0] or 0
                set_sequence(conn, table, max(ids, sequences.get(table, 0)))
        self._since_trim.clear()
        self.etcd_revision = revision
        if record_version and version < SCHEMA_VERSION:
            version_key = (self.base + SCHEMA_VERSION_KEY).encode()
            await self._send([Put(version_key, b"%d" % SCHEMA_VERSION)])
        self.stale = False
        return revision

    @contextlib.contextmanager
    def _applying_transaction(self) -> Iterator[sqlite3.Connection]:
        """A transaction on the mirror of what etcd already holds: not captured, and with
        foreign keys off (rows arrive in any order; etcd's state is consistent as a whole)."""
        with self.database.read() as conn:
            conn.execute("PRAGMA foreign_keys = OFF")
            self._applying = True
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("DELETE FROM changes")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            finally:
                self._applying = False
                conn.execute("PRAGMA foreign_keys = ON")

    async def applied_config(self) -> tuple[list[ConfigAppliedRow], set[str]]:
        """What the cluster applied from gateway configs (``config_applied`` rows) and the
        names of its live services, read from etcd at one revision; the mirror is untouched,
        so a node that does not lead may ask. Raises ``StoreUnavailable`` if etcd cannot be
        read."""
        try:
            self.requests += 1
            kvs, _ = await self.client.get(self.base.encode(), prefix=True)
        except EtcdUnavailable as e:
            self._unreachable(e)
            raise StoreUnavailable(f"etcd is unreachable: {e}", reason=str(e)) from e
        self._reached()
        applied: list[ConfigAppliedRow] = []
        live: set[str] = set()
        for kv in kvs:
            parsed = split_key(kv.key.decode()[len(self.base) :])
            if parsed is None or parsed[0] not in ("config_applied", "services"):
                continue
            row = decode_row(kv.value)
            if parsed[0] == "services":
                if not row.get("deleted"):
                    live.add(str(row["name"]))
            else:
                applied.append(
                    ConfigAppliedRow(
                        str(row["service"]),
                        str(row["source"]),
                        str(row["digest"]),
                        float(row["applied_at"]),  # type: ignore[arg-type]
                    )
                )
        return applied, live

    # -- following ----------------------------------------------------------------------------

    async def watch(self, on_change: OnChange, *, retry: float = 1.0) -> None:
        """A follower's task, until cancelled: keep the mirror at etcd's state by a watch of
        the prefix and call ``on_change(tables)`` after each batch applied (all tables after a
        load); an exception from ``on_change`` ends the task. Idle while this node leads; loads
        again after a compaction or ``follow`` (which must be called on this loop). etcd
        unreachable: ``connected`` is false and the watch is opened again every ``retry``."""
        while True:
            if self.leading:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                if self.stale:
                    await self.load()
                    on_change(set(PRIMARY_KEYS))
                await self._watch_once(on_change)
            except Compacted as e:
                log.info("state watch compacted at %d: loading again", e.revision)
                self.stale = True
            except (StoreUnavailable, EtcdUnavailable) as e:
                if isinstance(e, Deposed):
                    raise
                self._unreachable(e)
                await asyncio.sleep(retry)

    async def _watch_once(self, on_change: OnChange) -> None:
        stream = self.client.watch(
            self.base.encode(), prefix=True, start_revision=self.etcd_revision + 1
        )
        try:
            async for events in stream:
                self._reached()
                if self.leading or self.stale:
                    return
                tables = self._apply(events)
                if tables:
                    on_change(tables)
        finally:
            await _aclose(stream)

    def _apply(self, events: Iterable[WatchEvent]) -> set[str]:
        """Apply a watch batch to the mirror; the tables it changed."""
        tables: set[str] = set()
        with self._applying_transaction() as conn:
            for event in events:
                self.etcd_revision = max(self.etcd_revision, event.kv.mod_revision)
                key = event.kv.key.decode()[len(self.base) :]
                if key == SCHEMA_VERSION_KEY:
                    if event.type == "PUT":
                        _check_version(int(event.kv.value), self.base)
                    continue
                if key.startswith(SEQUENCE):
                    table = key.removeprefix(SEQUENCE)
                    if table in SEQUENCED and event.type == "PUT":
                        set_sequence(conn, table, int(event.kv.value))
                    continue
                parsed = split_key(key)
                if parsed is None:
                    continue
                table, pk = parsed
                if event.type == "PUT":
                    put_row(conn, table, decode_row(event.kv.value))
                else:
                    where = " AND ".join(f"{c} = ?" for c in PRIMARY_KEYS[table])
                    conn.execute(f"DELETE FROM main.{table} WHERE {where}", pk)
                tables.add(table)
        return tables

    # -- flushing -----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Writes decided locally and not yet in etcd."""
        return len(self._outbox)

    async def flush(self) -> None:
        """Send the pending writes, in order (see the module docstring for the outcomes).
        Flushes run one at a time: a second waits, then sends what is still pending."""
        async with self._flushing:
            while True:
                with self.database.lock:  # writes append to the outbox from any thread
                    batch = self._outbox.batch()
                    if batch is None:
                        return
                    if not self.leading or self.fence is None:
                        self._outbox.clear()
                        raise Deposed("this node does not lead: its pending writes were dropped")
                await self._send(batch.ops)
                with self.database.lock:
                    self._outbox.committed(batch)

    async def _send(self, ops: list[Op]) -> None:
        try:
            fence = list(self.fence()) if self.fence is not None else []
        except Deposed:
            self.follow()
            raise
        try:
            self.requests += 1
            result = await self.client.txn(fence, ops)
        except EtcdUnavailable as e:
            self._unreachable(e)
            raise StoreUnavailable(
                f"etcd is unreachable; {len(self._outbox)} writes wait: {e}", reason=str(e)
            ) from e
        self._reached()
        if not result.succeeded:
            self.follow()
            raise Deposed("another node leads: this node's writes were refused (fence)")
        self.etcd_revision = result.revision

    def _unreachable(self, error: Exception) -> None:
        self.connected = False
        self.unreachable = str(error)

    def _reached(self) -> None:
        self.connected = True
        self.unreachable = ""

    def __repr__(self) -> str:
        return (
            f"EtcdStore(prefix={self.base!r}, leading={self.leading}, stale={self.stale},"
            f" connected={self.connected},"
            f" pending={len(self._outbox)}, requests={self.requests},"
            f" revision={self.etcd_revision})"
        )


def _check_version(version: int, base: str) -> None:
    if version > SCHEMA_VERSION:
        raise StoreUnavailable(
            f"the cluster's state under {base} is at schema version {version},"
            f" newer than this gateway ({SCHEMA_VERSION})",
            reason="schema version",
        )


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


__all__ = [
    "MAX_BYTES",
    "MAX_OPS",
    "PRIMARY_KEYS",
    "TRIM_PER_WRITE",
    "EtcdStore",
    "Fence",
    "row_key",
    "split_key",
]
