"""The kubelet API of each port: its serving certificate, its server, and the node condition
that says whether it answers.

Ready must mean that the kubelet API answers (clients that trust Ready would otherwise get
"connection refused" from `kubectl logs/exec`). Until a port serves, each node on it carries
Ready=False with reason `KubeletAPINotServing` and a message saying why: the CSR waiting for
approval and the command that approves it, or the error that keeps the port from listening.

Who approves the serving CSR: the cluster's operator, as for any kubelet; the agent itself when
told to (`--approve-own-csrs`), or by default on a vkubelet dev cluster, which marks itself with
the ConfigMap kube-public/vkubelet-dev-cluster (no one else would ever approve it there).
"""

from __future__ import annotations

import base64
import logging
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography import x509

from ..kube import ApiError, KubeClient
from ..kubelet import KubeletAuth, KubeletNode, KubeletServer, serve_nodes, server_ssl_context
from ..node import (
    SIGNER,
    AgentConfig,
    NodeAgent,
    ServingCertificate,
    cluster_cert_dir,
    load_ca_bundle,
)
from ..sdk.provider import NodeCondition

log = logging.getLogger(__name__)

DEV_CLUSTER_MARKER = "/api/v1/namespaces/kube-public/configmaps/vkubelet-dev-cluster"
NOT_SERVING = "KubeletAPINotServing"


class KubeletApiReadiness:
    """A node condition source (`NodeConditions`): Ready=False until the node's port serves."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.serving = False
        self.csr: str | None = None
        self.error: str | None = None
        self._listeners: list[Callable[[], None]] = []

    def listen(self, callback: Callable[[], None]) -> None:
        """`callback()` runs at every change (a node controller's `notify_status_changed`)."""
        self._listeners.append(callback)

    def node_conditions(self) -> Sequence[NodeCondition]:
        if self.serving:
            return ()
        return (NodeCondition("Ready", "False", NOT_SERVING, self.message()),)

    def message(self) -> str:
        if self.csr is not None:
            return (
                f"the kubelet API (port {self.port}) waits for its serving certificate: CSR "
                f"{self.csr} needs approval (kubectl certificate approve {self.csr})"
            )
        if self.error is not None:
            return f"the kubelet API (port {self.port}) cannot start: {self.error}"
        return f"the kubelet API (port {self.port}) is starting"

    def waiting_for(self, csr: str | None) -> None:
        self.csr = csr
        self._changed()

    def failed(self, error: str) -> None:
        self.error = error
        self._changed()

    def set_serving(self) -> None:
        self.serving, self.csr, self.error = True, None, None
        self._changed()

    def _changed(self) -> None:
        for callback in self._listeners:
            callback()


async def approves_own_csrs(client: KubeClient, setting: bool | None) -> bool:
    """Whether we approve our own serving CSRs: as set, or (None: auto) on a vkubelet dev cluster.

    Unreachable propagates (the caller retries); any other answer about the marker means no.
    """
    if setting is not None:
        return setting
    try:
        marker = await client.get(DEV_CLUSTER_MARKER)
    except ApiError as e:
        if not (e.not_found or e.status == 403):
            log.info("cannot tell whether this is a vkubelet dev cluster (%s)", e)
        return False
    name = (marker.get("data") or {}).get("name", "?")
    if not await _may_approve_serving_csrs(client):
        log.info(
            "vkubelet dev cluster %s, but our identity may not approve CSRs (a node identity "
            "never may): a cluster admin approves our serving CSR",
            name,
        )
        return False
    log.info("vkubelet dev cluster %s: approving our own serving CSRs", name)
    return True


_APPROVAL_RIGHTS = (
    {
        "group": "certificates.k8s.io",
        "resource": "certificatesigningrequests",
        "subresource": "approval",
        "verb": "update",
    },
    {
        "group": "certificates.k8s.io",
        "resource": "signers",
        "verb": "approve",
        "name": SIGNER,
    },
)


async def _may_approve_serving_csrs(client: KubeClient) -> bool:
    """Asked with SelfSubjectAccessReviews; an apiserver that cannot tell lets us try (a refused
    approval is then logged, and the CSR waits for an admin)."""
    for attributes in _APPROVAL_RIGHTS:
        try:
            review = await client.create(
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": attributes},
                },
            )
        except ApiError as e:
            log.debug("cannot review our rights (%s); trying to approve anyway", e)
            return True
        if not (review.get("status") or {}).get("allowed"):
            return False
    return True


def cluster_ca(client: KubeClient) -> tuple[bytes | None, list[x509.Certificate]]:
    """The kubeconfig's CA (PEM) and its certificates: what our serving certificates must be
    signed by, and what names this cluster's subdirectory of the cert dir."""
    cluster = client.config.cluster
    pem: bytes | None = None
    if cluster.certificate_auth_data:
        pem = base64.b64decode(cluster.certificate_auth_data)
    elif cluster.certificate_auth:
        try:
            pem = Path(cluster.certificate_auth).read_bytes()
        except OSError as e:
            log.warning("cannot read the cluster CA %s: %s", cluster.certificate_auth, e)
    return pem, load_ca_bundle(pem)


class ServingTLS:
    """TLS contexts for kubelet ports: given files, or certificates from CSRs kept under this
    cluster's subdirectory of the cert dir."""

    def __init__(self, client: KubeClient, config: AgentConfig, approve: bool) -> None:
        self._client = client
        self._config = config
        self._approve = approve
        pem, self._ca = cluster_ca(client)
        self.cert_dir = cluster_cert_dir(config.cert_dir, pem, client.config.cluster.server)

    async def context(
        self,
        name: str,
        addresses: list[str],
        client_ca: Path | None,
        on_csr: Callable[[str | None], None],
    ) -> tuple[ssl.SSLContext, ServingCertificate | None]:
        """The TLS context of a port, and the certificate to renew (None for given files).
        Renewals reach the context: new connections get the new certificate."""
        config = self._config
        if config.tls_cert_file and config.tls_key_file:
            context = server_ssl_context(
                config.tls_cert_file, config.tls_key_file, client_ca_file=client_ca
            )
            return context, None
        certificate = ServingCertificate(
            self._client,
            node_name=name,
            addresses=addresses,
            cert_dir=self.cert_dir,
            cluster_ca=self._ca,
            approve=self._approve,
            on_csr=on_csr,
        )
        await certificate.ensure()
        context = server_ssl_context(
            certificate.cert_path, certificate.key_path, client_ca_file=client_ca
        )
        certificate.on_renewed = reloader(context)
        return context, certificate


def reloader(context: ssl.SSLContext) -> Callable[[Path, Path], None]:
    """New connections get the renewed certificate; open ones keep theirs."""

    def reload(cert: Path, key: Path) -> None:
        context.load_cert_chain(cert, key)
        log.info("serving certificate renewed")

    return reload


async def start_servers(
    nodes: Sequence[KubeletNode],
    context: ssl.SSLContext,
    auth: KubeletAuth,
    readiness: KubeletApiReadiness,
) -> list[KubeletServer]:
    """Listen for `nodes`; all or nothing: servers started before a failure are closed again,
    so a retry never finds its own ports taken."""
    started: list[KubeletServer] = []
    try:
        for server in serve_nodes(nodes, ssl_context=context, auth=auth):
            await server.start()
            started.append(server)
    except BaseException as e:
        for server in started:
            await server.close()
        if isinstance(e, Exception):
            readiness.failed(f"{type(e).__name__}: {e}")
        raise
    readiness.set_serving()
    return started


def kubelet_node(node: NodeAgent, port: int) -> KubeletNode:
    def pods() -> list[bytes]:
        return [record.raw for record in node.pods.reflector.items.values()]

    return KubeletNode(
        node.settings.name,
        node.provider,
        pods=pods,
        port=port,
        addresses=tuple(node.settings.address_list()),
    )
