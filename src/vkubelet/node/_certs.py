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
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from lightkube.config.kubeconfig import KubeConfig

from .._files import write_kubeconfig, write_private
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
        key_pem, pem = await request_certificate(
            self._client,
            node_name=self.node_name,
            signer=SIGNER,
            usages=["digital signature", "server auth"],
            sans=_sans(self.addresses),
            approve=self._approve,
            purpose="serving",
        )
        write_private(self.key_path, key_pem)
        self.cert_path.write_bytes(pem)
        return x509.load_pem_x509_certificate(pem)


async def request_certificate(
    client: KubeClient,
    *,
    node_name: str,
    signer: str,
    usages: list[str],
    sans: list[x509.GeneralName],
    approve: bool,
    purpose: str,
) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) for `system:node:<name>` from the CSR API."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node_name}"),
            ]
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    request = builder.sign(key, hashes.SHA256())
    name = f"vkubelet-{purpose}-{node_name}-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "spec": {
            "request": base64.b64encode(request.public_bytes(serialization.Encoding.PEM)).decode(),
            "signerName": signer,
            "usages": usages,
        },
    }
    await client.create(_CSR_PATH, body)
    log.info("node %s: sent CSR %s for its %s certificate", node_name, name, purpose)
    if approve:
        await _approve_csr(client, name)
    else:
        log.info("waiting for CSR %s to be approved (kubectl certificate approve %s)", name, name)
    pem = await _wait_signed(client, name)
    cert = x509.load_pem_x509_certificate(pem)
    log.info(
        "node %s: %s certificate signed, valid until %s",
        node_name,
        purpose,
        cert.not_valid_after_utc.isoformat(),
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, pem


async def _approve_csr(client: KubeClient, name: str) -> None:
    csr = await client.get(f"{_CSR_PATH}/{name}")
    csr.setdefault("status", {})["conditions"] = [
        {
            "type": "Approved",
            "status": "True",
            "reason": "VkubeletSelfApproved",
            "message": "approved by vkubelet (--approve-own-csrs, for development clusters)",
        }
    ]
    await client.replace(f"{_CSR_PATH}/{name}/approval", csr)


async def _wait_signed(client: KubeClient, name: str) -> bytes:
    delay = 0.2
    while True:
        try:
            csr = await client.get(f"{_CSR_PATH}/{name}")
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


CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"


class ClientIdentity:
    """The agent's own client certificate, obtained like a kubelet's `--bootstrap-kubeconfig`.

    With a bootstrap token the agent asks for `system:node:<name>` (the controller-manager
    approves it when the cluster allows bootstrappers to, as kubeadm clusters do), writes a
    kubeconfig with the signed certificate, and renews it with its own identity at 80 % of its
    lifetime. A valid certificate already in the kubeconfig is reused across restarts.
    """

    def __init__(self, *, kubeconfig: Path, bootstrap: Path | None, node_name: str) -> None:
        self.kubeconfig = kubeconfig
        self.bootstrap = bootstrap
        self.node_name = node_name

    def current(self) -> x509.Certificate | None:
        """The kubeconfig's certificate, if it is ours and has more than 20 % of its life left."""
        try:
            config = yaml.safe_load(self.kubeconfig.read_text())
            user = config["users"][0]["user"]
            cert = x509.load_pem_x509_certificate(base64.b64decode(user["client-certificate-data"]))
        except (OSError, KeyError, IndexError, TypeError, ValueError, yaml.YAMLError):
            return None
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not names or names[0].value != f"system:node:{self.node_name}":
            return None
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        if dt.datetime.now(dt.UTC) > start + (end - start) * 0.8:
            return None
        return cert

    async def ensure(self) -> None:
        if self.current() is not None:
            log.info(
                "node %s: reusing the client certificate in %s", self.node_name, self.kubeconfig
            )
            return
        if self.bootstrap is None:
            raise RuntimeError(
                f"{self.kubeconfig} holds no valid client certificate for system:node:"
                f"{self.node_name}, and no bootstrap kubeconfig was given to obtain one"
            )
        client = KubeClient.from_kubeconfig(self.bootstrap)
        try:
            await self._obtain(client)
        finally:
            await client.aclose()

    async def renew_forever(self, client: KubeClient) -> None:
        """Renew with the current identity; `client` switches to the new certificate."""
        while True:
            cert = self.current()
            if cert is not None:
                start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
                wait = (start + (end - start) * 0.8 - dt.datetime.now(dt.UTC)).total_seconds()
                await asyncio.sleep(max(wait, 1.0))
            await self._obtain(client)
            renewed = KubeConfig.from_file(self.kubeconfig).get()
            if renewed is not None:
                client.reload(renewed)

    async def _obtain(self, client: KubeClient) -> None:
        key_pem, cert_pem = await request_certificate(
            client,
            node_name=self.node_name,
            signer=CLIENT_SIGNER,
            usages=["digital signature", "client auth"],
            sans=[],
            approve=False,
            purpose="client",
        )
        cluster = client.config.cluster
        if cluster.certificate_auth_data:
            ca = base64.b64decode(cluster.certificate_auth_data)
        else:  # a CA file next to the bootstrap kubeconfig: small, read once
            ca = Path(cluster.certificate_auth or "").read_bytes()  # noqa: ASYNC240
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        write_kubeconfig(
            self.kubeconfig,
            cluster="default",
            server=cluster.server,
            ca_pem=ca,
            user=f"system:node:{self.node_name}",
            cert_pem=cert_pem,
            key_pem=key_pem,
        )
