"""Whether a failed attempt is tried again on another upstream: a pure decision.

A retry goes to a different routable upstream, within ``retries.attempts`` and
``retries.timeout``, and only while nothing is lost by it: no response byte sent to the
client and no request body byte taken from it (or the whole body kept to send again). A
connect failure is always retried, and so is a stream an HTTP/2 upstream refused
(``refused``: REFUSED_STREAM, or a GOAWAY whose last stream is below it: RFC 9113 8.7 says
it was not processed); a connection the upstream closed or reset before answering only for
an idempotent request without a body; with ``retries.on_status`` a 502, 503 or 504 answer to
such a request too.

Before any of that, a kept connection the upstream closed as it was reused (``stale``: its
keep-alive timeout met the request on the way) is no failure of the upstream: the request is
sent again once, on a new connection to the same upstream, whatever ``retries`` says, and
passive detection hears nothing of it (nginx does the same for a cached connection).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Final

from ..config import RetriesConfig
from ..errors import FailureKind, GatewayError
from ..pool.upstream import Upstream

IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
RETRY_STATUSES: Final = frozenset({502, 503, 504})


class Failed(Exception):
    """An attempt failed before the client got anything; ``kind`` says if a retry may help."""

    def __init__(self, error: GatewayError, kind: FailureKind) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind


def stale(
    kind: FailureKind,
    *,
    reused: bool,
    method: str,
    has_body: bool,
    body_taken: bool,
    response_started: bool,
) -> bool:
    """Whether a failed attempt met a stale kept connection: closed or reset before any
    answer, on a connection that had served a request before (``reused``), for a request that
    can be sent again as it was (idempotent, no body)."""
    return (
        kind == "disconnect"
        and reused
        and method in IDEMPOTENT
        and not has_body
        and not body_taken
        and not response_started
    )


def may_retry(
    kind: FailureKind,
    *,
    method: str,
    has_body: bool,
    body_taken: bool,
    response_started: bool,
    retries: int,
    elapsed: float,
    config: RetriesConfig,
    routable: Sequence[Upstream],
    tried: Collection[str],
) -> bool:
    """Whether an attempt that failed with ``kind`` is tried again (``retries`` made so far,
    ``elapsed`` seconds since the request came; ``body_taken``: a byte of its body left for
    an upstream and cannot be sent again, or the body failed)."""
    if retries >= config.attempts or response_started or body_taken:
        return False
    if elapsed >= config.timeout:
        return False
    replayable = method in IDEMPOTENT and not has_body
    if kind == "disconnect" and not replayable:
        return False
    if kind == "status" and not (config.on_status and replayable):
        return False
    if kind not in ("connect", "refused", "disconnect", "status"):
        return False
    return any(u.id not in tried for u in routable)
