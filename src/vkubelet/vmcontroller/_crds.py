"""The three CRDs, shipped as YAML in the package, and their installation.

Installed with server-side apply (field manager `vkubelet`), so running the command again after
an upgrade changes what changed and leaves other managers' fields alone; then we wait until the
apiserver says each is Established, so that the next `kubectl apply` of a VirtualMachine works.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any, cast

import yaml
from lightkube import AsyncClient
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition

__all__ = ["CRD_FILES", "crd_documents", "crd_yaml", "install_crds"]

CRD_FILES = ("virtualmachines.yaml", "virtualmachinebackups.yaml", "virtualmachinemigrations.yaml")
FIELD_MANAGER = "vkubelet"


def crd_yaml() -> str:
    """All three CRDs as one multi-document YAML (what `vkubelet vm install-crds --print` shows)."""
    folder = resources.files(__package__).joinpath("crds")
    return "---\n".join(folder.joinpath(name).read_text() for name in CRD_FILES)


def crd_documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(crd_yaml()) if doc]


async def install_crds(client: AsyncClient, *, wait: float = 60.0) -> list[str]:
    """Apply the CRDs and wait until each is Established; the names installed."""
    names = []
    for doc in crd_documents():
        crd = cast(CustomResourceDefinition, CustomResourceDefinition.from_dict(doc))
        await client.apply(crd, field_manager=FIELD_MANAGER, force=True)
        names.append(doc["metadata"]["name"])
    deadline = time.monotonic() + wait
    for name in names:
        while True:
            crd = await client.get(CustomResourceDefinition, name)
            conditions = crd.status.conditions if crd.status else None
            if any(c.type == "Established" and c.status == "True" for c in conditions or ()):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not Established after {wait:g}s")
            await asyncio.sleep(0.2)
    return names
