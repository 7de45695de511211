"""Aggregate mode tells the truth, against two real clusters and the real agent: the virtual
node publishes the most free on any single lower node (kept current), a pod that fits the summed
allocatable but no single lower node fails fast upstairs with `LowerClusterCannotFit` and an
Event naming cpu (nothing is created below), and a ReplicaSet whose pod cannot fit is not allowed
to hammer the node: the short-lived taint spaces its replacements out."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster
from vkubelet.sdk import parse_quantity
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    node_ready,
    start_agent,
    wait_for,
)

from ..clusters import LowerCluster

JSON = dict[str, Any]
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}
BACKOFF = 4


@dataclass
class AggregateNode:
    name: str
    agent: AgentProcess


@pytest.fixture
def aggregate_node(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> Iterator[AggregateNode]:
    name = f"vk-fit-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "lower.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": str(lower_cluster.kubeconfig),
                "upperClusterID": f"fit-{uuid.uuid4().hex[:6]}",
                "cannotFitBackoff": BACKOFF,
            }
        )
    )
    agent = start_agent(
        kube_cluster, tmp_path, provider="cluster", config=config, name=name, address="127.0.0.1"
    )
    try:
        wait_for(lambda: node_ready(kubectl, name), what=f"node {name} Ready")
        wait_for(lambda: largest_free(kubectl, name), what="the largest-free annotation")
        yield AggregateNode(name, agent)
    finally:
        agent.stop()
        kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
        print(agent.log()[-5000:])


def largest_free(kubectl: Kubectl, node: str) -> dict[str, str]:
    annotations = kubectl.json("get", "node", node)["metadata"].get("annotations") or {}
    found: dict[str, str] = json.loads(annotations.get("vkubelet.io/largest-free") or "{}")
    return found


def cpu(value: str) -> Fraction:
    return parse_quantity(value).to_fraction()


def free_cpu_per_lower_node(lower: LowerCluster) -> dict[str, Fraction]:
    """What each lower node has free, from the lower cluster itself."""
    free: dict[str, Fraction] = {}
    for node in lower.kubectl.json("get", "nodes")["items"]:
        if node["spec"].get("unschedulable"):
            continue
        free[node["metadata"]["name"]] = cpu(node["status"]["allocatable"]["cpu"])
    for pod in lower.kubectl.json("get", "pods", "-A")["items"]:
        where = pod["spec"].get("nodeName")
        if where in free and pod["status"].get("phase") not in ("Succeeded", "Failed"):
            for c in pod["spec"]["containers"]:
                free[where] -= cpu((c.get("resources") or {}).get("requests", {}).get("cpu", "0"))
    return free


def pinned(name: str, node: str, cpu_request: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [TOLERATION],
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example/web:1",
                    "resources": {"requests": {"cpu": cpu_request}},
                }
            ],
        },
    }


def test_a_pod_fitting_the_sum_but_no_single_lower_node_fails_fast_naming_cpu(
    kubectl: Kubectl, lower_cluster: LowerCluster, aggregate_node: AggregateNode
) -> None:
    node = aggregate_node.name
    lk = lower_cluster.kubectl
    namespace = f"fit-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    create_namespace(lk, namespace)
    try:
        # The annotation is the largest single node's free cpu, not the sum (allocatable).
        per_node = free_cpu_per_lower_node(lower_cluster)
        wait_for(
            lambda: cpu(largest_free(kubectl, node)["cpu"]) == max(per_node.values()),
            what=f"largest-free cpu = {max(per_node.values())}",
        )
        too_big = max(per_node.values()) + 1

        def summed() -> Fraction:
            return cpu(kubectl.json("get", "node", node)["status"]["allocatable"]["cpu"])

        # The annotation and the status are two writes: the sum may come a moment later.
        wait_for(lambda: too_big <= summed(), what=f"allocatable cpu the sum, >= {too_big}")

        # Kept current: a pod started below on the biggest node lowers it within seconds.
        biggest = max(per_node, key=lambda n: per_node[n])
        filler = pinned("filler", node, "1")
        filler["spec"] = {**filler["spec"], "nodeName": biggest}
        filler["spec"].pop("nodeSelector")
        lk("-n", namespace, "apply", "-f", "-", input=json.dumps(filler))
        expected = max([per_node[biggest] - 1, *(v for n, v in per_node.items() if n != biggest)])
        wait_for(
            lambda: cpu(largest_free(kubectl, node)["cpu"]) == expected,
            timeout=15,
            what=f"largest-free cpu down to {expected}",
        )
        lk("-n", namespace, "delete", "pod", "filler", "--grace-period=0", "--force")
        wait_for(
            lambda: cpu(largest_free(kubectl, node)["cpu"]) == per_node[biggest],
            timeout=15,
            what="largest-free cpu back up",
        )

        # Fits the sum, no single node: Failed at once, with an Event naming cpu.
        quantity = str(too_big) if too_big.denominator == 1 else f"{int(too_big * 1000)}m"
        kubectl(
            "-n", namespace, "apply", "-f", "-", input=json.dumps(pinned("big", node, quantity))
        )

        def failed() -> JSON | None:
            status: JSON = kubectl.json("-n", namespace, "get", "pod", "big")["status"]
            return status if status.get("phase") == "Failed" else None

        status = wait_for(failed, timeout=30, what="pod big Failed")
        assert status["reason"] == "LowerClusterCannotFit"
        assert "lacking cpu" in status["message"], status["message"]
        events = kubectl.json(
            "-n", namespace, "get", "events", "--field-selector", "involvedObject.name=big"
        )["items"]
        assert any(
            e["reason"] == "LowerClusterCannotFit" and "cpu" in e["message"] for e in events
        ), events
        assert lk("-n", namespace, "get", "pods", "-o", "name").stdout.strip() == "", (
            "nothing below"
        )

        # The node is tainted for the back-off only.
        def taint_keys() -> set[str]:
            taints = kubectl.json("get", "node", node)["spec"].get("taints") or []
            return {t["key"] for t in taints}

        wait_for(
            lambda: "vkubelet.io/lower-cannot-fit" in taint_keys(), timeout=10, what="the taint"
        )
        wait_for(
            lambda: "vkubelet.io/lower-cannot-fit" not in taint_keys(),
            timeout=BACKOFF + 10,
            what="the taint gone after the back-off",
        )

        # A pod that fits one node still runs.
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(pinned("small", node, "1")))
        wait_for(
            lambda: (
                kubectl.json("-n", namespace, "get", "pod", "small")["status"].get("phase")
                == "Running"
            ),
            timeout=60,
            what="pod small Running",
        )
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false")


def test_a_replicaset_whose_pod_fits_no_lower_node_does_not_hammer_the_virtual_node(
    kubectl: Kubectl, lower_cluster: LowerCluster, aggregate_node: AggregateNode
) -> None:
    node = aggregate_node.name
    namespace = f"loop-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    try:
        # Bigger than any lower node's whole allocatable: it can never fit, whatever earlier
        # tests still leave running below (free room would grow when their pods end).
        nodes = lower_cluster.kubectl.json("get", "nodes")["items"]
        too_big = int(max(cpu(n["status"]["allocatable"]["cpu"]) for n in nodes)) + 1
        template = pinned("big", node, str(too_big))
        replicaset = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {"name": "big"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "big"}},
                "template": {"metadata": template["metadata"], "spec": template["spec"]},
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(replicaset))

        def failures() -> int:
            pods = kubectl.json("-n", namespace, "get", "pods")["items"]
            return sum(p["status"].get("reason") == "LowerClusterCannotFit" for p in pods)

        wait_for(lambda: failures() >= 1, timeout=30, what="the first refusal")
        # Over 20 s, in which an unmitigated loop fails dozens of pods, back-offs of 4, 8 and
        # 16 s allow at most a few more refusals.
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < 20:
            count = failures()
            assert count <= 4, f"{count} pods failed in {elapsed:.0f}s"
            time.sleep(1)
        pending = [
            p
            for p in kubectl.json("-n", namespace, "get", "pods")["items"]
            if p["status"].get("phase") == "Pending"
        ]
        assert len(pending) <= 1
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lower_cluster.kubectl(
            "delete", "namespace", namespace, "--wait=false", "--ignore-not-found"
        )


def test_a_daemonset_tolerating_everything_is_refused_with_a_reason_and_never_stuck(
    kubectl: Kubectl, aggregate_node: AggregateNode
) -> None:
    node = aggregate_node.name
    namespace = f"ds-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "agent"}},
            "template": {
                "metadata": {"labels": {"app": "agent"}},
                "spec": {
                    # As log shippers and CNI agents do: every taint tolerated.
                    "tolerations": [{"operator": "Exists"}],
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [{"name": "app", "image": "registry.example/agent:1"}],
                },
            },
        },
    }
    try:
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(daemonset))

        def refused() -> JSON | None:
            pods: list[JSON] = kubectl.json("-n", namespace, "get", "pods")["items"]
            return next(
                (p for p in pods if p["status"].get("reason") == "DaemonSetPodRefused"), None
            )

        pod = wait_for(refused, timeout=60, what="a DaemonSet pod refused")
        assert pod["status"]["phase"] == "Failed"
        assert "vkubelet.io/run-on-virtual-node" in pod["status"]["message"]
        kubectl("-n", namespace, "delete", "daemonset", "agent")

        def none_left() -> bool:
            return not kubectl.json("-n", namespace, "get", "pods")["items"]

        wait_for(none_left, timeout=30, what="no DaemonSet pod left (none stuck Terminating)")
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")


def test_a_pod_the_lower_scheduler_keeps_refusing_fails_after_the_timeout_and_leaves_nothing_below(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> None:
    """No pod Pending below forever: with the fit check off (any way a pod gets past it), a
    pod no lower node can take is Unschedulable below, then failed upstairs with the lower
    scheduler's reason, and its lower pod removed."""
    name = f"vk-stuck-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "lower.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": str(lower_cluster.kubeconfig),
                "upperClusterID": f"stuck-{uuid.uuid4().hex[:6]}",
                "fitCheck": False,
                "unschedulableTimeout": 5,
            }
        )
    )
    agent = start_agent(
        kube_cluster, tmp_path, provider="cluster", config=config, name=name, address="127.0.0.1"
    )
    lk = lower_cluster.kubectl
    namespace = f"stuck-{uuid.uuid4().hex[:6]}"
    try:
        wait_for(lambda: node_ready(kubectl, name), what=f"node {name} Ready")
        create_namespace(kubectl, namespace)
        per_node = free_cpu_per_lower_node(lower_cluster)
        summed = cpu(kubectl.json("get", "node", name)["status"]["allocatable"]["cpu"])
        too_big = max(per_node.values()) + 1
        assert too_big <= summed, (per_node, summed)  # the upper scheduler binds it
        quantity = str(too_big) if too_big.denominator == 1 else f"{int(too_big * 1000)}m"
        kubectl(
            "-n", namespace, "apply", "-f", "-", input=json.dumps(pinned("stuck", name, quantity))
        )

        def lower_reason() -> str | None:
            got = lk("-n", namespace, "get", "pod", "stuck", "-o", "json", check=False)
            if got.returncode != 0:
                return None
            status = json.loads(got.stdout)["status"]
            return next(
                (c.get("reason") for c in status.get("conditions") or []
                 if c["type"] == "PodScheduled" and c["status"] == "False"),
                None,
            )  # fmt: skip

        wait_for(lambda: lower_reason() == "Unschedulable", what="Unschedulable below")

        def failed() -> JSON | None:
            status: JSON = kubectl.json("-n", namespace, "get", "pod", "stuck")["status"]
            return status if status.get("phase") == "Failed" else None

        status = wait_for(failed, timeout=60, what="the upper pod Failed")
        assert status["reason"] == "LowerClusterUnschedulable", status
        assert "Insufficient cpu" in status["message"], status["message"]
        wait_for(
            lambda: lk("-n", namespace, "get", "pod", "stuck", check=False).returncode != 0,
            timeout=30,
            what="the lower pod removed",
        )
        events = kubectl.json(
            "-n", namespace, "get", "events", "--field-selector", "involvedObject.name=stuck"
        )["items"]
        assert any(e["reason"] == "LowerClusterUnschedulable" for e in events)
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false", check=False)
        agent.stop()
        kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
