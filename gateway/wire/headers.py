"""Header rules of the proxy: hop-by-hop removal, X-Forwarded-*, X-Request-Id. PURE.

Hop-by-hop headers describe one connection, not the message, so they never cross the proxy
in either direction: the fixed set below plus every header the ``Connection`` header names.
``Expect`` is answered by the gateway itself and is not passed on. A WebSocket upgrade keeps
``Upgrade`` and ``Connection: Upgrade`` (the relay is transparent: the upstream does the
handshake with the client's own ``Sec-WebSocket-*`` fields). Framing (Content-Length,
Transfer-Encoding) is the caller's: each leg is framed on its own.

X-Forwarded-For carries the peer address: appended to the client's value when the client is
a trusted proxy (``trust_forwarded``), replacing it otherwise, so a client cannot forge it.
X-Request-Id is the client's when it is well formed, else a new one; it goes upstream and
comes back on every response. (The one impurity: a new id comes from a random generator.)
A traced request's new id is its trace's (``tracing``), and its traceparent and tracestate
are the gateway's (``trace``), in place of the client's.

Fields are bytes as they came off the wire: a value crosses exactly as it arrived.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from typing import Final

Fields = list[tuple[bytes, bytes]]

HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
"""Lower-cased names that never cross the proxy (RFC 9110 7.6.1, and the old Proxy-*)."""

_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding"})
_TRACE: Final = frozenset({b"traceparent", b"tracestate"})
"""W3C Trace Context: replaced by the gateway's own when it traces (``tracing``)."""
_REQUEST_REWRITTEN: Final = (
    HOP_BY_HOP
    | _FRAMING
    | {b"expect", b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto", b"x-request-id"}
    | _TRACE
)
RESPONSE_DROPPED: Final = HOP_BY_HOP | _FRAMING | {b"x-request-id"}
"""Lower-cased names of an upstream's answer that the client never gets as they are."""
_UPGRADE: Final = frozenset({b"connection", b"upgrade"})
_PLAIN_CONNECTION: Final = frozenset({b"keep-alive", b"close"})
"""Connection values that name no other field: the common case needs no token parsing."""


_DROPPED_LINE: Final = re.compile(
    rb"\r\n("
    + b"|".join(re.escape(name) for name in sorted(RESPONSE_DROPPED))
    + rb"):([^\r\n]*)(?=\r\n)",
    re.IGNORECASE,
)
"""A ``RESPONSE_DROPPED`` field's line with the CRLF before it, its name and its value (with
the spaces around it) captured, in a header block llhttp accepted (strict: the name is
followed by its colon, every line ends with CRLF and holds no other CR or LF). The CRLF it
starts with is a literal prefix the regular expression engine looks for first; the CRLF
after it is left to the next line, which may be dropped too."""

_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""Matched whole (``fullmatch``): ``$`` would also accept a trailing newline."""
_HEX2: Final = tuple(f"{i:02x}" for i in range(256))
_COUNTER_MASK: Final = (1 << 60) - 1
"""Below 2**62, the counter stays a machine integer compiled (``native.py``)."""


class _Ids:
    """New request ids: a random 64-bit prefix per process, then a counter from a random
    start, 32 hex digits like a UUID's. They must be unique, not secret. The counter's last
    byte comes from a table, and the rest is formatted once every 256 ids: formatting each
    id whole cost half as much as the access log line around it, compiled."""

    def __init__(self, prefix: int, start: int) -> None:
        self.prefix = f"{prefix:016x}"
        self.n = start & _COUNTER_MASK
        self.head = self._head(self.n)

    def _head(self, n: int) -> str:
        return f"{self.prefix}{n >> 8:014x}"  # once every 256 ids

    def next(self) -> str:
        n = self.n = (self.n + 1) & _COUNTER_MASK
        low = n & 0xFF
        if low == 0:
            self.head = self._head(n)
        return self.head + _HEX2[low]


_ids: Final = _Ids(random.SystemRandom().getrandbits(64), random.SystemRandom().getrandbits(32))


def request_id(candidate: str | None, made: str | None = None) -> str:
    """The client's X-Request-Id if it is well formed, else ``made`` (the trace's:
    ``tracing``) or a new unique one."""
    if candidate is not None and _REQUEST_ID.fullmatch(candidate):
        return candidate
    return _ids.next() if made is None else made


def connection_tokens(fields: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The lower-cased tokens of every Connection header."""
    tokens: set[bytes] = set()
    for name, value in fields:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    return frozenset(tokens)


def upstream_request(
    fields: Fields,
    *,
    host: bytes,
    peer: str | None,
    request_id: str,
    trust_forwarded: bool,
    websocket: bool = False,
    secure: bool = False,
    drop: bytes | None = None,
    trace: bytes = b"",
) -> list[bytes]:
    """The header lines sent upstream for a client request with ``fields``.

    ``host`` is the client's Host (empty if it sent none: the caller adds one). ``peer`` is
    the client's IP address (None on a Unix socket). ``secure``: it came over TLS
    (X-Forwarded-Proto: https). ``drop``: a field (lower-cased name) that stays here, every
    instance of it: a service's token that is not passed upstream. ``trace``: the gateway's
    traceparent and tracestate lines (``tracing.context``), which replace the client's; empty:
    the client's are passed on as they are.
    """
    lines: list[bytes] = []
    tokens: frozenset[bytes] = frozenset()
    prior: list[bytes] = []
    proto = forwarded_host = False
    for name, value in fields:
        lower = name.lower()
        if lower in _REQUEST_REWRITTEN:
            if lower == b"connection":
                tokens = connection_tokens(fields) - (_UPGRADE if websocket else frozenset())
            elif websocket and lower == b"upgrade":
                lines.append(name + b": " + value)
            elif lower in _TRACE:
                if not trace:
                    lines.append(name + b": " + value)
            elif trust_forwarded:
                if lower == b"x-forwarded-for":
                    prior.append(value)
                elif lower == b"x-forwarded-proto":
                    proto = True
                    lines.append(name + b": " + value)
                elif lower == b"x-forwarded-host":
                    forwarded_host = True
                    lines.append(name + b": " + value)
            continue
        if lower == drop:
            continue
        lines.append(name + b": " + value)
    if tokens and not tokens <= HOP_BY_HOP:
        # Connection may come after the fields it names: filter once all are known (those
        # in HOP_BY_HOP are gone already: "Connection: keep-alive" needs no pass).
        lines = [line for line in lines if line.partition(b":")[0].lower() not in tokens]
    if peer is not None:
        forwarded_for = peer.encode()
        if prior:
            forwarded_for = b", ".join(prior) + b", " + forwarded_for
        lines.append(b"X-Forwarded-For: " + forwarded_for)
    elif prior:
        lines.append(b"X-Forwarded-For: " + b", ".join(prior))
    if not proto:
        lines.append(b"X-Forwarded-Proto: https" if secure else b"X-Forwarded-Proto: http")
    if not forwarded_host and host:
        lines.append(b"X-Forwarded-Host: " + host)
    lines.append(b"X-Request-Id: " + request_id.encode())
    if trace:
        lines.append(trace)
    if websocket:
        lines.append(b"Connection: Upgrade")
    return lines


def plain_upstream_request(
    kept: bytes,
    *,
    host: bytes,
    peer: str | None,
    request_id: str,
    secure: bool = False,
    trace: bytes = b"",
) -> list[bytes]:
    """``upstream_request`` for a plain head (``plainhead.request``), from its lines that go
    upstream as they are (``kept``): the same lines, when it holds no X-Forwarded-* field to
    trust (its Connection field names nothing but keep-alive or close, and no upgrade).

    One item, all the lines: made in one join of their pieces (a line each cost a bytes
    object made, then joined again)."""
    pieces = [kept, b"\r\n"] if kept else []
    if peer is not None:
        pieces += (b"X-Forwarded-For: ", peer.encode(), b"\r\n")
    pieces.append(b"X-Forwarded-Proto: https\r\n" if secure else b"X-Forwarded-Proto: http\r\n")
    if host:
        pieces += (b"X-Forwarded-Host: ", host, b"\r\n")
    pieces += (b"X-Request-Id: ", request_id.encode())
    if trace:
        pieces += (b"\r\n", trace)
    return [b"".join(pieces)]


ResponseFields = tuple[bytes, int | None, bool, Fields]
"""An upstream answer's header block sorted out (``response_fields``): the end-to-end fields
(the block's lines but those of ``RESPONSE_DROPPED`` fields), Content-Length, whether it is
chunked, and its Connection and Upgrade fields (what a 101 passes on, what Connection
names). A plain tuple: one is made per answer, and a named tuple's ``__new__`` is Python."""


COMPILED: Final = not __file__.endswith(".py")
"""Whether this module runs compiled with mypyc (``native.py``): ``response_fields`` takes
the way that is faster there."""


def response_fields(block: bytes) -> ResponseFields:
    """Sort out an answer's header block: its lines as llhttp accepted them, CRLF-separated.

    Two ways give the same result (the tests hold them to it): compiled, a loop over the
    block's bytes (``_scan_fields``); interpreted, one split by a regular expression
    (``_split_fields``). Each takes less than half the time of the other way where it runs.
    """
    if COMPILED:
        return _scan_fields(block)
    return _split_fields(block)


def _split_fields(block: bytes) -> ResponseFields:
    """One split by a regular expression over the whole block finds the few fields the proxy
    reads or drops (most answers: Content-Length, perhaps Connection), and leaves the kept
    lines between them, with their CRLFs: joined, they are the block without the dropped.
    """
    parts = _DROPPED_LINE.split(b"\r\n" + block + b"\r\n")
    if len(parts) == 1:
        return block, None, False, []
    content_length = None
    chunked = False
    hop: Fields = []
    for i in range(1, len(parts), 3):  # kept, name, value, kept, name, value, ..., kept
        name = parts[i]
        lower = name.lower()
        if lower == b"content-length":
            content_length = int(parts[i + 1])  # llhttp checked it is a number, and one
        elif lower == b"transfer-encoding":
            chunked = True
        elif lower == b"connection" or lower == b"upgrade":
            hop.append((name, parts[i + 1].strip(b" \t")))
    kept = b"".join(parts[::3])
    # Every line dropped leaves b"\r\n": an inverted slice, which mypyc refuses (SystemError).
    return (kept[2:-2] if len(kept) > 4 else b""), content_length, chunked, hop


_DROPPED_NAMES: Final = tuple(sorted(RESPONSE_DROPPED))
_CONTENT_LENGTH: Final = _DROPPED_NAMES.index(b"content-length")
_TRANSFER_ENCODING: Final = _DROPPED_NAMES.index(b"transfer-encoding")
_CONNECTION: Final = _DROPPED_NAMES.index(b"connection")
_UPGRADE_NAME: Final = _DROPPED_NAMES.index(b"upgrade")
_COLON: Final = 58
_CR: Final = 13


def _scan_fields(block: bytes) -> ResponseFields:
    """A pass over the block's bytes, line by line; only the dropped lines and the runs of
    kept lines between them are sliced out. Compiled, the loop is C on machine integers,
    where each call of a ``bytes`` method (``find``, ``split``) costs as much as a line."""
    content_length: int | None = None
    chunked = False
    hop: Fields = []
    kept: list[bytes] = []
    n = len(block)
    start = 0  # of the line
    run = 0  # start of the run of kept lines the line ends, if it is dropped
    while start < n:
        colon = start
        while colon < n and block[colon] != _COLON and block[colon] != _CR:
            colon += 1
        end = colon
        while end < n and block[end] != _CR:
            end += 1
        which = _dropped_name(block, start, colon) if colon < end else -1
        if which >= 0:
            if start > run:
                kept.append(block[run : start - 2])
            run = end + 2
            if which == _CONTENT_LENGTH:
                content_length = _digits(block, colon + 1, end)
            elif which == _TRANSFER_ENCODING:
                chunked = True
            elif which == _CONNECTION or which == _UPGRADE_NAME:
                hop.append((block[start:colon], block[colon + 1 : end].strip(b" \t")))
        start = end + 2
    if run == 0:
        return block, None, False, []
    if run < n:
        kept.append(block[run:])
    return (kept[0] if len(kept) == 1 else b"\r\n".join(kept)), content_length, chunked, hop


def _dropped_name(block: bytes, start: int, end: int) -> int:
    """The index in ``_DROPPED_NAMES`` of the name ``block[start:end]``, or -1.

    Each byte is compared ORed with 0x20, which lowers a letter. No other byte becomes a
    letter or ``-`` (all these names hold) that way, but CR, which never is in a name."""
    length = end - start
    for i in range(len(_DROPPED_NAMES)):
        name = _DROPPED_NAMES[i]
        if len(name) == length:
            k = 0
            while k < length and (block[start + k] | 0x20) == name[k]:
                k += 1
            if k == length:
                return i
    return -1


def _digits(block: bytes, at: int, end: int) -> int:
    """The number in ``block[at:end]``: llhttp checked it is digits between spaces."""
    value = 0
    while at < end:
        c = block[at]
        if 48 <= c <= 57:
            value = value * 10 + c - 48
        at += 1
    return value


def names_fields(hop: Fields) -> bool:
    """Whether a Connection field among ``hop`` may name other fields (to drop): any value
    but the plain ``keep-alive`` or ``close``."""
    for _, value in hop:
        # The usual spelling first: a comparison, where lowering makes a copy.
        if value != b"keep-alive" and value != b"close" and value.lower() not in _PLAIN_CONNECTION:
            return True
    return False


def client_response(
    kept: bytes, hop: Fields, request_id: str, *, upgrade: bool = False
) -> list[bytes]:
    """The header lines returned to the client for an upstream answer.

    ``kept`` are the answer's end-to-end fields (the block ``response_fields`` keeps),
    ``hop`` its Connection and Upgrade fields. Fields the Connection header names are
    dropped; ``upgrade`` (a 101) keeps Connection and Upgrade. Framing is the caller's. An
    item of the list may hold several lines.
    """
    if not upgrade and names_fields(hop):
        tokens = connection_tokens(hop)
        out = [
            line for line in kept.split(b"\r\n") if line.partition(b":")[0].lower() not in tokens
        ]
    else:
        out = [kept] if kept else []
    if upgrade:
        out.extend(name + b": " + value for name, value in hop)
    out.append(b"X-Request-Id: " + request_id.encode())
    return out
