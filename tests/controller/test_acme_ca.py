"""A tiny certificate authority for the ACME tests, made with ``cryptography``: it signs leaf
certificates for given names and validity, as a CA's finalize would."""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from controller.acme.client import Issued, new_key_pem


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


class TestCA:
    __test__ = False

    def __init__(self, name: str = "Test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self,
        names: list[str],
        not_before: float,
        not_after: float,
        key_pem: bytes | None = None,
        ips: list[str] = (),  # type: ignore[assignment]
    ) -> Issued:
        """A leaf for ``names`` (and ``ips``), valid between the two wall-clock times, with
        ``key_pem`` or a fresh key; its chain is the leaf then this CA."""
        key_pem = key_pem or new_key_pem()
        key = serialization.load_pem_private_key(key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        alt: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
        alt += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(datetime.datetime.fromtimestamp(not_before, datetime.UTC))
            .not_valid_after(datetime.datetime.fromtimestamp(not_after, datetime.UTC))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return Issued(pem(leaf) + pem(self.cert), key_pem)
