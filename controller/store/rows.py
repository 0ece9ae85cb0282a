"""The store's rows: one frozen dataclass per table, the columns they are read from, and the
rollout kinds and statuses the tables accept.

A row is a snapshot of what was committed; the store never hands out a live cursor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from controller.planning.model import RolloutKind

RolloutStatus = Literal[
    "progressing", "paused", "complete", "failed", "aborted", "superseded", "rolled_back"
]
ROLLOUT_KINDS: Final[tuple[str, ...]] = get_args(RolloutKind)
ROLLOUT_STATUSES: Final[tuple[str, ...]] = get_args(RolloutStatus)
ACTIVE_STATUSES: Final = ("progressing", "paused")
FINISHED_STATUSES: Final = ("complete", "failed", "aborted", "rolled_back")
"""What ``finish_rollout`` accepts; ``superseded`` is set only by a newer rollout."""


def sql_list(values: Sequence[str]) -> str:
    """``'a', 'b'``: constant strings for an ``IN (...)`` (never values from a caller)."""
    return ", ".join(f"'{v}'" for v in values)


@dataclass(frozen=True, slots=True)
class ServiceRow:
    name: str
    spec_json: str
    serving_revision: int | None
    target_revision: int | None
    desired_replicas: int
    paused: bool
    deleted: bool
    updated_at: float


@dataclass(frozen=True, slots=True)
class RevisionRow:
    service: str
    number: int
    template_key: str
    spec_json: str
    created_at: float


@dataclass(frozen=True, slots=True)
class RolloutRow:
    id: int
    service: str
    from_revision: int | None
    to_revision: int
    kind: RolloutKind
    status: RolloutStatus
    reason: str
    retries_used: int
    started_at: float
    finished_at: float | None
    strategy_json: str | None = None
    """How it moves, as ``controller.planning.model.strategy_state`` writes it; None: not kept."""

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_STATUSES


@dataclass(frozen=True, slots=True)
class EventRow:
    id: int
    at: float
    service: str
    kind: str
    message: str
    revision: int | None
    replica: str | None


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    service: str
    replica_id: str
    revision: int
    backend: str
    handle_json: str
    created_at: float


@dataclass(frozen=True, slots=True)
class TokenRow:
    """A bearer token of a service, added through the admin API: its digest, never itself."""

    id: str
    service: str
    digest: str
    """SHA-256 of the token, hex."""
    label: str
    created_at: float


@dataclass(frozen=True, slots=True)
class ConfigAppliedRow:
    """The document last applied to a service from the gateway config, and from where."""

    service: str
    source: str
    """The file (or the config's inline entry) it came from, as the log names it."""
    digest: str
    """sha256 of the document, as ``controller.config`` computes it."""
    applied_at: float


SERVICE_COLS: Final = (
    "name, spec_json, serving_revision, target_revision, desired_replicas, paused, deleted,"
    " updated_at"
)
REVISION_COLS: Final = "service, number, template_key, spec_json, created_at"
ROLLOUT_COLS: Final = (
    "id, service, from_revision, to_revision, kind, status, reason, retries_used, started_at,"
    " finished_at, strategy_json"
)
EVENT_COLS: Final = "id, at, service, kind, message, revision, replica"
REPLICA_COLS: Final = "service, replica_id, revision, backend, handle_json, created_at"
TOKEN_COLS: Final = "id, service, digest, label, created_at"


def service_row(r: Sequence[Any]) -> ServiceRow:
    return ServiceRow(r[0], r[1], r[2], r[3], r[4], bool(r[5]), bool(r[6]), r[7])


def revision_row(r: Sequence[Any]) -> RevisionRow:
    return RevisionRow(*r)


def rollout_row(r: Sequence[Any]) -> RolloutRow:
    return RolloutRow(*r)


def event_row(r: Sequence[Any]) -> EventRow:
    return EventRow(*r)


def replica_row(r: Sequence[Any]) -> ReplicaRow:
    return ReplicaRow(*r)
