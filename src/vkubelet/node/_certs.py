"""The kubelet serving certificate, obtained and renewed through the CSR API, like a kubelet does.

The reference implementation wants certificate files made by hand with openssl (its most
reported set-up problem). vkubelet asks the cluster instead: it sends a CertificateSigningRequest
for signer `kubernetes.io/kubelet-serving` as `system:node:<name>` with the node's addresses as
SANs, waits for approval (or approves it itself when told to, for dev clusters), keeps the result
in its cert directory so a restart reuses it, and renews it at 80 % of its lifetime.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ._kube import ApiError, KubeClient, Unreachable

log = logging.getLogger(__name__)

SIGNER = "kubernetes.io/kubelet-serving"
_CSR_PATH = "/apis/certificates.k8s.io/v1/certificatesigningrequests"


def _sans(addresses: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for address in dict.fromkeys(addresses):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(address)))
        except ValueError:
            names.append(x509.DNSName(address))
    return names


def _still_good(cert_path: Path, addresses: Sequence[str]) -> x509.Certificate | None:
    """The stored certificate, if it covers `addresses` and has more than 20 % of its life left."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError):
        return None
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if dt.datetime.now(dt.UTC) > start + (end - start) * 0.8:
        return None
    try:
        present = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    if not set(_sans(addresses)) <= set(present):
        return None
    return cert


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class ServingCertificate:
    """One serving certificate for one kubelet port (all its nodes' addresses as SANs)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        addresses: Sequence[str],
        cert_dir: Path,
        approve: bool = False,
        on_renewed: Callable[[Path, Path], None] = lambda cert, key: None,
    ) -> None:
        self._client = client
        self.node_name = node_name
        self.addresses = list(addresses)
        self.cert_path = cert_dir / f"{node_name}-serving.crt"
        self.key_path = cert_dir / f"{node_name}-serving.key"
        self._approve = approve
        self.on_renewed = on_renewed
        self._cert_dir = cert_dir

    async def ensure(self) -> x509.Certificate:
        """A valid certificate on disk: the stored one, or a freshly signed one."""
        cert = _still_good(self.cert_path, self.addresses)
        if cert is not None:
            log.info("node %s: reusing serving certificate %s", self.node_name, self.cert_path)
            return cert
        return await self._request()

    async def renew_forever(self) -> None:
        while True:
            cert = _still_good(self.cert_path, self.addresses) or await self.ensure()
            start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
            renew_at = start + (end - start) * 0.8
            wait = (renew_at - dt.datetime.now(dt.UTC)).total_seconds()
            await asyncio.sleep(max(wait, 1.0))
            await self._request()
            self.on_renewed(self.cert_path, self.key_path)

    async def _request(self) -> x509.Certificate:
        self._cert_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        request = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                        x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{self.node_name}"),
                    ]
                )
            )
            .add_extension(x509.SubjectAlternativeName(_sans(self.addresses)), critical=False)
            .sign(key, hashes.SHA256())
        )
        name = f"vkubelet-serving-{self.node_name}-{uuid.uuid4().hex[:8]}"
        body = {
            "apiVersion": "certificates.k8s.io/v1",
            "kind": "CertificateSigningRequest",
            "metadata": {"name": name},
            "spec": {
                "request": base64.b64encode(
                    request.public_bytes(serialization.Encoding.PEM)
                ).decode(),
                "signerName": SIGNER,
                "usages": ["digital signature", "server auth"],
            },
        }
        await self._client.create(_CSR_PATH, body)
        log.info("node %s: sent CSR %s for its serving certificate", self.node_name, name)
        if self._approve:
            await self._approve_csr(name)
        else:
            log.info(
                "waiting for CSR %s to be approved (kubectl certificate approve %s)", name, name
            )
        pem = await self._wait_signed(name)
        cert = x509.load_pem_x509_certificate(pem)
        _write_private(self.key_path, key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ))  # fmt: skip
        self.cert_path.write_bytes(pem)
        log.info(
            "node %s: serving certificate signed, valid until %s",
            self.node_name,
            cert.not_valid_after_utc.isoformat(),
        )
        return cert

    async def _approve_csr(self, name: str) -> None:
        csr = await self._client.get(f"{_CSR_PATH}/{name}")
        csr.setdefault("status", {})["conditions"] = [
            {
                "type": "Approved",
                "status": "True",
                "reason": "VkubeletSelfApproved",
                "message": "approved by vkubelet (--approve-own-csrs, for development clusters)",
            }
        ]
        await self._client.replace(f"{_CSR_PATH}/{name}/approval", csr)

    async def _wait_signed(self, name: str) -> bytes:
        delay = 0.2
        while True:
            try:
                csr = await self._client.get(f"{_CSR_PATH}/{name}")
            except (ApiError, Unreachable) as e:
                log.warning("CSR %s: %s", name, e)
            else:
                status = csr.get("status") or {}
                for condition in status.get("conditions") or []:
                    if condition.get("type") in ("Denied", "Failed"):
                        raise RuntimeError(
                            f"CSR {name} {condition['type'].lower()}: {condition.get('message')}"
                        )
                if status.get("certificate"):
                    return base64.b64decode(status["certificate"])
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 10.0)
