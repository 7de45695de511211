"""`vkubelet vm import`: a VirtualMachine for a libvirt domain vkubelet did not make.

Import is a VirtualMachine field (`spec.importDomain`), not a one-off action: the node that
runs the VM's pod checks and starts the domain (only it reaches that libvirt host), every later
power-on starts the same domain again, and the VirtualMachine's deletion applies the policy.
So the manifest can live in Git like any other; the command only writes it for a domain and a
node, creates it, and waits for the node's verdict: Running, or the refusal's reason (the
domain unchanged), in which case it deletes the VirtualMachine it created, so that a failed
import leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from typing import Any, Final

from ..kube import NODES, ApiError, KubeClient
from ._base import API_VERSION, condition_of
from ._resources import VirtualMachine

__all__ = ["IMPORT_IMAGE", "ImportResult", "import_manifest", "import_vm", "vm_name_for"]

#: The template's image for an imported domain: never pulled (the domain boots its own disks),
#: there because a VirtualMachine's template names one.
IMPORT_IMAGE: Final = "vm.vkubelet.io/imported"
#: The pod reasons with which a node refuses an import (`providers.vm._domainimport`,
#: `_provider`): final until the domain or the VirtualMachine changes.
REFUSALS: Final = frozenset(
    {"DomainNotFound", "DomainOwned", "DomainUnsupported", "UnsupportedByRuntime", "InvalidVMSpec"}
)
_NAME: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def vm_name_for(domain: str) -> str:
    """A VirtualMachine name for a domain name (lowercased, other characters as '-'); ValueError
    when none can be made (then `--name` says it)."""
    name = re.sub(r"[^a-z0-9-]+", "-", domain.lower()).strip("-")[:63].strip("-")
    if not _NAME.fullmatch(name):
        raise ValueError(f"no VirtualMachine name can be made from {domain!r}: give --name")
    return name


def import_manifest(
    domain: str,
    node: str,
    *,
    name: str,
    namespace: str,
    deletion_policy: str = "Retain",
    replicas: int = 1,
    cpu: str | None = None,
    memory: str | None = None,
) -> dict[str, Any]:
    """The VirtualMachine: the domain on `node`'s libvirt host. `cpu`/`memory` are what the
    scheduler counts (the domain keeps its own size); none given, the node's defaults."""
    container: dict[str, Any] = {"name": "vm", "image": IMPORT_IMAGE}
    limits = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v}
    if limits:
        container["resources"] = {"limits": limits}
    return {
        "apiVersion": API_VERSION,
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "importDomain": {"name": domain, "deletionPolicy": deletion_policy},
            "template": {
                "metadata": {"labels": {"vm.vkubelet.io/imported": "true"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [container],
                },
            },
        },
    }


@dataclass(frozen=True)
class ImportResult:
    running: bool  # the domain runs as the VM's pod
    reason: str  # Running, a refusal's reason, Created (not waited for) or Timeout
    message: str


def _verdict(vm: dict[str, Any]) -> ImportResult | None:
    """What the VM's status says of the import so far (None: not decided yet)."""
    status = vm.get("status") or {}
    if status.get("phase") == "Running":
        pod, node = status.get("podName"), status.get("nodeName")
        return ImportResult(True, "Running", f"runs as pod {pod} on node {node}")
    ready = condition_of(vm, "Ready")
    if ready.get("reason") in REFUSALS:
        return ImportResult(False, str(ready["reason"]), str(ready.get("message") or ""))
    if status.get("phase") == "Failed" and (failure := status.get("lastFailure")):
        return ImportResult(False, str(failure.get("reason")), str(failure.get("message")))
    return None


async def import_vm(
    client: KubeClient, manifest: dict[str, Any], *, wait_seconds: float | None
) -> ImportResult:
    """Create the VirtualMachine (a node that does not exist or a VirtualMachine of that name
    is an error, nothing created); with `wait_seconds`, until it runs or its node refuses the
    import, which deletes it again."""
    meta = manifest["metadata"]
    namespace, name = str(meta["namespace"]), str(meta["name"])
    node = manifest["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    try:
        await client.get(NODES.path(name=node))
    except ApiError as e:
        if e.status == 404:
            raise ValueError(f"--node: there is no node {node!r}") from None
        if e.status != 403:  # (whoever may not read nodes imports unchecked)
            raise
    try:
        await client.create(VirtualMachine.path(namespace), manifest)
    except ApiError as e:
        if e.status == 409:
            raise ValueError(
                f"virtualmachine {namespace}/{name} exists already: give another --name"
            ) from None
        raise
    if wait_seconds is None or not manifest["spec"]["replicas"]:
        return ImportResult(False, "Created", "created; it is checked at its first power-on")
    path = VirtualMachine.path(namespace, name)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_seconds):
            while True:  # the node's verdict arrives in the VM's status: polled, once a second
                if (verdict := _verdict(dict(await client.get(path)))) is not None:
                    break
                await asyncio.sleep(1.0)
            if not verdict.running:  # refused: nothing of the import stays
                await client.delete(path)
            return verdict
    ready = condition_of(dict(await client.get(path)), "Ready")
    return ImportResult(
        False,
        "Timeout",
        f"not running after {wait_seconds:g} s (Ready: {ready.get('reason')}: "
        f"{ready.get('message')}); virtualmachine {namespace}/{name} is left as it is",
    )
