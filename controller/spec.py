"""ServiceSpec: what a user applies. The replica template, the rollout strategy, revisions.

A *revision* is identified by ``ServiceSpec.template_key()``: a digest of what a replica runs
(backend, command, env, working directory, port or addresses) and its probes. Two specs with
the same key are the same revision; a spec that differs only in ``replicas`` is a scale, and one
that differs only in route, balancing, timeouts, retries or limits is applied to the pool at
once without touching a replica.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, GetJsonSchemaHandler, field_validator, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from gateway import (
    HEADER_NAME,
    WHITE_SPACE,
    Address,
    AffinityKey,
    AuthRouting,
    Duration,
    HeaderName,
    InferenceBalancing,
    LimitsConfig,
    LoadBalancing,
    LoadFactor,
    LoadMetricsConfig,
    ModelConfig,
    OutlierConfig,
    PositiveDuration,
    PrefixChars,
    PreviewConfig,
    ProbeConfig,
    RateLimit,
    RetriesConfig,
    RouteConfig,
    ServiceRouting,
    StickyConfig,
    TimeoutsConfig,
    UpstreamProtocol,
    UpstreamTlsConfig,
    UpstreamTlsError,
    dump_settings,
    upstream_tls_context,
)

from .scaling import (
    COLD_START_QUEUE_TIMEOUT,
    GATEWAY_METRICS,
    MAX_REPLICAS,
    Autoscaling,
    ReplicaRange,
    ScalingConfig,
    replica_range,
)
from .schema import Model, on_branch

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""A service name: a DNS label. Checked with ``fullmatch`` (``$`` alone lets a newline by)."""
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
_DNS_LABEL = re.compile(NAME_PATTERN)
_ENV_NAME = re.compile(ENV_NAME_PATTERN)

MAX_COMMANDS = 32
MAX_COMMAND_LENGTH = 8192
NOT_BLANK = f"^[^\\u0000]*[^\\u0000{WHITE_SPACE}][^\\u0000]*$"
"""A command: something besides white space (``str.strip``'s), and no NUL."""
MAX_ENV = 256
MAX_ENV_VALUE = 32768
NO_NUL = "^[^\\u0000]*$"
MAX_PROBES = 8
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$"
"""An image reference as Docker writes it: ``name[:tag]`` or ``name@sha256:...``."""
MEMORY_PATTERN = r"^[1-9][0-9]{0,12}[kmg]?$"
"""Bytes, or a count of KiB (k), MiB (m) or GiB (g): ``512m``."""
USER_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})?$"
"""``user``, ``uid``, ``user:group`` or ``uid:gid``."""
MAX_GPUS = 64
GPU_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
"""A GPU as Docker's ``--gpus device=`` names it: an index (``0``) or a UUID (``GPU-3a2f...``)."""
MAX_VOLUMES = 32
VOLUME_PATTERN = (
    r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,254}|/[^:\x00]{0,4095}):/[^:\x00]{0,4095}(:(ro|rw))?$"
)
"""Docker's short syntax: ``NAME:/PATH`` (a named volume) or ``/HOST/PATH:/PATH``, then
``:ro`` or ``:rw`` (the default)."""
_VOLUME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")
DOCKER_FIELDS = ("image", "pull", "resources", "user", "gpus", "volumes")
"""Template fields only the docker backend reads."""
_MEMORY_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3}

DEFAULT_PROBE = ProbeConfig(type="tcp", interval=1.0, timeout=1.0, healthy_threshold=1)
"""A service with no probe gets this one on its port: never 'ready because it started'."""


class Resources(Model):
    """Limits of one container (docker backend)."""

    cpus: float | None = Field(default=None, gt=0, le=1024)
    """CPUs the container may use, e.g. 0.5."""
    memory: str | None = Field(default=None, pattern=MEMORY_PATTERN)
    """Most memory, ``512m`` or ``2g`` (bytes without a unit); beyond it the kernel kills."""

    @property
    def memory_bytes(self) -> int | None:
        if self.memory is None:
            return None
        unit = _MEMORY_UNITS.get(self.memory[-1], 1)
        return int(self.memory.rstrip("kmg")) * unit


Gpus = (
    Annotated[int, Field(ge=1, le=MAX_GPUS)]
    | Literal["all"]
    | Annotated[
        tuple[Annotated[str, Field(pattern=GPU_ID_PATTERN)], ...],
        Field(min_length=1, max_length=MAX_GPUS, json_schema_extra={"uniqueItems": True}),
    ]
)
"""A count of GPUs, ``all`` of the host's, or the ids of the devices."""


def gpu_count(gpus: Gpus | None, host_gpus: int) -> int:
    """How many of a host's GPUs a replica asking for ``gpus`` holds (``all``: every one)."""
    if gpus is None:
        return 0
    if gpus == "all":
        return host_gpus
    return gpus if isinstance(gpus, int) else len(gpus)


def _gpus(value: object) -> object:
    """One clear reason for a ``gpus`` that is none of its forms (rather than one per form)."""
    if value is None or value == "all":
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= MAX_GPUS:
            raise ValueError(f"a count from 1 to {MAX_GPUS}")
        return value
    if isinstance(value, (list, tuple)):
        if not 1 <= len(value) <= MAX_GPUS:
            raise ValueError(f"from 1 to {MAX_GPUS} device ids")
        for item in value:
            if not isinstance(item, str) or not re.fullmatch(GPU_ID_PATTERN, item):
                raise ValueError(f"not a device id: {item!r} (an index such as 0, or a UUID)")
        if len(set(value)) != len(value):
            raise ValueError("a device id is listed twice")
        return tuple(value)
    raise ValueError("a count, 'all', or a list of device ids")


def _volume(volume: str) -> str:
    parts = volume.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"{volume!r}: SOURCE:/PATH or SOURCE:/PATH:ro|rw")
    source, target = parts[0], parts[1]
    if len(parts) == 3 and parts[2] not in ("ro", "rw"):
        raise ValueError(f"{volume!r}: the mode is ro or rw, not {parts[2]!r}")
    if not target.startswith("/"):
        raise ValueError(f"{volume!r}: the container path must be absolute")
    if not source.startswith("/") and not _VOLUME_NAME.fullmatch(source):
        raise ValueError(
            f"{volume!r}: the source is a volume name (letters, digits, _ . -) "
            "or an absolute host path"
        )
    if not re.fullmatch(VOLUME_PATTERN, volume):
        raise ValueError(f"{volume!r}: a path too long or holding NUL")
    return volume


class ReplicaTemplate(Model):
    """What one replica runs. Part of the revision."""

    commands: Annotated[
        tuple[
            Annotated[
                str,
                Field(
                    min_length=1,
                    max_length=MAX_COMMAND_LENGTH,
                    json_schema_extra={"pattern": NOT_BLANK},  # _commands
                ),
            ],
            ...,
        ],
        Field(max_length=MAX_COMMANDS),
    ] = ()
    """Shell commands, run in order by ``sh -c`` (process backend); the last one serves."""
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables for the replica; PORT is the backend's to set.",
        json_schema_extra={  # _env
            "maxProperties": MAX_ENV,
            "propertyNames": {"pattern": ENV_NAME_PATTERN, "not": {"const": "PORT"}},
            "additionalProperties": {
                "type": "string",
                "maxLength": MAX_ENV_VALUE,
                "pattern": NO_NUL,
            },
        },
    )
    working_dir: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    """Process backend: a fixed port; by default the backend allocates one and passes it as
    ``$PORT``. Docker backend: the container's port (``$PORT`` inside; by default 8000),
    published at a host port the backend allocates."""
    addresses: tuple[Address, ...] = ()
    """Static backend: the addresses of replicas that another system runs."""
    image: str | None = Field(default=None, pattern=IMAGE_PATTERN)
    """Docker backend: the image each container runs (required there)."""
    pull: Literal["if_not_present", "always", "never"] | None = None
    """Docker backend: pull the image when it is missing (the default), always, or never."""
    resources: Resources | None = None
    """Docker backend: CPU and memory limits."""
    user: str | None = Field(default=None, pattern=USER_PATTERN)
    """Docker backend: the user the container runs as (by default the image's)."""
    gpus: Gpus | None = None
    """Docker backend: GPUs (NVIDIA driver): a count, ``all`` of the host's, or device ids.
    A replica is placed only on a host with that many GPUs free (``capacity.gpus``)."""
    volumes: (
        Annotated[
            tuple[Annotated[str, Field(json_schema_extra={"pattern": VOLUME_PATTERN})], ...],
            Field(max_length=MAX_VOLUMES),
        ]
        | None
    ) = None
    """Docker backend: ``NAME:/PATH`` (a named volume, made if missing) or
    ``/HOST/PATH:/PATH``, each optionally ``:ro`` (read only) or ``:rw``."""

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus_form(cls, value: object) -> object:
        return _gpus(value)

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, volumes: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if volumes is None else tuple(_volume(v) for v in volumes)

    @field_validator("commands")
    @classmethod
    def _commands(cls, commands: tuple[str, ...]) -> tuple[str, ...]:
        for command in commands:
            if not command.strip():
                raise ValueError("a command must not be empty")
            if "\x00" in command:
                raise ValueError("a command holds no NUL")
        return commands

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        if len(env) > MAX_ENV:
            raise ValueError(f"at most {MAX_ENV} variables")
        for name, value in env.items():
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"not a variable name: {name!r}")
            if name == "PORT":
                raise ValueError("PORT is set by the backend")
            if len(value) > MAX_ENV_VALUE or "\x00" in value:
                raise ValueError(f"value of {name} too long or holds NUL")
        return env


StrategyName = Literal["rolling", "canary", "blue_green"]
"""``rolling``: replicas replaced a few at a time, traffic by replica count; ``canary``: the
new revision takes a weight of the traffic step by step, judged by the analysis;
``blue_green``: the new revision in full beside the old, no traffic but preview traffic, then
all of it at once."""


def _fraction(value: object) -> object:
    """``0.01`` or ``"1%"``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return float(value.strip()[:-1]) / 100
        except ValueError:
            raise ValueError("a fraction (0.01) or a percentage ('1%')") from None
    return value


class CanaryStep(Model):
    """One step of a canary: the new revision's share of the traffic, and how long it holds
    it before the analysis is judged and the next step begins."""

    weight: int = Field(ge=1, le=100)
    """Percent of the requests sent to the new revision."""
    pause: Duration | None = None
    """How long the step lasts; none: until ``gateway rollout promote`` (the last step, at
    100, needs none)."""


DEFAULT_STEPS = (CanaryStep(weight=10, pause=60.0), CanaryStep(weight=50, pause=60.0))
"""A canary given no steps: 10 % then 50 %, a minute each, then all of it."""


class AnalysisConfig(Model):
    """How a canary (or a blue/green preview) is judged on the gateway's own counts of the
    new revision's requests over each step."""

    max_error_rate: float = Field(default=0.01, ge=0, le=1)
    """The largest share of 5xx answers (the revision's own and the gateway's errors)."""
    max_latency_ratio: float | None = Field(default=None, gt=0)
    """The largest p99 latency of the new revision over the stable one's in the same
    window; none: latency is not judged."""
    max_ttft_ratio: float | None = Field(default=None, gt=0)
    """The largest p99 time to first token of the new revision's streamed answers on model
    paths over the stable one's in the same window; none: not judged."""
    min_requests: int = Field(default=50, ge=1, le=10_000_000)
    """Fewer requests than this is not enough data: never a pass."""
    interval: PositiveDuration = 10.0
    """How often the analysis is judged while a step holds."""

    @field_validator("max_error_rate", mode="before")
    @classmethod
    def _rate(cls, value: object) -> object:
        return _fraction(value)


class RolloutStrategy(Model):
    """How a service moves from one revision to the next. Not part of the revision: a new
    strategy applies to the next rollout (and to the one in progress)."""

    strategy: StrategyName = "rolling"
    steps: tuple[CanaryStep, ...] = ()
    """Canary only: each step's weight (rising) and pause; a last step at 100 is implied."""
    analysis: AnalysisConfig | None = None
    """Canary and blue/green: judge the new revision on its requests; a failed check aborts
    the rollout. None: steps pass on their pause alone (blue/green waits for promote)."""
    keep_previous: Duration = 300.0
    """Blue/green: the previous revision is kept this long after the switch, so that
    ``rollout undo`` is instant."""

    max_surge: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    """Replicas of the target revision started beyond the desired count."""
    max_unavailable: int = Field(default=0, ge=0, le=MAX_REPLICAS)
    """Ready replicas the rollout may take away below the desired count."""
    min_ready: Duration = 0.0
    """Seconds a new replica must stay healthy before it counts as available."""
    start_timeout: Duration = 600.0
    """A new replica must become ready within this long."""
    progress_deadline: Duration = 1800.0
    """The whole rollout must complete within this long."""
    drain_timeout: Duration = 30.0
    stop_grace: Duration = 10.0
    """SIGTERM to SIGKILL."""
    retries: int = Field(default=2, ge=0, le=100)
    """Failed target-revision replicas replaced before the rollout fails."""
    on_failure: Literal["rollback", "pause"] = "rollback"
    retry_backoff: Duration = 1.0
    """Wait before the first replacement of a replica that failed; doubles per failure."""
    max_retry_backoff: Duration = 60.0
    """The cap of that doubling (crash-loop and no-capacity backoff)."""

    @model_validator(mode="after")
    def _progress(self) -> RolloutStrategy:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("max_surge and max_unavailable cannot both be 0: nothing could move")
        if self.steps and self.strategy != "canary":
            raise ValueError(f"steps: only for strategy canary, not {self.strategy}")
        if self.analysis is not None and self.strategy == "rolling":
            raise ValueError("analysis: only for strategy canary or blue_green")
        weights = [step.weight for step in self.steps]
        for before, after in itertools.pairwise(weights):
            if after <= before:
                raise ValueError(f"steps: weights must rise, {after} follows {before}")
        for i, step in enumerate(self.steps[:-1]):
            if step.weight == 100:
                raise ValueError(f"steps.{i}: weight 100 is the last step")
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """``_progress``'s rules that JSON Schema can state (not the order of the steps)."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        schema["allOf"] = [
            {  # max_surge defaults to 1, max_unavailable to 0
                "anyOf": [
                    {"not": {"required": ["max_surge"]}},
                    {"properties": {"max_surge": {"minimum": 1}}},
                    {
                        "required": ["max_unavailable"],
                        "properties": {"max_unavailable": {"minimum": 1}},
                    },
                ]
            },
            {
                "anyOf": [
                    {"not": {"required": ["steps"]}},
                    {"properties": {"steps": {"maxItems": 0}}},
                    {"required": ["strategy"], "properties": {"strategy": {"const": "canary"}}},
                ]
            },
            {
                "anyOf": [
                    {"not": {"required": ["analysis"]}},
                    {"properties": {"analysis": {"type": "null"}}},
                    {
                        "required": ["strategy"],
                        "properties": {
                            "strategy": {
                                "enum": [s for s in get_args(StrategyName) if s != "rolling"]
                            }
                        },
                    },
                ]
            },
        ]
        return schema

    @property
    def canary_steps(self) -> tuple[CanaryStep, ...]:
        """The canary's steps, ending at 100 (the default ones if none were given)."""
        steps = self.steps or DEFAULT_STEPS
        if steps[-1].weight < 100:
            steps = (*steps, CanaryStep(weight=100))
        return steps


MAX_RATE_LIMITS = 16


class AuthConfig(Model):
    """``auth``: requests need a bearer token, an API key (routing: not the revision).

    Tokens come from ``tokens_file`` (one a line; blank lines and ``#`` comments skipped),
    from ``tokens_env`` (the gateway's environment variable, tokens separated by commas or
    spaces) and from the admin API (``POST /api/services/{name}/tokens``, kept hashed in the
    store). Only their SHA-256 digests reach the data plane."""

    type: Literal["bearer"] = "bearer"
    tokens_file: str | None = Field(
        default=None,
        max_length=4096,
        json_schema_extra=on_branch("string", pattern="^/[^\\u0000]*$"),  # _absolute
    )
    """An absolute path, read when the spec is applied (and when tokens change)."""
    tokens_env: str | None = Field(default=None, pattern=ENV_NAME_PATTERN, max_length=256)
    header: HeaderName = "Authorization"
    """``Authorization`` carries ``Bearer <token>``; any other header the token alone."""
    pass_token: bool = False
    """Send the token's header upstream too (by default the gateway strips it)."""

    @field_validator("tokens_file")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        if path is not None and (not path.startswith("/") or "\x00" in path):
            raise ValueError(f"must be an absolute path, not {path!r}")
        return path


UNKEYED_POLICIES = [p for p in get_args(LoadBalancing) if p != "hash"]
"""The policies named alone (``hash`` needs a key: ``Balancing``)."""
_PLAIN_POLICIES = [p for p in UNKEYED_POLICIES if p != "inference"]
"""The policies that take no setting."""
_NO_INFERENCE = {"prefix_chars": {"type": "null"}, "max_load_factor": {"type": "null"}}


class Balancing(Model):
    """``load_balancing: {policy, ...}``: ``hash`` sends each key to one replica;
    ``inference`` picks by each replica's load and the prompt's prefix."""

    policy: LoadBalancing
    key: AffinityKey | None = None
    """``hash`` only: ``ip``, ``header:NAME`` or ``cookie:NAME``."""
    prefix_chars: PrefixChars | None = None
    """``inference`` only: characters of the prompt hashed in blocks for prefix affinity
    (0: none; by default 4096)."""
    max_load_factor: LoadFactor | None = None
    """``inference`` only: a prefix's replica is passed over while its load is above this
    many times the mean (by default 2)."""

    @model_validator(mode="after")
    def _key(self) -> Balancing:
        if self.policy == "hash" and self.key is None:
            raise ValueError("policy hash needs a key: ip, header:NAME or cookie:NAME")
        if self.policy != "hash" and self.key is not None:
            raise ValueError(f"a key is for policy hash, not {self.policy}")
        if self.policy != "inference":
            for name in ("prefix_chars", "max_load_factor"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for policy inference, not {self.policy}")
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """``_key``: a key with hash, and only with hash; the prefix settings with
        inference only."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        schema["anyOf"] = [
            {
                "required": ["policy", "key"],
                "properties": {
                    "policy": {"const": "hash"},
                    "key": {"type": "string"},
                    **_NO_INFERENCE,
                },
            },
            {"properties": {"policy": {"const": "inference"}, "key": {"type": "null"}}},
            {
                "properties": {
                    "policy": {"enum": _PLAIN_POLICIES},
                    "key": {"type": "null"},
                    **_NO_INFERENCE,
                }
            },
        ]
        return schema

    def inference(self) -> InferenceBalancing:
        """The settings of policy ``inference`` (the defaults where not given)."""
        given = {
            name: getattr(self, name)
            for name in ("prefix_chars", "max_load_factor")
            if getattr(self, name) is not None
        }
        return InferenceBalancing(**given)


_NO_DOCKER_FIELDS = {name: {"type": "null"} for name in DOCKER_FIELDS}
_BACKEND_RULES: list[dict[str, Any]] = [
    {  # a command, no addresses, and a fixed port only for one replica
        "properties": {
            "backend": {"const": "process"},
            "replica": {
                "required": ["commands"],
                "properties": {
                    "commands": {"minItems": 1},
                    "addresses": {"maxItems": 0},
                    **_NO_DOCKER_FIELDS,
                },
            },
        },
        "anyOf": [
            {"properties": {"replica": {"properties": {"port": {"type": "null"}}}}},
            {
                "properties": {
                    "replicas": {
                        "anyOf": [
                            {"type": "null"},
                            {"type": "integer", "maximum": 1},
                            {"type": "object", "properties": {"max": {"maximum": 1}}},
                        ]
                    }
                }
            },
        ],
    },
    {  # addresses, no command, and no more replicas (a count, not a range) than addresses
        "required": ["backend"],
        "properties": {
            "backend": {"const": "static"},
            "replica": {
                "required": ["addresses"],
                "properties": {
                    "addresses": {"minItems": 1},
                    "commands": {"maxItems": 0},
                    **_NO_DOCKER_FIELDS,
                },
            },
        },
        "anyOf": [
            {"properties": {"replicas": {"type": "null"}}},
            *(
                {
                    "properties": {
                        "replicas": {"type": "integer", "maximum": n},
                        "replica": {"properties": {"addresses": {"minItems": n}}},
                    }
                }
                for n in range(1, MAX_REPLICAS + 1)
            ),
        ],
    },
    {  # an image; no addresses and no working directory
        "required": ["backend"],
        "properties": {
            "backend": {"const": "docker"},
            "replica": {
                "required": ["image"],
                "properties": {
                    "image": {"type": "string"},
                    "addresses": {"maxItems": 0},
                    "working_dir": {"type": "null"},
                },
            },
        },
    },
]
"""``ServiceSpec._backend`` in JSON Schema: one branch per backend (the admin API's document
keeps those of the backends its gateway has)."""


def model_clash(spec: ServiceSpec, others: Iterable[ServiceSpec]) -> str | None:
    """Why ``spec`` cannot serve its model beside ``others`` (another service declares one of
    its names or aliases), or None."""
    if spec.model is None:
        return None
    names = set(spec.model.names)
    for other in others:
        if other.name == spec.name or other.model is None:
            continue
        shared = sorted(names.intersection(other.model.names))
        if shared:
            return (
                f"model: {shared[0]!r} is declared by both service {other.name!r} and "
                f"service {spec.name!r}; a model name or alias belongs to one service"
            )
    return None


def upstream_tls_problem(spec: ServiceSpec) -> tuple[str, str] | None:
    """Why ``spec``'s ``upstream_tls`` files cannot make a context now (its field path and
    the reason: a file missing, unreadable, not PEM, a key that is not the certificate's),
    or None. Read when a spec is applied; a spec already applied is never refused for it."""
    if spec.upstream_tls is None:
        return None
    try:
        upstream_tls_context(spec.upstream_tls)
    except UpstreamTlsError as exc:
        return f"upstream_tls.{exc.field}", str(exc)
    return None


def _probe_key(probe: ProbeConfig) -> dict[str, Any]:
    """A probe as its revision's identity holds it: ``service`` unset (as before gRPC
    probes) leaves the revisions made before it alone."""
    data = dump_settings(probe)
    if not data["service"]:
        del data["service"]
    return data


class ServiceSpec(Model):
    """A named, routed set of replicas."""

    name: str = Field(json_schema_extra={"pattern": NAME_PATTERN, "maxLength": 63})  # _name
    route: RouteConfig
    backend: Literal["process", "static", "docker"] = "process"
    replicas: int | ReplicaRange | None = Field(
        default=None,
        json_schema_extra=on_branch("integer", minimum=0, maximum=MAX_REPLICAS),  # _replicas_count
    )
    """A fixed count (by default 1, or the number of static addresses), or a range
    (``{min, max}`` or ``"min..max"``) the autoscaler keeps the count within."""
    scaling: ScalingConfig | None = None
    """How to autoscale (with a range only; a range without it takes the defaults)."""
    replica: ReplicaTemplate
    probes: tuple[ProbeConfig, ...] = Field(default=(), max_length=MAX_PROBES)
    load_balancing: LoadBalancing | Balancing = Field(
        default="least_outstanding",
        description=(
            "A policy's name, or {policy: hash, key} for affinity, or {policy: inference, "
            "prefix_chars, max_load_factor}."
        ),
        json_schema_extra=on_branch("string", enum=UNKEYED_POLICIES),  # _guards
    )
    """A policy's name, or ``{policy: hash, key: ...}`` for affinity."""
    upstream_protocol: UpstreamProtocol = Field(
        default="http1",
        description=(
            "http1, or http2: h2c by prior knowledge to the replicas (gRPC), or h2 agreed by "
            "ALPN with upstream_tls."
        ),
    )
    upstream_tls: UpstreamTlsConfig | None = None
    """TLS to the replicas: ``{ca, server_name, verify, cert, key}`` (none: plain TCP). Its
    files are read when the spec is applied (``upstream_tls_problem``) and by each process
    that connects."""
    timeouts: TimeoutsConfig = TimeoutsConfig()
    retries: RetriesConfig = RetriesConfig()
    outlier: OutlierConfig = OutlierConfig()
    limits: LimitsConfig = LimitsConfig()
    queue_timeout: Duration = 0.0
    rollout: RolloutStrategy = RolloutStrategy()
    preview: PreviewConfig = PreviewConfig()
    """Who may ask for one revision by header or host label (routing: not the revision)."""
    sticky: StickyConfig | None = None
    """Keep a client on its revision while a canary splits the traffic."""
    auth: AuthConfig | None = None
    """Requests need a bearer token (none: open)."""
    rate_limits: tuple[RateLimit, ...] = Field(default=(), max_length=MAX_RATE_LIMITS)
    """Token buckets per key (``ip``, ``header:NAME`` or ``token``) for path prefixes."""
    model: ModelConfig | None = None
    """The model it serves over an OpenAI-compatible API, by name and aliases: with
    ``models`` in the gateway config, requests that name it in their body come here. One
    service per name (``model_clash``)."""
    load_metrics: LoadMetricsConfig | None = None
    """Scrape each replica's requests waiting and running and its KV-cache use from its
    Prometheus endpoint (vLLM's or SGLang's names), for ``load_balancing: inference``."""

    @model_validator(mode="after")
    def _guards(self) -> ServiceSpec:
        if self.load_balancing == "hash":
            raise ValueError(
                "load_balancing: hash needs a key: {policy: hash, key: ip | header:NAME | "
                "cookie:NAME}"
            )
        for i, limit in enumerate(self.rate_limits):
            if limit.key == "token" and self.auth is None:
                raise ValueError(f"rate_limits.{i}.key: token needs auth on the service")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _DNS_LABEL.fullmatch(name):
            raise ValueError("must be a DNS label: a-z, 0-9 and '-', 1 to 63 characters")
        return name

    @field_validator("replicas", mode="before")
    @classmethod
    def _replicas_form(cls, value: object) -> object:
        return replica_range(value)

    @field_validator("replicas")
    @classmethod
    def _replicas_count(cls, value: int | ReplicaRange | None) -> int | ReplicaRange | None:
        if isinstance(value, int) and not 0 <= value <= MAX_REPLICAS:
            raise ValueError(f"a count from 0 to {MAX_REPLICAS}")
        return value

    @model_validator(mode="after")
    def _scaling(self) -> ServiceSpec:
        if self.scaling is not None and not isinstance(self.replicas, ReplicaRange):
            raise ValueError(
                "scaling: the replica count is fixed; give replicas a range "
                "({min, max} or 'min..max') to autoscale"
            )
        if isinstance(self.replicas, ReplicaRange) and self.backend == "static":
            raise ValueError("replicas: a static service's addresses are not autoscaled")
        metric = self.scaling.metric if self.scaling is not None else None
        if metric is not None and metric not in GATEWAY_METRICS and self.load_metrics is None:
            raise ValueError(
                f"scaling.metric: {metric} reads the replicas' own figures: the service "
                "needs load_metrics ({format: vllm | sglang, path: /metrics})"
            )
        return self

    @model_validator(mode="after")
    def _backend(self) -> ServiceSpec:
        if self.backend != "docker":
            for name in DOCKER_FIELDS:
                if getattr(self.replica, name) is not None:
                    raise ValueError(f"replica.{name}: only for the docker backend")
        if self.backend == "docker":
            if self.replica.image is None:
                raise ValueError("replica.image: the docker backend needs an image")
            if self.replica.addresses:
                raise ValueError("replica.addresses: only for the static backend")
            if self.replica.working_dir is not None:
                raise ValueError("replica.working_dir: not for the docker backend (the image's)")
        elif self.backend == "process":
            if not self.replica.commands:
                raise ValueError("replica.commands: the process backend needs a command")
            if self.replica.addresses:
                raise ValueError("replica.addresses: only for the static backend")
            if self.replica.port is not None and self.most_replicas > 1:
                raise ValueError(
                    "replica.port: a fixed port allows one replica; leave it out to get $PORT"
                )
        else:
            if not self.replica.addresses:
                raise ValueError("replica.addresses: the static backend needs addresses")
            if self.replica.commands:
                raise ValueError("replica.commands: the static backend runs nothing")
            if self.desired_replicas > len(self.replica.addresses):
                raise ValueError("replicas: more than the static addresses given")
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The rules of ``_backend``, ``_guards`` and ``_scaling`` (``queue`` with
        ``load_metrics``), in JSON Schema. That a range's min is at most its max is the one
        rule it cannot state (it compares no two fields' values): the API refuses such a range
        with 422."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        metrics = list(GATEWAY_METRICS)
        schema["allOf"] = [
            {"anyOf": _BACKEND_RULES},
            {  # a rate limit keyed by token needs auth (a pattern: the fuzz draws from no "not")
                "anyOf": [
                    {
                        "properties": {
                            "rate_limits": {
                                "items": {
                                    "properties": {
                                        "key": {"pattern": f"^(ip|header:{HEADER_NAME})$"}
                                    }
                                }
                            }
                        }
                    },
                    {"required": ["auth"], "properties": {"auth": {"type": "object"}}},
                ]
            },
            {  # scaling only with a range of replicas
                "anyOf": [
                    {"not": {"required": ["scaling"]}},
                    {"properties": {"scaling": {"type": "null"}}},
                    {"required": ["replicas"], "properties": {"replicas": {"type": "object"}}},
                ]
            },
            {  # a metric of the replicas' own figures needs load_metrics
                "anyOf": [
                    {"properties": {"scaling": {"properties": {"metric": {"enum": metrics}}}}},
                    {
                        "required": ["load_metrics"],
                        "properties": {"load_metrics": {"type": "object"}},
                    },
                ]
            },
        ]
        return schema

    @property
    def desired_replicas(self) -> int:
        """The fixed count, or where an autoscaled service begins: its ``min``, but at least
        one replica (so a new revision is proven to start before it scales to zero)."""
        if isinstance(self.replicas, ReplicaRange):
            return max(self.replicas.min, 1)
        if self.replicas is not None:
            return self.replicas
        return len(self.replica.addresses) if self.backend == "static" else 1

    @property
    def most_replicas(self) -> int:
        if isinstance(self.replicas, ReplicaRange):
            return self.replicas.max
        return self.desired_replicas

    @property
    def autoscaling(self) -> Autoscaling | None:
        """The autoscaler's settings, or None for a fixed count."""
        if not isinstance(self.replicas, ReplicaRange):
            return None
        scaling = self.scaling or ScalingConfig()
        return Autoscaling(min=self.replicas.min, max=self.replicas.max, **scaling.model_dump())

    @property
    def effective_queue_timeout(self) -> float:
        """``queue_timeout``, or for a ``min: 0`` service that leaves it unset, long enough to
        hold a request through a cold start."""
        if (
            "queue_timeout" not in self.model_fields_set
            and isinstance(self.replicas, ReplicaRange)
            and self.replicas.min == 0
        ):
            return COLD_START_QUEUE_TIMEOUT
        return self.queue_timeout

    @property
    def effective_probes(self) -> tuple[ProbeConfig, ...]:
        return self.probes or (DEFAULT_PROBE,)

    def template_key(self) -> str:
        """The identity of this spec's revision."""
        replica = self.replica.model_dump(mode="json")
        for name in DOCKER_FIELDS:  # unset, they leave the revisions made before them alone
            if replica[name] is None:
                del replica[name]
        doc = {
            "backend": self.backend,
            "replica": replica,
            "probes": [_probe_key(p) for p in self.effective_probes],
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]

    def routing(self, tokens: Mapping[str, str] | None = None) -> ServiceRouting:
        """What the data plane needs of this service; ``tokens``: the digests of its bearer
        tokens (SHA-256 hex -> id), from wherever they are kept (``controller.tokens``)."""
        balancing = self.load_balancing
        policy, affinity, inference = (
            (balancing.policy, balancing.key, balancing.inference())
            if isinstance(balancing, Balancing)
            else (balancing, None, InferenceBalancing())
        )
        auth = self.auth
        return ServiceRouting(
            name=self.name,
            route=self.route,
            load_balancing=policy,
            upstream_protocol=self.upstream_protocol,
            upstream_tls=self.upstream_tls,
            affinity=affinity,
            auth=None
            if auth is None
            else AuthRouting(
                header=auth.header.lower(), pass_token=auth.pass_token, tokens=dict(tokens or {})
            ),
            rate_limits=self.rate_limits,
            probes=self.effective_probes,
            timeouts=self.timeouts,
            retries=self.retries,
            outlier=self.outlier,
            limits=self.limits,
            queue_timeout=self.effective_queue_timeout,
            preview=self.preview,
            sticky=self.sticky,
            model=self.model,
            inference=inference,
            load_metrics=self.load_metrics,
        )

    def to_json(self) -> str:
        return self.model_dump_json(exclude_unset=True)
