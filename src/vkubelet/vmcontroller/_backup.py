"""The VirtualMachineBackup reconciler: one backup = one pod on the VM's node, its status the pod's.

    spec:   {vmName, target: {directory: /abs} | {persistentVolumeClaim: name}, mode: Auto}
    status: {phase, podName, nodeName, kind, sizeBytes, durationSeconds, path, reason, message}

Level-triggered and idempotent (a restarted controller picks up where the objects say): the pod's
name is derived from the backup's (`<backup>-backup`), so a pod created just before a crash is
found, never duplicated; a terminal phase is never left. The vm provider on the node does the
backup (`providers/vm/_backup.py`): this module only checks the request, places the pod (pinned
by `nodeName` to the node of the VM's running pod, owned by the backup so it goes with it) and
copies the pod's outcome into the status.

Checks before anything is created, each a Failed status with a clear message: the target is one of
an absolute directory or a PVC; a PVC must exist, be bound, and be bound to a `local` or `hostPath`
PersistentVolume (the only kinds with a directory on the node: the path goes to the pod, where the
node checks it against its allowed backup directories); the VirtualMachine must exist and run.

`restore_path` serves the VirtualMachine reconciler: `spec.restoreFrom.backup` (a backup's name)
becomes the pod annotation `vm.vkubelet.io/restore-from: <status.path>` the provider restores from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..kube import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, PODS, ApiError, ObjectRef
from ._base import (
    BACKUP_OF_ANNOTATION,
    TERMINAL,
    Context,
    controller_ref,
    read,
    vm_pods,
    write_status,
)
from ._resources import VirtualMachine, VirtualMachineBackup

__all__ = [
    "BackupReconciler",
    "RestoreError",
    "backup_pod",
    "pod_name_for",
    "restore_path",
    "status_from_pod",
    "target_annotation",
]

BACKUP_TARGET: Final = "vm.vkubelet.io/backup-target"
BACKUP_MODE: Final = "vm.vkubelet.io/backup-mode"
BACKUP_LABEL: Final = "vm.vkubelet.io/backup"  # on the pod: the backup's name (not NAME_LABEL:
# the VirtualMachine reconciler counts the pods carrying that one as the VM's own)
BACKUP_IMAGE: Final = "vm.vkubelet.io/backup"
_POLL: Final = 2.0


class TargetInvalid(Exception):
    """The backup cannot be taken as asked; the message goes to status.message."""


class RestoreError(Exception):
    """spec.restoreFrom names no usable backup."""


def pod_name_for(backup: str) -> str:
    return f"{backup[:243]}-backup"


def _get(obj: Mapping[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def target_annotation(
    target: object, claim: Mapping[str, Any] | None, volume: Mapping[str, Any] | None
) -> str:
    """The pod's `backup-target` annotation for spec.target (claim and volume: the PVC and its
    PV as read, None when absent); TargetInvalid says what is wrong."""
    if not isinstance(target, Mapping) or len(target) != 1:
        raise TargetInvalid(
            "spec.target: expected exactly one of directory or persistentVolumeClaim"
        )
    if "directory" in target:
        directory = target["directory"]
        if not isinstance(directory, str) or not directory.startswith("/"):
            raise TargetInvalid(f"spec.target.directory: {directory!r} is not an absolute path")
        return json.dumps({"directory": directory})
    if "persistentVolumeClaim" not in target:
        raise TargetInvalid(f"spec.target: unknown target kind {next(iter(target))!r}")
    name = target["persistentVolumeClaim"]
    if claim is None:
        raise TargetInvalid(f"spec.target.persistentVolumeClaim: PVC {name!r} not found")
    pv = _get(claim, "spec", "volumeName")
    if _get(claim, "status", "phase") != "Bound" or not pv:
        raise TargetInvalid(f"spec.target.persistentVolumeClaim: PVC {name!r} is not bound")
    if volume is None:
        raise TargetInvalid(f"spec.target.persistentVolumeClaim: PV {pv!r} of {name!r} not found")
    path = _get(volume, "spec", "local", "path") or _get(volume, "spec", "hostPath", "path")
    if not path:
        raise TargetInvalid(
            f"spec.target.persistentVolumeClaim: PVC {name!r} is bound to PV {pv!r}, which has "
            "no directory on the node (only local and hostPath volumes can hold backups)"
        )
    return json.dumps({"persistentVolumeClaim": name, "path": path})


def backup_pod(backup: Mapping[str, Any], vm_pod: Mapping[str, Any], target: str) -> dict[str, Any]:
    """The backup's pod: on the VM pod's node, never restarted, owned by the backup."""
    meta = backup["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name_for(meta["name"]),
            "namespace": meta["namespace"],
            "labels": {BACKUP_LABEL: meta["name"]},
            "annotations": {
                BACKUP_OF_ANNOTATION: vm_pod["metadata"]["name"],
                BACKUP_TARGET: target,
                BACKUP_MODE: str(_get(backup, "spec", "mode") or "Auto"),
            },
            "ownerReferences": [controller_ref("VirtualMachineBackup", backup)],
        },
        "spec": {
            "nodeName": vm_pod["spec"]["nodeName"],
            "restartPolicy": "Never",
            # whatever taints keep ordinary pods off the VM's node: this pod belongs there
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "backup", "image": BACKUP_IMAGE}],
        },
    }


def status_from_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The backup's status from its pod's (phase, and the outcome the provider reported)."""
    phase = _get(pod, "status", "phase") or "Pending"
    status: dict[str, Any] = {
        "phase": phase if phase in ("Pending", "Running", *TERMINAL) else "Pending",
        "podName": _get(pod, "metadata", "name"),
        "nodeName": _get(pod, "spec", "nodeName"),
    }
    statuses = _get(pod, "status", "containerStatuses") or [{}]
    terminated = _get(statuses[0], "state", "terminated") or {}
    if phase == "Succeeded":
        try:
            result = json.loads(terminated.get("message") or "")
        except ValueError:
            result = {}
        for key in ("kind", "sizeBytes", "durationSeconds", "path"):
            if key in result:
                status[key] = result[key]
    elif phase == "Failed":
        status["reason"] = terminated.get("reason") or _get(pod, "status", "reason") or "Failed"
        status["message"] = terminated.get("message") or _get(pod, "status", "message") or ""
    return status


@dataclass(frozen=True)
class _Failure:
    reason: str
    message: str


class BackupReconciler:
    resource = VirtualMachineBackup

    async def reconcile(self, ctx: Context, namespace: str, name: str) -> float | None:
        backup = await read(ctx, VirtualMachineBackup, name, namespace)
        if backup is None:
            return None  # deleted: its pod goes with it (owner reference)
        status = dict(backup.get("status") or {})
        if status.get("phase") in TERMINAL:
            return None
        pod = await read(ctx, PODS, pod_name_for(name), namespace)
        if pod is None and status.get("phase") == "Running":
            failure = _Failure("PodDeleted", "the backup pod was deleted")
            await self._finish(ctx, backup, failure)
            return None
        if pod is None:
            outcome = await self._start(ctx, backup)
            if isinstance(outcome, _Failure):
                await self._finish(ctx, backup, outcome)
                return None
            pod = outcome
        new = status_from_pod(pod)
        await write_status(ctx, VirtualMachineBackup, backup, new)
        if new["phase"] in TERMINAL:
            self._announce(ctx, backup, new)
            return None
        return _POLL

    async def _start(self, ctx: Context, backup: dict[str, Any]) -> dict[str, Any] | _Failure:
        """Check the request, then create the pod (or find the one a previous run created)."""
        meta, spec = backup["metadata"], backup.get("spec") or {}
        namespace = meta["namespace"]
        target = spec.get("target")
        claim = volume = None
        if isinstance(target, Mapping) and isinstance(target.get("persistentVolumeClaim"), str):
            claim = await read(
                ctx, PERSISTENT_VOLUME_CLAIMS, target["persistentVolumeClaim"], namespace
            )
            if (pv := _get(claim, "spec", "volumeName")) is not None:
                volume = await read(ctx, PERSISTENT_VOLUMES, pv, None)
        try:
            annotation = target_annotation(target, claim, volume)
        except TargetInvalid as e:
            return _Failure("TargetRefused", str(e))
        vm_name = str(spec.get("vmName") or "")
        vm = await read(ctx, VirtualMachine, vm_name, namespace) if vm_name else None
        if vm is None:
            return _Failure("VMNotFound", f"VirtualMachine {vm_name!r} not found")
        vm_pod = await _running_pod(ctx, namespace, vm_name)
        if vm_pod is None:
            return _Failure("VMNotRunning", f"VM {vm_name} is not running")
        manifest = backup_pod(backup, vm_pod, annotation)
        try:
            pod: dict[str, Any] = await ctx.client.create(PODS.path(namespace), manifest)
        except ApiError as e:
            if not e.conflict:
                raise
            found = await read(ctx, PODS, manifest["metadata"]["name"], namespace)
            if found is None:
                raise
            pod = found
        else:
            node = manifest["spec"]["nodeName"]
            ctx.events.emit(
                ObjectRef.of(backup),
                "Normal",
                "Started",
                f"backup pod {pod_name_for(meta['name'])} on {node}",
            )
        return pod

    async def _finish(self, ctx: Context, backup: dict[str, Any], failure: _Failure) -> None:
        new = {"phase": "Failed", "reason": failure.reason, "message": failure.message}
        await write_status(ctx, VirtualMachineBackup, backup, new)
        self._announce(ctx, backup, new)

    def _announce(self, ctx: Context, backup: dict[str, Any], status: Mapping[str, Any]) -> None:
        if status["phase"] == "Succeeded":
            message = (
                f"{status.get('kind')} backup of {status.get('sizeBytes')} bytes in "
                f"{status.get('durationSeconds')} s at {status.get('path')}"
            )
            ctx.events.emit(ObjectRef.of(backup), "Normal", "Succeeded", message)
        else:
            ctx.events.emit(
                ObjectRef.of(backup), "Warning", str(status["reason"]), str(status["message"])
            )


async def _running_pod(ctx: Context, namespace: str, vm: str) -> dict[str, Any] | None:
    """The VM's pod that runs (Running, bound to a node, not being deleted)."""
    for p in await vm_pods(ctx, namespace, vm):
        if (
            _get(p, "status", "phase") == "Running"
            and _get(p, "spec", "nodeName")
            and not _get(p, "metadata", "deletionTimestamp")
            and BACKUP_OF_ANNOTATION not in (_get(p, "metadata", "annotations") or {})
        ):
            return p
    return None


async def restore_path(ctx: Context, namespace: str, backup: str) -> tuple[str, str | None]:
    """The `restore-from` annotation for `spec.restoreFrom.backup`: the backup's directory, and
    the node that holds it. RestoreError when the backup is missing or did not succeed."""
    found = await read(ctx, VirtualMachineBackup, backup, namespace)
    if found is None:
        raise RestoreError(f"spec.restoreFrom.backup: VirtualMachineBackup {backup!r} not found")
    status = found.get("status") or {}
    if status.get("phase") != "Succeeded" or not status.get("path"):
        raise RestoreError(
            f"spec.restoreFrom.backup: VirtualMachineBackup {backup!r} has not succeeded "
            f"(phase {status.get('phase') or 'Pending'})"
        )
    node = status.get("nodeName")
    return str(status["path"]), str(node) if node else None
