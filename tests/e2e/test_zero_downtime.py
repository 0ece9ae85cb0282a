"""The short CI version of the zero-downtime harness (``bench/zero_downtime.py``, issue 6).

Scenarios 1, 3, 4 and 11 with the harness's ``SHORT`` profile: 2 replicas that start in
0.2 s, a smaller load mix (short, slow, SSE, upload, WebSocket; for 11, a gRPC service, unary
calls and server streams held across the drains, grpcio), tight timeouts and no retries, a
few seconds each. The gateway runs as a process of its own, driven through its admin API, exactly
as in the full harness. Each test fails on any failed request and on any check of the
scenario that did not hold (rollout outcome, replicas left alone, floor of ready replicas,
replica processes left behind).

3c (a new revision that passes its probe, then crashes) differs in two ways, both said in its
title: it sends only requests a proxy can replay (short and slow GETs), since a crash loses
the streams, uploads and WebSockets in flight on the crashing replica, which no proxy can
make whole (the full harness counts and reports those); and it sets ``min_ready`` above the
crash time, since two replicas that start in a blink could otherwise complete the rollout
before they crash (then nothing is rolled back, by design).

The last test is the deterministic regression test of the controller fix that 3c found.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.zero_downtime import SHORT, Row, run_scenarios
from controller.backends import FakeBackend
from controller.journal import Journal
from controller.operations import Controller
from controller.planning.model import ReplicaState
from controller.store import Store
from gateway import Health, Pool

pytestmark = pytest.mark.timeout(60)


def _explain(row: Row) -> str:
    failures = "; ".join(f"{o.kind} r{o.revision}: {o.error}" for o in row.failures[:5])
    return (
        f"[{row.key}] {row.title}: {row.summary.failed} of {row.summary.requests} requests "
        f"failed ({failures}); rollout: {row.rollout}; checks that did not hold: {row.problems}"
    )


async def _scenario(number: int, tmp_path: Path, keys: list[str]) -> None:
    rows = await run_scenarios([number], SHORT, tmp_path, verbose=False)
    assert [row.key for row in rows] == keys, [_explain(row) for row in rows]
    for row in rows:
        assert row.summary.requests > 0, _explain(row)
        assert row.passed, _explain(row)


async def test_rolling_update_under_load_loses_no_request(tmp_path: Path) -> None:
    await _scenario(1, tmp_path, ["1"])


async def test_failing_revisions_are_rolled_back_and_revision_1_serves(tmp_path: Path) -> None:
    await _scenario(3, tmp_path, ["3a", "3b", "3c"])


async def test_exhausted_capacity_degrades_and_fails_the_rollout_only(tmp_path: Path) -> None:
    await _scenario(4, tmp_path, ["4a", "4b"])


async def test_a_grpc_rolling_update_waits_for_the_streams_it_drains(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    await _scenario(11, tmp_path, ["11"])


async def test_a_rollback_takes_back_the_old_replicas_still_draining(tmp_path: Path) -> None:
    """Regression (found by 3c with 2 replicas): a rollout fails while it drains the last
    old replica; the rollback used to let that replica drain away and start a fresh one, so
    when the remaining new replica crashed too there was no routable replica for a moment.
    Fake backend, no clock: deterministic."""
    loop = asyncio.get_running_loop()
    pool = Pool(clock=loop.time)
    store = Store(tmp_path / "state.db")
    backend = FakeBackend()
    controller = Controller(
        pool, {"process": backend}, store, Journal(store, loop.time), loop.time, loop.time
    )

    async def settle() -> None:
        for _ in range(30):
            await asyncio.sleep(0)

    def replicas(*states: ReplicaState, revision: int) -> list[str]:
        observed = controller.state("web").observed
        return [r.id for r in observed.replicas if r.state in states and r.revision == revision]

    async def pass_probes(revision: int) -> None:
        for rid in replicas(ReplicaState.STARTING, revision=revision):
            pool.set_health("web", rid, Health.HEALTHY, "probe passed")
        await settle()

    def spec(version: str) -> dict[str, object]:
        return {
            "name": "web",
            "route": {"path_prefix": "/"},
            "replicas": 1,
            "replica": {"commands": ["serve"], "env": {"VERSION": version}},
            "rollout": {"retries": 0, "drain_timeout": 600},
        }

    try:
        await controller.apply(spec("v1"))
        await settle()
        await pass_probes(1)
        (old,) = replicas(ReplicaState.READY, revision=1)
        lease = pool.service("web").lease()  # a request in flight keeps its drain going
        assert lease is not None
        assert lease.upstream.id == old
        await controller.apply(spec("v2"))
        await settle()
        await pass_probes(2)
        assert replicas(ReplicaState.DRAINING, revision=1) == [old]
        started = len(backend.started)
        (new,) = replicas(ReplicaState.READY, revision=2)
        backend.kill(new, code=1)  # the new revision crashes: the rollout fails
        await settle()
        rollouts = [(r.kind, r.to_revision, r.status) for r in store.rollouts("web")]
        assert rollouts[:2] == [("rollback", 1, "complete"), ("rollout", 2, "failed")]
        assert replicas(ReplicaState.READY, revision=1) == [old]
        assert [u.id for u in pool.service("web").snapshot.routable] == [old]
        assert len(backend.started) == started  # nothing started to replace it
        assert old not in backend.stopped
        lease.release()
    finally:
        await controller.close()
        store.close()
