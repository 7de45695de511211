"""Hibernation, live resize and VM disks from PVCs (issue 13), end to end: a real control plane,
real kubectl, a real vm agent, QEMU under TCG, the small test guest.

Booting is the expensive part, so one VM pod (a plain pod carrying the VirtualMachine
controller's annotations: `vm.vkubelet.io/machine`, `power-off: Hibernate`) is booted once and
the tests take turns on it in the order written: resize it live, grow its disk, hibernate it
and resume it as a new pod of the same machine, then power it off and boot it cold as a third
pod. Its PVC (class `vkubelet-vm-disk`, provisioned by the agent when the scheduler picked the
node) is a disk of all three pods.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import tempfile
import time
import urllib.request
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

from .vmlab import TOLERATION, kill_qemus, require_vm_host, start_vm_agent

pytestmark = pytest.mark.integration

BOOT_TIMEOUT = 300
HOLD = "vkubelet.io/test-hold"  # a finalizer: keeps the deleted pod so its final status is seen


@dataclass
class Node:
    name: str
    agent: AgentProcess
    workdir: Path
    kubectl: Kubectl
    namespace: str

    @property
    def state(self) -> Path:
        return self.workdir / "state"

    def pod(self, name: str) -> dict[str, Any]:
        return dict(self.kubectl.json("-n", self.namespace, "get", "pod", name))

    def sh(self, pod: str, script: str) -> str:
        result = self.kubectl("-n", self.namespace, "exec", pod, "--", "sh", "-c", script)
        return str(result.stdout).strip()

    def running(self, name: str) -> bool:
        with contextlib.suppress(Exception):
            status = self.pod(name)["status"]
            return bool(status["containerStatuses"][0]["state"].get("running"))
        return False


@pytest.fixture(scope="module")
def node(kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path) -> Iterator[Node]:
    require_vm_host()
    workdir = Path(tempfile.mkdtemp(prefix="vkpw-", dir="/tmp"))  # short: socket paths
    name = f"hv-{uuid.uuid4().hex[:6]}"
    cidr = f"10.214.{random.randrange(1, 250)}.0/24"  # noqa: S311
    namespace = create_namespace(kubectl, f"vmpower-{uuid.uuid4().hex[:6]}")
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(local_test_address())
        agent = start_vm_agent(
            kube_cluster, workdir, name=name, address=address, cidr=cidr, image=vm_guest_image,
            hotplug={"maxCpus": 2, "maxMemory": "1Gi", "memorySlots": 2},
            storage={"kubeconfig": str(kube_cluster.kubeconfig), "intervalSeconds": 1},
        )  # fmt: skip
        handle = Node(name, agent, workdir, kubectl, namespace)
        try:
            wait_for(lambda: node_ready(kubectl, name), timeout=90, what=f"node {name} Ready")
            yield handle
        finally:
            for item in kubectl.json("-n", namespace, "get", "pods")["items"]:
                if item["metadata"].get("finalizers"):
                    kubectl(
                        "-n", namespace, "patch", "pod", item["metadata"]["name"],
                        "--type=json", "-p", '[{"op":"remove","path":"/metadata/finalizers"}]',
                        check=False,
                    )  # fmt: skip
            delete_namespace(kubectl, namespace, timeout=180)
            handle.agent.stop()
            kill_qemus(handle.state)
            kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")


def _vm_pod(
    node: Node, name: str, machine: str, cpu: str, memory: str, power_off: str = "Hibernate"
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "annotations": {
                "vm.vkubelet.io/machine": machine,
                "vm.vkubelet.io/power-off": power_off,
                "vm.vkubelet.io/root-size": "1Gi",
            },
            "finalizers": [HOLD],
        },
        "spec": {
            # Scheduled (not nodeName): the scheduler picks the node for the PVC to be made on.
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "tolerations": [TOLERATION],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
            "terminationGracePeriodSeconds": 60,
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {
                        "requests": {"cpu": cpu, "memory": memory},
                        "limits": {"cpu": cpu, "memory": memory},
                    },
                }
            ],
        },
    }


@dataclass
class Booted:
    name: str
    machine: str
    resume_seconds: float = 0.0  # pod created -> Running (resumed from hibernation)


CLAIM = {
    "apiVersion": "v1",
    "kind": "PersistentVolumeClaim",
    "metadata": {"name": "data"},
    "spec": {
        "storageClassName": "vkubelet-vm-disk",
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "64Mi"}},
    },
}
FIND_DISK = (
    'for d in /sys/block/*; do [ "$(cat $d/serial 2>/dev/null)" = data ] && echo ${d##*/}; done'
)


@pytest.fixture(scope="module")
def vm(node: Node) -> Booted:
    machine = f"m-{uuid.uuid4().hex[:8]}"
    node.kubectl("-n", node.namespace, "apply", "-f", "-", input=json.dumps(CLAIM))
    node.kubectl(
        "-n", node.namespace, "apply", "-f", "-",
        input=json.dumps(_vm_pod(node, "power-1", machine, "1", "256Mi")),
    )  # fmt: skip
    wait_for(lambda: node.running("power-1"), timeout=BOOT_TIMEOUT, interval=1, what="VM up")
    return Booted("power-1", machine)


def _uptime(node: Node, pod: str) -> float:
    return float(node.sh(pod, "cat /proc/uptime").split()[0])


def _mem_total_kib(node: Node, pod: str) -> int:
    line = node.sh(pod, "grep MemTotal /proc/meminfo")
    return int(line.split()[1])


def test_resize_to_two_vcpus_and_512mib_more_is_seen_by_the_guest_without_a_reboot(
    node: Node, vm: Booted
) -> None:
    assert node.sh(vm.name, "nproc") == "1"
    memory_before = _mem_total_kib(node, vm.name)
    uptime_before = _uptime(node, vm.name)
    patch = {
        "spec": {
            "containers": [
                {
                    "name": "vm",
                    "resources": {
                        "requests": {"cpu": "2", "memory": "768Mi"},
                        "limits": {"cpu": "2", "memory": "768Mi"},
                    },
                }
            ]
        }
    }
    node.kubectl(
        "-n", node.namespace, "patch", "pod", vm.name, "--subresource", "resize",
        "--type=strategic", "-p", json.dumps(patch),
    )  # fmt: skip

    def applied() -> bool:
        status = node.pod(vm.name)["status"]
        resources = status["containerStatuses"][0].get("resources") or {}
        return bool(resources.get("limits", {}).get("memory") == "768Mi")

    wait_for(applied, timeout=120, interval=1, what="status resources = the new size")
    assert node.sh(vm.name, "nproc") == "2"
    grown = _mem_total_kib(node, vm.name) - memory_before
    assert 500 * 1024 <= grown <= 520 * 1024, grown
    status = node.pod(vm.name)["status"]
    assert status["containerStatuses"][0]["restartCount"] == 0
    assert _uptime(node, vm.name) > uptime_before  # the same boot
    pending = [c for c in status.get("conditions", []) if c["type"] == "PodResizePending"]
    assert all(c["status"] != "True" for c in pending), pending


def test_shrinking_memory_is_deferred_to_the_next_power_cycle(node: Node, vm: Booted) -> None:
    def resize(memory: str) -> None:
        patch = {
            "spec": {
                "containers": [
                    {
                        "name": "vm",
                        "resources": {
                            "requests": {"memory": memory},
                            "limits": {"memory": memory},
                        },
                    }
                ]
            }
        }
        node.kubectl(
            "-n", node.namespace, "patch", "pod", vm.name, "--subresource", "resize",
            "-p", json.dumps(patch),
        )  # fmt: skip

    def condition() -> dict[str, Any] | None:
        for c in node.pod(vm.name)["status"].get("conditions", []):
            if c["type"] == "PodResizePending" and c["status"] == "True":
                return dict(c)
        return None

    resize("512Mi")
    pending = wait_for(condition, timeout=60, what="PodResizePending")
    assert pending["reason"] == "Deferred"
    assert "applied at next power cycle" in pending["message"]
    resize("768Mi")  # back to what runs: nothing pending any more
    wait_for(lambda: condition() is None, timeout=60, what="no resize pending")


def test_the_root_disk_grows_live(node: Node, vm: Booted) -> None:
    assert node.sh(vm.name, "cat /sys/block/vda/size") == str(2**30 // 512)
    node.kubectl(
        "-n", node.namespace, "annotate", "pod", vm.name, "vm.vkubelet.io/root-disk-size=2Gi"
    )
    wait_for(
        lambda: node.sh(vm.name, "cat /sys/block/vda/size") == str(2 * 2**30 // 512),
        timeout=60,
        what="the guest sees a 2 GiB disk",
    )


def test_hibernate_and_resume_keep_memory_and_uptime_faster_than_a_cold_boot(
    node: Node, vm: Booted
) -> None:
    node.sh(
        vm.name,
        "mkdir -p /mnt/mem && mount -t tmpfs tmpfs /mnt/mem && echo kept-$$ > /mnt/mem/value",
    )
    value = node.sh(vm.name, "cat /mnt/mem/value")
    uptime = _uptime(node, vm.name)
    old_ip = node.pod(vm.name)["status"]["podIP"]
    disk = node.sh(vm.name, FIND_DISK)
    assert disk.startswith("vd"), disk  # the PVC, found by its serial
    node.sh(vm.name, f"echo on-the-claim | dd of=/dev/{disk} bs=512 conv=sync && sync")
    node.kubectl("-n", node.namespace, "delete", "pod", vm.name, "--wait=false")

    def final_state() -> dict[str, Any] | None:
        state = node.pod(vm.name)["status"]["containerStatuses"][0]["state"]
        return dict(state["terminated"]) if "terminated" in state else None

    terminated = wait_for(final_state, timeout=120, interval=1, what="the VM hibernated")
    assert terminated["reason"] == "Hibernated", terminated
    saved = node.state / "machines" / vm.machine / "hibernate" / "state"
    assert saved.is_file()
    assert saved.stat().st_mode & 0o777 == 0o600  # the guest's memory: the agent's alone
    node.kubectl(
        "-n", node.namespace, "patch", "pod", vm.name, "--type=json",
        "-p", '[{"op":"remove","path":"/metadata/finalizers"}]',
    )  # fmt: skip
    node.kubectl("-n", node.namespace, "wait", "--for=delete", f"pod/{vm.name}", "--timeout=60s")
    vm.name = "power-2"
    # A pod that never boots (no image rule) takes the freed address, so that the resumed
    # guest's new pod gets another one and must move to it. It asks for it: the node never
    # hands a powered-off machine's address out as a free one.
    placeholder = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "placeholder", "annotations": {"vm.vkubelet.io/address": old_ip}},
        "spec": {
            "nodeName": node.name,
            "tolerations": [TOLERATION],
            "containers": [{"name": "vm", "image": "vm.vkubelet.io/absent"}],
        },
    }
    node.kubectl("-n", node.namespace, "apply", "-f", "-", input=json.dumps(placeholder))
    wait_for(
        lambda: node.pod("placeholder")["status"].get("podIP") == old_ip,
        timeout=60,
        what="the placeholder holds the old address",
    )

    started = time.monotonic()
    node.kubectl(
        "-n", node.namespace, "apply", "-f", "-",
        input=json.dumps(_vm_pod(node, "power-2", vm.machine, "2", "768Mi")),
    )  # fmt: skip
    wait_for(lambda: node.running("power-2"), timeout=BOOT_TIMEOUT, interval=0.5, what="resumed")
    vm.resume_seconds = time.monotonic() - started
    assert node.sh("power-2", "cat /mnt/mem/value") == value
    assert _uptime(node, "power-2") > uptime  # the same boot, continued
    assert node.sh("power-2", "nproc") == "2"  # the hotplugged CPU came back with the state
    assert not saved.exists()  # dropped once resumed
    # the guest moved to the new pod's address: the host reaches it there
    pod_ip = node.pod("power-2")["status"]["podIP"]
    assert pod_ip != old_ip
    assert f" {pod_ip}/" in node.sh("power-2", "ip -o -4 addr show")
    node.sh("power-2", "mkdir -p /srv && echo resumed > /srv/index.html && httpd -p 8080 -h /srv")
    fetched = wait_for(
        lambda: urllib.request.urlopen(f"http://{pod_ip}:8080/index.html", timeout=2).read(),
        timeout=30,
        what="the resumed guest served on its new pod IP",
    )
    assert fetched == b"resumed\n"
    events = node.kubectl(
        "-n", node.namespace, "get", "events", "--field-selector",
        "involvedObject.name=power-2,reason=Resumed", "-o", "name",
    ).stdout  # fmt: skip
    assert events.strip()


def test_a_cold_boot_keeps_the_claim_s_data_a_failed_hibernation_shuts_down_and_delete_reclaims(
    node: Node, vm: Booted
) -> None:
    assert vm.name == "power-2", "runs after the hibernation test"
    node.kubectl(
        "-n", node.namespace, "annotate", "--overwrite", "pod", vm.name,
        "vm.vkubelet.io/power-off=Shutdown",
    )  # fmt: skip
    node.kubectl(
        "-n", node.namespace, "patch", "pod", vm.name, "--type=json",
        "-p", '[{"op":"remove","path":"/metadata/finalizers"}]',
    )  # fmt: skip
    node.kubectl("-n", node.namespace, "delete", "pod", vm.name, "--timeout=120s")
    assert not (node.state / "machines" / vm.machine / "hibernate" / "state").exists()

    started = time.monotonic()
    node.kubectl(
        "-n", node.namespace, "apply", "-f", "-",
        input=json.dumps(_vm_pod(node, "power-3", vm.machine, "1", "256Mi")),
    )  # fmt: skip
    wait_for(lambda: node.running("power-3"), timeout=BOOT_TIMEOUT, interval=0.5, what="booted")
    cold_seconds = time.monotonic() - started
    vm.name = "power-3"
    assert vm.resume_seconds < cold_seconds, (vm.resume_seconds, cold_seconds)
    assert node.sh("power-3", "test -e /mnt/mem/value || echo gone") == "gone"  # a new boot
    disk = node.sh("power-3", FIND_DISK)
    assert node.sh("power-3", f"head -c 12 /dev/{disk}") == "on-the-claim"

    claim = node.kubectl.json("-n", node.namespace, "get", "pvc", "data")
    pv_name = claim["spec"]["volumeName"]
    pv = node.kubectl.json("get", "pv", pv_name)
    assert pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0][
        "values"
    ] == [node.name]
    image = Path(pv["spec"]["local"]["path"])
    assert image.is_file() and image.parent.name == "volumes"

    # A hibernation that cannot be saved (here: its directory cannot be made) is reported, and
    # the VM is shut down normally instead.
    blocker = node.state / "machines" / vm.machine / "hibernate"
    blocker.write_text("not a directory")
    node.kubectl("-n", node.namespace, "delete", "pod", "power-3", "--wait=false")

    def final_state() -> dict[str, Any] | None:
        state = node.pod("power-3")["status"]["containerStatuses"][0]["state"]
        return dict(state["terminated"]) if "terminated" in state else None

    terminated = wait_for(final_state, timeout=120, interval=1, what="the VM stopped")
    assert terminated["reason"] == "HibernateFailed", terminated
    assert terminated["exitCode"] == 0  # the guest shut down cleanly instead
    blocker.unlink()

    # Reclaim policy Delete: the claim gone, the agent removes the PV and its file.
    node.kubectl(
        "-n", node.namespace, "patch", "pod", "power-3", "--type=json",
        "-p", '[{"op":"remove","path":"/metadata/finalizers"}]',
    )  # fmt: skip
    node.kubectl("-n", node.namespace, "wait", "--for=delete", "pod/power-3", "--timeout=60s")
    node.kubectl("-n", node.namespace, "delete", "pvc", "data", "--timeout=60s")
    wait_for(
        lambda: not node.kubectl("get", "pv", pv_name, check=False).stdout.strip(),
        timeout=60,
        what="the PV deleted",
    )
    assert not image.exists()


def _checksums(*roots: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for root in roots
        for p in sorted([root] if root.is_file() else root.rglob("*"))
        if p.is_file()
    }


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_another_namespace_cannot_use_a_machine_or_a_volume_and_what_the_node_keeps_is_private(
    node: Node, vm: Booted
) -> None:
    """After the cold-boot test: the machine is powered off, its disks at rest. A pod of
    namespace B naming the machine, and one whose claim is pre-bound to namespace A's volume,
    are refused with a reason; A's files are unchanged. No VM boots (on today's code both would,
    with A's disks)."""
    machine = node.state / "machines" / vm.machine
    # A's volume: a claim bound for a pod that never boots (an image without a rule)
    claim = {**CLAIM, "metadata": {"name": "a-data"}}
    holder = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "a-holder"},
        "spec": {
            "nodeName": node.name,
            "tolerations": [TOLERATION],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "a-data"}}],
            "containers": [{"name": "vm", "image": "vm.vkubelet.io/absent"}],
        },
    }
    for manifest in (claim, holder):
        node.kubectl("-n", node.namespace, "apply", "-f", "-", input=json.dumps(manifest))

    def bound() -> str | None:
        found = node.kubectl.json("-n", node.namespace, "get", "pvc", "a-data")
        return str(found["spec"]["volumeName"]) if found["status"].get("phase") == "Bound" else None

    pv_name = wait_for(bound, timeout=60, what="A's claim bound")
    volume = Path(node.kubectl.json("get", "pv", pv_name)["spec"]["local"]["path"])
    assert volume.is_file()
    before = _checksums(machine, volume)

    other = create_namespace(node.kubectl, f"tenant-b-{uuid.uuid4().hex[:6]}")
    try:
        intruder = _vm_pod(node, "b-machine", vm.machine, "1", "256Mi", power_off="Shutdown")
        intruder["metadata"]["finalizers"] = []
        intruder["spec"]["volumes"] = []
        prebound = {**CLAIM, "metadata": {"name": "b-data"}}
        prebound["spec"] = {**CLAIM["spec"], "volumeName": pv_name}  # type: ignore[dict-item]
        taker = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "b-volume"},
            "spec": {
                "nodeName": node.name,
                "tolerations": [TOLERATION],
                "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "b-data"}}],
                "containers": [{"name": "vm", "image": "vm.vkubelet.io/tiny"}],
            },
        }
        for manifest in (intruder, prebound, taker):
            node.kubectl("-n", other, "apply", "-f", "-", input=json.dumps(manifest))

        def waiting(pod: str) -> dict[str, Any]:
            found = node.kubectl.json("-n", other, "get", "pod", pod)
            statuses = found["status"].get("containerStatuses") or [{}]
            return dict((statuses[0].get("state") or {}).get("waiting") or {})

        def event(pod: str, reason: str) -> str:
            return str(
                node.kubectl(
                    "-n", other, "get", "events", "-o", "jsonpath={.items[*].message}",
                    "--field-selector", f"involvedObject.name={pod},reason={reason}",
                ).stdout
            )  # fmt: skip

        refused = wait_for(
            lambda: waiting("b-machine").get("reason") == "MachineRefused" and waiting("b-machine"),
            timeout=60,
            what="the machine refused",
        )
        assert "belongs to another namespace" in refused["message"], refused
        assert "belongs to another namespace" in wait_for(
            lambda: event("b-machine", "MachineRefused"), timeout=30, what="the refusal's Event"
        )
        unattached = wait_for(
            lambda: event("b-volume", "FailedMount"), timeout=60, what="the volume not attached"
        )
        assert f"volume {pv_name} is bound to another claim" in unattached
        assert waiting("b-volume").get("reason") == "ContainerCreating"
        pvc = node.kubectl.json("-n", other, "get", "pvc", "b-data")
        assert pvc["status"]["phase"] == "Pending"  # the PV controller never binds it either
        assert not event("b-machine", "Started") and not event("b-volume", "Started")
    finally:
        node.kubectl("delete", "namespace", other, "--wait=false", check=False)
    assert _checksums(machine, volume) == before
    # what a real run made (disks by qemu-img, the claim's disk, records) is the agent's alone
    for directory in (node.state, machine, node.state / "volumes"):
        assert _mode(directory) == 0o700, directory
    for f in (machine / "root.qcow2", machine / "machine.json", volume):
        assert _mode(f) == 0o600, f
    node.kubectl("-n", node.namespace, "delete", "pod/a-holder", "pvc/a-data", "--wait=false")


def test_a_retained_claim_keeps_its_pv_and_file_and_a_named_node_counts_as_selected(
    node: Node,
) -> None:
    retain = f"vm-disk-retain-{uuid.uuid4().hex[:6]}"
    storage_class = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": retain},
        "provisioner": "vm.vkubelet.io/disk",
        "volumeBindingMode": "WaitForFirstConsumer",
        "reclaimPolicy": "Retain",
    }
    claim = {**CLAIM, "metadata": {"name": "kept"}}
    claim["spec"] = {**CLAIM["spec"], "storageClassName": retain}  # type: ignore[dict-item]
    # No scheduler (nodeName) and no boot (an image without a rule): only the claim matters.
    consumer = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "consumer"},
        "spec": {
            "nodeName": node.name,
            "tolerations": [TOLERATION],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "kept"}}],
            "containers": [{"name": "vm", "image": "vm.vkubelet.io/absent"}],
        },
    }
    node.kubectl("apply", "-f", "-", input=json.dumps(storage_class))
    try:
        for manifest in (claim, consumer):
            node.kubectl("-n", node.namespace, "apply", "-f", "-", input=json.dumps(manifest))

        def bound() -> str | None:
            found = node.kubectl.json("-n", node.namespace, "get", "pvc", "kept")
            if found["status"].get("phase") != "Bound":
                return None
            return str(found["spec"]["volumeName"])

        pv_name = wait_for(bound, timeout=60, what="the claim bound")
        image = Path(node.kubectl.json("get", "pv", pv_name)["spec"]["local"]["path"])
        assert image.is_file()
        node.kubectl("-n", node.namespace, "delete", "pod", "consumer", "--timeout=60s")
        node.kubectl("-n", node.namespace, "delete", "pvc", "kept", "--timeout=60s")

        def phase() -> str:
            return str(node.kubectl.json("get", "pv", pv_name)["status"].get("phase"))

        wait_for(lambda: phase() == "Released", timeout=60, what="the PV released")
        deadline = time.monotonic() + 5  # the provisioner runs every second: it had its chances
        while time.monotonic() < deadline:
            assert phase() == "Released" and image.is_file()
            time.sleep(0.5)
    finally:
        node.kubectl("delete", "storageclass", retain, "--ignore-not-found", check=False)
        for pv in node.kubectl.json("get", "pv")["items"]:
            if pv["spec"].get("storageClassName") == retain:
                node.kubectl("delete", "pv", pv["metadata"]["name"], check=False)
                Path(pv["spec"]["local"]["path"]).unlink(missing_ok=True)
