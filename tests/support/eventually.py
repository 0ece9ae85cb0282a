"""``eventually()``: the one way a test waits for something another task or process does.

A test never sleeps to let something happen (STYLE.md §3). Where the code under test signals a
change, ``eventually`` awaits that signal (``changed``) between checks; where only a process, a
file or the kernel can tell (a port answering, a pid gone, a key written by etcd), it checks
again every ``every`` seconds. ``timeout`` bounds a hang and is never a pace: a passing test
does not wait for it. It is measured on the monotonic clock, not the loop's, so a test on a
fake loop clock still fails in real seconds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


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
    sleeps ``every`` seconds. A check that raises counts as false. After ``timeout`` seconds it
    fails with ``what`` (by default the check's source), the last value, and the last
    exception as the cause.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
        except Exception as e:  # not yet: e.g. a connection refused until the port listens
            last, error = None, e
        else:
            if value:
                return value  # type: ignore[return-value]
            last, error = value, None
        left = deadline - time.monotonic()
        if left <= 0:
            because = f"; last error: {error!r}" if error is not None else f"; last: {last!r}"
            waited = what or _source(check)
            message = f"timed out after {timeout:g}s waiting for {waited}{because}"
            raise AssertionError(message) from error
        if changed is None:
            await asyncio.sleep(min(every, left))
        else:
            try:
                async with asyncio.timeout(left):
                    await changed()
            except TimeoutError:
                pass  # checked once more, then failed


def _source(check: Callable[..., object]) -> str:
    try:
        return inspect.getsource(check).strip()
    except (OSError, TypeError):
        return repr(check)
