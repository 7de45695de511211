"""What the cluster provider keeps current beyond pods, against two real dev clusters with the
real agent: upper Services reflected below for the pods that need them, the virtual node's labels
following the lower nodes', and the upper cluster's identity derived without configuration."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster
from vkubelet.testing import Kubectl, create_namespace, node_ready, start_agent, wait_for

from ..clusters import TOLERATION, ClusterNode, LowerCluster

JSON = dict[str, Any]


@pytest.fixture
def plain_node(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> Iterator[ClusterNode]:
    """A virtual node whose lower.yaml holds nothing but the kubeconfig."""
    yield from _node(kube_cluster, kubectl, lower_cluster, tmp_path, {})


@pytest.fixture
def upper_token_node(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> Iterator[ClusterNode]:
    yield from _node(
        kube_cluster, kubectl, lower_cluster, tmp_path, {"serviceAccountTokens": "upper"}
    )


def _node(
    kube_cluster: Cluster,
    kubectl: Kubectl,
    lower_cluster: LowerCluster,
    tmp_path: Path,
    options: JSON,
) -> Iterator[ClusterNode]:
    name = f"vk-plain-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "lower.yaml"
    config.write_text(yaml.safe_dump({"kubeconfig": str(lower_cluster.kubeconfig), **options}))
    agent = start_agent(
        kube_cluster, tmp_path, provider="cluster", config=config, name=name, address="127.0.0.1"
    )
    try:
        wait_for(lambda: node_ready(kubectl, name), what=f"node {name} Ready")
        yield ClusterNode(name, agent)
    finally:
        agent.stop()
        kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
        print(agent.log()[-5000:])


def service(name: str, app: str, port: int = 80) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {
                "type": "NodePort",
                "selector": {"app": app},
                "ports": [{"name": "http", "port": port, "targetPort": 8080}],
            },
        }
    )


def pod(name: str, app: str, node: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": app}},
            "spec": {
                "nodeName": node,
                "tolerations": [TOLERATION],
                "containers": [
                    {
                        "name": "app",
                        "image": "registry.example/web:1",
                        "ports": [{"containerPort": 8080}],
                    }
                ],
            },
        }
    )


def test_services_of_the_nodes_pods_are_reflected_below_and_follow_the_upper_ones(
    kubectl: Kubectl, lower_cluster: LowerCluster, plain_node: ClusterNode
) -> None:
    namespace = f"svc-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    lk = lower_cluster.kubectl
    upper_id = kubectl.json("get", "namespace", "kube-system")["metadata"]["uid"]
    try:
        # The user's own lower Service, at the name of an upper Service our pod needs.
        lk("create", "namespace", namespace)
        lk("-n", namespace, "apply", "-f", "-", input=service("mine", "web", 9999))
        for name, app in (("web", "web"), ("mine", "web"), ("db", "db")):
            kubectl("-n", namespace, "apply", "-f", "-", input=service(name, app))
        kubectl("-n", namespace, "apply", "-f", "-", input=pod("web-1", "web", plain_node.name))

        def lower_services() -> dict[str, JSON]:
            items = lk.json("-n", namespace, "get", "services")["items"]
            return {s["metadata"]["name"]: s for s in items}

        web = wait_for(lambda: lower_services().get("web"), timeout=60, what="web reflected")
        annotations = web["metadata"]["annotations"]
        # No upperClusterID configured: the upper kube-system namespace's UID stands for it.
        assert annotations["vkubelet.io/upper-cluster"] == upper_id
        assert "selector" not in web["spec"], "its EndpointSlices are the provider's"
        assert web["spec"]["type"] == "ClusterIP"
        assert [p["port"] for p in web["spec"]["ports"]] == [80]
        lower_pod = lk.json("-n", namespace, "get", "pod", "web-1")
        assert lower_pod["metadata"]["annotations"]["vkubelet.io/upper-cluster"] == upper_id

        # The provider's EndpointSlice below lists the lower pod (its upper IP is the lower one).
        def endpoint_ips() -> set[str]:
            slices = lk.json(
                "-n",
                namespace,
                "get",
                "endpointslices",
                "-l",
                "kubernetes.io/service-name=web",
            )["items"]
            return {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}

        ip = wait_for(
            lambda: lk.json("-n", namespace, "get", "pod", "web-1")["status"].get("podIP"),
            what="the lower pod's IP",
        )
        wait_for(lambda: endpoint_ips() == {ip}, timeout=60, what="the lower endpoints")

        services = lower_services()
        assert "db" not in services, "no pod of the node matches db"
        assert [p["port"] for p in services["mine"]["spec"]["ports"]] == [9999]
        assert "vkubelet.io/owner" not in (services["mine"]["metadata"].get("labels") or {})

        # An upper change reaches the copy.
        kubectl(
            "-n",
            namespace,
            "patch",
            "service",
            "web",
            "--type=json",
            "-p",
            '[{"op":"replace","path":"/spec/ports/0/port","value":8081}]',
        )
        wait_for(
            lambda: [p["port"] for p in lower_services()["web"]["spec"]["ports"]] == [8081],
            timeout=30,
            what="the port change below",
        )
        # A pod of the node now matching db brings db down.
        kubectl("-n", namespace, "apply", "-f", "-", input=pod("db-1", "db", plain_node.name))
        wait_for(lambda: "db" in lower_services(), timeout=60, what="db reflected")

        # The upper Service deleted: its copy goes.
        kubectl("-n", namespace, "delete", "service", "db")
        wait_for(lambda: "db" not in lower_services(), timeout=30, what="db's copy deleted")

        # No pod of the node matches web any more: its copy goes; the user's stays.
        kubectl("-n", namespace, "delete", "pod", "web-1", "--wait=false")
        wait_for(lambda: "web" not in lower_services(), timeout=60, what="web's copy deleted")
        assert [p["port"] for p in lower_services()["mine"]["spec"]["ports"]] == [9999]
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def test_the_virtual_nodes_labels_follow_the_labels_common_to_the_lower_nodes(
    kubectl: Kubectl, lower_cluster: LowerCluster, plain_node: ClusterNode
) -> None:
    lk = lower_cluster.kubectl
    key = f"example.com/pool-{uuid.uuid4().hex[:6]}"
    lower_nodes = [n.name for n in lower_cluster.nodes.values()]

    def labels() -> dict[str, str]:
        found: dict[str, str] = kubectl.json("get", "node", plain_node.name)["metadata"]["labels"]
        return found

    try:
        assert labels()["topology.kubernetes.io/region"] == "eu"
        kubectl("label", "node", plain_node.name, "team=payments")
        for name in lower_nodes:
            lk("label", "node", name, f"{key}=blue")
        wait_for(lambda: labels().get(key) == "blue", timeout=30, what="the new common label")
        lk("label", "node", lower_nodes[0], f"{key}=green", "--overwrite")
        wait_for(lambda: key not in labels(), timeout=30, what="the label no longer common")
        assert labels()["team"] == "payments", "the user's own label stays"
        assert labels()["topology.kubernetes.io/region"] == "eu"
    finally:
        for name in lower_nodes:
            lk("label", "node", name, f"{key}-")


def token_review(kubectl: Kubectl, token: str) -> JSON:
    review = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token},
    }
    answer = kubectl("create", "-f", "-", "-o", "json", input=json.dumps(review)).stdout
    status: JSON = json.loads(answer)["status"]
    return status


def test_upper_tokens_reach_the_lower_pod_in_a_stamped_secret_bound_to_the_upper_pod(
    kubectl: Kubectl, lower_cluster: LowerCluster, upper_token_node: ClusterNode
) -> None:
    namespace = f"tok-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    lk = lower_cluster.kubectl
    try:
        wait_for(
            lambda: (
                kubectl("-n", namespace, "get", "serviceaccount", "default", check=False).returncode
                == 0
            ),
            what="the upper default account",
        )
        kubectl(
            "-n", namespace, "apply", "-f", "-", input=pod("api-1", "api", upper_token_node.name)
        )
        upper = wait_for(
            lambda: (
                found
                if (found := kubectl.json("-n", namespace, "get", "pod", "api-1"))["status"].get(
                    "phase"
                )
                == "Running"
                else None
            ),
            timeout=90,
            what="the upper pod Running",
        )
        lower = lk.json("-n", namespace, "get", "pod", "api-1")
        text = json.dumps(lower)
        assert "serviceAccountToken" not in text
        assert lower["spec"]["automountServiceAccountToken"] is False
        [volume] = [v for v in lower["spec"]["volumes"] if v["name"].startswith("kube-api-acc")]
        [secret_source] = [s["secret"] for s in volume["projected"]["sources"] if "secret" in s]
        secret = lk.json("-n", namespace, "get", "secret", secret_source["name"])
        assert secret["metadata"]["labels"]["vkubelet.io/role"] == "upper-token"
        assert (
            secret["metadata"]["annotations"]["vkubelet.io/upper-uid"] == upper["metadata"]["uid"]
        )
        [token] = [base64.b64decode(v).decode() for v in secret["data"].values()]
        assert token not in text

        # An upper token, of the pod's account, bound to the upper pod; nothing below.
        status = token_review(kubectl, token)
        assert status.get("authenticated") is True
        assert status["user"]["username"] == f"system:serviceaccount:{namespace}:default"
        assert status["user"]["extra"]["authentication.kubernetes.io/pod-uid"] == [
            upper["metadata"]["uid"]
        ]
        assert not token_review(lk, token).get("authenticated")

        # The CA next to it is the upper cluster's, which verifies the upper apiserver.
        [ca_source] = [s["configMap"] for s in volume["projected"]["sources"] if "configMap" in s]
        lower_ca = lk.json("-n", namespace, "get", "configmap", ca_source["name"])["data"]
        upper_ca = kubectl.json("-n", namespace, "get", "configmap", "kube-root-ca.crt")["data"]
        assert lower_ca["ca.crt"] == upper_ca["ca.crt"]

        kubectl("-n", namespace, "delete", "pod", "api-1", "--wait=false")
        wait_for(
            lambda: (
                lk("-n", namespace, "get", "secret", secret_source["name"], check=False).returncode
                != 0
            ),
            timeout=60,
            what="the token Secret removed with the pod",
        )
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")
