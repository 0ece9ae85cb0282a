"""Rows between the mirror and etcd: capture (a transaction's changed rows → etcd operations)
and apply (etcd's rows → the mirror).

- ``install_capture``: temporary triggers on every table record, in the temporary table
  ``changes``, the primary key of each row an INSERT, UPDATE or DELETE touches (both keys of an
  UPDATE that changes a primary key). Temporary objects are not part of the schema and roll back
  with the transaction that wrote them.
- ``captured_ops``: each recorded row as it is at the end of the transaction: a put of the
  whole row, or a delete; and the AUTOINCREMENT counter of each sequenced table touched.
- ``put_row``, ``set_sequence``: the mirror takes a row or a counter as etcd holds it.

The key layout is ``etcd_keys``'s.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from controller.etcd import Delete, Op, Put

from .etcd_keys import PRIMARY_KEYS, SEQUENCE, SEQUENCED, encode_row, row_key


def captured_ops(conn: sqlite3.Connection, changed: list[tuple[str, str]], base: str) -> list[Op]:
    """The etcd operations that make etcd hold what the transaction left of the ``changed``
    rows (``(table, JSON array of the primary key)`` from ``changes``): a put of each row still
    there, a delete of each gone, and the counter of each sequenced table touched."""
    ops: list[Op] = []
    tables = set()
    for table, pk_json in changed:
        pk = conn.execute("SELECT value FROM json_each(?)", (pk_json,)).fetchall()
        pk_values = [v for (v,) in pk]
        columns = PRIMARY_KEYS[table]
        where = " AND ".join(f"{c} = ?" for c in columns)
        cursor = conn.execute(f"SELECT * FROM main.{table} WHERE {where}", pk_values)
        found = cursor.fetchone()
        key = (base + row_key(table, pk_values)).encode()
        if found is None:
            ops.append(Delete(key))
        else:
            ops.append(Put(key, encode_row([d[0] for d in cursor.description], found)))
        tables.add(table)
    for table in SEQUENCED:
        if table in tables:
            row = conn.execute(
                "SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)
            ).fetchone()
            if row is not None:
                key = (base + SEQUENCE + table).encode()
                ops.append(Put(key, str(int(row[0])).encode()))
    return ops


def install_capture(conn: sqlite3.Connection) -> None:
    """Temporary triggers record the primary key of every row a transaction touches."""
    conn.execute("CREATE TEMP TABLE changes (tbl TEXT NOT NULL, pk TEXT NOT NULL)")
    for table, columns in PRIMARY_KEYS.items():
        for event, row in (("INSERT", "NEW"), ("UPDATE", "NEW"), ("DELETE", "OLD")):
            pk = ", ".join(f"{row}.{c}" for c in columns)
            conn.execute(
                f"CREATE TEMP TRIGGER capture_{table}_{event.lower()} AFTER {event}"
                f" ON main.{table} BEGIN INSERT INTO changes (tbl, pk)"
                f" VALUES ('{table}', json_array({pk})); END"
            )
    # An UPDATE that changes a primary key touches two rows: the old one is gone.
    for table, columns in PRIMARY_KEYS.items():
        old = ", ".join(f"OLD.{c}" for c in columns)
        conn.execute(
            f"CREATE TEMP TRIGGER capture_{table}_rekey AFTER UPDATE ON main.{table}"
            f" BEGIN INSERT INTO changes (tbl, pk) VALUES ('{table}', json_array({old})); END"
        )


def put_row(conn: sqlite3.Connection, table: str, row: dict[str, Any]) -> None:
    columns = list(row)
    conn.execute(
        f"INSERT OR REPLACE INTO main.{table} ({', '.join(columns)})"
        f" VALUES ({', '.join('?' for _ in columns)})",
        [row[c] for c in columns],
    )


def set_sequence(conn: sqlite3.Connection, table: str, seq: int) -> None:
    updated = conn.execute(
        "UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = ?", (seq, table)
    )
    if updated.rowcount == 0 and seq:
        conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", (table, seq))


__all__ = ["captured_ops", "install_capture", "put_row", "set_sequence"]
