"""``pool.inference``: the pick by load and prompt prefix, pure, on generated pools."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.pool.balancer import least_outstanding
from gateway.pool.hashring import Ring, key_hash
from gateway.pool.inference import KV_WEIGHT, ReplicaLoad, load_of, pick
from gateway.pool.upstream import AdminState, Health, Upstream

KEYS = [key_hash(f"system prompt {i}".encode()) for i in range(400)]


def upstream(i: int, health: Health = Health.HEALTHY, **changes: object) -> Upstream:
    return Upstream(f"u{i}", "llm", "127.0.0.1", 9000 + i, health=health).replace(**changes)


def report(waiting: float, running: float, kv: float, at: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(waiting, running, kv, at, at + 3.0)


def test_the_load_counts_a_fresh_report_and_falls_back_to_in_flight() -> None:
    fresh = report(waiting=2, running=5, kv=1.0)
    assert load_of(1, fresh, now=1.0) == 1 + 6 + KV_WEIGHT  # beyond one: other clients'
    # Of the reported requests, those the gateway had in flight itself count once.
    ours = ReplicaLoad(2, 5, 1.0, 0.0, 3.0, own=4)
    assert load_of(1, ours, now=1.0) == 1 + 2 + KV_WEIGHT
    assert load_of(9, ReplicaLoad(2, 5, 1.0, 0.0, 3.0, own=9), now=1.0) == 9 + KV_WEIGHT
    assert load_of(1, fresh, now=3.0) == 1.0  # expired: in-flight alone
    assert load_of(1, None, now=0.0) == 1.0


def test_a_report_that_agrees_with_the_count_adds_nothing() -> None:
    # One request more than the gateway's own (one ended as the count was read) and a cache
    # with room: the in-flight count alone.
    assert load_of(3, ReplicaLoad(0, 4, 0.5, 0.0, 3.0, own=3), now=1.0) == 3.0
    assert load_of(3, ReplicaLoad(0, 4, 0.8, 0.0, 3.0, own=3), now=1.0) == 3.0
    # Past 80 % the cache weighs, up to KV_WEIGHT requests when full.
    assert load_of(3, ReplicaLoad(0, 3, 0.9, 0.0, 3.0, own=3), now=1.0) == 3 + KV_WEIGHT / 2


def test_an_unseen_prefix_is_placed_by_in_flight_counts_in_turn() -> None:
    # Unique prompts with the reports a scrape gives: each a few requests, the cache far from
    # full, one request apart from the gateway's count. They decide nothing, nor does the
    # ring: the pick is least_outstanding's (ties in turn), never the one that reported fewer
    # requests last (the one with the newest requests).
    ups = [upstream(i) for i in range(4)]
    ring = Ring([u.id for u in ups])
    rng = random.Random(57)
    for cursor in range(200):
        counts = {u.id: rng.randint(5, 7) for u in ups}
        reports = {
            uid: ReplicaLoad(0, c + rng.choice((-1, 0, 1)), c / 100, 0.0, 3.0, own=c)
            for uid, c in counts.items()
        }
        key = KEYS[cursor]
        chosen = pick(ups, counts, reports, 1.0, cursor, ring, key, fresh=True)
        assert chosen == least_outstanding(ups, counts, rng, cursor)
    # Even loads: one after the other, whoever owns the keys on the ring.
    firsts = [pick(ups, {}, {}, 0.0, cursor, ring, KEYS[0], fresh=True) for cursor in range(4)]
    assert firsts == ups


def test_the_least_loaded_wins_without_a_prefix() -> None:
    ups = [upstream(i) for i in range(3)]
    reports = {"u0": report(4, 4, 0.9), "u1": report(0, 1, 0.1), "u2": report(0, 3, 0.2)}
    assert pick(ups, {}, reports, now=1.0, cursor=0) == ups[1]
    # Stale reports: the in-flight counts decide.
    assert pick(ups, {"u1": 3, "u2": 1, "u0": 2}, reports, now=10.0, cursor=0) == ups[2]
    assert pick([], {}, {}, now=0.0, cursor=0) is None


def test_a_prefix_returns_to_its_replica_until_it_is_a_hot_spot() -> None:
    ups = [upstream(i) for i in range(4)]
    ring = Ring([u.id for u in ups])
    key = KEYS[0]
    home = pick(ups, {}, {}, now=0.0, cursor=0, ring=ring, key=key)
    assert home is not None
    for cursor in range(10):
        assert pick(ups, {}, {}, now=0.0, cursor=cursor, ring=ring, key=key) == home
    # Its replica reports a long queue: the prefix goes on round the ring, the same way
    # every time.
    busy = {home.id: report(waiting=20, running=8, kv=1.0)}
    elsewhere = pick(ups, {}, busy, now=0.0, cursor=0, ring=ring, key=key)
    assert elsewhere not in (None, home)
    assert pick(ups, {}, busy, now=0.0, cursor=5, ring=ring, key=key) == elsewhere
    assert elsewhere is not None
    assert elsewhere.id == next(u for u in ring.owners_from(key) if u != home.id)


def test_a_known_prefix_goes_to_its_home_within_the_bound_then_round_the_ring() -> None:
    # A conversation's first request went to its replica in turn (the pool's memory: its
    # home), not to the ring owner of its prefix: its next requests follow it there.
    ups = [upstream(i) for i in range(4)]
    ring = Ring([u.id for u in ups])
    key = KEYS[1]
    home = next(u for u in ups if u.id != ring.owners_from(key)[0])
    for cursor in range(10):
        chosen = pick(ups, {}, {}, 0.0, cursor, ring, key, fresh=False, home=home.id)
        assert chosen == home
    # Busier than the others but within the bound: it stays.
    counts = {u.id: 1 for u in ups} | {home.id: 3}
    assert pick(ups, counts, {}, 0.0, 0, ring, key, 2.0, False, home.id) == home
    # A hot spot (over twice the mean): round the ring from the key, skipping it.
    counts = {u.id: 1 for u in ups} | {home.id: 6}
    spill = pick(ups, counts, {}, 0.0, 0, ring, key, 2.0, False, home.id)
    assert spill is not None
    assert spill.id == next(u for u in ring.owners_from(key) if u != home.id)
    # A home that is not a candidate (gone, or at its cap): as without one.
    rest = [u for u in ups if u != home]
    assert pick(rest, {}, {}, 0.0, 0, ring, key, 2.0, False, home.id) == pick(
        rest, {}, {}, 0.0, 0, ring, key
    )


pools = st.integers(min_value=1, max_value=12)


@settings(max_examples=200, deadline=None)
@given(
    n=pools,
    states=st.lists(st.sampled_from(["healthy", "unhealthy", "draining", "ejected"]), max_size=12),
    inflight=st.lists(st.integers(min_value=0, max_value=50), max_size=12),
    kvs=st.lists(st.floats(min_value=0, max_value=1), max_size=12),
    key=st.sampled_from([None, *KEYS[:20]]),
    now=st.floats(min_value=0, max_value=10),
    cursor=st.integers(min_value=0, max_value=1000),
    fresh=st.booleans(),
    home=st.one_of(st.none(), st.integers(min_value=0, max_value=11).map(lambda i: f"u{i}")),
)
def test_never_an_unroutable_replica(
    n: int,
    states: list[str],
    inflight: list[int],
    kvs: list[float],
    key: int | None,
    now: float,
    cursor: int,
    fresh: bool,
    home: str | None,
) -> None:
    ups = []
    for i in range(n):
        state = states[i] if i < len(states) else "healthy"
        u = upstream(i)
        if state == "unhealthy":
            u = u.replace(health=Health.UNHEALTHY)
        elif state == "draining":
            u = u.replace(admin=AdminState.DRAINING)
        elif state == "ejected":
            u = u.replace(ejected=True)
        ups.append(u)
    routable = [u for u in ups if u.routable]  # what the pool passes: routable candidates
    counts = {f"u{i}": c for i, c in enumerate(inflight)}
    reports = {f"u{i}": report(1, 2, kv, at=0.0) for i, kv in enumerate(kvs)}
    ring = Ring([u.id for u in ups])  # a ring of every upstream, unroutable ones too
    chosen = pick(routable, counts, reports, now, cursor, ring, key, fresh=fresh, home=home)
    if routable:
        assert chosen in routable
    else:
        assert chosen is None


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=12),
    inflight=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    factor=st.floats(min_value=1.0, max_value=3.0),
    key=st.sampled_from(KEYS),
    fresh=st.booleans(),
    home=st.one_of(st.none(), st.integers(min_value=0, max_value=11).map(lambda i: f"u{i}")),
)
def test_the_load_bound_is_held(
    n: int, inflight: list[int], factor: float, key: int, fresh: bool, home: str | None
) -> None:
    ups = [upstream(i) for i in range(n)]
    counts = {f"u{i}": c for i, c in enumerate(inflight[:n])}
    ring = Ring([u.id for u in ups])
    chosen = pick(ups, counts, {}, 0.0, 0, ring, key, factor, fresh, home)
    assert chosen is not None
    total = sum(counts.values())
    assert counts.get(chosen.id, 0) + 1 <= math.ceil(factor * (total + 1) / n)
    if fresh:  # a prefix no cache holds: by load alone
        assert counts.get(chosen.id, 0) == min(counts.get(u.id, 0) for u in ups)
    elif home is not None and home in counts and chosen.id != home and home in ring.ids:
        # Its home was passed over only as over the bound.
        assert counts[home] + 1 > math.ceil(factor * (total + 1) / n)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=2, max_value=12), which=st.integers(min_value=0, max_value=11))
def test_a_replica_added_or_removed_moves_only_its_share_of_prefixes(n: int, which: int) -> None:
    # Prefixes not remembered (or whose home is over the bound) go by the ring: a replica
    # that leaves moves only the prefixes it owned there.
    ups = [upstream(i) for i in range(n)]
    gone = ups[which % n]
    rest = [u for u in ups if u != gone]

    def picks(pool: list[Upstream], homes: list[str | None]) -> list[Upstream | None]:
        ring = Ring([u.id for u in pool])
        return [
            pick(pool, {}, {}, 0.0, 0, ring, key, home=home)
            for key, home in zip(KEYS, homes, strict=True)
        ]

    nowhere: list[str | None] = [None] * len(KEYS)
    before, after = picks(ups, nowhere), picks(rest, nowhere)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    # Removed: only the prefixes it held move; added back: only those come to it.
    assert all(b == gone for b, _ in moved)
    assert len(moved) == before.count(gone)
    # Remembered homes (the first requests placed in turn): the pool forgets the removed
    # replica, whose prefixes go by the ring; every other prefix stays at its home.
    homes: list[str | None] = [ups[i % n].id for i in range(len(KEYS))]
    assert picks(ups, homes) == [ups[i % n] for i in range(len(KEYS))]
    forgotten = [None if h == gone.id else h for h in homes]
    by_ring = picks(rest, nowhere)
    for i, (home, now_at) in enumerate(zip(homes, picks(rest, forgotten), strict=True)):
        assert now_at == (by_ring[i] if home == gone.id else ups[i % n])
