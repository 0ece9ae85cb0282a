"""The deadline wheel (``Wheel``): the deadlines of a loop's client connections that wait for
a request (idle between requests, or for a new connection's first head) in coarse slots under
one timer of the loop, instead of a timer each.

Invariants: a connection is closed no earlier than its deadline and at most ``WHEEL_SLOT``
after it; it is in at most one slot (``ClientConnection._wheel_slot``).
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol


class Deadlined(Protocol):
    """A connection with a deadline in the wheel (``http1_downstream.ClientConnection``)."""

    def on_wheel(self) -> None:
        """Its slot came: it is out of the wheel now (close it, or put it back)."""


WHEEL_SLOT: Final = 0.25
"""The ``Wheel``'s slot, in seconds: a connection is closed at most this long after its
``keepalive_timeout`` or ``header_timeout`` (nginx's timers are lazy by up to 300 ms,
``NGX_TIMER_LAZY_DELAY``). Finer than a second so that a short ``keepalive_timeout`` (a
fraction of a second, in tests) still holds roughly."""
_SLOTS_PER_SECOND: Final = 4


def slot_of(when: float) -> int:
    """The slot a deadline ``when`` goes in: the first that ends after it (slots are
    numbered by their end, in ``WHEEL_SLOT`` since the loop's 0)."""
    return int(when * _SLOTS_PER_SECOND) + 1


class Wheel:
    """The deadlines of one event loop's connections waiting for a request, in ``WHEEL_SLOT``
    slots under one timer of the loop: such a connection is an entry of a set (tens of
    bytes), not a timer of its own (a TimerHandle, uvloop's UVTimer, a Context and a bound
    method: about 600 bytes, and a libuv handle made, started, stopped and closed for each
    new connection).

    Lazy, like a connection's own timer: a connection stays in its slot when it becomes busy
    or when its deadline moves later; when the slot comes, ``ClientConnection.on_wheel`` skips
    a busy one, puts back one whose deadline is later and closes the others. A connection
    closed meanwhile takes itself out (``ClientConnection._stop_timer``). One per loop
    (``wheel_of``): each worker process has its own."""

    __slots__ = ("_handle", "_next", "loop", "slots")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.slots: dict[int, set[Deadlined]] = {}
        """Connections by slot (the slot's end, in ``WHEEL_SLOT`` since the loop's 0)."""
        self._handle: asyncio.TimerHandle | None = None
        self._next = 0
        """The slot ``_handle`` fires for."""

    def add(self, reader: Deadlined, when: float) -> set[Deadlined]:
        """Put ``reader`` in the first slot that ends after ``when``; returns that slot (which
        ``reader`` leaves with ``discard`` if it closes before the slot comes)."""
        slot = slot_of(when)
        readers = self.slots.get(slot)
        if readers is None:
            readers = self.slots[slot] = set()
        readers.add(reader)
        if self._handle is None or slot < self._next:
            self._arm(slot)
        return readers

    def _arm(self, slot: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._next = slot
        self._handle = self.loop.call_at(slot / _SLOTS_PER_SECOND, self._fire)

    def _fire(self) -> None:
        self._handle = None
        # The loop may run a timer a little before its time (its clock's resolution): the
        # slot it was armed for is due all the same.
        due = max(self._next, int(self.loop.time() * _SLOTS_PER_SECOND))
        for slot in sorted([s for s in self.slots if s <= due]):
            readers = self.slots.pop(slot)
            while readers:  # one closed by another's ``on_wheel`` is out already
                readers.pop().on_wheel()
        self._arm_next()

    def _arm_next(self) -> None:
        """Armed for the first slot left. An ``on_wheel`` that put its connection back armed
        it already, but for that connection's slot, which may come after others. (A method
        of its own: in ``_fire`` mypyc would take ``_handle`` for the None it set.)"""
        if self.slots:
            first = min(self.slots)
            if self._handle is None or first < self._next:
                self._arm(first)


class _LastWheel:
    """The ``Wheel`` made last (the gateway runs one loop per process)."""

    wheel: Wheel | None = None


_last_wheel: Final = _LastWheel()


def wheel_of(loop: asyncio.AbstractEventLoop) -> Wheel:
    """The deadline wheel of ``loop``: the last one made, if it is ``loop``'s. A wheel
    replaced (a test's next loop) still fires what it holds, on its own loop."""
    wheel = _last_wheel.wheel
    if wheel is None or wheel.loop is not loop:
        wheel = _last_wheel.wheel = Wheel(loop)
    return wheel
