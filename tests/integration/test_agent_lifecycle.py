"""The agent process as a new user meets it on a real control plane: the kubelet API works on a
dev cluster with no manual step, the node says why it is not Ready while its serving CSR waits,
a certificate from another cluster is never served, and SIGTERM closes the provider."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    local_test_address,
    node_ready,
    running_pod,
    wait_for,
)

MARKER = ("-n", "kube-public", "configmap", "vkubelet-dev-cluster")


@pytest.fixture(scope="module")
def dev_cluster_marker(kube_cluster: Cluster, kubectl: Kubectl) -> Iterator[None]:
    """The marker `vkubelet dev cluster up` creates (made here if this cluster predates it)."""
    exists = kubectl("get", *MARKER, check=False).returncode == 0
    if not exists:
        kubectl("create", *MARKER, f"--from-literal=name={kube_cluster.name}")
    yield
    if not exists:
        kubectl("delete", *MARKER, "--ignore-not-found")


def agent(
    cluster: Cluster, tmp_path: Path, node: str, address: str, *args: str, provider: str = "mock"
) -> AgentProcess:
    (tmp_path / "mock.json").write_text(json.dumps({node: {"pods": "10"}}))
    return AgentProcess(
        cluster.kubeconfig,
        [
            "--provider",
            provider,
            "--provider-config",
            str(tmp_path / "mock.json"),
            "--nodename",
            node,
            "--internal-ip",
            address,
            "--kubelet-port",
            "0",
            *args,
        ],
        tmp_path / "agent.log",
    ).start()


def ready_condition(kubectl: Kubectl, node: str) -> dict[str, Any]:
    result = kubectl("get", "node", node, "-o", "json", check=False)
    if result.returncode != 0:
        return {}
    conditions = json.loads(result.stdout)["status"].get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), {})


def logs_and_exec_work(kubectl: Kubectl, node: str) -> None:
    pod = running_pod(kubectl, node)
    try:
        assert f"mock: container main of default/{pod} started" in kubectl("logs", pod).stdout
        assert kubectl("exec", pod, "--", "echo", "hi").stdout == "hi\n"
    finally:
        kubectl("delete", "pod", pod, "--wait=false")


def test_on_a_dev_cluster_logs_and_exec_work_with_no_manual_step(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path, dev_cluster_marker: None
) -> None:
    node = f"vk-auto-{uuid.uuid4().hex[:6]}"
    with local_test_address() as address:
        process = agent(kube_cluster, tmp_path, node, address, "--cert-dir", str(tmp_path / "pki"))
        try:
            wait_for(lambda: node_ready(kubectl, node), timeout=60, what="node Ready")
            # Ready means the kubelet API answers: no wait for "listening" needed.
            logs_and_exec_work(kubectl, node)
            assert "approving our own serving CSRs" in process.log()
        finally:
            process.stop()
            kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")


def test_the_node_says_why_its_kubelet_api_waits_until_an_admin_approves_the_csr(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    node = f"vk-wait-{uuid.uuid4().hex[:6]}"
    with local_test_address() as address:
        process = agent(
            kube_cluster,
            tmp_path,
            node,
            address,
            "--no-approve-own-csrs",
            "--cert-dir",
            str(tmp_path / "pki"),
        )
        try:
            condition = wait_for(
                lambda: (
                    (c := ready_condition(kubectl, node)).get("reason") == "KubeletAPINotServing"
                    and "certificate approve" in c.get("message", "")
                    and c
                ),
                what="NotReady with the reason",
            )
            assert condition["status"] == "False"
            csr = condition["message"].split("kubectl certificate approve ")[1].rstrip(")")
            warning = f"kubectl certificate approve {csr}"
            wait_for(
                lambda: any(
                    "WARNING" in line and warning in line for line in process.log().splitlines()
                ),
                what="a warning with the command",
            )
            assert ready_condition(kubectl, node)["status"] == "False"  # still, while pending
            kubectl("certificate", "approve", csr)
            wait_for(lambda: node_ready(kubectl, node), timeout=60, what="Ready once approved")
            logs_and_exec_work(kubectl, node)
        finally:
            process.stop()
            kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")


def test_a_stored_certificate_from_another_cluster_is_replaced_not_served(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path, dev_cluster_marker: None
) -> None:
    """The state a `dev cluster down && up` (or a new cluster) leaves: a valid-looking serving
    certificate in the cert dir, signed by a CA this cluster does not know."""

    from vkubelet.node._certs import cluster_cert_dir

    from ..unit.agent.pki import TestCA

    node = f"vk-cert-{uuid.uuid4().hex[:6]}"
    with local_test_address() as address:
        pki = tmp_path / "pki"
        current = cluster_cert_dir(
            pki, (kube_cluster.pki / "ca.crt").read_bytes(), kube_cluster.server
        )
        TestCA("another cluster").issue(
            current / f"{node}-serving.crt",
            current / f"{node}-serving.key",
            name=node,
            addresses=[address, node],
        )
        process = agent(kube_cluster, tmp_path, node, address, "--cert-dir", str(pki))
        try:
            wait_for(lambda: node_ready(kubectl, node), timeout=60, what="node Ready")
            assert "not signed by the current cluster's CA" in process.log()
            logs_and_exec_work(kubectl, node)
        finally:
            process.stop()
            kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")


PROVIDER = """
from pathlib import Path

from vkubelet.providers.mock import create as create_mock


class Recording:
    def __init__(self, inner, marker):
        self._inner, self._marker = inner, marker

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def aclose(self):
        with self._marker.open("a") as f:
            f.write("closed\\n")


def make(context):
    return Recording(create_mock(context), Path(__file__).with_suffix(".closed"))
"""


def test_sigterm_stops_the_agent_and_closes_its_provider_once(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    node = f"vk-term-{uuid.uuid4().hex[:6]}"
    provider = tmp_path / "recording.py"
    provider.write_text(PROVIDER)
    process = agent(
        kube_cluster,
        tmp_path,
        node,
        "127.0.0.1",
        "--no-kubelet-api",
        provider=f"{provider}:make",
    )
    try:
        wait_for(lambda: node_ready(kubectl, node), timeout=60, what="node Ready")
        assert process.proc is not None
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(timeout=30) == 0
        assert provider.with_suffix(".closed").read_text() == "closed\n"
    finally:
        process.stop()
        kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")


def _cli(*args: str) -> None:
    exe = Path(sys.prefix) / "bin" / "vkubelet"
    subprocess.run([str(exe), *args], check=True, capture_output=True, timeout=600)


def test_after_dev_cluster_down_and_up_logs_and_exec_still_work_with_the_default_cert_dir(
    tmp_path: Path,
) -> None:
    """The acceptance of issue 9: a new cluster of the same name has a new CA; the serving
    certificate the agent stored for the old one (under the default --cert-dir) is not reused."""
    from vkubelet.node import AgentConfig
    from vkubelet.node._certs import cluster_cert_dir

    name = f"vkt-{uuid.uuid4().hex[:6]}"
    node = f"vk-again-{uuid.uuid4().hex[:6]}"
    cluster = Cluster(name)
    default_dir = AgentConfig(nodes=[]).cert_dir
    used: list[Path] = []
    try:
        with local_test_address() as address:
            for round_ in ("first", "second"):
                _cli("dev", "cluster", "up", "--name", name)
                kubectl = Kubectl(cluster.kubeconfig)
                if kubectl("get", *MARKER, check=False).returncode != 0:
                    kubectl("create", *MARKER, f"--from-literal=name={name}")
                ca = (cluster.pki / "ca.crt").read_bytes()
                used.append(cluster_cert_dir(default_dir, ca, cluster.server))
                workdir = tmp_path / round_
                workdir.mkdir()
                process = agent(cluster, workdir, node, address)  # no --cert-dir: the default
                try:
                    wait_for(partial(node_ready, kubectl, node), timeout=90, what="node Ready")
                    logs_and_exec_work(kubectl, node)
                finally:
                    process.stop()
                if round_ == "first":
                    _cli("dev", "cluster", "down", "--name", name)
        assert used[0] != used[1]
    finally:
        _cli("dev", "cluster", "down", "--name", name)
        for directory in used:
            shutil.rmtree(directory, ignore_errors=True)
