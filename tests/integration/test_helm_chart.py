"""The Helm chart (deploy/helm/vkubelet) against the real control plane.

Rendered by a helm built from its Go module (cached); every provider's rendering is accepted by
the apiserver in a server-side dry run; and the agent runs on this machine exactly as the chart's
container would: the Deployment's args and env, the ConfigMap's files where the pod would mount
them, and the chart's ServiceAccount through in-cluster configuration (a TokenRequest token and
the CA in a service-account directory, KUBERNETES_SERVICE_HOST/PORT). With only the chart's RBAC
it registers its node, runs a pod, serves its logs, and can do nothing it does not need.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from vkubelet.devcluster import Cluster, ensure_helm, kubernetes_version
from vkubelet.testing import Kubectl, create_namespace, node_ready, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "vkubelet"
PROVIDERS = ("mock", "ssh", "cluster", "vm")


@pytest.fixture(scope="module")
def helm() -> Path:
    return ensure_helm(lambda line: print(line, file=sys.stderr, flush=True))


def render(
    helm: Path, namespace: str, *args: str, release: str = "vkubelet"
) -> list[dict[str, Any]]:
    args = ("--kube-version", kubernetes_version(), *args)
    out = subprocess.run(
        [str(helm), "template", release, str(CHART), "--namespace", namespace, *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def supports_leader_election() -> bool:
    """`--leader-elect` comes with the agent's HA work (HA-CONTRACT.md); until this tree has it,
    the process test renders the chart without it (the dry run still covers it)."""
    exe = Path(sys.prefix) / "bin" / "vkubelet"
    help_text = subprocess.run(
        [str(exe), "run", "--help"], capture_output=True, text=True, check=False
    ).stdout
    return "--leader-elect" in help_text


def test_plain_manifests_are_the_chart_rendered(helm: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "render.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("provider", PROVIDERS)
def test_each_provider_passes_lint_and_a_server_side_dry_run(
    helm: Path, kubectl: Kubectl, provider: str
) -> None:
    values = CHART / "ci" / f"{provider}-values.yaml"
    kube_version = ("--kube-version", kubernetes_version())
    lint = subprocess.run(
        [str(helm), "lint", str(CHART), "--strict", "--values", str(values), *kube_version],
        capture_output=True,
        text=True,
        check=False,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # kube-system exists: the namespaced objects are checked for real (a dry-run Namespace
    # would not make its namespace exist for the objects after it).
    docs = render(helm, "kube-system", "--values", str(values), "--include-crds")
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "ClusterRole", "Deployment", "ConfigMap"} <= kinds
    text = "\n---\n".join(yaml.safe_dump(d) for d in docs)
    result = kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=text)
    assert "serverside-applied (server dry run)" in result.stdout


@dataclass
class Installed:
    namespace: str
    node: str
    account: str
    deployment: dict[str, Any]
    config_map: dict[str, Any]


@pytest.fixture(scope="module")
def installed(helm: Path, kubectl: Kubectl) -> Iterator[Installed]:
    """The mock chart applied in a namespace of its own, but for the Deployment (this machine
    is the pod): ServiceAccount, ConfigMap and RBAC exactly as rendered."""
    suffix = uuid.uuid4().hex[:6]
    namespace = create_namespace(kubectl, f"vk-helm-{suffix}")
    node = f"vk-helm-{suffix}"
    values = {
        "nodeName": node,
        "providerConfig": {node: {"pods": "20"}},
        "replicas": 1,
        "leaderElection": {"enabled": supports_leader_election()},
        "kubeletPort": free_port(),
    }
    values_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"vk-helm-{suffix}.yaml"
    values_file.write_text(json.dumps(values))
    docs = render(helm, namespace, "--values", str(values_file), release=f"vk-{suffix}")
    values_file.unlink()
    others = [d for d in docs if d["kind"] != "Deployment"]
    kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in others))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    try:
        yield Installed(namespace, node, account, deployment, config_map)
    finally:
        for doc in others:
            if doc["kind"] in {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}:
                meta = doc["metadata"]
                where = ["-n", meta["namespace"]] if "namespace" in meta else []
                kubectl("delete", doc["kind"], meta["name"], *where, "--ignore-not-found")
        kubectl("delete", "namespace", namespace, "--wait=false")
        kubectl("delete", "node", node, "--ignore-not-found", "--wait=false")


@dataclass
class PodAgent:
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def agent(
    installed: Installed,
    kube_cluster: Cluster,
    kubectl: Kubectl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PodAgent]:
    """The chart's container as a process here: its args and env, its volumes as directories,
    and in-cluster credentials of the chart's ServiceAccount (KUBECONFIG unset)."""
    root = tmp_path_factory.mktemp("pod")
    # The projected config volume (/etc/vkubelet), the state emptyDir (/var/lib/vkubelet).
    mounts = {"/etc/vkubelet": root / "etc", "/var/lib/vkubelet": root / "state"}
    for directory in mounts.values():
        directory.mkdir()
    for name, content in installed.config_map["data"].items():
        (mounts["/etc/vkubelet"] / name).write_text(content)
    # /var/run/secrets/kubernetes.io/serviceaccount, as the kubelet projects it.
    account = root / "serviceaccount"
    account.mkdir()
    token = kubectl(
        "-n", installed.namespace, "create", "token", installed.account, "--duration", "1h"
    ).stdout.strip()
    (account / "token").write_text(token)
    (account / "ca.crt").write_bytes((kube_cluster.pki / "ca.crt").read_bytes())
    (account / "namespace").write_text(installed.namespace)

    container = installed.deployment["spec"]["template"]["spec"]["containers"][0]
    args = list(container["args"])
    for inside, outside in mounts.items():
        args = [a.replace(inside, str(outside)) for a in args]
    downward = {
        "status.podIP": "127.0.0.1",
        "metadata.name": f"{installed.node}-pod",
        "metadata.namespace": installed.namespace,
    }
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["HOME"] = str(root)  # no ~/.kube/config to fall back on
    for item in container["env"]:
        env[item["name"]] = downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
    server = urlsplit(kube_cluster.server)
    env["KUBERNETES_SERVICE_HOST"] = str(server.hostname)
    env["KUBERNETES_SERVICE_PORT"] = str(server.port)
    env["VKUBELET_SERVICEACCOUNT_DIR"] = str(account)

    log_path = root / "agent.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [str(Path(sys.prefix) / "bin" / "vkubelet"), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    port = int(next(a for a in args if a.startswith("--kubelet-port=")).split("=")[1])
    running = PodAgent(proc, log_path, port)
    try:
        # The operator approves the serving CSR (the chart says --no-approve-own-csrs).
        requester = f"system:serviceaccount:{installed.namespace}:{installed.account}"

        def pending_csr() -> str | None:
            for csr in kubectl.json("get", "csr")["items"]:
                if csr["spec"].get("username") == requester and not csr.get("status"):
                    return str(csr["metadata"]["name"])
            assert proc.poll() is None, running.log()
            return None

        kubectl("certificate", "approve", wait_for(pending_csr, what="the serving CSR"))
        wait_for(lambda: node_ready(kubectl, installed.node), what=f"node {installed.node} Ready")
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_agent_with_the_charts_account_runs_a_pod_and_serves_its_logs(
    agent: PodAgent, installed: Installed, kubectl: Kubectl
) -> None:
    name = f"p-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": installed.namespace},
        "spec": {
            "nodeName": installed.node,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {"name": "main", "image": "registry.example/app:1", "env": [{"name": "A"}]}
            ],
        },
    }
    kubectl.apply(pod)
    wait_for(
        lambda: (
            kubectl.json("-n", installed.namespace, "get", "pod", name)["status"].get("phase")
            == "Running"
        ),
        what=f"pod {name} Running",
    )
    logs = kubectl("-n", installed.namespace, "logs", name)
    assert logs.returncode == 0 and logs.stdout
    kubectl("-n", installed.namespace, "delete", "pod", name, "--wait=true", timeout=60)
    log = agent.log()
    # Nothing it tried was refused: the RBAC covers what the agent does.
    assert "forbidden" not in log.lower(), log


def get(url: str, context: ssl.SSLContext) -> tuple[int, bytes]:
    assert url.startswith("https://")
    try:
        with urllib.request.urlopen(url, context=context, timeout=10) as answer:  # noqa: S310
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_the_probe_and_scrape_endpoints_answer_on_the_kubelet_port(
    agent: PodAgent, installed: Installed, kube_cluster: Cluster
) -> None:
    container = installed.deployment["spec"]["template"]["spec"]["containers"][0]
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and probe["scheme"] == "HTTPS"
    annotations = installed.deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(agent.port)
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    base = f"https://127.0.0.1:{agent.port}"
    assert get(f"{base}/healthz", insecure)[0] == 200
    # /metrics is the kubelet's: an anonymous scrape is refused, a permitted identity served.
    assert get(f"{base}{annotations['prometheus.io/path']}", insecure)[0] == 401
    admin = ssl.create_default_context()
    admin.check_hostname = False
    admin.verify_mode = ssl.CERT_NONE
    admin.load_cert_chain(kube_cluster.pki / "admin.crt", kube_cluster.pki / "admin.key")
    status, body = get(f"{base}/metrics", admin)
    assert status == 200 and b"# TYPE" in body


def can_i(kubectl: Kubectl, installed: Installed, verb: str, resource: str, namespace: str) -> str:
    """`kubectl auth can-i` as the chart's account; `resource` may be resource/subresource
    (kubectl would read that as resource/name) or resource:name."""
    args = ["auth", "can-i", verb]
    resource, _, name = resource.partition(":")
    resource, _, subresource = resource.partition("/")
    args.append(f"{resource}/{name}" if name else resource)
    if subresource:
        args.append(f"--subresource={subresource}")
    if namespace:
        args += ["-n", namespace]
    who = f"system:serviceaccount:{installed.namespace}:{installed.account}"
    answer = kubectl(*args, "--as", who, check=False)
    return answer.stdout.strip()


@pytest.mark.parametrize(
    ("verb", "resource", "namespace"),
    [
        ("create", "pods", "default"),  # it runs pods, never makes them
        ("update", "pods", "default"),
        ("delete", "nodes", ""),  # only fleets (ssh) remove nodes
        ("list", "nodes", ""),
        ("list", "namespaces", ""),
        ("create", "clusterrolebindings", ""),
        ("update", "certificatesigningrequests/approval", ""),  # the operator approves
        ("create", "pods/eviction", "default"),
        ("create", "pods/exec", "default"),
        ("update", "leases", "kube-system"),
        ("patch", "mutatingwebhookconfigurations", ""),
        ("create", "secrets", "default"),
        ("update", "configmaps", "default"),
        ("get", "nodes/proxy", ""),  # what its own kubelet API authorizes others for
    ],
)
def test_the_charts_account_may_not_do_what_the_mock_agent_never_does(
    installed: Installed, kubectl: Kubectl, verb: str, resource: str, namespace: str
) -> None:
    assert can_i(kubectl, installed, verb, resource, namespace) == "no"


@pytest.mark.parametrize(
    ("verb", "resource", "namespace"),
    [
        ("patch", "nodes/status", ""),
        ("watch", "pods", ""),
        ("patch", "pods/status", "default"),
        ("create", "serviceaccounts/token", "default"),
        ("patch", "leases", "kube-node-lease"),
        ("create", "certificatesigningrequests", ""),
        ("get", "configmaps:extension-apiserver-authentication", "kube-system"),
    ],
)
def test_the_charts_account_may_do_what_the_agent_needs(
    installed: Installed, kubectl: Kubectl, verb: str, resource: str, namespace: str
) -> None:
    assert can_i(kubectl, installed, verb, resource, namespace) == "yes"
