"""A pure simulator of one service under the reconciler's contract, for the planner's tests.

``World`` holds what the planner reads (``observed``, ``desired``), a backend ``capacity`` and a
clock. ``apply()`` performs the planner's actions the way the executor does; the other methods
are what the backend, the prober and the user do. Nothing here performs I/O, reads a clock or
draws a random number: the tests choose every event.

The contract, in short: a Start adds a REQUESTED replica whose backend outcome (placed, no
capacity, start failed) comes later; a replica that fails (start error, exit, FailReplica)
records a failure in the backoff and, if it is of the target of a progressing rollout, in the
rollout; a FailRollout goes back to ``from_revision`` (``on_failure: rollback``), pauses, or
just ends the rollout (nothing to go back to, or a rollback failed); a new apply supersedes
the active rollout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.actions import (
    Action,
    CompleteRollout,
    Drain,
    FailReplica,
    FailRollout,
    Forget,
    SetDegraded,
    Start,
    Stop,
    WakeAt,
)
from controller.model import Backoff, Observed, Replica, Rollout, RolloutStatus
from controller.model import ReplicaState as S
from controller.planner import Desired, plan
from controller.spec import RolloutStrategy

RUNNING = frozenset({S.STARTING, S.READY, S.UNHEALTHY})
"""States whose process runs, so it can exit or be probed."""


@dataclass
class World:
    observed: Observed
    desired: Desired
    capacity: int
    now: float = 0.0
    bad: dict[int, str] = field(default_factory=dict)
    """Revisions whose replicas exit when probed (``crash``) or never pass a probe (``hang``)."""
    doomed: dict[str, str] = field(default_factory=dict)
    """Requested replicas the backend had no slot for, with the error their start raises."""
    ended: list[Rollout] = field(default_factory=list)
    """Rollouts that completed, failed or were superseded, in order."""
    log: list[str] = field(default_factory=list)
    forgotten: bool = False
    next_replica: int = 0
    next_rollout: int = 1
    next_revision: int = 2

    @classmethod
    def create(
        cls, strategy: RolloutStrategy, replicas: int, capacity: int, *, serving: bool
    ) -> World:
        """Revision 1 at full strength (``serving``), or a new service with its first rollout."""
        w = cls(Observed(), Desired(1, replicas, strategy), capacity)
        if serving:
            w.observed = Observed(
                tuple(w._replica(1, S.READY, ready_since=0.0) for _ in range(replicas)),
                serving_revision=1,
            )
        else:
            w.observed = Observed(rollout=w._rollout(None, 1, "rollout"))
        return w

    # -- reading ---------------------------------------------------------------------------

    def get(self, replica_id: str) -> Replica:
        return next(r for r in self.observed.replicas if r.id == replica_id)

    def pick(self, states: Iterable[S], index: int) -> Replica | None:
        """The ``index``-th replica (modulo) in one of ``states``, if any."""
        wanted = set(states)
        found = [r for r in self.observed.replicas if r.state in wanted]
        return found[index % len(found)] if found else None

    def slots_in_use(self) -> int:
        return sum(1 for r in self.observed.replicas if not r.terminal and r.id not in self.doomed)

    def converged(self) -> bool:
        """D ready replicas of the target, nothing else live, no active rollout, not degraded."""
        live = [r for r in self.observed.replicas if r.live]
        rollout = self.observed.rollout
        return (
            (rollout is None or not rollout.active)
            and len(live) == self.desired.replicas
            and all(r.state is S.READY and r.revision == self.desired.revision for r in live)
            and self.observed.degraded is None
        )

    def describe(self, tail: int = 60) -> str:
        """The last ``tail`` lines of the log and the state now, for a failing test."""
        o, d = self.observed, self.desired
        lines = [*self.log[-tail:], f"now={self.now:g} {d}", f"rollout={o.rollout}"]
        lines += [f"backoff={o.backoff} degraded={o.degraded!r} capacity={self.capacity}"]
        lines += [f"  {r}" for r in o.replicas if not r.terminal]
        return "\n".join(lines)

    # -- the executor ----------------------------------------------------------------------

    def plan(self) -> list[Action]:
        return plan(self.observed, self.desired, self.now)

    def apply(self, actions: Iterable[Action]) -> None:
        for action in actions:
            self.log.append(f"  {action}")
            match action:
                case Start(revision=revision):
                    used = self.slots_in_use()
                    r = self._replica(revision, S.REQUESTED)
                    if used >= self.capacity:
                        self.doomed[r.id] = f"no capacity: {used} of {self.capacity} slots in use"
                    self._set(r)
                case Drain(replica_id=rid):
                    assert self.get(rid).live, action
                    self._set(self.get(rid).replace(state=S.DRAINING, since=self.now))
                case Stop(replica_id=rid):
                    self._set(self.get(rid).replace(state=S.STOPPING, since=self.now))
                case FailReplica(replica_id=rid, reason=reason):
                    r = self.get(rid)
                    assert r.live, action
                    self._set(r.replace(state=S.DRAINING, since=self.now, failure=reason))
                    self._count_failure(r, reason)
                case CompleteRollout(rollout_id=rollout_id):
                    rollout = self._active(rollout_id)
                    self.ended.append(rollout.replace(status=RolloutStatus.COMPLETE))
                    self._observe(rollout=None, serving_revision=rollout.to_revision)
                case FailRollout(rollout_id=rollout_id, reason=reason):
                    self._fail_rollout(self._active(rollout_id), reason)
                case SetDegraded(reason=reason):
                    self._observe(degraded=reason)
                case Forget():
                    self.forgotten = True
                case WakeAt():
                    pass

    def _fail_rollout(self, rollout: Rollout, reason: str) -> None:
        # As controller/executor.py does: a failed rollback is neither paused nor rolled back
        # (that would go back to the revision that just failed, and could ping-pong forever).
        failed = rollout.replace(status=RolloutStatus.FAILED, reason=reason)
        rollback = rollout.kind == "rollback"
        if self.desired.strategy.on_failure == "pause" and not rollback:
            self._observe(rollout=failed.replace(status=RolloutStatus.PAUSED))
            return
        self.ended.append(failed)
        if rollout.from_revision is None or rollback:
            self._observe(rollout=None)  # nothing to go back to: keep trying the target
            return
        self.desired = dataclasses.replace(self.desired, revision=rollout.from_revision)
        back = self._rollout(rollout.to_revision, rollout.from_revision, "rollback")
        self._observe(rollout=back, backoff=Backoff())

    # -- the backend and the prober --------------------------------------------------------

    def spawn(self, replica_id: str, outcome: str) -> None:
        """The backend's answer to a requested start: ``ok``, ``no capacity``, ``start failed``."""
        r = self.get(replica_id)
        assert r.state is S.REQUESTED
        reason = self.doomed.pop(r.id, None)
        if reason is None and outcome == "no capacity":
            reason = f"no capacity: {self.capacity} of {self.capacity} slots in use"
        elif reason is None and outcome == "start failed":
            reason = "start failed: exec format error"
        if reason is not None:
            self._fail(r, reason)
        else:
            self._set(r.replace(state=S.STARTING, since=self.now, address=f"127.0.0.1:{r.id}"))

    def probe(self, replica_id: str, passed: bool) -> None:
        r = self.get(replica_id)
        kind = self.bad.get(r.revision)
        if r.state not in RUNNING:
            return
        if kind == "crash":
            self.crash(r.id, 1)
        elif passed and kind != "hang" and r.state is not S.READY:
            self._set(r.replace(state=S.READY, since=self.now, ready_since=self.now))
            if r.revision == self.desired.revision:
                self._observe(backoff=Backoff())
        elif not passed and r.state is S.READY:
            self._set(r.replace(state=S.UNHEALTHY, since=self.now))

    def crash(self, replica_id: str, code: int) -> None:
        r = self.get(replica_id)
        assert r.state in RUNNING
        self._fail(r, f"exited with code {code}", exit_code=code)

    def drain_done(self, replica_id: str) -> None:
        r = self.get(replica_id)
        assert r.state is S.DRAINING
        self._set(r.replace(drained=True))

    def stop_done(self, replica_id: str) -> None:
        r = self.get(replica_id)
        assert r.state is S.STOPPING
        self._set(r.replace(state=S.FAILED if r.failure else S.STOPPED, since=self.now))

    def settle(self) -> bool:
        """One benign round: every start is placed, probes pass, drains and stops finish.
        Whether anything changed."""
        before = self.observed
        for r in self.observed.replicas:
            if r.state is S.REQUESTED:
                self.spawn(r.id, "ok")
            elif r.state in (S.STARTING, S.UNHEALTHY):
                self.probe(r.id, True)
            elif r.state is S.DRAINING and not r.drained:
                self.drain_done(r.id)
            elif r.state is S.STOPPING:
                self.stop_done(r.id)
        return self.observed != before

    # -- the user --------------------------------------------------------------------------

    def user_apply(self, bad: str | None = None) -> int:
        """Apply a new revision (``bad``: its replicas ``crash`` or ``hang``); its number."""
        revision = self.next_revision
        self.next_revision += 1
        if bad is not None:
            self.bad[revision] = bad
        old = self.observed.rollout
        if old is not None and old.active:
            self.ended.append(old.replace(status=RolloutStatus.SUPERSEDED))
        self.desired = dataclasses.replace(self.desired, revision=revision)
        rollout = self._rollout(self.observed.serving_revision, revision, "rollout")
        self._observe(rollout=rollout, backoff=Backoff())
        return revision

    def user_scale(self, replicas: int) -> None:
        self.desired = dataclasses.replace(self.desired, replicas=replicas)

    def user_delete(self) -> None:
        self.desired = dataclasses.replace(self.desired, deleting=True)

    # -- internals -------------------------------------------------------------------------

    def _replica(self, revision: int, state: S, ready_since: float | None = None) -> Replica:
        self.next_replica += 1
        return Replica(f"r{self.next_replica}", revision, state, self.now, self.now, ready_since)

    def _rollout(self, from_revision: int | None, to_revision: int, kind: str) -> Rollout:
        self.next_rollout += 1
        status = RolloutStatus.PROGRESSING
        return Rollout(self.next_rollout - 1, from_revision, to_revision, kind, status, self.now)

    def _active(self, rollout_id: int) -> Rollout:
        rollout = self.observed.rollout
        assert rollout is not None, rollout_id
        assert rollout.active, rollout
        assert rollout.id == rollout_id, rollout
        return rollout

    def _set(self, replica: Replica) -> None:
        replicas = self.observed.replicas
        if any(r.id == replica.id for r in replicas):
            replicas = tuple(replica if r.id == replica.id else r for r in replicas)
        else:
            replicas = (*replicas, replica)
        self._observe(replicas=replicas)

    def _observe(self, **changes: object) -> None:
        self.observed = self.observed.replace(**changes)

    def _fail(self, r: Replica, reason: str, exit_code: int | None = None) -> None:
        self.log.append(f"  {r.id} failed: {reason}")
        self._set(r.replace(state=S.FAILED, since=self.now, failure=reason, exit_code=exit_code))
        self._count_failure(r, reason)

    def _count_failure(self, r: Replica, reason: str) -> None:
        self._observe(backoff=self.observed.backoff.failed(self.now, reason))
        rollout = self.observed.rollout
        if (
            rollout is not None
            and rollout.status is RolloutStatus.PROGRESSING
            and r.revision == rollout.to_revision
        ):
            self._observe(rollout=rollout.replace(failures=rollout.failures + 1))
