"""A throwaway certificate authority for the TLS tests (``cryptography``, the library
OpenSSL's Python users build certificates with)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Issued:
    cert: Path
    key: Path
    serial: int


class Authority:
    def __init__(self, directory: Path, name: str):
        self.directory = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        now = datetime.datetime.now(datetime.UTC)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = directory / f"{name}-ca.pem"
        self.path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        common_name: str,
        filename: str | None = None,
        ips: tuple[str, ...] = (),
        names: tuple[str, ...] = (),
    ) -> Issued:
        """A leaf certificate for ``common_name``, valid for localhost, 127.0.0.1 and
        ``ips``; with ``names``, for those DNS names only (a cluster's one name)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        serial = x509.random_serial_number()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName(name) for name in names]
                    if names
                    else [
                        x509.DNSName("localhost"),
                        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", *ips)),
                    ]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        stem = filename or common_name
        cert_path = self.directory / f"{stem}.pem"
        key_path = self.directory / f"{stem}-key.pem"
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        return Issued(cert_path, key_path, serial)
