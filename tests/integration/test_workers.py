"""Real worker nodes in a dev cluster: pods reach each other, Services and DNS carry real packets,
kubectl's streaming verbs work through real kubelets, and a virtual node lives beside them."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vkubelet import testing
from vkubelet.devcluster import Cluster
from vkubelet.testing import Kubectl, create_namespace, mock_node, port_forward, wait_for

pytestmark = pytest.mark.usefixtures("worker_cluster")


@pytest.fixture(scope="module")
def ns(worker_kubectl: Kubectl) -> Iterator[str]:
    name = create_namespace(worker_kubectl, f"workers-{uuid.uuid4().hex[:6]}")
    yield name
    worker_kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture(scope="module")
def busybox(worker_cluster: Cluster) -> str:
    return worker_cluster.image_reference("busybox")


def web_deployment(image: str, replicas: int = 2) -> list[dict[str, Any]]:
    """busybox httpd answering with its pod's name, one replica per worker, and its Service."""
    labels = {"app": "web"}
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "topologySpreadConstraints": [
                            {
                                "maxSkew": 1,
                                "topologyKey": "kubernetes.io/hostname",
                                "whenUnsatisfiable": "DoNotSchedule",
                                "labelSelector": {"matchLabels": labels},
                            }
                        ],
                        "containers": [
                            {
                                "name": "httpd",
                                "image": image,
                                "imagePullPolicy": "Never",
                                "command": [
                                    "sh",
                                    "-c",
                                    "mkdir -p /www && hostname > /www/index.html && "
                                    "echo serving $(hostname) && exec httpd -f -v -p 8080 -h /www",
                                ],
                                "ports": [{"containerPort": 8080}],
                                "readinessProbe": {"httpGet": {"path": "/", "port": 8080}},
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    ]


def client_pod(image: str, name: str = "client") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "3600"],
                }
            ],
            "terminationGracePeriodSeconds": 1,
        },
    }


@pytest.fixture(scope="module")
def web(worker_kubectl: Kubectl, ns: str, busybox: str) -> dict[str, str]:
    """The Deployment's pods (name -> node), Running and Ready, and a client pod."""
    k = worker_kubectl
    for item in [*web_deployment(busybox), client_pod(busybox)]:
        k("-n", ns, "apply", "-f", "-", input=json.dumps(item))
    k("-n", ns, "rollout", "status", "deployment/web", "--timeout=120s", timeout=150)
    k("-n", ns, "wait", "--for=condition=Ready", "pod/client", "--timeout=60s", timeout=90)
    pods = k.json("-n", ns, "get", "pods", "-l", "app=web")["items"]
    return {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods}


def fetch(kubectl: Kubectl, ns: str, url: str) -> str:
    """One HTTP GET from inside the client pod (busybox wget; its -T crashes in this build)."""
    result = kubectl(
        "-n", ns, "exec", "client", "--", "timeout", "5", "wget", "-q", "-O", "-", url, check=False
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def test_the_replicas_run_on_different_workers_with_addresses_from_their_pod_ranges(
    worker_cluster: Cluster, worker_kubectl: Kubectl, ns: str, web: dict[str, str]
) -> None:
    workers = {w.name: w for w in worker_cluster.workers()}
    assert sorted(web.values()) == sorted(workers)
    for pod in worker_kubectl.json("-n", ns, "get", "pods", "-l", "app=web")["items"]:
        ip = pod["status"]["podIP"]
        cidr = workers[pod["spec"]["nodeName"]].addresses.pod_cidr
        assert ip.rsplit(".", 1)[0] == cidr.rsplit(".", 1)[0], (ip, cidr)


def test_a_pod_reaches_a_pod_on_the_other_worker_by_its_address(
    worker_kubectl: Kubectl, ns: str, web: dict[str, str]
) -> None:
    client_node = worker_kubectl.json("-n", ns, "get", "pod", "client")["spec"]["nodeName"]
    pods = worker_kubectl.json("-n", ns, "get", "pods", "-l", "app=web")["items"]
    remote = next(p for p in pods if p["spec"]["nodeName"] != client_node)
    answer = fetch(worker_kubectl, ns, f"http://{remote['status']['podIP']}:8080/")
    assert answer == remote["metadata"]["name"]


@pytest.mark.parametrize("how", ["cluster-ip", "dns-name", "short-name"])
def test_a_service_balances_across_the_replicas_on_both_workers(
    worker_kubectl: Kubectl, ns: str, web: dict[str, str], how: str
) -> None:
    cluster_ip = worker_kubectl.json("-n", ns, "get", "service", "web")["spec"]["clusterIP"]
    url = {
        "cluster-ip": f"http://{cluster_ip}/",
        "dns-name": f"http://web.{ns}.svc.cluster.local/",
        "short-name": "http://web/",
    }[how]
    seen: set[str] = set()
    # A real kube-proxy picks at random: both backends answer within a few dozen requests.
    for _ in range(40):
        seen.add(fetch(worker_kubectl, ns, url))
        if set(web) <= seen:
            break
    assert set(web) <= seen, f"answers via {url}: {seen}"


def test_cluster_dns_names_the_kubernetes_service_and_the_api_answers_behind_it(
    worker_kubectl: Kubectl, ns: str, web: dict[str, str]
) -> None:
    looked_up = worker_kubectl(
        "-n", ns, "exec", "client", "--", "nslookup", "kubernetes.default.svc.cluster.local"
    ).stdout
    assert "10.96.0.1" in looked_up
    # The apiserver answers TLS at the Service address (busybox's TLS cannot complete the
    # handshake with its EC certificate, but the connection is made and refused by TLS alone).
    opened = worker_kubectl(
        "-n",
        ns,
        "exec",
        "client",
        "--",
        "sh",
        "-c",
        "echo | timeout 5 nc kubernetes.default.svc.cluster.local 443 && echo connected",
        check=False,
    )
    assert "connected" in opened.stdout, opened.stderr


def test_kubectl_logs_exec_port_forward_and_top_work_on_worker_pods(
    worker_kubectl: Kubectl, ns: str, web: dict[str, str]
) -> None:
    k = worker_kubectl
    pod = sorted(web)[0]
    assert f"serving {pod}" in k("-n", ns, "logs", pod).stdout
    assert k("-n", ns, "exec", pod, "--", "cat", "/www/index.html").stdout.strip() == pod
    echoed = k("-n", ns, "exec", "-i", pod, "--", "cat", input="through stdin\n")
    assert echoed.stdout == "through stdin\n"
    with (
        port_forward(k, pod, 8080, namespace=ns) as local,
        urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=10) as answer,
    ):
        assert answer.read().decode().strip() == pod
    top = wait_for(
        lambda: (r := k("-n", ns, "top", "pod", pod, check=False)).returncode == 0 and r.stdout,
        timeout=90,
        interval=3,
        what="kubectl top pod on a worker pod",
    )
    assert pod in top
    # Node metrics come from the kubelets' summaries, scraped apart from the pods' (a worker
    # may not have been scraped yet when its pod's metrics are).
    wait_for(
        lambda: (
            (r := k("top", "node", check=False)).returncode == 0
            and all(node in r.stdout for node in set(web.values()))
        ),
        timeout=90,
        interval=3,
        what="kubectl top node lists both workers",
    )


def test_a_virtual_mock_node_works_beside_the_workers_and_taints_keep_pods_apart(
    worker_cluster: Cluster,
    worker_kubectl: Kubectl,
    ns: str,
    busybox: str,
    web: dict[str, str],
    tmp_path: Path,
) -> None:
    k = worker_kubectl
    workers = {w.name for w in worker_cluster.workers()}
    with mock_node(worker_cluster, k, tmp_path / "mock", prefix="vk-beside") as node:
        # Ordinary pods stay off the virtual node: its taint keeps them on the workers.
        plain = web_deployment(busybox, replicas=4)[0]
        plain["metadata"]["name"] = "plain"
        plain["spec"]["selector"]["matchLabels"] = {"app": "plain"}
        plain["spec"]["template"]["metadata"]["labels"] = {"app": "plain"}
        del plain["spec"]["template"]["spec"]["topologySpreadConstraints"]
        k("-n", ns, "apply", "-f", "-", input=json.dumps(plain))
        k("-n", ns, "rollout", "status", "deployment/plain", "--timeout=120s", timeout=150)
        pods = k.json("-n", ns, "get", "pods", "-l", "app=plain")["items"]
        assert {p["spec"]["nodeName"] for p in pods} <= workers
        # A pod that tolerates the taint and selects the virtual node runs there, and kubectl
        # reaches it through the agent as it reaches worker pods through their kubelets.
        virtual = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "virtual"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node.name},
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
                "containers": [{"name": "main", "image": "registry.example/app:1"}],
            },
        }
        k("-n", ns, "apply", "-f", "-", input=json.dumps(virtual))
        k("-n", ns, "wait", "--for=condition=Ready", "pod/virtual", "--timeout=60s", timeout=90)
        assert k.json("-n", ns, "get", "pod", "virtual")["spec"]["nodeName"] == node.name
        assert k("-n", ns, "exec", "virtual", "--", "echo", "mock-exec").stdout.strip() == (
            "mock-exec"
        )
        k("-n", ns, "logs", "virtual")
        # The workers are untouched by the virtual node's arrival.
        assert fetch(k, ns, "http://web/") in web
        k("-n", ns, "delete", "pod", "virtual", "--wait=false")


@pytest.fixture(scope="module")
def virtual_pod(worker_cluster: Cluster, ns: str) -> Iterator[str]:
    """A stand-in for a routed VM (see `vkubelet.testing.virtual_pod`) answering "virtual pod"."""
    search = (f"{ns}.svc.cluster.local", "svc.cluster.local")
    with testing.virtual_pod(worker_cluster, "virtual pod\n", search=search) as address:
        yield address


def fetch_from_virtual_pod(address: str, url: str) -> subprocess.CompletedProcess[str]:
    """One HTTP GET from inside the stand-in's namespace (found by its address's host link)."""
    route = subprocess.run(
        ["ip", "-o", "route", "get", address], capture_output=True, text=True, check=True
    ).stdout
    netns = route.split(" dev ")[1].split()[0]
    get = (
        "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=5).read().decode())"
    )
    return subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", get, url],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


def test_a_worker_pod_reaches_a_virtual_pod_by_address_and_through_a_service(
    worker_kubectl: Kubectl, ns: str, web: dict[str, str], virtual_pod: str
) -> None:
    assert wait_for(
        lambda: fetch(worker_kubectl, ns, f"http://{virtual_pod}:8080/") == "virtual pod",
        timeout=30,
    )
    # A Service whose endpoint is the virtual pod, as a vm node's Ready VM pod would make it.
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "virt"},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "virt-1", "labels": {"kubernetes.io/service-name": "virt"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [virtual_pod], "conditions": {"ready": True}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }
    for item in (service, endpoints):
        worker_kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(item))
    url = f"http://virt.{ns}.svc.cluster.local/"
    assert wait_for(lambda: fetch(worker_kubectl, ns, url) == "virtual pod", timeout=30)


def test_a_virtual_pod_reaches_worker_pods_and_their_service_by_dns_name(
    worker_kubectl: Kubectl, ns: str, web: dict[str, str], virtual_pod: str
) -> None:
    pods = worker_kubectl.json("-n", ns, "get", "pods", "-l", "app=web")["items"]
    for pod in pods:
        direct = fetch_from_virtual_pod(virtual_pod, f"http://{pod['status']['podIP']}:8080/")
        assert direct.stdout.strip() == pod["metadata"]["name"], direct.stderr
    # By the Service's DNS name: the name goes to cluster DNS and the ClusterIP to a worker,
    # both through the cluster's routing table for its virtual range.
    seen: set[str] = set()
    for _ in range(40):
        answer = fetch_from_virtual_pod(virtual_pod, "http://web/")
        assert answer.returncode == 0, answer.stderr
        seen.add(answer.stdout.strip())
        if set(web) <= seen:
            break
    assert set(web) <= seen, seen
