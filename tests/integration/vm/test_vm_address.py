"""A VirtualMachine keeps its address (issue 26) across a power cycle, a live migration to the
other vm node, a power cycle there and a hibernation: status.ip, the pod IP and the guest's own
address stay the same, and the host reaches the guest's HTTP server at it each time (real
packets: the /32 route follows the VM from one node's link to the other's on this machine).

Two real agents (`twonodes`, sharing 10.212.0.0/16), the VM controller as `vkubelet
vm-controller`, real QEMU under TCG with the small test guest.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import Kubectl, create_namespace, delete_namespace, wait_for

from .twonodes import VMNode
from .vmlab import TOLERATION, install_crds

pytestmark = pytest.mark.integration

PAIR = "vm-address-test.vkubelet.io/pair"
PAGE = "kept-address-page"
SERVE = f"mkdir -p /www && echo {PAGE} > /www/index.html && httpd -p 8080 -h /www"


@dataclass
class Lab:
    kubectl: Kubectl
    namespace: str
    hv1: VMNode
    hv2: VMNode

    def k(self, *args: str, **kw: Any) -> Any:
        return self.kubectl("-n", self.namespace, *args, **kw)

    def status(self) -> dict[str, Any]:
        vm = self.kubectl.json("-n", self.namespace, "get", "vm", "keep")
        return dict(vm.get("status") or {})

    def running_on(self, node: VMNode) -> bool:
        status = self.status()
        return status.get("phase") == "Running" and status.get("nodeName") == node.name

    def replicas(self, count: int) -> None:
        body = json.dumps({"spec": {"replicas": count}})
        self.k("patch", "vm", "keep", "--type=merge", "-p", body)


def serves(address: str) -> bool:
    """The guest's HTTP server answers at `address`, from this host."""
    try:
        with socket.create_connection((address, 8080), timeout=3) as conn:
            conn.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
            conn.settimeout(3)
            return PAGE.encode() in b"".join(iter(lambda: conn.recv(4096), b""))
    except OSError:
        return False


@pytest.fixture(scope="module")
def lab(
    vm_node_pair: tuple[VMNode, VMNode],
    kube_cluster: Cluster,
    kubectl: Kubectl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Lab]:
    hv1, hv2 = vm_node_pair
    install_crds(kube_cluster)
    for node in (hv1, hv2):
        kubectl("label", "node", node.name, f"{PAIR}=yes", "--overwrite")
    namespace = create_namespace(kubectl, f"addr-{uuid.uuid4().hex[:6]}")
    log_path = tmp_path_factory.mktemp("controller") / "controller.log"
    with log_path.open("wb") as log:
        controller = subprocess.Popen(
            [str(Path(sys.prefix) / "bin" / "vkubelet"), "vm-controller",
             "--kubeconfig", str(kube_cluster.kubeconfig), "--namespace", namespace,
             "--lease-namespace", namespace, "--identity", "addr", "--log-level", "DEBUG"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        yield Lab(kubectl, namespace, hv1, hv2)
    finally:
        controller.terminate()
        controller.wait(timeout=30)
        print(log_path.read_text(errors="replace")[-3000:])
        delete_namespace(kubectl, namespace)
        for node in (hv1, hv2):
            kubectl("label", "node", node.name, f"{PAIR}-", check=False)


def _boot_and_serve(lab: Lab, node: VMNode, address: str | None) -> str:
    """Wait for the VM Running on `node`, start its HTTP server, check the address everywhere
    (status.ip, the pod IP, the guest's interface, packets from the host); the address."""
    wait_for(lambda: lab.running_on(node), timeout=300, interval=2, what=f"keep on {node.name}")
    status = lab.status()
    ip = str(status["ip"])
    if address is not None:
        assert ip == address, f"status.ip changed: {address} -> {ip}"
    pod = lab.kubectl.json("-n", lab.namespace, "get", "pod", status["podName"])
    assert pod["status"]["podIP"] == ip
    guest = str(lab.k("exec", status["podName"], "--", "ip", "-o", "-4", "addr").stdout)
    assert f" {ip}/" in guest, guest
    lab.k("exec", status["podName"], "--", "sh", "-c", SERVE)
    wait_for(lambda: serves(ip), timeout=60, what=f"the guest's httpd at {ip}")
    return ip


def _power_cycle(lab: Lab, node: VMNode, address: str) -> None:
    lab.replicas(0)
    wait_for(lambda: lab.status().get("phase") == "Stopped", timeout=180, what="keep Stopped")
    assert lab.status().get("ip") == address  # kept while powered off
    lab.replicas(1)
    _boot_and_serve(lab, node, address)


def test_a_vm_keeps_its_address_across_power_cycles_a_live_migration_and_hibernation(
    lab: Lab,
) -> None:
    template = {
        "metadata": {"labels": {"app": "keep"}},
        "spec": {
            "nodeSelector": {PAIR: "yes"},  # either vm node of the pair
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 10,
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                }
            ],
        },
    }
    vm = {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": "keep"},
        "spec": {"replicas": 1, "template": template},
    }
    lab.k("apply", "-f", "-", input=json.dumps(vm))
    wait_for(lambda: lab.status().get("nodeName"), timeout=120, what="keep scheduled")
    first, second = (lab.hv1, lab.hv2)
    if lab.status()["nodeName"] == lab.hv2.name:
        first, second = second, first
    address = _boot_and_serve(lab, first, None)
    print(f"keep's address on {first.name}: {address}")

    _power_cycle(lab, first, address)

    # Live migration to the other node: the guest keeps running with its address; the host's
    # /32 moves to the target's link and the guest gets the target's gateway.
    migration = {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": "keep-moves"},
        "spec": {"vmName": "keep", "targetNode": second.name},
    }
    lab.k("apply", "-f", "-", input=json.dumps(migration))

    def migrated() -> str | None:
        found = lab.kubectl.json("-n", lab.namespace, "get", "vmmigration", "keep-moves")
        phase = found.get("status", {}).get("phase")
        assert phase != "Failed", found["status"]
        return str(phase) if phase == "Succeeded" else None

    wait_for(migrated, timeout=300, interval=2, what="the migration Succeeded")
    wait_for(lambda: lab.running_on(second), timeout=120, what=f"keep Running on {second.name}")
    status = lab.status()
    assert status["ip"] == address
    pod = lab.kubectl.json("-n", lab.namespace, "get", "pod", status["podName"])
    assert pod["status"]["podIP"] == address
    # The same guest (its httpd still runs: no new boot) answers at the same address.
    wait_for(lambda: serves(address), timeout=60, what=f"the migrated guest at {address}")
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "exact", f"{address}/32"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert len(routes.strip().splitlines()) == 1, routes  # one link routes it: the target's

    # Powered off and on where its disks are now: an address of the first node's range is
    # accepted there (sharedPodCIDRs) and kept.
    _power_cycle(lab, second, address)

    # Hibernated and resumed: the same guest (its httpd was not started again) answers at once
    # at the same address.
    body = json.dumps({"spec": {"powerOffMode": "Hibernate", "replicas": 0}})
    lab.k("patch", "vm", "keep", "--type=merge", "-p", body)
    wait_for(lambda: lab.status().get("phase") == "Hibernated", timeout=180, what="Hibernated")
    assert lab.status().get("ip") == address
    lab.replicas(1)
    wait_for(lambda: lab.running_on(second), timeout=180, interval=2, what="keep resumed")
    assert lab.status()["ip"] == address
    wait_for(lambda: serves(address), timeout=60, what=f"the resumed guest at {address}")
