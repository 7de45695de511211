"""Live migration between two vm nodes (issue 13), driven with plain pods carrying the seam's
annotations, as the VirtualMachineMigration controller drives them: a real control plane, two
real agents, real QEMU under TCG, the small test guest.

One VM boots on hv-1 and the tests take turns on it, in the order written: it migrates to hv-2
while the guest counts, then a migration back is cut off by killing the target's QEMU.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.testing import Kubectl, create_namespace, wait_for

from .twonodes import VMNode, vm_node_pair  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration

TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}
SOURCE = "vm.vkubelet.io/migration-source"
MIGRATE_TO = "vm.vkubelet.io/migrate-to"
TARGET_READY = "vm.vkubelet.io/MigrationTarget"
MIGRATION = "vm.vkubelet.io/Migration"
DISK_MARKER = "migrated-disk-marker-42"
# The guest counts on its console every 100 ms (its own clock: uptime).
COUNTER = (
    "(i=0; while :; do i=$((i+1)); echo \"tick $i $(cut -d' ' -f1 /proc/uptime)\" > /dev/ttyS0;"
    " usleep 100000; done) </dev/null >/dev/null 2>&1 &"
)
TICK = re.compile(r"^tick (\d+) ([\d.]+)$", re.M)


def vm_pod(name: str, node: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "mig"}, "annotations": annotations or {}},
        "spec": {
            "nodeName": node,
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 5,
            "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}}],
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                }
            ],
        },
    }


@dataclass
class Lab:
    namespace: str
    kubectl: Kubectl
    hv1: VMNode
    hv2: VMNode

    def pod(self, name: str) -> dict[str, Any]:
        return dict(self.kubectl.json("-n", self.namespace, "get", "pod", name))

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for condition in self.pod(name)["status"].get("conditions") or []:
            if condition["type"] == kind:
                return dict(condition)
        return {}

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("-n", self.namespace, "apply", "-f", "-", input=json.dumps(manifest))

    def exec(self, name: str, *argv: str) -> str:
        return str(self.kubectl("-n", self.namespace, "exec", name, "--", *argv).stdout)

    def logs(self, name: str) -> str:
        return str(self.kubectl("-n", self.namespace, "logs", name).stdout)

    def running(self, name: str) -> bool:
        status = self.pod(name)["status"]
        states = status.get("containerStatuses") or [{}]
        return status.get("phase") == "Running" and "running" in states[0].get("state", {})

    def target(self, name: str, source: str, node: VMNode) -> dict[str, Any]:
        """Create a target pod on `node` and wait for its endpoint."""
        self.apply(vm_pod(name, node.name, {SOURCE: source}))
        wait_for(
            lambda: self.condition(name, TARGET_READY).get("status") == "True",
            timeout=120,
            what=f"{name}'s endpoint",
        )
        return dict(json.loads(self.condition(name, TARGET_READY)["message"]))

    def migrate(self, source: str, endpoint: dict[str, Any]) -> None:
        value = json.dumps(endpoint)
        self.kubectl("-n", self.namespace, "annotate", "pod", source, f"{MIGRATE_TO}={value}")


@pytest.fixture(scope="module")
def lab(vm_node_pair: tuple[VMNode, VMNode], kubectl: Kubectl) -> Iterator[Lab]:  # noqa: F811
    hv1, hv2 = vm_node_pair
    namespace = create_namespace(kubectl, f"mig-{uuid.uuid4().hex[:6]}")
    handle = Lab(namespace, kubectl, hv1, hv2)
    handle.apply(vm_pod("vm", hv1.name))
    wait_for(lambda: handle.running("vm"), timeout=300, interval=2, what="the VM Running")
    handle.exec("vm", "sh", "-c", f"printf {DISK_MARKER} > /dev/vdb && sync")
    handle.exec("vm", "sh", "-c", COUNTER)
    wait_for(lambda: len(TICK.findall(handle.logs("vm"))) >= 5, timeout=60, what="ticks")
    try:
        yield handle
    finally:
        kubectl("delete", "namespace", namespace, "--wait=true", check=False, timeout=120)


def _ticks(text: str) -> list[tuple[int, float]]:
    return [(int(n), float(t)) for n, t in TICK.findall(text)]


def test_a_running_vm_migrates_to_the_other_node_with_its_disk_and_console(lab: Lab) -> None:
    source_ip = lab.pod("vm")["status"]["podIP"]
    endpoint = lab.target("vm-2", "vm", lab.hv2)
    assert endpoint["host"] == lab.hv2.address
    lab.migrate("vm", endpoint)
    wait_for(
        lambda: lab.condition("vm", MIGRATION).get("reason") in ("Completed", "Failed"),
        timeout=120,
        what="the migration's outcome",
    )
    outcome = lab.condition("vm", MIGRATION)
    assert outcome["reason"] == "Completed", outcome
    result = json.loads(outcome["message"])
    downtime = result["downtimeMilliseconds"] / 1000
    print(f"migration: {result}")

    # The source pod ended as migrated; the VM runs on hv-2 with its disk.
    def source_ended() -> bool:
        state = lab.pod("vm")["status"]["containerStatuses"][0]["state"]
        return bool(state.get("terminated", {}).get("reason") == "Migrated")

    wait_for(source_ended, timeout=60, what="the source pod terminated: Migrated")
    assert lab.pod("vm")["status"]["phase"] == "Succeeded"
    wait_for(lambda: lab.running("vm-2"), timeout=120, what="the target Running")
    target = lab.pod("vm-2")
    assert target["spec"]["nodeName"] == lab.hv2.name
    assert lab.exec("vm-2", "head", "-c", str(len(DISK_MARKER)), "/dev/vdb") == DISK_MARKER
    # Its hostname is still the source's: the same guest, not a new boot.
    assert lab.exec("vm-2", "cat", "/etc/hostname").strip() == "vm"

    # The pod IP changes (each node has its own CIDR); the guest is given the new one.
    new_ip = target["status"]["podIP"]
    assert new_ip != source_ip
    wait_for(
        lambda: f"{new_ip}/" in lab.exec("vm-2", "ip", "-o", "-4", "addr"),
        timeout=60,
        what="the guest's new address",
    )

    # kubectl logs of the target: the source's history first, then the count goes on.
    before = _ticks(lab.logs("vm"))
    wait_for(lambda: len(_ticks(lab.logs("vm-2"))) > len(before) + 5, timeout=60, what="ticks")
    text = lab.logs("vm-2")
    assert text.startswith(lab.logs("vm")[:200])
    assert "vkubelet-guest: booted hostname=vm" in text
    ticks = _ticks(text)
    numbers = [n for n, _ in ticks]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "a tick was lost"
    # The guest's clock stands still while it is paused, so the pause itself (QEMU's downtime)
    # barely shows in its count. What can show is the precopy before it: under TCG on a busy
    # 2-core machine the migration thread can starve the guest's vCPU for the whole RAM phase.
    # So the bound is an ordinary gap plus the RAM phase plus the downtime; the run prints the
    # gap (with KVM, or on a quiet machine, it is an ordinary one: 0.2 s measured).
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(ticks)]
    switch = len(before) - 1  # the history is the source's log: its last tick, then hv-2's
    ordinary = max(gaps[:switch] or [0.1])
    precopy = result["totalMilliseconds"] / 1000
    print(f"switchover gap {gaps[switch]:.3f} s, ordinary max {ordinary:.3f} s")
    assert gaps[switch] <= ordinary + precopy + downtime + 0.5, ticks[switch - 3 : switch + 3]


def test_killing_the_target_midway_leaves_the_vm_running_at_the_source(lab: Lab) -> None:
    """A migration back to hv-1, slowed down (1 MB/s) so that its target can be killed."""
    endpoint = lab.target("vm-3", "vm-2", lab.hv1)
    lab.migrate("vm-2", {**endpoint, "maxBandwidth": 1_000_000})

    def migrating() -> bool:
        condition = lab.condition("vm-2", MIGRATION)
        assert condition.get("reason") != "Failed", condition
        return bool(json.loads(condition.get("message") or "{}").get("phase") == "migrating")

    wait_for(migrating, timeout=60, interval=0.5, what="the RAM migration under way")
    pid = lab.hv1.qemu_pid(lab.pod("vm-3")["metadata"]["uid"])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: lab.condition("vm-2", MIGRATION).get("reason") == "Failed",
        timeout=60,
        what="the migration Failed",
    )
    error = json.loads(lab.condition("vm-2", MIGRATION)["message"])["error"]
    assert error
    print(f"failure: {error}")
    # The VM runs on at hv-2: the pod Running, the guest answering, still counting.
    assert lab.running("vm-2")
    count = len(_ticks(lab.logs("vm-2")))
    wait_for(lambda: len(_ticks(lab.logs("vm-2"))) > count + 5, timeout=60, what="more ticks")
    assert lab.exec("vm-2", "head", "-c", str(len(DISK_MARKER)), "/dev/vdb") == DISK_MARKER
    lab.kubectl("-n", lab.namespace, "delete", "pod", "vm-3", "--wait=false")


# -- the VirtualMachineMigration reconciler against the real apiserver --------------------------
def _install_crds(kube_cluster: Any) -> None:
    """The project's CRDs, installed the way the docs say."""
    install = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "vkubelet"), "vm", "install-crds",
         "--kubeconfig", str(kube_cluster.kubeconfig)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr


def _reconcile_until_done(lab: Lab, kubeconfig: Any, name: str) -> dict[str, Any]:
    """Run the reconciler as the controller would (level-triggered passes) until it is done."""
    import asyncio
    import time

    from lightkube import AsyncClient, KubeConfig

    from vkubelet.vmcontroller._base import Context
    from vkubelet.vmcontroller._migration import MigrationReconciler

    class Events:
        def emit(self, obj: Any, type: str, reason: str, message: str) -> None:
            print(f"event {type} {reason}: {message}")

    async def run() -> None:
        client = AsyncClient(config=KubeConfig.from_file(kubeconfig))
        reconciler = MigrationReconciler()  # a fresh one each pass: no memory between passes
        try:
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:
                ctx = Context(client=client, events=Events())  # type: ignore[arg-type]
                if await reconciler.reconcile(ctx, lab.namespace, name) is None:
                    return
                reconciler = MigrationReconciler()
                await asyncio.sleep(0.5)
        finally:
            await client.close()

    asyncio.run(run())
    return dict(lab.kubectl.json("-n", lab.namespace, "get", "vmmigration", name)["status"])


def test_a_virtualmachinemigration_moves_the_vm_back_and_refuses_a_node_that_is_not_a_vm_node(
    lab: Lab, kube_cluster: Any
) -> None:
    _install_crds(kube_cluster)
    kubeconfig = kube_cluster.kubeconfig
    lab.kubectl("-n", lab.namespace, "label", "pod", "vm-2", "vm.vkubelet.io/name=db")
    vm = {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": "db"},
    }
    # Only the migration reconciler runs here: the template is the CRD's required shape.
    template = {"spec": {"containers": [{"name": "vm", "image": "vm.vkubelet.io/tiny"}]}}
    lab.apply({**vm, "spec": {"replicas": 1, "template": template}})
    plain = f"plain-{uuid.uuid4().hex[:5]}"
    lab.kubectl(
        "create",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": plain}}),
    )
    try:
        bad = {"apiVersion": "vkubelet.io/v1alpha1", "kind": "VirtualMachineMigration"}
        lab.apply(
            {**bad, "metadata": {"name": "bad"}, "spec": {"vmName": "db", "targetNode": plain}}
        )
        status = _reconcile_until_done(lab, kubeconfig, "bad")
        assert (status["phase"], status["message"]) == ("Failed", f"node {plain} is not a vm node")
        labelled = lab.kubectl.json(
            "-n", lab.namespace, "get", "pods", "-l", "vm.vkubelet.io/migration=bad"
        )
        assert labelled["items"] == [] and lab.running("vm-2")
    finally:
        lab.kubectl("delete", "node", plain, "--wait=false")
    # Without a target node the scheduler picks one: hv-1, the only other vm node.
    lab.apply({**bad, "metadata": {"name": "back"}, "spec": {"vmName": "db"}})
    status = _reconcile_until_done(lab, kubeconfig, "back")
    assert status["phase"] == "Succeeded", status
    assert (status["sourceNode"], status["targetNode"]) == (lab.hv2.name, lab.hv1.name)
    assert status["downtimeMilliseconds"] > 0 and status["progress"] == 100
    target = status["targetPod"]
    wait_for(lambda: lab.running(target), timeout=60, what="the VM Running on hv-1")
    assert lab.exec(target, "head", "-c", str(len(DISK_MARKER)), "/dev/vdb") == DISK_MARKER
    gone = lab.kubectl("-n", lab.namespace, "get", "pod", "vm-2", check=False)
    assert gone.returncode != 0 or "deletionTimestamp" in gone.stdout
