"""A rollout as a trace: its span, its steps' and its replicas' (start to ready), made from
the journal's entries and handed to the span exporter (``tracing.otlp_endpoint``).

Each rollout is one trace, whose id is derived from its record (``trace_id``: the service
and the rollout's id), so the rollout record leads to its trace without storing anything,
and a trace begun by one leader is continued under the same id by the next. The rollout's
span is the trace's root (``rollout_started`` to ``rollout_complete``, ``_failed``,
``_aborted`` or ``_superseded``: an error unless complete); each step (``rollout_step``,
``rollout_promoted``) is a child from its entry to the next step or the end; each replica
started meanwhile is a child from ``replica_started`` to ``replica_ready`` (or its failure,
an error, or its stop). A span goes to the exporter as it ends; times are the entries'
(the journal's wall clock).

Invariants: a listener of the journal never raises into it (the journal logs what it
raises) and holds at most ``MAX_OPEN`` replicas' spans; nothing is made without a rollout.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from gateway import Span

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


class RolloutTraces:
    """A journal listener (``Journal.listen``) sending each rollout's spans to ``add``;
    ``rollout_of`` gives a service's active rollout (for its id)."""

    def __init__(
        self,
        add: Callable[[list[Span]], None],
        rollout_of: Callable[[str], Rollout | None],
    ) -> None:
        self._add = add
        self._rollout_of = rollout_of
        self._traces: dict[str, _Trace] = {}
        self._replicas: dict[str, tuple[str, _Open]] = {}
        """Replica id -> its trace id and its open span."""

    def __call__(self, entry: Entry) -> None:
        kind, service, at = entry.kind, entry.service, entry.at
        trace = self._traces.get(service)
        if kind == "rollout_started":
            rollout = self._rollout_of(service)
            if rollout is None:
                return
            root = _Open(_span_id(), "", f"rollout {service}", at)
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

    def _replica(self, entry: Entry, trace: _Trace | None) -> None:
        replica = entry.replica
        if replica is None:
            return
        kind = entry.kind
        if kind == "replica_started" and trace is not None:
            if len(self._replicas) >= MAX_OPEN:
                self._replicas.pop(next(iter(self._replicas)))
            span = _Open(_span_id(), trace.root.span_id, f"replica {replica}", entry.at)
            span.attributes["gateway.replica"] = replica
            if entry.revision is not None:
                span.attributes["gateway.revision"] = entry.revision
            self._replicas[replica] = (trace.trace_id, span)
        elif kind in ("replica_ready", "replica_failed", "replica_stopped"):
            held = self._replicas.pop(replica, None)
            if held is not None:
                held[1].attributes["gateway.outcome"] = kind.removeprefix("replica_")
                self._send(held[0], held[1], entry.at, kind == "replica_failed")

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
