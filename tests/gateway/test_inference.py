"""``pool.inference``: the pick by load and prompt prefix, pure, on generated pools."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.pool.balancer import least_outstanding
from gateway.pool.inference import KV_WEIGHT, ReplicaLoad, load_of, pick
from gateway.pool.prefixes import Sent, blocks_of
from gateway.pool.upstream import AdminState, Health, Upstream


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


def test_a_prompt_no_replica_holds_is_placed_by_in_flight_counts_in_turn() -> None:
    # Unique prompts with the reports a scrape gives: each a few requests, the cache far from
    # full, one request apart from the gateway's count. They decide nothing: the pick is
    # least_outstanding's (ties in turn), never the one that reported fewer requests last
    # (the one with the newest requests).
    ups = [upstream(i) for i in range(4)]
    rng = random.Random(57)
    for cursor in range(200):
        counts = {u.id: rng.randint(5, 7) for u in ups}
        reports = {
            uid: ReplicaLoad(0, c + rng.choice((-1, 0, 1)), c / 100, 0.0, 3.0, own=c)
            for uid, c in counts.items()
        }
        chosen = pick(ups, counts, reports, 1.0, cursor, [0, 0, 0, 0])
        assert chosen == least_outstanding(ups, counts, rng, cursor)
    # Even loads: one after the other.
    assert [pick(ups, {}, {}, 0.0, cursor, [0] * 4) for cursor in range(4)] == ups


def test_the_least_loaded_wins_without_a_prefix() -> None:
    ups = [upstream(i) for i in range(3)]
    reports = {"u0": report(4, 4, 0.9), "u1": report(0, 1, 0.1), "u2": report(0, 3, 0.2)}
    assert pick(ups, {}, reports, now=1.0, cursor=0) == ups[1]
    # Stale reports: the in-flight counts decide.
    assert pick(ups, {"u1": 3, "u2": 1, "u0": 2}, reports, now=10.0, cursor=0) == ups[2]
    assert pick([], {}, {}, now=0.0, cursor=0) is None


def test_the_longest_held_prefix_wins_within_the_bound() -> None:
    ups = [upstream(i) for i in range(4)]
    # u2 was sent the conversation so far (9 blocks), u0 and u3 its system prompt (7): the
    # conversation goes back to u2, busier than the rest but within the bound.
    counts = {"u0": 2, "u1": 1, "u2": 3, "u3": 2}
    assert pick(ups, counts, {}, 0.0, 0, [7, 0, 9, 7]) == ups[2]
    # A new conversation on that system prompt: to a holder of it, the less loaded of the
    # two, not to the idle u1 that would prefill it all.
    assert pick(ups, counts | {"u3": 3}, {}, 0.0, 0, [7, 0, 7, 7]) == ups[0]
    # Equal holders, equal loads: in turn.
    assert [pick(ups, {}, {}, 0.0, c, [7, 0, 0, 7]) for c in range(4)] == [ups[0], ups[3]] * 2
    # The conversation's replica is a hot spot (over twice the mean): the next best holder.
    hot = {"u0": 1, "u1": 1, "u2": 8, "u3": 2}
    assert pick(ups, hot, {}, 0.0, 0, [7, 0, 9, 7]) == ups[0]
    # Every holder over the bound: by load.
    even = {"u0": 3, "u1": 0, "u2": 3, "u3": 0}
    assert pick(ups, even, {}, 0.0, 0, [7, 0, 9, 0], max_load_factor=1.0) == ups[1]
    # A replica that reports a long queue is passed over alike.
    busy = {"u2": report(waiting=20, running=8, kv=1.0)}
    assert pick(ups, {}, busy, 0.0, 0, [0, 0, 9, 1]) == ups[3]


pools = st.integers(min_value=1, max_value=12)


@settings(max_examples=200, deadline=None)
@given(
    n=pools,
    states=st.lists(st.sampled_from(["healthy", "unhealthy", "draining", "ejected"]), max_size=12),
    inflight=st.lists(st.integers(min_value=0, max_value=50), max_size=12),
    kvs=st.lists(st.floats(min_value=0, max_value=1), max_size=12),
    held=st.lists(st.integers(min_value=0, max_value=16), max_size=12),
    now=st.floats(min_value=0, max_value=10),
    cursor=st.integers(min_value=0, max_value=1000),
)
def test_never_an_unroutable_replica(
    n: int,
    states: list[str],
    inflight: list[int],
    kvs: list[float],
    held: list[int],
    now: float,
    cursor: int,
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
    # What the pool counts for the candidates (held[i] for u{i}; a list too short: none).
    matched = [held[int(u.id[1:])] if int(u.id[1:]) < len(held) else 0 for u in routable]
    chosen = pick(routable, counts, reports, now, cursor, matched)
    if routable:
        assert chosen in routable
    else:
        assert chosen is None


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=12),
    inflight=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    factor=st.floats(min_value=1.0, max_value=3.0),
    held=st.lists(st.integers(min_value=0, max_value=16), min_size=12, max_size=12),
    cursor=st.integers(min_value=0, max_value=1000),
)
def test_the_load_bound_is_held(
    n: int, inflight: list[int], factor: float, held: list[int], cursor: int
) -> None:
    ups = [upstream(i) for i in range(n)]
    counts = {f"u{i}": c for i, c in enumerate(inflight[:n])}
    matched = held[:n]
    chosen = pick(ups, counts, {}, 0.0, cursor, matched, factor)
    assert chosen is not None
    total = sum(counts.values())
    capacity = math.ceil(factor * (total + 1) / n)
    assert counts.get(chosen.id, 0) + 1 <= capacity
    within = [i for i in range(n) if counts.get(f"u{i}", 0) + 1 <= capacity]
    best = max((matched[i] for i in within), default=0)
    if best == 0:  # no replica within the bound holds a block: by load alone
        assert counts.get(chosen.id, 0) == min(counts.get(u.id, 0) for u in ups)
    else:  # the longest prefix held within the bound, the least loaded of its holders
        i = ups.index(chosen)
        assert matched[i] == best
        assert counts.get(chosen.id, 0) == min(
            counts.get(f"u{j}", 0) for j in within if matched[j] == best
        )


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=2, max_value=12), which=st.integers(min_value=0, max_value=11))
def test_a_replica_added_or_removed_moves_only_its_share_of_prefixes(n: int, which: int) -> None:
    # Each prompt was sent to one replica in turn (the pool's memory): a replica that leaves
    # is forgotten, and only its prompts move (by load); every other stays where it was. One
    # that joins holds nothing: it takes none of them.
    ups = [upstream(i) for i in range(n)]
    gone = ups[which % n]
    rest = [u for u in ups if u != gone]
    prompts = [f"system prompt {i % 7}, conversation {i}".encode() * 20 for i in range(60)]
    sent = Sent()
    for i, prompt in enumerate(prompts):
        sent.sent(blocks_of(prompt), ups[i % n].id)

    def picks(pool: list[Upstream]) -> list[Upstream | None]:
        ids = [u.id for u in pool]
        return [pick(pool, {}, {}, 0.0, 0, sent.matched(blocks_of(p), ids)) for p in prompts]

    assert picks(ups) == [ups[i % n] for i in range(len(prompts))]
    sent.keep({u.id for u in rest})
    after = picks(rest)
    for i, now_at in enumerate(after):
        if ups[i % n] == gone:
            assert now_at == rest[0]  # no holder left, even loads: by load, in turn
            sent.sent(blocks_of(prompts[i]), rest[0].id)
        else:
            assert now_at == ups[i % n]
    # Back again, holding nothing as far as the pool knows: every prompt stays.
    assert picks(ups) == after
