"""The chart with the vm provider and `vm.controller: true`, as deploy/manifests/vm.yaml has it,
run as its pod (tests/integration/helmchart.py): one process, `vkubelet run --vm-controller`,
with only the chart's ServiceAccount and RBAC. The CRDs from the chart's crds/ (as helm installs
them), the state directory the chart's hostPath names, QEMU under TCG with the cached test guest.
One VirtualMachine is created through the API: the controller makes its pod, the provider boots
it on the chart's node, `kubectl logs` shows its console, `kubectl exec` reaches the guest, a
VirtualMachineBackup of it succeeds, and deleting the VM removes its pod, with no request
refused on the way (at debug level, so that a refusal the code tolerates quietly, such as the
controller's node-selection check, shows too).

One TCG boot (~20 s to Running with the machine's load at 20): the module costs ~50-90 s here."""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster, ensure_helm
from vkubelet.testing import Kubectl, wait_for

from .helmchart import CHART, Installed, PodAgent, agent_as_pod, can_i, installed_chart, refusals
from .vm.vmlab import TOLERATION, clean_up, require_vm_host

pytestmark = pytest.mark.integration

BOOT_TIMEOUT = 300  # TCG on two shared cores


@dataclass
class Hypervisor:
    installed: Installed
    agent: PodAgent
    state: Path


@pytest.fixture(scope="module")
def hypervisor(
    kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path
) -> Iterator[Hypervisor]:
    require_vm_host()
    helm = ensure_helm(lambda line: print(line, file=sys.stderr, flush=True))
    # As `helm install` does with crds/ (the same CRDs `vkubelet vm install-crds` applies).
    crds = str(CHART / "crds")
    kubectl("apply", "--server-side", "--force-conflicts", "-f", crds)
    kubectl("wait", "--for=condition=established", "-f", crds, "--timeout=60s")
    workdir = Path(tempfile.mkdtemp(prefix="vkhc-", dir="/tmp"))  # short: QEMU's socket paths
    state = workdir / "vm"  # the chart's vm.stateHostPath: the same path inside the pod
    cidr = f"10.216.{random.randrange(1, 250)}.0/24"  # noqa: S311
    values = {
        "provider": "vm",
        "replicas": 1,
        "vm": {"controller": True, "stateHostPath": str(state)},
        "logLevel": "debug",
        "providerConfig": {
            "stateDir": str(state),
            "accel": "tcg",
            "podCIDR": cidr,
            "reserved": {"memory": "1Gi"},
            "guestAgentTimeoutSeconds": BOOT_TIMEOUT,
            "translations": [{"name": "tiny", "url": vm_guest_image.resolve().as_uri()}],
        },
    }
    node = f"hv-helm-{uuid.uuid4().hex[:6]}"
    try:
        with (
            installed_chart(helm, kubectl, node, values) as installed,
            agent_as_pod(installed, kube_cluster, kubectl, workdir / "pod") as agent,
        ):
            try:
                yield Hypervisor(installed, agent, state)
            finally:  # the VMs stopped by the agent before it goes
                where = ("-n", installed.namespace)
                kubectl(*where, "delete", "vm", "--all", "--wait=true", check=False, timeout=180)
    finally:
        clean_up(state, cidr)
        shutil.rmtree(state, ignore_errors=True)


def virtual_machine(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": "vm"},
        "spec": {
            "replicas": 1,
            "template": {
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "tolerations": [TOLERATION],
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "vm",
                            "image": "vm.vkubelet.io/tiny",
                            "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                        }
                    ],
                },
            },
        },
    }


def test_the_controller_and_provider_boot_a_vm_with_logs_and_exec_under_the_charts_rbac(
    hypervisor: Hypervisor, kubectl: Kubectl
) -> None:
    installed = hypervisor.installed
    where = ("-n", installed.namespace)
    kubectl(*where, "apply", "-f", "-", input=json.dumps(virtual_machine(installed.node)))

    def running() -> str | None:
        status = kubectl.json(*where, "get", "vm", "vm").get("status") or {}
        return status.get("podName") if status.get("phase") == "Running" else None

    pod: str = wait_for(running, timeout=BOOT_TIMEOUT, interval=2, what="the VM Running")
    assert kubectl.json(*where, "get", "pod", pod)["spec"]["nodeName"] == installed.node
    wait_for(
        lambda: f"booted hostname={pod}" in kubectl(*where, "logs", pod).stdout,
        timeout=60,
        what="the boot console in kubectl logs",
    )
    assert kubectl(*where, "exec", pod, "--", "cat", "/etc/hostname").stdout.strip() == pod
    events = kubectl.json(*where, "get", "events", "--field-selector", "involvedObject.name=vm")
    assert "PoweringOn" in {e["reason"] for e in events["items"]}

    # A backup: the controller's backup pod, the provider's copy into the state directory.
    backups = hypervisor.state / "backups"  # the provider's default backup directory
    backup = {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachineBackup",
        "metadata": {"name": "b1"},
        "spec": {"vmName": "vm", "target": {"directory": str(backups)}},
    }
    kubectl(*where, "apply", "-f", "-", input=json.dumps(backup))

    def backed_up() -> dict[str, Any] | None:
        status = kubectl.json(*where, "get", "virtualmachinebackup", "b1").get("status") or {}
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    status = wait_for(backed_up, timeout=120, interval=1, what="the backup done")
    assert status["phase"] == "Succeeded", status
    assert Path(status["path"]).is_relative_to(backups)

    kubectl(*where, "delete", "vm", "vm", "--wait=true", timeout=180)
    wait_for(
        lambda: kubectl(*where, "get", "pod", pod, "--ignore-not-found").stdout == "",
        timeout=120,
        what="the VM's pod deleted",
    )
    assert not refusals(hypervisor.agent.log())


@pytest.mark.parametrize(
    ("verb", "resource", "namespace", "answer"),
    [
        ("create", "pods", "default", "yes"),  # the controller makes the VMs' pods
        ("list", "nodes", "", "yes"),  # ...and checks their node selection
        ("create", "virtualmachinemigrations.vkubelet.io", "default", "yes"),  # ...moving them
        ("get", "persistentvolumes", "", "yes"),  # a backup's claim
        ("update", "leases:vkubelet-vm-controller", "kube-system", "yes"),
        ("create", "virtualmachines.vkubelet.io", "default", "no"),  # users make VMs
        ("delete", "virtualmachines.vkubelet.io", "default", "no"),
        ("delete", "nodes", "", "no"),  # not a fleet
        ("create", "pods/eviction", "default", "no"),
        ("create", "persistentvolumes", "", "no"),  # the disk provisioner has its own kubeconfig
    ],
)
def test_the_vm_charts_grants_are_exactly_its_own(
    hypervisor: Hypervisor, kubectl: Kubectl, verb: str, resource: str, namespace: str, answer: str
) -> None:
    assert can_i(kubectl, hypervisor.installed, verb, resource, namespace) == answer
