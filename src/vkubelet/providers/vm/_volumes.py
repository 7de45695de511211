"""PVCs as VM disks: a small dynamic provisioner for the StorageClass `vkubelet-vm-disk`.

No CSI driver and no shared storage: a claim of this class is a qcow2 file on the hypervisor node
that runs its first consumer. How it goes, in Kubernetes' own terms:
- the class is `WaitForFirstConsumer`, so the scheduler picks the pod's node first and writes it
  on the claim (`volume.kubernetes.io/selected-node`); a pod that names its node itself
  (`spec.nodeName`, no scheduler) counts as selecting that node too;
- the vm agent of that node (this module, with the credentials of `storage.kubeconfig`: a node's
  own identity may not create PVs) creates `<stateDir>/volumes/<pv>.qcow2` of the claim's size and
  a PV for it: a `local` volume at that path, node affinity to this node, `claimRef` to the claim,
  the class's reclaim policy; the PV controller binds the two;
- a VM pod with the claim gets the file as a virtio disk whose serial is the claim's name (cut to
  the 20 bytes virtio-blk keeps), so the guest finds it (`/sys/block/*/serial`);
- the claim deleted: with `Delete` the agent removes the file and the PV once it is `Released`;
  with `Retain` both stay (an admin reuses or removes them).
Polling (every `intervalSeconds`) rather than watches: a few list calls per interval, restart-safe
by construction (every step is derived from the objects).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..._files import private_dir
from ...kube import ApiError, KubeClient
from ...sdk import ProviderError
from ._disks import parse_size
from ._machine import _opt

__all__ = [
    "PROVISIONER",
    "STORAGE_CLASS",
    "ClaimDisk",
    "DiskProvisioner",
    "StorageConfig",
    "VolumeNotReady",
    "binding_refusal",
    "pv_for",
    "storage_class_manifest",
    "to_delete",
    "to_provision",
]

log = logging.getLogger(__name__)

STORAGE_CLASS = "vkubelet-vm-disk"
PROVISIONER = "vm.vkubelet.io/disk"
SELECTED_NODE = "volume.kubernetes.io/selected-node"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
SERIAL_BYTES = 20  # virtio-blk's serial field
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


@dataclass(frozen=True)
class StorageConfig:
    kubeconfig: Path
    interval: float = 2.0


@dataclass(frozen=True)
class ClaimDisk:
    claim: str
    path: Path

    @property
    def serial(self) -> str:
        return self.claim[:SERIAL_BYTES]


def storage_class_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS},
        "provisioner": PROVISIONER,
        "volumeBindingMode": "WaitForFirstConsumer",
        "reclaimPolicy": "Delete",
        "allowVolumeExpansion": False,
    }


def to_provision(
    pvc: dict[str, Any], node: str, classes: set[str], consumers: dict[str, str]
) -> bool:
    """Whether this node's agent must provision `pvc`: of our class, unbound, its node this one
    (selected by the scheduler, or the node of a pod that names it: `consumers`, claim -> node)."""
    spec, meta = pvc.get("spec") or {}, pvc.get("metadata") or {}
    if spec.get("storageClassName") not in classes or spec.get("volumeName"):
        return False
    if meta.get("deletionTimestamp"):
        return False
    selected = (meta.get("annotations") or {}).get(SELECTED_NODE)
    if selected is None:
        selected = consumers.get(f"{meta.get('namespace')}/{meta.get('name')}")
    return selected == node


def pv_name(pvc: dict[str, Any]) -> str:
    return f"pvc-{pvc['metadata']['uid']}"


def pv_for(pvc: dict[str, Any], node: str, path: Path, reclaim: str) -> dict[str, Any]:
    meta, spec = pvc["metadata"], pvc["spec"]
    storage = spec["resources"]["requests"]["storage"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": pv_name(pvc),
            "annotations": {PROVISIONED_BY: PROVISIONER},
            "labels": {"vm.vkubelet.io/node": node} if _NAME.fullmatch(node) else {},
        },
        "spec": {
            "capacity": {"storage": storage},
            "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
            "persistentVolumeReclaimPolicy": reclaim,
            "storageClassName": spec["storageClassName"],
            "volumeMode": "Filesystem",
            "local": {"path": str(path)},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "In",
                                    "values": [node],
                                }
                            ]
                        }
                    ]
                }
            },
        },
    }


def _pv_node(pv: dict[str, Any]) -> str | None:
    with contextlib.suppress(KeyError, IndexError, TypeError):
        terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
        expression = terms[0]["matchExpressions"][0]
        if expression["key"] == "kubernetes.io/hostname":
            return str(expression["values"][0])
    return None


def to_delete(pv: dict[str, Any], node: str, volumes: Path) -> Path | None:
    """The file of a PV of ours on this node whose claim is gone and whose policy is Delete."""
    meta, spec = pv.get("metadata") or {}, pv.get("spec") or {}
    if (meta.get("annotations") or {}).get(PROVISIONED_BY) != PROVISIONER:
        return None
    if _pv_node(pv) != node or spec.get("persistentVolumeReclaimPolicy") != "Delete":
        return None
    if (pv.get("status") or {}).get("phase") not in ("Released", "Failed"):
        return None
    path = Path((spec.get("local") or {}).get("path", ""))
    if path.parent != volumes:  # only files this provisioner made
        return None
    return path


class VolumeNotReady(RuntimeError):
    """A claim's disk cannot be attached yet: the pod waits in ContainerCreating, as a kubelet's
    does while its volumes are not attached, and retries."""

    reason: Final = "ContainerCreating"
    event_reason: Final = "FailedMount"


def binding_refusal(pvc: dict[str, Any], pv: dict[str, Any]) -> str | None:
    """Why `pv` is not the claim's disk (None: it is): both Bound, and the PV's claimRef names
    exactly this claim (namespace, name, uid). `spec.volumeName` alone is what the claim's
    author wrote: a claim pre-bound to another tenant's PV must not get that disk."""
    meta = pvc.get("metadata") or {}
    volume = (pvc.get("spec") or {}).get("volumeName")
    ref = (pv.get("spec") or {}).get("claimRef") or {}
    mine = (meta.get("namespace"), meta.get("name"), meta.get("uid"))
    if (ref.get("namespace"), ref.get("name"), ref.get("uid")) != mine:
        return f"volume {volume} is bound to another claim, not to this one"
    if (pvc.get("status") or {}).get("phase") != "Bound":
        return f"not Bound to volume {volume} yet"
    if (pv.get("status") or {}).get("phase") != "Bound":
        return f"volume {volume} is not Bound yet"
    return None


def drive_args(claims: Sequence[tuple[str | Path, str]]) -> tuple[str, ...]:
    """QEMU options attaching a launch's claim disks, (path, serial) each (after the root,
    scratch and seed)."""
    args: list[str] = []
    for index, (path, serial) in enumerate(claims):
        drive = f"file={_opt(Path(path).resolve())},if=none,id=claim{index},format=qcow2"
        device = f"virtio-blk-pci,drive=claim{index},serial={_opt(serial)}"
        args += ["-drive", drive, "-device", device]
    return tuple(args)


def _is_file(path: Path) -> bool:
    return path.is_file()  # a stat of a local file: not worth a thread


_STORAGE_CLASSES = "/apis/storage.k8s.io/v1/storageclasses"
_VOLUMES = "/api/v1/persistentvolumes"


async def _items(
    api: KubeClient, path: str, params: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    listed = await api.get(path, params)
    return list(listed.get("items") or [])


class DiskProvisioner:
    """The provisioning loop of one vm node, and the claim lookup the provider needs."""

    def __init__(
        self,
        node: str,
        config: StorageConfig,
        volumes: Path,
        create_blank: Callable[[Path, int], Awaitable[None]],
    ) -> None:
        self.node, self.config, self.volumes = node, config, volumes
        self._create_blank = create_blank
        self._client: KubeClient | None = None

    def _api(self) -> KubeClient:
        if self._client is None:
            self._client = KubeClient.from_kubeconfig(self.config.kubeconfig)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def ensure_storage_class(self) -> None:
        try:
            await self._api().create(_STORAGE_CLASSES, storage_class_manifest())
        except ApiError as e:
            if not e.conflict:
                raise

    async def run(self) -> None:
        private_dir(self.volumes)  # claim disks are tenants' data: the agent's alone
        while True:
            try:
                await self.ensure_storage_class()
                break
            except Exception as e:
                log.warning("storage class %s: %s", STORAGE_CLASS, e)
                await asyncio.sleep(self.config.interval * 5)
        while True:
            try:
                await self.sync_once()
            except Exception as e:  # the apiserver away: try again
                log.warning("disk provisioner: %s", e)
            await asyncio.sleep(self.config.interval)

    async def sync_once(self) -> None:
        api = self._api()
        classes = {
            sc["metadata"]["name"]: sc.get("reclaimPolicy") or "Delete"
            for sc in await _items(api, _STORAGE_CLASSES)
            if sc.get("provisioner") == PROVISIONER
        }
        consumers: dict[str, str] = {}
        on_node = {"fieldSelector": f"spec.nodeName={self.node}"}
        for pod in await _items(api, "/api/v1/pods", on_node):
            for volume in (pod.get("spec") or {}).get("volumes") or []:
                if claim := (volume.get("persistentVolumeClaim") or {}).get("claimName"):
                    consumers[f"{pod['metadata']['namespace']}/{claim}"] = self.node
        for pvc in await _items(api, "/api/v1/persistentvolumeclaims"):
            if to_provision(pvc, self.node, set(classes), consumers):
                await self._provision(pvc, classes[pvc["spec"]["storageClassName"]])
        for pv in await _items(api, _VOLUMES):
            if (path := to_delete(pv, self.node, self.volumes)) is not None:
                path.unlink(missing_ok=True)
                with contextlib.suppress(Exception):
                    await api.delete(f"{_VOLUMES}/{pv['metadata']['name']}")
                log.info("deleted volume %s (%s)", pv["metadata"]["name"], path)

    async def _provision(self, pvc: dict[str, Any], reclaim: str) -> None:
        path = self.volumes / f"{pv_name(pvc)}.qcow2"
        size = parse_size(pvc["spec"]["resources"]["requests"]["storage"], field="storage")
        if not path.exists():
            await self._create_blank(path, size)
        try:
            await self._api().create(_VOLUMES, pv_for(pvc, self.node, path, reclaim))
        except ApiError as e:
            if not e.conflict:
                raise
        meta = pvc["metadata"]
        log.info("provisioned %s for claim %s/%s", path, meta["namespace"], meta["name"])

    async def claim_disk(self, namespace: str, claim: str) -> ClaimDisk:
        """The disk of a bound claim of ours on this node; VolumeNotReady (retried) until then."""
        api = self._api()
        pvc = await api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        volume = (pvc.get("spec") or {}).get("volumeName")
        if not volume:
            raise VolumeNotReady(f"claim {claim} is not bound yet")
        pv = await api.get(f"{_VOLUMES}/{volume}")
        if (why := binding_refusal(pvc, pv)) is not None:
            raise VolumeNotReady(f"claim {claim}: {why}")
        path = Path((pv.get("spec", {}).get("local") or {}).get("path", ""))
        if _pv_node(pv) != self.node or path.parent != self.volumes or not _is_file(path):
            raise VolumeNotReady(f"claim {claim}'s volume {volume} is not a disk of this node")
        return ClaimDisk(claim, path)


async def claim_disks(
    provisioner: DiskProvisioner | None, namespace: str, claims: Sequence[str]
) -> list[tuple[str, str]]:
    """A pod's PVC disks for its launch, (path, serial) each; a claim not bound to its volume
    raises VolumeNotReady (the pod's preparation retries with back-off)."""
    if not claims:
        return []
    if provisioner is None:
        raise ProviderError(
            "CreateContainerConfigError",
            "spec.volumes: persistentVolumeClaim disks need `storage` in the node's vm config",
        )
    disks = [await provisioner.claim_disk(namespace, claim) for claim in claims]
    return [(str(d.path), d.serial) for d in disks]
