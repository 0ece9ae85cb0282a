"""The outbox: the writes decided locally and not yet in etcd, in order, cut into transactions.

Each write is the list of operations of one SQLite transaction. ``batch`` takes, from the head,
as many consecutive writes as fit one etcd transaction (``MAX_OPS`` operations, ``MAX_BYTES`` of
keys and values, a key written twice sent once as its last write left it: etcd refuses a key
twice in one transaction); ``committed`` removes what was sent. A write is never cut: each is
sent whole in one transaction, so it is atomic in etcd. ``refusal`` says why a write cannot be
(the store refuses it before it is applied anywhere).

Pure: no I/O, no clock. The store sends the batches and decides what a failure does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from controller.errors import WriteTooLarge
from controller.etcd import Op, Put

MAX_OPS: Final = 128
"""Operations per etcd transaction (etcd's ``--max-txn-ops``, 128 by default)."""
MAX_BYTES: Final = 1024 * 1024
"""Keys and values per transaction: etcd's ``--max-request-bytes`` is 1.5 MiB by default,
counted on the encoded request; a quarter of it is left for the encoding and the fence."""


def op_size(op: Op) -> int:
    return len(op.key) + (len(op.value) if isinstance(op, Put) else 0)


@dataclass(frozen=True)
class Batch:
    ops: list[Op]
    writes: int
    """The writes it holds, whole."""
    epoch: int
    """The outbox's ``clear`` count when it was taken: a batch taken before a clear is void."""


class Outbox:
    def __init__(self, max_ops: int = MAX_OPS, max_bytes: int = MAX_BYTES) -> None:
        self.max_ops = max_ops
        self.max_bytes = max_bytes
        self._writes: list[list[Op]] = []
        self._epoch = 0

    def __len__(self) -> int:
        return len(self._writes)

    def append(self, ops: list[Op]) -> None:
        if ops:
            self._writes.append(ops)

    def clear(self) -> None:
        self._writes.clear()
        self._epoch += 1

    def fits(self, ops: dict[bytes, Op]) -> bool:
        return len(ops) <= self.max_ops and sum(map(op_size, ops.values())) <= self.max_bytes

    def refusal(self, write: list[Op]) -> WriteTooLarge | None:
        """Why ``write`` cannot be one transaction, or ``None`` when it can."""
        ops = _dedup(write)
        if len(ops) > self.max_ops:
            return WriteTooLarge(
                f"this write would be {len(ops)} operations in one etcd transaction, more"
                f" than etcd takes ({self.max_ops}, its --max-txn-ops): refused, nothing"
                " of it applied",
                "operations",
                len(ops),
                self.max_ops,
            )
        size = sum(map(op_size, ops.values()))
        if size > self.max_bytes:
            return WriteTooLarge(
                f"this write would be {size} bytes in one etcd transaction, more than the"
                f" store sends in one ({self.max_bytes}, under etcd's --max-request-bytes):"
                " refused, nothing of it applied",
                "bytes",
                size,
                self.max_bytes,
            )
        return None

    def batch(self) -> Batch | None:
        """The next transaction to send, or ``None`` when nothing is pending."""
        if not self._writes:
            return None
        ops: dict[bytes, Op] = {}
        taken = 0
        for write in self._writes:
            merged = dict(ops)
            for op in write:
                merged.pop(op.key, None)  # re-inserted last: the order of the last writes
                merged[op.key] = op
            if not self.fits(merged):
                break
            ops = merged
            taken += 1
        if taken:
            return Batch(list(ops.values()), taken, self._epoch)
        # A head write that does not fit alone was let in despite ``refusal``: sent whole all
        # the same, etcd refuses it whole.
        return Batch(list(_dedup(self._writes[0]).values()), 1, self._epoch)

    def committed(self, batch: Batch) -> None:
        """``batch`` is in etcd: drop it from the head (unless the outbox was cleared since)."""
        if batch.epoch != self._epoch:
            return
        del self._writes[: batch.writes]


def _dedup(write: list[Op]) -> dict[bytes, Op]:
    ops: dict[bytes, Op] = {}
    for op in write:
        ops.pop(op.key, None)
        ops[op.key] = op
    return ops


__all__ = ["MAX_BYTES", "MAX_OPS", "Batch", "Outbox", "op_size"]
