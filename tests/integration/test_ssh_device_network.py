"""SSH device pods on the pod network: a device's address is its pods' IP, and a Service that
selects device pods carries worker pods' traffic to the device. Real packets throughout: real
sshd devices on addresses of the cluster's virtual pod range, real workers (kube-proxy, CoreDNS)
and busybox `wget` from a worker pod."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster
from vkubelet.testing import Kubectl, create_namespace, local_test_address, node_ready, wait_for
from vkubelet.testing.sshlab import TestDevice, ssh_inventory, ssh_lab, ssh_lab_unavailable

from .sshagent import pod_manifest, start_agent

pytestmark = pytest.mark.usefixtures("worker_cluster")

PORT = 8080


@dataclass
class RoutedDevice:
    device: TestDevice
    namespace: str
    kubectl: Kubectl

    def k(self, *args: str, **kw: Any) -> Any:
        return self.kubectl("-n", self.namespace, *args, **kw)

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.kubectl.json("-n", self.namespace, "get", kind, name)
        return found

    def fetch(self, url: str) -> str:
        """One HTTP GET from the client pod on a worker (busybox wget; its -T crashes)."""
        result = self.k(
            "exec", "client", "--", "timeout", "5", "wget", "-q", "-O", "-", url, check=False
        )
        return result.stdout.strip() if result.returncode == 0 else ""


@pytest.fixture(scope="module")
def routed(
    worker_cluster: Cluster, worker_kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RoutedDevice]:
    """One lab device on an address of the cluster's virtual pod range, its ssh agent, and a
    busybox client pod on a worker (the device's node is tainted: the client stays off it)."""
    reason = ssh_lab_unavailable()
    if reason:
        pytest.skip(reason)
    virtual = worker_cluster.virtual_pod_cidr()
    assert virtual is not None
    workdir = tmp_path_factory.mktemp("ssh-routed")
    k = worker_kubectl
    with local_test_address() as address, ssh_lab(1, workdir, routed_in=virtual) as [device]:
        path = workdir / "inventory.yaml"
        path.write_text(yaml.safe_dump(ssh_inventory([device])))
        agent = start_agent(worker_cluster, workdir, path, address)
        namespace = create_namespace(k, f"ssh-net-{uuid.uuid4().hex[:6]}")
        lab = RoutedDevice(device, namespace, k)
        try:
            wait_for(lambda: node_ready(k, device.name), timeout=60, what="the device's node")
            for item in client_pod(worker_cluster):
                lab.k("apply", "-f", "-", input=json.dumps(item))
            lab.k("wait", "--for=condition=Ready", "pod/client", "--timeout=90s", timeout=120)
            yield lab
        finally:
            k("delete", "namespace", namespace, "--wait=false", check=False)
            agent.stop()
            k("delete", "node", device.name, "--ignore-not-found", "--wait=false", check=False)


def client_pod(cluster: Cluster) -> list[dict[str, Any]]:
    """The client on a worker; it also serves "worker" on :8080, behind the Service `worker`."""
    serve = "mkdir -p /www && echo worker > /www/index.html && httpd -p 8080 -h /www"
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "client", "labels": {"app": "worker"}},
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": cluster.image_reference("busybox"),
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", f"{serve} && exec sleep 3600"],
                        "ports": [{"containerPort": 8080}],
                    }
                ],
                "terminationGracePeriodSeconds": 1,
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "worker"},
            "spec": {"selector": {"app": "worker"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    ]


def httpd_pod(
    name: str, device: TestDevice, answer: str, *, bound: bool = True, host_port: bool = True
) -> dict[str, Any]:
    """busybox httpd on the device, as the ssh provider runs commands, answering `answer`.
    `host_port`: it declares its port as a hostPort too, for the scheduler. `bound`: placed by
    nodeName (past the scheduler), else by the scheduler through a nodeSelector."""
    serve = f"mkdir -p www && echo {answer} > www/index.html && "
    serve += f"exec busybox httpd -f -p {PORT} -h www"
    manifest = pod_manifest(
        name,
        device.name,
        ["sh", "-c", serve],
        container={
            "ports": [{"containerPort": PORT, **({"hostPort": PORT} if host_port else {})}],
            "readinessProbe": {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1},
        },
    )
    manifest["metadata"]["labels"] = {"app": "device-web"}
    if not bound:
        del manifest["spec"]["nodeName"]
        manifest["spec"]["nodeSelector"] = {"lab.vkubelet.io/device": device.name}
    return manifest


@pytest.fixture(scope="module")
def device_web(routed: RoutedDevice) -> str:
    """A Ready httpd pod on the device and a Service selecting it; returns what it answers."""
    answer = f"device-{uuid.uuid4().hex[:8]}"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "device-web"},
        "spec": {"selector": {"app": "device-web"}, "ports": [{"port": 80, "targetPort": PORT}]},
    }
    for item in (httpd_pod("web", routed.device, answer), service):
        routed.k("apply", "-f", "-", input=json.dumps(item))
    routed.k("wait", "--for=condition=Ready", "pod/web", "--timeout=60s", timeout=90)
    return answer


def test_a_device_pod_s_ip_is_the_device_s_address_in_the_virtual_range(
    worker_cluster: Cluster, routed: RoutedDevice, device_web: str
) -> None:
    status = routed.get("pod", "web")["status"]
    assert status["podIP"] == routed.device.address
    assert status["podIPs"] == [{"ip": routed.device.address}]
    virtual = worker_cluster.virtual_pod_cidr()
    assert virtual is not None and routed.device.address.startswith(virtual.rsplit(".", 2)[0])
    link = routed.device.host_veth  # the host forwards what the device answers, on its link only
    assert Path(f"/proc/sys/net/ipv4/conf/{link}/forwarding").read_text().strip() == "1"
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "0"


def test_a_worker_pod_reaches_a_device_pod_by_address_and_through_its_service_by_dns_name(
    routed: RoutedDevice, device_web: str
) -> None:
    by_address = f"http://{routed.device.address}:{PORT}/"
    assert wait_for(lambda: routed.fetch(by_address) == device_web, timeout=30)
    by_name = f"http://device-web.{routed.namespace}.svc.cluster.local/"
    assert wait_for(lambda: routed.fetch(by_name) == device_web, timeout=30)
    assert routed.fetch("http://device-web/") == device_web  # the pod's search domains


def test_the_scheduler_keeps_a_pod_off_a_device_whose_host_port_is_taken(
    routed: RoutedDevice, device_web: str
) -> None:
    pod = httpd_pod("web-3", routed.device, "third", bound=False)
    routed.k("apply", "-f", "-", input=json.dumps(pod))

    def unschedulable() -> dict[str, Any] | None:
        conditions = routed.get("pod", "web-3").get("status", {}).get("conditions") or []
        return next((c for c in conditions if c.get("reason") == "Unschedulable"), None)

    condition = wait_for(unschedulable, timeout=60, what="web-3 unschedulable")
    assert "free ports" in condition["message"], condition
    routed.k("delete", "pod", "web-3", "--wait=false")


def test_a_second_pod_on_the_device_s_port_fails_with_an_event_naming_the_port(
    routed: RoutedDevice, device_web: str
) -> None:
    # Bound by nodeName, past the scheduler: the provider is what stops it. Without a hostPort:
    # the scheduler forgets a node's hostPort when *any* pod declaring it there ends, so this
    # refused pod would free the holder's port for the scheduler too.
    second = httpd_pod("web-2", routed.device, "second", host_port=False)
    routed.k("apply", "-f", "-", input=json.dumps(second))
    status = wait_for(
        lambda: (s := routed.get("pod", "web-2").get("status", {})).get("phase") == "Failed" and s,
        timeout=60,
        what="the second pod refused",
    )
    assert status["reason"] == "PortInUse"
    assert f"port {PORT}/TCP" in status["message"]
    assert f"pod {routed.namespace}/web " in status["message"]  # the holder

    def event() -> dict[str, Any] | None:
        events = routed.kubectl.json(
            "-n", routed.namespace, "get", "events", "--field-selector",
            "involvedObject.name=web-2,reason=PortInUse",
        )["items"]  # fmt: skip
        return events[0] if events else None

    found = wait_for(event, timeout=30, what="the PortInUse event")
    assert found["type"] == "Warning" and f"port {PORT}/TCP" in found["message"]
    # The holder serves on through the Service.
    assert routed.fetch("http://device-web/") == device_web


def test_a_device_pod_reaches_a_worker_pod_s_service_by_its_cluster_ip(
    routed: RoutedDevice, device_web: str
) -> None:
    """The device sends what it does not know to the host, which sends the cluster's virtual
    range's Service traffic to worker 0 (its kube-proxy translates and masquerades it)."""
    ip = routed.get("service", "worker")["spec"]["clusterIP"]
    get = ["exec", "web", "--", "timeout", "5", "busybox", "wget", "-q", "-O", "-", f"http://{ip}/"]
    assert wait_for(
        lambda: (
            (answer := routed.k(*get, check=False)).returncode == 0
            and answer.stdout.strip() == "worker"
        ),
        timeout=30,
        what="the worker's Service answering the device",
    )
