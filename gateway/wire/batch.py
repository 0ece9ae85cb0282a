"""Writes held to the end of the loop's turn, then made together.

Under load, one turn of the event loop handles the events of many connections: requests
read from clients, answers read from upstreams. Writing each message as soon as it is made
wakes the process at the other end once per write; when that process's core is idle, each
wake-up is an inter-processor interrupt, and in a virtual machine a costly one. Measured
under ``wrk -c64`` with the peers on the other core, the writes made as they came cost two
interrupts per request; holding them to the end of the turn, about 0.1 (see the closing
note of the performance issue, and ``bench/README.md``).

A connection with something to write holds it (``ClientConnection.write``,
``UpstreamConnection.send``) and joins the ``WriteBatch``; the batch's one callback, run
after the turn's I/O callbacks and before the loop polls again, writes what each holds. A
connection writes what it holds before anything else touches its transport (a write not
held, a close, an abort), so its bytes keep their order. Only whole ``bytes`` are held,
never a view of a buffer read into again.

Redis writes its replies the same way (``handleClientsWithPendingWrites`` before it sleeps),
as does Netty's ``FlushConsolidationHandler`` while a read loop lasts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sized
from typing import Protocol

log = logging.getLogger(__name__)


class Holder(Protocol):
    """A connection holding bytes to write (``flush`` writes them, if it still can)."""

    def flush(self) -> None: ...


class WriteBatch:
    """The connections holding writes in this turn of the loop.

    The first write of a turn goes at once: a lone request waits for nothing. It wakes its
    peer, as any write does; the writes after it in the same turn are held and made
    together when the turn ends. While at most one request is in flight (``in_flight``),
    nobody else could write in the turn: no turn is kept, and writes go at once.
    """

    __slots__ = ("_held", "_in_flight", "_loop", "_turn", "held_writes")

    def __init__(self, in_flight: Sized = ()) -> None:
        self._in_flight = in_flight
        """One item per request in flight: the connector's upstream connections in use."""
        self._held: list[Holder] = []
        self._turn = False
        """A write was made in this turn: the end of the turn is scheduled."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The running loop, kept (Python 3.11's ``get_running_loop`` makes a syscall)."""
        self.held_writes = 0
        """Writes held to the end of their turn, so far."""

    def hold(self, conn: Holder) -> bool:
        """Whether ``conn`` is to hold its write until the end of the turn (then it is
        flushed); False for the first write of a turn, which ``conn`` makes at once."""
        if self._turn:
            self._held.append(conn)
            self.held_writes += 1
            return True
        if len(self._in_flight) < 2:
            return False
        self._turn = True
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        loop.call_soon(self._end_turn)
        return False

    def _end_turn(self) -> None:
        self._turn = False
        held = self._held
        if not held:
            return
        self._held = []
        for conn in held:
            try:
                conn.flush()
            except Exception:  # one connection's failure is its own: the others still write
                log.exception("writing held bytes to %r failed", conn)

    def __repr__(self) -> str:
        return (
            f"<WriteBatch held={len(self._held)} turn={self._turn} held_writes={self.held_writes}>"
        )
