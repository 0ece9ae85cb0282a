"""Whether a failed attempt is tried again on another upstream: a pure decision.

A retry goes to a different routable upstream, within ``retries.attempts`` and
``retries.timeout``, and only while nothing is lost by it: no response byte sent to the
client and no request body byte taken from it. A connect failure is always retried; a
connection the upstream closed or reset before answering only for an idempotent request
without a body (a stale keep-alive connection); with ``retries.on_status`` a 502, 503 or 504
answer to such a request too.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Final

from ..config import RetriesConfig
from ..errors import FailureKind, GatewayError
from ..upstream import Upstream

IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
RETRY_STATUSES: Final = frozenset({502, 503, 504})


class Failed(Exception):
    """An attempt failed before the client got anything; ``kind`` says if a retry may help."""

    def __init__(self, error: GatewayError, kind: FailureKind) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind


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
    an upstream, or the body failed)."""
    if retries >= config.attempts or response_started or body_taken:
        return False
    if elapsed >= config.timeout:
        return False
    replayable = method in IDEMPOTENT and not has_body
    if kind == "disconnect" and not replayable:
        return False
    if kind == "status" and not (config.on_status and replayable):
        return False
    if kind not in ("connect", "disconnect", "status"):
        return False
    return any(u.id not in tried for u in routable)
