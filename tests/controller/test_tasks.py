"""controller.tasks: waits and background tasks whose cancellation always goes on."""

from __future__ import annotations

import asyncio

import pytest

from controller.tasks import wait_set


async def test_wait_set_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0) is False
    event.set()
    assert await wait_set(event, 0) is True
    assert await wait_set(event, None) is True


async def test_a_cancel_that_arrives_as_the_event_is_set_goes_on() -> None:
    """gh-86296: ``wait_for`` on 3.11 returns the result instead; a loop waiting there
    never stops."""
    event = asyncio.Event()
    waiting = asyncio.create_task(wait_set(event, 10))
    await asyncio.sleep(0)  # waiting on the event
    event.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
