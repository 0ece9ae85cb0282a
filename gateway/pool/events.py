"""Events the data plane publishes, and the protocols of those who listen.

The controller, the prober and the metrics follow the pool through ``PoolSubscriber``; this
module is why the dependency runs one way: the data plane defines the protocol, the control
plane implements it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, Protocol

from .upstream import Upstream

EventKind = Literal["added", "changed", "removed", "drained", "service_set", "service_removed"]


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """Something changed in a service's pool.

    ``added``/``changed``/``removed``: an upstream (``upstream`` is its new state,
    ``previous`` its old one). ``drained``: a drain finished (``clean`` is False when the drain
    timeout cut requests off). ``service_set``/``service_removed``: a service's routing
    config was set or the service was removed (``upstream`` is None).
    """

    kind: EventKind
    service: str
    at: float
    upstream: Upstream | None = None
    previous: Upstream | None = None
    reason: str = ""
    clean: bool = True


class PoolSubscriber(Protocol):
    def on_pool_event(self, event: PoolEvent) -> None:
        """Called synchronously on the event loop; must not block or raise."""


ProbeOutcome = Literal["success", "failure", "timeout"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    service: str
    upstream_id: str
    outcome: ProbeOutcome
    duration: float
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "success"


class ProbeObserver(Protocol):
    def on_probe(self, result: ProbeResult) -> None:
        """Called for every probe result (metrics)."""


_RECORD_FIELDS: Final[tuple[str, ...]] = (
    "request_id",
    "service",
    "revision",
    "upstream_id",
    "method",
    "path",
    "status",
    "duration",
    "ttfb",
    "bytes_in",
    "bytes_out",
    "retries",
    "retry_reasons",
    "error",
    "http_version",
    "grpc_status",
)
"""``RequestRecord``'s fields in the order ``__init__`` takes them."""


class RequestRecord:
    """What one proxied request did, for metrics and the access log.

    A plain class, one made per request: compiled with mypyc (``native.py``) it is a C
    struct made in one call, where a named tuple's ``__new__`` is interpreted Python.
    """

    __slots__ = _RECORD_FIELDS

    def __init__(
        self,
        request_id: str,
        service: str,
        revision: int | None,
        upstream_id: str | None,
        method: str,
        path: str,
        status: int,
        duration: float,
        ttfb: float | None,
        bytes_in: int,
        bytes_out: int,
        retries: int,
        retry_reasons: tuple[str, ...] = (),
        error: str | None = None,
        http_version: str = "1.1",
        grpc_status: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.service = service
        self.revision = revision
        self.upstream_id = upstream_id
        self.method = method
        self.path = path
        self.status = status
        self.duration = duration
        self.ttfb = ttfb
        self.bytes_in = bytes_in
        self.bytes_out = bytes_out
        self.retries = retries
        self.retry_reasons = retry_reasons
        self.error = error
        self.http_version = http_version
        """The client's HTTP version: ``1.1``, ``1.0``, or ``2`` (HTTP/2, h2 or h2c)."""
        self.grpc_status = grpc_status
        """The gRPC status a gRPC request's answer carried to the client, its code as text
        (``wire.grpc.status``); None for any other request, or an answer cut off without
        one."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _RECORD_FIELDS)
        return f"RequestRecord({fields})"


class Tokens:
    """What the answer to a request on a model path carried (``proxy.tokens``)."""

    __slots__ = ("gaps", "output", "ttft")

    def __init__(
        self,
        ttft: float | None = None,
        output: int | None = None,
        gaps: tuple[tuple[int, ...], float] | None = None,
    ) -> None:
        self.ttft = ttft
        """Seconds from the request's arrival to the first content chunk of an event
        stream; None: not streamed, or no content came."""
        self.output = output
        """Output tokens (``usage.completion_tokens``, else content chunks); None: unknown."""
        self.gaps = gaps
        """The inter-token latencies per latency bucket and their sum (``Buckets.counted``);
        None: fewer than two content chunks."""

    def __repr__(self) -> str:
        return f"Tokens(ttft={self.ttft!r}, output={self.output!r}, gaps={self.gaps!r})"


NO_TOKENS: Final = Tokens()
"""A request on a model path whose answer was not scanned (an error, not JSON nor SSE)."""


ClientTimeout = Literal["header", "body", "send"]
"""A client the gateway gave up on for slowness (``limits``): ``header`` (no request head
within ``header_timeout`` of the connection, or of the head's first bytes: over HTTP/2, a
header block left open), ``body`` (a request body past ``body_timeout`` or under
``body_min_rate``), ``send`` (an answer left unread for ``send_timeout``)."""

CLIENT_TIMEOUTS: Final[tuple[ClientTimeout, ...]] = ("header", "body", "send")


class RequestObserver(Protocol):
    def on_request(self, record: RequestRecord) -> None:
        """Called once per finished request; must be cheap (hot path)."""

    def on_model_request(self, record: RequestRecord, tokens: Tokens) -> None:
        """Called instead of ``on_request`` for a request on a model path (``models``):
        counted as ``on_request`` counts, and its tokens."""

    def on_client_timeout(self, protocol: str, timeout: ClientTimeout) -> None:
        """A client connection (``protocol``: ``http/1.1`` or ``h2``) was given up on for
        slowness: its connection closed, or its request or stream cut off."""
