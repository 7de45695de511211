"""What every reconciler of the VM controller shares: the protocol, the context, the names, and
the few reads and writes they all make (a missing object is an answer there, not an error).

A reconciler is level-triggered: it is handed a (namespace, name), reads the objects it needs
from the apiserver (never from memory kept between calls), takes the next step and returns. The
controller calls it again when a watched object changes, after the delay it returned, or at the
periodic resync, so a controller restarted in the middle of an operation finishes or rolls it
back from what the objects say.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

import msgspec

from ..kube import NODES, PODS, ApiError, EventRecorder, KubeClient, Resource, label_selector
from ..sdk.scheduling import tolerates

__all__ = [
    "BACKUP_OF_ANNOTATION",
    "MACHINE_ANNOTATION",
    "MIGRATE_TO_ANNOTATION",
    "MIGRATION_SOURCE_ANNOTATION",
    "NAME_LABEL",
    "POWER_OFF_ANNOTATION",
    "ROOT_DISK_SIZE_ANNOTATION",
    "TERMINAL",
    "VM_TOLERATION",
    "Context",
    "PodWatcher",
    "Reconciler",
    "Watched",
    "annotations_of",
    "condition_of",
    "controller_ref",
    "delete_pod",
    "meta_of",
    "nodes_by_name",
    "patch_pod",
    "read",
    "require_on_node",
    "template_spec",
    "vm_pods",
    "write_status",
]

T = TypeVar("T")

API_VERSION: Final = "vkubelet.io/v1alpha1"
NAME_LABEL: Final = "vm.vkubelet.io/name"  # on a VM's pod: the VirtualMachine's name
MACHINE_ANNOTATION: Final = "vm.vkubelet.io/machine"  # the VirtualMachine's uid: its disks
POWER_OFF_ANNOTATION: Final = "vm.vkubelet.io/power-off"  # Shutdown | Hibernate, before delete
ROOT_DISK_SIZE_ANNOTATION: Final = "vm.vkubelet.io/root-disk-size"
MIGRATION_SOURCE_ANNOTATION: Final = "vm.vkubelet.io/migration-source"  # on a migration target
MIGRATE_TO_ANNOTATION: Final = "vm.vkubelet.io/migrate-to"  # on a migrating source pod
BACKUP_OF_ANNOTATION: Final = "vm.vkubelet.io/backup-of"  # on a backup pod
TERMINAL: Final = ("Succeeded", "Failed")  # the phases a pod (or a backup, a migration) ends in
#: The vm provider's node taint as the agent sets it by default
#: (`virtual-kubelet.io/provider=<provider>:NoSchedule`), tolerated by exactly this provider's
#: value: `operator: Exists` would also let the scheduler put a VM on another provider's node.
VM_TOLERATION: Final = {
    "key": "virtual-kubelet.io/provider",
    "operator": "Equal",
    "value": "vm",
    "effect": "NoSchedule",
}


@runtime_checkable
class Reconciler(Protocol):
    """One kind of object the controller keeps in line with its spec.

    `resource` is the kind watched (each change queues that object's key); an optional
    `keys_for_pod(pod) -> Iterable[(namespace, name)]` (see `PodWatcher`) also queues objects
    when one of the pods labelled `vm.vkubelet.io/name` changes."""

    resource: Resource

    async def reconcile(self, ctx: Context, namespace: str, name: str) -> float | None:
        """Take the next step for the object; a number asks to be called again in that many
        seconds (the controller also calls again on changes and at each resync)."""
        ...


@runtime_checkable
class PodWatcher(Protocol):
    """The optional part of a reconciler: which of its objects a VM pod's change concerns."""

    def keys_for_pod(self, pod: Watched) -> Iterable[tuple[str, str]]: ...


class WatchedMeta(msgspec.Struct):
    name: str | None = None
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    resourceVersion: str | None = None
    managedFields: Any = None


class Watched(msgspec.Struct):
    """What the controller keeps of a watched object: only its metadata, since a reconciler
    reads the objects it acts on afresh (the watch only says which to look at)."""

    metadata: WatchedMeta


@dataclass
class Context:
    """What a reconciler gets: the client (the only way to the cluster) and the event recorder."""

    client: KubeClient
    events: EventRecorder


def meta_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("metadata") or {})


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict(meta_of(obj).get("annotations") or {})


def condition_of(obj: Mapping[str, Any] | None, type: str) -> dict[str, Any]:
    """The object's status condition of `type` ({} when it has none)."""
    for condition in ((obj or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == type:
            return dict(condition)
    return {}


def controller_ref(kind: str, obj: Mapping[str, Any]) -> dict[str, Any]:
    """The owner reference that makes `obj` (one of our kinds) the controller of what carries
    it: the garbage collector deletes that with it."""
    meta = meta_of(obj)
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def template_spec(vm: Mapping[str, Any]) -> dict[str, Any]:
    """The VM template's pod spec (a copy's top level) with the vm nodes' taint tolerated.

    A VirtualMachine's pod can only run on a vm node, so its template need not say so: without
    this the first VirtualMachine a user writes stays Pending with "untolerated taint". The
    template's own tolerations are kept and the vm one is added only when none of them already
    covers the taint (no duplicates, a broader one such as `operator: Exists` left alone).
    """
    spec = dict(((vm.get("spec") or {}).get("template") or {}).get("spec") or {})
    tolerations = list(spec.get("tolerations") or [])
    if not any(tolerates(t, VM_TOLERATION) for t in tolerations):
        spec["tolerations"] = [*tolerations, dict(VM_TOLERATION)]
    return spec


def require_on_node(spec: dict[str, Any], kind: str, requirements: list[dict[str, Any]]) -> None:
    """Add node `requirements` (`kind`: matchFields or matchExpressions) to a pod spec's required
    node affinity. Its terms are ORed, so each one gets them: none may lead elsewhere."""
    affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term[kind] = [*(term.get(kind) or []), *requirements]
    required["nodeSelectorTerms"] = terms


async def _unless_gone(call: Awaitable[T]) -> T | None:
    """The answer, or None when the object is not there (an answer here, not an error)."""
    try:
        return await call
    except ApiError as e:
        if e.not_found:
            return None
        raise


async def read(
    ctx: Context, resource: Resource, name: str, namespace: str | None
) -> dict[str, Any] | None:
    return await _unless_gone(ctx.client.get(resource.path(namespace, name)))


async def vm_pods(ctx: Context, namespace: str, vm: str) -> list[dict[str, Any]]:
    """The pods labelled with the VM's name (a quorum read: never a cache)."""
    found = await ctx.client.get(
        PODS.path(namespace), {"labelSelector": label_selector({NAME_LABEL: vm})}
    )
    pods: list[dict[str, Any]] = found.get("items") or []
    return pods


async def nodes_by_name(ctx: Context) -> dict[str, dict[str, Any]]:
    listed = (await ctx.client.get(NODES.path())).get("items") or []
    return {str(n["metadata"]["name"]): n for n in listed}


async def patch_pod(ctx: Context, namespace: str, pod: str, patch: dict[str, Any]) -> bool:
    """False when the pod is gone."""
    return await _unless_gone(ctx.client.patch(PODS.path(namespace, pod), patch)) is not None


async def delete_pod(ctx: Context, namespace: str, pod: str) -> bool:
    """False when the pod was gone already."""
    return await _unless_gone(ctx.client.delete(PODS.path(namespace, pod))) is not None


async def write_status(
    ctx: Context, resource: Resource, obj: Mapping[str, Any], status: Mapping[str, Any]
) -> None:
    """Patch the status fields that changed from `obj`'s (an object deleted meanwhile: none)."""
    old = dict(obj.get("status") or {})
    changed = {k: v for k, v in status.items() if old.get(k) != v}
    if not changed:
        return
    path = resource.path(meta_of(obj)["namespace"], meta_of(obj)["name"], "status")
    await _unless_gone(ctx.client.patch(path, {"status": changed}))
