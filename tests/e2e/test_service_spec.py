"""The spec a service runs after an undo, a rollback and a failed rollout; scaling never changes
its template; a template run before keeps its revision; a static address that was down comes
in when it comes up; two static services share an address. Through the admin API of a real
gateway with real replicas.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp

from controller.planning.model import ReplicaState
from tests.support.eventually import eventually
from tests.support.ports import free_port as _free_port

from .conftest import PROBE, Gateways, Handle, Load, serving, spec


class Api:
    """The admin API of one gateway."""

    def __init__(self, gw: Handle, http: aiohttp.ClientSession) -> None:
        self.base = f"http://127.0.0.1:{gw.gateway.admin.port}/api/services"
        self.http = http

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.http.request(method, self.base + path, json=body) as response:
            data = await response.json()
            assert response.status == 200, (response.status, data)
            return data


def version_of(gw: Handle) -> set[str]:
    """The VERSION in the template of every live replica."""
    state = gw.state()
    return {
        state.revisions[r.revision].replica.env.get("VERSION", "?")
        for r in state.observed.replicas
        if r.live
    }


def versioned(site, version: str, replicas: int, **rollout: Any) -> dict[str, Any]:
    data = spec(site(version), replicas, **rollout)
    data["replica"]["env"] = {"VERSION": version}
    return data


async def test_scale_after_undo_keeps_the_serving_template(gateways: Gateways, site) -> None:
    """Issue 22.1: after an undo back to v1, ``scale`` starts v1, not the v2 last applied."""
    gw = await gateways.start()
    await serving(gw, versioned(site, "v1", 1))
    async with aiohttp.ClientSession() as http, Load(gw.url) as load:
        api = Api(gw, http)
        await api.call("PUT", "/web", versioned(site, "v2", 1))
        await eventually(lambda: gw.state().observed.serving_revision == 2, what="v2 serving")
        await eventually(lambda: gw.state().observed.rollout is None, what="v2's rollout done")
        await api.call("POST", "/web/rollout/undo", {})
        await eventually(
            lambda: (
                gw.state().observed.serving_revision == 1
                and gw.state().observed.rollout is None
                and version_of(gw) == {"v1"}
            ),
            what="back on v1",
        )
        service = await api.call("GET", "/web")
        assert service["spec"]["replica"]["env"] == {"VERSION": "v1"}

        result = await api.call("POST", "/web/scale", {"replicas": 2})
        assert result["action"] == "scaled"
        assert result["revision"] == 1
        await eventually(lambda: gw.ready(1) == 2, what="two v1 replicas")
        assert gw.state().observed.rollout is None
        assert version_of(gw) == {"v1"}
        since = load.mark()
        await load.more()
        assert load.bodies(since) == {"v1"}
    assert not load.failures, load.summary()
    assert [r["to_revision"] for r in await _rollouts(gw)] == [1, 2, 1]


async def test_scale_after_a_failed_rollout_starts_nothing_failed(gateways: Gateways, site) -> None:
    """Issue 22.1: after a rollout failed and rolled back, ``scale`` to the same count
    changes nothing, and a new count starts the serving template."""
    gw = await gateways.start()
    await serving(gw, versioned(site, "v1", 1, retries=0))
    broken = versioned(site, "v2", 1, retries=0)
    broken["replica"]["commands"] = ["exit 3"]
    async with aiohttp.ClientSession() as http:
        api = Api(gw, http)
        await api.call("PUT", "/web", broken)
        await eventually(
            lambda: [r.status for r in gw.rollouts()][:2] == ["complete", "failed"],
            what="the failed rollout rolled back",
        )
        assert gw.state().desired.revision == 1
        unchanged = await api.call("POST", "/web/scale", {"replicas": 1})
        assert unchanged["action"] == "unchanged"
        await api.call("POST", "/web/scale", {"replicas": 2})
        await eventually(lambda: gw.ready(1) == 2, what="two v1 replicas")
    assert not gw.replicas(ReplicaState.STARTING, revision=2)
    assert {r.revision for r in gw.replicas() if r.live} == {1}


async def test_scale_during_an_undo_does_not_supersede_it(gateways: Gateways, site) -> None:
    """Issue 22.1: a scale while an undo runs changes the count, not the undo's target."""
    gw = await gateways.start()
    await serving(gw, versioned(site, "v1", 1))
    async with aiohttp.ClientSession() as http:
        api = Api(gw, http)
        await api.call("PUT", "/web", versioned(site, "v2", 1))
        await eventually(lambda: gw.state().observed.serving_revision == 2, what="v2 serving")
        await eventually(lambda: gw.state().observed.rollout is None, what="v2's rollout done")
        undo = await api.call("POST", "/web/rollout/undo", {})
        await api.call("POST", "/web/scale", {"replicas": 2})
        rollout = gw.state().observed.rollout
        assert rollout is not None
        assert rollout.id == undo["id"], "the undo was superseded"
        await eventually(
            lambda: gw.ready(1) == 2 and gw.state().observed.rollout is None,
            what="the undo done at two replicas",
        )
    assert gw.state().observed.serving_revision == 1


async def test_a_template_run_before_keeps_its_revision(gateways: Gateways, site) -> None:
    """Issue 22.4: v1, v2, then v1 again: the third apply targets revision 1, not 3."""
    gw = await gateways.start()
    await serving(gw, versioned(site, "v1", 1))
    async with aiohttp.ClientSession() as http:
        api = Api(gw, http)
        await api.call("PUT", "/web", versioned(site, "v2", 1))
        await eventually(lambda: gw.state().observed.serving_revision == 2, what="v2 serving")
        await eventually(lambda: gw.state().observed.rollout is None, what="v2's rollout done")
        again = await api.call("PUT", "/web", versioned(site, "v1", 1))
        assert again["action"] == "rollout"
        assert again["revision"] == 1
        await eventually(lambda: gw.state().observed.serving_revision == 1, what="v1 serving")
        revisions = await api.call("GET", "/web/revisions")
    numbers = sorted(r["number"] for r in revisions["revisions"])
    assert numbers == [1, 2]


async def test_a_static_address_down_past_start_timeout_is_routed_once_up(
    gateways: Gateways, tmp_path
) -> None:
    """Issue 22.3: a static service whose address stays down past ``start_timeout`` is never
    given up: its first rollout completes, and once a server listens there it is routed."""
    gw = await gateways.start()
    port = _free_port()
    data = {
        "name": "web",
        "backend": "static",
        "route": {"path_prefix": "/"},
        "replica": {"addresses": [f"127.0.0.1:{port}"]},
        "probes": [PROBE],
        "rollout": {"start_timeout": 0.5, "progress_deadline": 1},
    }
    async with aiohttp.ClientSession() as http:
        api = Api(gw, http)
        await api.call("PUT", "/web", data)
        await eventually(lambda: gw.state().observed.rollout is None, what="the first rollout done")
        await asyncio.sleep(1.5)  # past start_timeout and progress_deadline, the address down
        # Issue 53.5: it never passed a probe, yet it is reported unhealthy, not starting
        # (and is neither given up nor replaced).
        (replica,) = gw.replicas()
        assert replica.state is ReplicaState.UNHEALTHY
        assert [r.status for r in gw.rollouts()] == ["complete"]
        view = await api.call("GET", "/web")
        assert [(r["state"], r["health"]) for r in view["replicas"]] == [("unhealthy", "unhealthy")]
        admin = f"http://127.0.0.1:{gw.gateway.admin.port}/metrics"
        async with http.get(admin) as response:
            lines = (await response.text()).splitlines()
        series = 'gateway_service_replicas{{revision="1",service="web",state="{}"}}'
        assert series.format("unhealthy") + " 1.0" in lines
        assert series.format("starting") + " 0.0" in lines
        async with http.get(gw.url + "/") as response:
            assert response.status == 503

        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "index.html").write_text("up")
        server = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
            cwd=tmp_path / "up",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await eventually(lambda: gw.ready() == 1, what="the static replica ready")
            async with http.get(gw.url + "/") as response:
                assert response.status == 200
                assert await response.text() == "up"
        finally:
            server.terminate()
            await server.wait()


async def _rollouts(gw: Handle) -> list[dict[str, Any]]:
    return [{"to_revision": r.to_revision, "status": r.status} for r in reversed(gw.rollouts())]


async def test_two_static_services_at_one_address_both_serve(gateways: Gateways, tmp_path) -> None:
    """Issue 53.4: two routes to one upstream (say one with auth, one rate limited) are two
    static services at the same address; each gets its replica there, and both serve."""
    gw = await gateways.start()
    port = _free_port()
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "index.html").write_text("up")
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
        cwd=tmp_path / "up",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            api = Api(gw, http)
            for name in ("one", "two"):
                await api.call(
                    "PUT",
                    f"/{name}",
                    {
                        "name": name,
                        "backend": "static",
                        "route": {"path_prefix": f"/{name}", "strip_prefix": True},
                        "replica": {"addresses": [f"127.0.0.1:{port}"]},
                        "probes": [PROBE],
                    },
                )
            for name in ("one", "two"):
                await eventually(lambda n=name: gw.ready(name=n) == 1, what=f"{name} ready")
                async with http.get(f"{gw.url}/{name}/") as response:
                    assert response.status == 200
                    assert await response.text() == "up"
    finally:
        server.terminate()
        await server.wait()
