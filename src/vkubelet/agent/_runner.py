"""One node run: its node agent and its kubelet API, from start to stop (what Go's
`nodeutil.Node` is).

A process runs nodes three ways (its configured nodes, a fleet's members, a claimed shard's
nodes) that differ only in where a node's settings and provider come from and in how its port
gets a TLS context: the runner is given those, and runs and stops all of them alike. A runner
may carry several nodes, as a process's configured nodes may share a kubelet port.

Runners, fleets and shards know the process only as a `NodeHost`: the `Agent` owns them, and
they do not import it back.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ..kube import KubeClient
from ..kubelet import KubeletAuth, KubeletServer
from ..node import AgentConfig, NodeAgent, NodeSettings, PodLifecycleHandler, ServingCertificate
from ..sdk.tasks import run_supervised
from ._providers import NodeEventRouter
from ._serving import KubeletApiReadiness, kubelet_node, start_servers

log = logging.getLogger(__name__)

# Called with the port readiness's `waiting_for`, so that a CSR waiting for approval shows.
OnCsr = Callable[[str | None], None]
TlsSource = Callable[[OnCsr], Awaitable[tuple[ssl.SSLContext, ServingCertificate | None]]]


class NodeHost(Protocol):
    """The process (the `Agent`), as its runners, fleets and shards use it."""

    config: AgentConfig
    events: NodeEventRouter

    @property
    def client(self) -> KubeClient: ...

    def free_port(self) -> int: ...

    def node_exists(self, name: str) -> bool: ...

    def make_node(
        self,
        settings: NodeSettings,
        provider: PodLifecycleHandler,
        readiness: KubeletApiReadiness | None,
    ) -> NodeAgent: ...

    def kubelet_auth(self) -> KubeletAuth: ...

    async def tls_context(
        self, name: str, addresses: list[str], on_csr: OnCsr
    ) -> tuple[ssl.SSLContext, ServingCertificate | None]: ...

    async def close_provider(self, provider: object) -> None: ...


class NodeRunner:
    """Nodes on one kubelet port (usually one node), run until cancelled, then stopped in order:
    their controllers, their server, their providers."""

    def __init__(
        self,
        host: NodeHost,
        nodes: Sequence[tuple[NodeSettings, PodLifecycleHandler]],
        *,
        tls: TlsSource | None = None,
        on_serving: Callable[[ssl.SSLContext], None] | None = None,
    ) -> None:
        """`tls`: how the port gets its context (by default a serving certificate for the
        nodes' addresses, renewed while the runner runs); `on_serving`: told once it listens."""
        self._host = host
        self.port = nodes[0][0].kubelet_port
        self.readiness = KubeletApiReadiness(self.port) if host.config.kubelet_api else None
        self.nodes = [host.make_node(s, provider, self.readiness) for s, provider in nodes]
        self.servers: list[KubeletServer] = []
        # False for a provider that outlives this run (a fleet member restarted with its own).
        self.close_providers = True
        self._tls = tls or self._certificate_for_nodes
        self._on_serving = on_serving
        self._certificate: ServingCertificate | None = None
        self._stopped = False

    async def run(self, *, delay: float = 0.0, spread: float = 0.0) -> None:
        """The nodes start after `delay`, `spread` apart. One node failing restarts that node
        (with back-off), not the others nor the kubelet API, and vice versa."""
        try:
            async with asyncio.TaskGroup() as group:
                for index, node in enumerate(self.nodes):
                    start = delay + index * spread
                    group.create_task(_run_node(node, start), name=f"node {node.settings.name}")
                if self.readiness is not None:
                    name = f"kubelet API on port {self.port}"
                    if len(self.nodes) == 1:
                        name = f"kubelet API of {self.nodes[0].settings.name}"
                    group.create_task(run_supervised(self._serve, name=name, logger=log))
        finally:
            await self.stop()

    async def _serve(self) -> None:
        """Certificate, listen, renew: retried from the start (by the supervisor) if obtaining
        the certificate or listening fails, so that a CSR the apiserver was too busy for does
        not restart the nodes and pause their heartbeats; a failed renewal only retries itself."""
        assert self.readiness is not None
        if not self.servers:  # once listening, a retry never binds again
            context, self._certificate = await self._tls(self.readiness.waiting_for)
            self.servers = await start_servers(
                [kubelet_node(node, self.port) for node in self.nodes],
                context,
                self._host.kubelet_auth(),
                self.readiness,
            )
            if self._on_serving is not None:
                self._on_serving(context)
        if self._certificate is not None:
            await self._certificate.renew_forever()  # a node run past its certificate's life

    async def _certificate_for_nodes(
        self, on_csr: OnCsr
    ) -> tuple[ssl.SSLContext, ServingCertificate | None]:
        addresses = [a for node in self.nodes for a in node.settings.address_list()]
        return await self._host.tls_context(self.nodes[0].settings.name, addresses, on_csr)

    async def stop(self) -> None:
        """Close the servers, then the providers (once; a later call does nothing). Called when
        `run()` ends, and by an owner that cancelled `run()` perhaps before it started."""
        if self._stopped:
            return
        self._stopped = True
        for server in self.servers:
            await server.close()
        self.servers = []
        for node in self.nodes:
            self._host.events.remove(node.settings.name)
            if self.close_providers:
                await self._host.close_provider(node.provider)


async def _run_node(node: NodeAgent, delay: float) -> None:
    """One node agent, forever: restarted (with back-off) when it fails, never taking the
    process or the other nodes with it."""
    await asyncio.sleep(delay)
    await run_supervised(node.run, name=f"node {node.settings.name}", logger=log)
