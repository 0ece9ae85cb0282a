"""``hashring``: the spread of keys over 2 to 50 upstreams, and that only a leaving
upstream's keys move."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from gateway.pool.hashring import Ring, key_hash

KEYS = [key_hash(f"user-{i}".encode()) for i in range(20_000)]
SIZES = [2, 3, 5, 10, 20, 50]


def owners(ring: Ring, skip: frozenset[str] = frozenset()) -> list[str | None]:
    return [ring.lookup(k, skip) for k in KEYS]


@pytest.mark.parametrize("n", SIZES)
def test_the_spread_is_even(n: int) -> None:
    ring = Ring([f"u{i}" for i in range(n)])
    counts = Counter(owners(ring))
    mean = len(KEYS) / n
    assert set(counts) == {f"u{i}" for i in range(n)}
    # 160 points each: every share within 35 % of the mean (measured: within 25 %).
    assert max(counts.values()) < 1.35 * mean, counts
    assert min(counts.values()) > 0.65 * mean, counts


@pytest.mark.parametrize("n", SIZES)
def test_only_the_keys_of_an_upstream_that_leaves_move(n: int) -> None:
    ids = [f"u{i}" for i in range(n)]
    before = owners(Ring(ids))
    gone = ids[n // 2]
    after = owners(Ring([u for u in ids if u != gone]))
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved, "the leaving upstream owned keys"
    assert all(b == gone for b, _ in moved)
    assert len(moved) == before.count(gone)
    # Skipping it (tried, or full) sends its keys exactly where its removal would.
    assert owners(Ring(ids), frozenset({gone})) == after


@pytest.mark.parametrize("n", SIZES)
def test_one_that_joins_takes_its_share_and_nothing_else_moves(n: int) -> None:
    ids = [f"u{i}" for i in range(n)]
    before = owners(Ring(ids))
    after = owners(Ring([*ids, "new"]))
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == "new" for _, a in moved)
    assert len(moved) < 1.5 * len(KEYS) / (n + 1)


def test_the_order_of_ids_and_the_process_do_not_matter() -> None:
    a = Ring(["x", "y", "z"])
    b = Ring(["z", "x", "y"])
    assert owners(a) == owners(b)
    # Not ``hash()``, salted per process: every worker sends a key to the same upstream.
    digest = hashlib.blake2b(b"user-1", digest_size=8).digest()
    assert key_hash(b"user-1") == int.from_bytes(digest, "big")


def test_everyone_skipped_or_nobody_there() -> None:
    assert Ring([]).lookup(KEYS[0]) is None
    assert Ring(["a", "b"]).lookup(KEYS[0], {"a", "b"}) is None
    assert repr(Ring(["a"], vnodes=4)) == "<Ring upstreams=1 points=4>"


@pytest.mark.parametrize("n", [1, 2, 5, 20])
def test_owners_from_a_key_go_round_as_lookup_with_skips(n: int) -> None:
    ring = Ring([f"u{i}" for i in range(n)])
    for key in KEYS[:200]:
        order = ring.owners_from(key)
        assert sorted(order) == sorted(ring.ids)
        for i, uid in enumerate(order):
            assert ring.lookup(key, frozenset(order[:i])) == uid
    assert Ring([]).owners_from(KEYS[0]) == []
