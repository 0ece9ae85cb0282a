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

import hashlib
import math
from typing import Final

from ..config import AuthRouting
from ..errors import TooManyRequests, Unauthorized
from ..pool import ServicePool
from .exchange import Exchange
from .request import IncomingRequest

MAX_TOKEN: Final = 1024
"""Bytes: an API key is tens of bytes; a longer one is refused without being hashed."""
MAX_KEY: Final = 64
"""A rate-limit key (a header's value) longer than this is kept as its digest, so the table's
memory is bounded by its count of keys alone."""
_AUTHORIZATION: Final = b"authorization"
_COUNTED: Final = {"ok": "auth_ok", "missing": "auth_missing", "wrong": "auth_wrong"}


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


def _one(request: IncomingRequest, name: bytes) -> tuple[bytes | None, bool]:
    """The value of the request's first ``name`` field (lower-cased name), or None; and
    whether another follows. ``values`` without a list, for the token on every request."""
    raw = request.raw_fields
    if not raw:
        found = values(request, name)
        return (found[0] if found else None), len(found) > 1
    low = raw.lower()
    needle = b"\n" + name + b":"
    if low.startswith(needle[1:]):
        start = len(needle) - 1
    else:
        at = low.find(needle)
        if at < 0:
            return None, False
        start = at + len(needle)
    end = low.find(b"\r", start)
    if end < 0:
        end = len(low)
    return raw[start:end].strip(b" \t"), low.find(needle, end) >= 0


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
    header = auth.header.encode()
    value, more = _one(request, header)
    if value is None:
        return "missing", None
    if more:
        # Twice: which one would an upstream read? Neither is taken (with pass_token, the
        # unchecked one could reach it).
        return "wrong", None
    if header == _AUTHORIZATION:
        scheme, _, value = value.partition(b" ")
        if scheme.lower() != b"bearer":
            return ("missing", None) if not scheme else ("wrong", None)
    token = value.strip()
    if not token:
        return "missing", None
    if len(token) > MAX_TOKEN:
        return "wrong", None
    token_id = auth.tokens.get(hashlib.sha256(token).hexdigest())
    if token_id is None:
        return "wrong", None
    return "ok", token_id


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
    auth = sp.routing.auth
    if auth is not None and not auth.pass_token:
        name = auth.header.encode()
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
    auth = routing.auth
    if auth is not None:
        outcome, token_id = authenticate(auth, request)
        name = _COUNTED[outcome]
        counters[name] = counters.get(name, 0) + 1
        if token_id is None:
            message = (
                "this service needs a bearer token"
                if outcome == "missing"
                else "the bearer token is not valid for this service"
            )
            raise Unauthorized(message, service=routing.name)
    if routing.rate_limits:
        for rule in sp.rate_rules():
            if not path.startswith(rule.path_prefix):
                continue
            key = rule.key
            if key == "ip":
                value = client_ip(request, peer, trust_forwarded)
            elif key == "token":
                value = token_id or ""
            else:
                raw = field(request, rule.header) or b""
                if len(raw) > MAX_KEY:
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
    affinity = routing.affinity
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
