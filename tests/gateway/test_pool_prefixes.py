"""A service pool's memory of where each prompt prefix first went (``load_balancing:
inference``): a conversation's later requests follow its first, wherever the ring puts its
prefix; a replica that leaves is forgotten; the memory is bounded."""

from __future__ import annotations

import random

from gateway import Health, Pool, Upstream
from gateway.pool.hashring import Ring, key_hash
from gateway.pool.service_pool import PREFIXES_PLACED, ServicePool

from .conftest import routing

IDS = ("u0", "u1", "u2", "u3")


def pool_of() -> tuple[Pool, ServicePool]:
    pool = Pool(clock=lambda: 0.0, rng=random.Random(57))
    pool.set_service(routing("llm", prefix="/", load_balancing="inference"))
    for i, uid in enumerate(IDS):
        pool.add_upstream(Upstream(uid, "llm", "127.0.0.1", 9000 + i))
        pool.set_health("llm", uid, Health.HEALTHY)
    return pool, pool.service("llm")


def owner(prefix: bytes, ids: tuple[str, ...] = IDS) -> str:
    return Ring(ids).owners_from(key_hash(prefix))[0]


def test_a_conversation_stays_where_its_first_request_went() -> None:
    _, sp = pool_of()
    for n in range(20):
        prefix = f"system prompt, then conversation {n}'s first turn".encode()
        ring_owner = owner(prefix)
        # Its ring owner is the busiest: the first request goes to a least loaded one.
        busy = [sp.lease_of(u) for u in sp.snapshot.routable if u.id == ring_owner]
        first = sp.pick(key=prefix)
        assert first is not None
        assert first.id != ring_owner
        for lease in busy:
            lease.release()
        # Loads even again: the next turns go where the first did, not to the ring owner.
        for _ in range(5):
            later = sp.pick(key=prefix)
            assert later == first


def test_a_replica_that_leaves_is_forgotten() -> None:
    pool, sp = pool_of()
    prefix = b"a conversation"
    first = sp.pick(key=prefix)
    assert first is not None
    pool.set_health("llm", first.id, Health.UNHEALTHY)
    moved = sp.pick(key=prefix)
    assert moved is not None
    assert moved != first
    assert first.id not in sp.placed.values()
    # Back again, with an empty cache as far as the pool knows: the prefix stays where it
    # went since.
    pool.set_health("llm", first.id, Health.HEALTHY)
    for _ in range(4):
        assert sp.pick(key=prefix) == moved


def test_the_memory_keeps_the_most_recent_prefixes() -> None:
    _, sp = pool_of()
    keep = b"picked for again and again"
    sp.pick(key=keep)
    for n in range(PREFIXES_PLACED + 10):
        sp.pick(key=f"prompt {n}".encode())
        if n % 1000 == 0:
            sp.pick(key=keep)
    assert len(sp.placed) == PREFIXES_PLACED
    assert key_hash(keep) in sp.placed
    assert key_hash(b"prompt 0") not in sp.placed
