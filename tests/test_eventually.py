"""``tests.support.eventually``: what every waiting test relies on."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.eventually import eventually


async def test_returns_the_first_truthy_value_of_a_check_or_of_what_it_awaits() -> None:
    values = iter([0, [], "x"])
    assert await eventually(lambda: next(values), what="x", every=0) == "x"

    async def later() -> int:
        return 7

    assert await eventually(later, what="7") == 7


async def test_fails_after_the_timeout_with_what_and_the_last_error() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError("not yet")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="waiting for the port; last error: Connection"):
        await eventually(refused, what="the port", timeout=0.1)
    assert time.monotonic() - started < 1
    with pytest.raises(
        AssertionError, match=r"waiting for .*lambda: \[\], timeout=0.05\); last: \[\]"
    ):
        await eventually(lambda: [], timeout=0.05)


async def test_with_changed_it_checks_again_at_each_signal_not_on_a_timer() -> None:
    event = asyncio.Event()
    seen: list[int] = []

    async def changed() -> None:
        event.clear()
        await event.wait()

    async def signal() -> None:
        for n in range(3):
            seen.append(n)
            event.set()
            await asyncio.sleep(0)

    checks = 0

    def check() -> bool:
        nonlocal checks
        checks += 1
        return len(seen) == 3

    task = asyncio.create_task(signal())
    assert await eventually(check, what="three signals", changed=changed, timeout=5)
    await task
    assert checks <= 4  # once, then once per signal
