"""A scripted backend for controller tests: no processes, no sockets, no sleeping.

Starts succeed at once with ``Running(host="127.0.0.1", port=30000 + n)`` (n counts the
successful starts, from 0) unless the script says otherwise:

- ``fail_next_start(error)``: the next start raises ``error`` (queued, in order);
- ``set_capacity(n)``: starts beyond ``n`` running replicas raise NoCapacity;
- ``exit_on_start(code)``: the next started replica exits with ``code`` right after its start
  (on the next turn of the loop, so the caller has seen ``start`` return first);
- ``kill(replica_id, code)``: the replica exits, unasked (``requested=False``);
- ``set_logs(replica_id, lines)``: what ``logs`` returns.

What happened is in plain attributes: ``attempts`` (every start asked for), ``started``
(those that succeeded), ``stopped`` (ids of replicas stopped), ``running`` (the live ones;
tests may fill it before ``adopt``), ``exits`` (every exit reported).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from ..errors import NoCapacity, StartFailed
from .base import Exit, ExitHandler, Launch, Running
from .process import exit_reason

if TYPE_CHECKING:
    from .base import Backend

BASE_PORT = 30000


def _conforms(backend: FakeBackend) -> Backend:  # pragma: no cover - checked by mypy
    return backend


class FakeBackend:
    """Does what its script says, at once."""

    name: str = "fake"

    def __init__(self, capacity: int | None = None) -> None:
        self._capacity = capacity
        self._exit_handler: ExitHandler | None = None
        self._failures: deque[Exception] = deque()
        self._exit_codes: deque[int] = deque()
        self._logs: dict[str, list[str]] = {}
        self.attempts: list[Launch] = []
        self.started: list[Launch] = []
        self.stopped: list[str] = []
        self.running: dict[str, Running] = {}
        self.exits: list[Exit] = []
        self.adopted: list[str] = []
        self.closed = False

    # -- the script -------------------------------------------------------------------------

    def fail_next_start(self, error: Exception) -> None:
        self._failures.append(error)

    def set_capacity(self, capacity: int | None) -> None:
        self._capacity = capacity

    def exit_on_start(self, code: int) -> None:
        self._exit_codes.append(code)

    def kill(self, replica_id: str, code: int = 1) -> None:
        """The replica exits on its own with ``code`` (``-N``: killed by signal N)."""
        if replica_id not in self.running:
            raise KeyError(f"no running replica {replica_id}")
        del self.running[replica_id]
        self._report(Exit(replica_id, code=code, reason=exit_reason(code), requested=False))

    def set_logs(self, replica_id: str, lines: list[str]) -> None:
        self._logs[replica_id] = list(lines)

    # -- the Backend protocol -------------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def in_use(self) -> int:
        return len(self.running)

    def set_exit_handler(self, handler: ExitHandler) -> None:
        self._exit_handler = handler

    async def start(self, launch: Launch) -> Running:
        self.attempts.append(launch)
        if self._failures:
            raise self._failures.popleft()
        rid = launch.replica_id
        if rid in self.running:
            raise StartFailed(f"replica {rid} is already running")
        if self._capacity is not None and self.in_use >= self._capacity:
            raise NoCapacity(f"no capacity: {self.in_use} of {self._capacity} slots in use")
        running = Running(
            replica_id=rid,
            host="127.0.0.1",
            port=BASE_PORT + len(self.started),
            handle={"fake": len(self.started)},
        )
        self.started.append(launch)
        self.running[rid] = running
        if self._exit_codes:
            code = self._exit_codes.popleft()
            asyncio.get_running_loop().call_soon(self._exit_if_running, running, code)
        return running

    async def stop(self, replica_id: str, grace: float) -> None:
        if self.running.pop(replica_id, None) is None:
            return
        self.stopped.append(replica_id)
        self._report(Exit(replica_id, code=0, reason="stopped", requested=True))

    def adopt(self, launch: Launch, handle: dict[str, Any]) -> Running | None:
        running = self.running.get(launch.replica_id)
        if running is not None:
            self.adopted.append(launch.replica_id)
        return running

    def logs(self, replica_id: str, tail: int) -> list[str]:
        lines = self._logs.get(replica_id, [])
        return lines[-tail:] if tail > 0 else []

    async def close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"<FakeBackend in_use={self.in_use} capacity={self._capacity}>"

    def _exit_if_running(self, running: Running, code: int) -> None:
        if self.running.get(running.replica_id) is running:
            self.kill(running.replica_id, code)

    def _report(self, event: Exit) -> None:
        self.exits.append(event)
        if self._exit_handler is not None:
            self._exit_handler(event)
