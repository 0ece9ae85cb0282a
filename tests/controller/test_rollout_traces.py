"""A rollout as a trace (``controller.rollout_traces``): its span, its steps' and its
replicas' (their start, their probes to ready, or their failure), under an id derived from
the rollout's record; the apply that began it as its root, any other apply a trace of its
own."""

from __future__ import annotations

import pytest

from controller.errors import SpecError
from controller.journal import Entry
from controller.planning.model import Rollout
from controller.rollout_traces import INTERNAL, RolloutTraces, trace_id
from gateway import ProbeResult
from tests.support.clock import FakeClock

from .conftest import Harness, spec

ROLLOUT = Rollout(
    id=7, from_revision=1, to_revision=2, kind="rollout", status="active", started=0.0,
    strategy="canary",
)  # fmt: skip


def entry(at: float, kind: str, replica: str | None = None, service: str = "web") -> Entry:
    return Entry(1, at, service, kind, f"{kind} {replica or ''}".strip(), 2, replica)


def test_a_rollout_is_one_trace_of_its_steps_and_its_replicas() -> None:
    sent: list[tuple] = []
    traces = RolloutTraces(sent.extend, lambda service: ROLLOUT if service == "web" else None)
    for e in [
        entry(100.0, "rollout_started"),
        entry(100.1, "replica_started", "web-2-a"),
        entry(100.2, "replica_started", "web-2-b"),
        entry(101.0, "replica_ready", "web-2-a"),
        entry(101.5, "rollout_step"),
        entry(102.0, "replica_failed", "web-2-b"),
        entry(103.0, "rollout_complete"),
        entry(104.0, "replica_ready", "web-9-z"),  # no rollout: no trace
        entry(104.0, "rollout_started", service="other"),  # no rollout known: none
    ]:
        traces(e)
    by_name = {span[3]: span for span in sent}
    assert set(by_name) == {
        "rollout web", "replica web-2-a", "replica web-2-b", "rollout_step",
    }  # fmt: skip
    root = by_name["rollout web"]
    assert {span[0] for span in sent} == {trace_id("web", 7)}
    assert root[2] == ""
    assert (root[4], root[5], root[6], root[7]) == (INTERNAL, 100.0, 103.0, False)
    attributes = dict(root[8])
    assert attributes["gateway.rollout"] == 7
    assert attributes["gateway.revision"] == 2
    assert attributes["gateway.revision.from"] == 1
    assert attributes["gateway.rollout.strategy"] == "canary"
    assert attributes["gateway.outcome"] == "complete"
    ready, failed = by_name["replica web-2-a"], by_name["replica web-2-b"]
    assert ready[2] == failed[2] == root[1]
    assert (ready[5], ready[6], ready[7]) == (100.1, 101.0, False)
    assert (failed[5], failed[6], failed[7]) == (100.2, 102.0, True)
    step = by_name["rollout_step"]
    assert (step[2], step[5], step[6]) == (root[1], 101.5, 103.0)
    assert repr(traces) == "<RolloutTraces rollouts=0 replicas=0>"


def test_a_failed_rollout_is_an_error_and_its_id_is_the_records() -> None:
    sent: list[tuple] = []
    traces = RolloutTraces(sent.extend, lambda service: ROLLOUT)
    traces(entry(1.0, "rollout_started"))
    traces(entry(2.0, "rollout_failed"))
    ((trace, _, _, _, _, _, _, error, attributes),) = sent
    assert trace == trace_id("web", 7) != trace_id("web", 8)
    assert len(trace) == 32
    assert error is True
    assert dict(attributes)["gateway.outcome"] == "failed"


def test_a_replica_is_its_start_then_its_probes_to_ready() -> None:
    sent: list[tuple] = []
    wall = FakeClock(100.0)
    traces = RolloutTraces(sent.extend, lambda service: ROLLOUT, wall)
    traces(entry(100.0, "rollout_started"))
    wall.advance(0.5)
    traces.launching("web", "web-2-a")
    traces.launching("web", "web-2-b")
    traces.launching("other", "other-1-a")  # no rollout of its own: no span
    traces.on_probe(ProbeResult("web", "web-2-a", "failure", 0.1))  # before it is up: not its
    traces(entry(101.5, "replica_started", "web-2-a"))
    wall.advance(1.5)  # 102.0
    traces.on_probe(ProbeResult("web", "web-2-a", "failure", 0.25))  # began at 101.75
    traces.on_probe(ProbeResult("web", "web-2-a", "success", 0.1))
    traces.on_probe(ProbeResult("web", "web-2-a", "success", 0.1))
    traces(entry(102.5, "replica_ready", "web-2-a"))
    traces(entry(103.0, "replica_failed", "web-2-b"))  # its start failed
    assert repr(traces) == "<RolloutTraces rollouts=1 replicas=0>"
    by_name: dict[str, list[tuple]] = {}
    for span in sent:
        by_name.setdefault(span[3], []).append(span)
    (a,) = by_name["replica web-2-a"]
    (b,) = by_name["replica web-2-b"]
    assert (a[5], a[6], a[7]) == (100.5, 102.5, False)
    assert dict(a[8])["gateway.probes"] == 3
    assert (b[5], b[6], b[7]) == (100.5, 103.0, True)
    a_start, b_start = sorted(by_name["start"], key=lambda s: s[2] != a[1])
    assert (a_start[2], a_start[5], a_start[6], a_start[7]) == (a[1], 100.5, 101.5, False)
    assert (b_start[2], b_start[5], b_start[6], b_start[7]) == (b[1], 100.5, 103.0, True)
    assert dict(b_start[8])["gateway.outcome"] == "failed"
    (probe,) = by_name["probe to ready"]
    assert (probe[2], probe[5], probe[6], probe[7]) == (a[1], 101.75, 102.5, False)
    assert dict(probe[8])["gateway.probes"] == 3
    assert {span[0] for span in sent} == {trace_id("web", 7)}


async def test_an_apply_is_the_root_of_the_rollout_it_begins(h: Harness) -> None:
    sent: list[tuple] = []
    controller = h.controller
    wall = controller.wall_clock
    traces = RolloutTraces(sent.extend, controller.active_rollout, wall)
    h.controller.journal.listen(traces)
    controller.traces = traces
    controller.executor.on_launch = traces.launching

    with controller.applying("config", "gateway.yaml") as span:
        result = await controller.apply(spec(replicas=1), span)
    await h.settle()
    await h.pass_probes("web")
    assert result.rollout_id is not None
    trace = trace_id("web", result.rollout_id)
    by_name = {s[3]: s for s in sent}
    apply = by_name["apply web"]
    assert (apply[0], apply[2], apply[7]) == (trace, "", False)
    assert dict(apply[8]) == {
        "gateway.apply.source": "config",
        "gateway.apply.by": "gateway.yaml",
        "gateway.service": "web",
        "gateway.apply.action": "created",
        "gateway.revision": 1,
        "gateway.rollout": result.rollout_id,
    }
    children = sorted(s[3] for s in sent if s[2] == apply[1])
    assert children == ["diff", "plan", "rollout web", "store write", "validate"]
    assert all(s[0] == trace for s in sent)
    (replica,) = [s for s in sent if s[3].startswith("replica ")]
    assert replica[2] == by_name["rollout web"][1]
    assert dict(replica[8])["gateway.outcome"] == "ready"
    assert by_name["start"][2] == replica[1]

    # Nothing changed, or refused (before or as it is validated): traces of their own.
    sent.clear()
    await controller.apply(spec(replicas=1))
    static = spec(replicas=1, backend="static", replica={"addresses": ["127.0.0.1:9"]})
    with pytest.raises(SpecError), controller.applying("api", "curl at 127.0.0.1") as span:
        await controller.apply(static, span)  # a backend this controller has not
    with pytest.raises(SpecError), controller.applying("api") as span:
        await controller.apply({"name": "web", "replicas": "many"}, span)
    unchanged, backend, invalid = (s for s in sent if s[3].startswith("apply"))
    assert len({unchanged[0], backend[0], invalid[0], trace}) == 4
    assert dict(unchanged[8])["gateway.apply.action"] == "unchanged"
    assert dict(unchanged[8])["gateway.apply.source"] == "call"
    assert (backend[7], invalid[7]) == (True, True)
    assert "not configured" in str(dict(backend[8])["gateway.apply.refused"])
    assert dict(backend[8])["gateway.apply.by"] == "curl at 127.0.0.1"
    assert backend[3] == "apply web"
    assert invalid[3] == "apply"  # no name known before it is valid
    assert "gateway.apply.action" not in dict(invalid[8])
