"""A service pool's memory of where the blocks of each prompt prefix were sent (``load_balancing:
inference``, ``pool.prefixes``): a conversation's later requests follow its first; a new
conversation goes where its system prompt is; a replica that leaves is forgotten; the memory
is bounded."""

from __future__ import annotations

import random

from gateway import Health, Pool, Upstream
from gateway.pool.prefixes import BLOCK, Sent, blocks_of
from gateway.pool.service_pool import ServicePool

from .conftest import routing

IDS = ("u0", "u1", "u2", "u3")
SYSTEM = b"You are a careful assistant. " * 40  # some 1,160 bytes: four blocks and a part


def pool_of() -> tuple[Pool, ServicePool]:
    pool = Pool(clock=lambda: 0.0, rng=random.Random(57))
    pool.set_service(routing("llm", prefix="/", load_balancing="inference"))
    for i, uid in enumerate(IDS):
        pool.add_upstream(Upstream(uid, "llm", "127.0.0.1", 9000 + i))
        pool.set_health("llm", uid, Health.HEALTHY)
    return pool, pool.service("llm")


def test_blocks_are_chained_so_prompts_share_exactly_their_common_leading_blocks() -> None:
    a = blocks_of(SYSTEM + b"first question")
    b = blocks_of(SYSTEM + b"another question")
    assert len(a) == len(SYSTEM + b"first question") // BLOCK + 1  # the last one partial
    common = len(SYSTEM) // BLOCK
    assert a[:common] == b[:common]
    assert a[common] != b[common]
    # The same block after a different beginning is another block.
    assert blocks_of(b"x" * BLOCK + b"y" * BLOCK)[1] != blocks_of(b"z" * BLOCK + b"y" * BLOCK)[1]
    assert blocks_of(b"") == []


def test_a_replica_matches_the_leading_blocks_it_was_sent() -> None:
    sent = Sent()
    conversation = blocks_of(SYSTEM + b"first question, then its answer" * 20)
    sent.sent(conversation, "u1")
    sent.sent(blocks_of(SYSTEM + b"another question"), "u2")
    later = blocks_of(SYSTEM + b"first question, then its answer" * 30)
    common = len(SYSTEM) // BLOCK
    assert sent.matched(later, IDS) == [0, len(conversation) - 1, common, 0]
    # A block sent alone, without those before it, matches nothing: leading blocks only.
    alone = Sent()
    alone.sent(later[1:], "u0")
    assert alone.matched(later, IDS) == [0, 0, 0, 0]


def test_a_new_conversation_goes_where_its_system_prompt_is() -> None:
    _, sp = pool_of()
    first = sp.pick(key=SYSTEM + b"conversation 0, first question")
    assert first is not None
    others = [u for u in sp.snapshot.routable if u != first]
    # Its replica is busier than the others (within the bound): a new conversation on the
    # same system prompt still goes there, and no other replica prefills it.
    leases = [sp.lease_of(u) for u in (first, first, *others)]
    for n in range(1, 6):
        assert sp.pick(key=SYSTEM + f"conversation {n}, first question".encode()) == first
    # A prompt on another system prompt: by load, to one of the others.
    assert sp.pick(key=b"You are a pirate. " * 70 + b"first question") in others
    for lease in leases:
        lease.release()


def test_a_conversation_stays_where_its_first_request_went() -> None:
    _, sp = pool_of()
    for n in range(20):
        history = SYSTEM + f"conversation {n}'s first turn".encode() * 30
        first = sp.pick(key=history)
        assert first is not None
        for turn in range(5):
            # Another replica is sent the system prompt meanwhile; the conversation's turns
            # still match more blocks on its own.
            sp.pick(key=SYSTEM + f"someone else {n}, {turn}".encode())
            history += b" and its next turn" * 20
            assert sp.pick(key=history) == first


def test_a_replica_that_leaves_is_forgotten() -> None:
    pool, sp = pool_of()
    prefix = SYSTEM + b"a conversation"
    first = sp.pick(key=prefix)
    assert first is not None
    pool.set_health("llm", first.id, Health.UNHEALTHY)
    moved = sp.pick(key=prefix)
    assert moved is not None
    assert moved != first
    assert first.id not in sp.sent.pairs.values()
    # Back again, with an empty cache as far as the pool knows: the prefix stays where it
    # went since.
    pool.set_health("llm", first.id, Health.HEALTHY)
    for _ in range(4):
        assert sp.pick(key=prefix) == moved


def test_the_memory_keeps_the_most_recently_sent_blocks() -> None:
    sent = Sent(limit=100)
    keep = blocks_of(b"sent again and again" * 20)  # 2 blocks
    sent.sent(keep, "u0")
    for n in range(500):
        sent.sent(blocks_of(f"prompt {n} ".encode() * 40), IDS[n % 4])  # 2 blocks each
        if n % 20 == 0:
            sent.sent(keep, "u0")
    assert len(sent.pairs) == 100
    assert sent.matched(keep, IDS) == [2, 0, 0, 0]
    assert sent.matched(blocks_of(b"prompt 0 " * 40), IDS) == [0, 0, 0, 0]
    assert sent.matched(blocks_of(b"prompt 499 " * 40), IDS) == [0, 0, 0, 2]
