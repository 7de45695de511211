"""Issue 11's acceptance for scheduling across lower clusters, with real components: the upper
cluster (the session's), two lower dev clusters whose nodes are vkubelet mock nodes of uneven
sizes and zones, real kubectl, and ONE agent (`vkubelet run --config agent.yaml`) serving three
cluster-provider entries: an aggregate node of each lower cluster and a mirror fleet of the
first.

- Aggregate mode: 8 free CPUs spread 2+2+2+2 over four lower nodes: a 3-CPU pod fails fast with
  a reason naming cpu, four 2-CPU pods run.
- Mirror mode: the same 3-CPU pod is Pending upstairs with the upper scheduler's "Insufficient
  cpu" and never reaches a lower cluster; a zone spread spreads over the lower zones; a lower
  cordon is seen upstairs within 10 s.
- Two lower clusters: a Deployment spread over the cluster label lands on both; cordon + drain
  (PDB respected) of one virtual node moves the workload to the other, nothing left below.

Budget: the lower clusters and the agent start once for the module (the second lower cluster is
the session's `lower_cluster`, shared with the other cluster-provider modules); the scenarios
are folded into three tests that wait on conditions.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Iterator
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
    node_ready,
    wait_for,
)

from ..clusters import LowerCluster, LowerNodeSpec, existing_cluster, mock_nodes_in_one_agent

JSON = dict[str, Any]
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}
CLUSTER_LABEL = "vkubelet.io/cluster"
ZONE = "topology.kubernetes.io/zone"

# Uneven sizes; other owners' pods (the fillers below) leave exactly 2 CPUs free on each.
FRAGMENTED = (
    LowerNodeSpec("frag-a", {"cpu": "4", "memory": "8Gi"}, {ZONE: "a", "disk": "ssd"}),
    LowerNodeSpec("frag-b", {"cpu": "3", "memory": "6Gi"}, {ZONE: "b"}),
    LowerNodeSpec("frag-c", {"cpu": "2", "memory": "4Gi"}, {ZONE: "c"}),
    LowerNodeSpec("frag-d", {"cpu": "2", "memory": "4Gi"}, {ZONE: "c"}),
)
FILLERS = {"frag-a": "2", "frag-b": "1"}


@dataclass
class Fragmented:
    """The first lower cluster: four nodes with 2 free CPUs each."""

    kubectl: Kubectl
    kubeconfig: Path
    nodes: dict[str, str]  # prefix -> node name


@dataclass
class Agent:
    process: AgentProcess
    agg1: str  # aggregate node of the fragmented cluster
    agg2: str  # aggregate node of the session's lower cluster
    mirror_prefix: str  # the fleet mirroring the fragmented cluster

    def member(self, lower_node: str) -> str:
        return f"{self.mirror_prefix}-{lower_node}"


@pytest.fixture(scope="module")
def fragmented(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fragmented]:
    """`VKUBELET_FRAGMENTED_CLUSTER=NAME` reuses a running dev cluster (its mock nodes and
    fillers are still made here)."""
    workdir = tmp_path_factory.mktemp("fragmented")
    cluster = existing_cluster("VKUBELET_FRAGMENTED_CLUSTER")
    started = cluster is None
    if cluster is None:
        cluster = Cluster(f"frag-{uuid.uuid4().hex[:6]}", root=workdir / "state")
        cluster.up(progress=lambda m: print(f"[fragmented] {m}"), tie_to_parent=True)
    kubectl = Kubectl(cluster.kubeconfig)
    try:
        with mock_nodes_in_one_agent(cluster, kubectl, workdir, FRAGMENTED) as names:
            create_namespace(kubectl, "fillers")
            for prefix, cpu in FILLERS.items():
                filler = _pod(f"filler-{prefix}", cpu)
                filler["spec"]["nodeName"] = names[prefix]
                kubectl("-n", "fillers", "apply", "-f", "-", input=json.dumps(filler))
            wait_for(
                lambda: _phases(kubectl, "fillers") == ["Running"] * len(FILLERS),
                what="the fillers Running",
            )
            yield Fragmented(kubectl, cluster.kubeconfig, names)
            kubectl("delete", "namespace", "fillers", "--wait=false")
    finally:
        if started:
            cluster.down()


@pytest.fixture(scope="module")
def agent(
    kube_cluster: Cluster,
    kubectl: Kubectl,
    fragmented: Fragmented,
    lower_cluster: LowerCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Agent]:
    """One `vkubelet run --config agent.yaml` with three cluster-provider entries."""
    workdir = tmp_path_factory.mktemp("multi-agent")
    tag = uuid.uuid4().hex[:4]
    upper_id = f"multi-{tag}"
    lowers: dict[str, JSON] = {
        "frag.yaml": {
            "kubeconfig": str(fragmented.kubeconfig),
            "clusterName": "frag",
            "cannotFitBackoff": 2,
        },
        "frag-mirror.yaml": {
            "kubeconfig": str(fragmented.kubeconfig),
            "clusterName": "frag-mirror",
            "mode": "mirror",
        },
        "other.yaml": {"kubeconfig": str(lower_cluster.kubeconfig), "clusterName": "other"},
    }
    for file, config in lowers.items():
        (workdir / file).write_text(yaml.safe_dump({**config, "upperClusterID": upper_id}))
    agg1, agg2, prefix = f"vkx-{tag}-frag", f"vkx-{tag}-other", f"vkx-{tag}-m"
    entries = [(agg1, "frag.yaml"), (agg2, "other.yaml"), (prefix, "frag-mirror.yaml")]
    agent_yaml = {
        "certDir": "pki",
        "nodes": [
            {
                "name": name,
                "provider": "cluster",
                "providerConfig": file,
                "internalIP": "127.0.0.1",
                "kubeletPort": 0,
            }
            for name, file in entries
        ],
    }
    (workdir / "agent.yaml").write_text(yaml.safe_dump(agent_yaml))
    args = ["--config", str(workdir / "agent.yaml"), "--approve-own-csrs"]
    process = AgentProcess(kube_cluster.kubeconfig, args, workdir / "agent.log").start()
    found = Agent(process, agg1, agg2, prefix)
    members = [found.member(n) for n in fragmented.nodes.values()]
    try:
        for name in [found.agg1, found.agg2, *members]:
            wait_for(functools.partial(node_ready, kubectl, name), what=f"node {name} Ready")
        yield found
    finally:
        found.process.stop()
        for name in [found.agg1, found.agg2, *members]:
            kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
        print(found.process.log()[-6000:])


def _pod(name: str, cpu: str, **spec: Any) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "tolerations": [TOLERATION],
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example/web:1",
                    "resources": {"requests": {"cpu": cpu}},
                }
            ],
            **spec,
        },
    }


def _on_nodes(names: list[str]) -> JSON:
    term = {
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": names}]
    }
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
        }
    }


def _phases(kubectl: Kubectl, namespace: str, *selector: str) -> list[str]:
    pods = kubectl.json("-n", namespace, "get", "pods", *selector)["items"]
    return sorted(p["status"].get("phase", "") for p in pods)


def _pods(kubectl: Kubectl, namespace: str, *selector: str) -> list[JSON]:
    found: list[JSON] = kubectl.json("-n", namespace, "get", "pods", *selector)["items"]
    return found


def _apply(kubectl: Kubectl, namespace: str, obj: JSON) -> None:
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(obj))


def _clean(kubectl: Kubectl, lowers: list[Kubectl], namespace: str) -> None:
    """Delete the namespace upstairs and wait until its lower pods are gone (later tests need
    the lower room back)."""
    kubectl("delete", "namespace", namespace, "--wait=false")
    for lk in lowers:
        wait_for(
            functools.partial(_no_pods, lk, namespace),
            timeout=60,
            what=f"{namespace}'s lower pods gone",
        )
        lk("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def _deployment(name: str, replicas: int, cpu: str, spec: JSON) -> JSON:
    template = _pod(name, cpu, **spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": template["metadata"], "spec": template["spec"]},
        },
    }


def test_aggregate_fails_a_3_cpu_pod_over_2_free_cpus_per_node_naming_cpu_and_runs_four_2_cpu_pods(
    kubectl: Kubectl, fragmented: Fragmented, agent: Agent
) -> None:
    lk = fragmented.kubectl
    namespace = f"agg-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    try:
        node = kubectl.json("get", "node", agent.agg1)
        assert node["status"]["allocatable"]["cpu"] == "8", "2+2+2+2 free below"
        assert node["metadata"]["labels"][CLUSTER_LABEL] == "frag"
        wait_for(
            lambda: (
                json.loads(
                    kubectl.json("get", "node", agent.agg1)["metadata"]["annotations"].get(
                        "vkubelet.io/largest-free", "{}"
                    )
                ).get("cpu")
                == "2"
            ),
            what="largest-free cpu 2",
        )
        pinned = {"nodeSelector": {"kubernetes.io/hostname": agent.agg1}}
        _apply(kubectl, namespace, _pod("big", "3", **pinned))

        def failed() -> JSON | None:
            status: JSON = kubectl.json("-n", namespace, "get", "pod", "big")["status"]
            return status if status.get("phase") == "Failed" else None

        started = time.monotonic()
        status = wait_for(failed, timeout=30, what="the 3-CPU pod Failed")
        assert time.monotonic() - started < 15, "fails fast"
        assert status["reason"] == "LowerClusterCannotFit"
        assert "lacking cpu" in status["message"], status["message"]

        for i in range(4):
            _apply(kubectl, namespace, _pod(f"two-{i}", "2", **pinned))
        wait_for(
            lambda: [p for p in _phases(kubectl, namespace) if p == "Running"] == ["Running"] * 4,
            timeout=90,
            what="four 2-CPU pods Running",
        )
        below = _pods(lk, namespace)
        assert sorted(p["metadata"]["name"] for p in below) == [f"two-{i}" for i in range(4)]
        assert len({p["spec"]["nodeName"] for p in below}) == 4, "one per lower node"
    finally:
        _clean(kubectl, [lk], namespace)


def test_mirror_shows_the_real_shape_insufficient_cpu_upstairs_zone_spread_and_cordon(
    kubectl: Kubectl, fragmented: Fragmented, agent: Agent
) -> None:
    lk = fragmented.kubectl
    members = [agent.member(n) for n in fragmented.nodes.values()]
    # Fillers are not ours: each member offers its 2 free CPUs, and is labelled with its zone.
    wait_for(
        lambda: all(
            kubectl.json("get", "node", m)["status"]["allocatable"]["cpu"] == "2" for m in members
        ),
        timeout=30,
        what="2 CPUs offered by each mirrored node",
    )
    namespace = f"mir-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    try:
        _apply(kubectl, namespace, _pod("big", "3", affinity=_on_nodes(members)))

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

        spread = {
            "affinity": _on_nodes(members),
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": ZONE,
                    "whenUnsatisfiable": "DoNotSchedule",
                    "labelSelector": {"matchLabels": {"app": "spread"}},
                }
            ],
        }
        _apply(kubectl, namespace, _deployment("spread", 3, "1", spread))

        def running_below() -> list[JSON] | None:
            ok = [
                p
                for p in _pods(lk, namespace, "-l", "app=spread")
                if p["status"].get("phase") == "Running"
            ]
            return ok if len(ok) == 3 else None

        below = wait_for(running_below, timeout=90, what="3 spread pods Running below")
        zones = sorted(
            lk.json("get", "node", p["spec"]["nodeName"])["metadata"]["labels"][ZONE] for p in below
        )
        assert zones == ["a", "b", "c"]

        # A cordon below is a cordon upstairs within 10 s.
        victim = fragmented.nodes["frag-b"]
        lk("cordon", victim)
        try:
            started = time.monotonic()
            wait_for(
                lambda: (
                    kubectl.json("get", "node", agent.member(victim))["spec"].get("unschedulable")
                    is True
                ),
                timeout=10,
                what="the cordon upstairs within 10 s",
            )
            print(f"cordon seen upstairs after {time.monotonic() - started:.1f}s")
        finally:
            lk("uncordon", victim)
        wait_for(
            lambda: (
                not kubectl.json("get", "node", agent.member(victim))["spec"].get("unschedulable")
            ),
            timeout=10,
            what="the uncordon upstairs",
        )
        # The 3-CPU pod never went below, over the whole scenario (tens of seconds).
        assert unschedulable() is not None
        assert "big" not in {p["metadata"]["name"] for p in _pods(lk, namespace)}
    finally:
        _clean(kubectl, [lk], namespace)


def test_two_lower_clusters_spread_over_the_cluster_label_and_drain_moves_all_to_the_other(
    kubectl: Kubectl, fragmented: Fragmented, lower_cluster: LowerCluster, agent: Agent
) -> None:
    lowers = {"frag": fragmented.kubectl, "other": lower_cluster.kubectl}
    labels = {
        name: kubectl.json("get", "node", name)["metadata"]["labels"][CLUSTER_LABEL]
        for name in (agent.agg1, agent.agg2)
    }
    assert labels == {agent.agg1: "frag", agent.agg2: "other"}
    namespace = f"two-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    spec = {
        "affinity": _on_nodes([agent.agg1, agent.agg2]),
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": CLUSTER_LABEL,
                "whenUnsatisfiable": "DoNotSchedule",
                # A cordoned (drained) cluster's node carries the unschedulable taint: leave it
                # out of the domains, so its emptiness does not hold the others back.
                "nodeTaintsPolicy": "Honor",
                "labelSelector": {"matchLabels": {"app": "web"}},
            }
        ],
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "web"},
        "spec": {"minAvailable": 3, "selector": {"matchLabels": {"app": "web"}}},
    }
    try:
        _apply(kubectl, namespace, pdb)
        _apply(kubectl, namespace, _deployment("web", 4, "100m", spec))

        def placed() -> dict[str, int] | None:
            pods = _pods(kubectl, namespace, "-l", "app=web")
            running = [p for p in pods if p["status"].get("phase") == "Running"]
            if len(running) != 4 or len(pods) != 4:
                return None
            counts: dict[str, int] = {}
            for p in running:
                counts[labels[p["spec"]["nodeName"]]] = (
                    counts.get(labels[p["spec"]["nodeName"]], 0) + 1
                )
            return counts

        assert wait_for(placed, timeout=90, what="4 web pods Running") == {"frag": 2, "other": 2}
        for cluster, lk in lowers.items():
            assert len(_pods(lk, namespace)) == 2, f"2 lower pods in {cluster}"

        kubectl("cordon", agent.agg1)
        kubectl(
            "drain",
            agent.agg1,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=150s",
            timeout=180,
        )
        wait_for(
            lambda: placed() == {"other": 4}, timeout=90, what="all 4 web pods Running on other"
        )
        wait_for(
            lambda: not _pods(lowers["frag"], namespace),
            timeout=30,
            what="no pod left behind in the drained lower cluster",
        )
        assert (
            len(
                [
                    p
                    for p in _pods(lowers["other"], namespace)
                    if p["status"].get("phase") == "Running"
                ]
            )
            == 4
        )
    finally:
        kubectl("uncordon", agent.agg1)
        _clean(kubectl, list(lowers.values()), namespace)


def _no_pods(kubectl: Kubectl, namespace: str) -> bool:
    return not _pods(kubectl, namespace)
