"""An upstream connection's read timeout: one lazily re-armed timer of its own.

``ReadTimeout`` is the base of ``upstream_connection.UpstreamConnection``. A request's answer
must come, and each read of it follow the last, within ``read_timeout``. The timer is armed
once and moved lazily: a later deadline only changes ``_last_read``, and the timer, when it
fires early, is armed again for it (no timer per request or per read).

A streamed chunked body's reads (``_chunked_read``) are counted, not timed: each sets
``_untimed``, and the timer reads the clock. While such a body is under way the timer looks
at most ``LOOK`` of the timeout apart, and a read since its last look counts as then: a body
that stops is cut between 1 and 1 + ``LOOK`` times the timeout after its last read, never
before. (uvloop's ``loop.time()`` at each read, through a method looked up by name, cost a
streamed event a tenth of its user time.)

What a timeout does is the subclass's: ``_timed_out``; whether the timer has anything to
time, ``_answer_over``; whether a chunked body is under way, ``_streaming``.
"""

from __future__ import annotations

import asyncio
from typing import Final

LOOK: Final = 0.125
"""While a chunked body is under way, the timer looks at most this fraction of the timeout
apart."""


class ReadTimeout(asyncio.Protocol):
    """The read timeout of the request under way on an upstream connection."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._read_timeout = 0.0
        self._last_read = 0.0
        self._untimed = False
        """A chunked body was read since ``_last_read`` (counted, not timed: ``LOOK``)."""
        self._reading_paused = False
        """Paused by the client side: the upstream is not late meanwhile."""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        """When ``_timer`` fires (its ``when()``, kept: a call a request less)."""

    def _answer_over(self) -> bool:
        """Nothing to time: the answer is complete, failed, or the connection is gone."""
        raise NotImplementedError

    def _streaming(self) -> bool:
        """A chunked body is under way (its reads are counted, not timed)."""
        raise NotImplementedError

    def _timed_out(self) -> None:
        """The upstream was silent for the timeout: fail the request, drop the connection."""
        raise NotImplementedError

    def _arm(self, now: float, read_timeout: float) -> None:
        """A request sent at ``now`` (the loop's time as the caller read it): its answer is
        due within ``read_timeout`` (0: never)."""
        self._read_timeout = read_timeout
        self._last_read = now
        self._untimed = False
        if read_timeout:
            self._due_by(now + read_timeout)

    def _due_by(self, at: float) -> None:
        """The timer fires at ``at`` or earlier (an earlier one is kept: it re-arms)."""
        timer = self._timer
        if timer is not None:
            if self._timer_at <= at:
                return
            timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _look_soon(self) -> None:
        """A chunked body goes on after its head's read, now; its reads are counted, not
        timed: the timer looks at them within ``LOOK`` times the timeout."""
        timeout = self._read_timeout
        if not timeout or self._answer_over():
            return
        now = self._last_read = self._loop.time()
        self._untimed = False
        self._due_by(now + timeout * LOOK)

    def _on_timer(self) -> None:
        # Armed once and re-armed while requests go on: no timer per request.
        self._timer = None
        if not self._read_timeout or self._answer_over():
            return
        now = self._loop.time()
        timeout = self._read_timeout
        if self._untimed:
            self._untimed = False  # read since the last look: at most LOOK * timeout ago
            self._last_read = now
        deadline = self._last_read + timeout
        if self._reading_paused or now < deadline:
            # Armed for an earlier request or read: due at the last one's. A paused read is
            # the client's doing, the upstream is not late: half a timeout more from now.
            paused = self._reading_paused
            at = max(deadline, now + timeout * 0.5) if paused else deadline
            if self._streaming():
                at = min(at, now + timeout * LOOK)
            self._due_by(at)  # (no timer now: armed at ``at``)
            return
        self._timed_out()
