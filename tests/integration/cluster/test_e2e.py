"""`vkubelet run --provider cluster` end to end: a whole lower dev cluster as one node of the upper
dev cluster, with the real agent, real kubectl on both sides. (The issue's Deployment, outage and
shared-lower-cluster scenarios are in test_acceptance.py.)"""

from __future__ import annotations

import json
import signal
import time
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
    node_ready,
    start_agent,
    wait_for,
)

from ..clusters import TOLERATION, ClusterNode, LowerCluster

JSON = dict[str, Any]


@pytest.fixture
def cluster_node(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> Iterator[ClusterNode]:
    name = f"vk-lower-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "lower.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": str(lower_cluster.kubeconfig),
                "upperClusterID": f"e2e-{uuid.uuid4().hex[:6]}",
            }
        )
    )
    agent = start_agent(
        kube_cluster, tmp_path, provider="cluster", config=config, name=name, address="127.0.0.1"
    )
    try:
        wait_for(lambda: node_ready(kubectl, name), what=f"node {name} Ready")
        wait_for(
            lambda: (
                int(kubectl.json("get", "node", name)["status"]["allocatable"].get("pods", "0")) > 0
            ),
            what="the virtual node's capacity from the lower cluster",
        )
        yield ClusterNode(name, agent)
    finally:
        agent.stop()
        kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
        print(agent.log()[-5000:])


def deploy(kubectl: Kubectl, namespace: str, node: str, replicas: int) -> list[JSON]:
    """A Deployment pinned to the virtual node; its pods once all are Running with an IP."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "tolerations": [TOLERATION],
                    "containers": [{"name": "app", "image": "registry.example/web:1"}],
                },
            },
        },
    }
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(deployment))

    def running() -> list[JSON] | None:
        pods: list[JSON] = kubectl.json("-n", namespace, "get", "pods", "-l", "app=web")["items"]
        ok = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
        return pods if len(pods) == replicas == len(ok) else None

    found: list[JSON] = wait_for(running, timeout=120, what=f"{replicas} upper pods Running")
    return found


def test_the_agent_killed_and_restarted_adopts_every_lower_pod(
    kubectl: Kubectl, lower_cluster: LowerCluster, cluster_node: ClusterNode
) -> None:
    """Adopted, and with them what they use below: the ConfigMap copy and the Service the
    pods had stay while the restarted agent hands its pods back and starts a new one."""
    namespace = f"kill-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    lk = lower_cluster.kubectl
    try:
        config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "web-config"}}
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
        }
        for obj in ({**config, "data": {"LEVEL": "info"}}, service):
            kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(obj))
        deploy(kubectl, namespace, cluster_node.name, 2)
        keeper = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "keeper", "labels": {"app": "web"}},
            "spec": {
                "nodeName": cluster_node.name,
                "containers": [
                    {
                        "name": "app",
                        "image": "registry.example/web:1",
                        "envFrom": [{"configMapRef": {"name": "web-config"}}],
                    }
                ],
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(keeper))

        def below() -> tuple[int, int]:
            owned = ("-l", "vkubelet.io/owner")
            copies = lk.json("-n", namespace, "get", "configmaps", *owned)["items"]
            services = lk.json("-n", namespace, "get", "services", *owned)["items"]
            return len(copies), len(services)

        wait_for(lambda: below() == (1, 1), timeout=90, what="the ConfigMap copy and Service")
        # A pod without a controller, deleted upstairs while the agent is down.
        lonely = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "lonely"},
            "spec": {
                "nodeName": cluster_node.name,
                "containers": [{"name": "app", "image": "registry.example/web:1"}],
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(lonely))
        wait_for(
            lambda: (
                kubectl.json("-n", namespace, "get", "pod", "lonely")["status"].get("phase")
                == "Running"
            ),
            what="lonely Running",
        )

        def lower_pods() -> dict[str, str]:
            items = lk.json("-n", namespace, "get", "pods")["items"]
            return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items}

        wait_for(
            lambda: (
                kubectl.json("-n", namespace, "get", "pod", "keeper")["status"].get("phase")
                == "Running"
            ),
            what="keeper Running",
        )
        before = lower_pods()
        assert len(before) == 4 and "lonely" in before
        cluster_node.agent.stop(signal.SIGKILL)
        kubectl("-n", namespace, "delete", "pod", "lonely", "--grace-period=0", "--force")
        cluster_node.agent.start()
        wait_for(lambda: "lonely" not in lower_pods(), timeout=90, what="lonely removed below")
        wait_for(lambda: node_ready(kubectl, cluster_node.name), what="the node Ready again")
        # A new pod meanwhile: its start plans the copies of every pod the agent has so far.
        late = {**lonely, "metadata": {"name": "late"}}
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(late))
        wait_for(lambda: "late" in lower_pods(), timeout=90, what="late created below")
        deadline = time.monotonic() + 15  # the plans of the restart have run by then
        while time.monotonic() < deadline:
            assert below() == (1, 1), "a copy or Service the adopted pods use was deleted"
            time.sleep(1)
        after = lower_pods()
        # The survivors are the very same lower pods: adopted, none re-created.
        assert {k: v for k, v in after.items() if k != "late"} == {
            k: v for k, v in before.items() if k != "lonely"
        }
        for name in after:
            assert kubectl.json("-n", namespace, "get", "pod", name)["status"]["phase"] == "Running"
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")
