"""``tests.support.eventually``: what every waiting test relies on."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.eventually import GiveUp, eventually, eventually_blocking


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


async def test_a_check_that_gives_up_ends_the_wait_at_once() -> None:
    def exited() -> bool:
        raise GiveUp("the process exited")

    started = time.monotonic()
    with pytest.raises(GiveUp, match="the process exited"):
        await eventually(exited, timeout=5)
    with pytest.raises(GiveUp, match="the process exited"):
        eventually_blocking(exited, timeout=5)
    assert time.monotonic() - started < 1


def test_the_blocking_form_returns_the_first_truthy_value_or_fails_the_same() -> None:
    values = iter([0, None, "x"])
    assert eventually_blocking(lambda: next(values), every=0) == "x"
    with pytest.raises(AssertionError, match="waiting for the member; last: False"):
        eventually_blocking(lambda: False, what="the member", timeout=0.05, every=0.01)
