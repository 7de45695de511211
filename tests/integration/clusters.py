"""A second, "lower" dev cluster for the cluster provider's integration tests.

The cluster provider makes a whole lower cluster appear as one node of the upper cluster (the
`kube_cluster` fixture). Its tests need a lower cluster whose scheduler has real choices: a few
vkubelet mock nodes with different capacities and labels, untainted so that ordinary pods land on
them. Starting one costs tens of seconds, so it is made once per test session and torn down at
its end. `VKUBELET_LOWER_CLUSTER=NAME` reuses a running `vkubelet dev cluster up --name NAME`
instead (its mock nodes are still started and stopped by the session).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vkubelet.devcluster import Cluster, list_clusters
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    MockNode,
    local_test_address,
    mock_node,
    node_ready,
    start_agent,
    wait_for,
)

__all__ = [
    "LOWER_NODES",
    "TOLERATION",
    "ClusterNode",
    "LowerCluster",
    "LowerNodeSpec",
    "lower_as_virtual_node",
    "lower_cluster_session",
    "mock_nodes_in_one_agent",
    "restart_clients_of_the_apiserver",
]


#: Lets an upper pod onto a virtual node (they carry the provider taint).
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}


@dataclass
class ClusterNode:
    """An agent of the cluster provider, a node of the upper cluster."""

    name: str
    agent: AgentProcess


@dataclass(frozen=True)
class LowerNodeSpec:
    prefix: str
    capacity: dict[str, Any]
    labels: dict[str, str]


# Different sizes and one zone each; a region they all share (published on the virtual node).
LOWER_NODES = (
    LowerNodeSpec(
        "lower-a",
        {"cpu": "4", "memory": "8Gi", "pods": "30", "others": {"example.com/gpu": "2"}},
        {"topology.kubernetes.io/region": "eu", "topology.kubernetes.io/zone": "a", "disk": "ssd"},
    ),
    LowerNodeSpec(
        "lower-b",
        {"cpu": "2", "memory": "4Gi", "pods": "20"},
        {"topology.kubernetes.io/region": "eu", "topology.kubernetes.io/zone": "b", "disk": "hdd"},
    ),
    LowerNodeSpec(
        "lower-c",
        {"cpu": "1", "memory": "2Gi", "pods": "10"},
        {"topology.kubernetes.io/region": "eu", "topology.kubernetes.io/zone": "c"},
    ),
)


@dataclass
class LowerCluster:
    """The lower cluster, admin kubectl for it, and its mock nodes by prefix."""

    cluster: Cluster
    kubectl: Kubectl
    nodes: dict[str, MockNode]

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    def node(self, prefix: str) -> MockNode:
        return self.nodes[prefix]

    def all_ready(self) -> bool:
        return all(node_ready(self.kubectl, n.name) for n in self.nodes.values())


def restart_clients_of_the_apiserver(cluster: Cluster, *, tie_to_parent: bool) -> None:
    """Restart the scheduler and controller-manager after a test stopped and started the
    apiserver, so that the tests after it find a whole control plane.

    Their client-go watches back off while the apiserver is away and resume late: measured here
    after a 20 s outage, a new namespace got its ServiceAccount after 16 s and a pod its first
    scheduling attempt after 46 s, which the next tests spent waiting. Fresh processes are back
    in ~2 s. The agent under test is not restarted: what it does through the outage is the test.
    (Not metrics-server: restarted too, the next module's first test took 124 s instead of ~5 s
    in one run, likely kubectl's discovery failing on its aggregated API while it started.)
    """
    for component in ("kube-controller-manager", "kube-scheduler"):
        cluster.stop_component(component)
        cluster.start_component(component, tie_to_parent=tie_to_parent)


@contextlib.contextmanager
def mock_nodes_in_one_agent(
    cluster: Cluster, kubectl: Kubectl, workdir: Path, specs: tuple[LowerNodeSpec, ...]
) -> Iterator[dict[str, str]]:
    """Several untainted mock nodes served by one `vkubelet run --config` process (one start
    and one process instead of one per node: the modules that need no `kubectl top` from the
    lower nodes use this). Yields node name by prefix; stops the agent and deletes the Nodes."""
    workdir.mkdir(parents=True, exist_ok=True)
    names = {spec.prefix: f"{spec.prefix}-{uuid.uuid4().hex[:6]}" for spec in specs}
    (workdir / "mock.json").write_text(
        json.dumps({names[s.prefix]: {"pods": "500", **s.capacity} for s in specs})
    )
    nodes = [
        {
            "name": names[s.prefix],
            "provider": "mock",
            "providerConfig": "mock.json",
            "internalIP": "127.0.0.1",
            "kubeletPort": 0,
            "labels": s.labels,
            "taints": [],
        }
        for s in specs
    ]
    (workdir / "agent.yaml").write_text(yaml.safe_dump({"certDir": "pki", "nodes": nodes}))
    args = ["--config", str(workdir / "agent.yaml"), "--approve-own-csrs"]
    agent = AgentProcess(cluster.kubeconfig, args, workdir / "agent.log").start()
    try:
        for name in names.values():
            wait_for(
                functools.partial(node_ready, kubectl, name), timeout=60, what=f"node {name} Ready"
            )
        yield names
    finally:
        agent.stop()
        for name in names.values():
            kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")


def existing_cluster(variable: str) -> Cluster | None:
    """The running dev cluster named by the environment variable, if set."""
    reuse = os.environ.get(variable)
    if not reuse:
        return None
    existing = {c.name: c for c in list_clusters()}
    if reuse not in existing or not existing[reuse].is_up():
        raise RuntimeError(f"{variable}={reuse}: no such cluster is up")
    return existing[reuse]


@contextlib.contextmanager
def lower_cluster_session(
    workdir: Path, specs: tuple[LowerNodeSpec, ...] = LOWER_NODES
) -> Iterator[LowerCluster]:
    """Start (or reuse) the lower cluster and its mock nodes; stop what was started at the end."""
    with contextlib.ExitStack() as stack:
        reused = existing_cluster("VKUBELET_LOWER_CLUSTER")
        if reused is not None:
            cluster = reused
        else:
            cluster = Cluster(f"lower-{os.getpid()}", root=workdir / "state")
            cluster.up(
                progress=lambda m: print(f"[lower] {m}", file=sys.stderr, flush=True),
                tie_to_parent=True,
                extra_args={"kube-controller-manager": ["--node-monitor-grace-period=20s"]},
            )
            stack.callback(cluster.down)
        kubectl = Kubectl(cluster.kubeconfig)
        nodes: dict[str, MockNode] = {}
        for spec in specs:
            labels = [arg for k, v in spec.labels.items() for arg in ("--label", f"{k}={v}")]
            # The apiserver proxies nodes/<name>/proxy/... (stats for `kubectl top`) only to
            # non-loopback addresses; making one needs root.
            address = (
                stack.enter_context(local_test_address()) if os.geteuid() == 0 else "127.0.0.1"
            )
            nodes[spec.prefix] = stack.enter_context(
                mock_node(
                    cluster,
                    kubectl,
                    workdir / spec.prefix,
                    prefix=spec.prefix,
                    mock_config=spec.capacity,
                    address=address,
                    extra_args=("--disable-taint", *labels),
                )
            )
        yield LowerCluster(cluster, kubectl, nodes)


@contextlib.contextmanager
def lower_as_virtual_node(
    upper: Cluster,
    upper_kubectl: Kubectl,
    lower: Cluster,
    workdir: Path,
    name: str,
    settings: dict[str, Any] | None = None,
) -> Iterator[ClusterNode]:
    """A cluster-provider agent on this machine making `lower` the node `name` of `upper`,
    Ready; `settings` are added to its provider config. Stopped, its node deleted and its log
    tail printed (for a failed test's report) at the end."""
    config = workdir / "lower.yaml"
    config.write_text(yaml.safe_dump({"kubeconfig": str(lower.kubeconfig), **(settings or {})}))
    agent = start_agent(
        upper, workdir, provider="cluster", config=config, name=name, address="127.0.0.1"
    )
    try:
        wait_for(lambda: node_ready(upper_kubectl, name), timeout=90, what=f"node {name} Ready")
        yield ClusterNode(name, agent)
    finally:
        agent.stop()
        upper_kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
        print(agent.log()[-8000:])
