"""The journal: every transition, written to the store's event log and fanned out live.

Watchers (the admin API's server-sent events, the CLI following a rollout) subscribe with a
bounded queue; a watcher that does not keep up loses its oldest entries, never blocks the
controller. A store that cannot be written costs the log entry, not the transition.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .errors import StoreUnavailable
from .model import Replica
from .store import Store

log = logging.getLogger("gateway.events")


@dataclass(frozen=True, slots=True)
class Entry:
    id: int
    at: float
    service: str
    kind: str
    message: str
    revision: int | None = None
    replica: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "at": self.at,
            "service": self.service,
            "kind": self.kind,
            "message": self.message,
            "revision": self.revision,
            "replica": self.replica,
        }


class Journal:
    def __init__(self, store: Store, wall_clock: Callable[[], float]) -> None:
        self._store = store
        self._wall = wall_clock
        self._watchers: set[asyncio.Queue[Entry]] = set()
        self._fallback_id = 0

    def record(
        self,
        service: str,
        kind: str,
        message: str,
        revision: int | None = None,
        replica: str | None = None,
    ) -> Entry:
        log.info("%s: %s", service, message)
        try:
            row = self._store.add_event(service, kind, message, revision, replica)
            entry = Entry(row.id, row.at, service, kind, message, revision, replica)
        except StoreUnavailable as e:
            log.warning("event not persisted (%s): %s", e.message, message)
            self._fallback_id -= 1
            entry = Entry(
                self._fallback_id, self._wall(), service, kind, message, revision, replica
            )
        for queue in list(self._watchers):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(entry)
        return entry

    def replica(self, service: str, kind: str, replica: Replica, message: str) -> Entry:
        """An entry about one replica: ``message`` follows ``replica <id>``."""
        return self.record(
            service, kind, f"replica {replica.id} {message}", replica.revision, replica.id
        )

    def watch(self, maxsize: int = 1000) -> asyncio.Queue[Entry]:
        queue: asyncio.Queue[Entry] = asyncio.Queue(maxsize)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[Entry]) -> None:
        self._watchers.discard(queue)

    def __repr__(self) -> str:
        return f"<Journal watchers={len(self._watchers)}>"
