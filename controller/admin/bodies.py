"""The admin API's request and response bodies, as pydantic models.

These models are the contract: handlers build every JSON body through them, and the OpenAPI
document (``openapi.py``) is generated from their JSON schemas, so the two cannot drift apart.
Response models forbid unknown fields (``additionalProperties: false``); only the error body
is open, because errors carry details of their own (``service``, ``reason``...).

Times are wall-clock seconds since the epoch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from ..acme.manager import CertificateState
from ..errors import Limit
from ..scaling import MAX_REPLICAS, ScalingMetric
from ..tokens import TOKEN_PATTERN

SPEC_MARK = "x-service-spec"
"""Marks where the document refers to ServiceSpec (pydantic would resolve a ``$ref`` here)."""

SpecJson = Annotated[dict[str, Any], WithJsonSchema({"type": "object", SPEC_MARK: True})]
"""A service spec as applied (fields left out of the apply are left out here too)."""

ReplicaStateName = Literal[
    "requested", "starting", "ready", "unhealthy", "draining", "stopping", "stopped", "failed"
]
UpstreamStateName = Literal["unknown", "healthy", "unhealthy", "draining", "ejected"]
RolloutKindName = Literal["rollout", "rollback", "undo"]
RolloutStatusName = Literal[
    "progressing", "paused", "complete", "failed", "aborted", "superseded", "rolled_back"
]
ServiceStatus = Literal["ready", "progressing", "paused", "degraded", "deleting"]


class Schema(BaseModel):
    # Attribute docstrings become the fields' descriptions in the OpenAPI document.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


# -- requests -------------------------------------------------------------------------------


class RequestBody(Schema):
    """A request body: strict about JSON types (a boolean is no integer, a number no string),
    as the document's types say."""

    model_config = ConfigDict(strict=True)


class ScaleRequest(RequestBody):
    replicas: int = Field(ge=0, le=MAX_REPLICAS)


class UndoRequest(RequestBody):
    revision: int | None = Field(default=None, ge=1)
    """The revision to return to; by default the one before the current target."""


# -- errors ---------------------------------------------------------------------------------


class FieldError(Schema):
    field: str
    """The field's path, dotted (``route.path_prefix``, ``probes.0.interval``)."""
    reason: str


class ErrorBody(BaseModel):
    """Every error: a stable code, a message for people, and details of the error kind."""

    model_config = ConfigDict(frozen=True, extra="allow", use_attribute_docstrings=True)

    error: str
    message: str
    errors: list[FieldError] | None = None
    """Invalid specs and requests: each field path and what is wrong with it."""
    limit: Limit | None = None
    """A document refused while it was parsed (413 ``document_too_large``): the limit passed."""
    allowed: int | None = None
    """That limit's value."""


# -- services -------------------------------------------------------------------------------


class ReplicaView(Schema):
    id: str
    revision: int
    address: str | None
    state: ReplicaStateName
    """The controller's view: the replica lifecycle."""
    health: UpstreamStateName | None
    """The data plane's view (``None`` once it left the pool)."""
    inflight: int
    since: float
    """When it entered its current state."""
    failure: str | None = None
    exit_code: int | None = None
    probe_failure: str | None = None
    """While it is not healthy: why its probes last failed (a status, a refused connection,
    a TLS certificate that failed verification)."""


class RevisionProgress(Schema):
    revision: int
    ready: int
    live: int
    """Requested, starting, ready or unhealthy."""
    desired: int
    """The desired count for the target revision, 0 for the others."""


class RolloutView(Schema):
    id: int
    kind: RolloutKindName
    status: RolloutStatusName
    from_revision: int | None
    to_revision: int
    started: float
    failures: int
    """Target-revision replicas that failed during this rollout."""
    retries: int
    """How many failures the rollout may take before it fails."""
    reason: str
    progress: list[RevisionProgress]
    strategy: Literal["rolling", "canary", "blue_green"] = "rolling"
    step: int | None = None
    """Canary and blue/green: the current step, from 1 (blue/green: 1 before the switch)."""
    steps: int | None = None
    weight: int | None = None
    """The target revision's share of the traffic now, percent."""
    weights: list[int] = []
    """Each step's weight."""
    promoted: bool = False
    analysis: str | None = None
    """The last analysis, with its figures."""
    verdict: Literal["pass", "fail", "wait"] | None = None


class Conditions(Schema):
    degraded: bool
    reason: str | None = None


class BackoffView(Schema):
    """Starts of the target revision failing in a row: placement is retried with backoff."""

    failures: int
    """Failures in a row (to place, start, or keep a replica of the target revision)."""
    reason: str | None = None
    """The last failure's reason."""
    last_failure_at: float
    """When the last one failed (Unix time)."""
    retry_at: float
    """When the next start may be tried (Unix time); past it, the retry is under way or due."""


class AutoscalingView(Schema):
    """An autoscaled service's range and its autoscaler's last change."""

    min: int
    max: int
    metric: ScalingMetric
    target: float
    held: int
    """Requests held now, waiting for a routable replica."""
    decision: str | None = None
    """The last change of the count and why."""
    decided_at: float | None = None
    """When (Unix time)."""
    holding: str | None = None
    """Why the autoscaler holds the count now, when it says (``metric: queue`` without
    fresh figures from every replica)."""


class AuthView(Schema):
    header: str
    pass_token: bool
    tokens: int
    """Tokens accepted now (the spec's file and variable, and the API's)."""
    ok: int
    """Requests so far with a token accepted, here and in the workers."""
    missing: int
    wrong: int


class RateLimitView(Schema):
    path_prefix: str
    key: str
    rps: float
    burst: int


class GuardsView(Schema):
    """What a service asks of its requests; a service with none has no ``guards``."""

    auth: AuthView | None
    rate_limits: list[RateLimitView]
    rate_limited: int
    """Requests refused with 429 so far."""
    affinity: str | None
    """``load_balancing: hash``: the key hashed."""
    max_in_flight_per_replica: int | None
    queued: int
    """Requests waiting for a slot now."""
    queue_rejected: int
    """Requests the slot queue answered 503 so far (full, or no slot in time)."""


class ServiceView(Schema):
    name: str
    status: ServiceStatus
    spec: SpecJson
    serving_revision: int | None
    target_revision: int
    desired: int
    """The desired replica count (of the target revision)."""
    ready: int
    """Replicas ready now, of any revision (per revision: ``rollout.progress``)."""
    replicas: list[ReplicaView]
    conditions: Conditions
    rollout: RolloutView | None
    """The active rollout, if any."""
    backoff: BackoffView | None = None
    """While starts of the target revision fail: how many, why, and when the next is tried."""
    autoscaling: AutoscalingView | None = None
    """With a replica range: the autoscaler's settings and last decision."""
    guards: GuardsView | None = None
    """With auth, rate limits, hash affinity or an in-flight cap: them and their counts."""
    warnings: list[str] = []
    """What the spec allows that weakens the service (``upstream_tls.verify: false``)."""


class ServiceList(Schema):
    services: list[ServiceView]


class ApplyResultBody(Schema):
    action: Literal["created", "unchanged", "updated", "scaled", "rollout"]
    service: str
    revision: int
    """The revision the service targets after the apply (on a dry run, the one it would)."""
    previous_revision: int | None
    rollout_id: int | None
    """The rollout started (``None`` on a dry run, or when no rollout was needed)."""
    changes: list[str]
    """Spec fields that differ from the current target's."""
    dry_run: bool = False


class DeleteResult(Schema):
    service: str
    status: Literal["deleting"]


class RevisionView(Schema):
    number: int
    template_key: str
    created_at: float
    spec: SpecJson
    serving: bool
    target: bool


class RevisionList(Schema):
    service: str
    revisions: list[RevisionView]


class RolloutRecord(Schema):
    id: int
    kind: RolloutKindName
    status: RolloutStatusName
    from_revision: int | None
    to_revision: int
    reason: str
    retries_used: int
    started_at: float
    finished_at: float | None
    trace_id: str
    """The trace of this rollout: its span, its steps' and its replicas', exported with the
    requests' spans when ``tracing.otlp_endpoint`` is set."""


class RolloutList(Schema):
    service: str
    rollouts: list[RolloutRecord]
    """Newest first."""


class LogsView(Schema):
    service: str
    replica: str
    lines: list[str]
    node: str | None = None
    """In a cluster, the node whose log the lines are: the one that runs or ran the replica
    (None: no live node holds a log of it; and on one gateway)."""


class UpstreamView(Schema):
    service: str
    id: str
    address: str
    revision: int
    state: UpstreamStateName
    health: Literal["unknown", "healthy", "unhealthy"]
    admin: Literal["active", "draining"]
    ejected: bool
    inflight: int


class EventView(Schema):
    """One journal entry: the ``data`` of a server-sent event (its ``event`` is ``kind``)."""

    id: int
    at: float
    service: str
    kind: str
    message: str
    revision: int | None
    replica: str | None


class Probe(Schema):
    status: Literal["ok", "ready", "starting"]


class HostView(Schema):
    """A place a backend runs replicas: the local machine, or one Docker Engine."""

    backend: str
    name: str
    engine: str
    """Where the backend reaches it (``local`` for the process backend)."""
    reachable: bool
    error: str
    """Why it is unreachable; empty while it answers."""
    replicas: int
    """Replicas it runs (or is starting) now."""
    capacity: int | None
    """The most it runs at once; null: no limit."""


class HostList(Schema):
    hosts: list[HostView]


# -- certificates obtained by ACME (views.certificates_operation) --------------------------


class CertificateView(Schema):
    """One host's certificate obtained by ACME."""

    name: str
    """The host (the certificate's directory under ``<state_dir>/acme/certificates``)."""
    services: list[str]
    """The services whose routes name it."""
    state: CertificateState
    names: list[str]
    issuer: str | None
    not_before: float | None
    not_after: float | None
    next_order: float | None
    """When the renewal, or the retry of a failed order, is due."""
    ordering: bool
    failures: int
    """Orders failed in a row (0 after a success)."""
    last_error: str | None


class CertificateList(Schema):
    enabled: bool
    """Whether ``tls.acme`` is configured."""
    directory: str | None
    certificates: list[CertificateView]


# -- HTTPS (admin/tls.py) ---------------------------------------------------------------------


class TlsCertificateView(Schema):
    name: str
    """Its first DNS name (what metrics call it)."""
    names: list[str]
    not_after: float
    """Expiry, seconds since the epoch."""
    cert_file: str
    key_file: str
    acme: bool
    """Obtained by ACME (under state_dir/acme), not configured."""


class TlsRefusalView(Schema):
    cert_file: str
    key_file: str
    file: str
    """The file that could not be used."""
    reason: str


class TlsView(Schema):
    enabled: bool
    certificates: list[TlsCertificateView]
    refused: list[TlsRefusalView]
    reload_failures: int
    """Pairs refused by a load or reload since start (the old certificate kept serving)."""
    handshakes: dict[str, dict[str, int]]
    """``ok`` and ``resumed`` by TLS version, ``failed`` by reason, since start."""


class TokenRequest(RequestBody):
    token: str | None = Field(default=None, pattern=TOKEN_PATTERN)
    """The token to accept (printable ASCII, 16 to 1024 characters); by default the gateway
    makes one (256 random bits) and answers it once."""
    label: str = Field(default="", max_length=200)
    """Who or what the token is for."""


class TokenView(Schema):
    id: str
    source: Literal["api", "file", "env"]
    """Added through the API, or from the spec's ``auth.tokens_file`` / ``tokens_env``."""
    label: str
    created_at: float | None
    """Wall-clock seconds; none for the spec's tokens."""


class TokenList(Schema):
    service: str
    tokens: list[TokenView]


class TokenAdded(Schema):
    service: str
    token: TokenView
    secret: str | None
    """The token the gateway made: shown this once, kept only as its digest. None when the
    caller gave it."""


class TokenRevoked(Schema):
    service: str
    id: str
    revoked: bool


class ClusterNodeView(Schema):
    name: str
    address: str
    """Where its admin API answers (and takes the requests other nodes forward)."""
    leader: bool
    started_at: float
    """Wall-clock seconds."""
    replicas: int | None = None
    """Replicas running on it (placed by the leader), when it reports them."""
    capacity: int | None = None


class ClusterView(Schema):
    store: Literal["sqlite", "etcd"]
    """``sqlite``: one node, no cluster (``node`` and ``leader`` are null)."""
    node: str | None
    """The node that answered."""
    leader: str | None
    """The node that leads, as this node last saw it (null: none now)."""
    store_reachable: bool = True
    store_reason: str = ""
    """Why etcd is unreachable, when it is."""
    nodes: list[ClusterNodeView]


class NodeLogsView(Schema):
    node: str
    """The node that answered: its own log of the replica, never another node's."""
    replica: str
    found: bool
    """Whether this node holds a log of the replica (it started or adopted it here)."""
    lines: list[str]


REQUEST_MODELS: tuple[type[BaseModel], ...] = (ScaleRequest, UndoRequest, TokenRequest)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    ErrorBody,
    ServiceView,
    ServiceList,
    ApplyResultBody,
    DeleteResult,
    RevisionList,
    RolloutList,
    RolloutView,
    LogsView,
    UpstreamView,
    EventView,
    Probe,
    HostList,
    TlsView,
    CertificateList,
    TokenList,
    TokenAdded,
    TokenRevoked,
    ClusterView,
    NodeLogsView,
)
