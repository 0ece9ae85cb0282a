"""``FakeClock``: the time a unit test gives the code under test, moved only by the test."""

from __future__ import annotations


class FakeClock:
    """Monotonic time that moves only when a test says so: ``clock()`` reads it, ``advance``
    (or setting ``now``) moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
