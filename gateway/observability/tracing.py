"""W3C Trace Context propagation: ``traceparent`` and ``tracestate``. PURE (but for the random
ids and the sampling decision).

Each request the gateway forwards is a hop of a trace. Its ``traceparent`` (version 00:
``00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>``, lower-case hex) is read
(``parse``): a valid one keeps its trace id and its sampled flag; the gateway's hop gets a
new span id, sent upstream as the parent id of a new ``traceparent`` that replaces the
client's. A request without one, or with one that is not valid (upper-case hex, an all-zero
id, version ``ff``, a version 00 header of another length, more than one header), starts a
new trace: a new trace id, and the sampled flag set for ``sample_ratio`` of them. A version
above 00 is read by its prefix, as the specification asks (its first four fields, then
nothing or a ``-``), and forwarded as version 00.

``tracestate`` goes upstream unchanged with a valid ``traceparent`` (several headers joined
with ``,``), if it is within the specification's bounds (``MAX_TRACESTATE`` characters,
``MAX_MEMBERS`` list members); otherwise, and with a new trace, it is dropped.

The request id is ``<trace-id>-<span-id>`` (``request_id``): unique for each request (a
trace holds many) and found by the trace id in the access log and the gateway's error
bodies. With spans recorded (``spans``), that span id is the server span's, and each
attempt upstream is sent with its own client span's id as the parent (``with_parent``).
"""

from __future__ import annotations

import random
from typing import Final

MAX_TRACESTATE: Final = 512
"""Characters of a combined ``tracestate`` forwarded at most (the specification: at least 512
are propagated); a longer one is dropped."""
MAX_MEMBERS: Final = 32
"""List members a ``tracestate`` may hold (the specification's limit); more: dropped."""

_HEX: Final = frozenset(b"0123456789abcdef")
_DASH: Final = 45
_ZERO_TRACE: Final = b"0" * 32
_ZERO_SPAN: Final = b"0" * 16

Context = tuple[str, bytes]
"""A request's trace context as the gateway forwards it: its request id
(``<trace-id>-<span-id>``, the gateway's hop), and the header lines sent upstream
(``traceparent``, then ``tracestate`` if any; CRLF between them, none after)."""


def _hex(value: bytes, start: int, end: int) -> bool:
    """Whether ``value[start:end]`` is lower-case hex digits only."""
    i = start
    while i < end:
        if value[i] not in _HEX:
            return False
        i += 1
    return True


def parse(traceparent: bytes | None) -> tuple[bytes, int] | None:
    """A valid ``traceparent``'s trace id and flags; None if there is none or it is invalid
    (then a new trace begins)."""
    if traceparent is None:
        return None
    value = traceparent.strip(b" \t")
    n = len(value)
    if n < 55 or value[2] != _DASH or value[35] != _DASH or value[52] != _DASH:
        return None
    if not _hex(value, 0, 2) or value[:2] == b"ff":
        return None
    if value[:2] == b"00":
        if n != 55:
            return None
    elif n > 55 and value[55] != _DASH:
        return None  # a future version: its four first fields, then more after a dash
    if not _hex(value, 3, 35) or not _hex(value, 36, 52) or not _hex(value, 53, 55):
        return None
    trace_id = value[3:35]
    if trace_id == _ZERO_TRACE or value[36:52] == _ZERO_SPAN:
        return None
    return trace_id, int(value[53:55], 16)


def tracestate_kept(tracestate: bytes | None) -> bytes | None:
    """``tracestate`` as forwarded with a valid ``traceparent``: unchanged if within
    ``MAX_TRACESTATE`` characters and ``MAX_MEMBERS`` list members, else None (dropped)."""
    if not tracestate or len(tracestate) > MAX_TRACESTATE:
        return None
    if tracestate.count(b",") >= MAX_MEMBERS:
        members = 0
        for member in tracestate.split(b","):
            if member.strip(b" \t"):
                members += 1
        if members > MAX_MEMBERS:
            return None
    return tracestate


def _span_id() -> str:
    span = random.getrandbits(64)
    while not span:
        span = random.getrandbits(64)
    return f"{span:016x}"


def context(traceparent: bytes | None, tracestate: bytes | None, sample_ratio: float) -> Context:
    """The trace context of a request that came with these headers (None: not sent)."""
    parsed = parse(traceparent)
    if parsed is None:
        trace = random.getrandbits(128)
        while not trace:
            trace = random.getrandbits(128)
        request_id = f"{trace:032x}-{_span_id()}"
        sampled = random.random() < sample_ratio
        flags = b"-01" if sampled else b"-00"
        return request_id, b"traceparent: 00-" + request_id.encode() + flags
    trace_id, incoming = parsed
    request_id = trace_id.decode() + "-" + _span_id()
    flags = b"-01" if incoming & 1 else b"-00"
    line = b"traceparent: 00-" + request_id.encode() + flags
    kept = tracestate_kept(tracestate)
    if kept is not None:
        line += b"\r\ntracestate: " + kept
    return request_id, line


_PARENT: Final = 49
"""Where the parent id begins in a context's header lines (``b"traceparent: 00-<trace>-"``)."""


def sampled(lines: bytes) -> bool:
    """Whether a context's header lines (``Context``) carry the sampled flag."""
    return len(lines) > _PARENT + 18 and lines[_PARENT + 18] == 49  # "1"


def with_parent(lines: bytes, span_id: str) -> bytes:
    """A context's header lines with ``span_id`` as the parent id sent upstream (an
    attempt's client span, when spans are recorded)."""
    return lines[:_PARENT] + span_id.encode() + lines[_PARENT + 16 :]


def parent_id(traceparent: bytes | None) -> str:
    """The caller's span id of a valid ``traceparent``; "" if there is none (a new trace)."""
    if parse(traceparent) is None:
        return ""
    assert traceparent is not None
    return traceparent.strip(b" \t")[36:52].decode()
