"""Background tasks of the control plane: started with a name, their unexpected end logged,
cancelled and awaited in one call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


def guarded_task(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A named task whose unexpected end (an exception, not a cancellation) is logged."""
    task: asyncio.Task[None] = asyncio.create_task(coro, name=name)
    task.add_done_callback(_log_unexpected_end)
    return task


def _log_unexpected_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s ended unexpectedly", task.get_name(), exc_info=task.exception())


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` and wait for its end; a cancellation of the caller goes on."""
    if task is None or task.done():
        return
    task.cancel()
    await asyncio.wait([task])


async def wait_set(event: asyncio.Event, within: float | None) -> bool:
    """Wait until ``event`` is set or ``within`` seconds pass (None: no limit); whether it
    was set. A cancellation of the caller always goes on: ``asyncio.timeout``, not
    ``wait_for``, which on 3.11 swallows a cancel that arrives as the wait ends (CPython
    gh-86296), so a loop waiting here would never stop."""
    try:
        async with asyncio.timeout(within):
            await event.wait()
    except TimeoutError:
        return False
    return True
