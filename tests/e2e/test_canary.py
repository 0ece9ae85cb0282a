"""Canary and blue/green rollouts with real replicas under load (issue 27): the weights the
clients see at each step, a failing canary aborted by the gateway's own counts, blue/green
promotion and an instant undo, preview routes by header and by host.

Weights are checked within 4 standard deviations of a binomial draw over the requests of
the step (``tolerance``), plus 2 points for the requests in flight when the weight moved.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.eventually import eventually

from .conftest import ROLLOUT, Gateways, Load, serving

REPLICA = Path(__file__).with_name("canary_replica.py")
PROBE = {"type": "http", "path": "/healthz", "interval": 0.1, "timeout": 0.5}
TOKEN = "preview-token-of-web"


def canary_spec(
    version: str,
    replicas: int = 2,
    *,
    fail_every: int = 0,
    preview: dict[str, Any] | None = None,
    **rollout: Any,
) -> dict[str, Any]:
    return {
        "name": "web",
        "route": {"hosts": ["127.0.0.1", "hello.example.com"]},
        "replicas": replicas,
        "replica": {
            "commands": [f"{sys.executable} {REPLICA}"],
            "env": {"VERSION": version, "FAIL_EVERY": str(fail_every)},
        },
        "probes": [PROBE],
        "rollout": ROLLOUT | rollout,
        "preview": preview or {"allow": "anyone"},
    }


def tolerance(p: float, n: int) -> float:
    return 4 * math.sqrt(p * (1 - p) / n) + 0.02


def share(outcomes: list[Any], body: str) -> tuple[float, int]:
    n = len(outcomes)
    return sum(1 for o in outcomes if o.body == body) / n, n


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
async def test_canary_weights_hold_at_each_step_then_it_completes(
    gateways: Gateways, workers: int
) -> None:
    """With ``workers: 2`` the split travels to the worker processes in their snapshots and
    the counts come back in their reports."""
    gw = await gateways.start(workers=workers)
    steps = [{"weight": 20, "pause": 4}, {"weight": 50, "pause": 4}]
    analysis = {"max_error_rate": 0.01, "min_requests": 50, "interval": 1}
    await serving(gw, canary_spec("1", strategy="canary", steps=steps, analysis=analysis))
    split = lambda: gw.state().observed.split  # noqa: E731
    windows: list[tuple[int, list[Any]]] = []
    async with Load(gw.url, clients=8, limit=90) as load:
        result = await gw.controller.apply(
            canary_spec("2", strategy="canary", steps=steps, analysis=analysis)
        )
        assert result.revision == 2
        for weight in (20, 50):
            await eventually(
                lambda w=weight: split() == (2, w), timeout=30, what=f"revision 2 at {weight}%"
            )
            start = load.mark()
            await eventually(
                lambda w=weight: split() != (2, w), timeout=30, what=f"the step at {weight}% to end"
            )
            # Requests sent up to 0.1 s before the move was seen (polled every 50 ms).
            ended = time.monotonic() - 0.1
            windows.append((weight, [o for o in load.outcomes[start:] if o.at < ended]))
        await eventually(
            lambda: gw.state().observed.rollout is None and split() is None,
            timeout=30,
            what="completion",
        )
        after = load.mark()
        await load.more(200)
    assert not load.failures, load.summary()
    for weight, outcomes in windows:
        seen, n = share(outcomes, "v2")
        p = weight / 100
        print(f"workers {workers}, weight {weight}%: revision 2 served {seen:.1%} of {n}")
        assert abs(seen - p) <= tolerance(p, n), (weight, seen, n)
    assert load.bodies(after) == {"v2"}
    assert gw.rollouts()[0].status == "complete"
    events = [e.message for e in gw.controller.journal.since(0) if e.service == "web"]
    assert any("revision 2 takes 20% of the traffic (step 1 of 3)" in m for m in events)
    assert any("pass: analysis: error rate 0% <= 1% over" in m for m in events)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_canary_failing_one_request_in_five_is_aborted_at_its_first_step(
    gateways: Gateways, workers: int
) -> None:
    gw = await gateways.start(workers=workers)
    steps = [{"weight": 20, "pause": 30}]
    analysis = {"max_error_rate": 0.01, "min_requests": 60, "interval": 1}
    await serving(gw, canary_spec("1", strategy="canary", steps=steps, analysis=analysis))
    async with Load(gw.url, clients=8, limit=60) as load:
        start = load.mark()
        await gw.controller.apply(
            canary_spec("2", fail_every=5, strategy="canary", steps=steps, analysis=analysis)
        )
        await eventually(lambda: gw.state().desired.revision == 1, timeout=30, what="the abort")
        aborted = load.mark()
        await eventually(
            lambda: gw.state().observed.rollout is None, timeout=30, what="the rollback"
        )
        after = load.mark()
        await load.more(300)
    failed = gw.rollouts()[1]
    assert failed.status == "failed"
    assert failed.reason.startswith("analysis: error rate ")
    assert failed.reason.endswith(" requests at weight 20")
    # The only failed requests are the bad revision's own 500s, within its weight.
    bad = load.failures
    assert all(o.status == 500 and o.body == "v2" for o in bad), load.summary()
    canary = load.outcomes[start:aborted]
    served_by_2 = sum(1 for o in canary if o.body == "v2")
    print(
        f"workers {workers}, failing canary: {len(bad)} failed of {len(load.outcomes)} requests "
        f"({served_by_2} answered by revision 2 before the abort; reason: {failed.reason})"
    )
    assert served_by_2 >= 60
    # The stable revision serves 100% from then on.
    assert load.bodies(after) == {"v1"}
    assert not [o for o in load.sent_since(after) if o.failed]


async def test_blue_green_switch_and_instant_undo_fail_nothing(gateways: Gateways) -> None:
    gw = await gateways.start()
    bg: dict[str, Any] = {"strategy": "blue_green", "keep_previous": 60}
    await serving(gw, canary_spec("1", **bg))
    async with Load(gw.url, clients=8, limit=60) as load:
        await gw.controller.apply(canary_spec("2", **bg))
        await eventually(
            lambda: gw.ready(2) == 2 and gw.ready(1) == 2, timeout=20, what="blue and green"
        )
        await eventually(
            lambda: gw.state().observed.split == (2, 0), timeout=10, what="green at 0%"
        )
        mark = load.mark()
        await load.more(200)
        assert load.bodies(mark) == {"v1"}  # no traffic to green but preview traffic
        async with aiohttp.ClientSession() as session:
            headers = {"X-Gateway-Revision": "2"}
            async with session.get(gw.url, headers=headers) as response:
                assert (response.status, await response.text()) == (200, "v2")
        await gw.controller.promote("web")
        await eventually(
            lambda: gw.state().observed.split == (2, 100), timeout=5, what="the switch"
        )
        switched = load.mark()
        await load.more(200)
        assert load.bodies(switched) == {"v2"}
        assert gw.ready(1) == 2  # blue kept for an instant undo
        started = len(gw.started_pids)
        await gw.controller.undo("web")
        # All traffic back at once: the split to blue, then none once green is drained.
        await eventually(
            lambda: gw.state().observed.split in ((1, 100), None), timeout=2, what="the undo"
        )
        undone = load.mark()
        await load.more(200)
        await eventually(
            lambda: gw.state().observed.rollout is None, timeout=20, what="the undo to complete"
        )
    assert not load.failures, load.summary()
    assert load.bodies(undone) == {"v1"}
    assert len(gw.started_pids) == started  # nothing had to start: undo was instant


async def test_preview_routes_reach_the_revision_asked_for_or_are_refused(
    gateways: Gateways,
) -> None:
    gw = await gateways.start()
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    preview = {"allow": "token", "tokens": [digest]}
    bg: dict[str, Any] = {"strategy": "blue_green"}
    await serving(gw, canary_spec("1", preview=preview, **bg))
    await gw.controller.apply(canary_spec("2", preview=preview, **bg))
    await eventually(lambda: gw.ready(2) == 2, timeout=20, what="revision 2 ready")
    host = {"Host": "hello.example.com"}
    async with aiohttp.ClientSession() as session:

        async def get(headers: dict[str, str]) -> tuple[int, str, str]:
            async with session.get(gw.url, headers=headers) as response:
                seen = response.headers.get("X-Preview-Token-Seen", "")
                return response.status, await response.text(), seen

        asked = {"X-Gateway-Revision": "2"}
        token = {"X-Gateway-Preview-Token": TOKEN}
        assert (await get(host))[:2] == (200, "v1")
        assert (await get(host | asked | token)) == (200, "v2", "False")  # token not passed on
        assert (await get({"Host": "r2--hello.example.com"} | token))[:2] == (200, "v2")
        assert (await get({"Host": "r1--hello.example.com"} | token))[:2] == (200, "v1")
        # Refused where not allowed: no token, a wrong one, a revision with nothing routable.
        status, body, _ = await get(host | asked)
        assert status == 403
        assert "needs a token" in body
        status, _, _ = await get(host | asked | {"X-Gateway-Preview-Token": "nope"})
        assert status == 403
        status, _, _ = await get({"Host": "r2--hello.example.com"})
        assert status == 403
        status, body, _ = await get(host | {"X-Gateway-Revision": "9"} | token)
        assert status == 503
        assert "revision 9" in body
        status, _, _ = await get(host | {"X-Gateway-Revision": "two"} | token)
        assert status == 400
        # Preview off: the header is not read, a labelled host routes nowhere.
        await gw.controller.apply(canary_spec("2", preview={"allow": "off"}, **bg))
        assert (await get(host | asked | token))[:2] == (200, "v1")
        assert (await get({"Host": "r2--hello.example.com"}))[0] == 404


async def test_sticky_clients_keep_their_revision_during_a_canary(gateways: Gateways) -> None:
    gw = await gateways.start()
    steps = [{"weight": 50}]  # no pause: held until promoted
    sticky = {"sticky": {"header": "X-User"}}
    await serving(gw, canary_spec("1", strategy="canary", steps=steps) | sticky)
    await gw.controller.apply(canary_spec("2", strategy="canary", steps=steps) | sticky)
    await eventually(
        lambda: gw.state().observed.split == (2, 50), timeout=20, what="revision 2 at 50%"
    )
    seen: dict[str, set[str]] = {}
    async with aiohttp.ClientSession() as session:
        for i in range(40):
            user = f"user-{i}"
            for _ in range(10):
                headers = {"Host": "hello.example.com", "X-User": user}
                async with session.get(gw.url, headers=headers) as response:
                    assert response.status == 200
                    seen.setdefault(user, set()).add(await response.text())
    assert all(len(versions) == 1 for versions in seen.values()), seen
    on_canary = sum(1 for versions in seen.values() if versions == {"v2"})
    print(f"sticky: {on_canary} of 40 users on the canary at 50%")
    assert 8 <= on_canary <= 32  # 50% of 40: within 4.4 standard deviations
