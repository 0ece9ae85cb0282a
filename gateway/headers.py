"""Header rules of the proxy: hop-by-hop removal, X-Forwarded-*, X-Request-Id. PURE.

Hop-by-hop headers describe one connection, not the message, so they never cross the proxy
in either direction: the fixed set below plus every header the ``Connection`` header names.
``Expect`` is answered by the gateway itself and is not passed on, and on a WebSocket
upgrade the ``Sec-WebSocket-*`` headers are left to the upstream handshake the gateway makes.

X-Forwarded-For carries the peer address: appended to the client's value when the client is
a trusted proxy (``trust_forwarded``), replacing it otherwise, so a client cannot forge it.
X-Request-Id is the client's when it is well formed, else a new one; it goes upstream and
comes back on every response. (The one impurity: a new id comes from ``uuid4``.)
"""

from __future__ import annotations

import re
import uuid

from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""Lower-cased names that never cross the proxy (RFC 9110 7.6.1, and the old Proxy-*)."""

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

Headers = MultiMapping[str] | CIMultiDictProxy[str] | CIMultiDict[str]


def request_id(candidate: str | None) -> str:
    """The client's X-Request-Id if it is well formed, else a new random one."""
    if candidate is not None and _REQUEST_ID.match(candidate):
        return candidate
    return uuid.uuid4().hex


def end_to_end(headers: Headers) -> CIMultiDict[str]:
    """A copy of ``headers`` without the hop-by-hop ones (repeated headers kept in order)."""
    drop = set(HOP_BY_HOP)
    for value in headers.getall("Connection", ()):
        drop.update(token.strip().lower() for token in value.split(","))
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


def upstream_request(
    headers: Headers,
    *,
    peer: str | None,
    scheme: str,
    request_id: str,
    trust_forwarded: bool,
    websocket: bool = False,
) -> CIMultiDict[str]:
    """The headers sent upstream for a client request with ``headers``.

    Host stays the client's. ``peer`` is the client's IP address (None on a Unix socket).
    """
    out = end_to_end(headers)
    out.popall("Expect", None)
    if websocket:
        for name in [n for n in out if n.lower().startswith("sec-websocket-")]:
            out.popall(name, None)
    host = headers.get("Host")
    if trust_forwarded:
        prior = ", ".join(headers.getall("X-Forwarded-For", ()))
        if peer is not None:
            out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
        out.setdefault("X-Forwarded-Proto", scheme)
        if host is not None:
            out.setdefault("X-Forwarded-Host", host)
    else:
        out.popall("X-Forwarded-For", None)
        out.popall("X-Forwarded-Host", None)
        if peer is not None:
            out["X-Forwarded-For"] = peer
        out["X-Forwarded-Proto"] = scheme
        if host is not None:
            out["X-Forwarded-Host"] = host
    out["X-Request-Id"] = request_id
    return out


def client_response(headers: Headers, request_id: str) -> CIMultiDict[str]:
    """The headers returned to the client for an upstream response with ``headers``.

    Content-Length is kept, so a response the upstream framed by length is framed the same
    way; a chunked one is re-chunked by the gateway's own writer.
    """
    out = end_to_end(headers)
    out["X-Request-Id"] = request_id
    return out
