"""Least privilege: the agent runs as system:node:<name>, under the Node authorizer and the
NodeRestriction admission plugin, with no RBAC grant of its own."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    local_test_address,
    node_kubeconfig,
    node_ready,
    wait_for,
)


def approve_serving_csrs(kubectl: Kubectl, node: str, stop: threading.Event) -> None:
    """The cluster operator's part: a node identity cannot approve its own serving CSR."""
    while not stop.wait(0.5):
        for csr in kubectl.json("get", "csr")["items"]:
            name = csr["metadata"]["name"]
            if name.startswith(f"vkubelet-serving-{node}") and not csr.get("status", {}).get(
                "conditions"
            ):
                kubectl("certificate", "approve", name, check=False)


def test_agent_runs_pods_and_serves_logs_as_a_node_identity(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    node = f"vk-ident-{uuid.uuid4().hex[:6]}"
    kubeconfig = node_kubeconfig(kube_cluster, kubectl, node, tmp_path / "node.kubeconfig")
    (tmp_path / "mock.json").write_text(json.dumps({node: {"pods": "10"}}))
    stop = threading.Event()
    approver = threading.Thread(target=approve_serving_csrs, args=(kubectl, node, stop))
    approver.start()
    with local_test_address() as address:
        agent = AgentProcess(
            kubeconfig,
            [
                "--provider",
                "mock",
                "--provider-config",
                str(tmp_path / "mock.json"),
                "--nodename",
                node,
                "--internal-ip",
                address,
                "--kubelet-port",
                "0",
                "--cert-dir",
                str(tmp_path / "pki"),
            ],
            tmp_path / "agent.log",
        ).start()
        try:
            wait_for(lambda: node_ready(kubectl, node), timeout=60, what="node Ready")
            labels = kubectl.json("get", "node", node)["metadata"]["labels"]
            assert labels["type"] == "virtual-kubelet"
            assert "kubernetes.io/role" not in labels  # NodeRestriction forbids it to nodes
            ns = f"t-{uuid.uuid4().hex[:6]}"
            create_namespace(kubectl, ns)
            kubectl("-n", ns, "create", "configmap", "cfg", "--from-literal=k=v")
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p"},
                "spec": {
                    "nodeName": node,
                    "containers": [
                        {
                            "name": "c",
                            "image": "x",
                            "env": [
                                {
                                    "name": "K",
                                    "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}},
                                }
                            ],
                        }
                    ],
                },
            }
            kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(pod))
            wait_for(
                lambda: (
                    kubectl.json("-n", ns, "get", "pod", "p")["status"].get("phase") == "Running"
                ),
                what="pod Running (ConfigMap, token and status written as the node)",
            )
            wait_for(lambda: "listening on port" in agent.log(), timeout=60, what="kubelet API")
            assert "mock: image x" in kubectl("-n", ns, "logs", "p").stdout
            kubectl("-n", ns, "delete", "pod", "p", "--timeout=30s")
            problems = [
                line
                for line in agent.log().splitlines()
                if ("WARNING" in line or "ERROR" in line) and "orbidden" in line
            ]
            assert not problems, problems
            kubectl("delete", "namespace", ns, "--wait=false")
        finally:
            stop.set()
            approver.join()
            agent.stop()
            kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")


def test_agent_bootstraps_its_node_identity_from_a_bootstrap_token(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    node = f"vk-boot-{uuid.uuid4().hex[:6]}"
    bootstrap = kube_cluster.bootstrap_kubeconfig(tmp_path / "bootstrap.kubeconfig")
    node_config = tmp_path / "node.kubeconfig"
    (tmp_path / "mock.json").write_text(json.dumps({node: {"pods": "10"}}))
    stop = threading.Event()
    approver = threading.Thread(target=approve_serving_csrs, args=(kubectl, node, stop))
    approver.start()
    agent = AgentProcess(
        node_config,
        [
            "--bootstrap-kubeconfig",
            str(bootstrap),
            "--provider",
            "mock",
            "--provider-config",
            str(tmp_path / "mock.json"),
            "--nodename",
            node,
            "--kubelet-port",
            "0",
            "--cert-dir",
            str(tmp_path / "pki"),
        ],
        tmp_path / "agent.log",
    ).start()
    try:
        wait_for(lambda: node_ready(kubectl, node), timeout=90, what="node Ready")
        whoami = Kubectl(node_config)("auth", "whoami", "-o", "json").stdout
        assert json.loads(whoami)["status"]["userInfo"]["username"] == f"system:node:{node}"
        client_csrs = [
            c
            for c in kubectl.json("get", "csr")["items"]
            if c["metadata"]["name"].startswith(f"vkubelet-client-{node}")
        ]
        assert client_csrs
        conditions = client_csrs[0]["status"]["conditions"]
        assert conditions[0]["type"] == "Approved"  # by the controller-manager, not by us
        assert client_csrs[0]["spec"]["username"].startswith("system:bootstrap:")
        # A restart reuses the certificate: no second client CSR.
        agent.stop()
        agent.start()
        wait_for(lambda: "reusing the client certificate" in agent.log(), what="reuse")
        again = [
            c
            for c in kubectl.json("get", "csr")["items"]
            if c["metadata"]["name"].startswith(f"vkubelet-client-{node}")
        ]
        assert len(again) == 1
    finally:
        stop.set()
        approver.join()
        agent.stop()
        kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")
