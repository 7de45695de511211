"""A vm node's VMs on the dev cluster's pod network (routed mode), proven with real packets.

A vm agent joins `worker_cluster` with a /24 of the cluster's virtual pod range as its
`podCIDR` and the cluster DNS in its network settings. One VM (the small test guest) serves
HTTP behind a Service; busybox pods on the real workers fetch it by the Service's DNS name, and
the VM fetches a worker Deployment's Service by its short name (the guest's search list). The
tests share the VM and run in the order written.
"""

from __future__ import annotations

import contextlib
import json
import random
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

from .vmlab import TOLERATION, clean_up, require_vm_host, start_vm_agent

pytestmark = pytest.mark.integration

BOOT_TIMEOUT = 300
DNS = "10.96.0.10"  # the dev cluster's CoreDNS Service


@dataclass
class Lab:
    cluster: Cluster
    kubectl: Kubectl
    namespace: str
    node: str
    address: str
    workdir: Path
    agent: AgentProcess

    def fetch_from_worker(self, url: str) -> str:
        """One HTTP GET from the busybox client pod on a worker ('' when it fails)."""
        result = self.kubectl(
            "-n", self.namespace, "exec", "client", "--",
            "timeout", "5", "wget", "-q", "-O", "-", url, check=False,
        )  # fmt: skip
        return result.stdout.strip() if result.returncode == 0 else ""

    def in_vm(self, *argv: str, pod: str = "vm") -> subprocess.CompletedProcess[str]:
        """A command in the guest (kubectl exec, through the guest agent)."""
        return self.kubectl("-n", self.namespace, "exec", pod, "--", *argv, check=False)

    def fetch_from_vm(self, url: str) -> str:
        result = self.in_vm("timeout", "5", "wget", "-q", "-O", "-", url)
        return result.stdout.strip() if result.returncode == 0 else ""

    def vm_pod(self, pod: str = "vm") -> dict[str, Any]:
        return dict(self.kubectl.json("-n", self.namespace, "get", "pod", pod))

    def vm_ready(self, pod: str = "vm") -> bool:
        statuses = self.vm_pod(pod)["status"].get("containerStatuses") or [{}]
        return bool(statuses[0].get("ready"))

    def host_link(self, pod: str = "vm") -> str:
        """The VM's link on the host (the one its /32 route goes over)."""
        ip = self.vm_pod(pod)["status"]["podIP"]
        route = subprocess.run(
            ["ip", "-o", "route", "get", ip], capture_output=True, text=True, check=True
        ).stdout
        return route.split(" dev ")[1].split()[0]

    def restart_agent(self) -> None:
        self.agent = start_agent(
            self.cluster, self.workdir, provider="vm", config=self.workdir / "vm.yaml",
            name=self.node, address=self.address,
        )  # fmt: skip


def vm_pod(name: str, node: str) -> dict[str, Any]:
    """A VM of the small guest on `node`, Ready once it answers HTTP on 8080."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                    "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 2},
                }
            ],
        },
    }


SERVE = "mkdir -p /tmp/www && hostname > /tmp/www/index.html && httpd -p 8080 -h /tmp/www"


def _manifests(busybox: str, node: str) -> list[dict[str, Any]]:
    """A busybox httpd Deployment on the workers and its Service `web`, a busybox client pod,
    and the VM pod with its Service `vm` (Ready only once the guest answers HTTP)."""
    web = {"app": "web"}
    httpd = "mkdir -p /www && hostname > /www/index.html && exec httpd -f -p 8080 -h /www"
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": web},
                "template": {
                    "metadata": {"labels": web},
                    "spec": {
                        "containers": [
                            {
                                "name": "httpd",
                                "image": busybox,
                                "imagePullPolicy": "Never",
                                "command": ["sh", "-c", httpd],
                                "readinessProbe": {"httpGet": {"path": "/", "port": 8080}},
                            }
                        ],
                        # httpd is the container's PID 1, which ignores SIGTERM: the default
                        # 30 s grace made the module's teardown wait for the SIGKILL.
                        "terminationGracePeriodSeconds": 1,
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": web, "ports": [{"port": 80, "targetPort": 8080}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "client"},
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": busybox,
                        "imagePullPolicy": "Never",
                        "command": ["sleep", "3600"],
                    }
                ],
                "terminationGracePeriodSeconds": 1,
            },
        },
        vm_pod("vm", node),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "vm"},
            "spec": {"selector": {"app": "vm"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    ]


@pytest.fixture(scope="module")
def lab(worker_cluster: Cluster, worker_kubectl: Kubectl, vm_guest_image: Path) -> Iterator[Lab]:
    require_vm_host()
    virtual = worker_cluster.virtual_pod_cidr()
    assert virtual is not None
    cidr = f"{virtual.rsplit('.', 2)[0]}.{random.randrange(1, 250)}.0/24"  # noqa: S311
    workdir = Path(tempfile.mkdtemp(prefix="vknet-", dir="/tmp"))  # short: QEMU's sockets
    node = f"hv-net-{uuid.uuid4().hex[:6]}"
    k = worker_kubectl
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(local_test_address())
        agent = start_vm_agent(
            worker_cluster, workdir, name=node, address=address, cidr=cidr,
            image=vm_guest_image, network={"clusterDNS": [DNS]},
        )  # fmt: skip
        namespace = create_namespace(k, f"vmnet-{uuid.uuid4().hex[:6]}")
        lab = Lab(worker_cluster, k, namespace, node, address, workdir, agent)
        try:
            wait_for(lambda: node_ready(k, node), timeout=90, what=f"node {node} Ready")
            busybox = worker_cluster.image_reference("busybox")
            for item in _manifests(busybox, node):
                k("-n", namespace, "apply", "-f", "-", input=json.dumps(item))
            k("-n", namespace, "rollout", "status", "deployment/web", "--timeout=120s", timeout=150)
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
            clean_up(workdir / "state", cidr)
            k("delete", "node", node, "--ignore-not-found", "--wait=false")
            shutil.rmtree(workdir, ignore_errors=True)


def test_the_vm_takes_its_address_from_the_node_s_range_and_its_link_forwards(lab: Lab) -> None:
    pod = lab.vm_pod()
    virtual = lab.cluster.virtual_pod_cidr()
    assert virtual is not None and pod["status"]["podIP"].startswith(virtual.rsplit(".", 2)[0])
    link = lab.host_link()
    assert Path(f"/proc/sys/net/ipv4/conf/{link}/forwarding").read_text().strip() == "1"
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "0"  # never touched


def test_the_vm_is_ready_and_served_through_its_service_only_once_its_guest_answers(
    lab: Lab,
) -> None:
    url = f"http://vm.{lab.namespace}.svc.cluster.local/"
    assert not lab.vm_ready()
    assert lab.fetch_from_worker(url) == ""  # no endpoint yet: nothing answers
    serve = "mkdir -p /tmp/www && hostname > /tmp/www/index.html && httpd -p 8080 -h /tmp/www"
    assert lab.in_vm("sh", "-c", serve).returncode == 0
    wait_for(lab.vm_ready, timeout=60, what="the VM pod Ready once it serves")
    # A busybox pod on a real worker, through the ClusterIP Service, by its DNS name.
    wait_for(lambda: lab.fetch_from_worker(url) == "vm", timeout=60, what="the VM via its Service")
    ip = lab.vm_pod()["status"]["podIP"]
    assert lab.fetch_from_worker(f"http://{ip}:8080/") == "vm"  # and by its address


def test_the_vm_resolves_a_worker_service_by_its_short_name_and_reaches_it(lab: Lab) -> None:
    resolv = lab.in_vm("cat", "/etc/resolv.conf").stdout
    assert f"nameserver {DNS}" in resolv
    assert f"search {lab.namespace}.svc.cluster.local svc.cluster.local cluster.local" in resolv
    pods = lab.kubectl.json("-n", lab.namespace, "get", "pods", "-l", "app=web")["items"]
    names = {p["metadata"]["name"] for p in pods}
    wait_for(
        lambda: lab.fetch_from_vm("http://web/") in names,
        timeout=60,
        what="a worker pod through its Service, from the VM",
    )


def test_a_restarted_agent_applies_routed_mode_to_the_links_it_finds(lab: Lab) -> None:
    pods = lab.kubectl.json("-n", lab.namespace, "get", "pods", "-l", "app=web")["items"]
    names = {p["metadata"]["name"] for p in pods}
    forwarding = Path(f"/proc/sys/net/ipv4/conf/{lab.host_link()}/forwarding")
    forwarding.write_text("0")  # as a host-only agent leaves it: the VM cannot leave its host
    assert lab.fetch_from_vm("http://web/") == ""
    lab.agent.stop(signal.SIGKILL)  # the VM runs on; the next agent finds its links
    lab.restart_agent()
    wait_for(lambda: forwarding.read_text().strip() == "1", timeout=90, what="forwarding again")
    wait_for(lambda: lab.fetch_from_vm("http://web/") in names, timeout=90, what="web from the VM")
    # The VM's endpoint is back once the new agent's readiness probe passes (the node may have
    # been marked unreachable meanwhile, its pods not Ready).
    wait_for(lab.vm_ready, timeout=120, what="the VM pod Ready after the restart")
    url = f"http://vm.{lab.namespace}.svc.cluster.local/"
    wait_for(lambda: lab.fetch_from_worker(url) == "vm", timeout=90, what="the VM via its Service")


def test_a_host_only_node_s_vm_answers_its_host_but_not_the_pod_network(
    lab: Lab, vm_guest_image: Path
) -> None:
    third = int(lab.vm_pod()["status"]["podIP"].split(".")[2]) % 249 + 1  # another /24
    cidr = f"{lab.vm_pod()['status']['podIP'].rsplit('.', 2)[0]}.{third}.0/24"
    workdir = Path(tempfile.mkdtemp(prefix="vkho-", dir="/tmp"))
    node = f"hv-ho-{uuid.uuid4().hex[:6]}"
    k = lab.kubectl
    with local_test_address() as address:
        agent = start_vm_agent(
            lab.cluster, workdir, name=node, address=address, cidr=cidr, image=vm_guest_image,
            network={"mode": "host-only"},
        )  # fmt: skip
        try:
            wait_for(lambda: node_ready(k, node), timeout=90, what=f"node {node} Ready")
            k("-n", lab.namespace, "apply", "-f", "-", input=json.dumps(vm_pod("isolated", node)))
            wait_for(
                lambda: lab.in_vm("true", pod="isolated").returncode == 0,
                timeout=BOOT_TIMEOUT,
                interval=2,
                what="the host-only VM's guest agent",
            )
            assert lab.in_vm("sh", "-c", SERVE, pod="isolated").returncode == 0
            # Ready: the agent's probe, from the host, reaches it.
            wait_for(lambda: lab.vm_ready("isolated"), timeout=60, what="the VM Ready")
            link = Path(f"/proc/sys/net/ipv4/conf/{lab.host_link('isolated')}/forwarding")
            assert link.read_text().strip() == "0"
            ip = lab.vm_pod("isolated")["status"]["podIP"]
            assert lab.fetch_from_worker(f"http://{ip}:8080/") == ""
            assert lab.fetch_from_worker(f"http://{lab.vm_pod()['status']['podIP']}:8080/")
        finally:
            k("-n", lab.namespace, "delete", "pod", "isolated", "--wait=true", check=False,
              timeout=90)  # fmt: skip
            agent.stop()
            clean_up(workdir / "state", cidr)
            k("delete", "node", node, "--ignore-not-found", "--wait=false")
            shutil.rmtree(workdir, ignore_errors=True)


def test_a_pod_range_another_route_of_the_host_covers_stops_the_agent_naming_it(
    lab: Lab, tmp_path: Path
) -> None:
    plan_subnet = next(  # the dev cluster's own node subnet: a route of this host
        line.split()[0]
        for line in subprocess.run(
            ["ip", "-4", "-o", "route", "show"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        if line.startswith("10.200.")
    )
    config = tmp_path / "vm.yaml"
    config.write_text(json.dumps({"stateDir": "state", "accel": "tcg", "podCIDR": plan_subnet}))
    done = subprocess.run(
        [
            str(Path(sys.prefix) / "bin" / "vkubelet"), "run",
            "--kubeconfig", str(lab.cluster.kubeconfig), "--provider", "vm",
            "--provider-config", str(config), "--nodename", f"hv-bad-{uuid.uuid4().hex[:6]}",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"podCIDR: {plan_subnet} overlaps route(s) of this host" in done.stdout + done.stderr
    # It stopped before anything was made: no state directory, so no machine, seed or link of
    # its own. (Comparing the host's links would catch other tests' VMs coming and going.)
    assert not (tmp_path / "state").exists()
