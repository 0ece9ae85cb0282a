"""TLS termination: HTTPS listeners served by the same connection classes as plain ones.

    names         which certificate covers a server name (PURE)
    context       the TLS settings of every server context
    certificates  the certificates from files (and ACME's directory), reloaded on change
    handshake     how handshakes ended, counted
    transport     TlsConnection: each accepted connection's handshake, then its records
    acme          the HTTP-01 challenge answers, on the plain listener

``Termination`` is what a process that serves TLS holds: its certificates, its handshake
counts, and the task that reloads changed files and rotates ticket keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from typing import TYPE_CHECKING, Any

from .. import native

native.use_in(__path__, __name__)  # first: the compiled modules, if built (native.py)

from ..config import TlsConfig  # noqa: E402
from .certificates import Certificate, CertificateError, CertificateStore, ReloadReport  # noqa: E402
from .handshake import FAILURE_REASONS, HandshakeCounts, HandshakeTally  # noqa: E402

if TYPE_CHECKING:
    from .transport import TlsConnection, tls_connections

__all__ = [
    "FAILURE_REASONS",
    "Certificate",
    "CertificateError",
    "CertificateStore",
    "HandshakeCounts",
    "HandshakeTally",
    "ReloadReport",
    "Termination",
    "TlsConnection",
    "tls_connections",
]


def __getattr__(name: str) -> Any:
    # The record layer (``transport``) is the data plane's: it imports the proxy's client
    # connection, which a main process whose workers serve traffic never loads (PEP 562).
    if name in ("TlsConnection", "tls_connections"):
        return getattr(importlib.import_module(".transport", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Termination:
    """One process's TLS: certificates (``store``), handshake counts, the watch task."""

    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self.store = CertificateStore(config)
        self.tally = HandshakeTally()
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> ReloadReport:
        """Load the certificates and start watching their files."""
        report = self.store.reload()
        if self._watch is None:
            self._watch = asyncio.create_task(self.store.watch(), name="tls-watch")
        return report

    def reload(self) -> ReloadReport:
        """Load what changed on disk now (SIGHUP, the admin API, the ACME client)."""
        return self.store.reload()

    async def stop(self) -> None:
        task, self._watch = self._watch, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
