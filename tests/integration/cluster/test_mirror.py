"""Mirror mode against two real clusters and the real agent: one virtual node per lower node,
with that node's labels and free room; a pod bound to a mirrored node runs on exactly that lower
node; a cordon below is seen upstairs within seconds; a killed and restarted agent adopts the
lower pods; a lower node that appears is registered, one whose kubelet stops makes its virtual
node NotReady, and one that vanishes has its virtual node drained and deleted; the upper
scheduler sees the real shape (a pod too big for every lower node is Pending upstairs with
"Insufficient cpu", a zone spread puts one replica per lower zone)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    local_test_address,
    mock_node,
    node_ready,
    start_agent,
    wait_for,
)

from ..clusters import LowerCluster

JSON = dict[str, Any]
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}


@dataclass
class Mirror:
    prefix: str
    agent: AgentProcess
    restart: Callable[[], AgentProcess]

    def member(self, lower_node: str) -> str:
        return f"{self.prefix}-{lower_node}"


@pytest.fixture
def mirror(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> Iterator[Mirror]:
    prefix = f"vkm-{uuid.uuid4().hex[:4]}"
    config = tmp_path / "lower.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": str(lower_cluster.kubeconfig),
                "upperClusterID": f"mirror-{uuid.uuid4().hex[:6]}",
                "mode": "mirror",
                # A Service copy no member needs goes after 10 s, not the default 30 s: the
                # test of its end waits for it (and a shorter hold only makes a gap likelier).
                "sharedServiceGrace": 10,
            }
        )
    )

    def start() -> AgentProcess:
        return start_agent(
            kube_cluster,
            tmp_path,
            provider="cluster",
            config=config,
            name=prefix,
            address="127.0.0.1",
        )

    # These tests compare the virtual nodes with the whole of each lower node: pods that earlier
    # tests left terminating below (their namespaces are deleted without waiting) must be gone.
    wait_for(
        lambda: _foreign_pods(lower_cluster) == [],
        timeout=180,
        what="the lower nodes free of earlier tests' pods",
    )
    found = Mirror(prefix, start(), start)
    try:
        for lower in lower_cluster.nodes.values():
            member = found.member(lower.name)
            wait_for(
                functools.partial(node_ready, kubectl, member), what=f"mirrored {member} Ready"
            )
        yield found
    finally:
        found.agent.stop()
        for node in kubectl.json("get", "nodes")["items"]:
            if node["metadata"]["name"].startswith(prefix + "-"):
                kubectl("delete", "node", node["metadata"]["name"], "--wait=false")
        print(found.agent.log()[-6000:])


def _foreign_pods(lower_cluster: LowerCluster) -> list[str]:
    """Pods on the lower nodes that are not the lower cluster's own system pods."""
    pods = lower_cluster.kubectl.json("get", "pods", "-A")["items"]
    return [
        f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        for p in pods
        if p["spec"].get("nodeName") in {n.name for n in lower_cluster.nodes.values()}
        and p["metadata"]["namespace"] != "kube-system"
        and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
    ]


def test_each_lower_node_is_a_virtual_node_with_its_labels_room_and_cordon(
    kubectl: Kubectl, lower_cluster: LowerCluster, mirror: Mirror
) -> None:
    lk = lower_cluster.kubectl
    for lower in lower_cluster.nodes.values():
        below = lk.json("get", "node", lower.name)
        above = kubectl.json("get", "node", mirror.member(lower.name))
        labels = above["metadata"]["labels"]
        assert (
            labels["topology.kubernetes.io/zone"]
            == below["metadata"]["labels"]["topology.kubernetes.io/zone"]
        )
        assert labels["kubernetes.io/hostname"] == mirror.member(lower.name)
        assert above["metadata"]["annotations"]["vkubelet.io/lower-node"] == lower.name
        # Nothing else runs on the lower nodes: the whole allocatable is offered.
        assert above["status"]["allocatable"]["cpu"] == below["status"]["allocatable"]["cpu"]

    # A pod bound to the mirrored lower-b runs on exactly lower-b below.
    namespace = f"mirror-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    target = lower_cluster.node("lower-b").name
    try:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "web"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": mirror.member(target)},
                "tolerations": [TOLERATION],
                "containers": [
                    {
                        "name": "app",
                        "image": "registry.example/web:1",
                        "resources": {"requests": {"cpu": "500m"}},
                    }
                ],
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(pod))
        wait_for(
            lambda: (
                kubectl.json("-n", namespace, "get", "pod", "web")["status"].get("phase")
                == "Running"
            ),
            timeout=90,
            what="pod web Running",
        )
        assert lk.json("-n", namespace, "get", "pod", "web")["spec"]["nodeName"] == target

        # A cordon below is a cordon upstairs, within 10 s; and back.
        victim = lower_cluster.node("lower-c").name
        lk("cordon", victim)
        try:
            wait_for(
                lambda: (
                    kubectl.json("get", "node", mirror.member(victim))["spec"].get("unschedulable")
                    is True
                ),
                timeout=10,
                what="the cordon upstairs",
            )
        finally:
            lk("uncordon", victim)
        wait_for(
            lambda: (
                not kubectl.json("get", "node", mirror.member(victim))["spec"].get("unschedulable")
            ),
            timeout=10,
            what="the uncordon upstairs",
        )

        # Killed and restarted, the fleet's members adopt their lower pods: same lower pod.
        lower_uid = lk.json("-n", namespace, "get", "pod", "web")["metadata"]["uid"]
        mirror.agent.stop(signal.SIGKILL)
        mirror.agent = mirror.restart()
        wait_for(
            lambda: "adopted 1 running pod(s)" in mirror.agent.log(),
            timeout=60,
            what="the member adopting its pod after the restart",
        )
        assert lk.json("-n", namespace, "get", "pod", "web")["metadata"]["uid"] == lower_uid
        assert kubectl.json("-n", namespace, "get", "pod", "web")["status"]["phase"] == "Running"
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def test_a_lower_node_appearing_is_mirrored_and_one_vanishing_is_drained_and_removed(
    kubectl: Kubectl, lower_cluster: LowerCluster, mirror: Mirror, tmp_path: Path
) -> None:
    address = "127.0.0.1"
    with (
        local_test_address() if os.geteuid() == 0 else contextlib.nullcontext(address) as address,
        mock_node(
            lower_cluster.cluster,
            lower_cluster.kubectl,
            tmp_path / "lower-d",
            prefix="lower-d",
            mock_config={"cpu": "3", "memory": "4Gi", "pods": "10"},
            address=address,
            extra_args=("--disable-taint", "--label", "topology.kubernetes.io/zone=d"),
        ) as extra,
    ):
        member = mirror.member(extra.name)
        wait_for(lambda: node_ready(kubectl, member), timeout=30, what=f"{member} Ready")
        assert (
            kubectl.json("get", "node", member)["metadata"]["labels"]["topology.kubernetes.io/zone"]
            == "d"
        )
        namespace = f"vanish-{uuid.uuid4().hex[:6]}"
        create_namespace(kubectl, namespace)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "doomed"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": member},
                "tolerations": [TOLERATION],
                "containers": [{"name": "app", "image": "registry.example/web:1"}],
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(pod))
        wait_for(
            lambda: (
                kubectl.json("-n", namespace, "get", "pod", "doomed")["status"].get("phase")
                == "Running"
            ),
            timeout=90,
            what="pod doomed Running on the new node",
        )
        # The lower node's kubelet stops: once the lower cluster marks it not ready, so is
        # its virtual node, with the lower node's words.
        extra.agent.stop()

        def not_ready() -> str | None:
            conditions = kubectl.json("get", "node", member)["status"].get("conditions") or []
            ready = next(c for c in conditions if c["type"] == "Ready")
            return str(ready.get("message")) if ready.get("reason") == "LowerNodeNotReady" else None

        wait_for(not_ready, timeout=90, what=f"{member} NotReady with the lower node")
    # mock_node's exit deleted the lower node below.
    wait_for(
        lambda: (
            kubectl("get", "node", member, "--ignore-not-found", "-o", "name").stdout.strip() == ""
        ),
        timeout=60,
        what=f"{member} drained and deleted",
    )
    assert f"node {member} drained and deleted" in mirror.agent.log()
    # Its pod was evicted by the drain (not left bound to a node that no longer exists).
    wait_for(
        lambda: (
            kubectl(
                "-n", namespace, "get", "pod", "doomed", "--ignore-not-found", "-o", "name"
            ).stdout.strip()
            == ""
        ),
        timeout=30,
        what="the drained node's pod gone",
    )
    kubectl("delete", "namespace", namespace, "--wait=false")


def test_the_upper_scheduler_sees_the_real_shape_spread_over_zones_and_insufficient_cpu(
    kubectl: Kubectl, lower_cluster: LowerCluster, mirror: Mirror
) -> None:
    lk = lower_cluster.kubectl
    members = [mirror.member(n.name) for n in lower_cluster.nodes.values()]
    on_members = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": members}
                        ]
                    }
                ]
            }
        }
    }
    namespace = f"shape-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    try:
        # Larger than any single lower node (4, 2 and 1 CPUs): Pending upstairs with the
        # scheduler's own words, never sent below.
        big = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "big"},
            "spec": {
                "affinity": on_members,
                "tolerations": [TOLERATION],
                "containers": [
                    {
                        "name": "app",
                        "image": "registry.example/web:1",
                        "resources": {"requests": {"cpu": "5"}},
                    }
                ],
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(big))

        def unschedulable() -> str | None:
            status = kubectl.json("-n", namespace, "get", "pod", "big")["status"]
            for condition in status.get("conditions") or []:
                if condition["type"] == "PodScheduled" and condition.get("reason") == (
                    "Unschedulable"
                ):
                    return str(condition.get("message"))
            return None

        message = wait_for(unschedulable, timeout=30, what="big Unschedulable upstairs")
        assert "Insufficient cpu" in message, message

        # Spread over the lower zones as over real nodes: one replica per zone.
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "spread"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "spread"}},
                "template": {
                    "metadata": {"labels": {"app": "spread"}},
                    "spec": {
                        "affinity": on_members,
                        "tolerations": [TOLERATION],
                        "topologySpreadConstraints": [
                            {
                                "maxSkew": 1,
                                "topologyKey": "topology.kubernetes.io/zone",
                                "whenUnsatisfiable": "DoNotSchedule",
                                "labelSelector": {"matchLabels": {"app": "spread"}},
                            }
                        ],
                        "containers": [
                            {
                                "name": "app",
                                "image": "registry.example/web:1",
                                "resources": {"requests": {"cpu": "100m"}},
                            }
                        ],
                    },
                },
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(deployment))

        def running_below() -> list[JSON] | None:
            pods: list[JSON] = lk.json("-n", namespace, "get", "pods", "-l", "app=spread")["items"]
            ok = [p for p in pods if p["status"].get("phase") == "Running"]
            return ok if len(ok) == 3 else None

        below = wait_for(running_below, timeout=120, what="3 spread pods Running below")
        zones = {
            lk.json("get", "node", p["spec"]["nodeName"])["metadata"]["labels"][
                "topology.kubernetes.io/zone"
            ]
            for p in below
        }
        assert zones == {"a", "b", "c"}
        # Each runs on the lower node its upper node mirrors.
        for pod in kubectl.json("-n", namespace, "get", "pods", "-l", "app=spread")["items"]:
            lower = lk.json("-n", namespace, "get", "pod", pod["metadata"]["name"])
            assert pod["spec"]["nodeName"] == mirror.member(lower["spec"]["nodeName"])
        assert (
            lk(
                "-n", namespace, "get", "pod", "big", "--ignore-not-found", "-o", "name"
            ).stdout.strip()
            == ""
        )
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def test_members_share_one_lower_service_which_outlives_a_member_leaving(
    kubectl: Kubectl, lower_cluster: LowerCluster, mirror: Mirror, tmp_path: Path
) -> None:
    """One lower copy of an upper Service for the whole fleet, whichever member writes it;
    a member leaving (its lower node deleted, its pod evicted) does not take it down while
    another member runs a replica; it goes once no member has one."""
    lk = lower_cluster.kubectl
    namespace = create_namespace(kubectl, f"msvc-{uuid.uuid4().hex[:6]}")
    staying = mirror.member(lower_cluster.node("lower-a").name)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }

    def pod(name: str, member: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "labels": {"app": "web"}},
                "spec": {
                    "nodeName": member,
                    "tolerations": [TOLERATION],
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "app", "image": "registry.example/web:1"}],
                },
            }
        )

    def lower_web() -> JSON | None:
        found = lk("-n", namespace, "get", "service", "web", "-o", "json", check=False)
        return json.loads(found.stdout) if found.returncode == 0 else None

    def slice_addresses() -> set[str]:
        slices = lk.json(
            "-n", namespace, "get", "endpointslices", "-l", "kubernetes.io/service-name=web"
        )["items"]
        return {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}

    def upper_ip(name: str) -> str | None:
        status = kubectl.json("-n", namespace, "get", "pod", name).get("status") or {}
        return status.get("podIP") if status.get("phase") == "Running" else None

    address = "127.0.0.1"
    try:
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(service))
        with (
            local_test_address()
            if os.geteuid() == 0
            else contextlib.nullcontext(address) as address,
            mock_node(
                lower_cluster.cluster,
                lk,
                tmp_path / "lower-e",
                prefix="lower-e",
                mock_config={"cpu": "2", "memory": "2Gi", "pods": "10", "podCIDR": "10.245.9.0/24"},
                address=address,
                extra_args=("--disable-taint",),
            ) as extra,
        ):
            leaving = mirror.member(extra.name)
            wait_for(lambda: node_ready(kubectl, leaving), timeout=30, what=f"{leaving} Ready")
            kubectl("-n", namespace, "apply", "-f", "-", input=pod("web-leaving", leaving))
            ip_leaving = wait_for(lambda: upper_ip("web-leaving"), timeout=90, what="running")
            kubectl("-n", namespace, "apply", "-f", "-", input=pod("web-staying", staying))
            ip_staying = wait_for(lambda: upper_ip("web-staying"), timeout=90, what="running")
            wait_for(
                lambda: slice_addresses() == {ip_leaving, ip_staying},
                timeout=60,
                what="both members' replicas endpoints below",
            )
            copy = lower_web()
            assert copy is not None
            annotations = copy["metadata"]["annotations"]
            assert annotations["vkubelet.io/virtual-node"] == mirror.prefix, "the fleet's"
            assert "selector" not in copy["spec"]
            uid = copy["metadata"]["uid"]
            assert "LowerServiceConflict" not in mirror.agent.log()
            extra.agent.stop()
        # mock_node's exit deleted the lower node: the member leaves, its pod is evicted.

        def member_gone_and_service_kept() -> bool:
            current = lower_web()
            assert current is not None and current["metadata"]["uid"] == uid, "a gap below"
            gone = kubectl("get", "node", leaving, "--ignore-not-found", "-o", "name")
            return gone.stdout.strip() == "" and slice_addresses() == {ip_staying}

        wait_for(member_gone_and_service_kept, timeout=120, what=f"{leaving} gone, web kept")
        kubectl("-n", namespace, "delete", "pod", "web-staying", "--wait=false")
        # No member has a replica any more: deleted after the grace that lets a lone replica
        # move between members (the lab's sharedServiceGrace).
        wait_for(lambda: lower_web() is None, timeout=90, what="web deleted below")
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
