"""The dev cluster is a real control plane: apiserver, scheduler, controller-manager and CSR signer
all do their jobs, judged through real kubectl."""

import base64
import json
import re
import uuid
from pathlib import Path

from vkubelet.devcluster import Cluster, write_kubeconfig
from vkubelet.devcluster._pki import csr_pem, new_key
from vkubelet.testing import Kubectl, wait_for


def _namespace(kubectl: Kubectl) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    return name


def test_apiserver_reports_ready(kubectl: Kubectl) -> None:
    assert kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    version = json.loads(kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.37.")


def test_deployment_gets_a_replicaset_and_pods(kubectl: Kubectl) -> None:
    ns = _namespace(kubectl)
    kubectl("-n", ns, "create", "deployment", "web", "--image=nginx", "--replicas=2")
    rs = wait_for(
        lambda: kubectl.json("-n", ns, "get", "replicasets", "-l", "app=web")["items"],
        what="the deployment controller to create a ReplicaSet",
    )
    assert rs[0]["spec"]["replicas"] == 2
    pods = wait_for(
        lambda: len(kubectl.json("-n", ns, "get", "pods", "-l", "app=web")["items"]) == 2,
        what="the replicaset controller to create 2 pods",
    )
    assert pods


def test_unschedulable_pod_stays_pending_with_failed_scheduling_event(kubectl: Kubectl) -> None:
    ns = _namespace(kubectl)
    kubectl("-n", ns, "run", "lonely", "--image=busybox", "--restart=Never")

    def failed_scheduling() -> list[dict[str, object]]:
        events = kubectl.json(
            "-n", ns, "get", "events", "--field-selector", "involvedObject.name=lonely"
        )["items"]
        return [e for e in events if e["reason"] == "FailedScheduling"]

    events = wait_for(failed_scheduling, what="a FailedScheduling event from the scheduler")
    # "no nodes available to schedule pods", or "0/N nodes are available: ..." once nodes exist
    assert re.search(r"nodes (are )?available", str(events[0]["message"]))
    pod = kubectl.json("-n", ns, "get", "pod", "lonely")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_kubelet_csr_is_signed_and_its_identity_is_limited_by_the_node_authorizer(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    node = f"csr-node-{uuid.uuid4().hex[:6]}"
    key = new_key()
    csr_name = f"{node}-client"
    kubectl.apply(
        {
            "apiVersion": "certificates.k8s.io/v1",
            "kind": "CertificateSigningRequest",
            "metadata": {"name": csr_name},
            "spec": {
                "request": base64.b64encode(
                    csr_pem(key, f"system:node:{node}", ("system:nodes",))
                ).decode(),
                "signerName": "kubernetes.io/kube-apiserver-client-kubelet",
                "usages": ["digital signature", "client auth"],
            },
        }
    )
    kubectl("certificate", "approve", csr_name)
    cert_b64 = wait_for(
        lambda: kubectl.json("get", "csr", csr_name).get("status", {}).get("certificate"),
        what="the controller-manager to sign the approved CSR",
    )
    from cryptography.hazmat.primitives import serialization

    node_kubeconfig = tmp_path / "node.kubeconfig"
    write_kubeconfig(
        node_kubeconfig,
        cluster="dev",
        server=kube_cluster.server,
        ca_pem=(kube_cluster.pki / "ca.crt").read_bytes(),
        user=node,
        cert_pem=base64.b64decode(cert_b64),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    as_node = Kubectl(node_kubeconfig)

    whoami = json.loads(as_node("auth", "whoami", "-o", "json").stdout)["status"]["userInfo"]
    assert whoami["username"] == f"system:node:{node}"
    assert "system:nodes" in whoami["groups"]

    ns = _namespace(kubectl)
    kubectl("-n", ns, "create", "secret", "generic", "unrelated", "--from-literal=k=v")
    denied = as_node("-n", ns, "get", "secret", "unrelated", check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr
    assert "no relationship found between node" in denied.stderr

    # The same identity may register its own Node, but NodeRestriction stops it touching others.
    own = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    other = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"{node}-other"}}
    try:
        as_node("create", "-f", "-", input=json.dumps(own))
        refused = as_node("create", "-f", "-", input=json.dumps(other), check=False)
        assert refused.returncode != 0
        assert "Forbidden" in refused.stderr
    finally:
        kubectl("delete", "node", node, f"{node}-other", "--ignore-not-found")


def test_any_authenticated_user_can_read_the_dev_cluster_marker_and_nothing_else_there(
    kube_cluster: Cluster, kubectl: Kubectl, tmp_path: Path
) -> None:
    from vkubelet.testing import node_kubeconfig

    marker = kubectl.json("-n", "kube-public", "get", "configmap", "vkubelet-dev-cluster")
    assert marker["data"] == {"name": kube_cluster.name}
    kubectl("-n", "kube-public", "create", "configmap", "other", "--from-literal=k=v")
    try:
        # A node's identity has no RBAC of its own; the marker's Role is for system:authenticated.
        node = f"marker-node-{uuid.uuid4().hex[:6]}"
        as_node = Kubectl(
            node_kubeconfig(kube_cluster, kubectl, node, tmp_path / "node.kubeconfig")
        )
        seen = json.loads(
            as_node(
                "-n", "kube-public", "get", "configmap", "vkubelet-dev-cluster", "-o", "json"
            ).stdout
        )
        assert seen["data"]["name"] == kube_cluster.name
        for denied in (
            ("-n", "kube-public", "get", "configmap", "other"),
            ("-n", "kube-public", "get", "configmaps"),
            ("-n", "kube-public", "delete", "configmap", "vkubelet-dev-cluster"),
        ):
            result = as_node(*denied, check=False)
            assert result.returncode != 0 and "Forbidden" in result.stderr, denied
    finally:
        kubectl("-n", "kube-public", "delete", "configmap", "other", "--ignore-not-found")
