"""The cluster provider with real workers on both sides: two dev clusters side by side, each with
worker nodes (kubelet, containerd, kube-proxy, CoreDNS), the session's `worker_cluster` upstairs
and a one-worker cluster below, and a cluster-provider agent on this machine joining them.

Upper pods bound to the virtual node run as real containers on the lower worker; kubectl's
streaming verbs from upstairs reach the real process through the real lower kubelet; the upper
pod's IP is its lower pod's IP, routed through this machine (every cluster's worker pods are),
so upper worker pods reach it by address and through an upper Service by DNS name. Traffic
claims are proven with packets: busybox `wget` from real pods."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    Kubectl,
    create_namespace,
    port_forward,
    wait_for,
)

from ..clusters import TOLERATION, lower_as_virtual_node

pytestmark = pytest.mark.usefixtures("worker_cluster")

JSON = dict[str, Any]
HTTPD = "mkdir -p /www && hostname > /www/index.html && echo serving $(hostname) && "
HTTPD += "exec httpd -f -v -p 8080 -h /www"
#: Lower namespace = this + the upper one: what runs below is told apart from upstairs by name.
PREFIX = "up-"


@pytest.fixture(scope="module")
def virtual_node(
    worker_cluster: Cluster,
    worker_kubectl: Kubectl,
    lower_workers: Cluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """A cluster-provider agent on this machine: the lower cluster as a node of the upper one."""
    settings = {"upperClusterID": f"rw-{uuid.uuid4().hex[:6]}", "namespaces": {"prefix": PREFIX}}
    with lower_as_virtual_node(
        worker_cluster,
        worker_kubectl,
        lower_workers,
        tmp_path_factory.mktemp("vk-lowerw"),
        f"vk-lowerw-{uuid.uuid4().hex[:6]}",
        settings,
    ) as node:
        yield node.name


@pytest.fixture(scope="module")
def ns(worker_kubectl: Kubectl) -> Iterator[str]:
    name = create_namespace(worker_kubectl, f"rw-{uuid.uuid4().hex[:6]}")
    yield name
    worker_kubectl("delete", "namespace", name, "--wait=false")


def busybox_pod(image: str, name: str, command: str, **spec: Any) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": 8080}},
                }
            ],
            "terminationGracePeriodSeconds": 1,
            **spec,
        },
    }


def service(name: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": 8080}]},
    }


@pytest.fixture(scope="module")
def pods(
    worker_cluster: Cluster, worker_kubectl: Kubectl, virtual_node: str, ns: str
) -> dict[str, JSON]:
    """`below` (httpd on the virtual node, behind upper Service `below`) and `client` (on an
    upper worker), both Ready; their upper pods by name."""
    image = worker_cluster.image_reference("busybox")
    k = worker_kubectl
    below = busybox_pod(
        image,
        "below",
        HTTPD,
        nodeSelector={"kubernetes.io/hostname": virtual_node},
        tolerations=[TOLERATION],
    )
    client = busybox_pod(image, "client", HTTPD)
    for item in (below, client, service("below")):
        k("-n", ns, "apply", "-f", "-", input=json.dumps(item))
    for name in ("below", "client"):
        k("-n", ns, "wait", "--for=condition=Ready", f"pod/{name}", "--timeout=120s", timeout=150)
    return {n: k.json("-n", ns, "get", "pod", n) for n in ("below", "client")}


def fetch(kubectl: Kubectl, ns: str, pod: str, url: str) -> str:
    """One HTTP GET from inside `pod` (busybox wget; its -T crashes in this build)."""
    result = kubectl(
        "-n", ns, "exec", pod, "--", "timeout", "5", "wget", "-q", "-O", "-", url, check=False
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def lower_pod(lower_workers: Cluster, ns: str, name: str) -> JSON:
    found: JSON = Kubectl(lower_workers.kubeconfig).json("-n", PREFIX + ns, "get", "pod", name)
    return found


def test_an_upper_pod_runs_as_a_real_container_on_the_lower_worker_with_its_address(
    lower_workers: Cluster, ns: str, pods: dict[str, JSON]
) -> None:
    below = lower_pod(lower_workers, ns, "below")
    (worker,) = lower_workers.workers()
    assert below["spec"]["nodeName"] == worker.name
    assert below["status"]["containerStatuses"][0]["ready"] is True
    ip = pods["below"]["status"]["podIP"]
    assert ip == below["status"]["podIP"]
    assert ip.rsplit(".", 1)[0] == worker.addresses.pod_cidr.rsplit(".", 1)[0], ip


def test_kubectl_logs_exec_port_forward_and_cp_from_upstairs_reach_the_real_process(
    worker_kubectl: Kubectl, ns: str, pods: dict[str, JSON], tmp_path: Path
) -> None:
    k = worker_kubectl
    assert "serving below" in k("-n", ns, "logs", "below").stdout
    assert k("-n", ns, "exec", "below", "--", "cat", "/www/index.html").stdout.strip() == "below"
    # The process is the real httpd, running in the lower worker's container.
    assert "httpd" in k("-n", ns, "exec", "below", "--", "cat", "/proc/1/cmdline").stdout
    echoed = k("-n", ns, "exec", "-i", "below", "--", "cat", input="through stdin\n")
    assert echoed.stdout == "through stdin\n"
    failed = k("-n", ns, "exec", "below", "--", "sh", "-c", "exit 3", check=False)
    assert failed.returncode == 3
    with (
        port_forward(k, "below", 8080, namespace=ns) as local,
        urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=10) as answer,
    ):
        assert answer.read().decode().strip() == "below"
    note = tmp_path / "note.txt"
    note.write_text("carried down\n")
    k("-n", ns, "cp", str(note), "below:/tmp/note.txt")
    assert k("-n", ns, "exec", "below", "--", "cat", "/tmp/note.txt").stdout == "carried down\n"
    back = tmp_path / "back.txt"
    k("-n", ns, "cp", "below:/www/index.html", str(back))
    assert back.read_text().strip() == "below"


def test_an_upper_worker_pod_reaches_the_pod_below_by_address_with_its_own_source_address(
    worker_kubectl: Kubectl, ns: str, pods: dict[str, JSON]
) -> None:
    ip = pods["below"]["status"]["podIP"]
    assert fetch(worker_kubectl, ns, "client", f"http://{ip}:8080/") == "below"
    # Routed, not translated: httpd below logs the upper client pod's own address.
    client_ip = pods["client"]["status"]["podIP"]
    assert f"{client_ip}]" in worker_kubectl("-n", ns, "logs", "below").stdout


def test_an_upper_worker_pod_reaches_the_pod_below_through_an_upper_service_by_dns_name(
    worker_kubectl: Kubectl, ns: str, pods: dict[str, JSON]
) -> None:
    slices = worker_kubectl.json(
        "-n", ns, "get", "endpointslices", "-l", "kubernetes.io/service-name=below"
    )["items"]
    addresses = {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert addresses == {pods["below"]["status"]["podIP"]}
    url = f"http://below.{ns}.svc.cluster.local/"
    answer = wait_for(
        lambda: fetch(worker_kubectl, ns, "client", url) or None, timeout=30, what=url
    )
    assert answer == "below"


def test_the_pod_below_reaches_an_upper_worker_pod_by_address(
    worker_kubectl: Kubectl, ns: str, pods: dict[str, JSON]
) -> None:
    ip = pods["client"]["status"]["podIP"]
    assert fetch(worker_kubectl, ns, "below", f"http://{ip}:8080/") == "client"


def test_the_pod_below_reaches_a_lower_service_by_its_lower_dns_name(
    worker_kubectl: Kubectl, lower_workers: Cluster, ns: str, pods: dict[str, JSON]
) -> None:
    """Upper pods running below resolve names with the lower cluster's DNS (the lower kubelet's
    clusterDNS): a Service of the lower cluster is reached by its lower name."""
    lk = Kubectl(lower_workers.kubeconfig)
    lower_ns = create_namespace(lk, f"lw-{uuid.uuid4().hex[:6]}")
    try:
        image = lower_workers.image_reference("busybox")
        for item in (busybox_pod(image, "local", HTTPD), service("local")):
            lk("-n", lower_ns, "apply", "-f", "-", input=json.dumps(item))
        lk("-n", lower_ns, "wait", "--for=condition=Ready", "pod/local", "--timeout=120s")
        url = f"http://local.{lower_ns}.svc.cluster.local/"
        answer = wait_for(
            lambda: fetch(worker_kubectl, ns, "below", url) or None, timeout=30, what=url
        )
        assert answer == "local"
    finally:
        lk("delete", "namespace", lower_ns, "--wait=false")


def test_the_pod_below_runs_with_a_token_of_the_lower_service_account_that_the_lower_api_accepts(
    worker_kubectl: Kubectl, lower_workers: Cluster, ns: str, pods: dict[str, JSON], tmp_path: Path
) -> None:
    """The lower cluster mints the token (`serviceAccountTokens: lower`): no upper credential
    goes down, and the one mounted works against the lower apiserver as the lower account."""
    path = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    token = worker_kubectl("-n", ns, "exec", "below", "--", "cat", path).stdout.strip()
    config = yaml.safe_load(lower_workers.kubeconfig.read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    as_pod = tmp_path / "as-pod.kubeconfig"
    as_pod.write_text(yaml.safe_dump(config))
    who = Kubectl(as_pod).json("auth", "whoami")
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{PREFIX}{ns}:default"


def test_a_deployment_below_with_probes_and_a_configmap_serves_through_an_upper_service(
    worker_cluster: Cluster,
    worker_kubectl: Kubectl,
    virtual_node: str,
    ns: str,
    pods: dict[str, JSON],
) -> None:
    """What a real workload brings: image pull policy IfNotPresent, startup, liveness and
    readiness probes (a named port, an exec command) run by the lower kubelet, a ConfigMap
    copied below as a file and env, a Service with a named target port upstairs (reached from
    an upper worker by its upper name, and from a pod below by the short name of its
    reflection)."""
    k = worker_kubectl
    labels = {"app": "dep"}
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dep"}}
    container = {
        "name": "httpd",
        "image": worker_cluster.image_reference("busybox"),
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "sh",
            "-c",
            "mkdir -p /www && echo $GREETING $(hostname) > /www/index.html "
            "&& exec httpd -f -p 8080 -h /www",
        ],
        "env": [
            {
                "name": "GREETING",
                "valueFrom": {"configMapKeyRef": {"name": "dep", "key": "greeting"}},
            }
        ],
        "ports": [{"name": "web", "containerPort": 8080}],
        "volumeMounts": [{"name": "conf", "mountPath": "/conf"}],
        "startupProbe": {"httpGet": {"path": "/", "port": "web"}, "periodSeconds": 1},
        "livenessProbe": {"exec": {"command": ["cat", "/conf/greeting"]}},
        "readinessProbe": {"httpGet": {"path": "/", "port": "web"}, "periodSeconds": 2},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "dep"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": virtual_node},
                    "tolerations": [TOLERATION],
                    "terminationGracePeriodSeconds": 1,
                    "containers": [container],
                    "volumes": [{"name": "conf", "configMap": {"name": "dep"}}],
                },
            },
        },
    }
    dep_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "dep"},
        "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": "web"}]},
    }
    for item in ({**config, "data": {"greeting": "hello"}}, deployment, dep_service):
        k("-n", ns, "apply", "-f", "-", input=json.dumps(item))
    k("-n", ns, "rollout", "status", "deployment/dep", "--timeout=120s", timeout=150)
    names = {
        p["metadata"]["name"] for p in k.json("-n", ns, "get", "pods", "-l", "app=dep")["items"]
    }
    assert len(names) == 2
    seen: set[str] = set()
    for _ in range(40):  # kube-proxy picks at random: both answer within a few dozen requests
        seen.add(fetch(k, ns, "client", f"http://dep.{ns}.svc.cluster.local/"))
        if {f"hello {n}" for n in names} <= seen:
            break
    assert {f"hello {n}" for n in names} <= seen, seen
    # Below, the upper Service is reflected and the lower DNS resolves its short name.
    answer = wait_for(lambda: fetch(k, ns, "below", "http://dep/") or None, timeout=30, what="dep")
    assert answer in {f"hello {n}" for n in names}
    for name in names:
        assert (
            k(
                "-n",
                ns,
                "get",
                "pod",
                name,
                "-o",
                "jsonpath={.status.containerStatuses[0].restartCount}",
            ).stdout
            == "0"
        )
