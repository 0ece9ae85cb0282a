"""Hostile clients against a service's auth and rate limits (issue 28).

- Oversized and malformed tokens: 401 at once (a token over 1 KiB is not even hashed), 431
  past the header limit; nothing reaches the upstream, which never sees a token.
- Spoofed X-Forwarded-For (many values, many fields, garbage, huge): the bucket is the socket
  peer's; with ``trust_forwarded`` only the last hop counts.
- A million distinct rate-limit keys: the table stays at its cap, memory bounded.
- A wrong token's check takes as long whether none, half or all but its last byte is right:
  what is compared is its SHA-256, which a near miss does not bring nearer.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import replace

import pytest

from gateway.config import AuthRouting, RateLimit, RouteConfig, ServiceRouting
from gateway.pool.pool import Pool
from gateway.pool.ratelimit import MAX_KEYS
from gateway.proxy import guard
from gateway.proxy.request import IncomingRequest
from tests.gateway.conftest import routing

from .conftest import MiB, rss, send_raw

TOKEN = b"tok-" + bytes(random.Random(28).choice(b"abcdefghijklmnop") for _ in range(40))
DIGEST = hashlib.sha256(TOKEN).hexdigest()


@pytest.fixture
async def guarded(pool, recording, gateway):
    base = routing("web", prefix="/")
    pool.set_service(
        replace(
            base,
            auth=AuthRouting(tokens={DIGEST: "tok_1"}),
            rate_limits=(RateLimit(path_prefix="/limited", key="ip", rps=0.01, burst=2),),
        )
    )
    rec = await recording("web", "u1")
    return await gateway(), rec


def get(path: bytes, *fields: bytes) -> bytes:
    return (
        b"GET "
        + path
        + b" HTTP/1.1\r\nHost: h\r\n"
        + b"".join(f + b"\r\n" for f in fields)
        + (b"Connection: close\r\n\r\n")
    )


@pytest.mark.parametrize(
    "field",
    [
        b"Authorization: Bearer " + b"A" * 1025,  # over MAX_TOKEN: wrong, unhashed
        b"Authorization: Bearer " + b"A" * 15_000,  # under the header limit
        b"Authorization: Bearer " + TOKEN + b"\x00",  # llhttp refuses NUL: 400
        b"Authorization: Bearer " + TOKEN[:-1],
        b"Authorization: Basic " + TOKEN,
        b"Authorization: Bearer",
        b"Authorization:    ",
        b"Authorization: bearer " + TOKEN.upper(),
    ],
)
async def test_malformed_and_oversized_tokens_are_refused(guarded, field):
    gw, rec = guarded
    began = time.monotonic()
    answer = await send_raw(gw.port, get(b"/", field))
    assert answer.status in (400, 401), answer.data[:200]
    if answer.status == 401:
        assert b"WWW-Authenticate: Bearer" in answer.data
    assert time.monotonic() - began < 1.0
    assert rec.requests == []


async def test_past_the_header_limit_is_431_and_the_upstream_sees_nothing(guarded):
    gw, rec = guarded
    answer = await send_raw(gw.port, get(b"/", b"Authorization: Bearer " + b"A" * 20_000))
    assert answer.status == 431
    assert rec.requests == []


async def test_the_upstream_never_sees_the_token(guarded):
    gw, rec = guarded
    fields = (b"Authorization: Bearer " + TOKEN, b"authorization: Bearer x")
    answer = await send_raw(gw.port, get(b"/x", *fields))
    assert answer.status == 401  # twice: refused, whichever is right
    answer = await send_raw(gw.port, get(b"/x", fields[1], fields[0]))
    assert answer.status == 401
    answer = await send_raw(gw.port, get(b"/x", fields[0]))
    assert answer.status == 200
    (received,) = rec.requests
    assert received.header(b"authorization") == []
    assert TOKEN not in received.head


@pytest.mark.parametrize(
    "spoof",
    [
        [b"X-Forwarded-For: 10.%d.0.1"],
        [b"X-Forwarded-For: 10.%d.0.1, 10.0.0.2", b"X-Forwarded-For: 10.%d.9.9"],
        [b"X-Forwarded-For: " + b"9" * 8000 + b"%d"],
        [b"X-Forwarded-For: , , ,%d"],
        [b"Forwarded: for=10.%d.0.1", b"X-Real-Ip: 10.%d.0.1"],
    ],
)
async def test_spoofed_forwarded_for_does_not_dodge_a_limit(guarded, spoof):
    gw, _ = guarded
    auth = b"Authorization: Bearer " + TOKEN
    statuses = []
    for i in range(6):
        fields = [f.replace(b"%d", str(i).encode()) for f in spoof]
        statuses.append((await send_raw(gw.port, get(b"/limited", auth, *fields))).status)
    assert statuses == [200, 200, 429, 429, 429, 429]


def test_a_million_distinct_keys_keep_memory_bounded():
    pool = Pool(clock=lambda: 0.0, rng=random.Random(0))
    pool.set_service(
        ServiceRouting(
            name="svc",
            route=RouteConfig(path_prefix="/"),
            rate_limits=(RateLimit(key="header:x-key", rps=1, burst=1),),
        )
    )
    sp = pool.service("svc")
    request = IncomingRequest([(b"x-key", b"")])
    (rule,) = sp.rate_rules()
    before = rss()
    for i in range(1_000_000):
        # Keys of 64 bytes are kept as they are (longer ones as digests): the worst case.
        request.headers[0] = (b"x-key", b"%064d" % i)
        guard.check(sp, request, "/", None, False, i * 1e-6)
        if i == 500_000:
            halfway = rss()
    after = rss()
    assert len(rule.buckets) == MAX_KEYS
    assert rule.buckets.evicted == 1_000_000 - MAX_KEYS
    # The cap's worth of keys costs some megabytes (the table's dict grows to twice the cap
    # between its compactions); from then on, half a million more keys cost nothing more.
    assert halfway - before < 48 * MiB, (before, halfway)
    assert after - halfway < 2 * MiB, (before, halfway, after)


def test_a_wrong_tokens_check_time_does_not_depend_on_how_much_is_right():
    auth = AuthRouting(tokens={DIGEST: "tok_1"})
    n = len(TOKEN)
    guesses = {
        "none right": bytes(b ^ 0x01 for b in TOKEN),
        "half right": TOKEN[: n // 2] + bytes(b ^ 0x01 for b in TOKEN[n // 2 :]),
        "all but the last byte": TOKEN[:-1] + bytes([TOKEN[-1] ^ 0x01]),
    }
    requests = {
        k: IncomingRequest([(b"Authorization", b"Bearer " + v)]) for k, v in guesses.items()
    }
    for request in requests.values():
        assert guard.authenticate(auth, request) == ("wrong", None)
    # What is compared is the digest: a near miss's shares no longer a prefix with the real
    # one than a random guess's does.
    for guess in guesses.values():
        digest = hashlib.sha256(guess).hexdigest()
        common = len(digest) - len(digest.lstrip(DIGEST[0])) if digest[0] == DIGEST[0] else 0
        assert common <= 4
    times: dict[str, list[float]] = {k: [] for k in guesses}
    # Many short rounds, interleaved, each class's fastest taken: the box is shared, and other
    # work only ever slows a round down, never speeds one up.
    for _ in range(300):
        for name, request in requests.items():
            began = time.perf_counter()
            for _ in range(200):
                guard.authenticate(auth, request)
            times[name].append(time.perf_counter() - began)
    fastest = {k: min(v) for k, v in times.items()}
    assert max(fastest.values()) < 1.1 * min(fastest.values()), fastest
