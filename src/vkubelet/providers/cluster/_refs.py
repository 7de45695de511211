"""Every place a pod spec names another object: one walker for both collecting and renaming.

The dependency planner and the pod translation must agree exactly on which names a pod
references; one walk used by both makes a reference the planner copies and the translation
forgets (or the reverse) impossible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Reference", "pod_references", "rename_references"]

# Volume sources whose `secretRef.name` names a Secret in the pod's namespace.
_SECRET_REF_VOLUMES = ("cephfs", "cinder", "flexVolume", "iscsi", "rbd", "scaleIO", "storageos")
_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


@dataclass(frozen=True)
class Reference:
    kind: str  # ConfigMap, Secret, ServiceAccount, PersistentVolumeClaim
    name: str
    optional: bool = False


@dataclass
class _Slot:
    """Where a reference lives: `holder[key]` is the name."""

    kind: str
    holder: MutableMapping[str, Any]
    key: str
    optional: bool = False


def _slots(spec: MutableMapping[str, Any]) -> Iterator[_Slot]:
    for key in ("serviceAccountName", "serviceAccount"):
        if spec.get(key):
            yield _Slot("ServiceAccount", spec, key)
    for ref in spec.get("imagePullSecrets") or []:
        if isinstance(ref, dict) and ref.get("name"):
            yield _Slot("Secret", ref, "name", optional=True)  # the kubelet skips missing ones
    for volume in spec.get("volumes") or []:
        yield from _volume_slots(volume)
    for list_name in _CONTAINER_LISTS:
        for container in spec.get(list_name) or []:
            yield from _container_slots(container)


def _named(kind: str, holder: object, key: str = "name", optional: bool = True) -> Iterator[_Slot]:
    """The slot, when `holder` is a reference naming an object at `key`; optional if it says so
    (`optional=False`: a kind of reference the API gives no such field)."""
    if isinstance(holder, dict) and holder.get(key):
        yield _Slot(kind, holder, key, optional and bool(holder.get("optional")))


def _volume_slots(volume: MutableMapping[str, Any]) -> Iterator[_Slot]:
    yield from _named("ConfigMap", volume.get("configMap"))
    yield from _named("Secret", volume.get("secret"), "secretName")
    claim = volume.get("persistentVolumeClaim")
    yield from _named("PersistentVolumeClaim", claim, "claimName", optional=False)
    projected = volume.get("projected")
    for item in (projected.get("sources") or []) if isinstance(projected, dict) else []:
        yield from _named("ConfigMap", item.get("configMap"))
        yield from _named("Secret", item.get("secret"))
    csi = volume.get("csi")
    if isinstance(csi, dict):
        yield from _named("Secret", csi.get("nodePublishSecretRef"), optional=False)
    for name in _SECRET_REF_VOLUMES:
        source = volume.get(name)
        if isinstance(source, dict):
            yield from _named("Secret", source.get("secretRef"), optional=False)
    yield from _named("Secret", volume.get("azureFile"), "secretName", optional=False)


def _container_slots(container: MutableMapping[str, Any]) -> Iterator[_Slot]:
    for env in container.get("env") or []:
        value_from = env.get("valueFrom")
        if isinstance(value_from, dict):
            yield from _named("ConfigMap", value_from.get("configMapKeyRef"))
            yield from _named("Secret", value_from.get("secretKeyRef"))
    for source in container.get("envFrom") or []:
        yield from _named("ConfigMap", source.get("configMapRef"))
        yield from _named("Secret", source.get("secretRef"))


def pod_references(spec: MutableMapping[str, Any]) -> set[Reference]:
    """Every (kind, name) the spec references; a name is optional only if every use is."""
    found: dict[tuple[str, str], bool] = {}
    for slot in _slots(spec):
        key = (slot.kind, str(slot.holder[slot.key]))
        found[key] = found.get(key, True) and slot.optional
    return {Reference(kind, name, optional) for (kind, name), optional in found.items()}


def rename_references(spec: MutableMapping[str, Any], rename: Callable[[str, str], str]) -> None:
    """Replace, in place, every referenced name by `rename(kind, name)`."""
    for slot in list(_slots(spec)):
        slot.holder[slot.key] = rename(slot.kind, str(slot.holder[slot.key]))
