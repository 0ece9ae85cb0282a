"""The header block of an upstream's answer, sorted out in one pass (``headers.response_fields``).

Both ways of it (a regular expression's split, a loop over the bytes) must see exactly the
fields a per-line reading sees: a dropped field that slipped through would reach the client
(a second framing, a hop-by-hop field), a kept one taken out would be lost. The reference
below reads line by line. Each way is tested here whichever runs (``headers.COMPILED``).

New request ids are made from a table a byte at a time: they must count on across every byte.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from gateway.wire import headers
from gateway.wire.headers import (
    RESPONSE_DROPPED,
    _Ids,
    client_response,
    names_fields,
    request_id,
    response_fields,
)

Sort = Callable[[bytes], headers.ResponseFields]
WAYS = pytest.mark.parametrize("sort", [headers._scan_fields, headers._split_fields])


def reference(block: bytes) -> tuple[bytes, int | None, bool, list[tuple[bytes, bytes]]]:
    kept, length, chunked, hop = [], None, False, []
    for line in block.split(b"\r\n") if block else []:
        name, _, value = line.partition(b":")
        value = value.strip(b" \t")
        lower = name.lower()
        if lower not in RESPONSE_DROPPED:
            kept.append(line)
        elif lower == b"content-length":
            length = int(value)
        elif lower == b"transfer-encoding":
            chunked = True
        elif lower in (b"connection", b"upgrade"):
            hop.append((name, value))
    return b"\r\n".join(kept), length, chunked, hop


@WAYS
def test_a_typical_answer_keeps_its_end_to_end_fields_in_order(sort: Sort) -> None:
    block = (
        b"Server: nginx\r\nDate: Thu, 03 Dec 2026 12:00:00 GMT\r\nContent-Type: text/plain\r\n"
        b"Content-Length: 13\r\nConnection: keep-alive"
    )

    kept, length, chunked, hop = sort(block)

    assert kept == (
        b"Server: nginx\r\nDate: Thu, 03 Dec 2026 12:00:00 GMT\r\nContent-Type: text/plain"
    )
    assert length == 13
    assert not chunked
    assert hop == [(b"Connection", b"keep-alive")]


@pytest.mark.parametrize(
    "block",
    [
        b"",
        b"Content-Length: 0",
        b"content-LENGTH:7\r\nX-A: 1",
        b"X-A: 1\r\nTransfer-Encoding:  chunked \r\nX-B: 2",
        b"X-Request-Id: forged\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nTrailer: X",
        b"Tee: kept\r\nConnection-Id: kept\r\nUpgraded: kept\r\nX-Content-Length: kept",
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: x",
        b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nProxy-Authenticate: Basic\r\nX-Empty:",
        b"X-Value: Content-Length: 5",
        b"Content-Length: 12345678901234567890123",
        b"Connection: close\r\nX-A: 1",
        b"X-A: 1\r\nConnection: close",
        b"TE: a\r\nTE: b",
        b"Keep-Alive: 1\r\nX-A: 1\r\nX-B: 2\r\nUpgrade: h2c\r\nX-C: 3",
        b"Te^: kept\r\n_e: kept\r\nUpgrade_: kept\r\nX~Request-Id: kept",
    ],
)
@WAYS
def test_it_agrees_with_a_reading_line_by_line(sort: Sort, block: bytes) -> None:
    assert sort(block) == reference(block)


@WAYS
def test_it_agrees_on_random_blocks(sort: Sort) -> None:
    rng = random.Random(8)
    names = [
        *(name.decode() for name in RESPONSE_DROPPED),
        "server",
        "x-a",
        "tee",
        "connectionx",
        "content-lengths",
        "content-lengtg",
        "set-cookie",
    ]
    for _ in range(500):
        lines = []
        for _ in range(rng.randrange(0, 8)):
            name = "".join(c.upper() if rng.random() < 0.3 else c for c in rng.choice(names))
            value = str(rng.randrange(100)) if name.lower() == "content-length" else "v x"
            lines.append(f"{name}:{rng.choice(['', ' ', '  '])}{value}".encode())
        if sum(line.lower().startswith(b"content-length:") for line in lines) > 1:
            continue  # llhttp refuses the head before it is read
        block = b"\r\n".join(lines)
        assert sort(block) == reference(block), block


@pytest.mark.parametrize(
    ("value", "names"),
    [
        (b"keep-alive", False),
        (b"close", False),
        (b"Keep-Alive", False),
        (b"CLOSE", False),
        (b"close, X-Hop", True),
        (b"keep-alive, close", True),
        (b"X-Hop", True),
        (b"upgrade", True),
    ],
)
def test_only_a_connection_field_other_than_keep_alive_or_close_may_name_fields(
    value: bytes, names: bool
) -> None:
    assert names_fields([(b"Connection", value)]) is names
    assert names_fields([(b"Connection", b"keep-alive"), (b"Connection", value)]) is names


def test_client_response_drops_what_connection_names_and_adds_the_request_id() -> None:
    kept, _, _, hop = response_fields(b"X-Hop: 1\r\nX-End: 2\r\nConnection: close, X-Hop")

    lines = client_response(kept, hop, "id-1")

    assert lines == [b"X-End: 2", b"X-Request-Id: id-1"]


def test_client_response_keeps_connection_and_upgrade_on_a_101() -> None:
    block = b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: a"
    kept, _, _, hop = response_fields(block)

    lines = client_response(kept, hop, "id-2", upgrade=True)

    assert lines == [
        b"Sec-WebSocket-Accept: a",
        b"Upgrade: websocket",
        b"Connection: Upgrade",
        b"X-Request-Id: id-2",
    ]


@pytest.mark.parametrize("start", [0, 250, (1 << 60) - 3, (1 << 64) - 1])
def test_new_request_ids_are_unique_and_count_across_every_byte(start: int) -> None:
    ids = _Ids(0xABCDEF, start)
    made = [ids.next() for _ in range(600)]
    assert len(set(made)) == len(made)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in made)
    assert {i[:16] for i in made} == {"0000000000abcdef"}
    counters = [int(i[16:], 16) for i in made]
    first = ((start & ((1 << 60) - 1)) + 1) & ((1 << 60) - 1)
    assert counters == [(first + k) & ((1 << 60) - 1) for k in range(600)]


def test_a_well_formed_request_id_is_kept_and_a_bad_one_replaced() -> None:
    assert request_id("abc-123") == "abc-123"
    for bad in (None, "", "a b", "x" * 129, "id\n"):
        new = request_id(bad)
        assert new != bad
        assert len(new) == 32
    assert request_id(None) != request_id(None)
