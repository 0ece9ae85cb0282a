"""The certificates the HTTPS listeners serve, loaded from files, reloaded when they change.

A ``CertificateStore`` loads every configured pair (``tls.certificates``) and every pair the
ACME client wrote (``<managed_dir>/<name>/fullchain.pem`` and ``privkey.pem``), each into a
server context of its own, and chooses one per handshake by SNI (``names``). ``reload``
loads what changed on disk (size, mtime or inode of either file) and keeps the rest: a pair
that fails to load (unreadable, not PEM, key not matching) is refused with the file and the
reason, counted, and the certificate loaded before from it keeps serving; connections open
across a reload keep the context they began with. ``rotate`` replaces the context handshakes
begin with, and with it the session ticket key (a ticket issued before a rotation is not
resumed: a full handshake instead). ``watch`` runs both on a timer.

``cryptography`` reads each certificate's names and expiry; it is imported only when a
certificate is loaded, so a process without TLS does not pay for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from ..config import TlsConfig
from .context import server_context
from .names import NameIndex

log = logging.getLogger(__name__)

MANAGED_CERT: Final = "fullchain.pem"
MANAGED_KEY: Final = "privkey.pem"
FileKey = tuple[str, str]
"""(cert_file, key_file): what a certificate is loaded from."""
Signature = tuple[tuple[int, int, int], tuple[int, int, int]]


class CertificateError(Exception):
    """A pair that cannot be served: ``file`` says which file, the message why."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Certificate:
    """One loaded certificate: what it covers, until when, and its server context."""

    cert_file: str
    key_file: str
    names: tuple[str, ...]
    not_after: float
    """Its expiry, as a Unix timestamp."""
    managed: bool
    """Obtained by ACME (under ``managed_dir``), not configured."""
    context: ssl.SSLContext = field(repr=False, compare=False)
    signature: Signature = field(repr=False, compare=False)

    @property
    def name(self) -> str:
        """What metrics and logs call it: its first name."""
        return self.names[0] if self.names else os.path.basename(self.cert_file)


@dataclass(frozen=True, slots=True)
class Refusal:
    cert_file: str
    key_file: str
    file: str
    reason: str


@dataclass(frozen=True, slots=True)
class ReloadReport:
    loaded: tuple[Certificate, ...]
    """Every certificate serving after the reload."""
    changed: tuple[Certificate, ...]
    """Those (re)loaded by it."""
    refused: tuple[Refusal, ...]


def _signature(cert_file: str, key_file: str) -> Signature:
    def one(path: str) -> tuple[int, int, int]:
        try:
            st = os.stat(path)
        except OSError:
            return (0, 0, 0)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    return one(cert_file), one(key_file)


def read_certificate(cert_file: str) -> tuple[tuple[str, ...], float]:
    """The DNS names a PEM certificate (its leaf: the first) covers, and its expiry."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        data = Path(cert_file).read_bytes()
    except OSError as e:
        raise CertificateError(cert_file, f"cannot read: {e.strerror}") from None
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise CertificateError(cert_file, f"not a PEM certificate: {e}") from None
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        names = tuple(san.value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = tuple(
            str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        )
    return names, cert.not_valid_after_utc.timestamp()


def load(
    cert_file: str, key_file: str, *, tickets: bool, managed: bool, alpn: Sequence[str]
) -> Certificate:
    """Load one pair into a context of its own; raises ``CertificateError``."""
    signature = _signature(cert_file, key_file)
    names, not_after = read_certificate(cert_file)
    context = server_context(tickets=tickets, alpn=alpn)
    try:
        context.load_cert_chain(cert_file, key_file)
    except FileNotFoundError as e:
        raise CertificateError(e.filename or key_file, "no such file") from None
    except PermissionError as e:
        raise CertificateError(e.filename or key_file, "permission denied") from None
    except ssl.SSLError as e:
        reason = e.reason or str(e)
        if reason == "KEY_VALUES_MISMATCH":
            reason = "the key does not match the certificate"
        elif "PEM lib" in reason:  # what OpenSSL says of a key file it cannot parse
            reason = "no PEM private key in it"
        raise CertificateError(key_file, f"cannot load the pair: {reason}") from None
    return Certificate(cert_file, key_file, names, not_after, managed, context, signature)


class CertificateStore:
    """The certificates of ``config`` (and of its ``managed_dir``), chosen by SNI."""

    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self.loaded: dict[FileKey, Certificate] = {}
        self.refused: dict[FileKey, Refusal] = {}
        """The last refusal of each pair, while it stands (a later load of it clears it)."""
        self.reload_failures = 0
        """Pairs refused by a load or a reload, since start."""
        self.refused_names = 0
        """Handshakes refused for a server name no certificate covers (``refuse``)."""
        self._index: NameIndex[Certificate] = NameIndex()
        self._default: Certificate | None = None
        self.context = self._dispatcher()
        """The context a handshake begins with; its SNI callback picks the one of the
        certificate that answers (this one has none). OpenSSL keeps session tickets' key and
        the session cache in the context a handshake began with, so this is what ``rotate``
        replaces."""

    # -- choosing -----------------------------------------------------------------------------

    def find(self, server_name: str | None) -> Certificate | None:
        """The certificate a handshake for ``server_name`` gets (None: refused)."""
        found = self._index.find(server_name)
        if found is None and self.config.unknown_name == "default":
            return self._default
        return found

    def _dispatcher(self) -> ssl.SSLContext:
        context = server_context(tickets=self.config.session_tickets, alpn=self.config.alpn)
        context.sni_callback = self._choose
        return context

    def _choose(
        self, ssl_object: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext
    ) -> int | None:
        found = self.find(server_name)
        if found is None:
            self.refused_names += 1
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        ssl_object.context = found.context
        return None

    # -- loading ------------------------------------------------------------------------------

    def pairs(self) -> list[tuple[FileKey, bool]]:
        """Every pair to serve, configured first, then the managed ones by directory name."""
        found = [((c.cert_file, c.key_file), False) for c in self.config.certificates]
        managed = self.config.managed_dir
        if managed:
            try:
                names = sorted(os.listdir(managed))
            except OSError:
                names = []
            for name in names:
                cert = os.path.join(managed, name, MANAGED_CERT)
                key = os.path.join(managed, name, MANAGED_KEY)
                if os.path.isfile(cert) and os.path.isfile(key):
                    found.append(((cert, key), True))
        return found

    def reload(self, *, force: bool = False) -> ReloadReport:
        """Load what changed on disk (everything with ``force``); keep what fails to load."""
        kept: dict[FileKey, Certificate] = {}
        changed: list[Certificate] = []
        refused: list[Refusal] = []
        tickets = self.config.session_tickets
        pairs = self.pairs()
        for key, managed in pairs:
            old = self.loaded.get(key)
            if old is not None and not force and old.signature == _signature(*key):
                kept[key] = old
                continue
            try:
                new = load(*key, tickets=tickets, managed=managed, alpn=self.config.alpn)
            except CertificateError as e:
                refusal = Refusal(key[0], key[1], e.file, e.reason)
                if self.refused.get(key) != refusal or force:
                    self.reload_failures += 1
                    log.warning(
                        "TLS certificate %s refused: %s: %s%s",
                        key[0],
                        e.file,
                        e.reason,
                        "; the one loaded before keeps serving" if old is not None else "",
                    )
                self.refused[key] = refusal
                refused.append(refusal)
                if old is not None:
                    kept[key] = old
                continue
            self.refused.pop(key, None)
            kept[key] = new
            changed.append(new)
            if old is None or old.signature != new.signature:
                log.info(
                    "TLS certificate %s loaded: %s, expires %s",
                    key[0],
                    ", ".join(new.names) or "no DNS names",
                    _utc(new.not_after),
                )
        listed = {key for key, _ in pairs}
        for key in [k for k in self.refused if k not in listed]:
            del self.refused[key]
        self.loaded = kept
        ordered = list(kept.values())
        self._index = NameIndex.build((c.names, c) for c in ordered)
        self._default = ordered[0] if ordered else None
        return ReloadReport(tuple(ordered), tuple(changed), tuple(refused))

    def rotate(self) -> None:
        """New session ticket keys (and session cache): a new context for new handshakes."""
        self.context = self._dispatcher()

    async def watch(self) -> None:
        """Reload on change every ``watch_interval``; rotate every ``ticket_key_lifetime``."""
        interval = self.config.watch_interval
        lifetime = self.config.ticket_key_lifetime
        loop = asyncio.get_running_loop()
        rotate_at = loop.time() + lifetime if lifetime else None
        while True:
            waits = [w for w in (interval, lifetime) if w]
            if not waits:
                return
            await asyncio.sleep(min(waits))
            if rotate_at is not None and loop.time() >= rotate_at:
                self.rotate()
                rotate_at = loop.time() + lifetime
            elif interval:
                self.reload()

    def __repr__(self) -> str:
        return f"<CertificateStore {len(self.loaded)} loaded, {len(self.refused)} refused>"


def _utc(timestamp: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))
