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


def _volume_slots(volume: MutableMapping[str, Any]) -> Iterator[_Slot]:
    source = volume.get("configMap")
    if isinstance(source, dict) and source.get("name"):
        yield _Slot("ConfigMap", source, "name", bool(source.get("optional")))
    source = volume.get("secret")
    if isinstance(source, dict) and source.get("secretName"):
        yield _Slot("Secret", source, "secretName", bool(source.get("optional")))
    source = volume.get("persistentVolumeClaim")
    if isinstance(source, dict) and source.get("claimName"):
        yield _Slot("PersistentVolumeClaim", source, "claimName")
    projected = volume.get("projected")
    if isinstance(projected, dict):
        for item in projected.get("sources") or []:
            for kind, field in (("ConfigMap", "configMap"), ("Secret", "secret")):
                ref = item.get(field)
                if isinstance(ref, dict) and ref.get("name"):
                    yield _Slot(kind, ref, "name", bool(ref.get("optional")))
    csi = volume.get("csi")
    if isinstance(csi, dict):
        ref = csi.get("nodePublishSecretRef")
        if isinstance(ref, dict) and ref.get("name"):
            yield _Slot("Secret", ref, "name")
    for name in _SECRET_REF_VOLUMES:
        source = volume.get(name)
        if isinstance(source, dict):
            ref = source.get("secretRef")
            if isinstance(ref, dict) and ref.get("name"):
                yield _Slot("Secret", ref, "name")
    azure = volume.get("azureFile")
    if isinstance(azure, dict) and azure.get("secretName"):
        yield _Slot("Secret", azure, "secretName")


def _container_slots(container: MutableMapping[str, Any]) -> Iterator[_Slot]:
    for env in container.get("env") or []:
        value_from = env.get("valueFrom")
        if not isinstance(value_from, dict):
            continue
        for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
            ref = value_from.get(field)
            if isinstance(ref, dict) and ref.get("name"):
                yield _Slot(kind, ref, "name", bool(ref.get("optional")))
    for source in container.get("envFrom") or []:
        for kind, field in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            ref = source.get(field)
            if isinstance(ref, dict) and ref.get("name"):
                yield _Slot(kind, ref, "name", bool(ref.get("optional")))


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
