"""The store: the controller's durable state in one SQLite file.

It holds services (the last applied spec, the serving and target revision, the desired count),
their revisions, the rollout history, events, and the replicas the backends run; and, for each
service applied from the gateway config, the digest of the document last applied from there.
``Store`` joins one part per concept over the ``Database`` they share:

- ``database``: the connection, ``BEGIN IMMEDIATE`` transactions, SQLite errors translated
  (``StoreUnavailable``, ``Conflict``), the migration on open; ``migrations``: the versions.
- ``services``: services and revisions; ``rollouts``; ``events``; ``replicas``;
  ``config_applied``; ``tokens`` (bearer tokens added through the API, by digest).
  ``rows``: the frozen rows they return.

Invariants:

- Every write is one transaction, compound operations (``apply_revision``, ``create_rollout``,
  ``finish_rollout``, ``delete_service``) included. A crash at any moment, SIGKILL too, leaves
  either the old state or the new one; a write that returned is durable.
- A service's tokens go with it when it is deleted.
- A service's revisions are numbered 1, 2, 3... without gaps for the life of the file. A
  deleted service stays as a tombstone (``deleted``) with its revisions, rollouts and events,
  for audit and so that a re-created service continues from the highest number it ever used.
- A service has at most one active (progressing or paused) rollout. Outside a rollout,
  ``target_revision == serving_revision``.
- Foreign keys tie rollouts, replicas and the serving and target revision to existing revisions.
- A missing service, revision or rollout raises ``NotFound``.

Synchronous on purpose: writes are rare control-plane events. One lock serialises the
connection, which any thread may use (``asyncio.to_thread`` is fine). Timestamps are wall-clock
seconds from the injected ``clock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from controller.model import RolloutKind

from .config_applied import ConfigApplied
from .events import Events
from .migrations import SCHEMA_VERSION
from .replicas import Replicas
from .rollouts import Rollouts
from .rows import (
    ACTIVE_STATUSES,
    FINISHED_STATUSES,
    ROLLOUT_KINDS,
    ROLLOUT_STATUSES,
    ConfigAppliedRow,
    EventRow,
    ReplicaRow,
    RevisionRow,
    RolloutRow,
    RolloutStatus,
    ServiceRow,
    TokenRow,
)
from .services import UNSET, Services
from .tokens import Tokens


class Store(Services, Rollouts, Events, Replicas, ConfigApplied, Tokens):
    """The controller's state in one SQLite file. See the package docstring for the contract.

    ``readonly=True`` opens the file with SQLite's ``mode=ro``: reads work, every write raises
    ``StoreUnavailable``, and a file that needs a migration is refused.
    """

    def __init__(
        self,
        path: Path,
        clock: Callable[[], float] = time.time,
        *,
        readonly: bool = False,
        busy_timeout: float = 5.0,
        max_events_per_service: int = 10_000,
        trim_every: int = 100,
    ) -> None:
        self.max_events_per_service = max_events_per_service
        self._trim_every = trim_every
        self._since_trim = {}
        self.trimmed_events = 0
        super().__init__(path, clock, readonly=readonly, busy_timeout=busy_timeout)
        if not readonly:
            try:
                with self._write() as conn:
                    self._trim(conn, None)
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Store(path={str(self.path)!r}, schema_version={SCHEMA_VERSION},"
            f" journal_mode={self.journal_mode!r}, readonly={self.readonly},"
            f" writes={self.writes}, failed_writes={self.failed_writes},"
            f" trimmed_events={self.trimmed_events}, closed={self._closed})"
        )


__all__ = [
    "ACTIVE_STATUSES",
    "FINISHED_STATUSES",
    "ROLLOUT_KINDS",
    "ROLLOUT_STATUSES",
    "SCHEMA_VERSION",
    "UNSET",
    "ConfigAppliedRow",
    "EventRow",
    "ReplicaRow",
    "RevisionRow",
    "RolloutKind",
    "RolloutRow",
    "RolloutStatus",
    "ServiceRow",
    "Store",
    "TokenRow",
]
