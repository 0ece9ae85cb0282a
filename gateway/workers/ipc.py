"""The channel between the controller's process and its workers: messages and their framing.

One Unix stream socketpair per worker, made by the supervisor and inherited by the worker
(no other process holds either end, so either side's exit is the other's end of file). A
message is a frozen record, written by ``marshal`` after its length as 4 bytes big-endian:
``flatten`` makes it plain values (each record, enum, tuple or dict a tuple tagged with what
it was, a record or enum by its class's name) and ``restore`` makes it back, each record
through its class's ``__init__`` and only of a class of this package. ``marshal``, not
``pickle``: the interpreter has it loaded already, so a worker loads no ``pickle``. Both ends
run the same code from the same checkout and nothing else can write to the pair. Nothing on
the request path sends a message: snapshots go out when the pool changes, reports come back
every ``Setup.report_interval`` and when a draining upstream goes idle, finished spans with
them or when a batch is full (in the next loop turn).

controller's process -> worker: ``Setup`` (once, first), ``Install``, ``Forget``, ``Abort``,
``ReloadTls``, ``Loads`` (after each load scrape of a service), ``Stop``. worker ->
controller's process: ``Ready`` (once, listening), ``Idle``, ``Eject``, ``Report``, ``Spans``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import marshal
import struct
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..config import ProxyConfig, ServiceRouting
from ..observability.spans import Span
from ..observability.tally import Tally
from ..pool.inference import ReplicaLoad
from ..pool.snapshot import PoolSnapshot

_LENGTH = struct.Struct("!I")
MAX_MESSAGE = 64 * 1024 * 1024
"""A bound on one message, so a corrupt length cannot make a reader allocate without end."""


# -- to a worker ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """What a worker serves with: the proxy settings, its listener, its logs."""

    worker: int
    proxy: ProxyConfig
    host: str
    port: int
    """The port the supervisor reserved; each worker binds it with SO_REUSEPORT."""
    access_log: tuple[str, str | None] | None
    """(format, path) of the access log, or None when it is off."""
    log_level: str
    report_interval: float
    services: tuple[Install, ...]
    """Every service as it is now: installed before the worker starts listening."""
    tls_addresses: tuple[tuple[str, int], ...] = ()
    """The HTTPS listeners' (host, port), ports reserved like ``port``."""
    workers: int = 1
    """How many workers serve: each enforces its share of rate limits and in-flight caps."""


@dataclass(frozen=True, slots=True)
class Install:
    """A service's routing and its pool snapshot, to serve from as they are."""

    routing: ServiceRouting
    snapshot: PoolSnapshot


@dataclass(frozen=True, slots=True)
class Forget:
    """A service was removed."""

    service: str


@dataclass(frozen=True, slots=True)
class Abort:
    """A drain timed out: cut off what is still in flight on the upstream."""

    service: str
    upstream_id: str


@dataclass(frozen=True, slots=True)
class ReloadTls:
    """Load the TLS certificates that changed on disk (SIGHUP, the admin API, ACME)."""


@dataclass(frozen=True, slots=True)
class Loads:
    """A service's replicas' own load figures, as last scraped (``health.load_scraper``)."""

    service: str
    reports: dict[str, ReplicaLoad]


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop accepting, finish what is in flight (up to the shutdown timeout), report, exit."""


# -- from a worker ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker listens and serves."""

    worker: int
    pid: int


@dataclass(frozen=True, slots=True)
class Idle:
    """The worker holds no lease of a draining upstream, as of its snapshot ``version``."""

    service: str
    upstream_id: str
    version: int


@dataclass(frozen=True, slots=True)
class Eject:
    """The worker's passive detection proposes an ejection."""

    service: str
    upstream_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Report:
    """In-flight counts now, and the request counts since the previous report; per service,
    the requests held now and (completed, waited) since the previous report (the
    autoscaler's samples)."""

    inflight: dict[tuple[str, str], int]
    tally: Tally
    connections: int
    held: dict[str, int] = field(default_factory=dict)
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    handshakes: tuple[dict[str, int], dict[str, int], dict[str, int]] | None = None
    """TLS handshakes since the previous report (``tls.HandshakeCounts``); None without TLS."""
    guards: dict[str, tuple[dict[str, float], int]] = field(default_factory=dict)
    """Per service, ``ServicePool.counters`` since the previous report and the requests
    waiting for a slot now."""
    parked: int = 0
    """Of ``connections``, those parked (``proxy.parking``)."""
    http2: int = 0
    """Of ``connections``, those that speak HTTP/2."""


@dataclass(frozen=True, slots=True)
class Spans:
    """Spans the worker finished (plain tuples: the main process encodes and exports them),
    and how many it dropped since the previous message (its buffer was full)."""

    spans: list[Span]
    dropped: int


ToWorker = Setup | Install | Forget | Abort | ReloadTls | Loads | Stop
FromWorker = Ready | Idle | Eject | Report | Spans
_MESSAGES = (
    Setup, Install, Forget, Abort, ReloadTls, Loads, Stop, Ready, Idle, Eject, Report, Spans,
)  # fmt: skip


_PLAIN = frozenset({type(None), bool, int, float, str, bytes})
"""What ``marshal`` writes as it is (exact types: an enum of ``str`` is not a ``str`` here)."""
_TUPLE, _DICT, _LIST, _RECORD, _ENUM = range(5)
_PACKAGE = __name__.split(".", 1)[0] + "."
_shapes: dict[type, tuple[str, tuple[str, ...]]] = {}
"""Per record or enum class, made at its first message: its name in a message (one string, so
``marshal`` writes it once a message), and its fields that ``__init__`` takes."""
_classes: dict[str, tuple[type, tuple[str, ...]]] = {}
"""Per name in a message, made at its first message: the class, and its fields."""


def flatten(value: object) -> Any:
    """``value`` as plain values ``marshal`` writes: ``restore`` makes it back."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if isinstance(value, tuple) and kind is tuple:
        return (_TUPLE, *[flatten(v) for v in value])
    if isinstance(value, dict) and kind is dict:
        return (_DICT, *[(flatten(k), flatten(v)) for k, v in value.items()])
    if isinstance(value, list) and kind is list:
        return (_LIST, *[flatten(v) for v in value])
    if isinstance(value, Enum):
        return (_ENUM, _shape(kind)[0], value.value)
    if dataclasses.is_dataclass(value):
        name, fields = _shape(kind)
        return (_RECORD, name, *[flatten(getattr(value, f)) for f in fields])
    raise TypeError(f"an ipc message holds a {kind.__name__}")


def restore(value: object) -> object:
    """The value ``flatten`` was given."""
    if not isinstance(value, tuple):
        return value
    kind, *rest = value
    if kind == _TUPLE:
        return tuple([restore(v) for v in rest])
    if kind == _DICT:
        return {restore(k): restore(v) for k, v in rest}
    if kind == _LIST:
        return [restore(v) for v in rest]
    cls, fields = _class(rest[0])
    if kind == _ENUM and issubclass(cls, Enum):
        return cls(rest[1])
    if kind == _RECORD and not issubclass(cls, Enum):
        return cls(**{f: restore(v) for f, v in zip(fields, rest[1:], strict=True)})
    raise TypeError(f"not an ipc value: {value!r}")


def _shape(cls: type) -> tuple[str, tuple[str, ...]]:
    shape = _shapes.get(cls)
    if shape is None:
        name = sys.intern(f"{cls.__module__}:{cls.__qualname__}")
        enum = issubclass(cls, Enum)
        fields = () if enum else tuple(f.name for f in dataclasses.fields(cls) if f.init)
        shape = _shapes[cls] = (name, fields)
    return shape


def _class(name: object) -> tuple[type, tuple[str, ...]]:
    """The class ``_shape`` named, and its fields: a record or enum class of this package,
    imported already (each end imports every module its messages hold)."""
    found = _classes.get(str(name))
    if found is None:
        module, _, qualname = str(name).partition(":")
        cls: object = sys.modules.get(module) if module.startswith(_PACKAGE) else None
        for part in qualname.split("."):
            cls = getattr(cls, part, None)
        if not isinstance(cls, type) or not (
            issubclass(cls, Enum) or dataclasses.is_dataclass(cls)
        ):
            raise TypeError(f"not an ipc class: {name}")
        found = _classes[str(name)] = (cls, _shape(cls)[1])
    return found


def encode(message: ToWorker | FromWorker) -> bytes:
    data = marshal.dumps(flatten(message))
    return _LENGTH.pack(len(data)) + data


async def receive(reader: asyncio.StreamReader) -> ToWorker | FromWorker | None:
    """The next message, or None when the other side is gone (end of stream, or a write to
    it found the pair broken)."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(head)
        if length > MAX_MESSAGE:
            raise ValueError(f"ipc message of {length} bytes exceeds {MAX_MESSAGE}")
        data = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    message = restore(marshal.loads(data))
    if not isinstance(message, _MESSAGES):
        raise TypeError(f"not an ipc message: {type(message).__name__}")
    return message
