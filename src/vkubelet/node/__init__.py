"""The node agent: node controller, pod controller and the provider API (the Kubernetes client
stack it runs on is `vkubelet.kube`)."""

from ..sdk.config import ConfigError, parse_taint
from ..sdk.provider import (
    ContainerLogOptions,
    ContainerLogs,
    FleetNode,
    NodeConfigurer,
    NodeFleet,
    NodeProvider,
    NodeStatusNotifier,
    PodLifecycleHandler,
    PodNotifier,
    ProviderContext,
    ProviderError,
    ResolvedPod,
)
from ._agent import AgentConfig, NodeAgent, NodeSpec
from ._certs import SIGNER, ClientIdentity, ServingCertificate, cluster_cert_dir, load_ca_bundle
from ._config import load_agent_config
from ._nodecontroller import NodeSettings
from ._podcontroller import PodController
from ._podrecord import PodRecord
from ._registry import (
    ProviderLoadError,
    UnknownProvider,
    available_providers,
    load_provider,
    provider_label,
)
from ._resolution import Resolver, ServiceCache

__all__ = [
    "SIGNER",
    "AgentConfig",
    "ClientIdentity",
    "ConfigError",
    "ContainerLogOptions",
    "ContainerLogs",
    "FleetNode",
    "NodeAgent",
    "NodeConfigurer",
    "NodeFleet",
    "NodeProvider",
    "NodeSettings",
    "NodeSpec",
    "NodeStatusNotifier",
    "PodController",
    "PodLifecycleHandler",
    "PodNotifier",
    "PodRecord",
    "ProviderContext",
    "ProviderError",
    "ProviderLoadError",
    "ResolvedPod",
    "Resolver",
    "ServiceCache",
    "ServingCertificate",
    "UnknownProvider",
    "available_providers",
    "cluster_cert_dir",
    "load_agent_config",
    "load_ca_bundle",
    "load_provider",
    "parse_taint",
    "provider_label",
]
