"""End to end on the Docker backend: the real gateway, replicas as containers of a real engine.

Two hosts are configured on the one test engine (``$GATEWAY_TEST_DOCKER_HOST``), each with its
own capacity and port range, so placement spreads a service over both. Every container of the
test's gateway (its instance label) is removed at teardown.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.admin.views import host_views
from controller.backends.docker import EngineClient
from controller.cli.render import host_table
from controller.planning.model import ReplicaState
from controller.store import Store
from tests.controller.test_backend_docker import (
    ENGINE,
    IMAGE,
    MISSING,
    engine_or_skip,
    remove_labelled,
)
from tests.support.eventually import eventually
from tests.support.ports import free_port as _free_port
from tests.support.ports import port_block

from .conftest import PROBE, ROLLOUT, Gateways, Load, serving

ROOT = Path(__file__).resolve().parents[2]
LIVE = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY)


@pytest.fixture
async def docker_gateways(tmp_path: Path) -> AsyncIterator[Gateways]:
    await engine_or_skip()
    g = Gateways(tmp_path)
    try:
        yield g
    finally:
        try:
            await g.close()
        finally:
            path = g.state_dir / "instance-id"
            if path.exists():
                assert await remove_labelled(path.read_text().strip()) == 0, "containers left"


def docker_config(g: Gateways) -> dict[str, Any]:
    base = port_block(20)
    hosts = [
        {
            "name": name,
            "engine": ENGINE,
            "capacity": {"replicas": 2},
            "port_range": f"{base + 10 * i}-{base + 10 * i + 9}",
        }
        for i, name in enumerate(("a", "b"))
    ]
    return {"process": {"port_range": g.port_range}, "docker": {"hosts": hosts}}


def docker_spec(
    version: str, replicas: int = 2, image: str = IMAGE, **replica: Any
) -> dict[str, Any]:
    """A service ``web`` whose containers answer ``version``; ``replica``: more of its fields."""
    return {
        "name": "web",
        "backend": "docker",
        "route": {"path_prefix": "/"},
        "replicas": replicas,
        "replica": {
            "image": image,
            **replica,
            "env": {"VERSION": version},
            "commands": [
                "mkdir -p /tmp/site",
                'echo -n "$VERSION" > /tmp/site/index.html',
                "python3 -m http.server $PORT --directory /tmp/site",
            ],
        },
        "probes": [PROBE],
        "retries": {"attempts": 2},
        "rollout": ROLLOUT,
    }


def hosts_of(gw: Any) -> list[str]:
    return sorted(r.handle["host"] for r in gw.controller.executor.running.values())


async def test_rolling_update_over_two_hosts_costs_no_request(docker_gateways: Gateways) -> None:
    gw = await docker_gateways.start(backends=docker_config(docker_gateways))
    await serving(gw, docker_spec("v1"))
    assert hosts_of(gw) == ["a", "b"]
    async with Load(gw.url) as load:
        await load.more()
        assert load.bodies() == {"v1"}
        result = await gw.controller.apply(docker_spec("v2"))
        assert (result.action, result.revision) == ("rollout", 2)
        await eventually(
            lambda: (
                gw.state().observed.rollout is None
                and gw.ready(2) == 2
                and not gw.replicas(*LIVE, revision=1)
            ),
            timeout=20,
            what="two ready replicas of revision 2 only",
        )
        after = load.mark()
        await load.more()
    assert not load.failures, load.summary()
    assert load.bodies(after) == {"v2"}
    assert gw.rollouts()[0].status == "complete"  # the newest first
    await eventually(
        lambda: len(hosts_of(gw)) == 2, timeout=5, what="the revision-1 containers to be gone"
    )
    assert hosts_of(gw) == ["a", "b"]


async def test_rollout_to_a_missing_image_fails_and_the_old_revision_serves(
    docker_gateways: Gateways,
) -> None:
    gw = await docker_gateways.start(backends=docker_config(docker_gateways))
    await serving(gw, docker_spec("v1"))
    async with Load(gw.url) as load:
        await load.more()
        await gw.controller.apply(docker_spec("v2", image=MISSING))
        failed = await eventually(
            lambda: [r for r in gw.rollouts() if r.to_revision == 2 and r.status == "failed"],
            timeout=20,
            what="the rollout to fail",
        )
        await load.more()
    assert not load.failures, load.summary()
    assert load.bodies() == {"v1"}
    assert failed[0].reason.startswith(f"image not found: {MISSING}")
    assert gw.state().observed.serving_revision == 1
    assert gw.ready(1) == 2


async def test_a_restarted_gateway_adopts_its_containers(docker_gateways: Gateways) -> None:
    backends = docker_config(docker_gateways)
    first = await docker_gateways.start(backends=backends, on_exit="keep")
    await serving(first, docker_spec("v1"))
    containers = containers_of(first)
    await first.stop()  # the containers keep running
    second = await docker_gateways.start(backends=backends)
    assert containers_of(second) == containers
    await eventually(
        lambda: second.ready(1) == 2, timeout=10, what="the adopted replicas to be ready"
    )
    async with Load(second.url) as load:
        await load.more()
    assert not load.failures, load.summary()
    assert load.bodies() == {"v1"}


def containers_of(gw: Any) -> set[str]:
    return {r.handle["container"] for r in gw.controller.executor.running.values()}


async def test_the_docker_backend_is_opt_in_and_an_unreachable_engine_degrades(
    gateways: Gateways, tmp_path: Path
) -> None:
    plain = await gateways.start()
    assert sorted(plain.controller.backends) == ["process", "static"]
    await plain.stop()
    # No engine answers: the gateway starts, and a docker service waits for room, degraded.
    gone = {"name": "a", "engine": f"unix://{tmp_path}/no-engine.sock", "port_range": "24990-24999"}
    backends = {"process": {"port_range": gateways.port_range}, "docker": {"hosts": [gone]}}
    gw = await gateways.start(backends=backends)
    assert sorted(gw.controller.backends) == ["docker", "process", "static"]
    await gw.controller.apply(docker_spec("v1", replicas=1))
    degraded = await eventually(
        lambda: gw.state().observed.degraded, timeout=10, what="the service to degrade"
    )
    assert "a: unreachable" in degraded
    # gateway status lists the host, unreachable, and why.
    hosts = [h.model_dump() for h in host_views(gw.controller.backends)]
    assert [(h["backend"], h["name"], h["reachable"]) for h in hosts] == [
        ("process", "local", True),
        ("docker", "a", False),
    ]
    out = io.StringIO()
    host_table(hosts, out)
    row = out.getvalue().splitlines()[2].split()
    assert row[:4] == ["a", "docker", "0/8", "unreachable:"], out.getvalue()


async def test_capacity_full_on_both_hosts_degrades_a_scale_up_until_a_slot_frees(
    docker_gateways: Gateways,
) -> None:
    gw = await docker_gateways.start(backends=docker_config(docker_gateways))
    await serving(gw, docker_spec("v1"))
    other = {**docker_spec("api"), "name": "api", "route": {"path_prefix": "/api/"}}
    await gw.controller.apply(other)
    await eventually(
        lambda: gw.ready(1, name="api") == 2, timeout=20, what="api's two replicas to be ready"
    )
    async with Load(gw.url) as load:
        await load.more()
        await gw.controller.apply(docker_spec("v1", replicas=3))  # 4 slots, all taken
        degraded = await eventually(
            lambda: (
                "no capacity" in (gw.state().observed.degraded or "")
                and gw.state().observed.degraded
            ),
            timeout=10,
            what="web to degrade",
        )
        assert "no capacity: 2 of 2 hosts full (a: 2 of 2, b: 2 of 2)" in degraded
        assert gw.ready(1) == 2
        await load.more()
        await gw.controller.apply({**other, "replicas": 1})  # a slot frees
        await eventually(
            lambda: gw.ready(1) == 3, timeout=20, what="web's third replica to be ready"
        )
        await eventually(lambda: not gw.state().observed.degraded, timeout=5, what="web to recover")
        await load.more()
    assert not load.failures, load.summary()
    assert load.bodies() == {"v1"}
    assert hosts_of(gw) == ["a", "a", "b", "b"]


async def test_containers_killed_as_by_an_engine_restart_are_replaced(
    docker_gateways: Gateways,
) -> None:
    gw = await docker_gateways.start(backends=docker_config(docker_gateways))
    await serving(gw, docker_spec("v1"))
    instance = (docker_gateways.state_dir / "instance-id").read_text().strip()
    before = containers_of(gw)
    async with Load(gw.url) as load:
        await load.more()
        # An engine restart without live-restore kills its containers; host b's engine here.
        client = EngineClient(ENGINE)
        try:
            on_b = await client.containers({"gateway.instance": instance, "gateway.host": "b"})
            assert len(on_b) == 1
            await client.kill(on_b[0]["Id"])
            killed_at = time.monotonic()
        finally:
            await client.close()
        await eventually(
            lambda: gw.ready(1) == 2 and containers_of(gw) != before and len(hosts_of(gw)) == 2,
            timeout=20,
            what="the killed replica to be replaced",
        )
        after = load.mark()
        await load.more()
    failed = [e for e in gw.controller.journal.since(0) if e.kind == "replica_failed"]
    assert len(failed) == 1
    assert "SIGKILL" in failed[0].message
    assert gw.state().desired.replicas == 2
    assert gw.state().observed.rollout is None
    assert hosts_of(gw) == ["a", "b"]
    # Only requests in flight on the killed container may fail (its answer cut off, as with
    # any replica that dies mid-response): at most one per client, none sent after the kill.
    failures = load.failures
    assert len(failures) <= load.clients, load.summary()
    assert all(o.at <= killed_at for o in failures), load.summary()
    assert not [o for o in load.sent_since(after) if o.failed], load.summary()
    assert load.bodies(after) == {"v1"}


# -- a gateway SIGKILLed mid-rollout ----------------------------------------------------------


def _stored_containers(db: Path) -> dict[str, tuple[int, str]]:
    """Replica id -> (revision, container id) as the store holds them (empty before it exists)."""
    if not db.exists():
        return {}
    try:
        store = Store(db, readonly=True)
    except Exception:  # not created yet
        return {}
    try:
        return {
            r.replica_id: (r.revision, json.loads(r.handle_json)["container"])
            for r in store.replicas("web")
        }
    finally:
        store.close()


def _first_rollout_complete(db: Path) -> bool:
    if not db.exists():
        return False
    try:
        store = Store(db, readonly=True)
    except Exception:  # not created yet
        return False
    try:
        rollouts = store.rollouts("web")
    finally:
        store.close()
    return [r.status for r in rollouts] == ["complete"]


async def _labelled(instance: str) -> set[str]:
    client = EngineClient(ENGINE)
    try:
        return {c["Id"] for c in await client.containers({"gateway.instance": instance})}
    finally:
        await client.close()


async def test_a_gateway_killed_mid_rollout_adopts_its_containers_and_completes(
    docker_gateways: Gateways, tmp_path: Path
) -> None:
    """The first gateway is a process of its own, SIGKILLed while a revision-2 container starts.

    Nothing stops the containers (no shutdown ran); the next gateway adopts what the store
    knows, removes what it does not (a start whose record the kill cut off) after
    ``orphan_grace``, and carries the rollout through: no request fails once it serves.
    """
    g = docker_gateways
    backends = docker_config(g)
    backends["docker"]["orphan_grace"] = 1
    slow = docker_spec("v2")  # its server starts 2 s after the container: a rollout to catch
    slow["replica"]["commands"] = ["sleep 2", *slow["replica"]["commands"]]
    admin = _free_port()
    config = g.config(
        on_exit="keep",
        backends=backends,
        services=[docker_spec("v1")],
        log_level="warning",
        admin={"listen": f"127.0.0.1:{admin}", "token_env": None},
    )
    path = g.write_config(config)
    db = g.state_dir / "gateway.db"
    with open(tmp_path / "first-gateway.log", "wb") as output:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "controller.main", "serve", "-c", str(path),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    try:
        await eventually(
            lambda: (
                _first_rollout_complete(db)
                and sorted(rev for rev, _ in _stored_containers(db).values()) == [1, 1]
            ),
            timeout=30,
            what="the first gateway to serve two revision-1 containers",
        )
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{admin}/api/services/web"
            async with session.put(url, json=slow) as answer:
                assert answer.status == 200, await answer.text()
                assert (await answer.json())["action"] == "rollout"
        await eventually(
            lambda: any(rev == 2 for rev, _ in _stored_containers(db).values()),
            timeout=20,
            what="a revision-2 container to be recorded",
        )
        process.kill()  # SIGKILL: no shutdown, nothing stopped
        await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    instance = (g.state_dir / "instance-id").read_text().strip()
    left = await _labelled(instance)
    recorded = {c for _, c in _stored_containers(db).values()}
    assert recorded <= left, "a recorded container was stopped with the gateway"

    second = await g.start(backends=backends, services=[docker_spec("v1")])
    assert containers_of(second) == recorded  # adopted, nothing started again for them
    # Adopted upstreams route once their probes pass (a fresh process knows no health).
    await eventually(
        lambda: second.ready(1) + second.ready(2) >= 2, timeout=10, what="adopted replicas ready"
    )
    async with Load(second.url) as load:
        await load.more()
        await eventually(
            lambda: (
                second.state().observed.rollout is None
                and second.ready(2) == 2
                and not second.replicas(*LIVE, revision=1)
            ),
            timeout=30,
            what="the rollout to revision 2 to complete",
        )
        after = load.mark()
        await load.more()
    assert not load.failures, load.summary()
    assert load.bodies(after) == {"v2"}
    assert [(r.to_revision, r.status) for r in second.rollouts()][:2] == [
        (2, "complete"),
        (1, "complete"),
    ]
    # Nothing orphaned: what runs is what the gateway knows (orphan_grace is 1 s here).
    await eventually(
        lambda: len(containers_of(second)) == 2,
        timeout=10,
        what="the revision-1 containers to be gone",
    )
    known = containers_of(second)

    async def labelled_are_known() -> set[str]:
        found = await _labelled(instance)
        assert found == known, f"containers of the instance {found} != known {known}"
        return found

    await eventually(
        labelled_are_known, every=0.2, what="the instance's containers to be the known ones"
    )
