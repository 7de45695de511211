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
from ._config import load_agent_config
from ._nodecontroller import NodeSettings
from ._registry import ProviderLoadError, UnknownProvider, available_providers, load_provider

__all__ = [
    "AgentConfig",
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
    "PodLifecycleHandler",
    "PodNotifier",
    "ProviderContext",
    "ProviderError",
    "ProviderLoadError",
    "ResolvedPod",
    "UnknownProvider",
    "available_providers",
    "load_agent_config",
    "load_provider",
    "parse_taint",
]
