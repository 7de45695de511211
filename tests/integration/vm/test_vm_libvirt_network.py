"""The pod network of a libvirt runtime's VM on a remote libvirt host, proven with real packets.

A libvirt "host" of the lab (`vkubelet.testing.virtlab`: libvirtd and sshd in a network
namespace of their own, reached over `qemu+ssh`) is routed into the worker cluster's pod
network as a hypervisor of a site would be: the host routes the workers' pods and the Services
to the machine, the machine routes the vm nodes' ranges to the host. Two VMs (the small test
guest) boot side by side for the module, one per mode; their taps are libvirt's work on that
host (`providers.vm._lvnet`). Routed: a busybox pod on a real worker fetches the VM's HTTP
server by pod IP and through a ClusterIP Service by DNS name, and the VM fetches a worker pod by
its IP and a worker Service by its short name; after an agent restart (SIGKILL) and a poweroff
the VM boots again with the address read back from its domain. Bridged: the VM is a port of the
host's bridge, which holds its gateway; a worker pod fetches it by pod IP, and it fetches a
worker pod; the two VMs fetch each other by pod IP. The refusals cost no boot: an address a
running domain holds, a bridge the host lacks.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
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
    virtlab,
    wait_for,
)
from vkubelet.testing.virtlab import LibvirtHost

from .test_vm_network import SERVE, _manifests, vm_pod
from .vmlab import clean_up, require_vm_host, start_vm_agent

pytestmark = pytest.mark.integration

BOOT_TIMEOUT = 300
DNS = "10.96.0.10"  # the dev cluster's CoreDNS Service
#: What the lab host routes to the machine: the workers' pods and the Services (the machine
#: sends what the virtual range sends to a Service to worker 0, see devcluster._network).
ROUTES = ("10.160.0.0/11", "10.96.0.0/16")
LAB_BRIDGE = "vklbr0"  # the hypervisor's own L2 network, holding its gateway address
MISSING_BRIDGE = "vknobr0"
BRIDGED = {  # of the node whose bridge the host lacks (nothing is ever sent there)
    "subnet": "10.213.251.0/24",
    "gateway": "10.213.251.1",
    "pool": "10.213.251.100-10.213.251.110",
}


@dataclass
class Lab:
    kubectl: Kubectl
    namespace: str
    node: str
    host: LibvirtHost
    agent: AgentProcess
    bridged_node: str  # bridged mode on the host's LAB_BRIDGE
    missing_node: str  # bridged mode on a bridge the host does not have

    def run(self, pod: str, *argv: str) -> str:
        """A command in a pod ('' when it fails): the worker's client, or the VM."""
        done = self.kubectl("-n", self.namespace, "exec", pod, "--", *argv, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def answers(self, pod: str) -> bool:
        return self.run(pod, "echo", "up") == "up"

    def fetch(self, pod: str, url: str) -> str:
        return self.run(pod, "timeout", "5", "wget", "-q", "-O", "-", url)

    def pod(self, name: str) -> dict[str, Any]:
        return dict(self.kubectl.json("-n", self.namespace, "get", "pod", name))


@pytest.fixture(scope="module")
def lab(worker_cluster: Cluster, worker_kubectl: Kubectl, vm_guest_image: Path) -> Iterator[Lab]:
    require_vm_host()
    if (why := virtlab.libvirt_lab_unavailable()) is not None:
        pytest.skip(why)
    virtual = worker_cluster.virtual_pod_cidr()
    assert virtual is not None
    # the routed node's podCIDR and the bridged node's subnet: two /24s of the virtual range,
    # which the workers route to the machine, and the machine to the lab host
    first, second = random.sample(range(1, 250), 2)
    cidr = f"{virtual.rsplit('.', 2)[0]}.{first}.0/24"
    subnet = f"{virtual.rsplit('.', 2)[0]}.{second}"
    workdir = Path(tempfile.mkdtemp(prefix="vklvn-", dir="/tmp"))
    node = f"lv-net-{uuid.uuid4().hex[:6]}"
    k = worker_kubectl
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)  # last: after the lab's end
        (host,) = stack.enter_context(virtlab.libvirt_lab(1, workdir / "lab", routes=ROUTES))
        host.route_pods(cidr)
        host.route_pods(f"{subnet}.0/24")
        for step in (
            ("link", "add", LAB_BRIDGE, "type", "bridge"),
            ("addr", "add", f"{subnet}.1/24", "dev", LAB_BRIDGE),
            ("link", "set", LAB_BRIDGE, "up"),
        ):
            assert host.run("ip", *step).returncode == 0, step
        address = stack.enter_context(local_test_address())
        agent = start_vm_agent(
            worker_cluster, workdir, name=node, address=address, cidr=cidr, image=vm_guest_image,
            runtime="libvirt", libvirt={"uri": f"{host.ssh_uri}&no_tty=1"},
            network={"clusterDNS": [DNS]},
        )  # fmt: skip
        # Two bridged nodes start alongside: one on the host's bridge, one on a bridge the
        # host lacks (its test then costs no wait).
        bridged_networks = {
            f"{node}-br": {
                "mode": "bridged", "bridge": LAB_BRIDGE, "subnet": f"{subnet}.0/24",
                "gateway": f"{subnet}.1", "pool": f"{subnet}.100-{subnet}.110",
                "clusterDNS": [DNS],
            },
            f"{node}-nobr": {"mode": "bridged", "bridge": MISSING_BRIDGE, **BRIDGED},
        }  # fmt: skip
        for name, network in bridged_networks.items():
            (workdir / name).mkdir()
            other = start_vm_agent(
                worker_cluster, workdir / name, name=name, address=address, cidr=cidr,
                image=vm_guest_image, runtime="libvirt",
                libvirt={"uri": f"{host.ssh_uri}&no_tty=1"}, network=network,
            )  # fmt: skip
            stack.callback(k, "delete", "node", name, "--wait=false", check=False)
            stack.callback(other.stop)
        namespace = create_namespace(k, f"lvnet-{uuid.uuid4().hex[:6]}")
        lab = Lab(k, namespace, node, host, agent, f"{node}-br", f"{node}-nobr")
        try:
            for name in (node, lab.bridged_node, lab.missing_node):
                wait_for(partial(node_ready, k, name), timeout=90, what=f"node {name} Ready")
            busybox = worker_cluster.image_reference("busybox")
            for item in [*_manifests(busybox, node), vm_pod("bvm", lab.bridged_node)]:
                k("-n", namespace, "apply", "-f", "-", input=json.dumps(item))
            k("-n", namespace, "rollout", "status", "deployment/web", "--timeout=120s", timeout=150)
            k("-n", namespace, "wait", "--for=condition=Ready", "pod/client", "--timeout=90s",
              timeout=120)  # fmt: skip
            for vm in ("vm", "bvm"):  # (they boot side by side)
                wait_for(
                    partial(lab.answers, vm),
                    timeout=BOOT_TIMEOUT,
                    interval=2,
                    what=f"the guest agent of {vm} answering exec",
                )
            yield lab
        finally:
            delete_namespace(k, namespace)
            lab.agent.stop()
            clean_up(workdir / "state", cidr)
            k("delete", "node", node, "--ignore-not-found", "--wait=false")


def test_a_libvirt_vm_on_a_remote_host_is_on_the_pod_network_both_ways(lab: Lab) -> None:
    vm = lab.pod("vm")
    ip = vm["status"]["podIP"]
    domain = f"{lab.namespace}_vm"
    # libvirt made the tap on the host: the gateway with the guest as its peer, the /32 route
    (iface,) = [line.split() for line in lab.host.virsh("domiflist", domain).stdout.splitlines()]
    tap, kind, mac = iface[0], iface[1], iface[-1]
    assert kind == "ethernet"
    shown = lab.host.run("ip", "-4", "-o", "addr", "show", "dev", tap).stdout
    gateway = shown.split("inet ")[1].split()[0]
    assert f"peer {ip}/32" in shown
    assert f"{ip} dev {tap}" in lab.host.run("ip", "-4", "route").stdout
    # what libvirt does not set, the tap took from the host's defaults (the lab's, as documented)
    proxy_arp = lab.host.run("sysctl", "-n", f"net.ipv4.conf.{tap}.proxy_arp").stdout.strip()
    forwarding = lab.host.run("sysctl", "-n", f"net.ipv4.conf.{tap}.forwarding").stdout.strip()
    assert (proxy_arp, forwarding) == ("1", "1")
    # the domain records the pod's network, for a restarted agent to read back
    network = lab.host.virsh("metadata", domain, "https://vkubelet.io/xmlns/vm-network/1").stdout
    assert f'address="{ip}"' in network and f'mac="{mac}"' in network, network
    # the guest's NIC has the MAC its seed names, with the pod's address and the gateway
    assert lab.run("vm", "cat", f"/sys/class/net/{_guest_nic(lab)}/address") == mac
    assert f"inet {ip}/24" in lab.run("vm", "ip", "-4", "addr")
    assert f"default via {gateway}" in lab.run("vm", "ip", "route")

    # the VM serves: Ready through the agent's httpGet probe (from the agent's host)
    assert lab.run("vm", "sh", "-c", SERVE) == ""
    wait_for(
        lambda: bool((lab.pod("vm")["status"].get("containerStatuses") or [{}])[0].get("ready")),
        timeout=60,
        what="the VM pod Ready once it serves",
    )
    # a busybox pod on a real worker: by the VM's pod IP, and through its ClusterIP Service
    assert lab.fetch("client", f"http://{ip}:8080/") == "vm"
    url = f"http://vm.{lab.namespace}.svc.cluster.local/"
    wait_for(lambda: lab.fetch("client", url) == "vm", timeout=60, what="the VM via its Service")

    # the VM reaches a worker pod by its IP, and a worker Service by its short name (DNS)
    pods = lab.kubectl.json("-n", lab.namespace, "get", "pods", "-l", "app=web")["items"]
    names = {p["metadata"]["name"] for p in pods}
    web_ip = pods[0]["status"]["podIP"]
    assert lab.fetch("vm", f"http://{web_ip}:8080/") in names
    wait_for(
        lambda: lab.fetch("vm", "http://web/") in names,
        timeout=60,
        what="a worker pod through its Service, from the VM",
    )


def _guest_nic(lab: Lab, vm: str = "vm") -> str:
    """The guest's one NIC (the first interface but lo)."""
    names = lab.run(vm, "ls", "/sys/class/net").split()
    return next(name for name in names if name != "lo")


def test_a_restarted_agent_reads_the_vm_s_address_back_from_its_domain_and_a_reboot_keeps_it(
    lab: Lab,
) -> None:
    ip = lab.pod("vm")["status"]["podIP"]
    lab.agent.stop(signal.SIGKILL)  # the agent keeps nothing: the domain's XML says
    lab.agent.start()
    wait_for(
        lambda: lab.agent.log().count("listening on port") >= 2,
        timeout=60,
        what="the restarted agent's kubelet API",
    )
    wait_for(partial(lab.answers, "vm"), timeout=90, what="exec after the restart")
    # a cold boot of the adopted VM: its domain is made again with the address read back
    lab.run("vm", "poweroff")

    def rebooted() -> bool:
        status = (lab.pod("vm")["status"].get("containerStatuses") or [{}])[0]
        return status.get("restartCount", 0) >= 1 and "running" in status.get("state", {})

    wait_for(rebooted, timeout=BOOT_TIMEOUT, what="the VM booted again")
    wait_for(partial(lab.answers, "vm"), timeout=BOOT_TIMEOUT, what="exec after the reboot")
    assert lab.pod("vm")["status"]["podIP"] == ip
    assert lab.run("vm", "sh", "-c", SERVE) == ""
    wait_for(
        lambda: lab.fetch("client", f"http://{ip}:8080/") == "vm",
        timeout=60,
        what="the rebooted VM from a worker pod",
    )


def test_a_bridged_libvirt_vm_is_a_port_of_the_host_s_bridge_reached_from_a_worker(
    lab: Lab,
) -> None:
    domain = f"{lab.namespace}_bvm"
    (iface,) = [line.split() for line in lab.host.virsh("domiflist", domain).stdout.splitlines()]
    tap, kind, source, mac = iface[0], iface[1], iface[2], iface[-1]
    assert (kind, source) == ("bridge", LAB_BRIDGE)
    assert f": {tap}:" in lab.host.run("ip", "-o", "link", "show", "master", LAB_BRIDGE).stdout
    assert lab.host.run("ip", "-4", "-o", "addr", "show", "dev", tap).stdout == ""  # no route
    ip = lab.pod("bvm")["status"]["podIP"]
    subnet = ip.rsplit(".", 1)[0]
    assert ip == f"{subnet}.100"  # the pool's first address
    assert lab.run("bvm", "cat", f"/sys/class/net/{_guest_nic(lab, 'bvm')}/address") == mac
    assert f"inet {ip}/24" in lab.run("bvm", "ip", "-4", "addr")
    assert f"default via {subnet}.1" in lab.run("bvm", "ip", "route")
    # a worker pod reaches it through the site's gateway (the host on its bridge), and back
    assert lab.run("bvm", "sh", "-c", SERVE) == ""
    wait_for(lambda: lab.fetch("client", f"http://{ip}:8080/") == "bvm", timeout=60, what="bvm")
    pods = lab.kubectl.json("-n", lab.namespace, "get", "pods", "-l", "app=web")["items"]
    web_ip = pods[0]["status"]["podIP"]
    assert lab.fetch("bvm", f"http://{web_ip}:8080/") == pods[0]["metadata"]["name"]
    # the two VMs on the one host reach each other by pod IP (routed tap <-> the host's bridge)
    lab.run("vm", "sh", "-c", SERVE)  # (serving already after the tests above: then a no-op)
    vm_ip = lab.pod("vm")["status"]["podIP"]
    assert lab.fetch("bvm", f"http://{vm_ip}:8080/") == "vm"
    assert lab.fetch("vm", f"http://{ip}:8080/") == "bvm"


def test_an_address_clash_or_a_missing_bridge_fails_the_pod_naming_it_with_nothing_on_the_host(
    lab: Lab,
) -> None:
    # a pod asking for the address the running VM holds (a VirtualMachine's kept address)
    clash = vm_pod("clash", lab.node)
    clash["metadata"]["annotations"] = {"vm.vkubelet.io/address": lab.pod("vm")["status"]["podIP"]}
    lab.kubectl("-n", lab.namespace, "apply", "-f", "-", input=json.dumps(clash))
    nobridge = vm_pod("nobridge", lab.missing_node)
    lab.kubectl("-n", lab.namespace, "apply", "-f", "-", input=json.dumps(nobridge))

    def container(pod: str) -> dict[str, Any]:
        statuses = lab.pod(pod).get("status", {}).get("containerStatuses") or [{}]
        return dict(statuses[0])

    def waiting(pod: str, reason: str) -> dict[str, Any] | None:
        state = container(pod).get("state", {}).get("waiting") or {}
        return state if state.get("reason") == reason else None

    refused = wait_for(lambda: waiting("clash", "AddressInUse"), timeout=60, what="AddressInUse")
    assert "metadata.annotations[vm.vkubelet.io/address]" in refused["message"]

    def ended(pod: str, reason: str) -> dict[str, Any] | None:
        status = container(pod)
        for state in (status.get("state", {}), status.get("lastState", {})):
            if (state.get("terminated") or {}).get("reason") == reason:
                return dict(state["terminated"])
        return None

    missing = wait_for(lambda: ended("nobridge", "BridgeMissing"), timeout=90, what="BridgeMissing")
    assert f"network.bridge: {MISSING_BRIDGE}" in missing["message"]
    events = lab.kubectl.json(
        "-n", lab.namespace, "get", "events", "--field-selector", "involvedObject.name=nobridge"
    )["items"]
    assert any(e["reason"] == "BridgeMissing" and e["type"] == "Warning" for e in events)
    # nothing of either is left on the host: no domain, no tap
    domains = lab.host.virsh("list", "--all", "--name").stdout.split()
    assert sorted(domains) == [f"{lab.namespace}_bvm", f"{lab.namespace}_vm"], domains
    links = lab.host.run("ip", "-o", "link", "show").stdout
    assert links.count(": vkvm") == 2, links
