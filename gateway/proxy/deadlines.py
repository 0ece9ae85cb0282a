"""A client connection's deadlines: in a slot of the loop's ``Wheel`` while it waits for a
request, or on one lazily re-armed timer of its own while a body is read or it lingers.

``ConnectionDeadlines`` is the base of ``reader.RequestReader``. A connection has at most one
deadline at a time, of one kind:

- ``HEAD``: a request head within ``header_timeout`` (from the connection, or from a later
  request's first byte); ``KEEPALIVE``: the next request within ``keepalive_timeout`` while
  idle. Both in a slot of the loop's ``Wheel``, so a connection is closed no earlier than its
  deadline and at most ``WHEEL_SLOT`` after it. An idle connection's slot comes first at
  ``park_after``, to park it (``parking``); its keep-alive deadline still holds there;
- ``BODY``: each read of a request body within ``body_timeout`` (and at ``body_min_rate``);
  ``LINGER``: the reads discarded while lingering. Both on the connection's timer, moved
  lazily: a later deadline only changes ``_deadline``, and the timer, when it fires early,
  is armed again for it.

What a deadline that passed does is the subclass's: ``_body_timed_out``, ``abort``,
``close_transport``; ``_park`` parks an idle connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from ..config import ListenerLimits
from .limits import Limits, limits_of
from .wheel import Deadlined, wheel_of

log = logging.getLogger(__name__)

# What the connection's one deadline is for.
NONE: Final = 0
HEAD: Final = 1
KEEPALIVE: Final = 2
BODY: Final = 3
LINGER: Final = 4


class ConnectionDeadlines(asyncio.Protocol):
    """A client connection's one deadline (``_deadline``, of ``_deadline_kind``)."""

    __slots__ = (
        "_closing",
        "_deadline",
        "_deadline_kind",
        "_limits",
        "_loop",
        "_timer",
        "_timer_at",
        "_wheel_at",
        "_wheel_slot",
        "park_after",
        "transport",
    )

    def __init__(self, limits: ListenerLimits, loop: asyncio.AbstractEventLoop) -> None:
        self._limits: Limits = limits_of(limits)
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._closing = False
        self._deadline = 0.0
        self._deadline_kind = NONE
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._wheel_slot: set[Deadlined] | None = None
        """The ``Wheel`` slot this connection is in, if any (idle, or was since it fired)."""
        self._wheel_at = 0.0
        """When ``_wheel_slot`` was asked for (its slot ends within ``WHEEL_SLOT`` of it)."""
        self.park_after = self._limits.park_after
        """Idle this long, it is parked (``_park``); 0: never. The listener's ``park_after``,
        or longer for a connection that came back soon from parking (``parking``)."""

    def _set_deadline(self, timeout: float, kind: int, now: float) -> None:
        """Due ``timeout`` after ``now``, the loop's time (``loop.time()``) as the caller
        read it: an answer's end gives its own to the keep-alive deadline after it."""
        if not timeout:
            self._clear_deadline()
            return
        when = now + timeout
        self._deadline = when
        self._deadline_kind = kind
        timer = self._timer
        if kind == KEEPALIVE or kind == HEAD:  # in a slot of the loop's wheel, no timer
            if timer is not None:
                timer.cancel()
                self._timer = None
            if kind == KEEPALIVE:
                park_after = self.park_after
                if park_after and park_after < timeout:
                    when = now + park_after  # its slot comes first to park it (``on_wheel``)
            slot = self._wheel_slot
            if slot is None:
                self._into_wheel(when)
            elif when < self._wheel_at:  # its slot is later: moved
                slot.discard(self)
                self._into_wheel(when)
            # else its slot comes by ``when`` (within a slot) and puts it back (``on_wheel``)
            return
        if timer is None or self._timer_at > when:
            if timer is not None:
                timer.cancel()
            self._timer_at = when
            self._timer = self._loop.call_at(when, self._on_timer)

    def _into_wheel(self, when: float) -> None:
        """In the loop's wheel, in the slot that comes by ``when`` (out of none now)."""
        self._wheel_slot = wheel_of(self._loop).add(self, when)
        self._wheel_at = when

    def _clear_deadline(self) -> None:
        self._deadline = 0.0
        self._deadline_kind = NONE

    def on_wheel(self) -> None:
        """The ``Wheel`` slot this connection was in came (it is out of the wheel now)."""
        self._wheel_slot = None
        kind = self._deadline_kind
        if (kind != KEEPALIVE and kind != HEAD) or self.transport is None:
            return  # busy (a body's deadline has a timer), or closed
        now = self._loop.time()
        deadline = self._deadline
        if now < deadline:  # due later than when it was put in
            when = deadline
            if kind == KEEPALIVE and self.park_after:
                park_at = deadline - self._limits.keepalive_timeout + self.park_after
                if park_at <= now and self._park():
                    return
                if now < park_at < deadline:
                    when = park_at  # idle since less than ``park_after``
            self._into_wheel(when)
            return
        self._clear_deadline()
        if kind == HEAD:
            self._head_timed_out()
            return
        self._closing = True
        self.close_transport()

    def _on_timer(self) -> None:
        self._timer = None
        if self._deadline_kind == NONE or self.transport is None:
            return
        if self._deadline_kind == KEEPALIVE or self._deadline_kind == HEAD:
            if self._wheel_slot is None:  # the wheel's (``_set_deadline``), not ours
                self._into_wheel(self._deadline)
            return
        if self._loop.time() < self._deadline:
            self._timer_at = self._deadline
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
            return
        kind = self._deadline_kind
        self._clear_deadline()
        if kind == BODY:
            self._body_timed_out()
        elif kind == LINGER:
            self.close_transport()

    def _head_timed_out(self) -> None:
        log.debug("request head not received within %ss: closing", self._limits.header_timeout)
        self.abort()

    def _await_head(self) -> None:
        """A request head is due within ``header_timeout``."""
        self._set_deadline(self._limits.header_timeout, HEAD, self._loop.time())

    def _idle(self, now: float) -> None:
        """No request now: the next is due within ``keepalive_timeout`` of ``now``."""
        self._set_deadline(self._limits.keepalive_timeout, KEEPALIVE, now)

    def _stop_timer(self) -> None:
        """The connection is closed: no timer of its own, out of the wheel."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._wheel_slot is not None:
            self._wheel_slot.discard(self)
            self._wheel_slot = None

    # -- what a deadline that passed does (``RequestReader``, ``ClientConnection``) ----------

    def _park(self) -> bool:
        """Idle for ``park_after``: parked out of the loop if it can be (``parking``)."""
        raise NotImplementedError

    def _body_timed_out(self) -> None:
        """The request body's deadline passed."""
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def close_transport(self) -> None:
        raise NotImplementedError
