"""The vkubelet process: node agents, their kubelet API servers and certificates, one event loop.

This module sits above both `vkubelet.node` (node and pod controllers) and `vkubelet.kubelet` (the
HTTPS API), which do not know each other: it builds each node's provider, starts the kubelet API
on each port with a serving certificate from the CSR API (or given files), and supervises the
node agents so that one node's failure never stops the others.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import socket
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from .kubelet import KubeletAuth, KubeletNode, KubeletServer, serve_nodes, server_ssl_context
from .node import AgentConfig, ApiError, ConfigError, KubeClient, NodeAgent, NodeSpec, Unreachable
from .node._certs import ClientIdentity, ServingCertificate
from .node._registry import load_provider
from .node._resolution import ServiceCache
from .sdk.provider import FleetNode, NodeFleet, PodLifecycleHandler, ProviderContext

log = logging.getLogger(__name__)


# Nodes starting at once (registration, first pod list, adoption); the others wait their turn.
_STARTING_NODES = 32


def build_provider(spec: NodeSpec) -> PodLifecycleHandler | NodeFleet:
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
        self.providers: list[PodLifecycleHandler] = []
        self._single: list[NodeSpec] = []
        self.fleets: list[tuple[NodeSpec, NodeFleet]] = []
        for spec in config.nodes:
            built = build_provider(spec)
            if isinstance(built, NodeFleet):
                if self.identity is not None:
                    raise ConfigError(
                        f"{spec.settings.name}: a fleet of nodes cannot run under one node's "
                        "bootstrap identity; give the agent an identity with RBAC rights"
                    )
                self.fleets.append((spec, built))
            else:
                self.providers.append(built)
                self._single.append(spec)
        self._client = client
        self.nodes: list[NodeAgent] = []
        self.servers: list[KubeletServer] = []
        self._fleet_members: dict[str, _Member] = {}
        self._servers_ready = asyncio.Event()
        self._fleet_tls: dict[str, ssl.SSLContext] = {}  # fleet name -> its serving context
        self._auth: KubeletAuth | None = None
        self._services: ServiceCache | None = None
        self._startup = asyncio.Semaphore(_STARTING_NODES)

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
        self._services = ServiceCache(self.client)  # one Service watch for all nodes
        self.nodes = [
            NodeAgent(
                self.client,
                spec.settings,
                provider,
                services=self._services,
                workers=self.config.workers,
                startup=self._startup,
            )
            for spec, provider in zip(self._single, self.providers, strict=True)
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
                else:
                    self._servers_ready.set()
                for spec, fleet in self.fleets:
                    group.create_task(
                        self._run_fleet(spec, fleet), name=f"fleet {spec.settings.name}"
                    )
        finally:
            for member in self._fleet_members.values():
                member.task.cancel()
            for server in [*self.servers, *(m.server for m in self._fleet_members.values())]:
                if server is not None:
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
        by_port: dict[int, list[NodeAgent]] = {}
        for node in self.nodes:
            by_port.setdefault(node.settings.kubelet_port, []).append(node)
        client_ca = await self._client_ca_file()
        renewals = []
        self._auth = self._kubelet_auth()
        for spec, _ in self.fleets:
            # Every member of a fleet is served at the fleet's address, each on a port of its
            # own (so node-level requests such as /stats/summary reach the right member): one
            # certificate for the address serves them all.
            context, certificate = await self._serving_context(
                spec.settings.name, spec.settings.address_list(), client_ca
            )
            self._fleet_tls[spec.settings.name] = context
            if certificate is not None:
                renewals.append(asyncio.create_task(certificate.renew_forever()))
        self._servers_ready.set()
        for port, nodes in by_port.items():
            addresses = [a for n in nodes for a in n.settings.address_list()]
            context, certificate = await self._serving_context(
                nodes[0].settings.name, addresses, client_ca
            )
            kubelet_nodes = [_kubelet_node(n, port) for n in nodes]
            auth = self._auth
            for server in serve_nodes(kubelet_nodes, ssl_context=context, auth=auth):
                await server.start()
                self.servers.append(server)
            if certificate is not None:
                renewals.append(asyncio.create_task(certificate.renew_forever()))
        if renewals:
            await asyncio.gather(*renewals)

    def _kubelet_auth(self) -> KubeletAuth:
        if self.config.insecure_kubelet_api:
            return KubeletAuth.insecure_allow_all()
        return KubeletAuth.webhook(self.client)

    async def _serving_context(
        self, name: str, addresses: list[str], client_ca: Path | None
    ) -> tuple[ssl.SSLContext, ServingCertificate | None]:
        """The TLS context of a kubelet port: given files, or a certificate from a CSR (whose
        renewals reach the context: new connections get the new certificate)."""
        config = self.config
        if config.tls_cert_file and config.tls_key_file:
            return server_ssl_context(
                config.tls_cert_file, config.tls_key_file, client_ca_file=client_ca
            ), None
        certificate = ServingCertificate(
            self.client,
            node_name=name,
            addresses=addresses,
            cert_dir=config.cert_dir,
            approve=config.approve_csrs,
        )
        await certificate.ensure()
        context = server_ssl_context(
            certificate.cert_path, certificate.key_path, client_ca_file=client_ca
        )
        certificate.on_renewed = _reloader(context)
        return context, certificate

    # -- fleets -------------------------------------------------------------------------------
    async def _run_fleet(self, spec: NodeSpec, fleet: NodeFleet) -> None:
        """Keep one node agent per member of the fleet: start new members, drain gone ones,
        and restart (without draining) the agent of a member that changed."""
        mine: set[str] = set()
        drains: dict[str, asyncio.Task[None]] = {}
        async for members in fleet.watch_nodes():
            wanted = {m.name: m for m in members}
            for name in sorted(mine - set(wanted)):
                mine.discard(name)
                drains[name] = asyncio.create_task(self._drain(name), name=f"drain {name}")
            for name, member in wanted.items():
                running = self._fleet_members.get(name)
                if name in mine and running is not None:
                    if running.member is not member:
                        await self._stop_member(name)
                        await self._start_member(spec, member)
                    continue
                if name in drains:
                    await drains.pop(name)  # gone and back: the old node finishes draining first
                elif name in self._fleet_members or any(
                    n.settings.name == name for n in self.nodes
                ):
                    log.error("fleet %s: node %s exists already; skipped", spec.settings.name, name)
                    continue
                mine.add(name)
                await self._start_member(spec, member)
            for name in [n for n, t in drains.items() if t.done()]:
                drains.pop(name)

    async def _stop_member(self, name: str) -> None:
        member = self._fleet_members.pop(name)
        member.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await member.task
        if member.server is not None:
            await member.server.close()
        closer = getattr(member.node.provider, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()

    async def _start_member(self, spec: NodeSpec, member: FleetNode) -> None:
        settings = dataclasses.replace(
            spec.settings,
            name=member.name,
            labels={**spec.settings.labels, **member.labels},
            taints=[dict(t) for t in member.taints]
            if member.taints is not None
            else spec.settings.taints,
            addresses=[dict(a) for a in spec.settings.addresses],
            kubelet_port=_free_port() if self.config.kubelet_api else 0,
        )
        assert self._services is not None
        node = NodeAgent(
            self.client,
            settings,
            member.provider,
            services=self._services,
            workers=self.config.workers,
            startup=self._startup,
        )
        server: KubeletServer | None = None
        if self.config.kubelet_api:
            await self._servers_ready.wait()
            assert self._auth is not None
            [server] = serve_nodes(
                [_kubelet_node(node, settings.kubelet_port)],
                ssl_context=self._fleet_tls[spec.settings.name],
                auth=self._auth,
            )
            await server.start()
        task = asyncio.create_task(_supervise(node), name=f"node {member.name}")
        self._fleet_members[member.name] = _Member(member, node, task, server)
        log.info("fleet %s: node %s started", spec.settings.name, member.name)

    async def _drain(self, name: str) -> None:
        """A member left its fleet: cordon its node, evict its pods, then delete the node.

        The node's agent keeps running meanwhile, so the evicted pods stop gracefully on the
        member's backend; disruption budgets are respected (an eviction they refuse is retried).
        """
        member = self._fleet_members[name]
        path = f"/api/v1/nodes/{name}"
        log.info("node %s left its fleet: draining it", name)
        await _until_done(
            f"node {name}: cordon",
            lambda: self.client.patch(path, {"spec": {"unschedulable": True}}),
        )
        while pods := [r for r in member.node.pods.reflector.items.values()]:
            for record in pods:
                if record.deleting:
                    continue
                eviction = {
                    "apiVersion": "policy/v1",
                    "kind": "Eviction",
                    "metadata": {"name": record.name, "namespace": record.namespace},
                }
                with contextlib.suppress(Unreachable):
                    try:
                        await self.client.create(
                            f"/api/v1/namespaces/{record.namespace}/pods/{record.name}/eviction",
                            eviction,
                        )
                    except ApiError as e:
                        if e.status == 429:
                            log.info(
                                "node %s: eviction of %s/%s refused for now: %s",
                                name,
                                record.namespace,
                                record.name,
                                e,
                            )
                        elif not e.not_found:
                            log.warning(
                                "node %s: cannot evict %s/%s: %s",
                                name,
                                record.namespace,
                                record.name,
                                e,
                            )
            await asyncio.sleep(2)
        await self._stop_member(name)
        await _until_done(f"node {name}: delete", lambda: self.client.delete(path))
        log.info("node %s drained and deleted", name)

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


async def _until_done(what: str, call: Callable[[], Awaitable[object]]) -> None:
    """Retry an API call until it succeeds or its object is gone (both mean: done)."""
    while True:
        try:
            await call()
            return
        except ApiError as e:
            if e.not_found:
                return
            log.warning("%s failed (%s); retrying", what, e)
        except Unreachable:
            pass
        await asyncio.sleep(5)


@dataclasses.dataclass
class _Member:
    member: FleetNode
    node: NodeAgent
    task: asyncio.Task[None]
    server: KubeletServer | None


def _kubelet_node(node: NodeAgent, port: int) -> KubeletNode:
    return KubeletNode(
        node.settings.name,
        node.provider,
        pods=_pod_source(node),
        port=port,
        addresses=tuple(node.settings.address_list()),
    )


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
