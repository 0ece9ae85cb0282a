"""A rollout as a trace (``controller.rollout_traces``), from journal entries alone: its
span, its steps' and its replicas' (start to ready or failure), under an id derived from the
rollout's record."""

from __future__ import annotations

from controller.journal import Entry
from controller.planning.model import Rollout
from controller.rollout_traces import INTERNAL, RolloutTraces, trace_id

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
