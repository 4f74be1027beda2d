"""A local certificate authority for `loraplane up --tls` and the TLS tests: one CA, a server certificate valid for
the loopback names, and a client certificate for mTLS (the `cryptography` package; EC P-256, PEM files)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class LocalPKI:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.directory / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.directory / "client.key"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "loraplane local"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key, ca_key, ca_name: x509.Name, *, days: int, usage, sans=None, ca: bool = False):
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(ca_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    return builder.sign(ca_key, hashes.SHA256())


def make_local_pki(directory: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1"),
                   days: int = 365) -> LocalPKI:
    """Writes ca.pem, server.pem/.key (for `hosts`) and client.pem/.key into `directory` (keys mode 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = LocalPKI(directory)
    ca_key = _key()
    ca_name = _name("loraplane local CA")
    ca_cert = _issue("loraplane local CA", ca_key, ca_key, ca_name, days=days, usage=None, ca=True)
    sans = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_key, client_key = _key(), _key()
    server = _issue("loraplane server", server_key, ca_key, ca_name, days=days,
                    usage=[ExtendedKeyUsageOID.SERVER_AUTH], sans=sans)
    client = _issue("loraplane client", client_key, ca_key, ca_name, days=days,
                    usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    pki.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    pki.client_cert.write_bytes(client.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.server_key, server_key)
    _write_key(pki.client_key, client_key)
    return pki
