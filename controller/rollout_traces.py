"""A rollout as a trace: the apply that began it, its span, its steps' and its replicas'
(their start, their probes to ready), handed to the span exporter (``tracing.otlp_endpoint``).

Each rollout is one trace, whose id is derived from its record (``trace_id``: the service
and the rollout's id), so the rollout record leads to its trace without storing anything,
and a trace begun by one leader is continued under the same id by the next. An apply
(``ApplySpan``: the admin API's, a config file's) is the root of the trace of the rollout it
began, its phases (validate, diff, store write, plan) its children; an apply that began none
(unchanged, a same-template update, refused: an error) is a trace of its own. The rollout's
span (``rollout_started`` to ``rollout_complete``, ``_failed``, ``_aborted`` or
``_superseded``: an error unless complete) is the apply's child, or the root; each step
(``rollout_step``, ``rollout_promoted``) is its child from its entry to the next step or the
end; each replica started meanwhile is its child from the backend's start call
(``launching``) to ``replica_ready`` (or its failure, an error, or its stop), with two
children: ``start`` (the start call to ``replica_started``: the process or container up)
and ``probe to ready`` (the first probe heard, ``on_probe``, to ``replica_ready``, with the
probes' count). A span goes to the exporter as it ends; times are the entries' (the
journal's wall clock) or the ``wall`` clock's.

Invariants: a listener of the journal never raises into it (the journal logs what it
raises) and holds at most ``MAX_OPEN`` replicas' spans; nothing of a rollout is made without
one. Made in the I/O shell: the planning core knows nothing of spans.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from gateway import ProbeResult, Span

    from .journal import Entry
    from .planning.model import Rollout

INTERNAL: Final = 1
"""OTLP's ``SPAN_KIND_INTERNAL``."""
MAX_OPEN: Final = 1000
"""Replicas' spans held open at most (a replica that never says ready is forgotten)."""
ENDS: Final = {
    "rollout_complete": False,
    "rollout_failed": True,
    "rollout_aborted": True,
    "rollout_superseded": False,
}
"""The entries that end a rollout, and whether its span is then an error."""


def trace_id(service: str, rollout: int) -> str:
    """The trace id of ``service``'s rollout number ``rollout`` (32 lower-case hex digits)."""
    return hashlib.sha256(f"{service}\0{rollout}".encode()).hexdigest()[:32]


def _span_id() -> str:
    return f"{random.getrandbits(63) + 1:016x}"


def _own_trace_id() -> str:
    return f"{random.getrandbits(127) + 1:032x}"


@dataclass
class _Open:
    """A span begun and not yet ended."""

    span_id: str
    parent_id: str
    name: str
    start: float
    attributes: dict[str, str | int] = field(default_factory=dict)


@dataclass
class _Trace:
    """A service's rollout under way."""

    trace_id: str
    root: _Open
    step: _Open | None = None


@dataclass
class _Replica:
    """A replica's spans, from its start call until it is ready (or fails, or stops)."""

    trace_id: str
    span: _Open
    start: _Open | None = None
    """Its start, until ``replica_started``."""
    first_probe: float | None = None
    probes: int = 0


class ApplySpan:
    """One apply as it happens (``Controller.applying``): its phases, what it did or why it
    was refused. ``source`` says where it came from (``api``, ``config``), ``by`` who or what
    (the API client, the config file), when known."""

    def __init__(self, wall: Callable[[], float], source: str, by: str = "") -> None:
        self._wall = wall
        self.span_id = _span_id()
        self.start = wall()
        self.service = ""
        self.rollout: int | None = None
        """The rollout it began, once begun (its trace is then the rollout's)."""
        self.error = False
        self.attributes: dict[str, str | int] = {"gateway.apply.source": source}
        if by:
            self.attributes["gateway.apply.by"] = by
        self.phases: list[tuple[str, float, float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as the phase ``name`` (a child span), whether or not it raises."""
        start = self._wall()
        try:
            yield
        finally:
            self.phases.append((name, start, self._wall()))

    def named(self, service: str) -> None:
        self.service = service
        self.attributes["gateway.service"] = service

    def did(
        self, action: str, revision: int, previous: int | None, changes: tuple[str, ...]
    ) -> None:
        """What the apply did (``operations.ApplyResult``'s fields)."""
        attributes = self.attributes
        attributes["gateway.apply.action"] = action
        attributes["gateway.revision"] = revision
        if previous is not None:
            attributes["gateway.revision.from"] = previous
        if changes:
            attributes["gateway.apply.changes"] = ", ".join(changes)

    def refused(self, reason: str) -> None:
        self.error = True
        self.attributes["gateway.apply.refused"] = reason

    def __repr__(self) -> str:
        return f"<ApplySpan {self.service or '?'} phases={len(self.phases)} error={self.error}>"


class RolloutTraces:
    """A journal listener (``Journal.listen``) sending each rollout's spans to ``add``;
    ``rollout_of`` gives a service's active rollout (for its id). It hears too the applies
    (``applying``, ``applied``), the backend's start calls (``launching``) and the probes
    (``on_probe``: a ``gateway.ProbeObserver``)."""

    def __init__(
        self,
        add: Callable[[list[Span]], None],
        rollout_of: Callable[[str], Rollout | None],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._add = add
        self._rollout_of = rollout_of
        self._wall = wall
        self._traces: dict[str, _Trace] = {}
        self._replicas: dict[str, _Replica] = {}
        self._applying: dict[str, ApplySpan] = {}
        """Service -> its apply under way (one at a time: ``Controller`` serialises them)."""

    # -- applies ---------------------------------------------------------------------------

    @contextmanager
    def applying(self, span: ApplySpan) -> Iterator[None]:
        """A rollout that begins in the block is ``span``'s child, in the rollout's trace."""
        self._applying[span.service] = span
        try:
            yield
        finally:
            if self._applying.get(span.service) is span:
                del self._applying[span.service]

    def applied(self, span: ApplySpan) -> None:
        """Send ``span`` (ended now) and its phases."""
        end = self._wall()
        if span.rollout is not None:
            trace = trace_id(span.service, span.rollout)
            span.attributes["gateway.rollout"] = span.rollout
        else:
            trace = _own_trace_id()
        name = f"apply {span.service}" if span.service else "apply"
        root = _Open(span.span_id, "", name, span.start, span.attributes)
        self._send(trace, root, end, span.error)
        for phase, start, ended in span.phases:
            self._send(trace, _Open(_span_id(), span.span_id, phase, start), ended, False)

    # -- the journal's entries -------------------------------------------------------------

    def __call__(self, entry: Entry) -> None:
        kind, service, at = entry.kind, entry.service, entry.at
        trace = self._traces.get(service)
        if kind == "rollout_started":
            rollout = self._rollout_of(service)
            if rollout is None:
                return
            apply = self._applying.get(service)
            parent = ""
            if apply is not None:
                apply.rollout, parent = rollout.id, apply.span_id
            root = _Open(_span_id(), parent, f"rollout {service}", at)
            root.attributes.update(
                {
                    "gateway.service": service,
                    "gateway.rollout": rollout.id,
                    "gateway.rollout.kind": rollout.kind,
                    "gateway.rollout.strategy": rollout.strategy,
                    "gateway.revision": rollout.to_revision,
                }
            )
            if rollout.from_revision is not None:
                root.attributes["gateway.revision.from"] = rollout.from_revision
            self._traces[service] = _Trace(trace_id(service, rollout.id), root)
        elif trace is None:
            self._replica(entry, None)
        elif kind in ("rollout_step", "rollout_promoted"):
            self._end_step(trace, at)
            trace.step = _Open(_span_id(), trace.root.span_id, entry.message, at)
        elif kind in ENDS:
            self._end_step(trace, at)
            trace.root.attributes["gateway.outcome"] = kind.removeprefix("rollout_")
            self._send(trace.trace_id, trace.root, at, ENDS[kind])
            del self._traces[service]
        else:
            self._replica(entry, trace)

    def launching(self, service: str, replica: str) -> None:
        """The backend is asked to start ``replica`` (``Executor.on_launch``)."""
        trace = self._traces.get(service)
        if trace is None:
            return
        now = self._wall()
        span = self._replica_span(trace, replica, now)
        self._hold(
            replica, _Replica(trace.trace_id, span, _Open(_span_id(), span.span_id, "start", now))
        )

    def on_probe(self, result: ProbeResult) -> None:
        """A probe of a replica whose span is open: counted, the first one's start kept."""
        held = self._replicas.get(result.upstream_id)
        if held is None or held.start is not None:
            return
        if held.first_probe is None:
            held.first_probe = self._wall() - result.duration
        held.probes += 1

    def _replica_span(self, trace: _Trace, replica: str, at: float) -> _Open:
        span = _Open(_span_id(), trace.root.span_id, f"replica {replica}", at)
        span.attributes["gateway.replica"] = replica
        return span

    def _hold(self, replica: str, held: _Replica) -> None:
        if len(self._replicas) >= MAX_OPEN:
            self._replicas.pop(next(iter(self._replicas)))
        self._replicas[replica] = held

    def _replica(self, entry: Entry, trace: _Trace | None) -> None:
        replica = entry.replica
        if replica is None:
            return
        kind, at = entry.kind, entry.at
        held = self._replicas.get(replica)
        if kind == "replica_started":
            if held is None:  # its start call unheard: the span begins here
                if trace is None:
                    return
                held = _Replica(trace.trace_id, self._replica_span(trace, replica, at))
                self._hold(replica, held)
            if entry.revision is not None:
                held.span.attributes["gateway.revision"] = entry.revision
            if held.start is not None:
                self._send(held.trace_id, held.start, at, False)
                held.start = None
        elif held is not None and kind in ("replica_ready", "replica_failed", "replica_stopped"):
            del self._replicas[replica]
            error = kind == "replica_failed"
            outcome = kind.removeprefix("replica_")
            if held.start is not None:  # its start failed
                held.start.attributes["gateway.outcome"] = outcome
                self._send(held.trace_id, held.start, at, error)
            elif held.first_probe is not None:
                probe = _Open(_span_id(), held.span.span_id, "probe to ready", held.first_probe)
                probe.attributes.update({"gateway.probes": held.probes, "gateway.outcome": outcome})
                self._send(held.trace_id, probe, max(at, held.first_probe), error)
            held.span.attributes["gateway.probes"] = held.probes
            held.span.attributes["gateway.outcome"] = outcome
            self._send(held.trace_id, held.span, at, error)

    def _end_step(self, trace: _Trace, at: float) -> None:
        if trace.step is not None:
            self._send(trace.trace_id, trace.step, at, False)
            trace.step = None

    def _send(self, trace: str, span: _Open, end: float, error: bool) -> None:
        self._add(
            [
                (
                    trace,
                    span.span_id,
                    span.parent_id,
                    span.name,
                    INTERNAL,
                    span.start,
                    end,
                    error,
                    tuple(span.attributes.items()),
                )
            ]
        )

    def __repr__(self) -> str:
        return f"<RolloutTraces rollouts={len(self._traces)} replicas={len(self._replicas)}>"
