"""Backups of a running VM and restores (issue 13's backup acceptance), driven with plain pods
carrying the annotations the VirtualMachineBackup controller sets: a real control plane, real
kubectl, real QEMU under TCG, the small test guest.

The filesystem under test is an ext4-driver-mounted ext2 (busybox `mke2fs`; the cloud kernel has
ext4 built in) on the VM's second disk (an emptyDir volume). One source VM serves every test, in
the order written: a full backup while a writer runs, an incremental one, a restore into a new VM,
the refusals.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    delete_namespace,
    local_test_address,
    node_ready,
    wait_for,
)

from .vmlab import TOLERATION, clean_up, require_vm_host, start_vm_agent

pytestmark = pytest.mark.integration

BOOT_TIMEOUT = 300
# The writer appends consecutive numbers, one line each, to a file on the data disk.
WRITER = "i=0; while :; do echo $i >> /data/log; i=$((i+1)); done"


@dataclass
class Node:
    name: str
    agent: AgentProcess
    workdir: Path
    namespace: str
    kubectl: Kubectl

    @property
    def backups(self) -> Path:
        return self.workdir / "backups"

    def exec(self, pod: str, script: str) -> str:
        return self.kubectl("-n", self.namespace, "exec", pod, "--", "sh", "-c", script).stdout

    def pod(self, name: str) -> dict[str, Any]:
        pod: dict[str, Any] = self.kubectl.json("-n", self.namespace, "get", "pod", name)
        return pod

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("-n", self.namespace, "apply", "-f", "-", input=json.dumps(manifest))


@pytest.fixture(scope="module")
def node(kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path) -> Iterator[Node]:
    require_vm_host()
    workdir = Path(tempfile.mkdtemp(prefix="vkbk-", dir="/tmp"))  # short: unix socket paths
    name = f"hv-bk-{uuid.uuid4().hex[:6]}"
    cidr = f"10.214.{random.randrange(1, 250)}.0/24"  # noqa: S311
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(local_test_address())
        agent = start_vm_agent(
            kube_cluster, workdir, name=name, address=address, cidr=cidr,
            image=vm_guest_image, backupDirectories=["backups"],
        )  # fmt: skip
        namespace = create_namespace(kubectl, f"vmbk-{uuid.uuid4().hex[:6]}")
        handle = Node(name, agent, workdir, namespace, kubectl)
        try:
            wait_for(lambda: node_ready(kubectl, name), timeout=90, what=f"node {name} Ready")
            yield handle
        finally:
            delete_namespace(kubectl, namespace)
            handle.agent.stop()
            clean_up(workdir / "state", cidr)
            kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
            shutil.rmtree(workdir, ignore_errors=True)


def _vm_pod(node: Node, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "nodeName": node.name,
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 10,
            "volumes": [{"name": "data", "emptyDir": {"sizeLimit": "256Mi"}}],
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                }
            ],
        },
    }


def _running(node: Node, name: str) -> bool:
    status = node.pod(name)["status"]
    state = (status.get("containerStatuses") or [{}])[0].get("state", {})
    return status.get("phase") == "Running" and "running" in state


@pytest.fixture(scope="module")
def source(node: Node) -> str:
    """The VM backed up: a fresh ext2 on its data disk, a marker and 160 MiB of data written
    and synced (enough for the full copy to take measurably longer than an incremental one),
    then a writer appending lines for as long as the VM lives."""
    node.apply(_vm_pod(node, "src"))
    wait_for(lambda: _running(node, "src"), timeout=BOOT_TIMEOUT, interval=2, what="src Running")
    node.exec(
        "src",
        "mke2fs -q -F /dev/vdb && mkdir -p /data && mount -t ext4 /dev/vdb /data "
        "&& echo before-the-freeze > /data/marker "
        "&& dd if=/dev/zero of=/data/blob bs=1M count=160 2>/dev/null && sync",
    )
    node.exec("src", f"setsid sh -c '{WRITER}' </dev/null >/dev/null 2>&1 &")
    wait_for(lambda: int(node.exec("src", "wc -l < /data/log").strip() or 0) > 100, what="writer")
    return "src"


def _backup(node: Node, name: str, target: dict[str, Any], of: str = "src") -> dict[str, Any]:
    node.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "annotations": {
                    "vm.vkubelet.io/backup-of": of,
                    "vm.vkubelet.io/backup-target": json.dumps(target),
                    "vm.vkubelet.io/backup-mode": "Auto",
                },
            },
            "spec": {
                "nodeName": node.name,
                "restartPolicy": "Never",
                "tolerations": [TOLERATION],
                "containers": [{"name": "backup", "image": "vm.vkubelet.io/backup"}],
            },
        }
    )

    def ended() -> dict[str, Any] | None:
        pod = node.pod(name)
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    pod: dict[str, Any] = wait_for(ended, timeout=120, interval=1, what=f"backup pod {name} ended")
    return pod


def _terminated(pod: dict[str, Any]) -> dict[str, Any]:
    terminated: dict[str, Any] = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    return terminated


def _result(pod: dict[str, Any]) -> dict[str, Any]:
    assert pod["status"]["phase"] == "Succeeded", _terminated(pod)
    result: dict[str, Any] = json.loads(_terminated(pod)["message"])
    return result


@pytest.fixture(scope="module")
def full(node: Node, source: str) -> dict[str, Any]:
    return _result(_backup(node, "backup-1", {"directory": str(node.backups)}))


@pytest.fixture(scope="module")
def incremental(node: Node, full: dict[str, Any]) -> dict[str, Any]:
    return _result(_backup(node, "backup-2", {"directory": str(node.backups)}))


def test_a_full_backup_while_a_writer_runs_succeeds_with_size_duration_and_path(
    node: Node, full: dict[str, Any]
) -> None:
    assert full["kind"] == "full"
    assert full["consistency"] == "filesystem-consistent"
    assert full["sizeBytes"] > 0 and full["durationSeconds"] > 0
    path = Path(full["path"])
    assert path.parent == node.backups / node.namespace / "src"
    assert sorted(p.name for p in path.iterdir()) == ["disk0.qcow2", "disk1.qcow2"]
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert [b["kind"] for b in manifest["backups"]] == ["full"]
    assert manifest["vm"]["pod"] == "src"
    # the writer kept going: the guest was thawed
    before = int(node.exec("src", "wc -l < /data/log"))
    wait_for(lambda: int(node.exec("src", "wc -l < /data/log")) > before, what="writer resumed")
    logs = node.kubectl("-n", node.namespace, "logs", "backup-1").stdout
    assert "guest filesystems frozen" in logs and "copied 100%" in logs and "done: full" in logs


def test_the_second_backup_is_incremental_smaller_and_faster(
    node: Node, full: dict[str, Any], incremental: dict[str, Any]
) -> None:
    assert incremental["kind"] == "incremental"
    assert incremental["sizeBytes"] < full["sizeBytes"] / 2
    # the copy is what scales with the data; the whole duration also counts fixed costs (the
    # freeze, qemu-img, QMP round trips) that vary by seconds on a busy machine
    assert incremental["copySeconds"] < full["copySeconds"], (incremental, full)
    assert 0 < incremental["durationSeconds"] < 30
    path = Path(incremental["path"])
    info = subprocess.run(
        ["qemu-img", "info", "--output=json", str(path / "disk1.qcow2")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert (
        json.loads(info.stdout)["backing-filename"] == f"../{Path(full['path']).name}/disk1.qcow2"
    )
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert [b["kind"] for b in manifest["backups"]] == ["full", "incremental"]


def test_the_backup_restores_to_a_new_vm_whose_filesystem_checks_clean_with_the_data(
    node: Node, incremental: dict[str, Any]
) -> None:
    manifest = Path(incremental["path"]).parent / "manifest.json"
    node.apply(_vm_pod(node, "restored", {"vm.vkubelet.io/restore-from": str(manifest)}))
    wait_for(lambda: _running(node, "restored"), timeout=BOOT_TIMEOUT, interval=2, what="restored")
    uid = node.pod("restored")["metadata"]["uid"]
    disk = node.workdir / "state" / "vms" / uid / "scratch0.qcow2"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "data.raw"
        subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", str(disk), str(raw)], check=True)
        fsck = subprocess.run(["e2fsck", "-f", "-n", str(raw)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    out = node.exec("restored", "mkdir -p /data && mount -o ro /dev/vdb /data && cat /data/marker")
    assert out.strip() == "before-the-freeze"
    lines = node.exec("restored", "cat /data/log").split("\n")
    numbers = [int(n) for n in lines if n]
    assert len(numbers) > 100 and numbers == list(range(len(numbers)))  # whole lines, no gap


def test_bad_targets_and_an_unknown_vm_are_refused_with_a_clear_reason(
    node: Node, source: str
) -> None:
    relative = _backup(node, "bad-relative", {"directory": "backups"})
    outside = _backup(node, "bad-outside", {"directory": "/etc/vkubelet-backup"})
    claim = _backup(node, "bad-claim", {"persistentVolumeClaim": "nope"})
    nobody = _backup(node, "bad-vm", {"directory": str(node.backups)}, of="no-such-vm")
    for pod, reason, words in (
        (relative, "TargetRefused", "is relative"),
        (outside, "TargetRefused", "outside this node's backup directories"),
        (claim, "TargetRefused", "not resolved to a directory"),
        (nobody, "VMNotFound", "no VM pod"),
    ):
        assert pod["status"]["phase"] == "Failed"
        terminated = _terminated(pod)
        assert terminated["reason"] == reason and words in terminated["message"], terminated
    assert not Path("/etc/vkubelet-backup").exists()
    events = node.kubectl.json(
        "-n", node.namespace, "get", "events", "--field-selector", "involvedObject.name=bad-vm"
    )
    assert any(e["reason"] == "VMNotFound" for e in events["items"])
    # a backup pod is deleted like any pod
    node.kubectl("-n", node.namespace, "delete", "pod", "bad-vm", "--wait=true", "--timeout=60s")


def test_a_target_without_room_is_refused_before_the_freeze_and_the_guest_runs_on(
    node: Node, source: str
) -> None:
    """A target too small for the copy is refused up front: were it to fill up mid-copy, the
    jobs' copy-before-write would fail the guest's own writes (and pause the VM). One with room,
    mounted after the VM started (QEMU's mount namespace never sees it), takes the backup: the
    target reaches QEMU as a descriptor, not a path."""
    small = node.backups / "small"
    small.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True)
    try:
        pod = _backup(node, "backup-no-room", {"directory": str(small)})
        chain = small / node.namespace / "src"
        leftovers = sorted(p.name for p in chain.iterdir())
    finally:
        subprocess.run(["umount", str(small)], check=False)
    assert pod["status"]["phase"] == "Failed"
    terminated = _terminated(pod)
    assert terminated["reason"] == "TargetRefused", terminated
    assert "bytes free, this full backup needs about" in terminated["message"], terminated
    assert leftovers == []  # no backup directory, no manifest
    logs = node.kubectl("-n", node.namespace, "logs", "backup-no-room").stdout
    assert "guest filesystems frozen" not in logs
    before = int(node.exec("src", "wc -l < /data/log"))
    wait_for(lambda: int(node.exec("src", "wc -l < /data/log")) > before, what="writer goes on")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320m", "tmpfs", str(small)], check=True)
    try:
        result = _result(_backup(node, "backup-late-mount", {"directory": str(small)}))
        assert result["kind"] == "full" and Path(result["path"]).parent.parent.parent == small
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_without_a_guest_agent_the_backup_is_crash_consistent_and_says_so(
    node: Node, incremental: dict[str, Any]
) -> None:
    """Last: the source VM's agent is ended (busybox killall, after the exec has returned)."""
    node.exec("src", "setsid sh -c 'sleep 1; killall qemu-ga' </dev/null >/dev/null 2>&1 &")

    def agent_gone() -> bool:
        result = node.kubectl("-n", node.namespace, "exec", "src", "--", "true", check=False)
        return result.returncode != 0

    wait_for(agent_gone, timeout=30, what="the guest agent gone")
    result = _result(_backup(node, "backup-no-agent", {"directory": str(node.backups)}))
    assert result["kind"] == "incremental"
    assert result["consistency"].startswith("crash-consistent (guest agent:"), result
    logs = node.kubectl("-n", node.namespace, "logs", "backup-no-agent").stdout
    assert "the backup is crash-consistent" in logs
