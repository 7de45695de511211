"""What every reconciler of the VM controller shares: the protocol, the context, the names.

A reconciler is level-triggered: it is handed a (namespace, name), reads the objects it needs
from the apiserver (never from memory kept between calls), takes the next step and returns. The
controller calls it again when a watched object changes, after the delay it returned, or at the
periodic resync, so a controller restarted in the middle of an operation finishes or rolls it
back from what the objects say.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Protocol, runtime_checkable

from lightkube import AsyncClient
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Pod

__all__ = [
    "BACKUP_OF_ANNOTATION",
    "MACHINE_ANNOTATION",
    "MIGRATE_TO_ANNOTATION",
    "MIGRATION_SOURCE_ANNOTATION",
    "NAME_LABEL",
    "POWER_OFF_ANNOTATION",
    "ROOT_DISK_SIZE_ANNOTATION",
    "Context",
    "EventRecorder",
    "PodWatcher",
    "Reconciler",
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

log = logging.getLogger(__name__)


@runtime_checkable
class Reconciler(Protocol):
    """One kind of object the controller keeps in line with its spec.

    `resource` is the lightkube class watched (each change queues that object's key); an
    optional `keys_for_pod(pod) -> Iterable[(namespace, name)]` (see `PodWatcher`) also queues
    objects when one of the pods labelled `vm.vkubelet.io/name` changes."""

    resource: type

    async def reconcile(self, ctx: Context, namespace: str, name: str) -> float | None:
        """Take the next step for the object; a number asks to be called again in that many
        seconds (the controller also calls again on changes and at each resync)."""
        ...


@runtime_checkable
class PodWatcher(Protocol):
    """The optional part of a reconciler: which of its objects a VM pod's change concerns."""

    def keys_for_pod(self, pod: Pod) -> Iterable[tuple[str, str]]: ...


class EventRecorder:
    """Kubernetes Events about the controller's objects, best effort: an event that cannot be
    written is logged at debug level, never fails a reconcile. Repeats of the same (object,
    reason, message) within ten minutes bump the existing Event's count, as client-go does, so a
    reconcile loop that keeps finding the same problem writes one Event, not one per pass."""

    _WINDOW: Final = 600.0

    def __init__(self, client: AsyncClient, *, component: str = "vkubelet-vm-controller") -> None:
        self._client = client
        self._component = component
        self._recent: OrderedDict[tuple[str, str, str, str], tuple[str, int, float]] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def emit(self, obj: Any, type: str, reason: str, message: str) -> None:
        """Queue an Event (written in the background: a reconcile never waits on it)."""
        task = asyncio.get_running_loop().create_task(self._write(obj, type, reason, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Let the queued events be written (a short wait: they are best effort)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2)

    async def _write(self, obj: Any, type: str, reason: str, message: str) -> None:
        meta = obj.metadata
        if meta is None or not meta.name:
            return
        namespace = meta.namespace or "default"
        message = message[:1024]
        key = (str(meta.uid), type, reason, message)
        now = datetime.now(UTC)
        try:
            recent = self._recent.get(key)
            if recent is not None and time.monotonic() - recent[2] < self._WINDOW:
                name, count, first = recent
                await self._client.patch(
                    Event,
                    name,
                    {"count": count + 1, "lastTimestamp": now.isoformat()},
                    namespace=namespace,
                    patch_type=_merge(),
                )
                self._recent[key] = (name, count + 1, first)
                return
            event = Event(
                metadata=ObjectMeta(generateName=f"{meta.name}.", namespace=namespace),
                involvedObject=ObjectReference(
                    apiVersion=getattr(obj, "apiVersion", None) or API_VERSION,
                    kind=getattr(obj, "kind", None) or type_name(obj),
                    name=meta.name,
                    namespace=namespace,
                    uid=meta.uid,
                ),
                type=type,
                reason=reason,
                message=message,
                count=1,
                firstTimestamp=now,
                lastTimestamp=now,
                source=EventSource(component=self._component),
                reportingComponent=self._component,
            )
            created = await self._client.create(event)
            assert created.metadata is not None
            self._recent[key] = (str(created.metadata.name), 1, time.monotonic())
            while len(self._recent) > 1000:
                self._recent.popitem(last=False)
        except Exception as e:  # events are best effort
            log.debug("event %s about %s not recorded: %s", reason, meta.name, e)


def type_name(obj: Any) -> str:
    return type(obj).__name__


def _merge() -> Any:
    from lightkube.types import PatchType

    return PatchType.MERGE


@dataclass
class Context:
    """What a reconciler gets: the client (the only way to the cluster) and the event recorder."""

    client: AsyncClient
    events: EventRecorder
    extra: dict[str, Any] = field(default_factory=dict)  # room for shared settings, unused yet
