"""The `Agent`: one process serving its nodes, from start to an orderly stop.

Start: build every provider (a bad config fails here, loudly), obtain the client identity,
connect, then run supervised: each node agent, each kubelet port's server and certificate, each
fleet. Stop (SIGTERM/SIGINT, see the CLI): the controllers stop, the kubelet servers close, and
every provider — single nodes and fleet members alike — is closed once with `aclose()`, leaving
its pods running for the next start to adopt.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import socket
import ssl
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..kube import KubeClient
from ..kubelet import KubeletAuth, KubeletServer
from ..node import (
    AgentConfig,
    ConfigError,
    NodeAgent,
    NodeFleet,
    NodeSettings,
    NodeSpec,
    PodLifecycleHandler,
    ServiceCache,
    ServingCertificate,
)
from ..sdk.provider import Closeable
from ..sdk.tasks import run_supervised
from . import _providers
from ._clientca import ClientCA
from ._fleet import FleetRunner
from ._identity import bootstrap_identity, identify
from ._leases import ReplicaOptions, fenced_client
from ._runner import NodeRunner
from ._serving import KubeletApiReadiness, ServingTLS, approves_own_csrs
from ._sharding import ShardRunner, check_shardable
from ._standby import StandbyHealth
from ._webhook import serve_webhook, webhooks

log = logging.getLogger(__name__)

# Nodes starting at once (registration, first pod list, adoption); the others wait their turn.
_STARTING_NODES = 32
# How long one provider's aclose() may take at shutdown before the agent gives up on it.
CLOSE_TIMEOUT_SECONDS = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        client: KubeClient | None = None,
        *,
        replicas: ReplicaOptions | None = None,
    ) -> None:
        """`replicas` with `shard`: this replica runs the share of the nodes it claims (see
        `_sharding`); leader election wraps whole agents instead (`run_leader_elected`)."""
        self.config = config
        self.replicas = replicas
        self.identity = bootstrap_identity(config)
        for spec in config.nodes:
            if spec.settings.kubelet_port == 0:  # tests and many-node setups: any free port
                spec.settings.kubelet_port = _free_port()
        sharded = replicas is not None and replicas.shard
        self._shard_specs = copy.deepcopy(config.nodes) if sharded else []
        if replicas is not None and replicas.shard:
            check_shardable(config, replicas)
        self.events = _providers.NodeEventRouter()
        # Providers are built up front so that a bad config fails the start, loudly.
        self.providers: list[PodLifecycleHandler] = []
        self._single: list[NodeSpec] = []
        self._fleet_specs: list[tuple[NodeSpec, NodeFleet]] = []
        for spec in config.nodes:
            built = _providers.build_provider(spec, self.events)
            if isinstance(built, NodeFleet):
                if self.identity is not None:
                    raise ConfigError(
                        f"{spec.settings.name}: a fleet of nodes cannot run under one node's "
                        "bootstrap identity; give the agent an identity with RBAC rights"
                    )
                self._fleet_specs.append((spec, built))
            else:
                self.providers.append(built)
                self._single.append(spec)
        if sharded and self._fleet_specs:
            raise ConfigError(
                f"{self._fleet_specs[0][0].settings.name}: --shard shares single nodes; a "
                "fleet's provider decides its nodes itself (run it with --leader-elect)"
            )
        self._client = client
        self.runners: list[NodeRunner] = []
        self.fleets: list[FleetRunner] = []
        self._port_tls: dict[int, asyncio.Future[ssl.SSLContext]] = {}  # for admission webhooks
        self.shard: ShardRunner | None = None
        self._client_ca = ClientCA(config.client_ca_file)
        self._tls: ServingTLS | None = None
        self._tls_lock = asyncio.Lock()
        self._auth: KubeletAuth | None = None
        self._services: ServiceCache | None = None
        self._startup = asyncio.Semaphore(_STARTING_NODES)
        # Providers closed already, by id: an entry leaves as its provider is freed, so a
        # later provider (a claimed node's, a fleet member's) that gets the same id is closed.
        self._closed: dict[int, weakref.ref[object] | object] = {}

    def use_client(self, client: KubeClient) -> None:
        """The client to run with (a fenced one, under a Lease), before `run()`."""
        self._client = client

    @property
    def client(self) -> KubeClient:
        assert self._client is not None, "the agent's client exists once run() started"
        return self._client

    # -- nodes --------------------------------------------------------------------------------
    def free_port(self) -> int:
        return _free_port()

    def make_node(
        self,
        settings: NodeSettings,
        provider: PodLifecycleHandler,
        readiness: KubeletApiReadiness | None,
    ) -> NodeAgent:
        """A node agent whose Ready condition also waits for its kubelet API (`readiness`)."""
        assert self._services is not None
        node = NodeAgent(
            self.client,
            settings,
            provider,
            services=self._services,
            workers=self.config.workers,
            startup=self._startup,
            extra_conditions=[readiness] if readiness is not None else [],
        )
        if readiness is not None:
            readiness.listen(node.node.notify_status_changed)
        self.events.add(settings.name, node.events)
        return node

    @property
    def nodes(self) -> list[NodeAgent]:
        """The configured nodes (not a fleet's, nor a shard's)."""
        return [node for runner in self.runners for node in runner.nodes]

    @property
    def servers(self) -> list[KubeletServer]:
        return [server for runner in self.runners for server in runner.servers]

    def node_exists(self, name: str) -> bool:
        return any(n.settings.name == name for n in self.nodes) or any(
            name in f.members or name in f.draining for f in self.fleets
        )

    async def own_kubeconfig(self) -> Path | None:
        """The kubeconfig the agent acts with: its node identity's, obtained first when it
        bootstraps one; else the configured one (None: found as client-go finds it)."""
        if self.identity is None:
            return self.config.kubeconfig
        await self.identity.ensure()
        return self.identity.kubeconfig

    async def _connect(self) -> None:
        """Get a client identity if bootstrapping, then the client and the node agents."""
        if self._client is None:
            kubeconfig = await self.own_kubeconfig()
            if self.replicas is not None and self.replicas.shard:
                self._client = fenced_client(kubeconfig, self.config.client, self._may_write)
            else:
                self._client = KubeClient.from_kubeconfig(kubeconfig, options=self.config.client)
        self._services = ServiceCache(self.client)  # one Service watch for all nodes
        if self.replicas is not None and self.replicas.shard:
            # The providers built at start only validated the config: each claim builds its
            # own, reading the backend as the node's last holder left it.
            await self.discard()
            self.shard = ShardRunner(self, self._shard_specs, self.replicas)
            return
        by_port: dict[int, list[tuple[NodeSettings, PodLifecycleHandler]]] = {}
        for spec, provider in zip(self._single, self.providers, strict=True):
            by_port.setdefault(spec.settings.kubelet_port, []).append((spec.settings, provider))
        self.runners = [
            NodeRunner(self, nodes, on_serving=functools.partial(self._port_serves, port))
            for port, nodes in by_port.items()
        ]
        self.fleets = [FleetRunner(self, spec, fleet) for spec, fleet in self._fleet_specs]

    def _may_write(self) -> bool:
        return self.shard is None or self.shard.may_write()

    async def identify(self) -> str:
        return await identify(self.client, self.nodes)

    # -- running and stopping -----------------------------------------------------------------
    async def run(self) -> None:
        """Run until cancelled; then stop in order (see the module's docstring)."""
        try:
            await self._connect()
            await self.identify()
            async with asyncio.TaskGroup() as group:

                def supervise(work: Callable[[], Awaitable[None]], name: str, task: str) -> None:
                    group.create_task(run_supervised(work, name=name, logger=log), name=task)

                if self.identity is not None:
                    identity, client = self.identity, self.client
                    renew = functools.partial(identity.renew_forever, client)
                    supervise(renew, "client certificate renewal", "identity")
                # Many nodes start spread over a few seconds rather than in one burst, which
                # would delay every node's first lease renewals behind a thousand registrations;
                # as many as may start at once start at once (a restart of a few nodes is on
                # the clock: its pods wait).
                count = len(self.nodes)
                spread = min(5.0 / count, 0.05) if count > _STARTING_NODES else 0.0
                started = 0
                for runner in self.runners:
                    group.create_task(
                        runner.run(delay=started * spread, spread=spread),
                        name=f"nodes on port {runner.port}",
                    )
                    started += len(runner.nodes)
                for node, webhook in webhooks(self.nodes):
                    port, name = node.settings.kubelet_port, node.settings.name
                    tls = (
                        functools.partial(self.port_tls, port) if self.config.kubelet_api else None
                    )
                    serve = functools.partial(serve_webhook, self.client, node, webhook, tls)
                    supervise(serve, f"admission webhook of {name}", f"webhook {name}")
                for fleet in self.fleets:
                    supervise(fleet.run, f"fleet {fleet.name}", f"fleet {fleet.name}")
                if self.shard is not None:
                    supervise(self.shard.run, "sharding", "shard")
                    if self.replicas is not None and self.replicas.health_port:
                        health = StandbyHealth(self.replicas.health_port, lambda: True)
                        await health.start()
                        group.create_task(_close_when_cancelled(health), name="health")
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        """Controllers are stopped (the task group is done); close servers, then providers."""
        log.info("stopping: closing the kubelet API and the providers")
        for fleet in self.fleets:
            await fleet.aclose()
        for runner in self.runners:  # stopped when their tasks ended, unless never started
            await runner.stop()
        for provider in self.providers:
            await self.close_provider(provider)
        self._client_ca.close()
        if self._services is not None:
            await self._services.aclose()
        if self._client is not None:
            await self._client.aclose()

    async def discard(self) -> None:
        """Close the providers of an agent that will not run them (built to validate a
        config)."""
        for provider in [*self.providers, *(fleet for _, fleet in self._fleet_specs)]:
            await self.close_provider(provider)

    async def close_provider(self, provider: object) -> None:
        """`aclose()` a provider once (if it has one); its failure is logged, never raised."""
        if id(provider) in self._closed or not isinstance(provider, Closeable):
            return
        key = id(provider)
        try:
            self._closed[key] = weakref.ref(provider, lambda _: self._closed.pop(key, None))
        except TypeError:  # not weakly referable: kept, so its id is not reused
            self._closed[key] = provider
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_SECONDS):
                await provider.aclose()
        except Exception:
            log.exception("closing provider %s failed", type(provider).__name__)

    # -- the kubelet API ------------------------------------------------------------------------
    def kubelet_auth(self) -> KubeletAuth:
        if self._auth is None:
            if self.config.insecure_kubelet_api:
                self._auth = KubeletAuth.insecure_allow_all()
            else:
                self._auth = KubeletAuth.webhook(self.client)
        return self._auth

    async def tls_context(
        self, name: str, addresses: list[str], on_csr: Callable[[str | None], None]
    ) -> tuple[ssl.SSLContext, ServingCertificate | None]:
        async with self._tls_lock:
            if self._tls is None:
                approve = await approves_own_csrs(self.client, self.config.approve_csrs)
                self._tls = ServingTLS(self.client, self.config, approve)
        client_ca = await self._client_ca.file(self.client)
        return await self._tls.context(name, addresses, client_ca, on_csr)

    async def port_tls(self, port: int) -> ssl.SSLContext:
        """The TLS context of a kubelet port, once it serves (an admission webhook shares it)."""
        return await asyncio.shield(self._port_tls.setdefault(port, asyncio.Future()))

    def _port_serves(self, port: int, context: ssl.SSLContext) -> None:
        ready = self._port_tls.setdefault(port, asyncio.Future())
        if not ready.done():
            ready.set_result(context)


async def _close_when_cancelled(health: StandbyHealth) -> None:
    try:
        await asyncio.Future()
    finally:
        await health.close()
