"""A traffic split by revision in the pool: weights whatever the replica counts, a side with
nothing routable gives its share to the other, and the split travels in the snapshot."""

from __future__ import annotations

import pickle
import random
from collections import Counter

import pytest

from gateway import Health, Pool, ServiceRouting, Upstream
from gateway.config import RouteConfig
from gateway.pool.snapshot import PoolSnapshot, Split


def pool_of(stable: int, canary: int, policy: str = "round_robin") -> Pool:
    pool = Pool(clock=lambda: 0.0, rng=random.Random(7))
    pool.set_service(
        ServiceRouting(name="web", route=RouteConfig(path_prefix="/"), load_balancing=policy)
    )
    for i in range(stable):
        pool.add_upstream(Upstream(f"s{i}", "web", "127.0.0.1", 9000 + i, revision=1))
        pool.set_health("web", f"s{i}", Health.HEALTHY)
    for i in range(canary):
        pool.add_upstream(Upstream(f"c{i}", "web", "127.0.0.1", 9100 + i, revision=2))
        pool.set_health("web", f"c{i}", Health.HEALTHY)
    return pool


def revisions(pool: Pool, n: int) -> Counter[int]:
    sp = pool.service("web")
    picked = Counter[int]()
    for _ in range(n):
        upstream = sp.pick()
        assert upstream is not None
        picked[upstream.revision] += 1
    return picked


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding", "p2c"])
@pytest.mark.parametrize(("stable", "canary", "weight"), [(4, 1, 25), (1, 4, 5), (3, 3, 50)])
def test_the_weight_holds_whatever_the_replica_counts(
    policy: str, stable: int, canary: int, weight: int
) -> None:
    pool = pool_of(stable, canary, policy)
    pool.set_split("web", (2, weight))
    n = 20_000
    picked = revisions(pool, n)
    # A binomial draw: 5 standard deviations either side.
    p = weight / 100
    sd = (n * p * (1 - p)) ** 0.5
    assert abs(picked[2] - n * p) < 5 * sd


def test_within_a_revision_the_policy_spreads_requests() -> None:
    pool = pool_of(2, 2)
    pool.set_split("web", (2, 50))
    sp = pool.service("web")
    ids = Counter(u.id for u in (sp.pick() for _ in range(4000)) if u is not None)
    assert set(ids) == {"s0", "s1", "c0", "c1"}
    assert min(ids.values()) > 800


@pytest.mark.parametrize("weight", [0, 25, 100])
def test_a_revision_with_nothing_routable_gives_its_share_to_the_other(weight: int) -> None:
    pool = pool_of(2, 1)
    pool.set_split("web", (2, weight))
    pool.set_health("web", "c0", Health.UNHEALTHY)
    assert revisions(pool, 200) == Counter({1: 200})
    pool.set_health("web", "c0", Health.HEALTHY)
    for uid in ("s0", "s1"):
        pool.set_health("web", uid, Health.UNHEALTHY)
    assert revisions(pool, 200) == Counter({2: 200})


def test_weight_0_sends_nothing_and_100_everything() -> None:
    pool = pool_of(2, 2)
    pool.set_split("web", (2, 0))
    assert revisions(pool, 500) == Counter({1: 500})
    pool.set_split("web", (2, 100))
    assert revisions(pool, 500) == Counter({2: 500})
    pool.set_split("web", None)
    assert set(revisions(pool, 500)) == {1, 2}


def test_the_split_survives_upstream_changes_and_is_announced() -> None:
    pool = pool_of(2, 1)
    events: list[str] = []

    class Listener:
        def on_pool_event(self, event: object) -> None:
            events.append(getattr(event, "reason", ""))

    pool.subscribe(Listener())
    pool.set_split("web", (2, 10))
    pool.set_split("web", (2, 10))  # no change, no event
    assert events == ["revision 2 at 10%"]
    pool.add_upstream(Upstream("c1", "web", "127.0.0.1", 9201, revision=2))
    pool.set_health("web", "c1", Health.HEALTHY)
    split = pool.service("web").snapshot.split
    assert split is not None
    assert (split.revision, split.weight) == (2, 10)
    assert [u.id for u in split.chosen] == ["c0", "c1"]
    assert [u.id for u in split.rest] == ["s0", "s1"]


def test_the_split_travels_in_the_snapshot_to_a_mirror() -> None:
    pool = pool_of(3, 1)
    pool.set_split("web", (2, 30))
    sp = pool.service("web")
    sent = pickle.loads(pickle.dumps(sp.snapshot))
    assert isinstance(sent, PoolSnapshot)
    mirror = Pool(clock=lambda: 0.0, rng=random.Random(3))
    mirror.install(sp.routing, sent)
    assert mirror.service("web").snapshot.weights == (2, 30)
    assert 1000 < revisions(mirror, 5000)[2] < 2000


def test_split_group_thresholds() -> None:
    a = Upstream("a", "web", "h", 1, revision=1, health=Health.HEALTHY)
    b = Upstream("b", "web", "h", 2, revision=2, health=Health.HEALTHY)
    split = Split.of(2, 25, (a, b))
    assert split.group(0.0) == (b,)
    assert split.group(0.2499) == (b,)
    assert split.group(0.25) == (a,)
    assert split.group(0.999) == (a,)
    assert pickle.loads(pickle.dumps(split)) == split
