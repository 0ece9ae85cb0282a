"""Parked connections (``Parking``): idle keep-alive client connections held out of the event
loop, a descriptor in an epoll set of their own, until their client sends again.

An idle connection on uvloop holds a transport, its libuv handle and its entry in the loop's
transport table, and the ``ClientConnection``: several times what an nginx worker holds for
one (bench/RESULTS.md `code-figures`). A plain HTTP connection idle for ``park_after``
(``ListenerLimits``) is parked instead: its socket is duplicated into this set and its
transport closed, which closes the loop's descriptor but not the connection. Parked, it is the
kernel's socket and, here, three numbers and its place in a slot of deadlines. When
its client sends again, the socket becomes a new transport with a new ``ClientConnection``
(``loop.connect_accepted_socket``), which reads the request waiting in the socket's buffer as
it would have; a client that closed meanwhile is closed without one. The keep-alive deadline
holds while parked: at it the connection is closed, as an idle one is (in a slot of the
loop's ``Wheel``).

What it costs: a parked connection's next request first pays about what accepting a new
connection does (a transport and a connection made: about 50 microseconds of CPU, where a
kept-alive request takes 25 to 75; ``bench/parking.py``). So a connection that comes back
sooner than it had waited to be parked waits twice as long next time: a client that sends
every few seconds stops being parked after a resume or two, while one that stays parked waits
the listener's ``park_after`` again. And the transports the parked connections left are
freed, but the C heap keeps what it freed: once ``TRIM_AFTER`` connections were parked, its
free pages are given back (glibc's ``malloc_trim``).

Invariants: a connection is parked only with nothing buffered either way (nothing unread, no
answer unsent; TLS connections never), so nothing is lost; a parked descriptor is in this set
until it is resumed or closed, and it counts against ``max_connections`` meanwhile
(``ConnectionGate.parked``), as it did in the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import select
import socket
from array import array
from collections.abc import Callable, Coroutine
from typing import Any, Final, Protocol

from .wheel import slot_of, wheel_of

log = logging.getLogger(__name__)

_WATCH: Final = select.EPOLLIN | select.EPOLLRDHUP
"""A parked socket wakes on data, or on its client's end of the connection."""
_GONE: Final = select.EPOLLHUP | select.EPOLLERR


class Counted(Protocol):
    """What counts the listener's connections (``client.ConnectionGate``)."""

    parked: int


class _Expiry:
    """The parked connections whose keep-alive deadline falls in one slot of the ``Wheel``."""

    __slots__ = ("fds", "key", "parking")

    def __init__(self, parking: Parking, key: int) -> None:
        self.parking = parking
        self.key = key
        self.fds = array("i")

    def on_wheel(self) -> None:
        self.parking.expire(self)


class Parking:
    """One listener's parked connections: their sockets in an epoll set that the loop watches
    as one descriptor, and what each holds (its deadline, its delay), by descriptor."""

    __slots__ = (
        "_base",
        "_closed",
        "_deadlines",
        "_delays",
        "_epoll",
        "_expiries",
        "_factory",
        "_family",
        "_gate",
        "_loop",
        "_parked_at",
        "_since_trim",
        "_trim",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        factory: Callable[[float], asyncio.Protocol],
        family: int,
        gate: Counted,
        park_after: float,
    ) -> None:
        self._loop = loop
        self._factory = factory
        """Makes the protocol of a resumed connection (the listener's own), given how long it
        waits idle before it is parked again."""
        self._family = family
        self._gate = gate
        self._base = park_after
        """The listener's ``park_after``."""
        self._epoll: select.epoll | None = None
        """Made at the first park; its descriptor is watched by the loop while it exists."""
        self._deadlines = array("d")
        """The keep-alive deadline of each parked descriptor, by descriptor; 0: not parked."""
        self._parked_at = array("d")
        """When each was parked (the loop's time)."""
        self._delays = array("d")
        """How long each had waited idle before it was parked (its ``park_after``)."""
        self._expiries: dict[int, _Expiry] = {}
        self._closed = False
        self._since_trim = 0
        """Connections parked since the C heap was last trimmed (``_trim_heap``)."""
        self._trim: asyncio.TimerHandle | None = None

    @property
    def count(self) -> int:
        return self._gate.parked

    def park(self, fd: int, deadline: float, park_after: float) -> bool:
        """Hold the connection on ``fd`` (the transport's, which the caller then closes) until
        its client sends, or ``deadline``; it waited idle ``park_after`` before. False if it
        could not be (nothing changed)."""
        if self._closed:
            return False
        epoll = self._epoll
        if epoll is None:
            epoll = self._epoll = select.epoll()
            self._loop.add_reader(epoll.fileno(), self._ready)
        try:
            held = os.dup(fd)
        except OSError as e:  # out of descriptors: it stays in the loop
            log.debug("not parked: %s", e)
            return False
        try:
            epoll.register(held, _WATCH)
        except OSError as e:
            os.close(held)
            log.debug("not parked: %s", e)
            return False
        if held >= len(self._deadlines):
            grow = bytes(8 * (held + 1 - len(self._deadlines) + len(self._deadlines) // 2))
            self._deadlines.frombytes(grow)
            self._parked_at.frombytes(grow)
            self._delays.frombytes(grow)
        self._deadlines[held] = deadline
        self._parked_at[held] = self._loop.time()
        self._delays[held] = park_after
        self._gate.parked += 1
        self._expire_at(held, deadline)
        self._since_trim += 1
        if self._since_trim >= TRIM_AFTER and self._trim is None:
            self._trim = self._loop.call_later(1.0, self._trim_heap)
        return True

    def _expire_at(self, fd: int, deadline: float) -> None:
        """Put parked ``fd`` in the ``_Expiry`` of ``deadline``'s slot."""
        key = slot_of(deadline)  # the deadlines of one slot of the wheel share an expiry
        expiry = self._expiries.get(key)
        if expiry is None:
            expiry = self._expiries[key] = _Expiry(self, key)
            wheel_of(self._loop).add(expiry, deadline)
        expiry.fds.append(fd)

    def expire(self, expiry: _Expiry) -> None:
        """``expiry``'s slot came: close its connections whose deadline passed (those
        resumed meanwhile are not parked any more, or parked again with a later deadline)."""
        if self._expiries.get(expiry.key) is expiry:
            del self._expiries[expiry.key]
        now = self._loop.time()
        deadlines = self._deadlines
        for fd in expiry.fds:
            deadline = deadlines[fd] if fd < len(deadlines) else 0.0
            if not deadline or slot_of(deadline) != expiry.key:
                continue  # resumed since (and maybe parked again, in another slot)
            if now < deadline:  # the loop ran the wheel's timer a little early
                self._expire_at(fd, deadline)
                continue
            self._unwatch(fd)
            os.close(fd)

    def _unwatch(self, fd: int) -> None:
        """``fd`` is not parked any more (the caller resumes or closes it)."""
        epoll = self._epoll
        assert epoll is not None
        epoll.unregister(fd)
        self._deadlines[fd] = 0.0
        self._gate.parked -= 1

    def _ready(self) -> None:
        """Some parked sockets have something: a request (resumed) or their client's end
        (closed). Level-triggered: what one call leaves is reported again."""
        epoll = self._epoll
        if epoll is None:
            return
        now = self._loop.time()
        for fd, events in epoll.poll(0):
            self._unwatch(fd)
            sock = socket.socket(self._family, socket.SOCK_STREAM, 0, fd)
            if events & _GONE or (events & select.EPOLLRDHUP and not _waiting(sock)):
                sock.close()  # the client closed it, with nothing unread
                continue
            # Back sooner than it had waited to be parked: parking it did not pay (a new
            # transport costs about what a new connection does), so it waits twice as long
            # next time. Parked longer: it is the idle kind, and waits the listener's delay.
            delay = self._delays[fd]
            delay = 2 * delay if now - self._parked_at[fd] < delay else self._base
            self._resume(sock, delay)

    def _resume(self, sock: socket.socket, park_after: float) -> None:
        """A transport and a connection for ``sock`` (``loop.connect_accepted_socket``), made
        now: its coroutine is run here to its wait for the connection, and finished from the
        waiter's callback, without a task of its own."""

        def protocol() -> asyncio.Protocol:
            return self._factory(park_after)

        resuming = self._loop.connect_accepted_socket(protocol, sock)
        try:
            waiter = resuming.send(None)
        except StopIteration:
            return
        except OSError as e:  # reset meanwhile: the transport closed the socket
            log.debug("a parked connection could not be resumed: %s", e)
            return
        waiter.add_done_callback(functools.partial(_finish, resuming))

    def _trim_heap(self) -> None:
        """Give the C heap's free pages back to the system (``malloc_trim``, glibc's), once
        ``TRIM_AFTER`` connections were parked: the transports they left were freed, but a
        heap keeps what it freed for its next allocations, and RSS would stay at the peak of
        the connections in the loop."""
        self._trim = None
        self._since_trim = 0
        if _malloc_trim.function is None:
            _malloc_trim.load()
        function = _malloc_trim.function
        if function is not None:
            function(0)

    def close(self) -> None:
        """Close every parked connection and stop watching (the listener's shutdown: parked
        connections are idle ones)."""
        self._closed = True
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        epoll, self._epoll = self._epoll, None
        if epoll is None:
            return
        self._loop.remove_reader(epoll.fileno())
        deadlines = self._deadlines
        for fd in range(len(deadlines)):
            if deadlines[fd]:
                deadlines[fd] = 0.0
                os.close(fd)
        self._gate.parked = 0
        self._expiries.clear()
        epoll.close()


TRIM_AFTER: Final = 1024
"""Connections parked before the C heap is trimmed (``Parking._trim_heap``): about 1.4 MiB of
transports freed. A second after the first of them, so that a burst is trimmed once."""


class _MallocTrim:
    """glibc's ``malloc_trim``, found on first use: ``ctypes`` (0.4 MiB) is imported only by
    a process that parked ``TRIM_AFTER`` connections, which saved more. None where the C
    library has none (musl)."""

    function: Callable[[int], object] | None = None
    looked = False

    def load(self) -> None:
        if self.looked:
            return
        self.looked = True
        try:
            import ctypes

            self.function = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            log.debug("no malloc_trim in this C library: the heap is not trimmed")


_malloc_trim: Final = _MallocTrim()


def _finish(resuming: Coroutine[Any, Any, object], waiter: object) -> None:
    """The resumed connection's ``connection_made`` ran: let its coroutine end."""
    try:
        resuming.send(None)
    except StopIteration:
        pass
    except Exception as e:  # its transport failed before the protocol had it
        log.debug("a parked connection could not be resumed: %s", e)


def _waiting(sock: socket.socket) -> bool:
    """Whether the client sent something before it shut its side (read by the transport)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:
        return False
