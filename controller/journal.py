"""The journal: every transition, written to the store's event log and fanned out live.

Watchers (the admin API's server-sent events, the CLI following a rollout) subscribe with a
bounded queue; a watcher that does not keep up loses its oldest entries, never blocks the
controller. A store that cannot be written costs the log entry, not the transition.

The journal keeps the last ``HISTORY`` entries, so that a watcher that comes back (SSE's
``Last-Event-ID``) gets those it missed. Listeners (the metrics) hear each entry as it is
recorded, synchronously. Following a pool (``follow``), it records the data plane's health
transitions too: an upstream turning healthy or unhealthy, ejected or back from ejection,
whether or not the controller's view of the replica changes with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway import Health, Pool, PoolEvent

from .errors import StoreUnavailable
from .planning.model import EventKind, Replica
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


HISTORY = 1000
"""Entries kept for watchers that come back (``since``)."""

HealthKind = Literal[
    "upstream_healthy", "upstream_unhealthy", "upstream_ejected", "upstream_ejection_ended"
]
Listener = Callable[[Entry], None]


@dataclass(frozen=True, slots=True)
class HealthNote:
    """A health transition of one upstream, as the journal records it."""

    kind: HealthKind
    message: str
    revision: int
    upstream: str


def health_note(event: PoolEvent) -> HealthNote | None:
    """The health transition ``event`` is, if any: a change of an upstream's probed health
    (to healthy or unhealthy) or of its ejection. Drains, additions and removals are not."""
    new, old = event.upstream, event.previous
    if event.kind != "changed" or new is None or old is None:
        return None
    reason = f": {event.reason}" if event.reason else ""
    if new.health is not old.health and new.health is not Health.UNKNOWN:
        kind: HealthKind = (
            "upstream_healthy" if new.health is Health.HEALTHY else "upstream_unhealthy"
        )
        message = f"upstream {new.id} {old.health.value} -> {new.health.value}{reason}"
    elif new.ejected and not old.ejected:
        why = event.reason.removeprefix("ejected: ")
        kind, message = "upstream_ejected", f"upstream {new.id} ejected: {why or 'outlier'}"
    elif old.ejected and not new.ejected:
        kind, message = "upstream_ejection_ended", f"upstream {new.id} back from ejection"
    else:
        return None
    return HealthNote(kind, message, new.revision, new.id)


class Journal:
    def __init__(
        self, store: Store, wall_clock: Callable[[], float], history: int = HISTORY
    ) -> None:
        self._store = store
        self._wall = wall_clock
        self._watchers: set[asyncio.Queue[Entry]] = set()
        self._history: deque[Entry] = deque(maxlen=history)
        self._listeners: list[Listener] = []
        self._followed: list[Pool] = []
        self._fallback_id = 0
        self.persist = True
        """False on a cluster node that does not lead: only the leader writes the state, so
        what this node sees (its own probes' verdicts) is logged and streamed, not stored."""

    def record(
        self,
        service: str,
        kind: EventKind,
        message: str,
        revision: int | None = None,
        replica: str | None = None,
    ) -> Entry:
        log.info("%s: %s", service, message)
        row = None
        if self.persist:
            try:
                row = self._store.add_event(service, kind, message, revision, replica)
            except StoreUnavailable as e:
                log.warning("event not persisted (%s): %s", e.message, message)
        if row is not None:
            entry = Entry(row.id, row.at, service, kind, message, revision, replica)
        else:
            self._fallback_id -= 1
            entry = Entry(
                self._fallback_id, self._wall(), service, kind, message, revision, replica
            )
        self._history.append(entry)
        for listener in list(self._listeners):
            try:
                listener(entry)
            except Exception:  # a listener's bug must not cost the controller a transition
                log.exception("journal listener %r failed on %s", listener, entry.kind)
        for queue in list(self._watchers):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(entry)
        return entry

    def replica(self, service: str, kind: EventKind, replica: Replica, message: str) -> Entry:
        """An entry about one replica: ``message`` follows ``replica <id>``."""
        return self.record(
            service, kind, f"replica {replica.id} {message}", replica.revision, replica.id
        )

    def since(self, last_id: int) -> list[Entry]:
        """The entries recorded after the one with id ``last_id`` that the history still
        holds (all it holds if that one is older than them all)."""
        entries = list(self._history)
        for i, entry in enumerate(entries):
            if entry.id == last_id:
                return entries[i + 1 :]
        return [e for e in entries if e.id > last_id]

    def listen(self, listener: Listener) -> None:
        """Call ``listener`` with each entry as it is recorded (on the loop; it must not
        block, and what it raises is logged)."""
        self._listeners.append(listener)

    def follow(self, pool: Pool) -> None:
        """Record ``pool``'s health transitions (once, however often it is called)."""
        if not any(p is pool for p in self._followed):
            self._followed.append(pool)
            pool.subscribe(self)

    def on_pool_event(self, event: PoolEvent) -> None:
        """``gateway.PoolSubscriber``: a health transition becomes an entry."""
        note = health_note(event)
        if note is not None:
            self.record(event.service, note.kind, note.message, note.revision, note.upstream)

    def watch(self, maxsize: int = 1000) -> asyncio.Queue[Entry]:
        queue: asyncio.Queue[Entry] = asyncio.Queue(maxsize)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[Entry]) -> None:
        self._watchers.discard(queue)

    def __repr__(self) -> str:
        return (
            f"<Journal watchers={len(self._watchers)} history={len(self._history)}"
            f" listeners={len(self._listeners)}>"
        )
