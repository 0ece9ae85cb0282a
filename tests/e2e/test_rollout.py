"""A rolling update with real replicas under continuous traffic (issue 3, e2e (a))."""

from __future__ import annotations

from controller.planning.model import ReplicaState
from tests.support.eventually import eventually

from .conftest import Gateways, Load, Watch, alive, serving, spec

LIVE = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY)


async def test_rolling_update_of_three_replicas_costs_no_request(gateways: Gateways, site) -> None:
    gw = await gateways.start()
    await serving(gw, spec(site("v1"), 3))
    old_pids = set(gw.pids(revision=1).values())
    assert len(old_pids) == 3

    async with Load(gw.url) as load:
        await load.more()
        assert load.bodies() == {"v1"}
        # Rules 1 and 2: never fewer than 3 ready replicas at any moment of the rollout.
        async with Watch(lambda: gw.ready() >= 3, "3 ready replicas") as floor:
            result = await gw.controller.apply(spec(site("v2"), 3))
            assert (result.action, result.revision) == ("rollout", 2)
            await eventually(
                lambda: (
                    gw.state().observed.rollout is None
                    and gw.ready(2) == 3
                    and not gw.replicas(*LIVE, revision=1)
                ),
                timeout=15,
                what="three ready replicas of revision 2 only",
            )
        after = load.mark()
        await load.more()

    assert not load.failures, load.summary()
    floor.assert_held()
    assert load.bodies(after) == {"v2"}
    assert load.bodies() == {"v1", "v2"}
    assert gw.state().observed.serving_revision == 2
    assert gw.rollouts()[0].status == "complete"
    # Every revision-1 process is gone, and three revision-2 ones serve.
    await eventually(
        lambda: not any(alive(p) for p in old_pids), timeout=5, what="revision-1 processes to end"
    )
    assert set(gw.pids()) == {r.id for r in gw.replicas(ReplicaState.READY, revision=2)}
    assert not old_pids & set(gw.pids().values())
