"""etcd v3's JSON gateway, as values: the records and how they look on the wire.

The gateway speaks protobuf's JSON mapping: bytes are base64 strings, int64s are decimal
strings, and fields at their zero value are left out (a missing ``succeeded`` is False, a
missing ``kvs`` is empty). Everything is converted here, so the rest of the program sees
``bytes`` and ``int`` only. Pure: no I/O.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction: ``target`` of ``key`` compared to ``value``.

    A key that does not exist has version, create and mod revisions 0 (so ``CREATE EQUAL 0``
    means "absent"); ``VALUE`` takes bytes, the other targets an int."""

    key: bytes
    target: Literal["VERSION", "CREATE", "MOD", "VALUE", "LEASE"]
    result: Literal["EQUAL", "NOT_EQUAL", "GREATER", "LESS"]
    value: int | bytes


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    key: bytes
    prefix: bool = False


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    ranges: list[list[KeyValue]]
    """The kvs of each Get of the branch taken, in the order of its Gets."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["PUT", "DELETE"]
    kv: KeyValue
    """For a DELETE: the key, value ``b""`` and ``mod_revision`` the delete's revision."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(key: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``key``."""
    for i in range(len(key) - 1, -1, -1):
        if key[i] < 0xFF:
            return key[:i] + bytes([key[i] + 1])
    return b"\x00"  # every key from ``key`` on


def range_fields(key: bytes, prefix: bool) -> Json:
    fields: Json = {"key": b64(key)}
    if prefix:
        fields["range_end"] = b64(prefix_end(key))
    return fields


def header_revision(answer: Mapping[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


def key_value(raw: Mapping[str, Any]) -> KeyValue:
    return KeyValue(
        key=unb64(raw.get("key")),
        value=unb64(raw.get("value")),
        create_revision=int(raw.get("create_revision", 0)),
        mod_revision=int(raw.get("mod_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


def key_values(answer: Mapping[str, Any]) -> list[KeyValue]:
    return [key_value(kv) for kv in answer.get("kvs", ())]


_COMPARE_FIELD = {
    "VERSION": "version",
    "CREATE": "create_revision",
    "MOD": "mod_revision",
    "VALUE": "value",
    "LEASE": "lease",
}


def compare_json(compare: Compare) -> Json:
    field = _COMPARE_FIELD[compare.target]
    if compare.target == "VALUE":
        if not isinstance(compare.value, bytes):
            raise TypeError(f"a VALUE compare takes bytes, not {compare.value!r}")
        value: str = b64(compare.value)
    else:
        if isinstance(compare.value, bytes):
            raise TypeError(f"a {compare.target} compare takes an int, not bytes")
        value = str(compare.value)
    return {
        "key": b64(compare.key),
        "target": compare.target,
        "result": compare.result,
        field: value,
    }


def op_json(op: Op) -> Json:
    match op:
        case Put(key, value, lease):
            put: Json = {"key": b64(key), "value": b64(value)}
            if lease:
                put["lease"] = str(lease)
            return {"request_put": put}
        case Delete(key, prefix):
            return {"request_delete_range": range_fields(key, prefix)}
        case Get(key, prefix):
            return {"request_range": range_fields(key, prefix)}
    raise TypeError(f"not an etcd operation: {op!r}")


def txn_json(compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> Json:
    return {
        "compare": [compare_json(c) for c in compare],
        "success": [op_json(op) for op in success],
        "failure": [op_json(op) for op in failure],
    }


def txn_result(answer: Mapping[str, Any]) -> TxnResult:
    ranges = [
        key_values(response["response_range"])
        for response in answer.get("responses", ())
        if "response_range" in response
    ]
    return TxnResult(
        succeeded=bool(answer.get("succeeded", False)),
        revision=header_revision(answer),
        ranges=ranges,
    )


def watch_events(result: Mapping[str, Any]) -> list[WatchEvent]:
    events: list[WatchEvent] = []
    for raw in result.get("events", ()):
        kind: Literal["PUT", "DELETE"] = "DELETE" if raw.get("type") == "DELETE" else "PUT"
        events.append(WatchEvent(type=kind, kv=key_value(raw.get("kv", {}))))
    return events
