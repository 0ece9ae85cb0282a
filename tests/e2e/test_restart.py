"""A gateway restart adopts the replicas that kept running (issue 3, State), and keeps what
the API changed unless the config's own entry changed since it was last applied (issue 22)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from controller.config import document_digest
from controller.store import Store
from tests.support.eventually import eventually
from tests.support.strays import reap, spawn_stray

from .conftest import SERVER, Gateways, Load, alive, gateway_process, serving, spec


async def test_restart_adopts_running_replicas_at_the_serving_revision(
    gateways: Gateways, site
) -> None:
    first = await gateways.start(on_exit="keep")
    await serving(first, spec(site("v1"), 1))
    await first.controller.apply(spec(site("v2"), 2))
    await eventually(
        lambda: (
            first.state().observed.serving_revision == 2
            and first.state().observed.rollout is None
            and first.ready(2) == 2
            and not first.pids(revision=1)
        ),
        timeout=15,
        what="revision 2 serving alone",
    )
    kept = first.pids()
    assert len(kept) == 2
    await first.stop()
    assert all(alive(pid) for pid in kept.values()), "replicas_on_exit: keep stopped a replica"
    # And one the first gateway would have spawned just before a SIGKILL, with no record.
    log = gateways.state_dir / "logs" / "web-2-unrecorded.log"
    stray = spawn_stray(log, "exec sleep 1000")

    try:
        second = await gateways.start(on_exit="stop")
        assert not alive(stray), "a replica with no record outlived the restart"
    finally:
        reap(stray)
    state = second.state()
    assert state.desired.revision == 2
    assert state.observed.serving_revision == 2
    assert second.pids() == kept  # adopted: the same replicas, the same processes
    await eventually(
        lambda: second.ready(2) == 2, timeout=5, what="the adopted replicas to pass their probes"
    )
    async with Load(second.url) as load:
        await load.more(100)
    assert not load.failures, load.summary()
    assert load.bodies() == {"v2"}
    assert second.started_pids == []  # nothing was started again
    assert [r.status for r in second.rollouts()] == ["complete", "complete"]

    await second.controller.delete("web")
    await eventually(
        lambda: "web" not in second.controller.service_names(), timeout=10, what="the delete"
    )
    await eventually(
        lambda: not any(alive(p) for p in kept.values()), timeout=5, what="the replicas to end"
    )
    assert second.controller.store.service("web") is None
    # The first backend spawned these replicas: let it take in their exits, and collect now
    # so that a resource it leaked (an unclosed transport) is reported against this test.
    await asyncio.sleep(0.1)
    gc.collect()


def _stored(db: Path) -> tuple[list[Any], dict[str, int]]:
    """The service's rollouts and its stored replicas (id -> pid), empty if not there yet."""
    if not db.exists():
        return [], {}
    try:
        store = Store(db, readonly=True)
    except Exception:  # the first gateway has not created it yet
        return [], {}
    try:
        rollouts = store.rollouts("web")
        replicas = store.replicas("web")
    finally:
        store.close()
    return rollouts, {r.replica_id: json.loads(r.handle_json)["pid"] for r in replicas}


def _serving_pids(db: Path) -> dict[str, int] | None:
    """Replica id -> pid once the service is serving revision 1 with two replicas."""
    rollouts, pids = _stored(db)
    if not rollouts or rollouts[0].status != "complete" or len(pids) != 2:
        return None
    return pids


async def test_restart_of_the_gateway_process_keeps_adopted_replicas_serving(
    gateways: Gateways, site, tmp_path: Path
) -> None:
    """The first gateway is a process of its own, as in production, and it ends.

    Regression: replicas once wrote their output into a pipe to the gateway process; after it
    ended, every write failed (EPIPE) and http.server dropped each connection, so adopted
    replicas never passed a probe and the service was down after every restart.
    """
    config = gateways.config(on_exit="keep", services=[spec(site("v1"), 2)], log_level="warning")
    path = gateways.write_config(config)
    process = await gateway_process(path, tmp_path / "first-gateway.log")
    db = gateways.state_dir / "gateway.db"
    try:
        kept = await eventually(lambda: _serving_pids(db), timeout=15, what="the first gateway")
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()
        # Whatever happened, teardown makes sure the replicas it left behind end.
        gateways.other_pids |= set(_stored(db)[1].values())
    assert process.returncode == 0
    assert all(alive(pid) for pid in kept.values()), "replicas_on_exit: keep stopped a replica"

    second = await gateways.start(on_exit="stop")
    assert second.pids() == kept  # adopted
    assert second.state().observed.serving_revision == 1
    await eventually(
        lambda: second.ready(1) == 2, timeout=3, what="the adopted replicas to pass their probes"
    )
    async with Load(second.url) as load:
        await load.more(100)
    assert not load.failures, load.summary()
    assert load.bodies() == {"v1"}
    assert second.started_pids == []


# -- which source wins at start-up: the config's entry or the store (issue 22) ----------------
# The decision itself, controller.serving.startup_choice, is tested in
# tests/controller/test_startup_choice.py.


def test_document_digest_is_the_content_not_the_layout() -> None:
    assert document_digest({"a": 1, "b": [1, 2]}) == document_digest({"b": [1, 2], "a": 1})
    assert document_digest({"a": 1}) != document_digest({"a": 2})


async def test_restart_keeps_what_the_api_changed_until_the_config_file_changes(
    gateways: Gateways, site, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: every start applied the config's files again, so a restart rolled a service
    the API had moved to v2 back to the file's v1 (a rollout nobody asked for)."""
    caplog.set_level(logging.INFO, logger="gateway")
    spec_file = tmp_path / "web.json"
    spec_file.write_text(json.dumps(spec(site("v1"), 1)))
    services = [str(spec_file)]

    first = await gateways.start(on_exit="keep", services=services)
    # Its rollout complete, not only its replica ready: an apply in between supersedes it.
    await eventually(
        lambda: first.ready(1) == 1 and first.state().observed.rollout is None,
        timeout=10,
        what="revision 1 from the file, its rollout complete",
    )
    first_log = caplog.text
    await first.controller.apply(spec(site("v2"), 1))  # what `gateway apply` does
    await eventually(
        lambda: first.state().observed.serving_revision == 2 and not first.pids(revision=1),
        timeout=15,
        what="revision 2 from the API serving alone",
    )
    kept = first.pids()
    await first.stop()

    caplog.clear()
    second = await gateways.start(on_exit="keep", services=services)
    assert second.state().desired.revision == 2, "the restart went back to the file's spec"
    assert f"web: created from {spec_file} (created, revision 1)" in first_log
    assert second.state().observed.serving_revision == 2
    assert second.pids() == kept
    assert [r.status for r in second.rollouts()] == ["complete", "complete"]
    assert (
        f"web: spec from the store (changed through the API since {spec_file} was last applied)"
        in caplog.text
    )
    await eventually(
        lambda: second.ready(2) == 1, timeout=5, what="the adopted replica to pass its probes"
    )
    async with Load(second.url) as load:
        await load.more(50)
    assert not load.failures, load.summary()
    assert load.bodies() == {"v2"}
    await second.stop()

    # An edit of the file is a new intent: the next start applies it.
    caplog.clear()
    spec_file.write_text(json.dumps(spec(site("v3"), 1)))
    third = await gateways.start(on_exit="stop", services=services)
    assert f"web: {spec_file} changed since last applied: applied (rollout, revision 3)" in (
        caplog.text
    )
    assert third.state().desired.revision == 3
    await eventually(
        lambda: third.state().observed.serving_revision == 3 and third.ready(3) == 1,
        timeout=15,
        what="revision 3 from the edited file",
    )


async def test_restart_does_not_bring_back_a_service_deleted_through_the_api(
    gateways: Gateways, site, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    services = [spec(site("v1"), 1)]  # inline in the config
    first = await gateways.start(services=services)
    await first.controller.delete("web")
    await eventually(
        lambda: "web" not in first.controller.service_names(), timeout=10, what="the delete"
    )
    await first.stop()

    caplog.clear()
    second = await gateways.start(services=services)
    assert "web" not in second.controller.service_names()
    assert "web: deleted through the API since" in caplog.text
    assert second.started_pids == []


# -- a canary in progress survives a restart (issue 27) ----------------------------------------


def _held(db: Path, weight: int) -> Any:
    """The active rollout once its record says the canary holds ``weight``, else None."""
    rollouts, _ = _stored(db)
    active = [r for r in rollouts if r.active and r.strategy_json]
    if not active:
        return None
    state = json.loads(active[0].strategy_json)
    held = state["weight"] == weight and state["holding_since"] is not None
    return active[0] if held else None


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
async def test_a_canary_goes_on_at_its_weight_after_the_gateway_process_ends(
    gateways: Gateways, tmp_path: Path, signum: signal.Signals
) -> None:
    """The gateway that began the canary is a process of its own, ended by ``signum`` while
    the canary holds revision 2 at 50 %: the next one goes on at 50 % (not as a rolling
    update), for what is left of the step's pause, then completes. The clients are those
    of the next gateway, once its adopted replicas are ready (as the tests above)."""
    from .test_canary import canary_spec, share, tolerance

    steps = [{"weight": 50, "pause": 10}]
    analysis = {"max_error_rate": 0.01, "min_requests": 30, "interval": 1}
    canary = {"strategy": "canary", "steps": steps, "analysis": analysis}
    spec_file = tmp_path / "web.json"
    spec_file.write_text(json.dumps(canary_spec("1", **canary)))
    services = [str(spec_file)]
    first = await gateways.start(on_exit="keep", services=services)
    await eventually(lambda: first.ready(1) == 2, timeout=15, what="revision 1 from the file")
    await first.stop()

    spec_file.write_text(json.dumps(canary_spec("2", **canary)))  # the next start applies it
    config = gateways.config(on_exit="keep", services=services, log_level="warning")
    path = gateways.write_config(config)
    db = gateways.state_dir / "gateway.db"
    process = await gateway_process(path, tmp_path / "second-gateway.log")
    try:
        held = await eventually(
            lambda: _held(db, 50), timeout=30, what="the canary at 50% in the store"
        )
        await asyncio.sleep(2)  # into its pause
        process.send_signal(signum)
        await asyncio.wait_for(process.wait(), 10)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        gateways.other_pids |= set(_stored(db)[1].values())
    ended = asyncio.get_running_loop().time()
    kept = _stored(db)[1]
    assert len(kept) == 3, kept  # two of revision 1, the canary's one of revision 2
    assert all(alive(pid) for pid in kept.values())

    third = await gateways.start(on_exit="stop", services=services)
    rollout = third.state().observed.rollout
    assert rollout is not None
    assert (rollout.id, rollout.strategy, rollout.step, rollout.weight) == (
        held.id,
        "canary",
        0,
        50,
    )
    assert third.state().observed.split == (2, 50)
    assert third.pids() == kept  # adopted
    await eventually(
        lambda: third.ready(1) == 2 and third.ready(2) == 1, timeout=5, what="the adopted replicas"
    )
    async with Load(third.url, clients=8, limit=60) as load:
        start = load.mark()
        await eventually(
            lambda: third.state().observed.split != (2, 50), timeout=30, what="the step to end"
        )
        step_ended = asyncio.get_running_loop().time()
        window = [o for o in load.outcomes[start:] if o.at < time.monotonic() - 0.1]
        await eventually(
            lambda: third.state().observed.rollout is None and third.state().observed.split is None,
            timeout=30,
            what="completion",
        )
        after = load.mark()
        await load.more(200)
    assert not load.failures, load.summary()
    seen, n = share(window, "v2")
    print(
        f"{signum.name}: after the restart revision 2 served {seen:.1%} of {n} at 50%; the step "
        f"ended {step_ended - ended:.1f} s after the first gateway did; {len(load.outcomes)} "
        f"requests, {len(load.failures)} failed"
    )
    assert abs(seen - 0.5) <= tolerance(0.5, n), (seen, n)
    # The pause went on where it was (10 s from the weight, 2 s of it before the end), not
    # again from the restart.
    assert step_ended - ended < 9.5
    assert load.bodies(after) == {"v2"}
    assert len(third.started_pids) == 1  # the second replica of revision 2, for step 2 (100)
    assert [(r.id, r.status) for r in third.rollouts()][:1] == [(held.id, "complete")]
    messages = [e.message for e in third.controller.journal.since(0) if e.service == "web"]
    assert any("goes on at step 1, revision 2 at 50%" in m for m in messages)
    assert any("pass: analysis:" in m and "at weight 50" in m for m in messages)


async def test_a_second_signal_exits_at_once_and_takes_the_replicas_with_it(
    gateways: Gateways, site, tmp_path: Path
) -> None:
    """SIGTERM shuts the gateway down in order: with ``replicas_on_exit: stop`` it waits for
    each replica's stop, up to its ``stop_grace``. A second signal meanwhile exits at once,
    and the replicas go with it (SIGKILL) instead of running on, their ports held."""
    stubborn = f"trap '' TERM; exec {SERVER}"  # ignores SIGTERM: its stop takes the grace
    spec_file = tmp_path / "web.json"
    spec_file.write_text(json.dumps(spec(site("v1"), 1, commands=[stubborn], stop_grace=30)))
    config = gateways.config(on_exit="stop", services=[str(spec_file)])
    db = gateways.state_dir / "gateway.db"
    process = await gateway_process(gateways.write_config(config), tmp_path / "gateway.log")
    try:
        pids = await eventually(
            lambda: _stored(db)[1] or None, timeout=15, what="the replica in the store"
        )
        (pid,) = pids.values()
        await eventually(lambda: alive(pid), timeout=5, what="the replica to run")
        gateways.other_pids.add(pid)
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(1)  # stopping the replica, which ignores SIGTERM
        assert process.returncode is None
        assert alive(pid)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 5) == 1
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    await eventually(lambda: not alive(pid), timeout=5, what="the replica to be killed")
    log = (tmp_path / "gateway.log").read_text()
    assert "second signal: exiting at once" in log, log[-2000:]
