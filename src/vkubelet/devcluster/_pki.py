"""Certificates for a local control plane, made with `cryptography` instead of openssl by hand.

Every component gets its own identity so that the apiserver's Node and RBAC authorizers judge
each one as they would in a real cluster (the scheduler is `system:kube-scheduler`, the apiserver
talks to kubelets as `kube-apiserver-kubelet-client`, ...).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .._files import write_private

# Long enough that a dev cluster never expires under a user; short enough to be obviously a dev CA.
_VALIDITY = dt.timedelta(days=365)
_CLOCK_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class KeyPair:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return private_pem(self.key)

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """Write `<stem>.crt` and `<stem>.key` (the key readable by the owner only)."""
        cert_path = directory / f"{stem}.crt"
        key_path = directory / f"{stem}.key"
        cert_path.write_bytes(self.cert_pem())
        write_private(key_path, self.key_pem())
        return cert_path, key_path


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: accepted by every Kubernetes component and ~100x faster to generate than RSA-2048.
    return ec.generate_private_key(ec.SECP256R1())


def private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    validity: dt.timedelta,
    *,
    ca: bool,
) -> x509.CertificateBuilder:
    """What CA and leaf certificates share; only a CA may sign certificates."""
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )


def new_ca(common_name: str) -> KeyPair:
    key = new_key()
    name = _name(common_name)
    cert = (
        _builder(name, name, key, 10 * _VALIDITY, ca=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert, key)


def issue(
    ca: KeyPair,
    common_name: str,
    *,
    organizations: tuple[str, ...] = (),
    server: bool = False,
    client: bool = False,
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
) -> KeyPair:
    """Issue a leaf certificate signed by `ca` for a server, a client or both."""
    if not (server or client):
        raise ValueError("a leaf certificate must be for a server, a client or both")
    key = new_key()
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    builder = (
        _builder(_name(common_name, organizations), ca.cert.subject, key, _VALIDITY, ca=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return KeyPair(builder.sign(ca.key, hashes.SHA256()), key)


def load(cert_path: Path, key_path: Path) -> KeyPair:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{key_path}: expected an EC private key")
    return KeyPair(cert, key)


def csr_pem(
    key: ec.EllipticCurvePrivateKey, common_name: str, organizations: tuple[str, ...]
) -> bytes:
    """A PKCS#10 request, as a kubelet sends it to the CSR API."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_name(common_name, organizations))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)
