"""Watching: following one engine's events and deciding its reachability (``HostWatcher``).

Invariants:

- The watcher alone decides whether its host is reachable: the engine's event stream is open
  and the engine answers a heartbeat (a stopped engine keeps its sockets and says nothing). A
  call that found no engine sets the host's ``recheck``, and the watcher pings at once.
- After each (re)connection the watcher removes the containers left unremoved, lists the
  host's containers, reports the exits the stream did not show, asks again for the stops the
  engine did not answer and, once orphans are due, sweeps them. Exits it sees (``die``) it
  hands to the backend, which reports each exactly once.
- It reconnects with backoff and never stops a replica because its engine went away.
- The host listeners hear each change of the host's reachability (not its first success).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from ...tasks import guarded_task, wait_set
from .engine import EngineError, EngineUnreachable, EventStream
from .hosts import HostListener, HostRecord, ReplicaRecord
from .orphans import sweep

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "HEARTBEAT", "HEARTBEAT_TIMEOUT", "HostWatcher"]

log = logging.getLogger(__name__)

BACKOFF_FIRST, BACKOFF_MAX = 0.5, 10.0
HEARTBEAT, HEARTBEAT_TIMEOUT = 2.0, 5.0
"""While its event stream is open, an engine is pinged every HEARTBEAT seconds: one that does
not answer within HEARTBEAT_TIMEOUT (a stopped or hung process keeps its sockets open and
says nothing) is unreachable."""

Finish = Callable[[ReplicaRecord, int | None], None]
"""Reports a replica's exit (with the engine's exit code, if known); at most once per replica."""
Stop = Callable[[ReplicaRecord, float], Coroutine[Any, Any, None]]
"""Stops a replica's container within a grace period (seconds)."""


class HostWatcher:
    """Follows one host's engine for the backend; ``run`` is its task, until cancelled."""

    def __init__(
        self,
        host: HostRecord,
        labels: dict[str, str],
        *,
        finish: Finish,
        stop: Stop,
        stop_grace: float,
        orphans_due: Callable[[], bool],
        listeners: list[HostListener],
    ) -> None:
        self._host = host
        self._labels = labels
        """The labels of this gateway's containers on the host."""
        self._finish = finish
        self._stop = stop
        self._stop_grace = stop_grace
        self._orphans_due = orphans_due
        self._listeners = listeners
        """The backend's list, read at each change: listeners added later hear it too."""

    async def run(self) -> None:
        """Follow the host's events; on each (re)connection list its containers and report the
        exits the stream did not show. Reconnects with backoff; never stops a replica."""
        host = self._host
        backoff = BACKOFF_FIRST
        while True:
            try:
                events = await host.client.events(self._labels, host.since)
                try:
                    await self._relist()
                    if not host.reachable:
                        log.info("docker host %s reachable (%s)", host.name, host.client.engine)
                    self._reachable(True, "")
                    backoff = BACKOFF_FIRST
                    assert host.answered is not None
                    host.answered.set()
                    await self._follow(events)
                finally:
                    events.close()
            except EngineError as exc:
                if host.reachable or host.error != exc.message:
                    log.warning("docker host %s unreachable: %s", host.name, exc.message)
                self._reachable(False, exc.message)
                assert host.answered is not None
                host.answered.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    def __repr__(self) -> str:
        host = self._host
        state = "reachable" if host.reachable else f"unreachable ({host.error})"
        return f"<HostWatcher {host.name} {state} since={host.since}>"

    async def _follow(self, events: EventStream) -> None:
        """Read the host's events while its engine answers the heartbeat; raises EngineError
        when either ends."""
        reading = asyncio.ensure_future(self._read(events))
        beating = asyncio.ensure_future(self._heartbeat())
        try:
            done, _ = await asyncio.wait({reading, beating}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reading, beating):
                task.cancel()
            await asyncio.wait({reading, beating})
        for task in done:
            task.result()
        raise EngineUnreachable(f"engine {self._host.client.engine}: event stream ended")

    async def _read(self, events: EventStream) -> None:
        async for event in events:
            self._on_event(event)

    async def _heartbeat(self) -> None:
        host = self._host
        while True:
            await wait_set(host.recheck, HEARTBEAT)
            host.recheck.clear()
            await host.client.ping(HEARTBEAT_TIMEOUT)

    def _reachable(self, reachable: bool, error: str) -> None:
        host = self._host
        host.reachable, host.error = reachable, error
        if host.told == reachable or (reachable and host.told is None):
            host.told = reachable
            return
        host.told = reachable
        state = host.state()
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:
                log.exception("host listener failed for docker host %s", host.name)

    async def _relist(self) -> None:
        host = self._host
        for container in list(host.unremoved):
            try:
                await host.client.remove(container)
            except EngineUnreachable:
                raise
            except EngineError as exc:  # the engine's own trouble: the orphan sweep retries
                log.warning("container %.12s not removed: %s", container, exc.message)
            host.unremoved.discard(container)
        found = await host.client.containers(self._labels)
        host.listing = {c["Id"]: c for c in found}
        for replica in list(host.replicas.values()):
            if replica.container is None or not replica.started.is_set():
                continue
            info = host.listing.get(replica.container)
            if info is None or info.get("State") != "running":
                self._finish(replica, None)
            elif replica.stop_requested and replica.finishing is None:
                # Its stop was asked for while the engine did not answer: ask again.
                rid = replica.launch.replica_id
                guarded_task(self._stop(replica, self._stop_grace), f"stop:{rid}")
            replica.verified = True
        if self._orphans_due() and (host.sweeping is None or host.sweeping.done()):
            host.sweeping = guarded_task(
                sweep(host, self._labels, self._stop_grace), f"docker-orphans:{host.name}"
            )

    def _on_event(self, event: dict[str, Any]) -> None:
        host = self._host
        if isinstance(event.get("timeNano"), int):
            nanos = event["timeNano"]
            host.since = f"{nanos // 10**9}.{nanos % 10**9:09d}"
        action = event.get("Action") or event.get("status")
        container = (event.get("Actor") or {}).get("ID") or event.get("id")
        if action not in ("die", "oom") or not isinstance(container, str):
            return
        replica = next((r for r in host.replicas.values() if r.container == container), None)
        if replica is None:
            return
        if action == "oom":
            replica.oom = True
            return
        code = (event.get("Actor") or {}).get("Attributes", {}).get("exitCode")
        self._finish(replica, int(code) if isinstance(code, str) and code.isdigit() else None)
