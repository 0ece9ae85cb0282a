"""A fake event loop for the deadline tests: a clock the test moves, timers run in order as
it passes them. Nothing sleeps."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Handle:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: Handle) -> bool:
        return self.when < other.when


class FakeLoop:
    """The part of a loop the connections and the wheel use: a clock moved by ``advance``, timers
    run in order as it passes them. ``early`` runs each timer that much before its time, as a
    loop may (its clock's resolution)."""

    def __init__(self, now: float = 1000.0, early: float = 0.0) -> None:
        self.now = now
        self.early = early
        self.timers: list[Handle] = []
        self.readers: dict[int, Callable[[], None]] = {}
        self.resumed: list[tuple[asyncio.Protocol, object]] = []
        """Descriptors watched for reading (the test calls the callback when it wants)."""

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> Handle:
        handle = Handle(when, callback)
        heapq.heappush(self.timers, handle)
        return handle

    def call_later(self, delay: float, callback: Callable[[], None]) -> Handle:
        return self.call_at(self.now + delay, callback)

    def create_future(self) -> asyncio.Future[object]:
        """A future of this loop: its result or exception is read, nothing awaits it."""
        return asyncio.Future(loop=self)  # type: ignore[arg-type]

    def get_debug(self) -> bool:
        return False

    async def connect_accepted_socket(
        self, factory: Callable[[], asyncio.Protocol], sock: object
    ) -> tuple[None, asyncio.Protocol]:
        """Records what a parked connection's resumption made (``resumed``): no transport."""
        protocol = factory()
        self.resumed.append((protocol, sock))
        return None, protocol

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self.readers[fd] = callback

    def remove_reader(self, fd: int) -> bool:
        return self.readers.pop(fd, None) is not None

    def pending(self) -> list[Handle]:
        return [h for h in self.timers if not h.cancelled]

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while self.timers and self.timers[0].when - self.early <= end:
            handle = heapq.heappop(self.timers)
            if handle.cancelled:
                continue
            self.now = max(self.now, handle.when - self.early)
            handle.callback()
        self.now = end


@contextmanager
def running(loop: FakeLoop) -> Iterator[None]:
    """``loop`` as the running loop, for what the connection asks of it when it is made."""
    asyncio.events._set_running_loop(loop)  # type: ignore[arg-type]
    try:
        yield
    finally:
        asyncio.events._set_running_loop(None)
