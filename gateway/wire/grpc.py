"""gRPC on the wire, as far as a proxy needs it (gRPC over HTTP/2, grpc/grpc's PROTOCOL-HTTP2):
which requests are gRPC, their deadline (``grpc-timeout``), the status an answer carries
(``status``), the status codes of the gateway's own answers, and trailers-only answers (a
HEADERS frame with ``:status`` 200, ``content-type``, ``grpc-status`` and ``grpc-message``,
then END_STREAM).

Pure: no I/O, no gRPC or HTTP/2 library; the codecs and the upstream leg call it.
"""

from __future__ import annotations

from typing import Final

Fields = list[tuple[bytes, bytes]]

OK: Final = 0
DEADLINE_EXCEEDED: Final = 4
RESOURCE_EXHAUSTED: Final = 8
UNIMPLEMENTED: Final = 12
INTERNAL: Final = 13
UNAVAILABLE: Final = 14
UNAUTHENTICATED: Final = 16
UNKNOWN: Final = 2

_BY_HTTP_STATUS: Final = {
    400: INTERNAL,
    401: UNAUTHENTICATED,
    403: UNAUTHENTICATED,
    404: UNIMPLEMENTED,
    408: DEADLINE_EXCEEDED,
    413: RESOURCE_EXHAUSTED,
    429: RESOURCE_EXHAUSTED,
    431: INTERNAL,
    502: UNAVAILABLE,
    503: UNAVAILABLE,
    504: DEADLINE_EXCEEDED,
}
"""The gateway's own answers as gRPC statuses: gRPC's HTTP-to-status mapping, but for rate
limits and body limits (RESOURCE_EXHAUSTED), auth (UNAUTHENTICATED) and timeouts
(DEADLINE_EXCEEDED), which say more to a gRPC client than UNAVAILABLE would."""

_CODES: Final = {b"%d" % code: str(code) for code in range(17)}
"""The codes gRPC defines (OK 0 to UNAUTHENTICATED 16), as a ``grpc-status`` value -> as text."""

_UNITS: Final = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def is_grpc(fields: Fields) -> bool:
    """Whether a request's fields (lower-cased names, as HTTP/2 has them) say gRPC:
    ``content-type: application/grpc`` or ``application/grpc+...``/``;...``."""
    for name, value in fields:
        if name == b"content-type":
            return value.startswith(b"application/grpc")
    return False


def timeout(fields: Fields) -> float | None:
    """The request's ``grpc-timeout`` in seconds (1 to 8 digits and a unit), None if it has
    none or one not well formed (then it is ignored, as gRPC's servers do)."""
    for name, value in fields:
        if name == b"grpc-timeout":
            digits, unit = value[:-1], value[-1:]
            if not 1 <= len(digits) <= 8 or not digits.isdigit() or unit not in _UNITS:
                return None
            return int(digits) * _UNITS[unit]
    return None


def status(fields: Fields) -> str | None:
    """The ``grpc-status`` of an answer's trailers or trailers-only head (lower-cased names),
    as a gRPC client reads it: its code as text, ``"2"`` (UNKNOWN) for a value that is no
    code gRPC defines; None if it has none."""
    for name, value in fields:
        if name == b"grpc-status":
            return _CODES.get(value.strip(), "2")
    return None


def status_of(http_status: int) -> int:
    """The gRPC status of one of the gateway's own answers, by its HTTP status."""
    return _BY_HTTP_STATUS.get(http_status, UNKNOWN)


def encode_message(message: str) -> bytes:
    """``grpc-message``'s form: UTF-8, percent-encoded outside printable ASCII and for ``%``."""
    out = bytearray()
    for byte in message.encode():
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def status_fields(status: int, message: str) -> Fields:
    """The ``grpc-status`` and ``grpc-message`` fields (trailers, or in a trailers-only
    answer)."""
    fields: Fields = [(b"grpc-status", b"%d" % status)]
    if message:
        fields.append((b"grpc-message", encode_message(message)))
    return fields


def trailers_only(status: int, message: str, request_id: bytes = b"") -> Fields:
    """A whole gRPC answer with no message: HTTP 200 and the status in its one HEADERS."""
    fields: Fields = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    if request_id:
        fields.append((b"x-request-id", request_id))
    return fields + status_fields(status, message)
