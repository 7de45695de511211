"""The Helm chart installed for real: `helm install` into a dev cluster with worker nodes, the
agent image (built from this tree, no registry) running as pods on real kubelets, its virtual
node Ready at the leader pod's address, kubectl's verbs reaching the virtual node's pods through
the agent pod, and a deleted leader replaced by another replica (the standby, or one the
Deployment adds) without restarting any pod."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster, build_image, ensure_helm
from vkubelet.testing import Kubectl, node_ready, port_forward, wait_for

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "vkubelet"
NAMESPACE = "vkubelet-system"
AGENT_UID = 65532  # the chart's podSecurityContext


@pytest.fixture(scope="module")
def release(
    worker_cluster: Cluster, worker_kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The chart installed with the mock provider, two replicas, leader election; the mock's
    backend (its state file) in a directory both replicas mount, as a real backend is shared."""
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    helm = ensure_helm(log)
    worker_cluster.load_image(build_image("agent", log).path)
    backend = Path(f"/tmp/vkubelet-chart-backend-{uuid.uuid4().hex[:8]}")
    backend.mkdir(mode=0o700)
    os.chown(backend, AGENT_UID, AGENT_UID)
    node = f"vk-chart-{uuid.uuid4().hex[:6]}"
    values = {
        "provider": "mock",
        "nodeName": node,
        "providerConfig": {
            node: {"cpu": "8", "memory": "32Gi", "pods": "110", "stateFile": "/backend/state.json"}
        },
        "servingCertificate": {"approveOwnCSRs": True},
        "identity": "serviceAccount",  # a node identity may not approve its own CSRs
        "logFormat": "text",
        "extraVolumes": [
            {"name": "backend", "hostPath": {"path": str(backend), "type": "Directory"}}
        ],
        "extraVolumeMounts": [{"name": "backend", "mountPath": "/backend"}],
    }
    values_file = tmp_path_factory.mktemp("chart") / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    env = {**os.environ, "KUBECONFIG": str(worker_cluster.kubeconfig)}
    install = subprocess.run(
        [str(helm), "install", "vk", str(CHART), "--namespace", NAMESPACE, "--create-namespace",
         "--values", str(values_file), "--wait",
         "--timeout", "180s"],
        capture_output=True, text=True, env=env, check=False, timeout=240,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    try:
        yield {"node": node, "backend": backend}
    finally:
        subprocess.run(
            [str(helm), "uninstall", "vk", "--namespace", NAMESPACE, "--wait"],
            capture_output=True, env=env, check=False, timeout=120,
        )  # fmt: skip
        worker_kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")
        worker_kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        shutil.rmtree(backend, ignore_errors=True)


def agents(kubectl: Kubectl) -> list[dict[str, Any]]:
    selector = "app.kubernetes.io/instance=vk"
    items: list[dict[str, Any]] = kubectl.json("-n", NAMESPACE, "get", "pods", "-l", selector)[
        "items"
    ]
    return items


def leader(kubectl: Kubectl, node: str) -> str:
    lease = kubectl.json("-n", NAMESPACE, "get", "lease", f"vkubelet-agent-{node}")
    return str(lease["spec"].get("holderIdentity") or "")


def internal_ip(kubectl: Kubectl, node: str) -> str:
    addresses = kubectl.json("get", "node", node)["status"]["addresses"]
    return str(next(a["address"] for a in addresses if a["type"] == "InternalIP"))


@pytest.fixture(scope="module")
def virtual_pod(worker_kubectl: Kubectl, release: dict[str, Any]) -> Iterator[str]:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "on-the-chart-node"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": release["node"]},
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
            "containers": [{"name": "main", "image": "registry.example/app:1"}],
        },
    }
    worker_kubectl("apply", "-f", "-", input=json.dumps(pod))
    worker_kubectl("wait", "--for=condition=Ready", "pod/on-the-chart-node", "--timeout=90s",
                   timeout=120)  # fmt: skip
    yield "on-the-chart-node"
    worker_kubectl("delete", "pod", "on-the-chart-node", "--wait=false")


def test_the_agent_runs_as_pods_on_workers_and_its_node_is_ready_at_the_leaders_address(
    worker_cluster: Cluster, worker_kubectl: Kubectl, release: dict[str, Any]
) -> None:
    pods = agents(worker_kubectl)
    assert len(pods) == 2
    workers = {w.name for w in worker_cluster.workers()}
    assert {p["spec"]["nodeName"] for p in pods} <= workers
    assert all(p["status"]["containerStatuses"][0]["ready"] for p in pods)  # probes pass
    node = release["node"]
    wait_for(lambda: node_ready(worker_kubectl, node), timeout=60, what=f"{node} Ready")
    holder = next(p for p in pods if p["metadata"]["name"] == leader(worker_kubectl, node))
    assert internal_ip(worker_kubectl, node) == holder["status"]["podIP"]
    # The apiserver reaches the agent's kubelet API at that pod address, through the node proxy.
    health = worker_kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/healthz").stdout
    assert health.strip() == "ok"


def test_kubectl_logs_exec_port_forward_and_top_reach_the_virtual_nodes_pods_through_the_agent(
    worker_kubectl: Kubectl, release: dict[str, Any], virtual_pod: str
) -> None:
    k = worker_kubectl
    assert "started" in k("logs", virtual_pod).stdout
    assert k("exec", virtual_pod, "--", "echo", "through-the-agent").stdout.strip() == (
        "through-the-agent"
    )
    token = k(
        "exec", virtual_pod, "--", "cat", "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    )
    assert token.stdout.strip() == "default"
    # The mock's port-forward reaches 127.0.0.1:<port> where the agent runs: in its pod, the
    # agent's own kubelet port answers.
    with port_forward(k, virtual_pod, 10250) as local:
        import ssl

        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        with urllib.request.urlopen(
            f"https://127.0.0.1:{local}/healthz", timeout=10, context=insecure
        ) as answer:
            assert answer.read() == b"ok"
    top = wait_for(
        lambda: (r := k("top", "pod", virtual_pod, check=False)).returncode == 0 and r.stdout,
        timeout=90,
        interval=3,
        what="kubectl top pod on the virtual node",
    )
    assert virtual_pod in top


def test_deleting_the_leader_pod_hands_the_node_to_another_replica_without_restarting_pods(
    worker_kubectl: Kubectl, release: dict[str, Any], virtual_pod: str
) -> None:
    k, node = worker_kubectl, release["node"]
    before = k.json("get", "pod", virtual_pod)
    old = leader(k, node)
    standby = next(p["metadata"]["name"] for p in agents(k) if p["metadata"]["name"] != old)
    started = time.monotonic()
    k("-n", NAMESPACE, "delete", "pod", old, "--wait=false")

    # The leader gives its Lease up when it stops, else it expires (~10-12 s); in CI runs at
    # load a takeover once took longer than 15 s: the claim here is the hand-over itself.
    def taken_over() -> str:  # by the standby, or by a replica the Deployment adds meanwhile
        holder = leader(k, node)  # (the standby restarted by its kubelet under load, say)
        return holder if holder and holder != old else ""

    try:
        new = str(wait_for(taken_over, timeout=40, interval=0.2, what="another replica to lead"))
    except pytest.fail.Exception:  # what the replicas did instead
        print(json.dumps(k.json("-n", NAMESPACE, "get", "lease", f"vkubelet-agent-{node}")))
        print(k("-n", NAMESPACE, "get", "pods", "-o", "wide", check=False).stdout)
        print(k("-n", NAMESPACE, "logs", standby, "--tail=80", check=False).stdout)
        raise
    took_over = time.monotonic() - started
    # The node now lives at the new leader's address, and kubectl reaches the pod through it.
    if new != standby:
        print(f"the Lease went to {new}, not to the standby {standby}", file=sys.stderr)
    leader_ip = k.json("-n", NAMESPACE, "get", "pod", new)["status"]["podIP"]
    wait_for(lambda: internal_ip(k, node) == leader_ip, timeout=15, what="the node's new address")
    wait_for(
        lambda: (
            k("exec", virtual_pod, "--", "echo", "again", check=False).stdout.strip() == "again"
        ),
        timeout=30,
        what="kubectl exec through the new leader",
    )
    print(f"takeover after the leader pod's deletion: {took_over:.1f}s", file=sys.stderr)
    after = k.json("get", "pod", virtual_pod)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    (was,), (now,) = before["status"]["containerStatuses"], after["status"]["containerStatuses"]
    assert now["restartCount"] == was["restartCount"] == 0
    assert now["state"] == was["state"]  # same startedAt: the backend kept the container
    assert node_ready(k, node)
    assert after["status"]["hostIP"] == leader_ip


def test_the_cluster_provider_runs_as_a_pod_and_kubectl_exec_reaches_a_real_process_below(
    worker_cluster: Cluster,
    worker_kubectl: Kubectl,
    lower_workers: Cluster,
    release: dict[str, Any],
    tmp_path: Path,
) -> None:
    k, lower = worker_kubectl, Kubectl(lower_workers.kubeconfig)
    helm = ensure_helm(lambda m: print(m, file=sys.stderr))
    node = f"vk-lower-{uuid.uuid4().hex[:6]}"
    values = {
        "provider": "cluster",
        "nodeName": node,
        "replicas": 1,
        "providerConfig": {"kubeconfig": "lower.kubeconfig"},
        "secretFiles": {"lower.kubeconfig": lower_workers.kubeconfig.read_text()},
        "servingCertificate": {"approveOwnCSRs": True},
        "identity": "serviceAccount",  # a node identity may not approve its own CSRs
        "logFormat": "text",
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    env = {**os.environ, "KUBECONFIG": str(worker_cluster.kubeconfig)}
    namespace = "vkubelet-lower"
    install = subprocess.run(
        [str(helm), "install", "vkc", str(CHART), "--namespace", namespace, "--create-namespace",
         "--values", str(tmp_path / "values.yaml"), "--wait", "--timeout", "180s"],
        capture_output=True, text=True, env=env, check=False, timeout=240,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    try:
        wait_for(lambda: node_ready(k, node), timeout=90, what=f"{node} Ready")
        image = lower_workers.image_reference("busybox")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "runs-below"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
                "containers": [
                    {
                        "name": "main",
                        "image": image,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "echo below; exec sleep 3600"],
                    }
                ],
            },
        }
        k("apply", "-f", "-", input=json.dumps(pod))
        k("wait", "--for=condition=Ready", "pod/runs-below", "--timeout=120s", timeout=150)
        # Upstairs kubectl -> upper apiserver -> the agent pod -> lower apiserver -> the lower
        # worker's real kubelet -> a real process in a real container.
        lower_pods = lower.json("get", "pods", "-A")["items"]
        below = [p for p in lower_pods if p["metadata"]["name"].startswith("runs-below")]
        assert below and below[0]["spec"]["nodeName"] == lower_workers.workers()[0].name
        assert "below" in k("logs", "runs-below").stdout
        comm = k("exec", "runs-below", "--", "cat", "/proc/1/comm").stdout.strip()
        assert comm == "sleep"
        echoed = k("exec", "-i", "runs-below", "--", "cat", input="up and down\n").stdout
        assert echoed == "up and down\n"
    finally:
        k("delete", "pod", "runs-below", "--ignore-not-found", "--wait=false")
        subprocess.run(
            [str(helm), "uninstall", "vkc", "--namespace", namespace, "--wait"],
            capture_output=True, env=env, check=False, timeout=120,
        )  # fmt: skip
        k("delete", "node", node, "--ignore-not-found", "--wait=false")
