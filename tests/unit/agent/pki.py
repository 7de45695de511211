"""A test certificate authority that signs the CSRs the agent sends to the fake apiserver, as
the controller-manager's signer does on a real cluster."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from vkubelet.testing.fakeapi import FakeApiServer


class TestCA:
    __test__ = False

    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def sign(
        self,
        csr: x509.CertificateSigningRequest,
        *,
        seconds: float = 3600,
        age: float = 60,
    ) -> bytes:
        """A certificate for `csr` that started `age` seconds ago and lasts `seconds` in all."""
        start = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age)
        builder = (
            x509.CertificateBuilder()
            .subject_name(csr.subject)
            .issuer_name(self.cert.subject)
            .public_key(csr.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + dt.timedelta(seconds=seconds))
        )
        for extension in csr.extensions:
            builder = builder.add_extension(extension.value, extension.critical)
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def issue(
        self, path: Path, key_path: Path, *, name: str, addresses: list[str], seconds: float = 3600
    ) -> None:
        """Store a certificate for `system:node:<name>` as the agent would have."""
        key = ec.generate_private_key(ec.SECP256R1())
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(
                x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{name}")])
            )
            .add_extension(
                x509.SubjectAlternativeName(_names(addresses)),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.sign(csr, seconds=seconds))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


def _names(addresses: list[str]) -> list[x509.GeneralName]:
    import ipaddress

    names: list[x509.GeneralName] = []
    for address in addresses:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(address)))
        except ValueError:
            names.append(x509.DNSName(address))
    return names


def approved(csr: dict[str, object]) -> bool:
    status = csr.get("status") or {}
    assert isinstance(status, dict)
    return any(c.get("type") == "Approved" for c in status.get("conditions") or [])


def pending_csrs(api: FakeApiServer) -> list[str]:
    return [
        c["metadata"]["name"]
        for c in api.objects("certificatesigningrequests")
        if not (c.get("status") or {}).get("certificate")
    ]


def sign_pending(api: FakeApiServer, ca: TestCA, *, only_approved: bool, seconds: float) -> int:
    signed = 0
    for csr in api.objects("certificatesigningrequests"):
        status = csr.get("status") or {}
        if status.get("certificate") or (only_approved and not approved(csr)):
            continue
        request = x509.load_pem_x509_csr(base64.b64decode(csr["spec"]["request"]))
        pem = ca.sign(request, seconds=seconds, age=0)
        api.patch(
            "certificatesigningrequests",
            csr["metadata"]["name"],
            {"status": {**status, "certificate": base64.b64encode(pem).decode()}},
            subresource="status",
        )
        signed += 1
    return signed


@asynccontextmanager
async def signer(
    api: FakeApiServer, ca: TestCA, *, only_approved: bool = True, seconds: float = 3600
) -> AsyncIterator[None]:
    """Sign CSRs as they come (approved ones only, by default), like the cluster's signer."""

    async def loop() -> None:
        while True:
            sign_pending(api, ca, only_approved=only_approved, seconds=seconds)
            await asyncio.sleep(0.02)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
