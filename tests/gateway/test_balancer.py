"""The load-balancing policies: exact distributions, load preference, seeded randomness."""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.pool import balancer
from gateway.pool.balancer import least_outstanding, p2c, pick, round_robin
from gateway.pool.upstream import Health, Upstream


def ups(*weights: int) -> tuple[Upstream, ...]:
    return tuple(
        Upstream(f"u{i}", "svc", "127.0.0.1", 9000 + i, weight=w, health=Health.HEALTHY)
        for i, w in enumerate(weights)
    )


def counts(picked: Sequence[Upstream]) -> dict[str, int]:
    return dict(collections.Counter(u.id for u in picked))


# -- round_robin ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights",
    [(1,), (1, 1), (1, 1, 1), (1, 2), (3, 1, 2), (5, 1), (2, 2), (1, 1, 4, 1)],
)
@pytest.mark.parametrize("start", [0, 1, 7, 1000])
def test_round_robin_is_exact_over_any_cycle(weights, start):
    candidates = ups(*weights)
    rng = random.Random(0)
    cycle = sum(weights)
    picked = [round_robin(candidates, {}, rng, c) for c in range(start, start + cycle)]
    assert counts(picked) == {u.id: u.weight for u in candidates}


def test_round_robin_equal_weights_rotate_in_order():
    candidates = ups(1, 1, 1)
    picked = [round_robin(candidates, {}, random.Random(0), c).id for c in range(6)]
    assert picked == ["u0", "u1", "u2", "u0", "u1", "u2"]


def test_round_robin_ignores_load():
    candidates = ups(1, 1)
    busy = {"u0": 100}
    assert round_robin(candidates, busy, random.Random(0), 0).id == "u0"


# -- least_outstanding ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "inflight", "expected"),
    [
        ((1, 1, 1), {"u0": 2, "u1": 1, "u2": 3}, "u1"),
        ((1, 1, 1), {"u0": 1, "u1": 1}, "u2"),  # absent means 0
        ((1, 3), {"u0": 1, "u1": 2}, "u1"),  # 2/3 < 1/1
        ((1, 3), {"u0": 1, "u1": 4}, "u0"),  # 4/3 > 1/1
        ((2, 1), {"u0": 3, "u1": 2}, "u0"),  # 1.5 < 2
    ],
)
@pytest.mark.parametrize("cursor", [0, 1, 2, 5])
def test_least_outstanding_prefers_fewest_in_flight_per_weight(weights, inflight, expected, cursor):
    assert least_outstanding(ups(*weights), inflight, random.Random(0), cursor).id == expected


def test_least_outstanding_rotates_ties():
    candidates = ups(1, 1, 1, 1)
    inflight = {"u0": 5, "u1": 1, "u2": 1, "u3": 1}
    picked = [least_outstanding(candidates, inflight, random.Random(0), c).id for c in range(6)]
    # Each cursor starts the scan at another candidate; the first least-loaded one wins.
    assert picked == ["u1", "u1", "u2", "u3", "u1", "u1"]
    idle = [least_outstanding(candidates, {}, random.Random(0), c).id for c in range(4)]
    assert idle == ["u0", "u1", "u2", "u3"]


def test_least_outstanding_weighted_ties_rotate():
    candidates = ups(2, 1)
    inflight = {"u0": 2, "u1": 1}  # both 1.0 per weight
    picked = {least_outstanding(candidates, inflight, random.Random(0), c).id for c in range(2)}
    assert picked == {"u0", "u1"}


# -- p2c -----------------------------------------------------------------------------------


class SpyRandom(random.Random):
    """A seeded Random that remembers the pair p2c drew."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.drawn: list[Upstream] = []

    def choices(self, population, weights=None, *, cum_weights=None, k=1):
        out = super().choices(population, weights, cum_weights=cum_weights, k=k)
        self.drawn = list(out)
        return out


def test_p2c_single_candidate():
    [only] = ups(1)
    assert p2c((only,), {"u0": 10}, random.Random(0), 0) is only


@pytest.mark.parametrize("seed", range(5))
def test_p2c_never_picks_the_more_loaded_of_its_two(seed):
    candidates = ups(1, 2, 1, 3, 1)
    rng = SpyRandom(seed)
    loads = random.Random(seed + 100)
    for cursor in range(500):
        inflight = {u.id: loads.randrange(6) for u in candidates}
        chosen = p2c(candidates, inflight, rng, cursor)
        a, b = rng.drawn
        if a is b:  # p2c then draws another one: the chosen one is one of the two
            assert chosen is a or inflight[chosen.id] / chosen.weight <= inflight[a.id] / a.weight
            continue
        assert chosen in (a, b)
        other = b if chosen is a else a
        assert inflight[chosen.id] / chosen.weight <= inflight[other.id] / other.weight


@pytest.mark.parametrize("seed", range(3))
def test_p2c_never_picks_the_unique_most_loaded(seed):
    candidates = ups(1, 1, 1)
    inflight = {"u0": 0, "u1": 1, "u2": 9}
    rng = random.Random(seed)
    picked = counts([p2c(candidates, inflight, rng, c) for c in range(300)])
    assert "u2" not in picked


def test_p2c_spreads_load():
    """Picks that hold their lease: p2c keeps in-flight counts within a narrow band."""
    candidates = ups(1, 1, 1, 1)
    rng = random.Random(42)
    inflight = dict.fromkeys((u.id for u in candidates), 0)
    for cursor in range(400):
        inflight[p2c(candidates, inflight, rng, cursor).id] += 1
    assert sum(inflight.values()) == 400
    assert max(inflight.values()) - min(inflight.values()) <= 10


def test_p2c_idle_distribution_is_even():
    candidates = ups(1, 1, 1)
    rng = random.Random(7)
    picked = counts([p2c(candidates, {}, rng, c) for c in range(3000)])
    assert all(800 <= n <= 1200 for n in picked.values()), picked


def test_p2c_is_deterministic_for_a_seed():
    candidates = ups(1, 2, 3)
    rng_a, rng_b = random.Random(3), random.Random(3)
    first = [p2c(candidates, {}, rng_a, c).id for c in range(50)]
    second = [p2c(candidates, {}, rng_b, c).id for c in range(50)]
    assert first == second


# -- pick ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(balancer.POLICIES))
def test_pick_of_nothing_is_none(policy):
    assert pick(policy, (), {}, random.Random(0), 0) is None


@given(
    policy=st.sampled_from(sorted(balancer.POLICIES)),
    weights=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=8),
    loads=st.lists(st.integers(min_value=0, max_value=20), max_size=8),
    seed=st.integers(min_value=0, max_value=2**32),
    cursor=st.integers(min_value=0, max_value=10**6),
)
def test_pick_always_returns_one_of_the_candidates(policy, weights, loads, seed, cursor):
    candidates = ups(*weights)
    inflight = {f"u{i}": n for i, n in enumerate(loads)}
    chosen = pick(policy, candidates, inflight, random.Random(seed), cursor)
    assert chosen is not None
    assert any(chosen is u for u in candidates)
