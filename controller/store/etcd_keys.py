"""The store's key layout in etcd: one key per row, plus the AUTOINCREMENT counters.

Under ``<prefix>state/`` (the prefix ends with ``/``), values JSON or a decimal integer:

- ``<table>/<primary key>`` → the row, ``{column: value}`` (every column, SQL NULL as ``null``).
  The primary key is its columns' values in the table's key order, each ``str()``-ed and
  percent-encoded with no safe character (``/`` becomes ``%2F``), joined by ``/``:
  ``services/web``, ``revisions/web/3``, ``replicas/web/web-3-a1b2``, ``events/1042``.
  Tables and their keys: ``PRIMARY_KEYS``.
- ``sequence/<table>`` → the last id AUTOINCREMENT gave (``rollouts``, ``events``), so ids are
  never reused after a reload, even when the highest rows were deleted (trimmed events).
- ``schema_version`` → the store's schema version when the prefix was created or upgraded; a
  prefix at a newer version is refused, as a newer SQLite file is.

Nothing else of the store lives under ``state/``; other keys under the prefix (leader, nodes,
pools) are not the store's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final
from urllib.parse import quote, unquote

PRIMARY_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "services": ("name",),
    "revisions": ("service", "number"),
    "rollouts": ("id",),
    "events": ("id",),
    "replicas": ("service", "replica_id"),
    "config_applied": ("service",),
    "tokens": ("id",),
}
SEQUENCED: Final = ("rollouts", "events")
"""Tables whose ids come from AUTOINCREMENT: their counter has a key of its own."""
STATE: Final = "state/"
SCHEMA_VERSION_KEY: Final = "schema_version"
SEQUENCE: Final = "sequence/"


def row_key(table: str, pk: Sequence[object]) -> str:
    """The key of a row, relative to ``<prefix>state/``."""
    return table + "/" + "/".join(quote(str(v), safe="") for v in pk)


def split_key(key: str) -> tuple[str, tuple[str, ...]] | None:
    """``(table, primary key parts as text)`` of a row key relative to ``<prefix>state/``, or
    ``None`` if the key is not a row's (a counter, the schema version, an unknown table)."""
    table, _, rest = key.partition("/")
    if table not in PRIMARY_KEYS:
        return None
    parts = tuple(unquote(p) for p in rest.split("/"))
    return (table, parts) if len(parts) == len(PRIMARY_KEYS[table]) else None


def encode_row(columns: Sequence[str], values: Sequence[object]) -> bytes:
    return json.dumps(dict(zip(columns, values, strict=True)), separators=(",", ":")).encode()


def decode_row(value: bytes) -> dict[str, object]:
    row = json.loads(value)
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, not {type(row).__name__}")
    return row


__all__ = [
    "PRIMARY_KEYS",
    "SCHEMA_VERSION_KEY",
    "SEQUENCE",
    "SEQUENCED",
    "STATE",
    "decode_row",
    "encode_row",
    "row_key",
    "split_key",
]
