"""The kubelet API of a virtual node, reached the way users reach it: kubectl through the real
apiserver, and direct HTTPS requests to check authentication and authorization."""

from __future__ import annotations

import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    Kubectl,
    MockNode,
    create_namespace,
    running_pod,
)


def kubelet_port(node: MockNode, kubectl: Kubectl) -> int:
    status = kubectl.json("get", "node", node.name)["status"]
    return int(status["daemonEndpoints"]["kubeletEndpoint"]["Port"])


@pytest.fixture(scope="module")
def kubelet_node(api_node: MockNode) -> MockNode:
    return api_node


@pytest.fixture(scope="module")
def pod(kubelet_node: MockNode, kubectl: Kubectl) -> Iterator[str]:
    name = running_pod(kubectl, kubelet_node.name)
    yield name
    kubectl("delete", "pod", name, "--wait=false")


def test_kubectl_logs_reaches_the_provider_through_the_apiserver(
    pod: str, kubectl: Kubectl
) -> None:
    logs = kubectl("logs", pod).stdout
    assert f"mock: container main of default/{pod} started" in logs
    tail = kubectl("logs", pod, "--tail=1").stdout.splitlines()
    assert len(tail) == 1
    stamped = kubectl("logs", pod, "--timestamps", "--tail=1").stdout
    assert stamped[:4].isdigit() and "T" in stamped.split()[0]


def test_kubectl_logs_follow_streams_lines_as_they_come(pod: str, kubectl: Kubectl) -> None:
    follow = subprocess.Popen(
        [kubectl.binary, "--kubeconfig", str(kubectl.kubeconfig), "logs", "-f", pod],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert follow.stdout is not None
        seen: list[tuple[float, str]] = []
        while len([line for _, line in seen if "tick" in line]) < 2:
            line = follow.stdout.readline()
            assert line, "the follow stream ended early"
            seen.append((time.monotonic(), line))
        ticks = [t for t, line in seen if "tick" in line]
        # Flushed one by one while following: the second tick came about a second later.
        assert ticks[1] - ticks[0] > 0.5
    finally:
        follow.terminate()
        follow.wait(10)


def test_kubectl_logs_since_filters_by_time(pod: str, kubectl: Kubectl) -> None:
    assert "started" in kubectl("logs", pod, "--since=1h").stdout
    time.sleep(2)
    assert "started" not in kubectl("logs", pod, "--since=1s").stdout


def test_logs_of_an_unknown_container_are_a_clear_error(pod: str, kubectl: Kubectl) -> None:
    result = kubectl("logs", pod, "-c", "nope", check=False)
    assert result.returncode != 0
    assert "nope" in result.stderr


def test_logs_of_a_previous_container_show_the_providers_message(
    pod: str, kubectl: Kubectl
) -> None:
    """The node answers 400 as a kubelet does, so the apiserver passes the message on."""
    result = kubectl("logs", pod, "--previous", check=False)
    assert result.returncode != 0
    assert "(BadRequest)" in result.stderr
    assert f'previous terminated container "main" in pod "{pod}" not found' in result.stderr


def test_node_proxy_reaches_the_kubelet_api(kubelet_node: MockNode, kubectl: Kubectl) -> None:
    base = f"/api/v1/nodes/{kubelet_node.name}/proxy"
    assert kubectl("get", "--raw", f"{base}/healthz").stdout.strip() == "ok"
    pods = json.loads(kubectl("get", "--raw", f"{base}/pods").stdout)
    assert pods["kind"] == "PodList"


def _get(url: str, context: ssl.SSLContext, token: str | None = None) -> int:
    request = urllib.request.Request(url)  # noqa: S310 - https to our own test node
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:  # noqa: S310
            status: int = response.status
            return status
    except urllib.error.HTTPError as e:
        return e.code


def test_direct_requests_are_authenticated_and_authorized(
    kube_cluster: Cluster, kubelet_node: MockNode, kubectl: Kubectl, tmp_path: Path
) -> None:
    port = kubelet_port(kubelet_node, kubectl)
    url = f"https://{kubelet_node.address}:{port}/pods"
    anonymous = ssl.create_default_context(cafile=str(kube_cluster.pki / "ca.crt"))
    anonymous.check_hostname = False  # the certificate names the node's IP; we are testing auth
    assert _get(url, anonymous) == 401

    ns = f"t-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, ns)
    kubectl("-n", ns, "create", "serviceaccount", "nobody")
    token = kubectl("-n", ns, "create", "token", "nobody").stdout.strip()
    assert _get(url, anonymous, token) == 403

    apiserver = ssl.create_default_context(cafile=str(kube_cluster.pki / "ca.crt"))
    apiserver.check_hostname = False
    apiserver.load_cert_chain(
        kube_cluster.pki / "apiserver-kubelet-client.crt",
        kube_cluster.pki / "apiserver-kubelet-client.key",
    )
    assert _get(url, apiserver) == 200
    kubectl("delete", "namespace", ns, "--wait=false")


def test_the_serving_certificate_came_from_an_approved_csr(
    kubelet_node: MockNode, kubectl: Kubectl
) -> None:
    csrs: list[dict[str, Any]] = kubectl.json("get", "csr")["items"]
    ours = [
        c for c in csrs if c["metadata"]["name"].startswith(f"vkubelet-serving-{kubelet_node.name}")
    ]
    assert ours and ours[0]["spec"]["signerName"] == "kubernetes.io/kubelet-serving"
    assert ours[0]["status"].get("certificate")
