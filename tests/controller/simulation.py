"""A pure simulator of one service, driven as ``controller/reconciler.py`` drives it.

``World`` keeps the service's ``(desired, observed)`` pair and changes it only through the
real code: the planner's actions go through ``transitions.decide`` (with new replica and
rollout ids from counters, as the executor and the store give them), what the backend and the
prober report through ``transitions.observe``, what the user asks through
``transitions.intend``. It copies no rule. What stays here is what the reconciler does not
own: the fake backend (its capacity, the starts it has not answered yet, revisions whose
replicas crash or hang) and the clock. Nothing performs I/O, reads a clock or draws a random
number: the tests choose every event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.planning.actions import (
    AbandonRollout,
    Action,
    BeginRollout,
    CompleteRollout,
    FailRollout,
    Forget,
    Start,
    WakeAt,
)
from controller.planning.analysis import Counts, Traffic
from controller.planning.autoscaler import Sample
from controller.planning.model import Desired, Intent, Observed, Replica, Rollout, RolloutStatus
from controller.planning.model import ReplicaState as S
from controller.planning.planner import plan
from controller.planning.transitions import (
    AskPromote,
    Change,
    Configure,
    Counted,
    Delete,
    DrainDone,
    Exited,
    HealthChanged,
    Observation,
    Placed,
    Retarget,
    Sampled,
    SetPaused,
    StartFailed,
    Step,
    decide,
    intend,
    observe,
)
from controller.scaling import Autoscaling
from controller.spec import RolloutStrategy

RUNNING = frozenset({S.STARTING, S.READY, S.UNHEALTHY})
"""States whose process runs, so it can exit or be probed."""

MAX_REPLANS = 5
"""Plans in a row at one instant (a plan that ends with ``WakeAt(now)``) before giving up."""

ENDED = {"aborted": RolloutStatus.ABORTED, "superseded": RolloutStatus.SUPERSEDED}


@dataclass
class World:
    desired: Desired
    observed: Observed
    capacity: int
    """Backend slots: a start beyond them fails with no capacity."""
    now: float = 0.0
    bad: dict[int, str] = field(default_factory=dict)
    """Revisions whose replicas exit when probed (``crash``) or never pass a probe (``hang``)."""
    pending: dict[str, str | None] = field(default_factory=dict)
    """Starts the backend has not answered, in order: the error each will raise, if any."""
    ended: list[Rollout] = field(default_factory=list)
    """Rollouts that completed, failed, were superseded or aborted, in order (from the
    actions that ended them)."""
    log: list[str] = field(default_factory=list)
    forgotten: bool = False
    next_replica: int = 0
    next_rollout: int = 1
    next_revision: int = 2
    errors: dict[int, float] = field(default_factory=dict)
    """The share of a revision's requests it answers with a 5xx."""
    counts: dict[int, Counts] = field(default_factory=dict)
    """Requests each revision answered so far: the data plane's running totals."""
    served: dict[int, int] = field(default_factory=dict)
    """Requests each revision answered, as the pool's split sent them (what a client saw)."""
    taken: list[Action] = field(default_factory=list)
    """Every action applied, in order."""

    @classmethod
    def create(
        cls,
        strategy: RolloutStrategy,
        replicas: int,
        capacity: int,
        *,
        serving: bool,
        scaling: Autoscaling | None = None,
    ) -> World:
        """Revision 1 at full strength (``serving``), or a new service whose first plan will
        begin its first rollout; autoscaled within ``scaling``'s range if given."""
        w = cls(Desired(1, replicas, strategy, scaling=scaling), Observed(), capacity)
        if serving:
            ids = [w._new_id() for _ in range(replicas)]
            ready = [
                Replica(rid, 1, S.READY, 0.0, 0.0, 0.0, f"127.0.0.1:{rid}", healthy=True)
                for rid in ids
            ]
            w.observed = Observed(tuple(ready), serving_revision=1, target=1)
        return w

    # -- reading ---------------------------------------------------------------------------

    def get(self, replica_id: str) -> Replica:
        return next(r for r in self.observed.replicas if r.id == replica_id)

    def pick(self, states: Iterable[S], index: int) -> Replica | None:
        """The ``index``-th replica (modulo) in one of ``states``, if any."""
        wanted = set(states)
        found = [r for r in self.observed.replicas if r.state in wanted]
        return found[index % len(found)] if found else None

    def pick_pending(self, index: int) -> str | None:
        """The ``index``-th start (modulo) the backend has not answered yet."""
        found = list(self.pending)
        return found[index % len(found)] if found else None

    def pick_draining(self, index: int) -> Replica | None:
        """A replica whose drain runs in the pool (placed, not yet drained)."""
        found = [
            r
            for r in self.observed.replicas
            if r.state is S.DRAINING and r.address is not None and not r.drained
        ]
        return found[index % len(found)] if found else None

    def slots_in_use(self) -> int:
        doomed = {rid for rid, error in self.pending.items() if error is not None}
        return sum(1 for r in self.observed.replicas if not r.terminal and r.id not in doomed)

    def ready_of(self, revision: int) -> int:
        return sum(r.state is S.READY and r.revision == revision for r in self.observed.replicas)

    def converged(self) -> bool:
        """D ready replicas of the target, nothing else live, no active rollout, not degraded,
        and the target serves (rule 10)."""
        live = [r for r in self.observed.replicas if r.live]
        rollout = self.observed.rollout
        return (
            (rollout is None or not rollout.active)
            and self.observed.target == self.desired.revision
            and len(live) == self.desired.replicas
            and all(r.state is S.READY and r.revision == self.desired.revision for r in live)
            and self.observed.degraded is None
            and (
                self.desired.replicas == 0
                or self.observed.serving_revision == self.desired.revision
            )
        )

    def describe(self, tail: int = 60) -> str:
        """The last ``tail`` lines of the log and the state now, for a failing test."""
        o, d = self.observed, self.desired
        lines = [*self.log[-tail:], f"now={self.now:g} {d}", f"rollout={o.rollout}"]
        lines += [f"target={o.target} serving={o.serving_revision} backoff={o.backoff}"]
        lines += [f"degraded={o.degraded!r} capacity={self.capacity}"]
        lines += [f"  {r}" for r in o.replicas if not r.terminal]
        return "\n".join(lines)

    # -- the reconciler's loop -------------------------------------------------------------

    def plan(self) -> list[Action]:
        return plan(self.observed, self.desired, self.now)

    def apply(self, actions: Iterable[Action]) -> None:
        """Take each decision as ``Reconciler._take`` does; the fake backend learns of the
        starts (and whether it has a slot for them)."""
        for action in actions:
            self.log.append(f"  {action}")
            self.taken.append(action)
            match action:
                case Start():
                    used = self.slots_in_use()
                    rid = self._new_id()
                    self._commit(decide(self.desired, self.observed, action, self.now, new_id=rid))
                    full = used >= self.capacity
                    self.pending[rid] = (
                        f"no capacity: {used} of {self.capacity} slots in use" if full else None
                    )
                case BeginRollout():
                    rollout_id = self.next_rollout
                    self.next_rollout += 1
                    step = decide(
                        self.desired, self.observed, action, self.now, rollout_id=rollout_id
                    )
                    self._commit(step)
                case CompleteRollout(rollout_id=rid):
                    self._ended(rid, RolloutStatus.COMPLETE)
                    self._commit(decide(self.desired, self.observed, action, self.now))
                case FailRollout(rollout_id=rid, reason=reason):
                    self._ended(rid, RolloutStatus.FAILED, reason)
                    self._commit(decide(self.desired, self.observed, action, self.now))
                case AbandonRollout(rollout_id=rid, outcome=outcome, reason=reason):
                    self._ended(rid, ENDED[outcome], reason)
                    self._commit(decide(self.desired, self.observed, action, self.now))
                case Forget():
                    self._commit(decide(self.desired, self.observed, action, self.now))
                    self.forgotten = True
                case _:
                    self._commit(decide(self.desired, self.observed, action, self.now))

    def step(self) -> list[Action]:
        """One plan, applied; then, as the loop does when a plan wakes it at once (a rollout
        begun, resumed or failed), the next plans at the same instant. Every action taken."""
        taken: list[Action] = []
        for _ in range(MAX_REPLANS):
            actions = self.plan()
            self.apply(actions)
            taken += actions
            if WakeAt(self.now) not in actions:
                return taken
        raise AssertionError(f"plans at {self.now} do not settle: {taken[-20:]}")

    # -- the backend and the prober --------------------------------------------------------

    def spawn(self, replica_id: str, outcome: str) -> None:
        """The backend answers a start: ``ok``, ``no capacity``, ``start failed``."""
        reason = self.pending.pop(replica_id)
        if reason is None and outcome == "no capacity":
            reason = f"no capacity: {self.capacity} of {self.capacity} slots in use"
        elif reason is None and outcome == "start failed":
            reason = "start failed: exec format error"
        if reason is not None:
            self._observe(StartFailed(replica_id, reason))
        else:
            self._observe(Placed(replica_id, f"127.0.0.1:{replica_id}"))

    def probe(self, replica_id: str, passed: bool) -> None:
        """A probe's verdict on a running or draining replica (a bad revision's never passes,
        or its replica exits)."""
        r = self.get(replica_id)
        if r.address is None or not (r.state in RUNNING or r.state is S.DRAINING):
            return
        kind = self.bad.get(r.revision)
        if kind == "crash" and r.state in RUNNING:
            self.crash(r.id, 1)
            return
        healthy = passed and kind is None
        self._observe(HealthChanged(r.id, healthy, "" if healthy else "connection refused"))

    def crash(self, replica_id: str, code: int) -> None:
        r = self.get(replica_id)
        assert r.state in RUNNING
        self._observe(Exited(r.id, code, f"exited with code {code}", requested=False))

    def drain_done(self, replica_id: str) -> None:
        self._observe(DrainDone(replica_id, clean=True))

    def stop_done(self, replica_id: str) -> None:
        r = self.get(replica_id)
        assert r.state is S.STOPPING
        self._observe(Exited(r.id, 0, "stopped", requested=True))

    def sample(self, inflight: int, held: int = 0) -> None:
        """The data plane's traffic now, as the reconciler samples it: ``inflight`` requests
        spread over the READY replicas (``held`` waiting when none is)."""
        ready = [r for r in self.observed.replicas if r.state is S.READY]
        if not ready:
            held, inflight = held + inflight, 0
        per = [(r.id, inflight // len(ready) + (i < inflight % len(ready))) for i, r in
               enumerate(ready)] if ready else []  # fmt: skip
        self._observe(Sampled(Sample(self.now, inflight, held, 0, 0, len(ready), tuple(per))))

    def requests(self, n: int) -> None:
        """``n`` requests through the pool as its split sends them (the share of each side,
        the one with nothing ready giving its share to the other; without a split, by ready
        replica counts), then the reconciler's sample of the counts."""
        ready: dict[int, int] = {}
        for r in self.observed.replicas:
            if r.state is S.READY:
                ready[r.revision] = ready.get(r.revision, 0) + 1
        total = sum(ready.values())
        shares: dict[int, float] = {}
        split = self.observed.split
        if total and split is not None:
            revision, weight = split
            chosen = ready.get(revision, 0)
            rest = total - chosen
            share = weight / 100 if chosen and rest else (1.0 if chosen else 0.0)
            for rev, count in ready.items():
                if rev == revision:
                    shares[rev] = share
                else:
                    shares[rev] = (1 - share) * count / rest
        elif total:
            shares = {rev: count / total for rev, count in ready.items()}
        for rev, share in shares.items():
            k = round(n * share)
            if not k:
                continue
            bad = round(k * self.errors.get(rev, 0.0))
            before = self.counts.get(rev, Counts(0, 0, (0, 0)))
            self.counts[rev] = Counts(
                before.requests + k, before.errors + bad, (before.latency[0] + k, 0)
            )
            self.served[rev] = self.served.get(rev, 0) + k
        traffic = Traffic(self.now, (0.1,), tuple(sorted(self.counts.items())))
        self._observe(Counted(traffic))

    def settle(self) -> bool:
        """One benign round: every start is placed, probes pass, drains and stops finish.
        Whether anything changed."""
        before = self.observed
        for rid in list(self.pending):
            self.spawn(rid, "ok")
        for r in self.observed.replicas:
            if r.state in (S.STARTING, S.UNHEALTHY):
                self.probe(r.id, True)
            elif r.state is S.DRAINING and r.address is not None and not r.drained:
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
        self._intend(Retarget(revision, "apply"))
        return revision

    def user_retarget(self, revision: int, intent: Intent) -> None:
        """An undo, an abort, or an apply of an earlier spec."""
        self._intend(Retarget(revision, intent))

    def user_scale(self, replicas: int) -> None:
        self._intend(Configure(replicas, self.desired.strategy, self.desired.static))

    def user_pause(self, paused: bool) -> None:
        self._intend(SetPaused(paused))

    def user_promote(self) -> bool:
        """``rollout promote``, taken only while a rollout is active, as the admin API takes
        it (``Operations.promote``: 409 otherwise); whether it was taken."""
        rollout = self.observed.rollout
        if rollout is None or not rollout.active:
            return False
        self._intend(AskPromote())
        return True

    def user_delete(self) -> None:
        self._intend(Delete())

    # -- internals -------------------------------------------------------------------------

    def _new_id(self) -> str:
        self.next_replica += 1
        return f"r{self.next_replica}"

    def _commit(self, step: Step) -> None:
        self.desired, self.observed = step.desired, step.observed
        self.log += [f"    {e.kind}: {e.message}" for e in step.events]

    def _observe(self, seen: Observation) -> None:
        self.log.append(f"  {seen}")
        self._commit(observe(self.desired, self.observed, seen, self.now))

    def _intend(self, change: Change) -> None:
        self.log.append(f"  {change}")
        self._commit(intend(self.desired, self.observed, [change]))

    def _ended(self, rollout_id: int, status: RolloutStatus, reason: str = "") -> None:
        rollout = self.observed.rollout
        assert rollout is not None, rollout_id
        assert rollout.active, rollout
        assert rollout.id == rollout_id, rollout
        self.ended.append(rollout.replace(status=status, reason=reason))
