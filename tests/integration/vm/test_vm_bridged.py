"""Bridged mode, proven with real packets: a VM joins the dev cluster's own bridge.

A vm agent in bridged mode puts its VM on `worker_cluster`'s host bridge (`vkwbr<n>`) with an
address of a pool in the cluster's node subnet 10.200.n.0/24 above .100 (the host is .1, the
workers .10+i): the workers have that subnet on-link, so a busybox pod on a worker reaches the
VM by its address and through a Service by DNS name without any route of ours; a restarted
agent finds the address on the link again. Then the errors:
a missing bridge stops the agent naming `network.bridge`, and an exhausted pool makes a pod wait
with a reason and an Event naming `network.pool`; neither leaves anything on the host.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.providers.vm._net import PodNetwork
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    delete_namespace,
    local_test_address,
    node_ready,
    start_agent,
    wait_for,
)

from .test_vm_network import SERVE, vm_pod
from .vmlab import clean_up, require_vm_host, start_vm_agent

pytestmark = pytest.mark.integration

BOOT_TIMEOUT = 300


@dataclass
class Lab:
    cluster: Cluster
    kubectl: Kubectl
    namespace: str
    node: str
    bridge: str
    subnet: str  # the cluster's node subnet, 10.200.n.0/24
    agent: AgentProcess
    workdir: Path
    agent_address: str

    def address(self, last: int) -> str:
        return host(self.subnet, last)

    def network(self, pool: str, bridge: str | None = None) -> dict[str, Any]:
        return bridged(bridge or self.bridge, self.subnet, pool)

    def fetch_from_worker(self, url: str) -> str:
        """One HTTP GET from the busybox client pod on a worker ('' when it fails)."""
        result = self.kubectl(
            "-n", self.namespace, "exec", "client", "--",
            "timeout", "5", "wget", "-q", "-O", "-", url, check=False,
        )  # fmt: skip
        return result.stdout.strip() if result.returncode == 0 else ""

    def in_vm(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.kubectl("-n", self.namespace, "exec", "vm", "--", *argv, check=False)

    def pod(self, name: str = "vm") -> dict[str, Any]:
        return dict(self.kubectl.json("-n", self.namespace, "get", "pod", name))

    def vm_ready(self) -> bool:
        statuses = self.pod()["status"].get("containerStatuses") or [{}]
        return bool(statuses[0].get("ready"))


def host(subnet: str, last: int) -> str:
    return f"{subnet.rsplit('.', 1)[0]}.{last}"


def bridged(bridge: str, subnet: str, pool: str) -> dict[str, Any]:
    """The provider's `network` section; the gateway is the host's address on the bridge."""
    return {"mode": "bridged", "bridge": bridge, "subnet": subnet, "gateway": host(subnet, 1),
            "pool": pool}  # fmt: skip


def _links() -> set[str]:
    return {p.name for p in Path("/sys/class/net").iterdir()}


def _aliases() -> set[str]:
    """The addresses VM links of this machine hold (other engineers' links come and go)."""
    found = set()
    for name in _links():
        with contextlib.suppress(OSError):
            alias = Path(f"/sys/class/net/{name}/ifalias").read_text().strip()
            if alias.startswith("vkubelet-address="):
                found.add(alias.removeprefix("vkubelet-address="))
    return found


def _made_for(uid: str) -> list[str]:
    """The links and netns a pod's network would have (none when nothing was made)."""
    network = PodNetwork("10.213.0.0/24")  # names depend on the pod's UID alone
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    made = [network.host_link(uid)] if network.host_link(uid) in _links() else []
    return made + ([network.netns(uid)] if network.netns(uid) in names else [])


@pytest.fixture(scope="module")
def lab(worker_cluster: Cluster, worker_kubectl: Kubectl, vm_guest_image: Path) -> Iterator[Lab]:
    require_vm_host()
    virtual = worker_cluster.virtual_pod_cidr()
    assert virtual is not None
    index = int(virtual.split(".")[1]) - 224  # the cluster's network: 10.(224+n).0.0/16
    bridge, subnet = f"vkwbr{index}", f"10.200.{index}.0/24"
    workdir = Path(tempfile.mkdtemp(prefix="vkbr-", dir="/tmp"))  # short: QEMU's sockets
    node = f"hv-br-{uuid.uuid4().hex[:6]}"
    k = worker_kubectl
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(local_test_address())
        pool = f"{host(subnet, 100)}-{host(subnet, 101)}"
        agent = start_vm_agent(
            worker_cluster, workdir, name=node, address=address, cidr="10.213.0.0/24",
            image=vm_guest_image,
            network={**bridged(bridge, subnet, pool), "clusterDNS": ["10.96.0.10"]},
        )  # fmt: skip
        namespace = create_namespace(k, f"vmbr-{uuid.uuid4().hex[:6]}")
        lab = Lab(worker_cluster, k, namespace, node, bridge, subnet, agent, workdir, address)
        try:
            wait_for(lambda: node_ready(k, node), timeout=90, what=f"node {node} Ready")
            busybox = worker_cluster.image_reference("busybox")
            client = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "client"},
                "spec": {
                    "containers": [
                        {"name": "main", "image": busybox, "imagePullPolicy": "Never",
                         "command": ["sleep", "3600"]}
                    ],
                    "terminationGracePeriodSeconds": 1,
                },
            }  # fmt: skip
            service = {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "vm"},
                "spec": {"selector": {"app": "vm"}, "ports": [{"port": 80, "targetPort": 8080}]},
            }
            for item in (client, vm_pod("vm", node), service):
                k("-n", namespace, "apply", "-f", "-", input=json.dumps(item))
            k("-n", namespace, "wait", "--for=condition=Ready", "pod/client", "--timeout=90s",
              timeout=120)  # fmt: skip
            wait_for(
                lambda: lab.in_vm("true").returncode == 0,
                timeout=BOOT_TIMEOUT,
                interval=2,
                what="the VM's guest agent answering exec",
            )
            yield lab
        finally:
            delete_namespace(k, namespace)
            lab.agent.stop()
            clean_up(workdir / "state", subnet)
            k("delete", "node", node, "--ignore-not-found", "--wait=false")
            shutil.rmtree(workdir, ignore_errors=True)


def test_the_vm_joins_the_bridge_with_a_pool_address_and_the_host_routes_nothing_for_it(
    lab: Lab,
) -> None:
    ip = lab.pod()["status"]["podIP"]
    assert ip in (lab.address(100), lab.address(101))
    link = next(
        name for name in _links()
        if Path(f"/sys/class/net/{name}/ifalias").is_file()
        and Path(f"/sys/class/net/{name}/ifalias").read_text().strip()
        == f"vkubelet-address={ip}"
    )  # fmt: skip
    assert Path(f"/sys/class/net/{link}/master").resolve().name == lab.bridge
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "dev", link], capture_output=True, text=True, check=True
    )
    assert routes.stdout.strip() == ""  # no /32, no gateway address: the bridge is on-link
    addresses = subprocess.run(
        ["ip", "-4", "addr", "show", "dev", link], capture_output=True, text=True, check=True
    )
    assert "inet " not in addresses.stdout
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "0"
    # The guest was given the pool address with the subnet's prefix and the gateway.
    assert f"inet {ip}/24" in lab.in_vm("ip", "-4", "addr").stdout
    assert f"default via {lab.address(1)}" in lab.in_vm("ip", "route").stdout


def test_a_worker_pod_reaches_the_bridged_vm_by_address_and_through_its_service(
    lab: Lab,
) -> None:
    assert lab.in_vm("sh", "-c", SERVE).returncode == 0
    wait_for(lab.vm_ready, timeout=60, what="the VM pod Ready once it serves")
    ip = lab.pod()["status"]["podIP"]
    wait_for(
        lambda: lab.fetch_from_worker(f"http://{ip}:8080/") == "vm",
        timeout=60,
        what="the VM by its address from a worker pod",
    )
    url = f"http://vm.{lab.namespace}.svc.cluster.local/"
    wait_for(lambda: lab.fetch_from_worker(url) == "vm", timeout=60, what="the VM via its Service")


def test_a_restarted_agent_finds_the_address_on_the_link_and_puts_it_on_the_bridge_again(
    lab: Lab,
) -> None:
    ip = lab.pod()["status"]["podIP"]
    link = next(
        name for name in _links()
        if Path(f"/sys/class/net/{name}/ifalias").is_file()
        and Path(f"/sys/class/net/{name}/ifalias").read_text().strip() == f"vkubelet-address={ip}"
    )  # fmt: skip
    lab.agent.stop(signal.SIGKILL)  # the VM runs on; the next agent finds its link
    subprocess.run(["ip", "link", "set", link, "nomaster"], check=True)  # as a bridge re-made
    lab.agent = start_agent(
        lab.cluster, lab.workdir, provider="vm", config=lab.workdir / "vm.yaml",
        name=lab.node, address=lab.agent_address,
    )  # fmt: skip
    master = Path(f"/sys/class/net/{link}/master")
    wait_for(
        lambda: master.exists() and master.resolve().name == lab.bridge,
        timeout=90,
        what="the VM's link on the bridge again",
    )
    wait_for(lab.vm_ready, timeout=120, what="the VM pod Ready after the restart")
    assert lab.pod()["status"]["podIP"] == ip
    url = f"http://vm.{lab.namespace}.svc.cluster.local/"
    wait_for(lambda: lab.fetch_from_worker(url) == "vm", timeout=90, what="the VM via its Service")


def test_a_missing_bridge_stops_the_agent_naming_network_bridge(lab: Lab, tmp_path: Path) -> None:
    missing = f"vkbr{uuid.uuid4().hex[:8]}"
    config = tmp_path / "vm.yaml"
    settings = {"stateDir": "state", "accel": "tcg", "network": lab.network(
        f"{lab.address(120)}-{lab.address(121)}", bridge=missing)}  # fmt: skip
    config.write_text(json.dumps(settings))
    done = subprocess.run(
        [
            str(Path(sys.prefix) / "bin" / "vkubelet"), "run",
            "--kubeconfig", str(lab.cluster.kubeconfig), "--provider", "vm",
            "--provider-config", str(config), "--nodename", f"hv-bad-{uuid.uuid4().hex[:6]}",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    expected = f"{config}: network.bridge: bridge {missing} does not exist on this host"
    assert expected in done.stdout + done.stderr
    assert not {lab.address(120), lab.address(121)} & _aliases()  # nothing made on the host


def test_an_exhausted_pool_makes_the_pod_wait_naming_network_pool(
    lab: Lab, vm_guest_image: Path
) -> None:
    """A second bridged node whose one-address pool is the first node's VM's address: the pool
    is this machine's to share, and its links say which addresses are taken."""
    taken = lab.pod()["status"]["podIP"]
    workdir = Path(tempfile.mkdtemp(prefix="vkbx-", dir="/tmp"))
    node = f"hv-bx-{uuid.uuid4().hex[:6]}"
    k = lab.kubectl
    with local_test_address() as address:
        agent = start_vm_agent(
            lab.cluster, workdir, name=node, address=address, cidr="10.213.0.0/24",
            image=vm_guest_image, network=lab.network(f"{taken}-{taken}"),
        )  # fmt: skip
        try:
            wait_for(lambda: node_ready(k, node), timeout=90, what=f"node {node} Ready")
            k("-n", lab.namespace, "apply", "-f", "-", input=json.dumps(vm_pod("starved", node)))

            def waiting() -> dict[str, Any]:
                statuses = lab.pod("starved").get("status", {}).get("containerStatuses") or [{}]
                return dict(statuses[0].get("state", {}).get("waiting") or {})

            wait_for(
                lambda: waiting().get("reason") == "AddressPoolExhausted",
                timeout=60,
                what="the pod waiting for an address of the pool",
            )
            assert f"network.pool {taken}-{taken}" in waiting().get("message", "")
            events = k.json(
                "-n", lab.namespace, "get", "events",
                "--field-selector", "involvedObject.name=starved",
            )["items"]  # fmt: skip
            assert any(
                e["reason"] == "AddressPoolExhausted" and "network.pool" in e["message"]
                for e in events
            ), events
            assert _made_for(lab.pod("starved")["metadata"]["uid"]) == []  # nothing half-made
        finally:
            k("-n", lab.namespace, "delete", "pod", "starved", "--wait=true", check=False,
              timeout=90)  # fmt: skip
            agent.stop()
            clean_up(workdir / "state", lab.subnet)
            k("delete", "node", node, "--ignore-not-found", "--wait=false")
            shutil.rmtree(workdir, ignore_errors=True)
