"""The VirtualMachineBackup reconciler on a fake client: a backup becomes one pod on the VM's
node whose outcome becomes the status; bad requests fail with a message and create nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vkubelet.testing.fakeapi import FakeApiServer
from vkubelet.vmcontroller._backup import BackupReconciler, RestoreError, restore_path
from vkubelet.vmcontroller._base import Context

NS = "apps"

RESOURCES = {
    "VirtualMachineBackup": "virtualmachinebackups",
    "VirtualMachine": "virtualmachines",
    "Pod": "pods",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "PersistentVolume": "persistentvolumes",
}


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, str, str]] = []

    def emit(self, obj: Any, type: str, reason: str, message: str) -> None:
        self.emitted.append((type, reason, message))


def _context() -> tuple[Context, FakeApiServer, Events]:
    api, events = FakeApiServer(), Events()
    return Context(client=api.client(), events=events), api, events  # type: ignore[arg-type]


def _put(api: FakeApiServer, kind: str, obj: dict[str, Any]) -> None:
    api.create(RESOURCES[kind], obj)


def _uid(api: FakeApiServer) -> str:
    backup = api.get("virtualmachinebackups", "nightly", NS)
    assert backup is not None
    return str(backup["metadata"]["uid"])


def _created(api: FakeApiServer) -> list[dict[str, Any]]:
    """The pods the reconciler created, as it sent them."""
    return [c.body for c in api.calls if c.method == "POST" and c.path.endswith("/pods")]


def _backup(client: FakeApiServer, target: dict[str, Any], vm: str = "db") -> None:
    _put(
        client,
        "VirtualMachineBackup",
        {
            "apiVersion": "vkubelet.io/v1alpha1",
            "kind": "VirtualMachineBackup",
            "metadata": {"name": "nightly", "namespace": NS, "uid": "b-uid"},
            "spec": {"vmName": vm, "target": target, "mode": "Auto"},
        },
    )


def _vm(client: FakeApiServer, phase: str = "Running") -> None:
    _put(
        client,
        "VirtualMachine",
        {
            "apiVersion": "vkubelet.io/v1alpha1",
            "kind": "VirtualMachine",
            "metadata": {"name": "db", "namespace": NS, "uid": "vm-uid"},
            "spec": {"replicas": 1},
        },
    )
    _put(
        client,
        "Pod",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "db-x1y2z",
                "namespace": NS,
                "labels": {"vm.vkubelet.io/name": "db"},
            },
            "spec": {
                "nodeName": "hv-1",
                "containers": [{"name": "vm", "image": "vm.vkubelet.io/t"}],
            },
            "status": {"phase": phase},
        },
    )


async def _reconcile(ctx: Context) -> float | None:
    return await BackupReconciler().reconcile(ctx, NS, "nightly")


def _status(client: FakeApiServer) -> dict[str, Any]:
    backup = client.get("virtualmachinebackups", "nightly", NS)
    assert backup is not None
    status: dict[str, Any] = backup["status"]
    return status


def _set_status(client: FakeApiServer, resource: str, name: str, status: dict[str, Any]) -> None:
    client.patch(resource, name, {"status": None}, NS, subresource="status")
    client.patch(resource, name, {"status": status}, NS, subresource="status")


def _finish_pod(client: FakeApiServer, phase: str, terminated: dict[str, Any]) -> None:
    _set_status(
        client,
        "pods",
        "nightly-backup",
        {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "backup",
                    "image": "vm.vkubelet.io/backup",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        },
    )


async def test_a_backup_becomes_a_pod_pinned_to_the_vm_s_node_owned_by_the_backup() -> None:
    ctx, client, events = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    assert await _reconcile(ctx) is not None  # polls while the pod runs
    [pod] = _created(client)
    assert pod["metadata"]["name"] == "nightly-backup"
    assert pod["spec"]["nodeName"] == "hv-1" and pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["containers"][0]["image"] == "vm.vkubelet.io/backup"
    annotations = pod["metadata"]["annotations"]
    assert annotations["vm.vkubelet.io/backup-of"] == "db-x1y2z"
    assert json.loads(annotations["vm.vkubelet.io/backup-target"]) == {"directory": "/srv/backups"}
    assert annotations["vm.vkubelet.io/backup-mode"] == "Auto"
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "VirtualMachineBackup",
        "nightly",
        _uid(client),
        True,
    )
    assert "vm.vkubelet.io/name" not in (pod["metadata"].get("labels") or {})
    assert _status(client) == {"phase": "Pending", "podName": "nightly-backup", "nodeName": "hv-1"}
    assert events.emitted[0][:2] == ("Normal", "Started")
    # again: the same pod is found, never a second one
    await _reconcile(ctx)
    assert len(_created(client)) == 1


async def test_the_status_is_the_pod_s_outcome_size_duration_path() -> None:
    ctx, client, events = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    await _reconcile(ctx)
    result = {"kind": "incremental", "sizeBytes": 1234, "durationSeconds": 0.5, "path": "/srv/x"}
    _finish_pod(
        client, "Succeeded", {"exitCode": 0, "reason": "Completed", "message": json.dumps(result)}
    )
    assert await _reconcile(ctx) is None
    assert _status(client) == {
        "phase": "Succeeded",
        "podName": "nightly-backup",
        "nodeName": "hv-1",
        **result,
    }
    assert events.emitted[-1][:2] == ("Normal", "Succeeded")
    # terminal: nothing changes any more
    _finish_pod(client, "Failed", {"exitCode": 1, "reason": "BackupFailed", "message": "x"})
    assert await _reconcile(ctx) is None and _status(client)["phase"] == "Succeeded"


async def test_a_failed_pod_fails_the_backup_with_its_reason_and_message() -> None:
    ctx, client, events = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    await _reconcile(ctx)
    _finish_pod(client, "Failed", {"exitCode": 1, "reason": "TargetRefused", "message": "outside"})
    await _reconcile(ctx)
    status = _status(client)
    assert (status["phase"], status["reason"], status["message"]) == (
        "Failed",
        "TargetRefused",
        "outside",
    )
    assert events.emitted[-1] == ("Warning", "TargetRefused", "outside")


async def test_a_vm_that_does_not_run_fails_the_backup_and_creates_nothing() -> None:
    ctx, client, _ = _context()
    _vm(client, phase="Pending")
    _backup(client, {"directory": "/srv/backups"})
    assert await _reconcile(ctx) is None
    assert _status(client) == {
        "phase": "Failed",
        "reason": "VMNotRunning",
        "message": "VM db is not running",
    }
    assert not _created(client)


async def test_an_unknown_vm_fails_the_backup() -> None:
    ctx, client, _ = _context()
    _backup(client, {"directory": "/srv/backups"}, vm="ghost")
    await _reconcile(ctx)
    assert _status(client)["reason"] == "VMNotFound" and "'ghost'" in _status(client)["message"]
    assert not _created(client)


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ({"directory": "relative/dir"}, "is not an absolute path"),
        ({"bucket": "s3://x"}, "unknown target kind 'bucket'"),
        ({"directory": "/a", "persistentVolumeClaim": "b"}, "exactly one of"),
        ({"persistentVolumeClaim": "missing"}, "PVC 'missing' not found"),
        ({"persistentVolumeClaim": "pending"}, "PVC 'pending' is not bound"),
        ({"persistentVolumeClaim": "disk"}, "no directory on the node"),
    ],
)
async def test_an_unknown_or_unusable_target_fails_with_a_clear_message_and_creates_nothing(
    target: dict[str, Any], words: str
) -> None:
    ctx, client, events = _context()
    _vm(client)
    _put(
        client,
        "PersistentVolumeClaim",
        {"metadata": {"name": "pending", "namespace": NS}, "status": {"phase": "Pending"}},
    )
    _put(
        client,
        "PersistentVolumeClaim",
        {
            "metadata": {"name": "disk", "namespace": NS},
            "spec": {"volumeName": "pv-img"},
            "status": {"phase": "Bound"},
        },
    )
    _put(
        client,
        "PersistentVolume",
        {"metadata": {"name": "pv-img"}, "spec": {"csi": {"driver": "x", "volumeHandle": "h"}}},
    )
    _backup(client, target)
    assert await _reconcile(ctx) is None
    status = _status(client)
    assert status["phase"] == "Failed" and status["reason"] == "TargetRefused"
    assert words in status["message"]
    assert not _created(client)
    assert events.emitted[-1][:2] == ("Warning", "TargetRefused")


async def test_a_pvc_bound_to_a_local_volume_targets_its_path() -> None:
    ctx, client, _ = _context()
    _vm(client)
    _put(
        client,
        "PersistentVolumeClaim",
        {
            "metadata": {"name": "backups", "namespace": NS},
            "spec": {"volumeName": "pv-local"},
            "status": {"phase": "Bound"},
        },
    )
    _put(
        client,
        "PersistentVolume",
        {"metadata": {"name": "pv-local"}, "spec": {"local": {"path": "/srv/pv1"}}},
    )
    _backup(client, {"persistentVolumeClaim": "backups"})
    await _reconcile(ctx)
    annotation = _created(client)[0]["metadata"]["annotations"]["vm.vkubelet.io/backup-target"]
    assert json.loads(annotation) == {"persistentVolumeClaim": "backups", "path": "/srv/pv1"}


async def test_a_deleted_backup_pod_fails_a_running_backup() -> None:
    ctx, client, _ = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    await _reconcile(ctx)
    _set_status(client, "pods", "nightly-backup", {"phase": "Running"})
    await _reconcile(ctx)
    client.delete("pods", "nightly-backup", NS, grace=0)
    await _reconcile(ctx)
    assert _status(client)["reason"] == "PodDeleted"
    assert len(_created(client)) == 1


async def test_restore_from_a_backup_name_is_its_path_once_it_succeeded() -> None:
    ctx, client, _ = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    with pytest.raises(RestoreError, match="has not succeeded"):
        await restore_path(ctx, NS, "nightly")
    with pytest.raises(RestoreError, match="not found"):
        await restore_path(ctx, NS, "other")
    succeeded = {"phase": "Succeeded", "path": "/srv/backups/apps/db/0001-full"}
    _set_status(client, "virtualmachinebackups", "nightly", succeeded)
    assert (await restore_path(ctx, NS, "nightly"))[0] == "/srv/backups/apps/db/0001-full"
