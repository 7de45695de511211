"""`vkubelet run --provider cluster` end to end: a whole lower dev cluster as one node of the upper
dev cluster, with the real agent, real kubectl on both sides."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import signal
import socket
import socketserver
import threading
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
    port_forward,
    start_agent,
    wait_for,
)

from .clusters import LowerCluster


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A TCP echo server on 127.0.0.1 (a thread: test scaffolding), yielding its port."""

    class Echo(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                self.wfile.write(line)

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()


JSON = dict[str, Any]
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}


@dataclass
class ClusterNode:
    name: str
    agent: AgentProcess


@pytest.fixture
def cluster_node(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> Iterator[ClusterNode]:
    name = f"vk-lower-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "lower.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": str(lower_cluster.kubeconfig),
                "upperClusterID": f"e2e-{uuid.uuid4().hex[:6]}",
            }
        )
    )
    agent = start_agent(
        kube_cluster, tmp_path, provider="cluster", config=config, name=name, address="127.0.0.1"
    )
    try:
        wait_for(lambda: node_ready(kubectl, name), what=f"node {name} Ready")
        wait_for(
            lambda: (
                int(kubectl.json("get", "node", name)["status"]["allocatable"].get("pods", "0")) > 0
            ),
            what="the virtual node's capacity from the lower cluster",
        )
        yield ClusterNode(name, agent)
    finally:
        agent.stop()
        kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
        print(agent.log()[-5000:])


def deploy(kubectl: Kubectl, namespace: str, node: str, replicas: int) -> list[JSON]:
    """A Deployment pinned to the virtual node; its pods once all are Running with an IP."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "tolerations": [TOLERATION],
                    "containers": [{"name": "app", "image": "registry.example/web:1"}],
                },
            },
        },
    }
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(deployment))

    def running() -> list[JSON] | None:
        pods: list[JSON] = kubectl.json("-n", namespace, "get", "pods", "-l", "app=web")["items"]
        ok = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
        return pods if len(pods) == replicas == len(ok) else None

    found: list[JSON] = wait_for(running, timeout=120, what=f"{replicas} upper pods Running")
    return found


def test_the_agent_killed_and_restarted_adopts_every_lower_pod(
    kubectl: Kubectl, lower_cluster: LowerCluster, cluster_node: ClusterNode
) -> None:
    namespace = f"kill-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    lk = lower_cluster.kubectl
    try:
        deploy(kubectl, namespace, cluster_node.name, 2)
        # A pod without a controller, deleted upstairs while the agent is down.
        lonely = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "lonely"},
            "spec": {
                "nodeName": cluster_node.name,
                "containers": [{"name": "app", "image": "registry.example/web:1"}],
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(lonely))
        wait_for(
            lambda: (
                kubectl.json("-n", namespace, "get", "pod", "lonely")["status"].get("phase")
                == "Running"
            ),
            what="lonely Running",
        )

        def lower_pods() -> dict[str, str]:
            items = lk.json("-n", namespace, "get", "pods")["items"]
            return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items}

        before = lower_pods()
        assert len(before) == 3 and "lonely" in before
        cluster_node.agent.stop(signal.SIGKILL)
        kubectl("-n", namespace, "delete", "pod", "lonely", "--grace-period=0", "--force")
        cluster_node.agent.start()
        wait_for(lambda: "lonely" not in lower_pods(), timeout=90, what="lonely removed below")
        wait_for(lambda: node_ready(kubectl, cluster_node.name), what="the node Ready again")
        after = lower_pods()
        # The survivors are the very same lower pods: adopted, none re-created.
        assert after == {k: v for k, v in before.items() if k != "lonely"}
        for name in after:
            assert kubectl.json("-n", namespace, "get", "pod", name)["status"]["phase"] == "Running"
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def test_a_deployment_on_the_virtual_node_runs_in_the_lower_cluster(
    kubectl: Kubectl, lower_cluster: LowerCluster, cluster_node: ClusterNode, tmp_path: Path
) -> None:
    namespace = f"web-{uuid.uuid4().hex[:6]}"
    secret_value = f"s3cret-{uuid.uuid4().hex}"
    create_namespace(kubectl, namespace)
    lk = lower_cluster.kubectl
    try:
        kubectl("-n", namespace, "create", "configmap", "cfg", "--from-literal=COLOR=blue")
        kubectl(
            "-n",
            namespace,
            "create",
            "secret",
            "generic",
            "creds",
            f"--from-literal=pw={secret_value}",
        )
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {
                        "labels": {"app": "web"},
                        "annotations": {"mock.vkubelet.io/print-env": "true"},
                    },
                    "spec": {
                        "nodeSelector": {"kubernetes.io/hostname": cluster_node.name},
                        "tolerations": [TOLERATION],
                        "containers": [
                            {
                                "name": "app",
                                "image": "registry.example/web:1",
                                "resources": {"requests": {"cpu": "100m"}},
                                "envFrom": [{"configMapRef": {"name": "cfg"}}],
                                "volumeMounts": [{"name": "creds", "mountPath": "/creds"}],
                            }
                        ],
                        "volumes": [{"name": "creds", "secret": {"secretName": "creds"}}],
                    },
                },
            },
        }
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(deployment))

        def running() -> list[dict[str, object]] | None:
            pods = kubectl.json("-n", namespace, "get", "pods", "-l", "app=web")["items"]
            ok = [
                p
                for p in pods
                if p["status"].get("phase") == "Running" and p["status"].get("podIP")
            ]
            return pods if len(pods) == 3 and len(ok) == 3 else None

        pods = wait_for(running, timeout=120, what="3 upper pods Running")
        below = {p["metadata"]["name"]: p for p in lk.json("-n", namespace, "get", "pods")["items"]}
        for pod in pods:
            lower = below[pod["metadata"]["name"]]
            assert pod["status"]["podIP"] == lower["status"]["podIP"]
            assert lower["spec"]["nodeName"] in {n.name for n in lower_cluster.nodes.values()}
            text = json.dumps(lower)
            assert secret_value not in text
            assert base64.b64encode(secret_value.encode()).decode() not in text

        first = pods[0]["metadata"]["name"]
        logs = kubectl("-n", namespace, "logs", first).stdout
        assert "COLOR=blue" in logs
        assert (
            kubectl("-n", namespace, "exec", first, "--", "echo", "hello").stdout.strip() == "hello"
        )

        # exit codes and `kubectl cp` (tar over exec) go through too.
        failed = kubectl("-n", namespace, "exec", first, "--", "sh", "-c", "exit 3", check=False)
        assert failed.returncode == 3
        local_file = tmp_path / "note.txt"
        local_file.write_text("carried down\n")
        kubectl("-n", namespace, "cp", str(local_file), f"{first}:/tmp/note.txt")
        copied = kubectl("-n", namespace, "exec", first, "--", "cat", "/tmp/note.txt").stdout
        assert copied == "carried down\n"

        # port-forward: through the upper apiserver, the agent, the lower apiserver and the lower
        # mock node, whose pods "are" this machine: it dials 127.0.0.1:<port>.
        scoped = tmp_path / "upper-in-namespace.kubeconfig"
        shutil.copy(kubectl.kubeconfig, scoped)
        in_namespace = Kubectl(scoped)
        in_namespace("config", "set-context", "--current", f"--namespace={namespace}")
        with (
            echo_server() as port,
            port_forward(in_namespace, first, port) as local,
            socket.create_connection(("127.0.0.1", local), timeout=10) as conn,
        ):
            conn.sendall(b"ping through two clusters\n")
            assert conn.makefile("rb").readline() == b"ping through two clusters\n"

        # Editing the ConfigMap reaches the lower copy.
        kubectl("-n", namespace, "patch", "configmap", "cfg", "-p", '{"data":{"COLOR":"red"}}')
        wait_for(
            lambda: any(
                cm["data"].get("COLOR") == "red"
                for cm in lk.json("-n", namespace, "get", "configmaps", "-l", "vkubelet.io/owner")[
                    "items"
                ]
            ),
            what="the ConfigMap edit in the lower copy",
        )

        # Scaling to zero leaves no stamped object behind.
        kubectl("-n", namespace, "scale", "deployment", "web", "--replicas=0")
        wait_for(
            lambda: not kubectl.json("-n", namespace, "get", "pods")["items"],
            timeout=120,
            what="the upper pods gone",
        )

        def stamped_left() -> list[str]:
            return [
                f"{kind}/{item['metadata']['name']}"
                for kind in ("pods", "configmaps", "secrets", "serviceaccounts")
                for item in lk.json("-n", namespace, "get", kind, "-l", "vkubelet.io/owner")[
                    "items"
                ]
            ]

        wait_for(lambda: not stamped_left(), timeout=60, what="no stamped object left below")
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lk("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")
