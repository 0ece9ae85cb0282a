"""Settings of the data plane: listeners, routes, probes, balancing, timeouts, retries, drain.

Every class is a frozen dataclass that forbids unknown fields, so a typo in a config file is
an error that names the field instead of a setting silently ignored. Durations accept
``"250ms"``, ``"5s"``, ``"2m"``, ``"1h"`` or plain seconds.

pydantic validates them (``parse_settings``, or as fields of the controller's models) in the
controller's process only: constraints and checks are ``Annotated`` metadata, cross-field rules
``__post_init__``, and nothing here imports pydantic at module level, so a worker process, which
receives them over its channel, never loads it. Built directly, a dataclass takes its values as
given (only ``__post_init__`` runs): build it from typed values, or with ``parse_settings``.

Each check states what it takes in JSON Schema too (a ``Check``'s ``json_schema``; a
cross-field rule's, in ``json_schema_extra`` beside its ``__post_init__``), so the schema
pydantic makes of a class (the admin API's document) takes what validation takes. Patterns
there are ECMA-262's: ``$`` is the end of the string, where the checks use ``fullmatch``.

Nothing here reads a file or the environment: the one loader is in ``controller.config``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal, TypeVar

from .checks import Check, Ge, Gt, Le, Pattern

T = TypeVar("T")


_FORBID = {"extra": "forbid"}
"""pydantic's config of each dataclass (read from ``__pydantic_config__``): unknown fields
are errors."""


_ADAPTERS: dict[type, Any] = {}
"""pydantic's ``TypeAdapter`` of each class, made on first use."""


def _adapter(cls: type) -> Any:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        from pydantic import TypeAdapter

        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


def parse_settings(cls: type[T], data: object) -> T:
    """``data`` (a dict, as read from a document) validated into ``cls``; raises pydantic's
    ``ValidationError`` (a ``ValueError``)."""
    result: T = _adapter(cls).validate_python(data)
    return result


def dump_settings(obj: object) -> dict[str, Any]:
    """One of these dataclasses as JSON-ready data (what pydantic's ``model_dump(mode="json")``
    gave)."""
    result: dict[str, Any] = _adapter(type(obj)).dump_python(obj, mode="json")
    return result


WHITE_SPACE = (
    "\\u0009-\\u000d\\u001c-\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029"
    "\\u202f\\u205f\\u3000"
)
"""What ``str.isspace`` (so ``str.strip``) takes for white space, as the body of a regex class
(ECMA-262's ``\\s`` is another set)."""
_ASCII_SPACE = r"[\t\n\v\f\r ]*"
"""``\\s*`` as ``re.ASCII`` reads it."""
_DURATION_TEXT = rf"{_ASCII_SPACE}([0-9]+(?:\.[0-9]+)?){_ASCII_SPACE}(ms|s|m|h)?{_ASCII_SPACE}"
"""A duration written as text, matched whole, in ASCII (no Arabic-Indic digit, no Unicode
space): its number, then its unit."""
_POSITIVE_DURATION_TEXT = (
    rf"{_ASCII_SPACE}([0-9]*[1-9][0-9]*(?:\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)"
    rf"{_ASCII_SPACE}(ms|s|m|h)?{_ASCII_SPACE}"
)
"""``_DURATION_TEXT`` whose number is not 0."""
_DURATION = re.compile(_DURATION_TEXT)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> object:
    """``"250ms"`` -> 0.25; numbers pass through; anything else is left for pydantic to refuse."""
    if isinstance(value, bool):  # YAML's "yes" is not one second
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, str):
        match = _DURATION.fullmatch(value)
        if not match:
            raise ValueError(f"not a duration: {value!r} (use e.g. '250ms', '5s', '2m' or seconds)")
        return float(match.group(1)) * _UNITS[match.group(2)]
    return value


def _duration_schema(number: dict[str, Any]) -> dict[str, Any]:
    """A duration in JSON Schema: its number, with its bound, or its text (not 0 where the
    bound excludes it)."""
    text = _POSITIVE_DURATION_TEXT if number.get("exclusiveMinimum") == 0 else _DURATION_TEXT
    return {"anyOf": [number, {"type": "string", "pattern": f"^{text}$"}]}


_AS_DURATION = Check(parse_duration, before=True, json_schema=_duration_schema)

Duration = Annotated[float, Ge(0), _AS_DURATION]
"""Seconds, as a float; written in config as ``"500ms"``, ``"30s"``, ``"5m"`` or a number."""
PositiveDuration = Annotated[float, Gt(0), _AS_DURATION]
"""A ``Duration`` that is not 0."""


def parse_address(value: str, *, listen: bool = False) -> tuple[str, int]:
    """``"127.0.0.1:9001"`` or ``"[::1]:9001"`` -> (host, port).

    ``listen``: an address to bind, where port 0 means any free port.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host:
        raise ValueError(f"not a host:port address: {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif any(c in host for c in ":[]"):
        # "::1" would otherwise read as host ":" port 1
        raise ValueError(f"not a host:port address (IPv6 hosts go in brackets): {value!r}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"not a host:port address: {value!r}")
    number = int(port)
    if not (0 if listen else 1) <= number < 65536:
        raise ValueError(f"port out of range in {value!r}")
    return host, number


def _check_address(value: str) -> str:
    parse_address(value)
    return value


_PORT = r"0*([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
Address = Annotated[
    str,
    Check(
        before=True,
        fn=lambda v: _check_address(str(v)),
        json_schema={"pattern": rf"^(\[[^{WHITE_SPACE}]+\]|[^:\[\]{WHITE_SPACE}]+):{_PORT}$"},
    ),
]
"""``host:port``; IPv6 hosts in brackets."""


def _check_listen(value: str) -> str:
    parse_address(value, listen=True)
    return value


ListenAddress = Annotated[str, Check(before=True, fn=lambda v: _check_listen(str(v)))]
"""An address to bind: ``host:port``, where port 0 picks any free port."""


LoadBalancing = Literal["round_robin", "least_outstanding", "p2c", "hash", "inference"]
"""``hash``: consistent hashing of a request key (``ServiceRouting.affinity``);
``inference``: by each replica's load and the prompt's prefix (``InferenceBalancing``)."""

UpstreamProtocol = Literal["http1", "http2"]
"""How the gateway speaks to a service's replicas: HTTP/1.1, or HTTP/2 (gRPC's): in
cleartext by prior knowledge (h2c), or over TLS agreed by ALPN (``UpstreamTlsConfig``)."""

HEADER_NAME = r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}"
"""An HTTP header name (RFC 9110 5.1)."""
_TOKEN = re.compile(HEADER_NAME)
_COOKIE_NAME = r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}"
_COOKIE = re.compile(_COOKIE_NAME)
_HOST = re.compile(
    r"(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*"
)
"""Matched whole (``$`` would let a final newline through), on ASCII only (``str.lower``
makes the Kelvin sign a ``k``)."""


PreviewAllow = Literal["off", "anyone", "token"]
"""Who may ask for a revision by preview route: nobody, anyone, or a request bearing the
admin token or one of the service's preview tokens."""

_DIGEST_TEXT = r"[0-9a-f]{64}"
_DIGEST = re.compile(_DIGEST_TEXT)


def _header(name: str | None) -> str | None:
    if name is not None and not _TOKEN.fullmatch(name):
        raise ValueError(f"not a header name: {name!r}")
    return name


HeaderName = Annotated[str, Check(_header, json_schema={"pattern": f"^{HEADER_NAME}$"})]
"""An HTTP header name, in any case."""


def _digests(tokens: tuple[str, ...]) -> tuple[str, ...]:
    for token in tokens:
        if not _DIGEST.fullmatch(token):
            raise ValueError("a token is given by its SHA-256 digest: 64 hex digits")
    return tokens


@dataclass(frozen=True, slots=True)
class PreviewConfig:
    """Preview routes: a request asks for one revision of the service, by header
    (``X-Gateway-Revision: 3``) or by host label (``r3--hello.example.com``)."""

    __pydantic_config__ = _FORBID

    allow: PreviewAllow = "off"
    header: HeaderName = "X-Gateway-Revision"
    """The request header that names a revision."""
    host_prefix: Annotated[str, Pattern(r"^[a-z]{0,8}$")] = "r"
    """A host ``<prefix><revision>--<a host of the route>`` names a revision; "": no host
    form."""
    token_header: HeaderName = "X-Gateway-Preview-Token"
    """With ``allow: token``: the header that bears the token (not passed upstream)."""
    tokens: Annotated[
        tuple[str, ...],
        Check(_digests, json_schema={"items": {"type": "string", "pattern": f"^{_DIGEST_TEXT}$"}}),
    ] = ()
    """SHA-256 digests (hex) of the tokens accepted: the service's; the controller adds the
    admin token's."""


_ONE_OF_HEADER_OR_COOKIE = {
    **_FORBID,
    "json_schema_extra": {  # StickyConfig.__post_init__
        "oneOf": [
            {"required": ["header"], "properties": {"header": {"type": "string"}}},
            {"required": ["cookie"], "properties": {"cookie": {"type": "string"}}},
        ]
    },
}


@dataclass(frozen=True, slots=True)
class StickyConfig:
    """A client keeps its revision while traffic is split between two: the draw between
    them is a hash of this header's or cookie's value instead of a random number."""

    __pydantic_config__ = _ONE_OF_HEADER_OR_COOKIE

    header: HeaderName | None = None
    cookie: Annotated[str | None, Pattern(f"^{_COOKIE_NAME}$")] = None

    def __post_init__(self) -> None:
        if (self.header is None) == (self.cookie is None):
            raise ValueError("a header or a cookie, one of the two")


@dataclass(frozen=True, slots=True)
class Hsts:
    """The ``Strict-Transport-Security`` header (RFC 6797)."""

    __pydantic_config__ = _FORBID

    max_age: Duration = 31_536_000.0
    include_subdomains: bool = False
    preload: bool = False


def _hosts(hosts: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for host in hosts:
        name = host.lower().rstrip(".")
        if not host.isascii() or not _HOST.fullmatch(name) or len(name) > 253:
            raise ValueError(f"not a host name or *.suffix wildcard: {host!r}")
        out.append(name)
    return tuple(out)


def _route_prefix(prefix: str | None) -> str | None:
    if prefix is None:
        return None
    if not prefix.startswith("/") or any(c in prefix for c in "?#\\ \t\r\n%"):
        raise ValueError("must start with '/' and hold no '?', '#', '%', '\\' or space")
    segments = prefix.split("/")
    if any(s in (".", "..") for s in segments) or "//" in prefix:
        raise ValueError("must be a normalised path (no '.', '..' or '//')")
    return prefix.rstrip("/") or "/"


_HOST_NAME = (
    r"^(?=.{1,253}\.*$)(\*\.)?[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
    r"(\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*\.*$"
)
"""``_hosts``: a host name or ``*.suffix``, in any case, trailing dots allowed, at most 253
characters without them."""
_ROUTE_PREFIX = r"^(?!.*//)(?!(.*/)?\.\.?(/|$))/[^?#\\ \t\r\n%]*$"
"""``_route_prefix``: starts with '/', no '?', '#', '%', '\\' or space, no '.' or '..' segment,
no '//'."""
_HAS_PREFIX = {"required": ["path_prefix"], "properties": {"path_prefix": {"type": "string"}}}
_HOSTS_OR_PREFIX = {
    **_FORBID,
    "json_schema_extra": {  # RouteConfig.__post_init__
        "allOf": [
            {
                "anyOf": [
                    {"required": ["hosts"], "properties": {"hosts": {"minItems": 1}}},
                    _HAS_PREFIX,
                ]
            },
            {
                "anyOf": [
                    {
                        "not": {
                            "required": ["strip_prefix"],
                            "properties": {"strip_prefix": {"const": True}},
                        }
                    },
                    _HAS_PREFIX,
                ]
            },
        ]
    },
}


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """Which requests belong to a service: by Host and/or by path prefix."""

    __pydantic_config__ = _HOSTS_OR_PREFIX

    hosts: Annotated[
        tuple[str, ...],
        Check(_hosts, json_schema={"items": {"type": "string", "pattern": _HOST_NAME}}),
    ] = ()
    """Exact host names, or ``*.suffix`` wildcards; empty means any host."""
    path_prefix: Annotated[
        str | None, Check(_route_prefix, json_schema={"pattern": _ROUTE_PREFIX})
    ] = None
    """A path prefix such as ``/api``; the longest matching prefix wins."""
    strip_prefix: bool = False
    """Remove ``path_prefix`` from the path before forwarding."""
    tls: Literal["acme"] | None = None
    """``acme``: the gateway obtains and renews a certificate for this route's exact hosts
    (``tls.acme`` in the gateway config says from which directory)."""
    https_redirect: bool = False
    """Answer plain-HTTP requests with a 308 to the same URL on HTTPS (the ACME challenge path
    excepted)."""
    hsts: Hsts | None = None
    """Add ``Strict-Transport-Security`` to the answers this route sends over HTTPS."""

    def __post_init__(self) -> None:
        if not self.hosts and self.path_prefix is None:
            raise ValueError("a route needs hosts, a path_prefix, or both")
        if self.strip_prefix and self.path_prefix is None:
            raise ValueError("strip_prefix needs a path_prefix")


def _probe_path(path: str) -> str:
    if not path.startswith("/") or any(c in path for c in "\r\n "):
        raise ValueError("must start with '/' and hold no space or line break")
    return path


RequestPath = Annotated[str, Check(_probe_path, json_schema={"pattern": r"^/[^\r\n ]*$"})]
"""The path of a request the gateway sends a replica itself (a probe's, a scrape's)."""


def _header_fields(headers: dict[str, str]) -> dict[str, str]:
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"not a header name: {name!r}")
        if any((c < " " and c != "\t") or c == "\x7f" for c in value):
            raise ValueError(f"the value of {name} holds a control character")
    return headers


HeaderFields = Annotated[
    dict[str, str],
    Check(
        _header_fields,
        json_schema={
            "propertyNames": {"pattern": f"^{HEADER_NAME}$"},
            "additionalProperties": {
                "type": "string",
                "pattern": "^[^\\u0000-\\u0008\\u000a-\\u001f\\u007f]*$",
            },
        },
    ),
]
"""Header fields sent with a request the gateway makes itself (a probe, a span export): names
as tokens, values without control characters."""


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """One active health check of each upstream."""

    __pydantic_config__ = _FORBID

    type: Literal["http", "tcp", "grpc"] = "http"
    """``grpc``: ``grpc.health.v1.Health/Check`` over h2c, passed when it answers SERVING."""
    service: str = ""
    """gRPC only: the service asked about (empty: the server as a whole)."""
    path: RequestPath = "/"
    """HTTP only: the path requested."""
    method: Literal["GET", "HEAD", "OPTIONS"] = "GET"
    headers: HeaderFields = field(default_factory=dict)
    expected_statuses: tuple[int, ...] = ()
    """HTTP statuses that pass; empty means any 2xx. Redirects are not followed."""
    interval: PositiveDuration = 5.0
    timeout: PositiveDuration = 2.0
    healthy_threshold: Annotated[int, Ge(1), Le(100)] = 2
    """Consecutive passes that make an upstream healthy."""
    unhealthy_threshold: Annotated[int, Ge(1), Le(100)] = 3
    """Consecutive failures that make an upstream unhealthy."""
    jitter: Annotated[float, Ge(0), Le(1)] = 0.1
    """Each interval is stretched or shrunk by up to this fraction, so probes spread out."""


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    __pydantic_config__ = _FORBID
    connect: Duration = 5.0
    """To open a connection to an upstream."""
    read: Duration = 60.0
    """The longest idle gap between bytes from an upstream (in a chunked body streamed to the
    client, measured to an eighth of it: cut 1 to 1.125 times it after the last read)."""
    total: Duration | None = None
    """Optional cap on a whole exchange (never applied to WebSockets)."""


@dataclass(frozen=True, slots=True)
class RetriesConfig:
    __pydantic_config__ = _FORBID
    attempts: Annotated[int, Ge(0), Le(10)] = 2
    """Extra tries on another upstream after a failure before any byte was sent."""
    timeout: Duration = 10.0
    """No new attempt starts after this long since the request arrived."""
    on_status: bool = False
    """Also retry idempotent requests without a body that got 502, 503 or 504."""


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """Passive detection: ejection on failures seen in real traffic."""

    __pydantic_config__ = _FORBID

    consecutive_connect_failures: Annotated[int, Ge(1)] = 3
    consecutive_5xx: Annotated[int, Ge(1)] = 5
    base_ejection_time: Duration = 10.0
    """The first ejection lasts this long; each further one adds as much again."""
    max_ejection_time: Duration = 300.0
    max_ejection_percent: Annotated[int, Ge(0), Le(100)] = 50
    """Never eject more than this share of a pool (at least one upstream may go)."""


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    __pydantic_config__ = _FORBID
    max_body_size: Annotated[int, Ge(0)] = 64 * 1024 * 1024
    """Largest request body accepted, in bytes (413 beyond it); 0 means no limit."""
    max_in_flight_per_replica: Annotated[int, Ge(1), Le(1_000_000)] | None = None
    """Most requests one replica is sent at once (off by default); more wait in the service's
    queue, oldest first, for ``queue_timeout`` at most, then 503. With worker processes each
    enforces its share, ``max(1, n // workers)``."""
    max_queue: Annotated[int, Ge(0), Le(100_000)] = 1000
    """Requests waiting for a slot under ``max_in_flight_per_replica`` at most (per
    process); beyond, 503 at once."""


RequestKey = Annotated[
    str,
    Check(
        before=True,
        fn=lambda v: _check_key(v),
        json_schema={"pattern": f"^(ip|token|header:{HEADER_NAME}|cookie:{_COOKIE_NAME})$"},
    ),
]
"""Where a request's key comes from: ``ip`` (the client's address), ``header:NAME``,
``cookie:NAME`` (affinity only) or ``token`` (the bearer token's id; rate limits only)."""


def _check_key(value: object) -> object:
    if not isinstance(value, str):
        return value
    kind, sep, name = value.partition(":")
    if value in ("ip", "token"):
        return value
    if sep and kind == "header" and _TOKEN.fullmatch(name):
        return f"header:{name.lower()}"
    if sep and kind == "cookie" and _COOKIE.fullmatch(name):
        return value
    raise ValueError(f"not a key: {value!r} (ip, header:NAME, cookie:NAME or token)")


def _limit_prefix(prefix: str) -> str:
    if not prefix.startswith("/") or any(c in prefix for c in "?# \t\r\n"):
        raise ValueError("must start with '/' and hold no '?', '#' or space")
    return prefix


def _no_cookie(key: str) -> str:
    if key.startswith("cookie:"):
        raise ValueError("a rate limit's key is ip, header:NAME or token")
    return key


def _no_token(key: str) -> str:
    if key == "token":
        raise ValueError("an affinity key is ip, header:NAME or cookie:NAME")
    return key


AffinityKey = Annotated[
    RequestKey,
    Check(_no_token, json_schema={"pattern": f"^(ip|header:{HEADER_NAME}|cookie:{_COOKIE_NAME})$"}),
]
"""What ``load_balancing: hash`` hashes: ``ip``, ``header:NAME`` or ``cookie:NAME``."""


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A token bucket per key for requests whose path starts with ``path_prefix``."""

    __pydantic_config__ = _FORBID

    path_prefix: Annotated[
        str, Check(_limit_prefix, json_schema={"pattern": r"^/[^?# \t\r\n]*$"})
    ] = "/"
    key: Annotated[
        RequestKey,
        Check(
            _no_cookie,
            json_schema={
                "pattern": f"^(ip|token|header:{HEADER_NAME})$",
                "description": "ip, header:NAME or token (the bearer token's id: needs auth)",
            },
        ),
    ] = "ip"
    rps: Annotated[float, Gt(0), Le(1_000_000)] = field(kw_only=True)
    """Tokens added per second."""
    burst: Annotated[int, Ge(0), Le(1_000_000)] = 0
    """The bucket's size: requests allowed at once after a quiet spell (0: ``ceil(rps)``)."""


@dataclass(frozen=True, slots=True)
class AuthRouting:
    """What the data plane checks of a request to a service with ``auth``: a bearer token
    whose SHA-256 is one of ``tokens``. Only hashes cross to the data plane."""

    __pydantic_config__ = _FORBID

    header: str = "authorization"
    """Lower-cased; ``authorization`` carries ``Bearer <token>``, any other header the token."""
    pass_token: bool = False
    """Send the header upstream (by default it is stripped)."""
    tokens: dict[str, str] = field(default_factory=dict)
    """SHA-256 of each token (hex) -> the token's id."""


MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}"
"""A model's name or alias as a request's ``model`` gives it (``meta-llama/Llama-3-8B``)."""
_MODEL_NAME = re.compile(MODEL_NAME)


def _model_name(name: str) -> str:
    if not _MODEL_NAME.fullmatch(name):
        raise ValueError(f"not a model name: {name!r} (letters, digits and '._:/@+-', at most 128)")
    return name


ModelName = Annotated[str, Check(_model_name, json_schema={"pattern": f"^{MODEL_NAME}$"})]


MAX_ALIASES: Final = 16


def _distinct_aliases(aliases: tuple[str, ...]) -> tuple[str, ...]:
    if len(aliases) > MAX_ALIASES:
        raise ValueError(f"at most {MAX_ALIASES} aliases")
    if len(set(aliases)) != len(aliases):
        raise ValueError("an alias is listed twice")
    return aliases


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The model a service serves over an OpenAI-compatible API (``models`` in the gateway
    config routes requests to it by the ``model`` of their body)."""

    __pydantic_config__ = _FORBID

    name: ModelName
    aliases: Annotated[
        tuple[ModelName, ...],
        Check(_distinct_aliases, json_schema={"uniqueItems": True, "maxItems": MAX_ALIASES}),
    ] = ()
    """Other names a request may give for it."""

    def __post_init__(self) -> None:
        if self.name in self.aliases:
            raise ValueError(f"aliases: {self.name!r} is the model's name already")

    @property
    def names(self) -> tuple[str, ...]:
        """The name, then the aliases."""
        return (self.name, *self.aliases)


LoadFormat = Literal["vllm", "sglang"]
"""Whose metric names a replica's ``/metrics`` uses (``health.load_report``)."""


@dataclass(frozen=True, slots=True)
class LoadMetricsConfig:
    """``load_metrics``: each replica's own view of its load (requests waiting and running,
    KV-cache use), scraped from its Prometheus endpoint for ``load_balancing: inference``."""

    __pydantic_config__ = _FORBID

    format: LoadFormat = "vllm"
    path: RequestPath = "/metrics"
    interval: PositiveDuration = 1.0
    """How often each replica is scraped (a scrape is bounded by the interval too)."""
    max_age: PositiveDuration = 3.0
    """A replica's figures older than this expire: its in-flight count alone counts."""


PrefixChars = Annotated[int, Ge(0), Le(65_536)]
LoadFactor = Annotated[float, Ge(1), Le(100)]


@dataclass(frozen=True, slots=True)
class InferenceBalancing:
    """``load_balancing: {policy: inference, ...}``: the settings of the pick
    (``pool.inference``)."""

    __pydantic_config__ = _FORBID

    prefix_chars: PrefixChars = 4096
    """Characters of the prompt's beginning (the raw JSON text of its messages or its
    prompt) hashed in blocks (``pool.prefixes``) for prefix affinity; 0: no affinity, by
    load alone."""
    max_load_factor: LoadFactor = 2.0
    """A prefix's replica is passed over while its load is above this many times the mean
    load of the candidates (bounded-load consistent hashing): a cache miss costs its whole
    prefill, so the bound is looser than for balancing alone."""


def _absolute_path(path: str | None) -> str | None:
    if path is not None and (not path.startswith("/") or "\x00" in path):
        raise ValueError(f"must be an absolute path, not {path!r}")
    return path


FilePath = Annotated[str | None, Check(_absolute_path, json_schema={"pattern": "^/[^\\u0000]*$"})]
"""An absolute path to a file (read where it is used, not where it is validated)."""
_TLS_NAME = r"^[A-Za-z0-9]([A-Za-z0-9.:-]{0,252})$"
"""A DNS name or an IP address, as a certificate names its subject."""
_CERT_WITH_KEY: dict[str, Any] = {
    **_FORBID,
    "json_schema_extra": {  # UpstreamTlsConfig.__post_init__
        "anyOf": [
            {"properties": {"cert": {"type": "null"}, "key": {"type": "null"}}},
            {
                "required": ["cert", "key"],
                "properties": {"cert": {"type": "string"}, "key": {"type": "string"}},
            },
        ]
    },
}


@dataclass(frozen=True, slots=True)
class UpstreamTlsConfig:
    """``upstream_tls``: the gateway speaks TLS to the service's replicas (nginx's
    ``proxy_ssl_*``, Envoy's ``UpstreamTlsContext``); ALPN offers ``http/1.1`` or ``h2`` as
    ``upstream_protocol`` says. The files are read by each process that connects
    (``wire.upstream_tls``), and read again when they change."""

    __pydantic_config__ = _CERT_WITH_KEY

    ca: FilePath = None
    """PEM file of the certificate authorities a replica's certificate must chain to (None:
    the system's trust store)."""
    server_name: Annotated[str | None, Pattern(_TLS_NAME)] = None
    """Sent as SNI and checked against the replica's certificate (None: the replica's host;
    an IP address is checked, not sent)."""
    verify: bool = True
    """Check the replica's certificate (chain and name). False: any certificate is taken,
    as nginx's default ``proxy_ssl_verify off``; the service's view says so."""
    cert: FilePath = None
    """PEM file of a client certificate (its chain, leaf first) presented to the replicas
    (mutual TLS); with ``key``."""
    key: FilePath = None
    """PEM file of the client certificate's private key; with ``cert``."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("upstream_tls: cert and key go together (a client certificate)")


@dataclass(frozen=True, slots=True)
class ServiceRouting:
    """All the data plane needs to know of one service."""

    __pydantic_config__ = _FORBID

    name: str
    route: RouteConfig
    load_balancing: LoadBalancing = "least_outstanding"
    upstream_protocol: UpstreamProtocol = "http1"
    """``http2``: requests go to the replicas over HTTP/2, multiplexed
    (``proxy.h2_upstream``): h2c, or h2 with ``upstream_tls``."""
    upstream_tls: UpstreamTlsConfig | None = None
    """TLS to the replicas (None: plain TCP)."""
    probes: tuple[ProbeConfig, ...] = ()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    retries: RetriesConfig = RetriesConfig()
    outlier: OutlierConfig = OutlierConfig()
    limits: LimitsConfig = LimitsConfig()
    preview: PreviewConfig = PreviewConfig()
    sticky: StickyConfig | None = None
    """Keep a client on its revision while traffic is split (None: a random draw)."""
    queue_timeout: Duration = 0.0
    """Wait this long for an upstream to become routable (or, under
    ``limits.max_in_flight_per_replica``, for a slot) before answering 503."""
    auth: AuthRouting | None = None
    """Requests need a bearer token (None: open)."""
    rate_limits: tuple[RateLimit, ...] = ()
    affinity: RequestKey | None = None
    """``load_balancing: hash``: the request key hashed onto the routable upstreams."""
    model: ModelConfig | None = None
    """The model it serves, by name and aliases (``ModelsConfig``)."""
    inference: InferenceBalancing = InferenceBalancing()
    """``load_balancing: inference``: its settings."""
    load_metrics: LoadMetricsConfig | None = None
    """Scrape each replica's own figures of its load (None: not scraped)."""


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    __pydantic_config__ = _FORBID
    max_header_size: Annotated[int, Ge(1024)] = 16 * 1024
    """Largest request line or header field, in bytes (431 beyond it)."""
    header_timeout: Duration = 10.0
    """A client must send its full request head within this long (from the connection, or
    from a later request's first byte); enforced up to 0.25 s late, as ``keepalive_timeout``
    (the connections' deadline wheel, ``proxy.wheel.WHEEL_SLOT``). HTTP/2: the first
    request within it of the connection, and each header block within it of its first
    frame (GOAWAY)."""
    keepalive_timeout: Duration = 75.0
    """How long a client connection may stay idle between requests (closed up to 0.25 s
    after it)."""
    park_after: Duration = 1.0
    """A plain HTTP connection idle this long is parked: held out of the event loop as its
    socket alone (a few numbers, not a transport), until its client sends again; its
    next request then pays about what a new connection's first does, and one that came back
    sooner than it had waited waits twice as long next time (``proxy.parking``). Up to
    0.25 s late. 0: never."""
    max_connections: Annotated[int, Ge(1)] = 10_000
    """Open client connections beyond this are refused at accept."""
    body_timeout: Duration = 30.0
    """The longest a request body may pause between two reads (408 and close); 0: none."""
    body_min_rate: Annotated[int, Ge(0)] = 0
    """Bytes per second a request body must average once ``body_timeout`` has passed since it
    began, so a body trickled a byte at a time cannot hold a connection (Apache's
    mod_reqtimeout ``MinRate``); 0: no minimum. HTTP/2: each stream's body (408 on it)."""
    send_timeout: Duration = 60.0
    """The longest a client may leave the response unread (its socket buffer full) before it
    is cut off; bounds how long a client that never reads holds an upstream; 0: none."""


@dataclass(frozen=True, slots=True)
class CertificateFiles:
    """One certificate (its chain, leaf first) and its private key, in PEM files."""

    __pydantic_config__ = _FORBID

    cert_file: str
    key_file: str


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """How the HTTPS listeners (``listen_tls``) terminate TLS."""

    __pydantic_config__ = _FORBID

    certificates: tuple[CertificateFiles, ...] = ()
    """Chosen by SNI against each certificate's names: exact first, then wildcard."""
    unknown_name: Literal["default", "refuse"] = "default"
    """A client that sends no SNI, or a name no certificate covers: given the default
    certificate (the first listed, else the first obtained by ACME), or refused with an
    ``unrecognized_name`` alert."""
    handshake_timeout: Duration = 10.0
    """A client must finish its TLS handshake within this long."""
    session_tickets: bool = True
    """Session resumption by tickets (RFC 8446 section 4.6.1)."""
    ticket_key_lifetime: Duration = 3600.0
    """Ticket keys are replaced this often; a ticket older than two lifetimes is not resumed."""
    watch_interval: Duration = 5.0
    """How often certificate files are checked for changes (0: only on SIGHUP or the admin
    API's reload)."""
    alpn: tuple[Literal["h2", "http/1.1"], ...] = ("h2", "http/1.1")
    """The protocols offered by ALPN, in the server's order of preference: ``h2`` first, so a
    client that speaks both (a browser) gets HTTP/2; ``["http/1.1"]``: HTTP/1.1 only."""
    managed_dir: str | None = None
    """Certificates obtained by ACME (``<dir>/<name>/fullchain.pem`` and ``privkey.pem``), and
    the HTTP-01 challenge answers (``<dir>/../challenges/<token>``); set by the loader from
    ``state_dir``, not written in a config."""


_OTLP_ENDPOINT = r"^https?://[^/?#\s]+(/[^?#\s]*)?$"


def _otlp_endpoint(url: str | None) -> str | None:
    """An OTLP/HTTP endpoint: a URL without a path gets the traces path (``/v1/traces``)."""
    if url is None:
        return None
    match = re.fullmatch(_OTLP_ENDPOINT, url)
    if match is None:
        raise ValueError("must be an http:// or https:// URL, without query or fragment")
    if match.group(1) in (None, "/"):
        return url.rstrip("/") + "/v1/traces"
    return url


_SPANS_NEED_PROPAGATE: dict[str, Any] = {
    **_FORBID,
    "json_schema_extra": {  # TracingConfig.__post_init__
        "not": {
            "required": ["otlp_endpoint", "propagate"],
            "properties": {"otlp_endpoint": {"type": "string"}, "propagate": {"const": False}},
        }
    },
}


@dataclass(frozen=True, slots=True)
class Http2Config:
    """Inbound HTTP/2: h2c by prior knowledge on ``listen``, h2 by ALPN on ``listen_tls``
    (``tls.alpn``); and the upstream leg of services with ``upstream_protocol: http2``."""

    __pydantic_config__ = _FORBID

    cleartext: bool = True
    """Take HTTP/2 by prior knowledge on the plain listener (a connection that opens with
    the HTTP/2 preface); False: that preface is refused with 400, as before."""
    max_concurrent_streams: Annotated[int, Ge(1)] = 100
    """Streams a client may have open at once on one connection (SETTINGS_MAX_CONCURRENT_
    STREAMS); one more breaks the protocol and ends the connection with GOAWAY."""
    max_header_list_size: Annotated[int, Ge(1024)] = 64 * 1024
    """The largest request header list, decoded (SETTINGS_MAX_HEADER_LIST_SIZE); a larger
    one ends the connection with GOAWAY. Each field is also held to
    ``limits.max_header_size`` (431 on its stream)."""
    upstream_max_concurrent_streams: Annotated[int, Ge(1)] = 100
    """Streams the gateway opens at once on one HTTP/2 connection to a replica (fewer if
    the replica's SETTINGS_MAX_CONCURRENT_STREAMS says so); one more opens a new
    connection."""


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """W3C Trace Context propagation (``tracing``), and spans of the sampled requests exported
    over OTLP/HTTP (protobuf) when ``otlp_endpoint`` is set."""

    __pydantic_config__ = _SPANS_NEED_PROPAGATE

    propagate: bool = True
    """Send each request upstream with a ``traceparent`` for the gateway's hop (the client's
    trace continued, else a new one) and the client's ``tracestate``; the request id carries
    the trace id. False: both headers pass through untouched, none is added (and no span is
    recorded: ``otlp_endpoint`` needs it)."""
    sample_ratio: Annotated[float, Ge(0), Le(1)] = 0.01
    """The share of new traces (a request without a valid ``traceparent``) sent with the
    sampled flag set; a continued trace keeps its caller's flag. Spans are recorded for the
    sampled requests only."""
    otlp_endpoint: Annotated[
        str | None, Check(_otlp_endpoint, json_schema={"pattern": _OTLP_ENDPOINT})
    ] = None
    """Where spans are exported, OTLP over HTTP with protobuf (``http://collector:4318``; a
    URL without a path gets ``/v1/traces``). None: no span is recorded."""
    service_name: Annotated[str, Pattern(r"^\S(.*\S)?$")] = "gateway"
    """The ``service.name`` of the spans' resource."""
    headers: HeaderFields = field(default_factory=dict)
    """Header fields sent with each export (a collector's API key)."""
    timeout: PositiveDuration = 10.0
    """An export that takes longer is given up, and its spans counted as dropped."""

    def __post_init__(self) -> None:
        if self.otlp_endpoint is not None and not self.propagate:
            raise ValueError("tracing.otlp_endpoint needs tracing.propagate: spans are of traces")


MODELS_BODY_READ_MAX: Final = 256 * 1024
"""The most of a body read for its ``model``: what a request body buffers before its client
is paused (``proxy.request.BODY_HIGH_WATER``)."""


@dataclass(frozen=True, slots=True)
class ModelsConfig:
    """The traffic listener as an OpenAI-compatible endpoint: a POST under ``path_prefix``
    goes to the service whose ``model`` its JSON body names; ``GET {path_prefix}/models``
    lists them; errors on these paths come in OpenAI's shape."""

    __pydantic_config__ = _FORBID

    path_prefix: Annotated[str, Check(_route_prefix, json_schema={"pattern": _ROUTE_PREFIX})] = (
        "/v1"
    )
    max_body_read: Annotated[int, Ge(1024), Le(MODELS_BODY_READ_MAX)] = 64 * 1024
    """Bytes of a body read at most to find its ``model`` (then relayed unchanged with the
    rest); a body whose ``model`` comes later is refused with 400."""


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Settings of the traffic listener and its forwarding."""

    __pydantic_config__ = _FORBID

    listen: ListenAddress = "0.0.0.0:8080"
    listen_tls: tuple[ListenAddress, ...] = ()
    """HTTPS listeners, served with ``tls``."""
    tls: TlsConfig = TlsConfig()
    http2: Http2Config = Http2Config()
    limits: ListenerLimits = ListenerLimits()
    shutdown_timeout: Duration = 30.0
    """On SIGTERM, in-flight requests get this long to finish."""
    upstream_keepalive: Annotated[int, Ge(0)] = 256
    """Idle keep-alive connections kept per upstream address; one more is closed after its
    exchange. Concurrent connections are never capped per upstream (a cap would make a busy
    upstream look like a failing one)."""
    trust_forwarded: bool = False
    """Keep a client's X-Forwarded-* headers (behind a trusted proxy) instead of replacing them."""
    tracing: TracingConfig = TracingConfig()
    models: ModelsConfig | None = None
    """Route by model (OpenAI-compatible); None: off."""
