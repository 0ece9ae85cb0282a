"""HTTP/2 fields on the wire, as the inbound HTTP/2 codec (``proxy.h2_downstream``) writes
them: the connection preface, and an answer's fields made of the lines HTTP/1.1's rules give.

Framing, HPACK and flow control are ``h2_session``'s; this module only turns the header
lines ``headers`` and ``http1`` make (the one place their rules live) into HTTP/2 fields:
names lower-cased, the connection-specific ones (RFC 9113 8.2.2) left out, ``:status``
first; and counts the control frames among those written (``control_frames``). The
HTTP/1.1 listener reads ``PREFACE`` from it.
"""

from __future__ import annotations

from collections import deque
from typing import Final

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What an HTTP/2 client sends first (RFC 9113 3.4): on the plain listener, an HTTP/2
connection by prior knowledge (h2c)."""

RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PING: Final = 0x6
"""The control frames (Envoy's ``max_outbound_control_frames``): what a peer makes the
gateway write without asking for an answer (acknowledgements, and resets)."""

CONNECTION_SPECIFIC: Final = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
"""Fields an HTTP/2 message must not carry (RFC 9113 8.2.2)."""

Fields = list[tuple[bytes, bytes]]


def answer_fields(status: int, lines: list[bytes]) -> Fields:
    """An answer's HTTP/2 fields: ``:status``, then ``lines`` (``Name: value`` lines of an
    HTTP/1.1 head; an item may hold several, joined with CRLF) with lower-cased names and
    without the connection-specific ones."""
    fields: Fields = [(b":status", b"%d" % status)]
    for item in lines:
        for line in item.split(b"\r\n"):
            name, colon, value = line.partition(b":")
            if not colon:
                continue
            name = name.strip().lower()
            if name in CONNECTION_SPECIFIC:
                continue
            fields.append((name, value.strip()))
    return fields


def split_answer(data: bytes) -> tuple[int, Fields, bytes]:
    """A whole HTTP/1.1 answer the gateway made itself (``http1.json_response``,
    ``messages.gateway_error_response``) as HTTP/2 status, fields and body: its answers are
    made once, in HTTP/1.1's bytes, and told in HTTP/2 from them."""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, _, rest = head.partition(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    return status, answer_fields(status, [rest] if rest else []), body


def request_fields(lines: list[bytes], scheme: bytes = b"http") -> Fields:
    """A request head made for HTTP/1.1 (``messages.upstream_head``: its request line, then
    ``Name: value`` lines, an item possibly holding several) as HTTP/2 fields for the upstream
    leg: the pseudo-fields first (``:authority`` from Host), names lower-cased, the
    connection-specific ones left out, and ``te: trailers`` (which gRPC servers require; the
    client's TE is hop-by-hop and was dropped)."""
    method, target, _ = lines[0].split(b" ", 2)
    authority = b""
    rest: Fields = []
    for item in lines[1:]:
        for line in item.split(b"\r\n"):
            name, colon, value = line.partition(b":")
            if not colon:
                continue
            name = name.strip().lower()
            if name == b"host":
                authority = value.strip()
            elif name not in CONNECTION_SPECIFIC and name != b"te":
                rest.append((name, value.strip()))
    fields: Fields = [
        (b":method", method),
        (b":scheme", scheme),
        (b":authority", authority),
        (b":path", target),
    ]
    fields += rest
    fields.append((b"te", b"trailers"))
    return fields


def take(out: deque[bytes], size: int) -> bytes:
    """At most ``size`` bytes from the front of the chunks queued in ``out``, taken off it:
    what one DATA frame carries within the windows."""
    chunk = out[0]
    if len(chunk) > size:
        out[0] = chunk[size:]
        return chunk[:size]
    out.popleft()
    return chunk


def control_frames(data: bytes) -> int:
    """How many of the whole frames ``data`` holds (frames as ``h2_session`` writes them, one after
    the other) are control frames: RST_STREAM, SETTINGS or PING."""
    count = 0
    at = 0
    size = len(data)
    while at + 9 <= size:
        kind = data[at + 3]
        if kind == RST_STREAM or kind == SETTINGS or kind == PING:
            count += 1
        at += 9 + int.from_bytes(data[at : at + 3], "big")
    return count
