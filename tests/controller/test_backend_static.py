"""The static backend: addresses handed out and given back, one live replica each."""

from __future__ import annotations

import pytest

from controller.backends import Exit, Launch, Running, StaticBackend
from controller.errors import NoCapacity, StartFailed
from controller.spec import ReplicaTemplate

ADDRESSES = ("127.0.0.1:9001", "127.0.0.1:9002", "[::1]:9003")


def launch(rid: str, *addresses: str, service: str = "svc", revision: int = 1) -> Launch:
    template = ReplicaTemplate(addresses=addresses or ADDRESSES)
    return Launch(service=service, revision=revision, replica_id=rid, template=template)


@pytest.fixture
def exits() -> list[Exit]:
    return []


@pytest.fixture
def backend(exits: list[Exit]) -> StaticBackend:
    backend = StaticBackend()
    backend.set_exit_handler(exits.append)
    return backend


async def test_hands_out_the_first_free_address(backend: StaticBackend) -> None:
    first = await backend.start(launch("r1"))
    second = await backend.start(launch("r2"))
    third = await backend.start(launch("r3"))
    assert first == Running("r1", "127.0.0.1", 9001, handle={"address": "127.0.0.1:9001"})
    assert (second.host, second.port) == ("127.0.0.1", 9002)
    assert (third.host, third.port, third.handle) == ("::1", 9003, {"address": "[::1]:9003"})
    assert third.pid is None
    assert backend.in_use == 3
    assert backend.capacity is None


async def test_all_addresses_held_is_no_capacity(backend: StaticBackend) -> None:
    for rid in ("r1", "r2", "r3"):
        await backend.start(launch(rid))
    with pytest.raises(NoCapacity, match=r"^no capacity: all 3 static addresses in use$") as e:
        await backend.start(launch("r4"))
    assert e.value.retry_after > 0


async def test_an_address_is_held_across_revisions(backend: StaticBackend) -> None:
    await backend.start(launch("a-1", "127.0.0.1:9001", service="a"))
    # Another revision of the service listing the same address cannot have it at the same
    # time: the service's pool would hold the upstream twice.
    with pytest.raises(NoCapacity, match="all 1 static"):
        await backend.start(launch("a-2", "127.0.0.1:9001", service="a", revision=2))
    other = await backend.start(launch("a-3", "127.0.0.1:9001", "127.0.0.1:9009", service="a"))
    assert other.port == 9009


async def test_services_share_an_address(backend: StaticBackend, exits: list[Exit]) -> None:
    # Two routes to one upstream (one with auth, one rate limited) are two services: each
    # has its replica at the address, neither takes it from the other.
    a = await backend.start(launch("a-1", "127.0.0.1:9001", service="a"))
    b = await backend.start(launch("b-1", "127.0.0.1:9001", service="b"))
    assert (a.host, a.port) == (b.host, b.port) == ("127.0.0.1", 9001)
    assert backend.in_use == 2
    with pytest.raises(NoCapacity, match="all 1 static"):
        await backend.start(launch("b-2", "127.0.0.1:9001", service="b", revision=2))
    # Stopping one service's replica leaves the other's held.
    await backend.stop("a-1", grace=10)
    assert exits == [Exit("a-1", code=None, reason="released", requested=True)]
    with pytest.raises(NoCapacity, match="all 1 static"):
        await backend.start(launch("b-3", "127.0.0.1:9001", service="b"))
    again = await backend.start(launch("a-2", "127.0.0.1:9001", service="a"))
    assert again.port == 9001


async def test_stop_releases_and_reports(backend: StaticBackend, exits: list[Exit]) -> None:
    await backend.start(launch("r1", "127.0.0.1:9001"))
    await backend.stop("r1", grace=10)
    assert exits == [Exit("r1", code=None, reason="released", requested=True)]
    assert backend.in_use == 0
    again = await backend.start(launch("r2", "127.0.0.1:9001"))
    assert again.port == 9001

    await backend.stop("r1", grace=10)  # already released
    await backend.stop("unknown", grace=10)
    assert len(exits) == 1


async def test_start_failures(backend: StaticBackend) -> None:
    await backend.start(launch("r1"))
    with pytest.raises(StartFailed, match="already running"):
        await backend.start(launch("r1"))
    empty = Launch("svc", 1, "r9", ReplicaTemplate())
    with pytest.raises(StartFailed, match="no static addresses"):
        await backend.start(empty)


async def test_repeated_address_counts_once(backend: StaticBackend) -> None:
    await backend.start(launch("r1", "127.0.0.1:9001", "127.0.0.1:9001"))
    with pytest.raises(NoCapacity, match="all 1 static"):
        await backend.start(launch("r2", "127.0.0.1:9001", "127.0.0.1:9001"))


async def test_adopt(backend: StaticBackend) -> None:
    handle = {"address": "127.0.0.1:9002"}
    running = backend.adopt(launch("r1"), handle)
    assert running == Running("r1", "127.0.0.1", 9002, handle=handle)
    assert backend.in_use == 1
    assert backend.adopt(launch("r1"), handle) == running  # idempotent
    # The adopted address is held: a start gets another one, an adoption by another id none.
    assert (await backend.start(launch("r2"))).port == 9001
    assert backend.adopt(launch("r3"), handle) is None
    # Not (or no longer) in the template, or not an address at all.
    assert backend.adopt(launch("r4", "127.0.0.1:9001"), {"address": "127.0.0.1:9003"}) is None
    assert backend.adopt(launch("r5"), {"address": "nonsense"}) is None
    assert backend.adopt(launch("r6"), {}) is None
    assert backend.in_use == 2
    # Another service's replica at the same address is adopted: it holds its own.
    other = backend.adopt(launch("b-1", service="b"), handle)
    assert other == Running("b-1", "127.0.0.1", 9002, handle=handle)
    assert backend.in_use == 3


async def test_logs_repr_close(backend: StaticBackend) -> None:
    await backend.start(launch("r1"))
    assert backend.logs("r1", 10) == []
    assert repr(backend) == "<StaticBackend in_use=1 capacity=None>"
    await backend.close()
    assert backend.in_use == 1  # closing leaves replicas alone
