"""Cross-cluster Services with real packets: a pod running *below* (on a real worker of the
lower cluster) reaches an upper Service reflected there by DNS name, and through it every ready
replica — those on the upper cluster's real workers as well as the virtual node's, which run as
real containers below. Two dev clusters with workers on one machine (the session's
`worker_cluster` upstairs, one more below for this module), routed to each other by the host."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import Kubectl, create_namespace, wait_for

from ..clusters import TOLERATION, ClusterNode, lower_as_virtual_node

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("worker_cluster")]

JSON = dict[str, Any]
LABELS = {"app": "web"}


@pytest.fixture(scope="module")
def virtual_node(
    worker_cluster: Cluster,
    worker_kubectl: Kubectl,
    lower_workers: Cluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ClusterNode]:
    """A cluster-provider agent: the lower cluster as one virtual node of the upper one."""
    with lower_as_virtual_node(
        worker_cluster,
        worker_kubectl,
        lower_workers,
        tmp_path_factory.mktemp("xsvc-agent"),
        f"vk-xsvc-{uuid.uuid4().hex[:6]}",
    ) as node:
        yield node


def httpd(image: str) -> JSON:
    """busybox httpd on 8080 answering with its pod's name (the lower pod has the upper name)."""
    return {
        "name": "httpd",
        "image": image,
        "imagePullPolicy": "Never",
        "command": [
            "sh",
            "-c",
            "mkdir -p /www && hostname > /www/index.html && exec httpd -f -p 8080 -h /www",
        ],
        "ports": [{"containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 2},
    }


def upper_objects(image: str, node: str) -> list[JSON]:
    """The Service, two replicas on the upper workers (the virtual node's taint keeps them off
    it) and one on the virtual node."""
    pod_spec = {"containers": [httpd(image)], "terminationGracePeriodSeconds": 1}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": LABELS, "ports": [{"port": 80, "targetPort": 8080}]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web-workers"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": LABELS},
                "template": {"metadata": {"labels": LABELS}, "spec": pod_spec},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "web-virtual", "labels": LABELS},
            "spec": {**pod_spec, "nodeName": node, "tolerations": [TOLERATION]},
        },
    ]


def client_pod(image: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client"},
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


def ready_replicas(kubectl: Kubectl, namespace: str) -> dict[str, str] | None:
    """Name -> node of the Service's upper pods, once all three are Ready."""
    pods = kubectl.json("-n", namespace, "get", "pods", "-l", "app=web")["items"]
    ready = {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in pods
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
    }
    return ready if len(ready) == 3 else None


def test_a_lower_pod_reaches_every_ready_replica_of_an_upper_service_and_no_unready_one(
    worker_cluster: Cluster,
    worker_kubectl: Kubectl,
    lower_workers: Cluster,
    virtual_node: ClusterNode,
    tmp_path: Path,
) -> None:
    upper, lower = worker_kubectl, Kubectl(lower_workers.kubeconfig)
    image = worker_cluster.image_reference("busybox")
    assert lower_workers.image_reference("busybox") == image, "the virtual node's pod runs below"
    namespace = create_namespace(upper, f"xsvc-{uuid.uuid4().hex[:6]}")
    try:
        for item in upper_objects(image, virtual_node.name):
            upper("-n", namespace, "apply", "-f", "-", input=json.dumps(item))
        replicas = wait_for(
            lambda: ready_replicas(upper, namespace), timeout=120, what="three ready replicas"
        )
        on_workers = {p for p, node in replicas.items() if node != virtual_node.name}
        assert len(on_workers) == 2 and "web-virtual" in replicas, replicas

        wait_for(
            lambda: lower("-n", namespace, "get", "service", "web", check=False).returncode == 0,
            timeout=60,
            what="web reflected below",
        )
        lower("-n", namespace, "apply", "-f", "-", input=json.dumps(client_pod(image)))
        lower("-n", namespace, "wait", "--for=condition=Ready", "pod/client", "--timeout=90s")

        def fetch() -> str | None:
            result = lower(
                "-n", namespace, "exec", "client", "--",
                "timeout", "5", "wget", "-q", "-O", "-", "http://web/",
                check=False,
            )  # fmt: skip
            return result.stdout.strip() if result.returncode == 0 else None

        seen: set[str] = set()

        def every_replica_answered() -> bool:
            seen.add(fetch() or "")
            return seen >= set(replicas)

        wait_for(every_replica_answered, timeout=120, what=f"answers from {sorted(replicas)}")
        assert seen - {""} == set(replicas), seen

        # A replica upstairs that stops being ready (its page gone: the probe gets 404) drops
        # out below too: then 15 answers in a row come from the two others (were it still an
        # endpoint, a request would reach it, and fail, with 1 - (2/3)^15 > 99 % odds).
        unready = sorted(on_workers)[0]
        upper("-n", namespace, "exec", unready, "--", "rm", "/www/index.html")
        streak: list[str | None] = []

        def fifteen_answers_from_the_others() -> bool:
            answer = fetch()
            streak[:] = [*streak, answer] if answer in set(replicas) - {unready} else []
            return len(streak) >= 15

        wait_for(fifteen_answers_from_the_others, timeout=120, what=f"{unready} out below")
    finally:
        upper("delete", "namespace", namespace, "--wait=false")
