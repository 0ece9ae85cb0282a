"""The store's database: the one SQLite connection, its transactions, and its errors.

- Every write is one ``BEGIN IMMEDIATE`` transaction (``write``): committed whole, or rolled
  back whole. WAL with ``synchronous=FULL``: a write that returned is durable.
- SQLite errors are translated here, once: a database that cannot be opened or written
  (read-only, disk full, I/O error, locked past ``busy_timeout``, not a database) raises
  ``StoreUnavailable`` with the reason; a broken constraint ``Conflict``.
- Opening migrates the file to ``SCHEMA_VERSION``; a read-only file must already be there.

One lock (``lock``) serialises the connection, which any thread may use. The store reaches
the tables only through ``read`` and ``write``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from controller.errors import Conflict, StoreUnavailable

from . import migrations

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


class Database:
    """The connection to the store's file, opened and migrated; closed by ``close``.

    ``readonly=True`` opens the file with SQLite's ``mode=ro``: reads work, every write raises
    ``StoreUnavailable``, and a file that needs a migration is refused. ``committing`` is
    called in each write transaction before its COMMIT; raising rolls it back.
    """

    def __init__(
        self,
        path: Path,
        clock: Callable[[], float],
        *,
        readonly: bool = False,
        busy_timeout: float = 5.0,
        committing: Callable[[sqlite3.Connection], None] | None = None,
    ) -> None:
        self.path = path
        self.readonly = readonly
        self._clock = clock
        self._committing = committing
        self.lock = threading.RLock()
        self.closed = False
        self.writes = 0
        """Transactions committed by this instance."""
        self.failed_writes = 0
        self.journal_mode = ""
        self._conn = self._connect(busy_timeout)
        try:
            self._migrate()
        except BaseException:
            self.close()
            raise

    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        if self.readonly:
            target, uri = self.path.resolve().as_uri() + "?mode=ro", True
        else:
            target, uri = str(self.path), False
        with self._translating():
            # isolation_level=None: no implicit transactions; write opens them explicitly, so
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
    def read(self) -> Iterator[sqlite3.Connection]:
        with self.lock:
            if self.closed:
                raise StoreUnavailable("the store is closed", reason="closed", path=str(self.path))
            with self._translating():
                yield self._conn

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One transaction: committed whole, or rolled back whole and the error translated."""
        with self.read() as conn:
            # IMMEDIATE takes the write lock up front: reads inside see what the write is based on.
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                if self._committing is not None:
                    self._committing(conn)
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
            with self.read() as conn:
                version = migrations.version(conn)
            if version != migrations.SCHEMA_VERSION:
                raise StoreUnavailable(
                    f"read-only state database {self.path} is at schema version {version},"
                    f" this controller needs {migrations.SCHEMA_VERSION}",
                    reason="schema version",
                    path=str(self.path),
                )
            return
        with self.write() as conn:
            conn.execute(migrations.CREATE_VERSION_TABLE)
            version = migrations.version(conn)
            if version > migrations.SCHEMA_VERSION:
                raise StoreUnavailable(
                    f"state database {self.path} is at schema version {version}, newer than"
                    f" this controller ({migrations.SCHEMA_VERSION})",
                    reason="schema version",
                    path=str(self.path),
                )
            migrations.upgrade(conn, version, self._clock)

    def close(self) -> None:
        """Close the connection. Idempotent; any later call raises ``StoreUnavailable``."""
        with self.lock:
            if not self.closed:
                self.closed = True
                self._conn.close()
