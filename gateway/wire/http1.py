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

_REASONS: Final = {
    100: b"Continue",
    101: b"Switching Protocols",
    102: b"Processing",
    103: b"Early Hints",
    200: b"OK",
    201: b"Created",
    202: b"Accepted",
    203: b"Non-Authoritative Information",
    204: b"No Content",
    205: b"Reset Content",
    206: b"Partial Content",
    207: b"Multi-Status",
    208: b"Already Reported",
    226: b"IM Used",
    300: b"Multiple Choices",
    301: b"Moved Permanently",
    302: b"Found",
    303: b"See Other",
    304: b"Not Modified",
    305: b"Use Proxy",
    307: b"Temporary Redirect",
    308: b"Permanent Redirect",
    400: b"Bad Request",
    401: b"Unauthorized",
    402: b"Payment Required",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    406: b"Not Acceptable",
    407: b"Proxy Authentication Required",
    408: b"Request Timeout",
    409: b"Conflict",
    410: b"Gone",
    411: b"Length Required",
    412: b"Precondition Failed",
    413: b"Request Entity Too Large",
    414: b"Request-URI Too Long",
    415: b"Unsupported Media Type",
    416: b"Requested Range Not Satisfiable",
    417: b"Expectation Failed",
    418: b"I'm a Teapot",
    421: b"Misdirected Request",
    422: b"Unprocessable Entity",
    423: b"Locked",
    424: b"Failed Dependency",
    425: b"Too Early",
    426: b"Upgrade Required",
    428: b"Precondition Required",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    451: b"Unavailable For Legal Reasons",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
    506: b"Variant Also Negotiates",
    507: b"Insufficient Storage",
    508: b"Loop Detected",
    510: b"Not Extended",
    511: b"Network Authentication Required",
}
"""Reason phrases by status code: ``http.HTTPStatus``'s of Python 3.11, written out so that
a worker does not import ``http``, whose enum of 62 members it would hold only to read this."""
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
