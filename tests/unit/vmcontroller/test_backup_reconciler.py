"""The VirtualMachineBackup reconciler on a fake client: a backup becomes one pod on the VM's
node whose outcome becomes the status; bad requests fail with a message and create nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2 as httpx
import pytest
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import PersistentVolume, PersistentVolumeClaim, Pod

from vkubelet.vmcontroller._backup import BackupReconciler, RestoreError, restore_path
from vkubelet.vmcontroller._base import Context
from vkubelet.vmcontroller._resources import VirtualMachine, VirtualMachineBackup

NS = "apps"


def _error(code: int) -> ApiError:
    body = {"kind": "Status", "apiVersion": "v1", "code": code, "message": f"error {code}"}
    return ApiError(response=httpx.Response(code, json=body))


class FakeClient:
    """Objects by (kind, namespace, name) as dicts; records creates and status patches."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.created: list[dict[str, Any]] = []

    def put(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.objects[(kind, meta.get("namespace"), meta["name"])] = obj

    @staticmethod
    def _kind(resource: Any) -> str:
        return {
            VirtualMachineBackup: "VirtualMachineBackup",
            VirtualMachineBackup.Status: "VirtualMachineBackup",
            VirtualMachine: "VirtualMachine",
            Pod: "Pod",
            PersistentVolumeClaim: "PersistentVolumeClaim",
            PersistentVolume: "PersistentVolume",
        }[resource]

    async def get(self, resource: Any, name: str, *, namespace: str | None = None) -> Any:
        obj = self.objects.get((self._kind(resource), namespace, name))
        if obj is None:
            raise _error(404)
        return resource.from_dict(json.loads(json.dumps(obj)))

    async def create(self, obj: Any) -> Any:
        data = obj.to_dict()
        kind = data["kind"]
        if (kind, data["metadata"]["namespace"], data["metadata"]["name"]) in self.objects:
            raise _error(409)
        self.put(kind, data)
        self.created.append(data)
        return obj

    async def patch(self, resource: Any, name: str, obj: Any, **kw: Any) -> Any:
        target = self.objects[(self._kind(resource), kw["namespace"], name)]
        target.setdefault("status", {}).update(obj["status"])
        return None

    async def list(
        self, resource: Any, *, namespace: str, labels: dict[str, str]
    ) -> AsyncIterator[Any]:
        for (kind, ns, _), obj in list(self.objects.items()):
            mine = obj["metadata"].get("labels") or {}
            matches = all(mine.get(k) == v for k, v in labels.items())
            if kind == self._kind(resource) and ns == namespace and matches:
                yield resource.from_dict(obj)


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, str, str]] = []

    def emit(self, obj: Any, type: str, reason: str, message: str) -> None:
        self.emitted.append((type, reason, message))


def _context() -> tuple[Context, FakeClient, Events]:
    client, events = FakeClient(), Events()
    return Context(client=client, events=events), client, events  # type: ignore[arg-type]


def _backup(client: FakeClient, target: dict[str, Any], vm: str = "db") -> None:
    client.put(
        "VirtualMachineBackup",
        {
            "apiVersion": "vkubelet.io/v1alpha1",
            "kind": "VirtualMachineBackup",
            "metadata": {"name": "nightly", "namespace": NS, "uid": "b-uid"},
            "spec": {"vmName": vm, "target": target, "mode": "Auto"},
        },
    )


def _vm(client: FakeClient, phase: str = "Running") -> None:
    client.put(
        "VirtualMachine",
        {
            "apiVersion": "vkubelet.io/v1alpha1",
            "kind": "VirtualMachine",
            "metadata": {"name": "db", "namespace": NS, "uid": "vm-uid"},
            "spec": {"replicas": 1},
        },
    )
    client.put(
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


def _reconcile(ctx: Context) -> float | None:
    return asyncio.run(BackupReconciler().reconcile(ctx, NS, "nightly"))


def _status(client: FakeClient) -> dict[str, Any]:
    status: dict[str, Any] = client.objects[("VirtualMachineBackup", NS, "nightly")]["status"]
    return status


def _finish_pod(client: FakeClient, phase: str, terminated: dict[str, Any]) -> None:
    pod = client.objects[("Pod", NS, "nightly-backup")]
    pod["status"] = {
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
    }


def test_a_backup_becomes_a_pod_pinned_to_the_vm_s_node_owned_by_the_backup() -> None:
    ctx, client, events = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    assert _reconcile(ctx) is not None  # polls while the pod runs
    [pod] = client.created
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
        "b-uid",
        True,
    )
    assert "vm.vkubelet.io/name" not in (pod["metadata"].get("labels") or {})
    assert _status(client) == {"phase": "Pending", "podName": "nightly-backup", "nodeName": "hv-1"}
    assert events.emitted[0][:2] == ("Normal", "Started")
    # again: the same pod is found, never a second one
    _reconcile(ctx)
    assert len(client.created) == 1


def test_the_status_is_the_pod_s_outcome_size_duration_path() -> None:
    ctx, client, events = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    _reconcile(ctx)
    result = {"kind": "incremental", "sizeBytes": 1234, "durationSeconds": 0.5, "path": "/srv/x"}
    _finish_pod(
        client, "Succeeded", {"exitCode": 0, "reason": "Completed", "message": json.dumps(result)}
    )
    assert _reconcile(ctx) is None
    assert _status(client) == {
        "phase": "Succeeded",
        "podName": "nightly-backup",
        "nodeName": "hv-1",
        **result,
    }
    assert events.emitted[-1][:2] == ("Normal", "Succeeded")
    # terminal: nothing changes any more
    _finish_pod(client, "Failed", {"exitCode": 1, "reason": "BackupFailed", "message": "x"})
    assert _reconcile(ctx) is None and _status(client)["phase"] == "Succeeded"


def test_a_failed_pod_fails_the_backup_with_its_reason_and_message() -> None:
    ctx, client, events = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    _reconcile(ctx)
    _finish_pod(client, "Failed", {"exitCode": 1, "reason": "TargetRefused", "message": "outside"})
    _reconcile(ctx)
    status = _status(client)
    assert (status["phase"], status["reason"], status["message"]) == (
        "Failed",
        "TargetRefused",
        "outside",
    )
    assert events.emitted[-1] == ("Warning", "TargetRefused", "outside")


def test_a_vm_that_does_not_run_fails_the_backup_and_creates_nothing() -> None:
    ctx, client, _ = _context()
    _vm(client, phase="Pending")
    _backup(client, {"directory": "/srv/backups"})
    assert _reconcile(ctx) is None
    assert _status(client) == {
        "phase": "Failed",
        "reason": "VMNotRunning",
        "message": "VM db is not running",
    }
    assert not client.created


def test_an_unknown_vm_fails_the_backup() -> None:
    ctx, client, _ = _context()
    _backup(client, {"directory": "/srv/backups"}, vm="ghost")
    _reconcile(ctx)
    assert _status(client)["reason"] == "VMNotFound" and "'ghost'" in _status(client)["message"]
    assert not client.created


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
def test_an_unknown_or_unusable_target_fails_with_a_clear_message_and_creates_nothing(
    target: dict[str, Any], words: str
) -> None:
    ctx, client, events = _context()
    _vm(client)
    client.put(
        "PersistentVolumeClaim",
        {"metadata": {"name": "pending", "namespace": NS}, "status": {"phase": "Pending"}},
    )
    client.put(
        "PersistentVolumeClaim",
        {
            "metadata": {"name": "disk", "namespace": NS},
            "spec": {"volumeName": "pv-img"},
            "status": {"phase": "Bound"},
        },
    )
    client.put(
        "PersistentVolume",
        {"metadata": {"name": "pv-img"}, "spec": {"csi": {"driver": "x", "volumeHandle": "h"}}},
    )
    _backup(client, target)
    assert _reconcile(ctx) is None
    status = _status(client)
    assert status["phase"] == "Failed" and status["reason"] == "TargetRefused"
    assert words in status["message"]
    assert not client.created
    assert events.emitted[-1][:2] == ("Warning", "TargetRefused")


def test_a_pvc_bound_to_a_local_volume_targets_its_path() -> None:
    ctx, client, _ = _context()
    _vm(client)
    client.put(
        "PersistentVolumeClaim",
        {
            "metadata": {"name": "backups", "namespace": NS},
            "spec": {"volumeName": "pv-local"},
            "status": {"phase": "Bound"},
        },
    )
    client.put(
        "PersistentVolume",
        {"metadata": {"name": "pv-local"}, "spec": {"local": {"path": "/srv/pv1"}}},
    )
    _backup(client, {"persistentVolumeClaim": "backups"})
    _reconcile(ctx)
    annotation = client.created[0]["metadata"]["annotations"]["vm.vkubelet.io/backup-target"]
    assert json.loads(annotation) == {"persistentVolumeClaim": "backups", "path": "/srv/pv1"}


def test_a_deleted_backup_pod_fails_a_running_backup() -> None:
    ctx, client, _ = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    _reconcile(ctx)
    client.objects[("Pod", NS, "nightly-backup")]["status"] = {"phase": "Running"}
    _reconcile(ctx)
    del client.objects[("Pod", NS, "nightly-backup")]
    _reconcile(ctx)
    assert _status(client)["reason"] == "PodDeleted"
    assert len(client.created) == 1


def test_restore_from_a_backup_name_is_its_path_once_it_succeeded() -> None:
    ctx, client, _ = _context()
    _vm(client)
    _backup(client, {"directory": "/srv/backups"})
    with pytest.raises(RestoreError, match="has not succeeded"):
        asyncio.run(restore_path(ctx, NS, "nightly"))
    with pytest.raises(RestoreError, match="not found"):
        asyncio.run(restore_path(ctx, NS, "other"))
    _status_obj = client.objects[("VirtualMachineBackup", NS, "nightly")]
    _status_obj["status"] = {"phase": "Succeeded", "path": "/srv/backups/apps/db/0001-full"}
    assert asyncio.run(restore_path(ctx, NS, "nightly"))[0] == "/srv/backups/apps/db/0001-full"
