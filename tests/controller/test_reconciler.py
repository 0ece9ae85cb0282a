"""The reconcile loop with the fake backend and a fake clock: no process, no sleep.

Each test drives observations (probe results through the pool, exits through the backend)
and checks what the controller did, including what it must never do (the background reports).
"""

from __future__ import annotations

import io
from typing import Any

import pytest

from controller.admin.views import service_view
from controller.cli.render import service_detail
from controller.errors import Conflict, HostFault, NoCapacity, SpecError
from controller.planning.model import ReplicaState, RolloutStatus
from gateway import Health, ProbeResult
from gateway.pool.inference import ReplicaLoad

from .conftest import Harness, spec

LIVE = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY)


async def serving(h: Harness, name: str = "web", replicas: int = 2, **extra: object) -> None:
    result = await h.controller.apply(spec(name, replicas, **extra))
    assert result.action == "created"
    await h.settle()
    await h.pass_probes(name)
    assert h.ready(name) == replicas
    assert h.state(name).observed.serving_revision == 1


async def test_new_service_starts_replicas_and_admits_them_only_when_healthy(h: Harness) -> None:
    await h.controller.apply(spec("web", 2))
    await h.settle()
    assert len(h.backend.started) == 2
    assert len(h.replicas("web", ReplicaState.STARTING)) == 2
    assert h.pool.service("web").snapshot.routable == ()
    assert h.state("web").observed.degraded == "0 of 2 replicas ready"
    await h.pass_probes("web")
    assert len(h.pool.service("web").snapshot.routable) == 2
    observed = h.state("web").observed
    assert observed.serving_revision == 1
    assert observed.rollout is None
    assert observed.degraded is None
    assert [r.status for r in h.store.rollouts("web")] == ["complete"]


async def test_identical_apply_changes_nothing(h: Harness) -> None:
    await serving(h)
    result = await h.controller.apply(spec("web", 2))
    assert result.action == "unchanged"
    await h.settle()
    assert len(h.backend.started) == 2


async def test_route_change_applies_without_restarting_replicas(h: Harness) -> None:
    await serving(h)
    result = await h.controller.apply(spec("web", 2, route={"path_prefix": "/new"}))
    assert result.action == "updated"
    assert result.changes == ("route.path_prefix",)
    await h.settle()
    assert len(h.backend.started) == 2
    assert h.pool.service("web").routing.route.path_prefix == "/new"


async def test_rolling_update_keeps_every_ready_replica_until_replaced(h: Harness) -> None:
    await serving(h, replicas=3)
    result = await h.controller.apply(spec("web", 3, version="v2"))
    assert (result.action, result.revision, result.changes) == ("rollout", 2, ("replica.env",))
    for _ in range(20):
        await h.settle()
        # Rule 1 and 2: never fewer than 3 ready replicas at any step.
        assert h.ready("web") >= 3
        if h.state("web").observed.rollout is None:
            break
        await h.pass_probes("web", revision=2)
    assert h.ready("web", revision=2) == 3
    assert not h.replicas("web", *LIVE, revision=1)
    assert h.state("web").observed.serving_revision == 2
    assert len(h.backend.stopped) == 3
    assert h.store.rollouts("web")[0].status == "complete"


async def test_scale_up_without_capacity_keeps_the_service_up_and_retries(h: Harness) -> None:
    """Background report: a failed scale-up terminated the service. Here it degrades."""
    h.backend.set_capacity(1)
    await serving(h, replicas=1)
    first = h.replicas("web", ReplicaState.READY)[0]
    result = await h.controller.scale("web", 2)
    assert result.action == "scaled"
    await h.settle()
    assert h.state("web").observed.degraded == (
        "1 of 2 replicas ready: no capacity: 1 of 1 slots in use"
    )
    assert h.backend.stopped == []
    assert h.replicas("web", ReplicaState.READY) == [first]
    attempts = len(h.backend.attempts)
    await h.advance(0.5)
    assert len(h.backend.attempts) == attempts  # backing off
    await h.advance(1.0)
    assert len(h.backend.attempts) == attempts + 1  # retried
    h.backend.set_capacity(2)
    await h.advance(10)
    await h.pass_probes("web")
    assert h.ready("web") == 2
    assert h.state("web").observed.degraded is None
    assert h.backend.stopped == []


async def test_rollout_without_capacity_fails_and_the_old_revision_keeps_serving(
    h: Harness,
) -> None:
    """Background report: a rollout whose replica could not be placed killed the service."""
    h.backend.set_capacity(1)
    await serving(h, replicas=1)
    old = h.replicas("web", ReplicaState.READY)[0]
    await h.controller.apply(spec("web", 1, version="v2"))
    for _ in range(10):
        await h.advance(10)
        assert h.replicas("web", ReplicaState.READY) == [old]
    rollouts = h.store.rollouts("web")
    failed = next(r for r in rollouts if r.to_revision == 2)
    assert failed.status == "failed"
    assert failed.reason == "no capacity: 1 of 1 slots in use (after 3 failures)"
    assert h.state("web").desired.revision == 1
    assert h.state("web").observed.serving_revision == 1
    assert rollouts[0].kind == "rollback"
    assert rollouts[0].status == "complete"
    assert h.backend.stopped == []


async def test_new_revision_that_exits_fails_the_rollout_only(h: Harness) -> None:
    await serving(h, replicas=2)
    for _ in range(3):
        h.backend.exit_on_start(3)
    await h.controller.apply(spec("web", 2, version="bad"))
    for _ in range(10):
        await h.advance(10)
        assert h.ready("web", revision=1) == 2
    failed = next(r for r in h.store.rollouts("web") if r.to_revision == 2)
    assert failed.status == "failed"
    assert failed.reason == "replica exited with code 3 (after 3 failures)"
    assert not h.replicas("web", *LIVE, revision=2)


async def test_starts_their_host_failed_do_not_fail_the_rollout(h: Harness) -> None:
    """Three starts failed by their host (an engine stopped mid-rollout: unreachable, or a
    server error on its way out) back off but fail nothing: the rollout completes."""
    await serving(h, replicas=2)
    h.backend.fail_next_start(HostFault("host b unreachable: engine gone"))
    for _ in range(2):
        h.backend.fail_next_start(HostFault("host b: failed to update store for object type"))
    await h.controller.apply(spec("web", 2, version="v2"))
    for _ in range(10):
        await h.advance(10)
        await h.pass_probes("web")
    assert len(h.backend.attempts) >= 2 + 3 + 2
    rollout = next(r for r in h.store.rollouts("web") if r.to_revision == 2)
    assert (rollout.status, rollout.kind) == ("complete", "rollout")
    assert h.ready("web", revision=2) == 2
    assert h.state("web").observed.serving_revision == 2


async def revision_2_starting(h: Harness) -> Any:
    """Revision 1 serving on two replicas, then revision 2 applied (``start_timeout`` 30 s,
    no retry): its first replica, starting."""
    rollout = {"retries": 0, "start_timeout": 30}
    await serving(h, replicas=2, rollout=rollout)
    await h.controller.apply(spec("web", 2, version="v2", rollout=rollout))
    await h.settle()
    (new,) = h.replicas("web", ReplicaState.STARTING, revision=2)
    return new


def failure_of_revision_2(h: Harness) -> str:
    failed = next(r for r in h.store.rollouts("web") if r.to_revision == 2)
    assert failed.status == "failed"
    reason: str = failed.reason
    return reason


async def test_new_revision_that_never_passes_its_probe_fails_after_start_timeout(
    h: Harness,
) -> None:
    new = await revision_2_starting(h)
    h.pool.set_health("web", new.id, Health.UNHEALTHY, "probe failed")
    await h.advance(29)
    assert h.replicas("web", ReplicaState.STARTING, revision=2)
    await h.advance(2)
    await h.settle()
    assert failure_of_revision_2(h) == "not ready within 30s: probe failed (after 1 failure)"
    assert h.ready("web", revision=1) == 2
    assert new.id in h.backend.stopped


async def test_a_replica_given_up_is_reported_with_its_latest_probe_failure(h: Harness) -> None:
    new = await revision_2_starting(h)
    # Unhealthy while it started (nothing listened yet); then it listens and answers 404.
    h.pool.set_health("web", new.id, Health.UNHEALTHY, "connection refused")
    for reason in ("connection refused", "HTTP 404", "HTTP 404"):
        h.controller.reconciler.on_probe(ProbeResult("web", new.id, "failure", 0.01, reason))
    await h.advance(10)
    # A probe that passes once, short of the threshold, changes nothing the user is told.
    h.controller.reconciler.on_probe(ProbeResult("web", new.id, "success", 0.01))
    await h.advance(21)
    await h.settle()
    assert failure_of_revision_2(h) == "not ready within 30s: HTTP 404 (after 1 failure)"
    assert h.ready("web", revision=1) == 2


async def test_a_serving_replica_keeps_its_verdict_through_one_failed_probe(h: Harness) -> None:
    await serving(h, replicas=1)
    (r,) = h.replicas("web", ReplicaState.READY)
    h.controller.reconciler.on_probe(ProbeResult("web", r.id, "timeout", 1.0, "timed out"))
    await h.settle()
    (after,) = h.replicas("web", ReplicaState.READY)
    assert (after.healthy, after.probe_failure, after.since) == (True, "", r.since)


async def test_on_failure_pause_keeps_new_replicas_and_old_ones(h: Harness) -> None:
    strategy = {"retries": 0, "on_failure": "pause"}
    await serving(h, replicas=2, rollout=strategy)
    h.backend.exit_on_start(1)
    await h.controller.apply(spec("web", 2, version="v2", rollout=strategy))
    await h.advance(5)
    rollout = h.state("web").observed.rollout
    assert rollout is not None
    assert rollout.status == "paused"
    assert h.ready("web", revision=1) == 2
    assert h.store.active_rollout("web").status == "paused"


@pytest.mark.parametrize("then", ["abort", "resume"])
async def test_on_failure_pause_keeps_the_unready_replica_for_inspection(
    h: Harness, then: str
) -> None:
    strategy = {"retries": 0, "start_timeout": 30, "on_failure": "pause"}
    await serving(h, replicas=2, rollout=strategy)
    await h.controller.apply(spec("web", 2, version="v2", rollout=strategy))
    await h.settle()
    (new,) = h.replicas("web", ReplicaState.STARTING, revision=2)
    h.pool.set_health("web", new.id, Health.UNHEALTHY, "probe failed")
    await h.advance(31)
    await h.settle()
    record = h.store.active_rollout("web")
    why = "not ready within 30s: probe failed"
    assert (record.status, record.reason) == ("paused", f"{why} (after 1 failure)")
    assert record.retries_used == 1
    # Kept: still running, still probed (not routed), its failure said; for as long as the
    # rollout stays paused.
    await h.advance(600)
    (kept,) = h.replicas("web", ReplicaState.STARTING, revision=2)
    assert (kept.id, kept.failure) == (new.id, why)
    assert new.id not in h.backend.stopped
    assert h.pool.upstream("web", new.id) is not None
    assert h.ready("web", revision=1) == 2
    if then == "abort":  # back to revision 1: the kept replica goes
        await h.controller.abort("web")
        await h.settle()
        assert h.state("web").observed.rollout is None
        assert h.ready("web", revision=1) == 2
    else:  # retried with its retries afresh: the kept replica is replaced
        await h.controller.resume("web")
        await h.settle()
        assert h.state("web").observed.rollout.status == "progressing"
        await h.pass_probes("web", revision=2)
        await h.settle()
        await h.pass_probes("web", revision=2)
        await h.settle()
        assert h.ready("web", revision=2) == 2
        assert h.state("web").observed.serving_revision == 2
    assert new.id in h.backend.stopped
    assert not h.replicas("web", *LIVE, revision=1 if then == "resume" else 2)


async def test_crashed_serving_replica_alone_is_replaced_with_backoff(h: Harness) -> None:
    await serving(h, replicas=2)
    victim, survivor = h.replicas("web", ReplicaState.READY)
    h.backend.kill(victim.id, code=-9)
    await h.settle()
    assert h.replicas("web", ReplicaState.READY) == [survivor]
    assert "killed by signal 9" in h.state("web").observed.degraded
    attempts = len(h.backend.attempts)
    await h.advance(1.1)
    assert len(h.backend.attempts) == attempts + 1
    await h.pass_probes("web")
    assert h.ready("web") == 2
    assert survivor.id not in h.backend.stopped


async def test_superseding_apply_treats_every_older_revision_as_old(h: Harness) -> None:
    await serving(h, replicas=2)
    await h.controller.apply(spec("web", 2, version="v2"))
    await h.settle()
    await h.pass_probes("web", revision=2)
    await h.controller.apply(spec("web", 2, version="v3"))
    for _ in range(20):
        await h.settle()
        assert h.ready("web") >= 2
        if h.state("web").observed.rollout is None:
            break
        await h.pass_probes("web", revision=3)
    assert h.ready("web", revision=3) == 2
    assert not h.replicas("web", *LIVE, revision=1)
    assert not h.replicas("web", *LIVE, revision=2)
    statuses = {r.to_revision: r.status for r in h.store.rollouts("web")}
    assert statuses == {1: "complete", 2: "superseded", 3: "complete"}


async def test_abort_returns_to_the_previous_revision(h: Harness) -> None:
    await serving(h, replicas=1)
    await h.controller.apply(spec("web", 1, version="v2"))
    await h.settle()
    await h.controller.abort("web")
    await h.settle()
    assert h.state("web").desired.revision == 1
    assert not h.replicas("web", *LIVE, revision=2)
    assert h.ready("web", revision=1) == 1
    assert h.state("web").observed.rollout is None
    with pytest.raises(Conflict):
        await h.controller.pause("web")


async def test_undo_rolls_back_to_the_previous_revision(h: Harness) -> None:
    await serving(h, replicas=1)
    await h.controller.apply(spec("web", 1, version="v2"))
    await h.settle()
    await h.pass_probes("web", revision=2)
    await h.settle()
    assert h.state("web").observed.serving_revision == 2
    rollout = await h.controller.undo("web")
    assert (rollout.kind, rollout.to_revision) == ("undo", 1)
    await h.settle()
    await h.pass_probes("web", revision=1)
    await h.settle()
    assert h.state("web").observed.serving_revision == 1
    assert h.ready("web", revision=1) == 1


async def test_pause_and_resume(h: Harness) -> None:
    await serving(h, replicas=2)
    await h.controller.apply(spec("web", 2, version="v2"))
    await h.controller.pause("web")
    await h.settle()
    started = len(h.backend.started)
    await h.advance(5)
    assert len(h.backend.started) == started
    with pytest.raises(Conflict):
        await h.controller.pause("web")
    await h.controller.resume("web")
    for _ in range(20):
        await h.settle()
        if h.state("web").observed.rollout is None:
            break
        await h.pass_probes("web", revision=2)
    assert h.ready("web", revision=2) == 2


async def test_delete_drains_and_stops_everything_then_forgets(h: Harness) -> None:
    await serving(h, replicas=2)
    await h.controller.delete("web")
    await h.settle()
    assert "web" not in h.controller.reconciler.services
    assert "web" not in h.pool.services
    assert len(h.backend.stopped) == 2
    assert h.store.service("web") is None


async def test_bad_spec_is_refused_and_changes_nothing(h: Harness) -> None:
    await serving(h, replicas=2)
    with pytest.raises(SpecError) as error:
        await h.controller.apply(spec("web", 2, rollout={"max_surge": -1}))
    assert error.value.errors[0]["field"] == "rollout.max_surge"
    await h.settle()
    assert h.state("web").desired.revision == 1
    assert len(h.backend.started) == 2


async def test_start_failure_is_one_replica_failure(h: Harness) -> None:
    h.backend.fail_next_start(NoCapacity("no capacity: fleet full"))
    await h.controller.apply(spec("web", 2))
    await h.settle()
    assert len(h.replicas("web", ReplicaState.STARTING)) == 1
    assert len(h.replicas("web", ReplicaState.FAILED)) == 1


async def test_restart_restores_services_and_adopts_running_replicas(h: Harness) -> None:
    await serving(h, replicas=2)
    running = set(h.backend.running)
    await h.controller.close()
    from controller.journal import Journal
    from controller.operations import Controller
    from gateway import Pool

    pool = Pool(clock=h.clock)
    controller = Controller(
        pool, {"process": h.backend}, h.store, Journal(h.store, h.clock), h.clock, h.clock
    )
    controller.restore()
    h.controller, h.pool = controller, pool
    await h.settle()
    assert set(h.backend.adopted) == running
    assert len(h.backend.started) == 2  # nothing started again
    await h.pass_probes("web")
    assert h.ready("web") == 2
    assert h.state("web").observed.serving_revision == 1


async def test_reapplying_the_serving_spec_mid_rollout_keeps_its_replicas(h: Harness) -> None:
    await serving(h, replicas=2)
    old = {r.id for r in h.replicas("web", ReplicaState.READY)}
    await h.controller.apply(spec("web", 2, version="v2"))
    await h.settle()
    result = await h.controller.apply(spec("web", 2, version="v1"))
    assert (result.action, result.revision) == ("rollout", 1)
    await h.settle()
    await h.pass_probes("web")
    assert {r.id for r in h.replicas("web", ReplicaState.READY)} == old
    assert not h.replicas("web", *LIVE, revision=2)
    assert [r.number for r in h.store.revisions("web")] == [1, 2]
    assert h.state("web").observed.rollout is None


# -- a staged rollout survives a restart (issue 27) -------------------------------------------

SHIFT = 50_000.0
"""The restarted controller's monotonic clock reads this much more than the first's."""

STEPS = [{"weight": 25, "pause": 10}, {"weight": 50, "pause": 10}]


async def restart(h: Harness, downtime: float = 0.0) -> None:
    """Close the controller (its replicas keep running) and, ``downtime`` later, start another
    on the same store, with a monotonic clock of another origin (``SHIFT``) and a wall clock
    that agrees with the store's."""
    from controller.journal import Journal
    from controller.operations import Controller
    from gateway import Pool

    await h.controller.close()
    h.clock.advance(downtime)

    def mono() -> float:
        return h.clock.now + SHIFT

    def wall() -> float:
        return h.clock.now + 1_700_000_000

    pool = Pool(clock=mono)
    controller = Controller(
        pool, {"process": h.backend}, h.store, Journal(h.store, mono), mono, wall
    )
    controller.restore()
    h.controller, h.pool = controller, pool
    await h.settle()


def shifted(rollout: Any, by: float) -> dict[str, Any]:
    """What a restore must bring back of ``rollout``: its times on a clock ``by`` ahead."""

    def move(t: float | None) -> float | None:
        return None if t is None else t + by

    return {
        "id": rollout.id,
        "status": rollout.status,
        "strategy": rollout.strategy,
        "step": rollout.step,
        "weight": rollout.weight,
        "promoted": rollout.promoted,
        "verdict": rollout.verdict,
        "analysis": rollout.analysis,
        "reason": rollout.reason,
        "started": move(rollout.started),
        "step_since": move(rollout.step_since),
        "holding_since": move(rollout.holding_since),
    }


async def canary_at_step_2(h: Harness, **rollout: Any) -> None:
    """Revision 2 of four replicas held at 50 % (step 2 of 3), 4 s into its 10 s pause."""
    strategy = {"strategy": "canary", "steps": STEPS, **rollout}
    await serving(h, replicas=4, rollout=strategy)
    await h.controller.apply(spec("web", 4, version="v2", rollout=strategy))
    await h.settle()
    await h.pass_probes("web", revision=2)
    assert h.state("web").observed.split == (2, 25)
    await h.advance(10)
    await h.pass_probes("web", revision=2)
    assert h.state("web").observed.split == (2, 50)
    await h.advance(4)


async def test_a_canary_at_step_2_of_3_goes_on_at_its_step_after_a_restart(h: Harness) -> None:
    await canary_at_step_2(h)
    before = h.state("web").observed.rollout
    assert (before.strategy, before.step, before.weight) == ("canary", 1, 50)
    kept = h.store.active_rollout("web")
    assert kept is not None
    assert kept.strategy_json is not None

    await restart(h, downtime=3)
    after = h.state("web").observed.rollout
    assert shifted(after, 0) == shifted(before, SHIFT)
    assert h.state("web").observed.split == (2, 50)  # set in the new pool at once
    assert h.pool.service("web").snapshot.split is not None
    assert len(h.backend.started) == 6  # nothing started again: 4 old, 2 canary
    assert any("goes on at step 2, revision 2 at 50%" in e.message for e in h.store.events("web"))
    await h.pass_probes("web")

    # Its pause goes on where it was: 10 s from when the weight was set, downtime included.
    await h.advance(2.5)
    assert h.state("web").observed.rollout.step == 1
    await h.advance(1)
    assert h.state("web").observed.rollout.step == 2
    for _ in range(5):
        await h.pass_probes("web", revision=2)
        await h.advance(1)
    assert h.state("web").observed.rollout is None
    assert h.ready("web", revision=2) == 4
    assert [r.status for r in h.store.rollouts("web")][:1] == ["complete"]


async def test_a_paused_canary_stays_paused_at_its_weight_after_a_restart(h: Harness) -> None:
    await canary_at_step_2(h)
    await h.controller.pause("web")
    before = h.state("web").observed.rollout
    assert before.status is RolloutStatus.PAUSED

    await restart(h, downtime=30)  # longer than the pause: a paused step does not move
    after = h.state("web").observed.rollout
    assert shifted(after, 0) == shifted(before, SHIFT)
    assert h.state("web").desired.paused
    assert h.state("web").observed.split == (2, 50)
    await h.pass_probes("web")
    await h.advance(60)
    assert h.state("web").observed.rollout.step == 1
    assert h.state("web").observed.split == (2, 50)

    await h.controller.resume("web")  # the step holds its weight again, a fresh pause
    await h.settle()
    assert h.state("web").observed.rollout.status is RolloutStatus.PROGRESSING
    assert h.store.active_rollout("web").retries_used == 0
    await h.advance(11)
    assert h.state("web").observed.rollout.step == 2


async def test_a_blue_green_after_its_switch_keeps_blue_for_keep_previous_across_a_restart(
    h: Harness,
) -> None:
    bg = {"strategy": "blue_green", "keep_previous": 60}
    await serving(h, replicas=2, rollout=bg)
    await h.controller.apply(spec("web", 2, version="v2", rollout=bg))
    await h.settle()
    await h.pass_probes("web", revision=2)
    assert h.state("web").observed.split == (2, 0)
    await h.controller.promote("web")
    await h.settle()
    assert h.state("web").observed.split == (2, 100)
    await h.advance(20)
    before = h.state("web").observed.rollout
    assert (before.strategy, before.step, before.weight, before.promoted) == (
        "blue_green",
        1,
        100,
        True,
    )

    await restart(h, downtime=5)
    after = h.state("web").observed.rollout
    assert shifted(after, 0) == shifted(before, SHIFT)
    assert h.state("web").observed.split == (2, 100)
    await h.pass_probes("web")
    # Blue is kept 60 s after the switch: 25 s have passed, downtime included.
    await h.advance(34)
    assert h.ready("web", revision=1) == 2
    await h.advance(1.5)
    assert not h.replicas("web", *LIVE, revision=1)
    await h.advance(1)
    assert h.state("web").observed.rollout is None
    assert h.state("web").observed.serving_revision == 2


async def test_a_canary_waiting_for_its_first_replica_is_still_a_canary_after_a_restart(
    h: Harness,
) -> None:
    """Its strategy is recorded with the rollout (create_rollout), before any step."""
    strategy = {"strategy": "canary", "steps": STEPS}
    await serving(h, replicas=4, rollout=strategy)
    await h.controller.apply(spec("web", 4, version="v2", rollout=strategy))
    await h.settle()
    before = h.state("web").observed.rollout
    assert (before.strategy, before.step, before.holding_since) == ("canary", 0, None)

    await restart(h, downtime=1)
    after = h.state("web").observed.rollout
    assert shifted(after, 0) == shifted(before, SHIFT)
    await h.pass_probes("web")
    assert h.state("web").observed.split == (2, 25)
    assert len(h.replicas("web", *LIVE, revision=1)) == 4  # nothing old goes before 100 %
    assert len(h.replicas("web", *LIVE, revision=2)) == 1


async def test_a_resumed_rolling_update_keeps_its_fresh_deadline_across_a_restart(
    h: Harness,
) -> None:
    """A resume gives the deadline afresh; the record keeps when (not only the first start)."""
    rolling = {"progress_deadline": 30, "start_timeout": 600}
    await serving(h, replicas=2, rollout=rolling)
    await h.controller.apply(spec("web", 2, version="v2", rollout=rolling))
    await h.settle()
    await h.controller.pause("web")
    await h.advance(100)
    await h.controller.resume("web")
    await h.settle()
    before = h.state("web").observed.rollout
    assert before.started == h.clock.now

    await restart(h, downtime=5)
    after = h.state("web").observed.rollout
    assert after.started == before.started + SHIFT
    await h.advance(20)  # 25 s after the resume: within its 30 s
    assert h.state("web").observed.rollout is not None
    assert h.store.active_rollout("web") is not None
    assert h.state("web").observed.rollout.id == before.id
    await h.advance(6)
    assert h.state("web").observed.rollout.kind == "rollback"
    failed = h.store.rollout(before.id)
    assert failed is not None
    assert failed.status == "failed"
    assert failed.reason.startswith("not complete within 30s")


async def test_a_rollout_whose_record_keeps_no_strategy_state_goes_on_as_a_rolling_update(
    h: Harness,
) -> None:
    """A record written before strategy_json existed (or unreadable) is a rolling update."""
    await canary_at_step_2(h)
    rid = h.state("web").observed.rollout.id
    with h.store.database.write() as conn:
        conn.execute("UPDATE rollouts SET strategy_json = 'not json' WHERE id = ?", (rid,))
    await restart(h)
    rollout = h.state("web").observed.rollout
    assert (rollout.id, rollout.strategy) == (rid, "rolling")


async def test_with_a_gate_a_healthy_replica_is_ready_only_once_every_node_routes_to_it(
    h: Harness,
) -> None:
    """A cluster's leader: healthy here is not enough; ``regate`` after the other nodes'
    reports say they route to it too."""
    everywhere: set[str] = set()
    h.controller.reconciler.gate = lambda service, uid: uid in everywhere
    await h.controller.apply(spec("web", 2))
    await h.settle()
    await h.pass_probes("web")
    assert h.ready("web") == 0  # routable here, not yet on every node
    assert h.state("web").observed.serving_revision is None
    first, second = (r.id for r in h.replicas("web"))
    everywhere.add(first)
    h.controller.reconciler.regate()
    await h.settle()
    assert h.ready("web") == 1
    everywhere.add(second)
    h.controller.reconciler.regate()
    await h.settle()
    assert h.ready("web") == 2
    assert h.state("web").observed.serving_revision == 1


async def test_a_sample_takes_the_fresh_waiting_figures_of_the_routable_replicas(
    h: Harness,
) -> None:
    """``metric: queue``: a sample holds the waiting requests of the routable replicas whose
    figures have not expired, and counts the others; 6 waiting on one replica, target 4,
    scales 1 -> 2."""
    queue = {"metric": "queue", "target": 4, "scale_up_delay": 0}
    load_metrics = {"format": "vllm"}
    data = spec("web", 1, scaling=queue, load_metrics=load_metrics)
    await h.controller.apply(data | {"replicas": {"min": 1, "max": 3}})
    await h.settle()
    await h.pass_probes("web")
    sp = h.pool.service("web")
    (replica,) = sp.snapshot.routable
    now = h.clock()
    sp.reports = {replica.id: ReplicaLoad(3.0, 1.0, 0.2, now - 1.0, now + 2.0)}
    state = h.state("web")
    h.controller.reconciler.sample(state)
    last = state.observed.samples[-1]
    assert (last.waiting, last.reported, last.unreported) == (3.0, 1, 0)
    assert state.desired.replicas == 1  # 3 waiting, target 4

    h.clock.advance(2.0)  # the report expires
    h.controller.reconciler.sample(state)
    last = state.observed.samples[-1]
    assert (last.waiting, last.reported, last.unreported) == (0.0, 0, 1)
    holding = (
        "queue: no fresh figures from the replicas (load_metrics): no scale-down, holding at 1"
    )
    view = service_view(h.controller, state).model_dump(mode="json")
    assert view["autoscaling"]["holding"] == holding
    shown = io.StringIO()
    service_detail(view, False, shown)
    assert f"holding: {holding}" in shown.getvalue()

    now = h.clock()
    sp.reports = {replica.id: ReplicaLoad(6.0, 1.0, 0.2, now, now + 3.0)}
    h.controller.reconciler.sample(state)
    await h.settle()
    assert state.desired.replicas == 2
    assert state.observed.scaler.decision == "queue 6 per replica now > target 4: 1 -> 2"
