"""HTTP/1.1 on the wire: message heads, body framing and the gateway's own answers. PURE.

The proxy speaks HTTP/1.1 on both legs over asyncio protocols (``downstream`` towards
clients, ``connector`` towards upstreams), parsed by llhttp through ``httptools``. This module
holds what both legs share: header names as lower-cased bytes, the hop-by-hop set, chunk
framing and the serialisation of a response the gateway makes itself (an error, a refusal).

Headers stay bytes from the parser to the other leg: a value crosses exactly as it arrived,
so an upstream never sees another value than the one the gateway routed on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from http import HTTPStatus

RawHeaders = list[tuple[bytes, bytes]]
"""Header fields in arrival order, names as sent (case kept), values as sent."""

CRLF = b"\r\n"
LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_date_cache: tuple[int, bytes] = (0, b"")


def reason(status: int) -> bytes:
    return _REASONS.get(status, b"Unknown")


def http_date() -> bytes:
    """The current time as an IMF-fixdate, computed at most once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode())
    return _date_cache[1]


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (never the empty last chunk)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def response_head(status: int, phrase: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    lines = [b"HTTP/1.1 %d %b" % (status, phrase)]
    for name, value in headers:
        lines.append(name + b": " + value)
    lines.append(CRLF)
    return CRLF.join(lines)


def json_response(
    status: int,
    body: Mapping[str, object],
    headers: Mapping[str, str] | None = None,
    *,
    close: bool = False,
) -> bytes:
    """A complete response the gateway makes itself, with a JSON body."""
    payload = json.dumps(body, default=str).encode()
    fields: list[tuple[bytes, bytes]] = [
        (b"Content-Type", b"application/json; charset=utf-8"),
        (b"Content-Length", b"%d" % len(payload)),
        (b"Date", http_date()),
    ]
    if headers:
        fields.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
    if close:
        fields.append((b"Connection", b"close"))
    return response_head(status, reason(status), fields) + payload
