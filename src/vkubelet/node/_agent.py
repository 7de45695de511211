"""One process, many virtual nodes: each with its own provider, lease, pods and events.

All nodes share one API client (one HTTP/2 connection pool) and one event loop. A node whose
provider crashes is restarted with back-off; the others carry on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ._events import EventRecorder
from ._kube import ClientOptions, KubeClient
from ._nodecontroller import NodeController, NodeSettings
from ._podcontroller import PodController
from ._registry import ProviderContext, load_provider
from ._resolution import Resolver, ServiceCache
from .provider import PodLifecycleHandler

log = logging.getLogger(__name__)


@dataclass
class NodeSpec:
    """One virtual node in the agent's configuration."""

    settings: NodeSettings
    provider_config: Path | None = None


@dataclass
class AgentConfig:
    nodes: list[NodeSpec]
    kubeconfig: Path | None = None
    client: ClientOptions = field(default_factory=ClientOptions)
    workers: int = 32


class NodeAgent:
    """The node controller, pod controller and event recorder of one virtual node."""

    def __init__(
        self,
        client: KubeClient,
        settings: NodeSettings,
        provider: PodLifecycleHandler,
        *,
        services: ServiceCache,
        workers: int = 32,
    ) -> None:
        self.settings = settings
        self.provider = provider
        self.events = EventRecorder(client, component="vkubelet", host=settings.name)
        self.node = NodeController(client, settings, provider)
        host_ip = next(
            (a["address"] for a in settings.addresses if a.get("type") == "InternalIP"),
            "127.0.0.1",
        )
        self.pods = PodController(
            client,
            settings.name,
            provider,
            self.events,
            lambda objects: Resolver(
                client,
                objects,
                provider,
                services,
                host_ip=host_ip,
                allocatable=lambda: self.node.allocatable,
            ),
            workers=workers,
        )

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.events.run())
            group.create_task(self.node.run())
            await self.node.registered.wait()
            group.create_task(self.pods.run())


def build_provider(spec: NodeSpec) -> PodLifecycleHandler:
    factory = load_provider(spec.settings.provider)
    internal_ip = next(
        (a["address"] for a in spec.settings.addresses if a.get("type") == "InternalIP"),
        "127.0.0.1",
    )
    return factory(
        ProviderContext(
            node_name=spec.settings.name,
            config_path=spec.provider_config,
            internal_ip=internal_ip,
            kubelet_port=spec.settings.kubelet_port,
        )
    )


class Agent:
    def __init__(self, config: AgentConfig, client: KubeClient | None = None) -> None:
        self.config = config
        self.client = client or KubeClient.from_kubeconfig(config.kubeconfig, options=config.client)
        # Providers are built up front so that a bad config fails the start, loudly.
        services = ServiceCache(self.client)  # one Service watch for all nodes
        self.nodes = [
            NodeAgent(
                self.client,
                spec.settings,
                build_provider(spec),
                services=services,
                workers=config.workers,
            )
            for spec in config.nodes
        ]

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for node in self.nodes:
                    group.create_task(_supervise(node), name=f"node {node.settings.name}")
        finally:
            await self.client.aclose()


async def _supervise(node: NodeAgent) -> None:
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
