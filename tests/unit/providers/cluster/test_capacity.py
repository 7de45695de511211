"""The virtual node's allocatable: Σ allocatable of usable lower nodes - others' requests,
clamped at zero, pods and extended resources included; labels all lower nodes share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vkubelet.providers.cluster import is_ours, lower_capacity, pod_requests, stamp
from vkubelet.providers.cluster._capacity import format_quantity

from .pods import OWNER

JSON = dict[str, Any]


def node(
    name: str,
    *,
    ready: bool = True,
    cordoned: bool = False,
    extra: dict[str, str] | None = None,
    **allocatable: str,
) -> JSON:
    return {
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/region": "eu",
                "rack": name,
                "node-role.kubernetes.io/worker": "",
            },
        },
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {
            "allocatable": {**allocatable, **(extra or {})},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pod(node_name: str | None, phase: str = "Running", **requests: str) -> JSON:
    return {
        "metadata": {"name": "p", "namespace": "x"},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "resources": {"requests": requests}}],
        },
        "status": {"phase": phase},
    }


def ours(p: Mapping[str, Any]) -> bool:
    return is_ours(p, OWNER)


def test_allocatable_is_the_usable_nodes_minus_others_requests() -> None:
    nodes = [
        node("a", cpu="4", memory="8Gi", pods="110", extra={"example.com/gpu": "2"}),
        node("b", cpu="2", memory="4Gi", pods="110"),
    ]
    pods = [
        pod("a", cpu="500m", memory="1Gi"),
        pod("b", phase="Pending", cpu="1", **{"example.com/gpu": "1"}),  # bound: counts
        pod(None, phase="Pending", cpu="3"),  # not bound: takes nothing yet
        pod("a", phase="Succeeded", cpu="3"),  # terminal
        pod("a", phase="Failed", cpu="3"),
    ]
    capacity = lower_capacity(nodes, pods, ours)
    assert capacity.allocatable == {
        "cpu": "4500m",
        "example.com/gpu": "1",
        "memory": str(11 * 2**30),
        "pods": "218",
    }
    assert capacity.usable_nodes == 2


def test_our_own_pods_are_not_subtracted_twice() -> None:
    mine = stamp(pod("a", cpu="1"), OWNER, namespace="x", name="p", uid="u")
    capacity = lower_capacity([node("a", cpu="4", pods="10")], [mine], ours)
    assert capacity.allocatable == {"cpu": "4", "pods": "10"}


def test_cordoned_not_ready_and_tainted_nodes_offer_nothing() -> None:
    tainted = node("d", cpu="8", pods="10")
    tainted["spec"]["taints"] = [{"key": "dedicated", "effect": "NoSchedule"}]
    soft = node("e", cpu="1", pods="10")
    soft["spec"]["taints"] = [{"key": "spot", "effect": "PreferNoSchedule"}]
    nodes = [
        node("a", cpu="4", pods="10"),
        node("b", cordoned=True, cpu="16", pods="10"),
        node("c", ready=False, cpu="32", pods="10"),
        tainted,
        soft,
    ]
    # A pod on a node that does not count does not count either.
    capacity = lower_capacity(nodes, [pod("b", cpu="10")], ours)
    assert capacity.allocatable == {"cpu": "5", "pods": "20"}
    assert capacity.usable_nodes == 2


def test_each_resource_is_clamped_at_zero_never_negative() -> None:
    nodes = [node("a", cpu="1", memory="1Gi", pods="2", extra={"example.com/gpu": "1"})]
    pods = [pod("a", cpu="2", **{"example.com/gpu": "3"}) for _ in range(3)]
    capacity = lower_capacity(nodes, pods, ours)
    assert capacity.allocatable == {
        "cpu": "0",
        "example.com/gpu": "0",
        "memory": str(2**30),
        "pods": "0",
    }


def test_a_resource_no_usable_node_has_is_clamped_too() -> None:
    # tensile-kube #91: an extended resource requested by pods on nodes that lack it.
    capacity = lower_capacity([node("a", cpu="2")], [pod("a", **{"example.com/fpga": "1"})], ours)
    assert capacity.allocatable["example.com/fpga"] == "0"


def test_labels_common_to_every_usable_node_are_published() -> None:
    nodes = [node("a", cpu="1"), node("b", cpu="1"), node("c", ready=False, cpu="1")]
    nodes[2]["metadata"]["labels"]["topology.kubernetes.io/region"] = "us"
    capacity = lower_capacity(nodes, [], ours)
    assert capacity.labels == {"topology.kubernetes.io/region": "eu"}
    one = lower_capacity([node("a", cpu="1")], [], ours, label_excluded=lambda k: k == "rack")
    assert one.labels == {"topology.kubernetes.io/region": "eu"}  # no hostname, no role
    assert lower_capacity([], [], ours).labels == {}


def test_requests_follow_the_schedulers_rules_for_init_containers_and_sidecars() -> None:
    spec = {
        "containers": [
            {"name": "a", "resources": {"requests": {"cpu": "1"}}},
            {"name": "b", "resources": {"limits": {"cpu": "500m", "memory": "1Gi"}}},
        ],
        "initContainers": [
            {
                "name": "sidecar",
                "restartPolicy": "Always",
                "resources": {"requests": {"cpu": "200m"}},
            },
            {"name": "big-init", "resources": {"requests": {"cpu": "3", "memory": "64Mi"}}},
        ],
        "overhead": {"cpu": "100m"},
    }
    requests = pod_requests({"spec": spec})
    # max(1 + 0.5 + 0.2 sidecar, 3 + 0.2 sidecar) + 0.1 overhead
    assert format_quantity(requests["cpu"]) == "3300m"
    assert format_quantity(requests["memory"]) == str(2**30)
