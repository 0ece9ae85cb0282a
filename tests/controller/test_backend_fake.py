"""The scripted fake backend that controller tests drive."""

from __future__ import annotations

import asyncio

import pytest

from controller.backends import Exit, FakeBackend, Launch, Running
from controller.errors import NoCapacity, StartFailed
from controller.spec import ReplicaTemplate


def launch(rid: str) -> Launch:
    return Launch("svc", 1, rid, ReplicaTemplate(commands=("serve",)))


@pytest.fixture
def exits() -> list[Exit]:
    return []


@pytest.fixture
def backend(exits: list[Exit]) -> FakeBackend:
    backend = FakeBackend()
    backend.set_exit_handler(exits.append)
    return backend


async def test_starts_succeed_at_once(backend: FakeBackend) -> None:
    first = await backend.start(launch("r1"))
    second = await backend.start(launch("r2"))
    assert first == Running("r1", "127.0.0.1", 30000, handle={"fake": 0})
    assert second.port == 30001
    assert backend.started == [launch("r1"), launch("r2")]
    assert backend.running == {"r1": first, "r2": second}
    assert backend.in_use == 2
    with pytest.raises(StartFailed, match="already running"):
        await backend.start(launch("r1"))


async def test_fail_next_start_is_a_queue(backend: FakeBackend) -> None:
    backend.fail_next_start(StartFailed("bad command"))
    backend.fail_next_start(NoCapacity("no capacity: fleet full", retry_after=7))
    with pytest.raises(StartFailed, match="bad command"):
        await backend.start(launch("r1"))
    with pytest.raises(NoCapacity) as caught:
        await backend.start(launch("r1"))
    assert caught.value.retry_after == 7
    await backend.start(launch("r1"))
    assert [a.replica_id for a in backend.attempts] == ["r1", "r1", "r1"]
    assert [a.replica_id for a in backend.started] == ["r1"]


async def test_capacity(backend: FakeBackend) -> None:
    backend.set_capacity(1)
    await backend.start(launch("r1"))
    with pytest.raises(NoCapacity, match=r"^no capacity: 1 of 1 slots in use$"):
        await backend.start(launch("r2"))
    assert backend.capacity == 1
    assert repr(backend) == "<FakeBackend in_use=1 capacity=1>"
    backend.set_capacity(None)
    await backend.start(launch("r2"))

    assert FakeBackend(capacity=0).capacity == 0
    with pytest.raises(NoCapacity):
        await FakeBackend(capacity=0).start(launch("r1"))


async def test_kill_reports_an_unrequested_exit(backend: FakeBackend, exits: list[Exit]) -> None:
    await backend.start(launch("r1"))
    await backend.start(launch("r2"))
    backend.kill("r1")
    backend.kill("r2", code=-9)
    assert exits == [
        Exit("r1", code=1, reason="exited with code 1", requested=False),
        Exit("r2", code=-9, reason="killed by signal 9 (SIGKILL)", requested=False),
    ]
    assert backend.running == {}
    assert backend.exits == exits
    with pytest.raises(KeyError):
        backend.kill("r1")


async def test_stop_reports_a_requested_exit(backend: FakeBackend, exits: list[Exit]) -> None:
    await backend.start(launch("r1"))
    await backend.stop("r1", grace=10)
    await backend.stop("r1", grace=10)  # already stopped
    await backend.stop("unknown", grace=10)
    assert exits == [Exit("r1", code=0, reason="stopped", requested=True)]
    assert backend.stopped == ["r1"]
    assert backend.in_use == 0


async def test_exit_on_start_comes_after_start_returns(
    backend: FakeBackend, exits: list[Exit]
) -> None:
    exited = asyncio.Event()

    def on_exit(event: Exit) -> None:
        exits.append(event)
        exited.set()

    backend.set_exit_handler(on_exit)
    backend.exit_on_start(3)
    running = await backend.start(launch("r1"))
    assert running.replica_id in backend.running
    assert exits == []
    await exited.wait()
    assert exits == [Exit("r1", code=3, reason="exited with code 3", requested=False)]
    assert backend.running == {}
    # Only the next start was scripted.
    await backend.start(launch("r2"))
    assert "r2" in backend.running


async def test_exit_on_start_after_stop_is_dropped(backend: FakeBackend, exits: list[Exit]) -> None:
    backend.exit_on_start(3)
    await backend.start(launch("r1"))
    await backend.stop("r1", 0)
    await asyncio.sleep(0)  # one turn of the loop: the scheduled exit finds nothing to end
    assert [e.reason for e in exits] == ["stopped"]


async def test_adopt_logs_close(backend: FakeBackend) -> None:
    assert backend.adopt(launch("r1"), {"fake": 0}) is None
    restarted = FakeBackend()
    restarted.running["r1"] = Running("r1", "127.0.0.1", 30000, handle={"fake": 0})
    assert restarted.adopt(launch("r1"), {"fake": 0}) == restarted.running["r1"]
    assert restarted.adopted == ["r1"]

    backend.set_logs("r1", ["one", "two", "three"])
    assert backend.logs("r1", 2) == ["two", "three"]
    assert backend.logs("r1", 0) == []
    assert backend.logs("r2", 5) == []
    await backend.close()
    assert backend.closed
