"""The data plane with real replicas: a replica killed under load (issue 2, Tests)."""

from __future__ import annotations

import os
import signal
import time

from controller.planning.model import ReplicaState
from tests.support.eventually import eventually

from .conftest import Gateways, Load, Watch, alive, serving, spec


async def test_killing_a_replica_under_load_costs_no_request(gateways: Gateways, site) -> None:
    gw = await gateways.start()
    await serving(gw, spec(site("v1"), 2))
    (victim_id, victim_pid), (survivor_id, survivor_pid) = sorted(gw.pids().items())

    async with (
        Load(gw.url) as load,
        Watch(lambda: alive(survivor_pid), "the other replica alive") as survivor,
    ):
        await load.more()
        killed = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)  # a replica this test's gateway started
        failed = await eventually(
            lambda: (r := gw.state().replica(victim_id)) and r.state is ReplicaState.FAILED and r,
            timeout=5,
            what="the killed replica to be seen failed",
        )
        # Only that replica is replaced, after the crash backoff; the other is left alone.
        await eventually(
            lambda: gw.ready() == 2 and victim_id not in gw.pids(),
            timeout=10,
            what="a replacement replica",
        )
        after = load.mark()
        await load.more(100)

    # A response the victim had begun when it died is cut: its head (http.server writes it
    # before the body, in a write of its own) had gone on to the client, so no proxy could
    # retry it. The kill rarely lands there (once in this suite's runs so far). Any other
    # failure fails the test.
    cut = [
        o
        for o in load.failures
        if o.at <= killed <= o.at + o.took
        and ("payload is not completed" in o.error or o.error.startswith("truncated"))
    ]
    assert [o for o in load.failures if o not in cut] == [], load.summary()
    survivor.assert_held()
    assert failed.failure == "replica killed by signal 9 (SIGKILL)"
    assert load.bodies() == {"v1"}
    assert not alive(victim_pid)
    pids = gw.pids()
    assert pids[survivor_id] == survivor_pid
    (replacement_id,) = set(pids) - {survivor_id}
    assert gw.state().replica(replacement_id).state is ReplicaState.READY
    assert set(gw.started_pids[:2]) == {victim_pid, survivor_pid}
    assert gw.started_pids[2:] == [pids[replacement_id]]  # one start: the replacement
    assert gw.state().observed.degraded is None
    # Both the survivor and the replacement answered once it was ready.
    assert {o.body for o in load.outcomes[after:]} == {"v1"}
