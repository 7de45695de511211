"""The kubelet serving certificate, obtained and renewed through the CSR API, like a kubelet does.

The reference implementation wants certificate files made by hand with openssl (its most
reported set-up problem). vkubelet asks the cluster instead: it sends a CertificateSigningRequest
for signer `kubernetes.io/kubelet-serving` as `system:node:<name>` with the node's addresses as
SANs, waits for approval (or approves it itself on a vkubelet dev cluster, or when told to), keeps
the result in its cert directory so a restart reuses it, and renews it at 80 % of its lifetime.

Stored certificates are kept apart per cluster (a subdirectory named after the cluster CA's
fingerprint) and checked before reuse: signed by the current cluster's CA, matching their key,
covering the node's addresses. A certificate from an earlier dev cluster of the same name, or
from another cluster altogether, would otherwise be served and refused by the apiserver
("x509: certificate signed by unknown authority").

While a CSR waits for approval, a warning with the exact `kubectl certificate approve` command is
logged every minute: a kubelet API that never comes up must never be a silent mystery.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import ipaddress
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from lightkube.config.kubeconfig import KubeConfig

from .._files import write_atomic, write_kubeconfig, write_private
from ..kube import ApiError, KubeClient, Unreachable, load_kubeconfig, service_account_kubeconfig
from ..sdk.retry import Backoff

log = logging.getLogger(__name__)

SIGNER = "kubernetes.io/kubelet-serving"
CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
# What the CSR of each purpose asks for: its signer and its extended key usage.
_PURPOSES = {"serving": (SIGNER, "server auth"), "client": (CLIENT_SIGNER, "client auth")}
_CSR_PATH = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
# How often a CSR that nobody approves is brought up again in the log.
PENDING_REMINDER_SECONDS = 60.0
# Renewal retries: a failed renewal is retried after this, doubling up to the maximum, while the
# current certificate keeps serving.
RENEW_RETRY_SECONDS = 5.0
RENEW_RETRY_MAX_SECONDS = 300.0


def cluster_cert_dir(cert_dir: Path, ca_pem: bytes | None, server: str) -> Path:
    """The subdirectory of `cert_dir` for one cluster: named after its CA's fingerprint (or its
    server's URL without a CA), so certificates of different clusters never meet."""
    ca = load_ca_bundle(ca_pem)
    if ca:
        digest = hashlib.sha256(b"".join(c.fingerprint(hashes.SHA256()) for c in ca)).hexdigest()
    else:
        digest = hashlib.sha256(server.encode()).hexdigest()
    return cert_dir / f"cluster-{digest[:16]}"


def load_ca_bundle(pem: bytes | None) -> list[x509.Certificate]:
    """The certificates of a PEM bundle; none for None or unreadable data."""
    if not pem:
        return []
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []


def _issued_by_one_of(cert: x509.Certificate, cas: Sequence[x509.Certificate]) -> bool:
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False


def _key_matches(cert: x509.Certificate, key_path: Path) -> bool:
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return False
    der = serialization.Encoding.DER
    info = serialization.PublicFormat.SubjectPublicKeyInfo
    return key.public_key().public_bytes(der, info) == cert.public_key().public_bytes(der, info)


def _sans(addresses: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for address in dict.fromkeys(addresses):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(address)))
        except ValueError:
            names.append(x509.DNSName(address))
    return names


def stored_certificate_problem(
    cert_path: Path,
    key_path: Path,
    addresses: Sequence[str],
    cluster_ca: Sequence[x509.Certificate] = (),
) -> str | None:
    """Why the stored certificate cannot be reused (None: it can). It must exist, have more than
    20 % of its life left, cover `addresses`, match its key and, when the cluster's CA is known,
    be signed by it."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except OSError:
        return "none stored"
    except ValueError:
        return "unreadable"
    if dt.datetime.now(dt.UTC) > _renewal_due(cert):
        return "due for renewal"
    try:
        present = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "no subject alternative names"
    if not set(_sans(addresses)) <= set(present):
        return "does not cover the node's addresses"
    if not _key_matches(cert, key_path):
        return "its key is missing or does not match"
    if cluster_ca and not _issued_by_one_of(cert, cluster_ca):
        return "not signed by the current cluster's CA"
    return None


def _load(cert_path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(cert_path.read_bytes())


def _renewal_due(cert: x509.Certificate) -> dt.datetime:
    """80 % into the certificate's lifetime, when a kubelet renews: a failed renewal leaves a
    fifth of the lifetime for retries while the current certificate still works."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * 0.8


async def _sleep_until(moment: dt.datetime) -> None:
    await asyncio.sleep(max((moment - dt.datetime.now(dt.UTC)).total_seconds(), 1.0))


class ServingCertificate:
    """One serving certificate for one kubelet port (all its nodes' addresses as SANs)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        addresses: Sequence[str],
        cert_dir: Path,
        cluster_ca: Sequence[x509.Certificate] = (),
        approve: bool = False,
        on_renewed: Callable[[Path, Path], None] = lambda cert, key: None,
        on_csr: Callable[[str | None], None] = lambda name: None,
    ) -> None:
        """`cert_dir` is this cluster's directory (see `cluster_cert_dir`); `on_csr` hears the
        name of a CSR sent and waiting for its certificate, then None once it is signed."""
        self._client = client
        self.node_name = node_name
        self.addresses = list(addresses)
        self.cert_path = cert_dir / f"{node_name}-serving.crt"
        self.key_path = cert_dir / f"{node_name}-serving.key"
        self._cluster_ca = list(cluster_ca)
        self._approve = approve
        self.on_renewed = on_renewed
        self.on_csr = on_csr
        self.retry_seconds = RENEW_RETRY_SECONDS

    async def ensure(self) -> x509.Certificate:
        """A valid certificate on disk: the stored one, or a freshly signed one."""
        problem = stored_certificate_problem(
            self.cert_path, self.key_path, self.addresses, self._cluster_ca
        )
        if problem is None:
            log.info("node %s: reusing serving certificate %s", self.node_name, self.cert_path)
            return _load(self.cert_path)
        if problem != "none stored":
            log.info(
                "node %s: stored serving certificate %s not reused (%s); requesting a new one",
                self.node_name,
                self.cert_path,
                problem,
            )
        return await self._request()

    async def renew_forever(self) -> None:
        """Renew at 80 % of the lifetime. A failed renewal is retried with back-off while the
        current certificate keeps serving; it never ends this loop."""
        cert = _load(self.cert_path)
        backoff = Backoff(initial=self.retry_seconds, cap=RENEW_RETRY_MAX_SECONDS)
        while True:
            await _sleep_until(_renewal_due(cert))
            try:
                cert = await self._request()
                self.on_renewed(self.cert_path, self.key_path)
            except Exception as e:  # any failure: retried, the current certificate serves
                delay = backoff.next_delay()
                log.warning(
                    "node %s: serving certificate renewal failed (%s); the current one serves "
                    "until %s; retrying in %.0fs",
                    self.node_name,
                    e,
                    cert.not_valid_after_utc.isoformat(),
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            backoff.reset()

    async def _request(self) -> x509.Certificate:
        self.cert_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            key_pem, pem = await request_certificate(
                self._client,
                node_name=self.node_name,
                purpose="serving",
                sans=_sans(self.addresses),
                approve=self._approve,
                on_sent=self.on_csr,
            )
        finally:
            self.on_csr(None)
        # Key first, then the certificate: a reader that sees the new certificate finds its key.
        write_private(self.key_path, key_pem)
        write_atomic(self.cert_path, pem)
        return x509.load_pem_x509_certificate(pem)


async def request_certificate(
    client: KubeClient,
    *,
    node_name: str,
    purpose: str,
    sans: Sequence[x509.GeneralName] = (),
    approve: bool = False,
    on_sent: Callable[[str], None] = lambda name: None,
) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) for `system:node:<name>` from the CSR API.

    With `approve`, the CSR is approved with our own identity; if that is refused (no rights),
    we wait for someone else to approve it, saying how.
    """
    signer, usage = _PURPOSES[purpose]
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
            "usages": ["digital signature", usage],
        },
    }
    await client.create(_CSR_PATH, body)
    log.info("node %s: sent CSR %s for its %s certificate", node_name, name, purpose)
    on_sent(name)
    approved = False
    if approve:
        try:
            await _approve_csr(client, name)
            approved = True
        except ApiError as e:
            log.warning("node %s: cannot approve CSR %s ourselves: %s", node_name, name, e)
    # A client certificate is the controller-manager's to approve (bootstrap tokens): say so only
    # when it takes long. A serving certificate is nobody's to approve by default: say so now.
    remind_now = purpose == "serving" and not approved
    pem = await _wait_signed(client, name, node_name, purpose, remind_now)
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


async def _wait_signed(
    client: KubeClient, name: str, node_name: str, purpose: str, remind_now: bool
) -> bytes:
    """The signed certificate, once there. A WARNING with the approve command comes at once
    with `remind_now`, else after a minute, and then every minute while it is pending."""
    backoff = Backoff(initial=0.2, factor=1.5, cap=10.0, jitter=0.0)
    next_reminder = time.monotonic() + (0.0 if remind_now else PENDING_REMINDER_SECONDS)
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
            approved = any(c.get("type") == "Approved" for c in status.get("conditions") or [])
            if not approved and time.monotonic() >= next_reminder:
                log.warning(
                    "node %s: CSR %s for its %s certificate is waiting for approval; a cluster "
                    "admin approves it with: kubectl certificate approve %s",
                    node_name,
                    name,
                    purpose,
                    name,
                )
                next_reminder = time.monotonic() + PENDING_REMINDER_SECONDS
        await backoff.wait()


def _cluster_of(kubeconfig: Path | KubeConfig) -> tuple[str, bytes] | None:
    """(server, CA PEM) of a kubeconfig's current cluster; None if unreadable."""
    try:
        loaded = kubeconfig if isinstance(kubeconfig, KubeConfig) else load_kubeconfig(kubeconfig)
        config = loaded.get()
        if config is None:
            return None
        cluster = config.cluster
        if cluster.certificate_auth_data:
            ca = base64.b64decode(cluster.certificate_auth_data)
        elif cluster.certificate_auth:
            ca = Path(cluster.certificate_auth).read_bytes()
        else:
            ca = b""
    except (OSError, KeyError, ValueError, TypeError, yaml.YAMLError):
        return None
    return cluster.server, ca


class ClientIdentity:
    """The agent's own client certificate, obtained like a kubelet's `--bootstrap-kubeconfig`.

    With a bootstrap token the agent asks for `system:node:<name>` (the controller-manager
    approves it when the cluster allows bootstrappers to, as kubeadm clusters do), writes a
    kubeconfig with the signed certificate, and renews it with its own identity at 80 % of its
    lifetime. A valid certificate already in the kubeconfig is reused across restarts.

    `bootstrap_in_cluster`: the pod's service account asks instead of a bootstrap token (the
    chart's way: the controller-manager approves it when the account may create
    `certificatesigningrequests/nodeclient`, the right it checks for bootstrap tokens too).
    """

    def __init__(
        self,
        *,
        kubeconfig: Path,
        bootstrap: Path | None,
        node_name: str,
        bootstrap_in_cluster: bool = False,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.bootstrap = bootstrap
        self.bootstrap_in_cluster = bootstrap_in_cluster
        self.node_name = node_name

    def _bootstrap_config(self) -> KubeConfig | None:
        if self.bootstrap_in_cluster:
            return service_account_kubeconfig()
        return None if self.bootstrap is None else load_kubeconfig(self.bootstrap)

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
        if dt.datetime.now(dt.UTC) > _renewal_due(cert):
            return None
        bootstrap = self._bootstrap_config()
        if bootstrap is not None and _cluster_of(bootstrap) != _cluster_of(self.kubeconfig):
            # Another cluster now (say after `dev cluster down && up`): this identity is void.
            log.info(
                "node %s: %s is for another cluster than %s; obtaining a new identity",
                self.node_name,
                self.kubeconfig,
                "the service account's" if self.bootstrap_in_cluster else self.bootstrap,
            )
            return None
        return cert

    async def ensure(self) -> None:
        if self.current() is not None:
            log.info(
                "node %s: reusing the client certificate in %s", self.node_name, self.kubeconfig
            )
            return
        bootstrap = self._bootstrap_config()
        context = None if bootstrap is None else bootstrap.get()
        if context is None:
            raise RuntimeError(
                f"{self.kubeconfig} holds no valid client certificate for system:node:"
                f"{self.node_name}, and no bootstrap kubeconfig was given to obtain one"
            )
        async with KubeClient(context) as client:
            await self._obtain(client)

    async def renew_forever(self, client: KubeClient) -> None:
        """Renew with the current identity; `client` switches to the new certificate. A failed
        renewal is retried with back-off while the current certificate still works; it never
        ends this loop (nor the process)."""
        backoff = Backoff(initial=RENEW_RETRY_SECONDS, cap=RENEW_RETRY_MAX_SECONDS)
        while True:
            cert = self.current()
            if cert is not None:
                await _sleep_until(_renewal_due(cert))
            try:
                await self._obtain(client)
                renewed = load_kubeconfig(self.kubeconfig).get()
            except Exception as e:
                delay = backoff.next_delay()
                log.warning(
                    "node %s: client certificate renewal failed (%s); retrying in %.0fs",
                    self.node_name,
                    e,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            if renewed is not None:
                client.reload(renewed)

    async def _obtain(self, client: KubeClient) -> None:
        key_pem, cert_pem = await request_certificate(
            client, node_name=self.node_name, purpose="client"
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
