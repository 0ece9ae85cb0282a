"""How TLS handshakes ended: ``ok`` and ``resumed`` by TLS version, failures by reason.

Each listener's ``TlsConnection`` (``transport``) counts its handshake here; a worker process
sends what it counted to the main process (``take``), which adds it up (``merge``) for
``gateway_tls_handshakes_total`` and ``gateway_tls_handshake_failures_total``.
"""

from __future__ import annotations

import ssl
from typing import Final

FAILURE_REASONS: Final = (
    "timeout",
    "plain_http",
    "unknown_name",
    "protocol",
    "closed",
)
"""Why a handshake failed, as ``gateway_tls_handshake_failures_total`` says: it did not finish
within ``handshake_timeout``; plain HTTP came to the TLS port; the server name is one no
certificate covers (``unknown_name: refuse``); anything else OpenSSL refused (no shared
version or cipher, garbage instead of a ClientHello, a client alert); the client closed."""


def failure_reason(exc: BaseException) -> str:
    """What an error of a handshake says of it, as one of ``FAILURE_REASONS``."""
    if isinstance(exc, ssl.SSLError):
        if exc.reason == "HTTP_REQUEST":
            return "plain_http"
        if exc.reason == "CALLBACK_FAILED":  # the SNI callback refused the name
            return "unknown_name"
        if exc.reason in ("UNEXPECTED_EOF_WHILE_READING",):
            return "closed"
        return "protocol"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "closed"


class HandshakeTally:
    """How handshakes ended: ``ok`` and ``resumed`` by TLS version, failures by reason."""

    __slots__ = ("failed", "ok", "resumed")

    def __init__(self) -> None:
        self.ok: dict[str, int] = {}
        self.resumed: dict[str, int] = {}
        self.failed: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)

    def succeeded(self, version: str, resumed: bool) -> None:
        counts = self.resumed if resumed else self.ok
        counts[version] = counts.get(version, 0) + 1

    def merge(self, other: HandshakeCounts) -> None:
        for mine, theirs in zip((self.ok, self.resumed, self.failed), other, strict=True):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count

    def take(self) -> HandshakeCounts:
        """The counts since the last ``take`` (a worker's report), and start again."""
        taken = (self.ok, self.resumed, {k: v for k, v in self.failed.items() if v})
        self.ok, self.resumed = {}, {}
        self.failed = dict.fromkeys(FAILURE_REASONS, 0)
        return taken


HandshakeCounts = tuple[dict[str, int], dict[str, int], dict[str, int]]
"""(ok by version, resumed by version, failed by reason)."""
