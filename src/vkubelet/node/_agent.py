"""One virtual node's agent, and the configuration of a process serving many of them.

All nodes of a process share one API client (one connection pool) and one event loop; the
process itself (kubelet API servers, certificates, supervision) is `vkubelet.agent`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..kube import ClientOptions, EventRecorder, KubeClient
from ..sdk.provider import NodeConditions, PodLifecycleHandler, UsesUpperAPI
from ._nodecontroller import NodeController, NodeSettings
from ._podcontroller import PodController
from ._resolution import Resolver, ServiceCache


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
    workers: int = 96
    # The kubelet API (logs, exec, port-forward, stats) on each node's kubelet port.
    kubelet_api: bool = True
    tls_cert_file: Path | None = None  # serving certificate; default: obtained with a CSR
    tls_key_file: Path | None = None
    client_ca_file: Path | None = None  # verifies the apiserver's client certificate
    cert_dir: Path = field(
        default_factory=lambda: Path.home() / ".local" / "state" / "vkubelet" / "pki"
    )
    # Approve our own serving CSRs: True, False, or None (auto: on a vkubelet dev cluster).
    approve_csrs: bool | None = None
    # A bootstrap token kubeconfig: the agent then obtains its own system:node client
    # certificate and writes `kubeconfig` (default: <cert_dir>/<node>.kubeconfig) with it.
    bootstrap_kubeconfig: Path | None = None
    # Or the pod's own service account obtains it (`--bootstrap-in-cluster`, the chart's way);
    # that account then also writes the replicas' Leases (a node identity may not).
    bootstrap_in_cluster: bool = False
    insecure_kubelet_api: bool = False  # no authentication or authorization (loud warning)


class NodeAgent:
    """The node controller, pod controller and event recorder of one virtual node."""

    def __init__(
        self,
        client: KubeClient,
        settings: NodeSettings,
        provider: PodLifecycleHandler,
        *,
        services: ServiceCache,
        workers: int = 96,
        startup: asyncio.Semaphore | None = None,
        extra_conditions: Sequence[NodeConditions] = (),
    ) -> None:
        """`extra_conditions`: node conditions from the agent's other parts (its kubelet API,
        say), merged with the provider's and the node controller's own."""
        self.settings = settings
        self.provider = provider
        if isinstance(provider, UsesUpperAPI):
            provider.use_upper_api(client)
        # Shared by the nodes of one process: how many may be starting (registering, listing
        # their pods, adopting) at once. A thousand starting together would fill the event loop
        # with work that delays the lease renewals of the nodes already up.
        self._startup = startup or asyncio.Semaphore(1_000_000)
        self._services = services
        self.events = EventRecorder(client, component="vkubelet", host=settings.name)
        self.node = NodeController(client, settings, provider, extra_conditions=extra_conditions)
        resolver = functools.partial(
            Resolver,
            client,
            provider=provider,
            services=services,
            host_ip=settings.internal_ip,
            allocatable=lambda: self.node.allocatable,
        )
        self.pods = PodController(
            client, settings.name, provider, self.events, resolver, workers=workers
        )

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group, self._startup:
            self._services.start()  # every pod's env needs them: listed while the node registers
            group.create_task(self.events.run())
            group.create_task(self.node.run())
            # The pod list runs alongside the registration (a restart's critical path is their
            # sum otherwise); the provider's pods are adopted once the node is registered.
            group.create_task(self.pods.run(after=self.node.registered))
            await self.pods.ready.wait()
