"""The files of automatic certificates, under ``<state_dir>/acme``::

    acme/                           0700
      account/key.pem               0600  the account's key, kept across restarts
      account/registration.json     0600  the account's URL at the directory it was made at
      certificates/<name>/          0700  <name>: the certificate's first host name
        fullchain.pem               0600  the leaf first, then the chain
        privkey.pem                 0600
      challenges/<token>            0600  HTTP-01 key authorizations, while an order runs

The data plane reads ``certificates/`` (``tls.managed_dir``) and serves ``challenges/`` under
``/.well-known/acme-challenge/`` on the plain listener.

Every file is written atomically: to a temporary file in the same directory, flushed to disk,
then renamed over the old one, so a reader sees the old file or the new one, never a part.
A certificate's key is written before its chain: a pair read between the two renames is
a new key with the old chain, which the key check of ``certificate`` (and the data plane's
loader) refuses, never a silent mismatch. Blocking calls: the manager runs them in a thread.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from .errors import StoreError
from .schedule import Certificate

TOKEN = re.compile(r"[A-Za-z0-9_-]{1,256}")
"""An HTTP-01 token (base64url, RFC 8555 section 8.3): it names a file, so nothing else may."""
NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")
"""A certificate's directory name: a lower-case DNS name (no ``/``, no ``..`` at the ends)."""


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data``: a temporary file beside it, fsync, rename, fsync of the
    directory (so the rename itself survives a crash)."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, mode)  # os.open's mode is masked by the umask
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True, slots=True)
class StoredCertificate:
    """A certificate read back from its files."""

    name: str
    certificate: Certificate
    issuer: str
    """The issuing CA's common name (or its whole name)."""


def parse_certificate(name: str, chain_pem: bytes, key_pem: bytes) -> StoredCertificate:
    """The names and validity of the chain's leaf; ``StoreError`` if either file is not PEM
    or the key is not the leaf's."""
    from cryptography import x509  # imported here: a gateway without ACME never needs it
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    try:
        leaf = x509.load_pem_x509_certificate(chain_pem)
    except ValueError as e:
        raise StoreError(f"certificate {name}: fullchain.pem is no PEM certificate: {e}") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise StoreError(f"certificate {name}: privkey.pem is not a PEM private key: {e}") from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if key.public_key().public_bytes(der, spki) != leaf.public_key().public_bytes(der, spki):
        raise StoreError(f"certificate {name}: privkey.pem is not the key of fullchain.pem")
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        names = tuple(n.lower() for n in san.value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = ()
    if not names:
        names = tuple(
            str(a.value).lower() for a in leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        )
    issuer_cn = leaf.issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
    issuer = str(issuer_cn[0].value) if issuer_cn else leaf.issuer.rfc4514_string()
    validity = Certificate(
        names,
        leaf.not_valid_before_utc.timestamp(),
        leaf.not_valid_after_utc.timestamp(),
    )
    return StoredCertificate(name, validity, issuer)


class AcmeStore:
    """The files under ``root`` (``<state_dir>/acme``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.account_dir = root / "account"
        self.certificates_dir = root / "certificates"
        self.challenges_dir = root / "challenges"

    def prepare(self) -> None:
        """Make the directories (0700, also when they existed with looser modes) and remove
        the challenge answers an interrupted order left."""
        for directory in (self.root, self.account_dir, self.certificates_dir, self.challenges_dir):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(directory, 0o700)
        for leftover in self.challenges_dir.iterdir():
            if leftover.is_file():
                leftover.unlink(missing_ok=True)

    # -- the account --------------------------------------------------------------------------

    def account_key(self) -> bytes | None:
        """The account key (PEM), or None before the first order."""
        try:
            return (self.account_dir / "key.pem").read_bytes()
        except FileNotFoundError:
            return None

    def save_account_key(self, pem: bytes) -> None:
        write_atomic(self.account_dir / "key.pem", pem)

    def registration(self, directory: str) -> str | None:
        """The account's registration (the acme library's JSON) at ``directory``; None if
        the account was made at another directory, or never."""
        try:
            data = json.loads((self.account_dir / "registration.json").read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise StoreError(f"account/registration.json unreadable: {e}") from None
        if not isinstance(data, dict) or data.get("directory") != directory:
            return None
        registration = data.get("registration")
        return registration if isinstance(registration, str) else None

    def save_registration(self, directory: str, registration: str) -> None:
        body = json.dumps({"directory": directory, "registration": registration}, indent=2)
        write_atomic(self.account_dir / "registration.json", body.encode())

    def forget_registration(self) -> None:
        (self.account_dir / "registration.json").unlink(missing_ok=True)

    # -- certificates -------------------------------------------------------------------------

    def certificate_dir(self, name: str) -> Path:
        if not NAME.fullmatch(name) or ".." in name:
            raise StoreError(f"not a certificate name: {name!r}")
        return self.certificates_dir / name

    def write_certificate(self, name: str, chain_pem: bytes, key_pem: bytes) -> StoredCertificate:
        """Store a certificate (checked first: the pair must parse and match) and return it
        as read back."""
        stored = parse_certificate(name, chain_pem, key_pem)
        directory = self.certificate_dir(name)
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
            write_atomic(directory / "privkey.pem", key_pem)
            write_atomic(directory / "fullchain.pem", chain_pem)
        except OSError as e:
            raise StoreError(f"certificate {name} not written: {e}") from None
        return stored

    def certificate(self, name: str) -> StoredCertificate | None:
        """The stored certificate ``name``; None if there is none. ``StoreError`` if its
        files are unreadable or do not match."""
        directory = self.certificate_dir(name)
        try:
            chain = (directory / "fullchain.pem").read_bytes()
            key = (directory / "privkey.pem").read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"certificate {name} unreadable: {e}") from None
        return parse_certificate(name, chain, key)

    # -- HTTP-01 answers ----------------------------------------------------------------------

    def challenge_path(self, token: str) -> Path:
        if not TOKEN.fullmatch(token):
            raise StoreError(f"not an HTTP-01 token: {token[:64]!r}")
        return self.challenges_dir / token

    def put_challenge(self, token: str, key_authorization: str) -> None:
        try:
            write_atomic(self.challenge_path(token), key_authorization.encode("ascii"))
        except OSError as e:
            raise StoreError(f"challenge answer not written: {e}") from None

    def remove_challenge(self, token: str) -> None:
        self.challenge_path(token).unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"<AcmeStore {self.root}>"
