"""HTTP/1.1 on the wire: message heads, body framing and the gateway's own answers.

The proxy speaks HTTP/1.1 on both legs over asyncio protocols (``proxy.http1_downstream`` towards
clients, ``proxy.connector`` towards upstreams), parsed by llhttp through ``httptools``. This module
holds what both legs share: body framing and the serialisation of response heads, including
whole answers the gateway makes itself (an error, a refusal). Header rules are ``headers``.

Headers stay bytes from the parser to the other leg: a value crosses exactly as it arrived,
so an upstream never sees another value than the one the gateway routed on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus
from typing import Final, Protocol

from . import plainhead

CRLF: Final = b"\r\n"
LAST_CHUNK: Final = b"0\r\n\r\n"
CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"

MAX_HEADERS: Final = plainhead.MAX_FIELDS
"""Header fields a head may hold, request or answer (aiohttp's default too): a request with
more is refused with 431, an answer with more is a broken answer."""
HEAD_LIMIT_FACTOR: Final = 4
"""A whole head may hold at most this many times ``max_header_size`` bytes."""

_REASONS: Final = {s.value: s.phrase.encode() for s in HTTPStatus}
STATUS_LINE_START: Final = tuple(b"HTTP/1.1 %d " % code for code in range(1000))
"""``HTTP/1.1 <code> `` by code (llhttp reads three digits; the gateway's own are three too):
joining a head from pieces costs two thirds of formatting it (``proxy.messages.client_head``)."""
_DECIMALS: Final = tuple(b"%d" % n for n in range(1024))
"""Small numbers in decimal, looked up: a Content-Length of a small body costs no string."""
_date_cache: tuple[int, bytes] = (0, b"")


def decimal(n: int) -> bytes:
    """``n`` in decimal digits, as ``b"%d" % n`` writes it."""
    return _DECIMALS[n] if 0 <= n < 1024 else b"%d" % n


def reason(status: int) -> bytes:
    return _REASONS.get(status, b"Unknown")


def http_date() -> bytes:
    """The current time as an IMF-fixdate, computed at most once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode())
    return _date_cache[1]


class Writer(Protocol):
    """What a body is written to: an asyncio transport, in practice."""

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None: ...


def write_body(transport: Writer, data: bytes | memoryview, *, chunked: bool) -> None:
    """Write a piece of a body to ``transport``, as one chunk if ``chunked`` (``data`` is
    never empty: the empty chunk is ``LAST_CHUNK``). A large piece is not copied into a
    chunk: its framing goes around it with ``writelines``."""
    if not chunked:
        transport.write(data)
    elif len(data) < 4096:
        transport.write(b"%x\r\n%b\r\n" % (len(data), bytes(data)))
    else:
        transport.writelines((b"%x\r\n" % len(data), data, CRLF))


def response_head(status: int, phrase: bytes, lines: Sequence[bytes]) -> bytes:
    """A response head: the status line, then ``lines`` (each ``Name: value``)."""
    head = STATUS_LINE_START[status] + phrase + CRLF
    if lines:
        return head + CRLF.join(lines) + b"\r\n\r\n"
    return head + CRLF


def plain_response(
    status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
) -> bytes:
    """A complete response the gateway makes itself, with ``headers`` and ``body`` as given."""
    lines = [b"Content-Length: %d" % len(body), b"Date: " + http_date()]
    lines.extend(f"{k}: {v}".encode("latin-1") for k, v in headers.items())
    if close:
        lines.append(b"Connection: close")
    return response_head(status, reason(status), lines) + body


def json_response(
    status: int,
    body: Mapping[str, object],
    headers: Mapping[str, str] | None = None,
    *,
    close: bool = False,
) -> bytes:
    """A complete response the gateway makes itself, with a JSON body."""
    payload = json.dumps(body, default=str).encode()
    lines = [
        b"Content-Type: application/json; charset=utf-8",
        b"Content-Length: %d" % len(payload),
        b"Date: " + http_date(),
    ]
    if headers:
        lines.extend(f"{k}: {v}".encode("latin-1") for k, v in headers.items())
    if close:
        lines.append(b"Connection: close")
    return response_head(status, reason(status), lines) + payload
