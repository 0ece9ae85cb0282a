"""What a service asks of a request before it is forwarded: a bearer token, rate limits,
and the key its affinity hashes. Run by ``Proxy._prepare`` once the request is routed, only
for a service that set one of them (``ServiceRouting.auth``, ``rate_limits``, ``affinity``).

Auth: the token is the value of ``auth.header`` (``Authorization: Bearer <token>`` by
default); its SHA-256 is looked up among the service's token hashes (``AuthRouting.tokens``),
one dict lookup. Only hashes reach the data plane, so a token is never held, logged or sent
back; and the lookup's time depends on the digest, which a client cannot steer a byte at a
time, not on how much of a guessed token is right. A token longer than ``MAX_TOKEN`` is
wrong without being hashed, and so is a request with the header twice. Each check is counted
by outcome (``ok``, ``missing``, ``wrong``) in the pool's counters. Unless ``pass_token``, the
header is not sent upstream.

Rate limits: each rule whose ``path_prefix`` the path starts with spends a token of its key's
bucket (``ratelimit``); the first empty one refuses with 429, ``Retry-After`` and the
``RateLimit-*`` fields. The client's address is the socket peer, or with
``proxy.trust_forwarded`` the last X-Forwarded-For hop: the one the trusted proxy in front
added; the hops before it are the client's to write.
"""

from __future__ import annotations

import math
from typing import Final

from ..config import AuthRouting
from ..errors import TooManyRequests, Unauthorized
from ..pool.service_pool import ServicePool, token_digests
from ..wire import plainhead
from .exchange import Exchange
from .request import IncomingRequest

MAX_TOKEN: Final = 1024
"""Bytes: an API key is tens of bytes; a longer one is refused without being hashed."""
MAX_KEY: Final = 64
"""A rate-limit key (a header's value) longer than this is kept as its digest, so the table's
memory is bounded by its count of keys alone."""
_AUTHORIZATION: Final = b"authorization"
MISSING: Final = "\x00missing"
WRONG: Final = "\x00wrong"
"""What ``token_of`` says of a request without a token, or a wrong one: never an id."""
TWICE: Final = plainhead.TWICE
"""What ``_one`` says of a field given twice: never a value (a value holds no CR)."""
_AUTHORIZATION_LINE: Final = len(b"authorization: ")
"""Bytes before the value of a plain head's Authorization line (``strip``)."""


def values(request: IncomingRequest, name: bytes) -> list[bytes]:
    """The values of the request's ``name`` fields (lower-cased name), in order, without the
    spaces around them. A head read by ``plainhead`` is searched as the block it came in
    (``bytes.find`` on it lower-cased, in C), not split into fields."""
    raw = request.raw_fields
    if not raw:
        return [value for key, value in request.headers if key.lower() == name]
    out: list[bytes] = []
    low = b"\n" + raw.lower()  # every line, the first too, after a LF: raw's index + 1
    needle = b"\n" + name + b":"
    at = low.find(needle)
    while at >= 0:
        start = at + len(needle)
        end = low.find(b"\r", start)
        if end < 0:
            end = len(low)
        out.append(raw[start - 1 : end - 1].strip(b" \t"))
        at = low.find(needle, end)
    return out


def _one(request: IncomingRequest, name: bytes) -> bytes | None:
    """The value of the request's only ``name`` field (lower-cased name); None if it has
    none, ``TWICE`` if more than one. ``values`` without a list, for the token of every
    request (nothing made but the value: no tuple for the collector to track)."""
    raw = request.raw_fields
    if not raw:
        found = values(request, name)
        return (found[0] if len(found) == 1 else TWICE) if found else None
    if name == _AUTHORIZATION:  # noted as the head was read (``plainhead``)
        value = request.authorization
        if value is None or value == TWICE:
            return value
        return value.strip(b" \t")
    low = raw.lower()
    needle = b"\n" + name + b":"
    if low.startswith(needle[1:]):
        start = len(needle) - 1
    else:
        at = low.find(needle)
        if at < 0:
            return None
        start = at + len(needle)
    end = low.find(b"\r", start)
    if end < 0:
        end = len(low)
    if low.find(needle, end) >= 0:
        return TWICE
    return raw[start:end].strip(b" \t")


def field(request: IncomingRequest, name: bytes) -> bytes | None:
    """The value of the request's last ``name`` field (lower-cased name), or None."""
    found = values(request, name)
    return found[-1] if found else None


def strip(request: IncomingRequest, name: bytes) -> None:
    """Take the ``name`` fields out of the lines a plain head sends upstream as they are
    (``IncomingRequest.plain_lines``), so it keeps its shortcut (``messages.upstream_head``);
    any other head drops them as its fields are written (``Exchange.strip``)."""
    plain = request.plain_lines
    if not plain:
        return
    if name == _AUTHORIZATION and request.raw_fields:  # found as the head was read
        at = request.authorization_at
        value = request.authorization
        if value is None:
            return  # none
        if value != TWICE and at >= 0:
            end = at + _AUTHORIZATION_LINE + len(value)  # its CRLF, unless it is the last
            if end >= len(plain):
                request.plain_lines = plain[: max(at - 2, 0)]
            else:
                request.plain_lines = plain[:at] + plain[end + 2 :]
            return
    low = b"\r\n" + plain.lower()  # every line after a CRLF: plain's index + 2
    needle = b"\r\n" + name + b":"
    at = low.find(needle)  # the line begins at plain[at], its CRLF is plain[end - 2 : end]
    while at >= 0:
        end = low.find(b"\r\n", at + len(needle))
        if end < 0:  # the last line: the CRLF before it goes with it
            plain = plain[: max(at - 2, 0)]
            break
        plain = plain[:at] + plain[end:]
        low = low[:at] + low[end:]
        at = low.find(needle, at)
    request.plain_lines = plain


def authenticate(auth: AuthRouting, request: IncomingRequest) -> tuple[str, str | None]:
    """("ok", the token's id), ("missing", None) or ("wrong", None)."""
    token_id = token_of(auth, request)
    if token_id == MISSING or token_id == WRONG:
        return ("missing" if token_id == MISSING else "wrong"), None
    return "ok", token_id


def token_of(auth: AuthRouting, request: IncomingRequest) -> str:
    """The id of the request's token, or ``MISSING`` or ``WRONG``."""
    return _token_id(request, auth.header.encode(), token_digests(auth.tokens))


def _token_id(request: IncomingRequest, header: bytes, digests: dict[bytes, str]) -> str:
    """``token_of`` with the auth's header (encoded) and tokens (``token_digests``)."""
    value = _one(request, header)
    if value is None:
        return MISSING
    if value == TWICE:
        # Which one would an upstream read? Neither is taken (with pass_token, the
        # unchecked one could reach it).
        return WRONG
    if header == _AUTHORIZATION:
        if value.startswith(b"Bearer "):  # as nearly every client spells it
            value = value[7:]
        else:
            scheme, _, value = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return WRONG if scheme else MISSING
    token = value.strip()
    if not token:
        return MISSING
    if len(token) > MAX_TOKEN:
        return WRONG
    import hashlib  # here: a worker whose services check no token imports no digests

    return digests.get(hashlib.sha256(token).digest(), WRONG)


def client_ip(request: IncomingRequest, peer: str | None, trust_forwarded: bool) -> str:
    """The client's address: the socket peer, or behind a trusted proxy the last
    X-Forwarded-For hop (the one that proxy appended)."""
    if trust_forwarded:
        last = None
        for key, value in request.headers:
            if key.lower() == b"x-forwarded-for":
                last = value
        if last is not None:
            hop = last.rpartition(b",")[2].strip()
            if hop:
                return hop[:MAX_KEY].decode("latin-1")
    return peer or ""


def admit(ex: Exchange, sp: ServicePool, trust_forwarded: bool, now: float) -> None:
    """``check`` the routed request of ``ex``: refused, or let through with its affinity
    key (``Exchange.affinity``) and the token's header to strip (``Exchange.strip``)."""
    request = ex.request
    ex.affinity = check(sp, request, ex.path, ex.client.peer, trust_forwarded, now)
    if sp.auth_strip:
        name = sp.auth_header
        ex.strip = name
        strip(request, name)


def check(
    sp: ServicePool,
    request: IncomingRequest,
    path: str,
    peer: str | None,
    trust_forwarded: bool,
    now: float,
) -> bytes | None:
    """Refuse the request (``Unauthorized``, ``TooManyRequests``) or let it through; returns
    the affinity key to hash, if the service has one and the request carries it."""
    routing = sp.routing
    counters = sp.counters
    token_id = None
    if sp.auth_on:
        token_id = _token_id(request, sp.auth_header, sp.auth_digests)
        if token_id == MISSING or token_id == WRONG:
            name = "auth_missing" if token_id == MISSING else "auth_wrong"
            counters[name] = counters.get(name, 0) + 1
            raise Unauthorized(
                "this service needs a bearer token"
                if token_id == MISSING
                else "the bearer token is not valid for this service",
                service=routing.name,
            )
        counters["auth_ok"] = counters.get("auth_ok", 0) + 1
    if sp.rate_limited:
        for rule in sp.rate_rules():
            if not path.startswith(rule.path_prefix):
                continue
            key = rule.key
            if key == "ip":
                value = client_ip(request, peer, trust_forwarded)
            elif key == "token":
                value = token_id or ""  # (auth is on: a rule keyed by token needs it)
            else:
                raw = field(request, rule.header) or b""
                if len(raw) > MAX_KEY:
                    import hashlib

                    raw = hashlib.blake2b(raw, digest_size=16).hexdigest().encode()
                value = raw.decode("latin-1")
            if not rule.buckets.allow(value, now):
                verdict = rule.buckets.take(value, now)  # the refusal's figures; spends nothing
                counters["rate_limited"] = counters.get("rate_limited", 0) + 1
                retry = max(1, math.ceil(verdict.retry_after))
                window = rule.buckets.burst / rule.buckets.rps
                fields = (
                    ("RateLimit-Limit", str(verdict.limit)),
                    ("RateLimit-Remaining", "0"),
                    ("RateLimit-Reset", str(max(1, math.ceil(verdict.reset)))),
                    ("RateLimit-Policy", f"{verdict.limit};w={window:g}"),
                )
                raise TooManyRequests(
                    f"over the rate limit of {rule.rps:g} requests per second "
                    f"(burst {rule.burst}) for {rule.path_prefix}",
                    retry,
                    fields,
                    service=routing.name,
                )
    affinity = sp.affinity
    if affinity is None:
        return None
    if affinity == "ip":
        return client_ip(request, peer, trust_forwarded).encode() or None
    kind, _, name = affinity.partition(":")
    if kind == "header":
        return field(request, name.encode()) or None
    return cookie(request, name.encode()) or None


def cookie(request: IncomingRequest, name: bytes) -> bytes | None:
    """The value of cookie ``name`` in the request's Cookie fields, or None."""
    for key, value in request.headers:
        if key.lower() == b"cookie":
            for pair in value.split(b";"):
                k, sep, v = pair.strip().partition(b"=")
                if sep and k == name:
                    return v
    return None
