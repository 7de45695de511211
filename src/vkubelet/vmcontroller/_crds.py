"""The three CRDs, shipped as YAML in the package, and their installation.

Installed with server-side apply (field manager `vkubelet`), so running the command again after
an upgrade changes what changed and leaves other managers' fields alone; then we wait until the
apiserver says each is Established, so that the next `kubectl apply` of a VirtualMachine works.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any

import yaml

from ..kube import APPLY_PATCH, CUSTOM_RESOURCE_DEFINITIONS, KubeClient
from ._base import condition_of

__all__ = ["CRD_FILES", "crd_documents", "crd_yaml", "install_crds"]

CRD_FILES = ("virtualmachines.yaml", "virtualmachinebackups.yaml", "virtualmachinemigrations.yaml")
FIELD_MANAGER = "vkubelet"


def crd_yaml() -> str:
    """All three CRDs as one multi-document YAML (what `vkubelet vm install-crds --print` shows)."""
    folder = resources.files(__package__).joinpath("crds")
    return "---\n".join(folder.joinpath(name).read_text() for name in CRD_FILES)


def crd_documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(crd_yaml()) if doc]


async def install_crds(client: KubeClient, *, wait: float = 60.0) -> list[str]:
    """Apply the CRDs and wait until each is Established; the names installed."""
    names = []
    for doc in crd_documents():
        name = doc["metadata"]["name"]
        await client.request(
            "PATCH",
            CUSTOM_RESOURCE_DEFINITIONS.path(name=name),
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=doc,
            content_type=APPLY_PATCH,
        )
        names.append(name)
    deadline = time.monotonic() + wait
    for name in names:
        while True:
            crd = await client.get(CUSTOM_RESOURCE_DEFINITIONS.path(name=name))
            if condition_of(crd, "Established").get("status") == "True":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not Established after {wait:g}s")
            await asyncio.sleep(0.2)
    return names
