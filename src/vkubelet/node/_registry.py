"""Providers are found by name through the `vkubelet.providers` entry-point group.

A third-party package ships a provider by declaring, in its pyproject.toml:

    [project.entry-points."vkubelet.providers"]
    mine = "my_package.provider:create"

where `create(context: ProviderContext)` returns an object implementing `PodLifecycleHandler`
(one node) or `NodeFleet` (a changing set of nodes, e.g. one per device).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from ..sdk.provider import NodeFleet, PodLifecycleHandler, ProviderContext

GROUP = "vkubelet.providers"


ProviderFactory = Callable[[ProviderContext], PodLifecycleHandler | NodeFleet]


class UnknownProvider(LookupError):
    pass


def available_providers() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_provider(name: str) -> ProviderFactory:
    providers = available_providers()
    if name not in providers:
        known = ", ".join(sorted(providers)) or "none installed"
        raise UnknownProvider(f"unknown provider {name!r} (available: {known})")
    factory: ProviderFactory = providers[name].load()
    return factory
