"""The node agent with the mock provider, against the real control plane, driven with kubectl.

The mock keeps its state in a file (as a real backend would keep its own), which is where these
tests read what the provider was actually given: resolved env, volume files, create counts.
"""

from __future__ import annotations

import base64
import json
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    MockNode,
    create_namespace,
    ephemeral_state,
    node_ready,
    wait_for,
)
from vkubelet.testing import mock_node as start_mock_node

from .clusters import restart_clients_of_the_apiserver

TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}


@dataclass
class StatefulMockNode:
    """A mock node whose fake backend keeps its pods in a state file the tests can read."""

    node: MockNode
    state_file: Path

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def agent(self) -> AgentProcess:
        return self.node.agent

    def state(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"creates": 0, "pods": []}
        return data

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        for pod in self.state()["pods"]:
            if pod["namespace"] == namespace and pod["name"] == name:
                return pod  # type: ignore[no-any-return]
        return None

    def wait_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """The pod as the provider has it; the mock writes its state file within 0.1 s."""
        found: dict[str, Any] = wait_for(
            lambda: self.pod(namespace, name), timeout=5, what=f"{name} in the provider"
        )
        return found


@pytest.fixture(scope="module")
def mock_node(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StatefulMockNode]:
    work = tmp_path_factory.mktemp("node")
    state_file = work / "mock-state.json"
    config = {"cpu": "16", "memory": "64Gi", "stateFile": str(state_file)}
    with start_mock_node(kube_cluster, kubectl, work, mock_config=config) as node:
        yield StatefulMockNode(node, state_file)


@pytest.fixture
def ns(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    create_namespace(kubectl, name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


def pod_manifest(name: str, node: str, **spec: Any) -> dict[str, Any]:
    annotations = spec.pop("annotations", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}, "annotations": annotations},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [TOLERATION],
            "containers": [{"name": "main", "image": "registry.example/app:1"}],
            **spec,
        },
    }


def phase(kubectl: Kubectl, ns: str, name: str) -> str | None:
    result = kubectl("-n", ns, "get", "pod", name, "-o", "json", check=False)
    if result.returncode:
        return None
    return json.loads(result.stdout)["status"].get("phase")  # type: ignore[no-any-return]


def test_deployment_runs_on_the_virtual_node_and_scale_to_zero_removes_pods_promptly(
    mock_node: StatefulMockNode, kubectl: Kubectl, ns: str
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": mock_node.name},
                    "tolerations": [TOLERATION],
                    "containers": [{"name": "web", "image": "nginx"}],
                },
            },
        },
    }
    kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(deployment))

    def running() -> list[dict[str, Any]]:
        pods = kubectl.json("-n", ns, "get", "pods", "-l", "app=web")["items"]
        ok = [
            p
            for p in pods
            if p["status"].get("phase") == "Running"
            and p["spec"].get("nodeName") == mock_node.name
            and all(c.get("ready") for c in p["status"].get("containerStatuses", []))
        ]
        return ok if len(ok) == 3 else []

    pods = wait_for(running, timeout=60, what="3 Running pods on the virtual node")
    assert all(p["status"]["podIP"] for p in pods)

    started = time.monotonic()
    kubectl("-n", ns, "scale", "deployment", "web", "--replicas=0")
    wait_for(
        lambda: not kubectl.json("-n", ns, "get", "pods", "-l", "app=web")["items"],
        timeout=30,
        interval=0.1,
        what="pods removed after scaling to 0",
    )
    # The default grace period is 30 s; the mock stops containers at once, and the agent
    # removes the object as soon as it sees them terminated.
    assert time.monotonic() - started < 5
    wait_for(
        lambda: not [p for p in mock_node.state()["pods"] if p["namespace"] == ns],
        timeout=5,
        what="the provider to have stopped them",
    )


def test_every_env_source_reaches_the_provider_resolved(
    mock_node: StatefulMockNode, kubectl: Kubectl, ns: str
) -> None:
    kubectl(
        "-n",
        ns,
        "create",
        "configmap",
        "settings",
        "--from-literal=color=blue",
        "--from-literal=size=L",
    )
    kubectl("-n", ns, "create", "secret", "generic", "creds", "--from-literal=password=hunter2")
    kubectl("-n", ns, "create", "serviceaccount", "runner")
    env = [
        {"name": "GREETING", "value": "hello"},
        {"name": "EXPANDED", "value": "$(GREETING)-world-$$(GREETING)"},
        {"name": "COLOR", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "color"}}},
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_IPS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}},
        {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
        {
            "name": "MEM_MI",
            "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
        },
        {
            "name": "CPU_M",
            "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}},
        },
    ]
    manifest = pod_manifest(
        "envy",
        mock_node.name,
        serviceAccountName="runner",
        containers=[
            {
                "name": "main",
                "image": "registry.example/app:1",
                "env": env,
                "envFrom": [{"prefix": "CFG_", "configMapRef": {"name": "settings"}}],
                "resources": {"limits": {"memory": "256Mi"}, "requests": {"cpu": "250m"}},
            }
        ],
    )
    kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(manifest))
    wait_for(lambda: phase(kubectl, ns, "envy") == "Running", what="pod envy Running")
    provided = mock_node.wait_pod(ns, "envy")
    seen = dict(provided["containers"][0]["env"])
    pod = kubectl.json("-n", ns, "get", "pod", "envy")
    expected = {
        "GREETING": "hello",
        "EXPANDED": "hello-world-$(GREETING)",
        "COLOR": "blue",
        "PASSWORD": "hunter2",
        "CFG_color": "blue",
        "CFG_size": "L",
        "POD_NAME": "envy",
        "POD_NS": ns,
        "APP": "envy",
        "POD_IP": pod["status"]["podIP"],
        "POD_IPS": pod["status"]["podIP"],
        "HOST_IP": "127.0.0.1",
        "NODE": mock_node.name,
        "SA": "runner",
        "MEM_MI": "256",
        "CPU_M": "250",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
    }
    assert {k: seen.get(k) for k in expected} == expected
    # The mock asks for the projected service-account token when something reads it (a
    # TokenRequest bound to the pod), not at every start: it is not among the files given.
    assert not [k for k in provided["files"] if k.endswith("/token")]
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    token = kubectl("-n", ns, "exec", "envy", "--", "cat", f"{sa}/token").stdout
    assert token.count(".") == 2
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert claims["sub"] == f"system:serviceaccount:{ns}:runner"
    assert claims["kubernetes.io"]["pod"]["uid"] == pod["metadata"]["uid"]
    assert kubectl("-n", ns, "exec", "envy", "--", "cat", f"{sa}/namespace").stdout == ns


def test_missing_mandatory_configmap_holds_the_pod_until_it_appears(
    mock_node: StatefulMockNode, kubectl: Kubectl, ns: str
) -> None:
    container = {
        "name": "main",
        "image": "registry.example/app:1",
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "later", "key": "x"}}}],
    }
    kubectl(
        "-n",
        ns,
        "apply",
        "-f",
        "-",
        input=json.dumps(pod_manifest("waiter", mock_node.name, containers=[container])),
    )

    def waiting_reason() -> str | None:
        pod = kubectl.json("-n", ns, "get", "pod", "waiter")
        for status in pod["status"].get("containerStatuses") or []:
            return (status.get("state", {}).get("waiting") or {}).get("reason")
        return None

    wait_for(
        lambda: waiting_reason() == "CreateContainerConfigError",
        what="CreateContainerConfigError while the ConfigMap is missing",
    )
    events = kubectl.json(
        "-n", ns, "get", "events", "--field-selector", "involvedObject.name=waiter"
    )["items"]
    assert any(e["type"] == "Warning" and "later" in e["message"] for e in events)
    assert mock_node.pod(ns, "waiter") is None

    kubectl("-n", ns, "create", "configmap", "later", "--from-literal=x=finally")
    wait_for(lambda: phase(kubectl, ns, "waiter") == "Running", what="pod starts once it exists")
    provided = mock_node.wait_pod(ns, "waiter")
    assert dict(provided["containers"][0]["env"])["X"] == "finally"


def test_editing_a_mounted_configmap_reaches_the_provider(
    mock_node: StatefulMockNode, kubectl: Kubectl, ns: str
) -> None:
    kubectl("-n", ns, "create", "configmap", "site", "--from-literal=index.html=v1")
    manifest = pod_manifest(
        "reader",
        mock_node.name,
        volumes=[{"name": "site", "configMap": {"name": "site"}}],
        containers=[
            {
                "name": "main",
                "image": "nginx",
                "volumeMounts": [{"name": "site", "mountPath": "/usr/share/nginx/html"}],
            }
        ],
    )
    kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(manifest))
    wait_for(lambda: phase(kubectl, ns, "reader") == "Running", what="pod reader Running")
    assert mock_node.wait_pod(ns, "reader")["files"]["site/index.html"] == "v1"

    patch = json.dumps({"data": {"index.html": "v2"}})
    kubectl("-n", ns, "patch", "configmap", "site", "--type=merge", "-p", patch)
    wait_for(
        lambda: (mock_node.pod(ns, "reader") or {}).get("files", {}).get("site/index.html") == "v2",
        timeout=20,
        what="the new ConfigMap content in the provider",
    )
    assert (mock_node.pod(ns, "reader") or {})["updates"] >= 1


def test_a_pod_the_provider_rejects_fails_with_its_reason_and_others_still_run(
    mock_node: StatefulMockNode, kubectl: Kubectl, ns: str
) -> None:
    bad = pod_manifest(
        "bad", mock_node.name, annotations={"mock.vkubelet.io/fail": "UnsupportedImage"}
    )
    good = pod_manifest("good", mock_node.name)
    kubectl(
        "-n",
        ns,
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [bad, good]}),
    )
    wait_for(lambda: phase(kubectl, ns, "bad") == "Failed", what="the rejected pod Failed")
    pod = kubectl.json("-n", ns, "get", "pod", "bad")
    assert pod["status"]["reason"] == "UnsupportedImage"
    events = kubectl.json("-n", ns, "get", "events", "--field-selector", "involvedObject.name=bad")[
        "items"
    ]
    assert any(e["reason"] == "UnsupportedImage" and e["type"] == "Warning" for e in events)
    wait_for(lambda: phase(kubectl, ns, "good") == "Running", what="the good pod Running")
    assert mock_node.agent.running


def test_a_readiness_probe_gates_a_mock_pod_s_ready_condition(
    mock_node: StatefulMockNode, kubectl: Kubectl, ns: str
) -> None:
    probe = {"exec": {"command": ["test", "-f", "/tmp/ready"]}, "periodSeconds": 1}
    container = {"name": "main", "image": "registry.example/app:1", "readinessProbe": probe}
    manifest = pod_manifest("probed", mock_node.name, containers=[container])
    kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(manifest))

    def ready() -> bool:
        conditions = kubectl.json("-n", ns, "get", "pod", "probed")["status"].get("conditions")
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions or [])

    def probe_failures() -> int:
        events = kubectl.json(
            "-n", ns, "get", "events", "--field-selector", "involvedObject.name=probed"
        )["items"]
        return sum(e.get("count") or 1 for e in events if e["reason"] == "Unhealthy")

    wait_for(lambda: phase(kubectl, ns, "probed") == "Running", what="Running")
    wait_for(lambda: probe_failures() >= 3, what="three failed probes")
    assert not ready()
    wait_for(
        lambda: kubectl("-n", ns, "exec", "probed", "--", "sh", "-c", "echo > /tmp/ready"),
        timeout=30,
        what="the file the probe looks for",
    )
    wait_for(ready, timeout=30, what="Ready once the probe succeeds")
    kubectl("-n", ns, "exec", "probed", "--", "rm", "/tmp/ready")
    wait_for(lambda: not ready(), timeout=30, what="not Ready again")


def test_deleting_the_node_object_gets_it_registered_again(
    mock_node: StatefulMockNode, kubectl: Kubectl
) -> None:
    before = kubectl.json("get", "node", mock_node.name)["metadata"]["uid"]
    kubectl("delete", "node", mock_node.name)

    def new_uid() -> bool:
        result = kubectl("get", "node", mock_node.name, "-o", "json", check=False)
        return result.returncode == 0 and json.loads(result.stdout)["metadata"]["uid"] != before

    wait_for(new_uid, timeout=60, what="the Node re-created by the agent")
    wait_for(lambda: node_ready(kubectl, mock_node.name), timeout=30, what="node Ready again")


def test_agent_restart_keeps_every_pod_without_recreating_it_and_reports_debug_commands_lost(
    mock_node: StatefulMockNode, kubectl: Kubectl, ns: str
) -> None:
    for name in ("keep-1", "keep-2"):
        kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(pod_manifest(name, mock_node.name)))
    for name in ("keep-1", "keep-2"):
        wait_for(lambda n=name: phase(kubectl, ns, n) == "Running", what=f"{name} Running")  # type: ignore[misc]
    uids = {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in kubectl.json("-n", ns, "get", "pods")["items"]
    }
    # A debug command that dies with the agent: reported lost after the restart, not running.
    kubectl("-n", ns, "debug", "keep-1", "--image=busybox", "-c", "bg", "--", "sleep", "3600")
    wait_for(lambda: ephemeral_state(kubectl, ns, "keep-1", "bg").get("running"), what="bg runs")
    time.sleep(0.5)  # the mock writes its state file within 0.1 s
    creates = mock_node.state()["creates"]

    mock_node.agent.stop(signal.SIGKILL)  # a crash, not a clean shutdown

    def not_ready() -> bool:
        node = kubectl.json("get", "node", mock_node.name)
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        return bool(ready) and ready[0]["status"] != "True"

    wait_for(not_ready, timeout=90, what="node NotReady after its lease expired")

    mock_node.agent.start()
    wait_for(lambda: node_ready(kubectl, mock_node.name), timeout=60, what="node Ready again")
    time.sleep(3)  # give a (wrong) re-create the chance to happen
    after = {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in kubectl.json("-n", ns, "get", "pods")["items"]
    }
    assert after == uids
    assert all(phase(kubectl, ns, n) == "Running" for n in uids)
    assert mock_node.state()["creates"] == creates
    lost = wait_for(
        lambda: ephemeral_state(kubectl, ns, "keep-1", "bg").get("terminated"),
        what="the debug command's end",
    )
    assert (lost["exitCode"], lost["reason"]) == (137, "ContainerStatusUnknown")


def test_exec_of_a_missing_command_prints_one_plain_message_and_exits_127(
    mock_node: StatefulMockNode, kubectl: Kubectl, ns: str
) -> None:
    kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(pod_manifest("shell", mock_node.name)))
    wait_for(lambda: phase(kubectl, ns, "shell") == "Running", timeout=30, what="shell Running")
    log_before = mock_node.agent.log_path.read_text()
    for command in ("nope", "/nope"):
        result = kubectl("-n", ns, "exec", "shell", "--", command, check=False)
        assert result.returncode == 127, result
        assert result.stderr.count(f"{command}: command not found") == 1, result.stderr
        assert "command terminated with exit code 127" in result.stderr
        assert "Internal error" not in result.stderr
    log_after = mock_node.agent.log_path.read_text()[len(log_before) :]
    assert "Traceback" not in log_after


def test_node_conditions_read_like_the_kubelets_with_transition_times(
    mock_node: StatefulMockNode, kubectl: Kubectl
) -> None:
    node = kubectl.json("get", "node", mock_node.name)
    found = {c["type"]: c for c in node["status"]["conditions"]}
    assert found["Ready"]["message"] == "kubelet is posting ready status"
    assert found["MemoryPressure"]["message"] == "kubelet has sufficient memory available"
    for condition in found.values():
        assert condition.get("lastTransitionTime"), condition
        assert condition.get("lastHeartbeatTime"), condition


def test_apiserver_outage_is_survived_and_no_change_is_missed(
    kube_cluster: Cluster,
    mock_node: StatefulMockNode,
    kubectl: Kubectl,
    ns: str,
    pytestconfig: pytest.Config,
) -> None:
    for name in ("a", "b"):
        kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(pod_manifest(name, mock_node.name)))
    for name in ("a", "b"):
        wait_for(lambda n=name: phase(kubectl, ns, n) == "Running", what=f"{name} Running")  # type: ignore[misc]

    own_cluster = not pytestconfig.getoption("--vkubelet-cluster")
    kube_cluster.stop_component("kube-apiserver")
    try:
        time.sleep(20)
        assert mock_node.agent.running, mock_node.agent.log()[-2000:]
    finally:
        kube_cluster.start_component("kube-apiserver", tie_to_parent=own_cluster)
    try:
        kubectl("-n", ns, "delete", "pod", "a", "--wait=false")
        # Bound directly: after an apiserver restart the scheduler and controller-manager may
        # take a minute to resync their own watches, and this test is about the agent, not them.
        direct = pod_manifest("c", mock_node.name, nodeName=mock_node.name)
        kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(direct))
        wait_for(lambda: phase(kubectl, ns, "c") == "Running", timeout=60, what="pod c Running")
        wait_for(lambda: mock_node.pod(ns, "a") is None, timeout=30, what="pod a stopped")
        wait_for(lambda: phase(kubectl, ns, "a") is None, timeout=30, what="pod a gone")
        assert mock_node.pod(ns, "b") is not None
        wait_for(lambda: node_ready(kubectl, mock_node.name), timeout=60, what="node Ready")
    finally:
        restart_clients_of_the_apiserver(kube_cluster, tie_to_parent=own_cluster)
