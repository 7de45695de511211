"""Where a provider comes from: an installed entry point, a module, or a file.

A third-party package ships a provider by declaring, in its pyproject.toml:

    [project.entry-points."vkubelet.providers"]
    mine = "my_package.provider:create"

where `create(context: ProviderContext)` returns an object implementing `PodLifecycleHandler`
(one node) or `NodeFleet` (a changing set of nodes, e.g. one per device).

For a first try no packaging is needed: `--provider my_package.provider:create` imports a module
from the Python path, and `--provider ./my_provider.py` (factory `create`) or
`--provider ./my_provider.py:make` loads a file. Every failure names what was given.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType

from ..sdk.provider import NodeFleet, PodLifecycleHandler, ProviderContext

GROUP = "vkubelet.providers"
DEFAULT_FACTORY = "create"


ProviderFactory = Callable[[ProviderContext], PodLifecycleHandler | NodeFleet]


class ProviderLoadError(Exception):
    """A provider cannot be loaded or built; the message says what was given and why."""


class UnknownProvider(ProviderLoadError, LookupError):
    """The provider given cannot be found or imported."""


def available_providers() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_provider(name: str) -> ProviderFactory:
    """The factory for `name`: an entry-point name, `module:factory`, `file.py[:factory]`."""
    providers = available_providers()
    if name in providers:
        factory: ProviderFactory = providers[name].load()
        return factory
    target, _, attribute = name.partition(":")
    if target.endswith(".py") or "/" in target:
        module = _load_file(name, Path(target).expanduser())
    elif attribute:
        module = _import(name, target)
    else:
        known = ", ".join(sorted(providers)) or "none installed"
        raise UnknownProvider(
            f"unknown provider {name!r}: not an installed provider ({known}), nor "
            "module:factory, nor a path to a .py file"
        )
    return _factory(name, module, attribute or DEFAULT_FACTORY)


def provider_label(given: str) -> str:
    """A name for the provider fit for a taint value and a label (the node's
    `virtual-kubelet.io/provider` taint): an entry point's name as it is, else the module's or
    the file's last name, e.g. `my_provider` for `./lab/my_provider.py:make`."""
    if ":" not in given and not given.endswith(".py") and "/" not in given:
        return given
    target = given.partition(":")[0]
    stem = Path(target).stem if target.endswith(".py") or "/" in target else target
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", stem.rsplit(".", 1)[-1])[:63].strip("-_.")
    return name or "custom"


def _import(given: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UnknownProvider(f"provider {given!r}: module {module_name!r} not found ({e})") from e
    except Exception as e:
        raise UnknownProvider(
            f"provider {given!r}: importing module {module_name!r} failed: {type(e).__name__}: {e}"
        ) from e


def _load_file(given: str, path: Path) -> ModuleType:
    if not path.is_file():
        raise UnknownProvider(f"provider {given!r}: no such file {str(path)!r}")
    module_name = f"vkubelet_provider_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UnknownProvider(f"provider {given!r}: {str(path)!r} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise UnknownProvider(
            f"provider {given!r}: loading {str(path)!r} failed: {type(e).__name__}: {e}"
        ) from e
    return module


def _factory(given: str, module: ModuleType, attribute: str) -> ProviderFactory:
    try:
        factory = getattr(module, attribute)
    except AttributeError:
        raise UnknownProvider(
            f"provider {given!r}: module {module.__name__!r} has no attribute {attribute!r}"
        ) from None
    if not callable(factory):
        raise UnknownProvider(
            f"provider {given!r}: {module.__name__}.{attribute} is not callable "
            f"(a {type(factory).__name__})"
        )
    checked: ProviderFactory = factory
    return checked
