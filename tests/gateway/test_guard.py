"""``proxy.guard``: bearer tokens by their hash, the client's address, rate limits' 429 and
the affinity key, on a request head as the parser leaves it and a fake clock."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

import pytest

from gateway.config import AuthRouting, RouteConfig, ServiceRouting, parse_settings
from gateway.errors import TooManyRequests, Unauthorized
from gateway.pool.pool import Pool
from gateway.pool.service_pool import token_digests
from gateway.proxy import guard
from gateway.proxy.request import IncomingRequest
from gateway.wire import plainhead

TOKEN = b"k3y-" + b"x" * 40
AUTH = AuthRouting(tokens={hashlib.sha256(TOKEN).hexdigest(): "tok_1"})


def request(*fields: tuple[bytes, bytes]) -> IncomingRequest:
    return IncomingRequest(list(fields))


@pytest.mark.parametrize(
    ("fields", "outcome"),
    [
        ([(b"Authorization", b"Bearer " + TOKEN)], ("ok", "tok_1")),
        ([(b"authorization", b"bearer   " + TOKEN + b" ")], ("ok", "tok_1")),
        ([], ("missing", None)),
        ([(b"Authorization", b"")], ("missing", None)),
        ([(b"Authorization", b"Bearer ")], ("missing", None)),
        ([(b"Authorization", b"Basic dXNlcjpwdw==")], ("wrong", None)),
        ([(b"Authorization", b"Bearer " + TOKEN[:-1])], ("wrong", None)),
        ([(b"Authorization", b"Bearer " + TOKEN + b"x")], ("wrong", None)),
        ([(b"Authorization", b"Bearer " + b"a" * 5000)], ("wrong", None)),
        # Twice, even the same: an upstream might read the one not checked.
        ([(b"Authorization", b"Bearer " + TOKEN), (b"Authorization", b"Bearer no")],
         ("wrong", None)),
        ([(b"Authorization", b"Bearer " + TOKEN), (b"authorization", b"Bearer " + TOKEN)],
         ("wrong", None)),
    ],
)  # fmt: skip
def test_authenticate(fields: list[tuple[bytes, bytes]], outcome: tuple) -> None:
    assert guard.authenticate(AUTH, request(*fields)) == outcome


def test_another_header_carries_the_token_bare() -> None:
    auth = replace(AUTH, header="x-api-key")
    assert guard.authenticate(auth, request((b"X-Api-Key", TOKEN))) == ("ok", "tok_1")
    assert guard.authenticate(auth, request((b"Authorization", b"Bearer " + TOKEN)))[0] == (
        "missing"
    )


def test_the_client_address() -> None:
    spoofed = request((b"X-Forwarded-For", b"6.6.6.6, 7.7.7.7"))
    assert guard.client_ip(spoofed, "10.0.0.1", trust_forwarded=False) == "10.0.0.1"
    # Behind a trusted proxy: the hop it appended, the last; never the client's own.
    assert guard.client_ip(spoofed, "10.0.0.1", trust_forwarded=True) == "7.7.7.7"
    two = request((b"X-Forwarded-For", b"6.6.6.6"), (b"X-Forwarded-For", b"1.2.3.4"))
    assert guard.client_ip(two, "10.0.0.1", trust_forwarded=True) == "1.2.3.4"
    assert guard.client_ip(request(), "10.0.0.1", trust_forwarded=True) == "10.0.0.1"


def test_cookie() -> None:
    req = request((b"Cookie", b"a=1; session=abc; b=2"))
    assert guard.cookie(req, b"session") == b"abc"
    assert guard.cookie(req, b"sess") is None


def pool_of(**changes: object) -> Pool:
    pool = Pool(clock=lambda: 0.0, rng=random.Random(0))
    pool.set_service(
        parse_settings(
            ServiceRouting, {"name": "svc", "route": RouteConfig(path_prefix="/"), **changes}
        )
    )
    return pool


def test_check_counts_outcomes_and_refuses_with_401() -> None:
    sp = pool_of(auth=AUTH).service("svc")
    guard.check(sp, request((b"Authorization", b"Bearer " + TOKEN)), "/", "1.1.1.1", False, 0.0)
    with pytest.raises(Unauthorized, match="needs a bearer token") as missing:
        guard.check(sp, request(), "/", "1.1.1.1", False, 0.0)
    with pytest.raises(Unauthorized, match="not valid"):
        guard.check(sp, request((b"Authorization", b"Bearer nope")), "/", "1.1.1.1", False, 0.0)
    assert sp.counters == {"auth_ok": 1, "auth_missing": 1, "auth_wrong": 1}
    assert missing.value.status == 401
    assert dict(missing.value.fields)["WWW-Authenticate"].startswith("Bearer")


def test_check_rate_limits_by_prefix_and_key_with_the_draft_fields() -> None:
    limits = [
        {"path_prefix": "/api", "key": "header:X-User", "rps": 1, "burst": 2},
        {"path_prefix": "/", "key": "ip", "rps": 100, "burst": 100},
    ]
    sp = pool_of(rate_limits=limits).service("svc")
    alice = request((b"X-User", b"alice"))
    for _ in range(2):
        guard.check(sp, alice, "/api/x", "1.1.1.1", False, 5.0)
    guard.check(sp, alice, "/other", "1.1.1.1", False, 5.0)  # not under /api
    guard.check(sp, request((b"X-User", b"bob")), "/api/x", "1.1.1.1", False, 5.0)
    with pytest.raises(TooManyRequests) as refused:
        guard.check(sp, alice, "/api/x", "1.1.1.1", False, 5.5)
    error = refused.value
    assert (error.status, error.retry_after) == (429, 1)
    assert dict(error.fields) == {
        "RateLimit-Limit": "2",
        "RateLimit-Remaining": "0",
        "RateLimit-Reset": "2",
        "RateLimit-Policy": "2;w=2",
    }
    assert sp.counters == {"rate_limited": 1}
    guard.check(sp, alice, "/api/x", "1.1.1.1", False, 6.0)  # a token again


def test_a_spoofed_forwarded_for_is_one_key_unless_trusted() -> None:
    sp = pool_of(rate_limits=[{"key": "ip", "rps": 1, "burst": 1}]).service("svc")
    guard.check(sp, request((b"X-Forwarded-For", b"1.0.0.1")), "/", "9.9.9.9", False, 0.0)
    with pytest.raises(TooManyRequests):
        guard.check(sp, request((b"X-Forwarded-For", b"1.0.0.2")), "/", "9.9.9.9", False, 0.0)


def test_long_header_keys_are_kept_as_digests() -> None:
    sp = pool_of(rate_limits=[{"key": "header:x-k", "rps": 1, "burst": 1}]).service("svc")
    for i in range(50):
        guard.check(sp, request((b"x-k", b"%d" % i + b"v" * 10_000)), "/", None, False, 0.0)
    (rule,) = sp.rate_rules()
    assert all(len(key) <= 64 for key in rule.buckets._tat)


def test_the_affinity_key() -> None:
    sp = pool_of(load_balancing="hash", affinity="cookie:sid").service("svc")
    assert guard.check(sp, request((b"Cookie", b"sid=42")), "/", "1.1.1.1", False, 0.0) == b"42"
    assert guard.check(sp, request(), "/", "1.1.1.1", False, 0.0) is None
    sp = pool_of(load_balancing="hash", affinity="ip").service("svc")
    assert guard.check(sp, request(), "/", "1.1.1.1", False, 0.0) == b"1.1.1.1"


def plain_head(block: bytes) -> IncomingRequest:
    """A head with the field lines ``block`` as the reader leaves one ``plainhead`` read:
    the block, the lines kept as they are for the upstream, the Authorization field noted,
    no fields parsed."""
    plain = plainhead.request(b"GET / HTTP/1.1\r\n" + block + b"\r\n\r\n", 16384)
    assert plain is not None
    _, _, raw, kept, _, _, _, _, auth, auth_at = plain[:10]
    req = IncomingRequest(None)
    req.raw_fields = raw
    req.plain_lines = kept
    if auth is not None:
        req.authorization = auth
        req.authorization_at = auth_at
    return req


@pytest.mark.parametrize(
    ("kept", "stripped"),
    [
        (b"Authorization: Bearer t\r\nAccept: */*", b"Accept: */*"),
        (b"Accept: */*\r\nAuthorization: Bearer t", b"Accept: */*"),
        (b"Accept: */*\r\nauthorization: Bearer t\r\nX-A: 1", b"Accept: */*\r\nX-A: 1"),
        (b"Authorization: Bearer t", b""),
        (b"X-Authorization: 1\r\nAuthorization-Info: 2",
         b"X-Authorization: 1\r\nAuthorization-Info: 2"),
    ],
)  # fmt: skip
def test_a_plain_heads_lines_lose_the_token_and_nothing_else(kept: bytes, stripped: bytes) -> None:
    req = plain_head(kept)
    assert req.plain_lines == kept
    guard.strip(req, b"authorization")
    assert req.plain_lines == stripped
    custom = plain_head(kept.replace(b"uthorization", b"pi-key-1234567"))
    guard.strip(custom, b"api-key-1234567")  # a header not noted as read: searched for
    assert custom.plain_lines == stripped.replace(b"uthorization", b"pi-key-1234567")


def test_a_plain_head_is_searched_as_its_block() -> None:
    block = b"Host: h\r\nAUTHORIZATION:   Bearer " + TOKEN + b"  \r\nX-Authorization: no"
    req = plain_head(block)
    assert guard.values(req, b"authorization") == [b"Bearer " + TOKEN]
    assert guard.authenticate(AUTH, req) == ("ok", "tok_1")
    assert req._headers is None  # the fields were never split
    twice = plain_head(block + b"\r\nAuthorization: Bearer " + TOKEN)
    assert guard.authenticate(AUTH, twice) == ("wrong", None)


def test_tokens_are_looked_up_by_digest_as_by_their_hex_form() -> None:
    digest = hashlib.sha256(TOKEN).digest()
    tokens = {digest.hex(): "tok_1", digest.hex().upper(): "tok_2", "not hex": "tok_3"}
    # Only a key a hex digest could equal is kept: the others never matched either.
    assert token_digests(tokens) == {digest: "tok_1"}
