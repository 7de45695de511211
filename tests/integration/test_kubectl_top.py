"""`kubectl top` and node-proxy paths on a dev cluster, out of the box: metrics-server (a component
of the cluster, registered with the aggregator) scrapes a mock node's kubelet API at the node's
address, and the apiserver proxies `nodes/<name>/proxy/...` to a non-loopback node address."""

import json
import os
import re
from pathlib import Path

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    Kubectl,
    MockNode,
    mock_node,
    running_pod,
    wait_for,
)

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="a non-loopback node address needs root (a veth)"
)


@pytest.fixture(scope="module")
def node(api_node: MockNode) -> MockNode:
    """The shared mock node (conftest.py): metrics-server dials its address, loopback or not;
    only the apiserver's node proxy refuses loopback."""
    return api_node


@pytest.fixture(scope="module")
def pod(node: MockNode, kubectl: Kubectl) -> str:
    return running_pod(kubectl, node.name)


def _top(kubectl: Kubectl, *args: str) -> list[str] | None:
    """The figures of `kubectl top <args>` (name, CPU, ..., memory) once it has them."""
    result = kubectl("top", *args, "--no-headers", check=False)
    if result.returncode != 0:
        return None  # "metrics not available yet" until metrics-server has scraped twice
    return result.stdout.split()


def _millicores(text: str) -> int:
    match = re.fullmatch(r"(\d+)m", text)
    assert match, f"not a CPU figure: {text!r}"
    return int(match.group(1))


def _mebibytes(text: str) -> int:
    match = re.fullmatch(r"(\d+)Mi", text)
    assert match, f"not a memory figure: {text!r}"
    return int(match.group(1))


def test_metrics_api_is_registered_and_available(kube_cluster: Cluster, kubectl: Kubectl) -> None:
    service = kubectl.json("get", "apiservice", "v1beta1.metrics.k8s.io")
    conditions = {c["type"]: c["status"] for c in service["status"]["conditions"]}
    assert conditions["Available"] == "True"
    assert "metrics-server" in kube_cluster.running_components()


def test_kubectl_top_pod_reports_the_pods_usage(node: MockNode, pod: str, kubectl: Kubectl) -> None:
    figures = wait_for(
        lambda: _top(kubectl, "pod", pod), timeout=120, interval=2, what=f"kubectl top pod {pod}"
    )
    name, cpu, memory = figures
    assert name == pod
    # The mock's usage of a container: 5-200m CPU, 16-256 MiB, constant for its life.
    assert 5 <= _millicores(cpu) <= 200
    assert 16 <= _mebibytes(memory) <= 256


def test_kubectl_top_node_reports_the_nodes_usage(
    node: MockNode, pod: str, kubectl: Kubectl
) -> None:
    figures = wait_for(
        lambda: _top(kubectl, "node", node.name),
        timeout=120,
        interval=2,
        what=f"kubectl top node {node.name}",
    )
    name, cpu, cpu_percent, memory, memory_percent = figures
    assert name == node.name
    # The node's own 50m and 256 MiB plus its pods'.
    assert _millicores(cpu) >= 50
    assert _mebibytes(memory) >= 256
    assert re.fullmatch(r"\d+%", cpu_percent) and re.fullmatch(r"\d+%", memory_percent)


@NEEDS_ROOT
def test_node_proxy_serves_the_kubelet_summary_that_top_agrees_with(
    node: MockNode, pod: str, kubectl: Kubectl
) -> None:
    assert not node.address.startswith("127.")
    path = f"/api/v1/nodes/{node.name}/proxy/stats/summary"
    summary = json.loads(kubectl("get", "--raw", path).stdout)
    assert summary["node"]["nodeName"] == node.name
    [entry] = [p for p in summary["pods"] if p["podRef"]["name"] == pod]

    # metrics-server read the same kubelet: `top` shows the mock's constant rate and working set
    # (CPU is a rate over two scrapes, so allow a millicore of rounding).
    figures = wait_for(lambda: _top(kubectl, "pod", pod), timeout=120, interval=2, what="top")
    assert abs(_millicores(figures[1]) - entry["cpu"]["usageNanoCores"] / 1e6) <= 1
    assert _mebibytes(figures[2]) == entry["memory"]["workingSetBytes"] // 2**20

    metrics = kubectl("get", "--raw", f"/api/v1/nodes/{node.name}/proxy/metrics/resource").stdout
    assert f'pod="{pod}"' in metrics


def test_node_proxy_paths_are_refused_for_a_loopback_node(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    """Why the demo and this module give nodes another address: the apiserver's own rule."""
    with mock_node(kube_cluster, kubectl, tmp_path, prefix="vk-loop") as loop:
        result = kubectl("get", "--raw", f"/api/v1/nodes/{loop.name}/proxy/healthz", check=False)
    assert result.returncode != 0
    assert "address not allowed" in result.stderr, result.stderr
