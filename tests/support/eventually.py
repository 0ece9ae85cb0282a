"""``eventually()``: the one way a test waits for something another task or process does.

A test never sleeps to let something happen (STYLE.md §3). Where the code under test signals a
change, ``eventually`` awaits that signal (``changed``) between checks; where only a process, a
file or the kernel can tell (a port answering, a pid gone, a key written by etcd), it checks
again every ``every`` seconds. ``timeout`` bounds a hang and is never a pace: a passing test
does not wait for it. It is measured on the monotonic clock, not the loop's, so a test on a
fake loop clock still fails in real seconds.

A check that finds waiting longer cannot help (the process it waits for exited) raises
``GiveUp``: the wait fails at once with it. ``eventually_blocking`` is the same wait for code
that cannot await (a synchronous fixture starting an engine or etcd).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class GiveUp(Exception):
    """Raised by a check when waiting longer cannot help; ``eventually`` lets it through."""


async def eventually(
    check: Callable[[], T | Awaitable[T]],
    *,
    what: str | None = None,
    timeout: float = 10.0,
    changed: Callable[[], Awaitable[object]] | None = None,
    every: float = 0.02,
) -> T:
    """The first truthy value of ``check()`` (awaited if it returns an awaitable).

    Between checks it awaits ``changed()`` if given (a signal of the code under test), else
    sleeps ``every`` seconds. A check that raises counts as false, but for ``GiveUp``, which
    ends the wait. After ``timeout`` seconds it fails with ``what`` (by default the check's
    source), the last value, and the last exception as the cause.
    """
    wait = _Wait(check, what, timeout)
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
        except GiveUp:
            raise
        except Exception as e:  # not yet: e.g. a connection refused until the port listens
            wait.failed(e)
        else:
            if value:
                return value  # type: ignore[return-value]
            wait.was(value)
        left = wait.left()
        if changed is None:
            await asyncio.sleep(min(every, left))
        else:
            try:
                async with asyncio.timeout(left):
                    await changed()
            except TimeoutError:
                pass  # checked once more, then failed


def eventually_blocking(
    check: Callable[[], T], *, what: str | None = None, timeout: float = 10.0, every: float = 0.05
) -> T:
    """``eventually`` for code that cannot await: the same checks and failure, blocking for
    ``every`` seconds between them (nothing else runs on the thread meanwhile)."""
    wait = _Wait(check, what, timeout)
    while True:
        try:
            value = check()
        except GiveUp:
            raise
        except Exception as e:
            wait.failed(e)
        else:
            if value:
                return value
            wait.was(value)
        time.sleep(min(every, wait.left()))


class _Wait:
    """The deadline of one wait and what its last check saw."""

    def __init__(self, check: Callable[..., object], what: str | None, timeout: float) -> None:
        self.check = check
        self.what = what
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.last: object = None
        self.error: BaseException | None = None

    def was(self, value: object) -> None:
        self.last, self.error = value, None

    def failed(self, error: BaseException) -> None:
        self.last, self.error = None, error

    def left(self) -> float:
        """Seconds left; past the deadline, the failure."""
        left = self.deadline - time.monotonic()
        if left > 0:
            return left
        error = self.error
        because = f"; last error: {error!r}" if error is not None else f"; last: {self.last!r}"
        waited = self.what or _source(self.check)
        message = f"timed out after {self.timeout:g}s waiting for {waited}{because}"
        raise AssertionError(message) from error


def _source(check: Callable[..., object]) -> str:
    try:
        return inspect.getsource(check).strip()
    except (OSError, TypeError):
        return repr(check)
