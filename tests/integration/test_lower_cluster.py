"""The lower-cluster fixture the cluster provider's tests stand on: a second real control plane
whose scheduler places pods on mock nodes of different sizes and labels."""

from __future__ import annotations

import json
import uuid

from vkubelet.testing import wait_for

from .clusters import LOWER_NODES, LowerCluster


def test_the_lower_cluster_schedules_pods_onto_its_labelled_mock_nodes(
    lower_cluster: LowerCluster,
) -> None:
    kubectl = lower_cluster.kubectl
    assert lower_cluster.all_ready()
    for spec in LOWER_NODES:
        node = kubectl.json("get", "node", lower_cluster.node(spec.prefix).name)
        for key, value in spec.labels.items():
            assert node["metadata"]["labels"][key] == value
        assert node["status"]["allocatable"]["cpu"] == spec.capacity["cpu"]
        assert not node["spec"].get("taints")
    gpu_node = kubectl.json("get", "node", lower_cluster.node("lower-a").name)
    assert gpu_node["status"]["allocatable"]["example.com/gpu"] == "2"

    # No nodeName: the lower scheduler picks the only node in zone b.
    name = f"smoke-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"topology.kubernetes.io/zone": "b"},
            "containers": [
                {
                    "name": "main",
                    "image": "registry.example/app:1",
                    "resources": {"requests": {"cpu": "500m"}},
                }
            ],
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        running = wait_for(
            lambda: (
                (p := kubectl.json("get", "pod", name))["status"].get("phase") == "Running" and p
            ),
            what=f"pod {name} Running in the lower cluster",
        )
        assert running["spec"]["nodeName"] == lower_cluster.node("lower-b").name
        assert running["status"].get("podIP")
    finally:
        kubectl("delete", "pod", name, "--wait=false", "--ignore-not-found")
