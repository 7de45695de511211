"""What every reconciler of the VM controller shares: the protocol, the context, the names.

A reconciler is level-triggered: it is handed a (namespace, name), reads the objects it needs
from the apiserver (never from memory kept between calls), takes the next step and returns. The
controller calls it again when a watched object changes, after the delay it returned, or at the
periodic resync, so a controller restarted in the middle of an operation finishes or rolls it
back from what the objects say.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

import msgspec

from ..kube import EventRecorder, KubeClient, Resource

__all__ = [
    "BACKUP_OF_ANNOTATION",
    "MACHINE_ANNOTATION",
    "MIGRATE_TO_ANNOTATION",
    "MIGRATION_SOURCE_ANNOTATION",
    "NAME_LABEL",
    "POWER_OFF_ANNOTATION",
    "ROOT_DISK_SIZE_ANNOTATION",
    "Context",
    "PodWatcher",
    "Reconciler",
    "Watched",
]

GROUP: Final = "vkubelet.io"
API_VERSION: Final = "vkubelet.io/v1alpha1"
NAME_LABEL: Final = "vm.vkubelet.io/name"  # on a VM's pod: the VirtualMachine's name
MACHINE_ANNOTATION: Final = "vm.vkubelet.io/machine"  # the VirtualMachine's uid: its disks
POWER_OFF_ANNOTATION: Final = "vm.vkubelet.io/power-off"  # Shutdown | Hibernate, before delete
ROOT_DISK_SIZE_ANNOTATION: Final = "vm.vkubelet.io/root-disk-size"
MIGRATION_SOURCE_ANNOTATION: Final = "vm.vkubelet.io/migration-source"  # on a migration target
MIGRATE_TO_ANNOTATION: Final = "vm.vkubelet.io/migrate-to"  # on a migrating source pod
BACKUP_OF_ANNOTATION: Final = "vm.vkubelet.io/backup-of"  # on a backup pod


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
    extra: dict[str, Any] = field(default_factory=dict)  # room for shared settings, unused yet
