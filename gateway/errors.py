"""Errors of the data plane, each carrying the HTTP status the gateway answers with.

    GatewayError
    ├── BadRequest              400  a request that cannot be served as it was sent
    ├── Unauthorized            401  the service needs a bearer token: none, or a wrong one
    ├── TooManyRequests         429  over a rate limit of the service
    ├── RequestTimeout          408  the request body paused or trickled too long
    ├── NoRoute                 404  no service matches the request
    │   └── ModelNotFound            no service serves the model a request names
    ├── NoRoutableUpstream      503  the service has no upstream that may take the request
    ├── RequestTooLarge         413  the body is larger than the service allows
    ├── OwnAnswer               any  an answer the gateway gives itself, not an error: an
    │                                ACME challenge's, a redirect to HTTPS
    └── UpstreamError           502  forwarding failed
        ├── UpstreamConnectError     could not connect, or reset before any byte was sent
        ├── UpstreamProtocolError    the upstream answered something that is not HTTP
        └── UpstreamTimeout     504  (also a TimeoutError) connect, read or total timeout

Library exceptions (OSError, llhttp's) are translated into these once, where they happen
(``proxy.connector``, ``proxy.http1_downstream``). An error of an attempt also says what kind
of failure it was (``kind``), which decides whether a retry may help and what passive
detection hears.
"""

from __future__ import annotations

from typing import Literal

FailureKind = Literal[
    "connect",
    "disconnect",
    "refused",
    "stale",
    "timeout",
    "protocol",
    "client",
    "status",
    "other",
]
"""What kind of failure an attempt met: ``connect`` (nothing reached the upstream),
``disconnect`` (closed before any answer), ``refused`` (an HTTP/2 upstream refused the
stream, by REFUSED_STREAM or a GOAWAY below it: its application never saw the request),
``stale`` (a ``disconnect`` of a kept connection reused for a request that can be sent
again: the upstream closed it as it went idle, ``retry.stale``), ``timeout``, ``protocol``
(not HTTP, or a body that broke off), ``client`` (the client's doing: too large, too slow,
gone), ``status`` (an answer whose status ``retries.on_status`` retries) or ``other``."""


class GatewayError(Exception):
    status = 500
    code = "gateway_error"
    fields: tuple[tuple[str, str], ...] = ()
    """Header fields of the answer beyond the JSON body's own."""

    def __init__(self, message: str, *, kind: FailureKind = "other", **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.kind: FailureKind = kind
        self.details = details


class BadRequest(GatewayError):
    status = 400
    code = "bad_request"


class Unauthorized(GatewayError):
    status = 401
    code = "unauthorized"
    fields = (("WWW-Authenticate", 'Bearer realm="gateway"'),)


class TooManyRequests(GatewayError):
    """429, with ``Retry-After`` and the ``RateLimit-*`` fields of the rule that refused."""

    status = 429
    code = "rate_limited"

    def __init__(
        self, message: str, retry_after: int, fields: tuple[tuple[str, str], ...], **details: object
    ) -> None:
        super().__init__(message, kind="client", **details)
        self.retry_after = retry_after
        self.fields = fields


class RequestTimeout(GatewayError, TimeoutError):
    status = 408
    code = "request_timeout"


class NoRoute(GatewayError):
    status = 404
    code = "no_route"


class ModelNotFound(NoRoute):
    code = "model_not_found"


class NoRoutableUpstream(GatewayError):
    status = 503
    code = "no_routable_upstream"

    def __init__(
        self,
        message: str,
        retry_after: int = 1,
        *,
        kind: FailureKind = "other",
        **details: object,
    ) -> None:
        super().__init__(message, kind=kind, **details)
        self.retry_after = retry_after


class RequestTooLarge(GatewayError):
    status = 413
    code = "request_too_large"


class OwnAnswer(GatewayError):
    """An answer the gateway gives itself instead of forwarding (raised where a request is
    routed, answered as any error is, but with its own status, fields and body)."""

    code = "own_answer"

    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str],
        body: bytes = b"",
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.body = body
        self.close = close
        """The client's connection closes after it (the request's body cannot be read on)."""


class UpstreamError(GatewayError):
    status = 502
    code = "bad_gateway"


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class UpstreamTimeout(UpstreamError, TimeoutError):
    status = 504
    code = "upstream_timeout"


class ClientGone(ConnectionError):
    """The client closed its connection before its request body was complete.

    (Here, not in ``proxy.http1_downstream``: this module stays pure Python, as mypyc cannot
    compile a subclass of a built-in exception such as ``ConnectionError``; see
    ``native.MODULES``.)"""
