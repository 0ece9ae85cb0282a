"""TLS to a service's replicas (``upstream_tls``): the client side's context, and what a
connection checks of its handshake.

``UpstreamTls.of(config, alpn)`` is one per distinct config and ALPN protocol in a process
(the most recent ``KEPT`` are kept). Its ``SSLContext`` is made on first use from the files
the config names, in the process that connects: a worker makes its own, a context is never
sent between processes. It is made once for all of its connections, and made again when one
of its files changes (their modification times, looked at most every ``RECHECK`` seconds);
a file that became unusable leaves the last good context in use, and says so in the log.

ALPN offers one protocol, the service's ``upstream_protocol``: ``http/1.1`` or ``h2``. A
replica that does not choose ``h2`` when it is offered cannot speak HTTP/2 over TLS: the
connection fails (``refusal``). A replica that chooses nothing for ``http/1.1`` speaks
HTTP/1.1.

Connections to the same address under different TLS settings are different connections:
``key`` is the keep-alive pools' key of this config's connections to an address, never a
plain connection's (``Upstream.address``), so a connection verified under one config is
never reused under another, nor a plain one where TLS is asked for.

Sessions are not resumed: asyncio's ``create_connection`` takes no session, and kept-alive
connections make handshakes rare (docs/upstream-tls.md).
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Final

from ..config import UpstreamTlsConfig

log = logging.getLogger(__name__)

RECHECK: Final = 5.0
"""Seconds between two looks at a context's files (their modification times)."""
KEPT: Final = 256
"""Contexts kept per process: one per distinct config (and ALPN protocol) in use."""
HTTP1: Final = "http/1.1"
H2: Final = "h2"


class UpstreamTlsError(ValueError):
    """A file of ``upstream_tls`` that cannot be read or used; ``field`` names which."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"upstream_tls.{field}: {reason}")
        self.field = field
        self.reason = reason


def upstream_tls_context(config: UpstreamTlsConfig, alpn: str = HTTP1) -> ssl.SSLContext:
    """A new client context as ``config`` says, offering ``alpn``: TLS 1.2 at least,
    OpenSSL's defaults otherwise. Raises ``UpstreamTlsError`` for a file it cannot use."""
    if config.ca is None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)  # the system's CAs
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # the given CAs alone
        try:
            context.load_verify_locations(cafile=config.ca)
        except OSError as exc:  # ssl.SSLError too
            raise UpstreamTlsError("ca", _file_problem(config.ca, exc)) from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if not config.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.cert is not None and config.key is not None:
        for field, path in (("cert", config.cert), ("key", config.key)):
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise UpstreamTlsError(field, _file_problem(path, exc)) from None
        try:
            context.load_cert_chain(config.cert, config.key)
        except (OSError, ValueError) as exc:
            raise UpstreamTlsError(
                "cert",
                f"{config.cert} and {config.key} are not a PEM certificate and its key "
                f"({_reason(exc)})",
            ) from None
    context.set_alpn_protocols([alpn])
    return context


def _file_problem(path: str, exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"{path} holds no PEM certificate ({_reason(exc)})"
    if isinstance(exc, OSError) and exc.strerror:
        return f"cannot read {path}: {exc.strerror}"
    return f"cannot use {path}: {_reason(exc)}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).replace("_", " ").lower()
    return str(exc) or type(exc).__name__


def handshake_failure(exc: OSError) -> str:
    """Why a TLS handshake with a replica failed, in a few words (``exc`` as
    ``create_connection`` raised it)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the replica's certificate failed verification: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {_reason(exc)}"
    return exc.strerror or str(exc) or type(exc).__name__


class UpstreamTls:
    """One config's TLS to replicas, offering one ALPN protocol: its context, made once and
    again when its files change, and its connections' key."""

    __slots__ = ("_checked", "_context", "_stamps", "alpn", "config", "tag")

    _kept: dict[tuple[UpstreamTlsConfig, str], UpstreamTls] = {}  # noqa: RUF012
    _made = 0

    @classmethod
    def of(cls, config: UpstreamTlsConfig, alpn: str) -> UpstreamTls:
        """The one of ``config`` offering ``alpn`` in this process (made on first use)."""
        kept = cls._kept
        tls = kept.get((config, alpn))
        if tls is None:
            if len(kept) >= KEPT:
                del kept[next(iter(kept))]
            tls = kept[(config, alpn)] = cls(config, alpn)
        return tls

    def __init__(self, config: UpstreamTlsConfig, alpn: str) -> None:
        UpstreamTls._made += 1
        self.config = config
        self.alpn = alpn
        self.tag = f"tls{UpstreamTls._made}"
        """Distinct per instance in its process: what ``key`` adds to an address."""
        self._context: ssl.SSLContext | None = None
        self._stamps: tuple[float, ...] = ()
        self._checked = float("-inf")

    def key(self, address: str) -> str:
        """The keep-alive pools' key of its connections to ``address``."""
        return f"{address} {self.tag}"

    def server_hostname(self, host: str) -> str:
        """The name sent as SNI and checked against the certificate (an IP address is
        checked, not sent)."""
        return self.config.server_name or host

    def context(self, now: float) -> ssl.SSLContext:
        """Its context (``now``: monotonic seconds, when its files are looked at).

        Raises ``UpstreamTlsError`` if none could ever be made."""
        context = self._context
        if context is not None and now - self._checked < RECHECK:
            return context
        self._checked = now
        stamps = self._file_stamps()
        if context is not None and stamps == self._stamps:
            return context
        try:
            context = upstream_tls_context(self.config, self.alpn)
        except UpstreamTlsError as exc:
            if self._context is None:
                raise
            log.warning("upstream TLS: %s; the context made before stays in use", exc)
            return self._context
        self._context, self._stamps = context, stamps
        return context

    def _file_stamps(self) -> tuple[float, ...]:
        config = self.config
        stamps = []
        for path in (config.ca, config.cert, config.key):
            if path is None:
                continue
            try:
                stamps.append(os.stat(path).st_mtime)
            except OSError:
                stamps.append(-1.0)
        return tuple(stamps)

    def refusal(self, ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str | None:
        """Why a connection whose handshake is done cannot be used (``h2`` offered, not
        chosen), or None."""
        if self.alpn != H2:
            return None
        chosen = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        if chosen == H2:
            return None
        return f"the replica did not agree on h2 by ALPN (it chose {chosen or 'none'})"

    def __repr__(self) -> str:
        return f"<UpstreamTls {self.tag} alpn={self.alpn} verify={self.config.verify}>"


def alpn_of(protocol: str) -> str:
    """The ALPN protocol offered for an ``upstream_protocol``."""
    return H2 if protocol == "http2" else HTTP1


def tls_of(config: UpstreamTlsConfig | None, alpn: str) -> UpstreamTls | None:
    """``UpstreamTls.of(config, alpn)``, or None for no config (plain)."""
    return None if config is None else UpstreamTls.of(config, alpn)
