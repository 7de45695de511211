"""The vkubelet process: node agents, their kubelet API servers and certificates, one event loop.

This module sits above both `vkubelet.node` (node and pod controllers) and `vkubelet.kubelet` (the
HTTPS API), which do not know each other: it builds each node's provider, starts the kubelet API
on each port with a serving certificate from the CSR API (or given files), and supervises the
node agents so that one node's failure never stops the others.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path

from .kubelet import KubeletAuth, KubeletNode, KubeletServer, serve_nodes, server_ssl_context
from .node import AgentConfig, ApiError, ConfigError, KubeClient, NodeAgent, NodeSpec, Unreachable
from .node._certs import ClientIdentity, ServingCertificate
from .node._registry import ProviderContext, load_provider
from .node._resolution import ServiceCache
from .node.provider import PodLifecycleHandler

log = logging.getLogger(__name__)


def build_provider(spec: NodeSpec) -> PodLifecycleHandler:
    factory = load_provider(spec.settings.provider)
    return factory(
        ProviderContext(
            node_name=spec.settings.name,
            config_path=spec.provider_config,
            internal_ip=spec.settings.internal_ip,
            kubelet_port=spec.settings.kubelet_port,
        )
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


class Agent:
    def __init__(self, config: AgentConfig, client: KubeClient | None = None) -> None:
        self.config = config
        self.identity: ClientIdentity | None = None
        if config.bootstrap_kubeconfig is not None:
            if len(config.nodes) != 1:
                raise ConfigError("a bootstrap kubeconfig gives one node identity: serve one node")
            name = config.nodes[0].settings.name
            self.identity = ClientIdentity(
                kubeconfig=config.kubeconfig or config.cert_dir / f"{name}.kubeconfig",
                bootstrap=config.bootstrap_kubeconfig,
                node_name=name,
            )
        for spec in config.nodes:
            if spec.settings.kubelet_port == 0:  # tests and many-node setups: any free port
                spec.settings.kubelet_port = _free_port()
        # Providers are built up front so that a bad config fails the start, loudly.
        self.providers = [build_provider(spec) for spec in config.nodes]
        self._client = client
        self.nodes: list[NodeAgent] = []
        self.servers: list[KubeletServer] = []

    @property
    def client(self) -> KubeClient:
        assert self._client is not None, "the agent's client exists once run() started"
        return self._client

    async def _connect(self) -> None:
        """Get a client identity if bootstrapping, then the client and the node agents."""
        kubeconfig = self.config.kubeconfig
        if self.identity is not None:
            await self.identity.ensure()
            kubeconfig = self.identity.kubeconfig
        if self._client is None:
            self._client = KubeClient.from_kubeconfig(kubeconfig, options=self.config.client)
        services = ServiceCache(self.client)  # one Service watch for all nodes
        self.nodes = [
            NodeAgent(
                self.client,
                spec.settings,
                provider,
                services=services,
                workers=self.config.workers,
            )
            for spec, provider in zip(self.config.nodes, self.providers, strict=True)
        ]

    async def identify(self) -> str:
        """Who the apiserver says we are; a node identity switches on NodeRestriction's rules.

        Waits (with back-off, saying so) while the apiserver is unreachable.
        """
        backoff = 0.5
        while True:
            try:
                review = await self.client.create(
                    "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                    {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
                )
                break
            except Unreachable as e:
                log.warning("apiserver unreachable (%s); retrying in %.1fs", e, backoff)
            except ApiError as e:
                log.warning("cannot tell who we are (%s); assuming an unrestricted identity", e)
                return ""
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30)
        user: str = review.get("status", {}).get("userInfo", {}).get("username", "")
        if user.startswith("system:node:"):
            own = user.removeprefix("system:node:")
            for node in self.nodes:
                node.settings.node_restricted = True
                if node.settings.name != own:
                    log.error(
                        "running as %s, which may only manage node %s, not %s: use one agent "
                        "(or one identity) per node, or an identity with RBAC rights",
                        user,
                        own,
                        node.settings.name,
                    )
            log.info("running as %s under the Node authorizer and NodeRestriction", user)
        return user

    async def run(self) -> None:
        await self._connect()
        await self.identify()
        try:
            async with asyncio.TaskGroup() as group:
                if self.identity is not None:
                    group.create_task(self.identity.renew_forever(self.client))
                # Many nodes start spread over a few seconds rather than in one burst, which
                # would delay every node's first lease renewals behind a thousand registrations.
                spread = min(5.0 / max(len(self.nodes), 1), 0.05)
                for index, node in enumerate(self.nodes):
                    group.create_task(
                        _supervise(node, delay=index * spread), name=f"node {node.settings.name}"
                    )
                if self.config.kubelet_api:
                    group.create_task(self._serve_kubelet_api(), name="kubelet API")
        finally:
            for server in self.servers:
                await server.close()
            await self.client.aclose()

    async def _serve_kubelet_api(self) -> None:
        """Start the kubelet API of every port; retried until it works, never fatal to pods."""
        backoff = 1.0
        while True:
            try:
                await self._start_servers()
                return
            except (ApiError, Unreachable, OSError, ssl.SSLError, RuntimeError) as e:
                log.error("kubelet API not started: %s; retrying in %.0fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 60)

    async def _start_servers(self) -> None:
        config = self.config
        by_port: dict[int, list[NodeAgent]] = {}
        for node in self.nodes:
            by_port.setdefault(node.settings.kubelet_port, []).append(node)
        client_ca = await self._client_ca_file()
        renewals = []
        for port, nodes in by_port.items():
            if config.tls_cert_file and config.tls_key_file:
                cert, key = config.tls_cert_file, config.tls_key_file
                certificate = None
            else:
                addresses = [a for n in nodes for a in n.settings.address_list()]
                certificate = ServingCertificate(
                    self.client,
                    node_name=nodes[0].settings.name,
                    addresses=addresses,
                    cert_dir=config.cert_dir,
                    approve=config.approve_csrs,
                )
                await certificate.ensure()
                cert, key = certificate.cert_path, certificate.key_path
            context = server_ssl_context(cert, key, client_ca_file=client_ca)
            auth = (
                KubeletAuth.insecure_allow_all()
                if config.insecure_kubelet_api
                else KubeletAuth.webhook(self.client)
            )
            kubelet_nodes = [
                KubeletNode(
                    n.settings.name,
                    n.provider,
                    pods=_pod_source(n),
                    port=port,
                    addresses=tuple(n.settings.address_list()),
                )
                for n in nodes
            ]
            for server in serve_nodes(kubelet_nodes, ssl_context=context, auth=auth):
                await server.start()
                self.servers.append(server)
            if certificate is not None:
                certificate.on_renewed = _reloader(context)
                renewals.append(asyncio.create_task(certificate.renew_forever()))
        if renewals:
            await asyncio.gather(*renewals)

    async def _client_ca_file(self) -> Path | None:
        """The CA that signs the apiserver's kubelet client certificate.

        In order: `clientCAFile` from the config; the cluster's own statement of it (ConfigMap
        kube-system/extension-apiserver-authentication, readable with the right RBAC); the
        kubeconfig's CA, which is the same CA in kubeadm-style and vkubelet dev clusters.
        """
        if self.config.client_ca_file is not None:
            return self.config.client_ca_file
        pem: bytes | None = None
        try:
            cm = await self.client.get(
                "/api/v1/namespaces/kube-system/configmaps/extension-apiserver-authentication"
            )
            text = (cm.get("data") or {}).get("client-ca-file")
            pem = text.encode() if text else None
        except ApiError as e:
            log.info("cannot read the cluster's client CA (%s); using the kubeconfig's CA", e)
        if pem is None:
            data = self.client.config.cluster.certificate_auth_data
            if data:
                pem = base64.b64decode(data)
            elif self.client.config.cluster.certificate_auth:
                return Path(self.client.config.cluster.certificate_auth)
        if pem is None:
            log.warning("no client CA: the kubelet API accepts only bearer tokens")
            return None
        directory = Path(tempfile.mkdtemp(prefix="vkubelet-ca-"))
        path = directory / "client-ca.crt"
        path.write_bytes(pem)
        return path


def _reloader(context: ssl.SSLContext) -> Callable[[Path, Path], None]:
    """New connections get the renewed certificate; open ones keep theirs."""

    def reload(cert: Path, key: Path) -> None:
        context.load_cert_chain(cert, key)
        log.info("serving certificate renewed")

    return reload


def _pod_source(node: NodeAgent) -> Callable[[], list[bytes]]:
    def pods() -> list[bytes]:
        return [record.raw for record in node.pods.reflector.items.values()]

    return pods


async def _supervise(node: NodeAgent, *, delay: float = 0.0) -> None:
    await asyncio.sleep(delay)
    backoff = 1.0
    while True:
        try:
            await node.run()
            return
        except* Exception as group:
            log.error(
                "node %s crashed; restarting in %.0fs",
                node.settings.name,
                backoff,
                exc_info=group.exceptions[0],
            )
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 60)
