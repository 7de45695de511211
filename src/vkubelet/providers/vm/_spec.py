"""A pod, read as a virtual machine: pure, so every refusal is tested without QEMU.

A VM pod has exactly one container (the VM): its image names the disk image, its resources
(limits, else requests) size the machine, annotations set the root disk's size and bus
(virtlet's names and ours), emptyDir volumes become blank disks, and the files the container
would see (configMap, secret, downwardAPI and projected volumes at their mount paths, plus its
environment as /etc/vkubelet/env) travel to the guest in the cloud-init seed.

Every refusal names the pod field at fault, since that is what the user must change.
"""

from __future__ import annotations

import math
import posixpath
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from lightkube.models.core_v1 import Container

from ...sdk import EmptyDirVolume, FilesVolume, HostPathVolume, OtherVolume, ResolvedPod
from ._config import millicpu, quantity_bytes

__all__ = [
    "DISK_BUS_ANNOTATIONS",
    "ENV_FILE",
    "ROOT_SIZE_ANNOTATIONS",
    "MachinePlan",
    "ScratchDisk",
    "SpecError",
    "plan_machine",
]

# Ours first: where both are set, the project's name wins.
ROOT_SIZE_ANNOTATIONS = ("vm.vkubelet.io/root-size", "VirtletRootVolumeSize")
DISK_BUS_ANNOTATIONS = ("vm.vkubelet.io/disk-bus", "VirtletDiskDriver")
VCPU_ANNOTATION = "VirtletVCPUCount"
ENV_FILE = "/etc/vkubelet/env"
DEFAULT_SCRATCH_BYTES = 2**30
_MIB = 2**20


class SpecError(ValueError):
    """The pod cannot run as a VM; `field` is the pod field at fault (for the pod's reason)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ScratchDisk:
    """A blank qcow2 disk for an emptyDir volume (the guest formats and mounts it)."""

    volume: str
    size: int  # bytes
    mount_path: str | None


@dataclass(frozen=True)
class MachinePlan:
    container: str
    image: str
    vcpus: int
    memory_mib: int
    root_size: int | None  # bytes; None keeps the image's size
    disk_bus: Literal["virtio", "scsi"]
    scratch: tuple[ScratchDisk, ...] = ()
    files: Mapping[str, bytes] = field(default_factory=dict)  # guest path -> content
    secret_files: frozenset[str] = frozenset()  # which of `files` come from secrets
    claims: tuple[str, ...] = ()  # persistentVolumeClaim names, in volume order (`_volumes`)


def plan_machine(
    resolved: ResolvedPod,
    *,
    allocatable_millicpu: int,
    allocatable_memory: int,
    default_millicpu: int = 1000,
    default_memory: int = 256 * _MIB,
) -> MachinePlan:
    """The machine for `resolved`, or a `SpecError` naming the field that cannot be honoured."""
    pod = resolved.pod
    spec = pod.spec
    assert spec is not None
    if spec.initContainers:
        raise SpecError("spec.initContainers", "a VM pod has no init containers")
    if len(spec.containers) != 1:
        raise SpecError(
            "spec.containers",
            f"a VM pod has exactly one container (the VM), this one has {len(spec.containers)}",
        )
    container = spec.containers[0]
    where = "spec.containers[0]"
    if not container.image:
        raise SpecError(f"{where}.image", "a VM pod needs an image (the disk image's name)")
    annotations = dict((pod.metadata.annotations if pod.metadata else None) or {})
    cpu, memory = _resources(container, where, annotations, default_millicpu, default_memory)
    if memory > allocatable_memory:
        raise SpecError(
            f"{where}.resources.limits.memory",
            f"{_mib(memory)}Mi is more than the node can give a VM ({_mib(allocatable_memory)}Mi)",
        )
    if cpu > allocatable_millicpu:
        raise SpecError(
            f"{where}.resources.limits.cpu",
            f"{cpu}m is more than the node can give a VM ({allocatable_millicpu}m)",
        )
    files, secrets = _files(resolved, container)
    return MachinePlan(
        container=container.name,
        image=container.image,
        vcpus=max(1, math.ceil(cpu / 1000)),
        memory_mib=_mib(memory),
        root_size=_root_size(annotations),
        disk_bus=_disk_bus(annotations),
        scratch=_scratch(resolved, container),
        files=files,
        secret_files=frozenset(secrets),
        claims=_claims(resolved),
    )


def _claims(resolved: ResolvedPod) -> tuple[str, ...]:
    """The pod's PVCs: VM disks of the `vkubelet-vm-disk` class (`_volumes`)."""
    spec = resolved.pod.spec
    assert spec is not None
    return tuple(
        v.persistentVolumeClaim.claimName for v in spec.volumes or [] if v.persistentVolumeClaim
    )


def _mib(size: int) -> int:
    return -(-size // _MIB)


def _resources(
    container: Container,
    where: str,
    annotations: Mapping[str, str],
    default_cpu: int,
    default_memory: int,
) -> tuple[int, int]:
    resources = container.resources
    limits = dict((resources.limits if resources else None) or {})
    requests = dict((resources.requests if resources else None) or {})
    cpu, memory = default_cpu, default_memory
    if VCPU_ANNOTATION in annotations:
        try:
            count = int(annotations[VCPU_ANNOTATION])
        except ValueError:
            count = 0
        if not 1 <= count <= 255:
            raise SpecError(
                f"metadata.annotations[{VCPU_ANNOTATION}]",
                f"expected a whole number from 1 to 255, got {annotations[VCPU_ANNOTATION]!r}",
            )
        cpu = count * 1000
    for kind, values in (("requests", requests), ("limits", limits)):  # limits win
        try:
            if "cpu" in values:
                cpu = millicpu(values["cpu"])
        except ValueError as e:
            raise SpecError(f"{where}.resources.{kind}.cpu", str(e)) from None
        try:
            if "memory" in values:
                memory = quantity_bytes(values["memory"])
        except ValueError as e:
            raise SpecError(f"{where}.resources.{kind}.memory", str(e)) from None
    if memory < 16 * _MIB:
        raise SpecError(f"{where}.resources.limits.memory", "a VM needs at least 16Mi of memory")
    return max(cpu, 1), memory


def _root_size(annotations: Mapping[str, str]) -> int | None:
    for name in ROOT_SIZE_ANNOTATIONS:
        if name in annotations:
            try:
                size = quantity_bytes(annotations[name])
            except ValueError as e:
                raise SpecError(f"metadata.annotations[{name}]", str(e)) from None
            if size <= 0:
                raise SpecError(f"metadata.annotations[{name}]", "expected a positive size")
            return size
    return None


def _disk_bus(annotations: Mapping[str, str]) -> Literal["virtio", "scsi"]:
    for name in DISK_BUS_ANNOTATIONS:
        if name in annotations:
            value = annotations[name].strip().lower()
            if value == "virtio":
                return "virtio"
            if value == "scsi":
                return "scsi"
            raise SpecError(
                f"metadata.annotations[{name}]", f"expected virtio or scsi, got {value!r}"
            )
    return "virtio"


def _mounts(container: Container) -> dict[str, list[tuple[str, str]]]:
    """Volume name -> [(mountPath, subPath)] for the container."""
    mounts: dict[str, list[tuple[str, str]]] = {}
    for mount in container.volumeMounts or []:
        mounts.setdefault(mount.name, []).append((mount.mountPath, mount.subPath or ""))
    return mounts


def _scratch(resolved: ResolvedPod, container: Container) -> tuple[ScratchDisk, ...]:
    mounts = _mounts(container)
    disks = []
    for index, volume in enumerate(_volume_list(resolved)):
        if not isinstance(volume, EmptyDirVolume):
            continue
        size = DEFAULT_SCRATCH_BYTES
        if volume.size_limit:
            try:
                size = quantity_bytes(volume.size_limit)
            except ValueError as e:
                raise SpecError(f"spec.volumes[{index}].emptyDir.sizeLimit", str(e)) from None
        paths = mounts.get(volume.name)
        disks.append(ScratchDisk(volume.name, size, paths[0][0] if paths else None))
    return tuple(disks)


def _volume_list(resolved: ResolvedPod) -> list[object]:
    """The resolved volumes in the order of `spec.volumes` (for field indices)."""
    spec = resolved.pod.spec
    assert spec is not None
    return [resolved.volumes.get(v.name) for v in spec.volumes or []]


def _files(resolved: ResolvedPod, container: Container) -> tuple[dict[str, bytes], set[str]]:
    files: dict[str, bytes] = {}
    secrets: set[str] = set()
    mounts = _mounts(container)
    for index, volume in enumerate(_volume_list(resolved)):
        if isinstance(volume, OtherVolume) and volume.kind == "persistentVolumeClaim":
            continue  # a disk (`_claims`)
        if isinstance(volume, HostPathVolume | OtherVolume):
            kind = "hostPath" if isinstance(volume, HostPathVolume) else volume.kind
            raise SpecError(
                f"spec.volumes[{index}].{kind}",
                "a VM pod takes emptyDir, persistentVolumeClaim, configMap, secret, downwardAPI "
                "and projected volumes",
            )
        if not isinstance(volume, FilesVolume):
            continue
        for mount_path, sub_path in mounts.get(volume.name, []):
            for relative, content in volume.files.items():
                if sub_path:
                    if relative != sub_path:
                        continue
                    target = mount_path
                else:
                    target = posixpath.join(mount_path, relative)
                target = posixpath.normpath(target)
                files[target] = content.data
                if volume.kind == "secret" or volume.kind == "projected":
                    secrets.add(target)  # a projected volume may carry a secret or a token
    env = container.env or []
    if env:
        lines = [f"{var.name}={shlex.quote(var.value or '')}" for var in env]
        files[ENV_FILE] = ("\n".join(lines) + "\n").encode()
        secrets.add(ENV_FILE)  # env values may come from secrets
    return files, secrets
