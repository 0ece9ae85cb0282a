"""What the nodes of a cluster share of a pool, and what each node reports back. PURE.

The leader publishes each service's *pool record* (``<prefix>pools/<service>``): its routing,
its upstreams' membership and admin state, its traffic split and failure, and the leader's
snapshot version. Never health or ejections: every node probes and ejects for itself. Every
other node (a follower) turns a record into the steps that make its own pool match (``plan``).

Each follower publishes a *node report* (``<prefix>reports/<node>``): which upstreams it can
route to, which draining upstreams it holds nothing of (``idle``), each with the version
the leader gave that drain (``Member.since``), and its traffic per service (``demand.Demand``).
The leader reads the reports (``PeerTable``): a drain there completes once every live node is
idle on it; "a replacement is serving" means routable on every node that reports; the
autoscaler reads the demand merged over the nodes (``demand.DemandTable``).

Invariants:
- A record's content (``PoolRecord.content``) changes only when membership, admin state, the
  routing, the split or the failure do: health never makes a write.
- ``plan`` never adds an upstream routable: it starts as the local pool's default (unknown) and
  the node's own probes decide. A draining member is added, then drained.
- A drain's ``since`` is the leader's snapshot version that made it draining, so an idle report
  of an earlier drain of the same upstream never completes a later one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from controller.cluster.demand import Demand
from gateway import (
    AdminState,
    PoolSnapshot,
    ProbeConfig,
    ServiceRouting,
    Upstream,
    dump_settings,
    parse_settings,
)

# -- the pool record --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Member:
    """One upstream as the cluster knows it: where it is and whether it is draining."""

    id: str
    host: str
    port: int
    revision: int = 0
    weight: int = 1
    probes: tuple[ProbeConfig, ...] = ()
    admin: AdminState = AdminState.ACTIVE
    since: int = 0
    """While draining: the leader's snapshot version that made it so (0 while active)."""
    timeout: float | None = None
    """While draining: the drain timeout the leader gave, None for the follower's default."""

    @classmethod
    def of(cls, upstream: Upstream, since: int = 0, timeout: float | None = None) -> Member:
        draining = upstream.admin is AdminState.DRAINING
        return cls(
            upstream.id,
            upstream.host,
            upstream.port,
            upstream.revision,
            upstream.weight,
            upstream.probes,
            upstream.admin,
            since if draining else 0,
            timeout if draining else None,
        )

    def upstream(self, service: str) -> Upstream:
        """The upstream to add to a local pool: active (``plan`` drains it next if need be)."""
        return Upstream(
            self.id, service, self.host, self.port, self.revision, self.weight, probes=self.probes
        )

    def same_place(self, upstream: Upstream) -> bool:
        """Whether ``upstream`` is this member (same address, revision, weight and probes)."""
        return (
            upstream.host == self.host
            and upstream.port == self.port
            and upstream.revision == self.revision
            and upstream.weight == self.weight
            and upstream.probes == self.probes
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "host": self.host,
            "port": self.port,
            "revision": self.revision,
            "admin": self.admin.value,
        }
        if self.weight != 1:
            out["weight"] = self.weight
        if self.probes:
            out["probes"] = [dump_settings(p) for p in self.probes]
        if self.admin is AdminState.DRAINING:
            out["since"] = self.since
            if self.timeout is not None:
                out["timeout"] = self.timeout
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Member:
        timeout = raw.get("timeout")
        return cls(
            str(raw["id"]),
            str(raw["host"]),
            int(raw["port"]),
            int(raw.get("revision", 0)),
            int(raw.get("weight", 1)),
            tuple(parse_settings(ProbeConfig, p) for p in raw.get("probes", ())),
            AdminState(raw.get("admin", "active")),
            int(raw.get("since", 0)),
            None if timeout is None else float(timeout),
        )


@dataclass(frozen=True, slots=True)
class PoolRecord:
    """A service's pool as the leader publishes it."""

    routing: ServiceRouting
    upstreams: tuple[Member, ...] = ()
    split: tuple[int, int] | None = None
    failure: str = ""
    version: int = 0
    """The leader's snapshot version when it was written (not part of ``content``)."""

    @property
    def service(self) -> str:
        return self.routing.name

    @property
    def content(self) -> PoolRecord:
        """The record without its version: what decides whether it must be written again."""
        return replace(self, version=0) if self.version else self

    def member(self, upstream_id: str) -> Member | None:
        for member in self.upstreams:
            if member.id == upstream_id:
                return member
        return None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "routing": dump_settings(self.routing),
                "upstreams": [m.to_json() for m in self.upstreams],
                "split": None if self.split is None else list(self.split),
                "failure": self.failure,
                "version": self.version,
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> PoolRecord:
        """Raises ``ValueError`` (pydantic's ``ValidationError`` is one) on a malformed record."""
        try:
            raw = json.loads(data)
            split = raw.get("split")
            return cls(
                parse_settings(ServiceRouting, raw["routing"]),
                tuple(Member.from_json(m) for m in raw.get("upstreams", ())),
                None if split is None else (int(split[0]), int(split[1])),
                str(raw.get("failure", "")),
                int(raw.get("version", 0)),
            )
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ValueError(f"not a pool record: {exc!r}") from exc


def record_of(
    routing: ServiceRouting,
    snapshot: PoolSnapshot,
    drains: Mapping[str, tuple[int, float | None]] | None = None,
) -> PoolRecord:
    """The record of a service's pool; ``drains``: upstream id -> (since, timeout) of the
    draining ones (a draining upstream not in it gets the snapshot's version)."""
    drains = drains or {}
    members = []
    for upstream in snapshot.upstreams:
        since, timeout = drains.get(upstream.id, (snapshot.version, None))
        members.append(Member.of(upstream, since, timeout))
    return PoolRecord(routing, tuple(members), snapshot.weights, snapshot.failure, snapshot.version)


# -- what a follower does with a record -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetService:
    routing: ServiceRouting


@dataclass(frozen=True, slots=True)
class RemoveService:
    service: str


@dataclass(frozen=True, slots=True)
class AddUpstream:
    upstream: Upstream


@dataclass(frozen=True, slots=True)
class RemoveUpstream:
    upstream_id: str


@dataclass(frozen=True, slots=True)
class DrainUpstream:
    upstream_id: str
    timeout: float | None
    """None: the follower's default."""


@dataclass(frozen=True, slots=True)
class UndrainUpstream:
    upstream_id: str


@dataclass(frozen=True, slots=True)
class SetSplit:
    split: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class SetFailure:
    failure: str


Step = (
    SetService
    | RemoveService
    | AddUpstream
    | RemoveUpstream
    | DrainUpstream
    | UndrainUpstream
    | SetSplit
    | SetFailure
)


def plan(
    routing: ServiceRouting | None, snapshot: PoolSnapshot | None, record: PoolRecord | None
) -> list[Step]:
    """The steps that make a local service (its ``routing`` and ``snapshot``, both None when
    it has none) match ``record`` (None: the service's key is gone), in the order to take
    them: the service, removals, additions, drains and undrains, the split, the failure.

    An upstream whose address, revision, weight or probes changed under the same id is
    removed and added again (its health starts over)."""
    if record is None:
        return [] if routing is None else [RemoveService(routing.name)]
    steps: list[Step] = []
    if routing != record.routing:
        steps.append(SetService(record.routing))
    local = {u.id: u for u in snapshot.upstreams} if snapshot is not None else {}
    wanted = {m.id: m for m in record.upstreams}
    kept: dict[str, Upstream] = {}
    for uid, upstream in local.items():
        member = wanted.get(uid)
        if member is None or not member.same_place(upstream):
            steps.append(RemoveUpstream(uid))
        else:
            kept[uid] = upstream
    for member in record.upstreams:
        if member.id not in kept:
            steps.append(AddUpstream(member.upstream(record.service)))
    for member in record.upstreams:
        have = kept.get(member.id)
        admin = have.admin if have is not None else AdminState.ACTIVE
        if member.admin is AdminState.DRAINING and admin is not AdminState.DRAINING:
            steps.append(DrainUpstream(member.id, member.timeout))
        elif member.admin is AdminState.ACTIVE and admin is AdminState.DRAINING:
            steps.append(UndrainUpstream(member.id))
    if (snapshot.weights if snapshot is not None else None) != record.split:
        steps.append(SetSplit(record.split))
    if (snapshot.failure if snapshot is not None else "") != record.failure:
        steps.append(SetFailure(record.failure))
    return steps


# -- what a follower reports ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeReport:
    """What one node can route to, the draining upstreams it holds nothing of, and its
    traffic per service (``demand``)."""

    routable: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Service -> the ids of its upstreams routable on the node (services with none left out)."""
    idle: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(service, upstream id) -> the ``since`` of the drain the node is idle on."""
    demand: Mapping[str, Demand] = field(default_factory=dict)
    """Service -> its traffic on the node (services with none so far left out)."""
    fresh_for: float = 0.0
    """Seconds ``demand`` counts once taken in (the node's lease TTL; 0: while it is there)."""

    @property
    def busy(self) -> bool:
        """Requests in flight or held on the node: its report is written again before its
        demand goes stale."""
        return any(d.busy for d in self.demand.values())

    def encode(self) -> bytes:
        out: dict[str, Any] = {
            "routable": {s: sorted(ids) for s, ids in sorted(self.routable.items())},
            "idle": {f"{s}/{u}": v for (s, u), v in sorted(self.idle.items())},
        }
        if self.demand:
            out["demand"] = {s: d.to_json() for s, d in sorted(self.demand.items())}
        if self.fresh_for:
            out["fresh_for"] = self.fresh_for
        return json.dumps(out, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> NodeReport:
        try:
            raw = json.loads(data)
            routable = {
                str(s): frozenset(str(u) for u in ids) for s, ids in raw["routable"].items()
            }
            idle: dict[tuple[str, str], int] = {}
            for key, version in raw["idle"].items():
                service, _, uid = str(key).partition("/")
                idle[service, uid] = int(version)
            demand = {str(s): Demand.from_json(d) for s, d in raw.get("demand", {}).items()}
            fresh_for = float(raw.get("fresh_for", 0.0))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a node report: {exc!r}") from exc
        return cls(routable, idle, demand, fresh_for)


def report_of(
    snapshots: Iterable[PoolSnapshot],
    records: Mapping[str, PoolRecord],
    drained: Iterable[tuple[str, str]],
    demand: Mapping[str, Demand] | None = None,
    fresh_for: float = 0.0,
) -> NodeReport:
    """A follower's report: what its ``snapshots`` route to, of the upstreams the leader's
    ``records`` say are draining those whose local drain is over (``drained``), and the
    ``demand`` of the records' services that have any."""
    routable = {s.service: frozenset(u.id for u in s.routable) for s in snapshots if s.routable}
    idle: dict[tuple[str, str], int] = {}
    for service, uid in drained:
        record = records.get(service)
        member = record.member(uid) if record is not None else None
        if member is not None and member.admin is AdminState.DRAINING:
            idle[service, uid] = member.since
    said = {s: d for s, d in (demand or {}).items() if s in records and not d.empty}
    return NodeReport(routable, idle, said, fresh_for)


# -- what the leader makes of the reports -----------------------------------------------------


class PeerTable:
    """The nodes that report, each a pool peer with an int stable for the table's life.

    Node peers are negative, so they never meet a worker process's pid (the other peers of
    the leader's pool)."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}
        self.reports: dict[str, NodeReport] = {}

    def number(self, node: str) -> int:
        peer = self.numbers.get(node)
        if peer is None:
            peer = self.numbers[node] = -(len(self.numbers) + 1)
        return peer

    def update(self, node: str, report: NodeReport) -> bool:
        """Take a node's report; True when the node is new (it just joined)."""
        joined = node not in self.reports
        self.reports[node] = report
        return joined

    def remove(self, node: str) -> bool:
        """Forget a node; True when it was there."""
        return self.reports.pop(node, None) is not None

    def routable_everywhere(self, service: str, upstream_id: str) -> bool:
        """Routable on every node that reports (True with none: nothing else serves)."""
        return all(
            upstream_id in report.routable.get(service, ()) for report in self.reports.values()
        )

    def __repr__(self) -> str:
        return f"<PeerTable nodes={sorted(self.reports)}>"
