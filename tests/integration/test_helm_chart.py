"""The Helm chart (deploy/helm/vkubelet) against the real control plane.

Rendered by a helm built from its Go module (cached); every provider's rendering passes `helm
lint` and a server-side dry run; the plain manifests are the chart rendered; and the mock chart's
agent runs on this machine exactly as its container would (tests/integration/helmchart.py), with
the chart's ServiceAccount through in-cluster configuration: with only the chart's RBAC it
registers its node, runs a pod, serves its logs, and may do nothing it does not need.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from vkubelet.devcluster import Cluster, ensure_helm, kubernetes_version
from vkubelet.testing import Kubectl, wait_for

from .helmchart import (
    CHART,
    ROOT,
    Installed,
    PodAgent,
    agent_as_pod,
    can_i,
    installed_chart,
    pod_runs_and_logs,
    render,
)

pytestmark = pytest.mark.integration

PROVIDERS = ("mock", "ssh", "cluster")  # not vm: the chart refuses it (test_helm_chart_vm.py)


@pytest.fixture(scope="module")
def helm() -> Path:
    return ensure_helm(lambda line: print(line, file=sys.stderr, flush=True))


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
    docs = render(helm, "kube-system", "--values", str(values))
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "ClusterRole", "Deployment", "ConfigMap"} <= kinds
    text = "\n---\n".join(yaml.safe_dump(d) for d in docs)
    result = kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=text)
    assert "serverside-applied (server dry run)" in result.stdout


@pytest.fixture(scope="module")
def installed(helm: Path, kubectl: Kubectl) -> Iterator[Installed]:
    """The mock chart's ServiceAccount, ConfigMap and RBAC exactly as rendered, with the
    fallback identity (`identity: serviceAccount`): the grants below are its RBAC's."""
    node = f"vk-helm-{uuid.uuid4().hex[:6]}"
    values = {"identity": "serviceAccount", "providerConfig": {node: {"pods": "20"}}}
    with installed_chart(helm, kubectl, node, values) as chart:
        yield chart


@pytest.fixture(scope="module")
def agent(
    installed: Installed,
    kube_cluster: Cluster,
    kubectl: Kubectl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PodAgent]:
    with agent_as_pod(installed, kube_cluster, kubectl, tmp_path_factory.mktemp("pod")) as agent:
        yield agent


def test_the_agent_with_the_charts_account_runs_a_pod_and_serves_its_logs(
    agent: PodAgent, installed: Installed, kubectl: Kubectl
) -> None:
    assert pod_runs_and_logs(kubectl, installed)
    # Nothing it tried was refused: the RBAC covers what the agent does.
    assert "forbidden" not in agent.log().lower(), agent.log()
    # It wrote only to the chart's volumes (the image's root filesystem is read-only).
    assert list(agent.home.iterdir()) == []


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
    probe = installed.container["livenessProbe"]["httpGet"]
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


def test_the_default_node_identity_reads_only_what_its_pods_reference(
    helm: Path, kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    """The chart's default, `identity: node`: the ServiceAccount only obtains the node's client
    certificate (kube-controller-manager approves its CSR, no human step); the agent then acts as
    system:node:<name> under the Node authorizer. Its pods run and serve logs, a Secret a pod
    references is read, and neither the account nor the node may list Secrets cluster-wide."""
    node = f"vk-helm-node-{uuid.uuid4().hex[:6]}"
    values = {"providerConfig": {node: {"pods": "20"}}}  # the default identity
    with (
        installed_chart(helm, kubectl, node, values) as installed,
        agent_as_pod(installed, kube_cluster, kubectl, tmp_path / "pod") as agent,
    ):
        assert "--bootstrap-in-cluster" in installed.container["args"]
        # The node's client certificate: asked for by the account, approved by the controller.
        (csr,) = [
            c
            for c in kubectl.json("get", "csr")["items"]
            if c["spec"]["username"] == installed.user
            and c["spec"]["signerName"] == "kubernetes.io/kube-apiserver-client-kubelet"
        ]
        assert csr["status"]["conditions"][0]["reason"] == "AutoApproved"
        as_node = Kubectl(tmp_path / "pod" / "state" / "pki" / f"{node}.kubeconfig")
        whoami = json.loads(as_node("auth", "whoami", "-o", "json").stdout)
        assert whoami["status"]["userInfo"]["username"] == f"system:node:{node}"

        # A pod whose env names a Secret runs (the node read that Secret) and serves its logs.
        where = ("-n", installed.namespace)
        kubectl(*where, "create", "secret", "generic", "mine", "--from-literal=k=from-a-secret")
        kubectl(*where, "create", "secret", "generic", "other", "--from-literal=k=not-yours")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "p",
                "namespace": installed.namespace,
                "annotations": {"mock.vkubelet.io/print-env": "true"},
            },
            "spec": {
                "nodeName": node,
                "tolerations": [{"operator": "Exists"}],
                "containers": [
                    {
                        "name": "main",
                        "image": "busybox",
                        "env": [
                            {
                                "name": "K",
                                "valueFrom": {"secretKeyRef": {"name": "mine", "key": "k"}},
                            }
                        ],
                    }
                ],
            },
        }
        kubectl.apply(pod)
        wait_for(
            lambda: kubectl.json(*where, "get", "pod", "p")["status"].get("phase") == "Running",
            what="pod p Running",
        )
        wait_for(
            lambda: "K=from-a-secret" in kubectl(*where, "logs", "p", check=False).stdout,
            what="the Secret's value in kubectl logs",
        )

        # With its own credentials, for real: no Secret it was not given, no list of any.
        refused = as_node("get", "secrets", "-A", check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower()
        other = as_node(*where, "get", "secret", "other", check=False)
        assert other.returncode != 0 and "forbidden" in other.stderr.lower()
        assert as_node(*where, "get", "secret", "mine", "-o", "name").stdout.strip()
        # ...and the account it was obtained with may not either.
        for verb in ("list", "watch", "get"):
            answer = kubectl("auth", "can-i", verb, "secrets", "-A", "--as", installed.user,
                             check=False).stdout.strip()  # fmt: skip
            assert answer == "no", (verb, answer)
        # The Node authorizer's answer to the node: "no - node: No Object name found".
        assert can_i(kubectl, installed, "list", "secrets", "").startswith("no")
        assert can_i(kubectl, installed, "list", "configmaps", "").startswith("no")

        kubectl(*where, "delete", "pod", "p", "--wait=true", timeout=90)
        assert "forbidden" not in agent.log().lower(), agent.log()
