"""The node agent: node controller, pod controller and the provider API types the agent uses
(providers import them from `vkubelet.sdk`; the Kubernetes client stack the agent runs on is
`vkubelet.kube`)."""

from ..sdk.config import ConfigError, parse_taint
from ..sdk.provider import (
    ContainerLogOptions,
    FleetNode,
    NodeFleet,
    PodLifecycleHandler,
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
    "FleetNode",
    "NodeAgent",
    "NodeFleet",
    "NodeSettings",
    "NodeSpec",
    "PodController",
    "PodLifecycleHandler",
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
