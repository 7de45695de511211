"""The Helm chart's objects applied, and its container run on this machine as the pod would.

Shared by the chart's integration tests (one module per provider: the cluster provider's needs
the session's lower cluster). "As the pod would": the Deployment's args and env (the downward
API's values filled in), the ConfigMap's and Secret's files where the projected volume puts them,
the emptyDir as a directory, and the chart's ServiceAccount through in-cluster configuration (a
TokenRequest token and the cluster CA in the directory `VKUBELET_SERVICEACCOUNT_DIR` names,
`KUBERNETES_SERVICE_HOST/PORT` set to the apiserver, no kubeconfig anywhere).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from vkubelet.devcluster import Cluster, kubernetes_version
from vkubelet.testing import Kubectl, create_namespace, node_ready, wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "vkubelet"
JSON = dict[str, Any]


def render(helm: Path, namespace: str, *args: str, release: str = "vkubelet") -> list[JSON]:
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def supports_leader_election() -> bool:
    """`--leader-elect` comes with the agent's HA work (HA-CONTRACT.md); until this tree has it,
    the agent runs from a rendering without it (the dry runs still cover those args)."""
    exe = Path(sys.prefix) / "bin" / "vkubelet"
    help_text = subprocess.run(
        [str(exe), "run", "--help"], capture_output=True, text=True, check=False
    ).stdout
    return "--leader-elect" in help_text


@dataclass
class Installed:
    namespace: str
    nodes: list[str]  # what the agent registers: `nodeName`, or an ssh inventory's devices
    account: str
    deployment: JSON
    files: dict[str, str]  # the projected /etc/vkubelet: ConfigMap and Secret files
    identity: str  # the chart's `identity`: node, or serviceAccount

    @property
    def node(self) -> str:
        return self.nodes[0]

    @property
    def user(self) -> str:
        """The chart's ServiceAccount (with `identity: node` it only obtains the node's)."""
        return f"system:serviceaccount:{self.namespace}:{self.account}"

    @property
    def acting_as(self) -> tuple[str, ...]:
        """kubectl's impersonation flags for whoever the agent acts as."""
        if self.identity == "node":
            return ("--as", f"system:node:{self.node}", "--as-group", "system:nodes")
        return ("--as", self.user)

    @property
    def container(self) -> JSON:
        container: JSON = self.deployment["spec"]["template"]["spec"]["containers"][0]
        return container


@contextlib.contextmanager
def installed_chart(
    helm: Path, kubectl: Kubectl, node: str, values: JSON, *, devices: Sequence[str] = ()
) -> Iterator[Installed]:
    """The chart with `values` applied in a namespace of its own, all but the Deployment (this
    machine is its pod); its cluster-wide objects and the node removed afterwards. `devices`:
    the nodes an ssh inventory names, instead of `node` (then no `nodeName`)."""
    suffix = uuid.uuid4().hex[:6]
    namespace = create_namespace(kubectl, f"vk-helm-{suffix}")
    values = {
        "nodeName": node,
        "replicas": 1,
        "leaderElection": {"enabled": supports_leader_election()},
        "kubeletPort": free_port(),
        **({"nodeName": ""} if devices else {}),
        **values,
    }
    values_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"vk-helm-{suffix}.json"
    values_file.write_text(json.dumps(values))
    try:
        docs = render(helm, namespace, "--values", str(values_file), release=f"vk-{suffix}")
    finally:
        values_file.unlink()
    others = [d for d in docs if d["kind"] != "Deployment"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    files = dict(next(d for d in docs if d["kind"] == "ConfigMap").get("data") or {})
    for secret in (d for d in docs if d["kind"] == "Secret"):
        files.update(secret.get("stringData") or {})
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    identity = values.get("identity", "node")  # the chart's default
    try:
        kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in others))
        yield Installed(namespace, list(devices) or [node], account, deployment, files, identity)
    finally:
        for doc in others:
            if doc["kind"] in {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}:
                meta = doc["metadata"]
                where = ["-n", meta["namespace"]] if "namespace" in meta else []
                kubectl("delete", doc["kind"], meta["name"], *where, "--ignore-not-found")
        kubectl("delete", "namespace", namespace, "--wait=false")
        for name in devices or [node]:
            kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")


@dataclass
class PodAgent:
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int
    home: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def agent_as_pod(
    installed: Installed, cluster: Cluster, kubectl: Kubectl, root: Path
) -> Iterator[PodAgent]:
    """Run the chart's container here; the admin approves its serving CSRs (the chart's default
    is --no-approve-own-csrs, as a cluster operator would); yield once its nodes are Ready."""
    mounts = {"/etc/vkubelet": root / "etc", "/var/lib/vkubelet": root / "state"}
    for directory in mounts.values():
        directory.mkdir(parents=True)
    for name, content in installed.files.items():
        (mounts["/etc/vkubelet"] / name).write_text(content)
        (mounts["/etc/vkubelet"] / name).chmod(0o440)  # the projected volume's defaultMode
    account = root / "serviceaccount"  # /var/run/secrets/kubernetes.io/serviceaccount
    account.mkdir()
    token = kubectl(
        "-n", installed.namespace, "create", "token", installed.account, "--duration", "1h"
    ).stdout.strip()
    (account / "token").write_text(token)
    (account / "ca.crt").write_bytes((cluster.pki / "ca.crt").read_bytes())
    (account / "namespace").write_text(installed.namespace)

    args = list(installed.container["args"])
    for inside, outside in mounts.items():
        args = [a.replace(inside, str(outside)) for a in args]
    downward = {
        "status.podIP": "127.0.0.1",
        "metadata.name": f"{installed.node}-pod",
        "metadata.namespace": installed.namespace,
    }
    # No kubeconfig to fall back on, and a home that must stay empty: the container's root
    # filesystem is read-only, only the chart's volumes (and /tmp) take writes.
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("XDG_")}
    env["HOME"] = str(root / "home")
    (root / "home").mkdir()
    for item in installed.container["env"]:
        env[item["name"]] = downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
    server = urlsplit(cluster.server)
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
    running = PodAgent(proc, log_path, port, root / "home")
    try:
        # The serving CSRs come from the agent's account, or from the node itself; a node
        # identity's client CSR is kube-controller-manager's to approve, never ours.
        requesters = {installed.user, *(f"system:node:{node}" for node in installed.nodes)}

        def approved_and_ready() -> bool:
            """Approve the serving CSRs asked for so far (one per node); all Ready?"""
            for csr in kubectl.json("get", "csr")["items"]:
                spec = csr["spec"]
                if (
                    spec.get("username") in requesters
                    and spec.get("signerName") == "kubernetes.io/kubelet-serving"
                    and not csr.get("status")
                ):
                    kubectl("certificate", "approve", csr["metadata"]["name"])
            assert proc.poll() is None, running.log()
            return all(node_ready(kubectl, node) for node in installed.nodes)

        wait_for(approved_and_ready, what=f"nodes {installed.nodes} Ready")
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pod_runs_and_logs(kubectl: Kubectl, installed: Installed) -> str:
    """A pod bound to the chart's node Runs, `kubectl logs` answers, and it is deleted; return
    the logs."""
    name = f"p-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": installed.namespace},
        "spec": {
            "nodeName": installed.node,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "command": ["sh", "-c", "echo hello from the chart; sleep 3600"],
                    "env": [{"name": "A", "value": "1"}],
                }
            ],
        },
    }
    kubectl.apply(pod)
    where = ("-n", installed.namespace)
    wait_for(
        lambda: kubectl.json(*where, "get", "pod", name)["status"].get("phase") == "Running",
        timeout=90,
        what=f"pod {name} Running",
    )
    logs: str = wait_for(
        lambda: kubectl(*where, "logs", name, check=False).stdout, what=f"logs of {name}"
    )
    kubectl(*where, "delete", "pod", name, "--wait=true", timeout=90)
    return logs


def can_i(kubectl: Kubectl, installed: Installed, verb: str, resource: str, namespace: str) -> str:
    """`kubectl auth can-i` as whoever the agent acts as (its node, or the chart's account);
    `resource` may be resource/subresource (kubectl would read that as resource/name) or
    resource:name."""
    args = ["auth", "can-i", verb]
    resource, _, name = resource.partition(":")
    resource, _, subresource = resource.partition("/")
    args.append(f"{resource}/{name}" if name else resource)
    if subresource:
        args.append(f"--subresource={subresource}")
    if namespace:
        args += ["-n", namespace]
    return kubectl(*args, *installed.acting_as, check=False).stdout.strip()


def refusals(log: str) -> list[str]:
    """The agent's log lines that report a refusal (a 403: "Forbidden", RBAC's "... is
    forbidden: User ... cannot ..."), at any level, but for the one no RBAC rule grants: a
    namespace being deleted refuses new objects (a VM of an earlier test's namespace)."""
    return [
        line
        for line in log.splitlines()
        if "forbidden" in line.lower() and "being terminated" not in line
    ]
