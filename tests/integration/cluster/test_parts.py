"""The cluster provider's parts against two real clusters: an upper pod as its apiserver stores
it (admission applied) is translated, its dependencies copied, and the lower apiserver accepts
it, the lower scheduler places it and it runs; no Secret value appears in the lower pod; edits
reach the lower copies; no stamped copy is left once no pod uses them; the lower credentials'
missing permissions are named, and the docs' ClusterRole grants all of them."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import write_kubeconfig
from vkubelet.providers.cluster import (
    LowerCluster,
    MissingPermissions,
    NamespaceMapping,
    Owner,
    PodTranslation,
    is_ours,
    load_lower_config,
    lower_capacity,
    open_lower,
    plan_dependencies,
    status_up,
    translate_pod,
)
from vkubelet.sdk import parse_quantity
from vkubelet.testing import Kubectl, create_namespace, wait_for

from ..clusters import LOWER_NODES
from ..clusters import LowerCluster as LowerTestCluster

JSON = dict[str, Any]
DOCS = Path(__file__).parents[3] / "docs" / "cluster-provider.md"
KINDS = ("configmaps", "secrets", "serviceaccounts", "persistentvolumeclaims")


def lower_yaml(tmp_path: Path, kubeconfig: Path, **extra: Any) -> Path:
    path = tmp_path / "lower.yaml"
    path.write_text(yaml.safe_dump({"kubeconfig": str(kubeconfig), **extra}))
    return path


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def with_lower(config_path: Path, work: Any) -> Any:
    lower = open_lower(load_lower_config(config_path))
    try:
        return await work(lower)
    finally:
        await lower.aclose()


@pytest.fixture
def shop(kubectl: Kubectl) -> Iterator[str]:
    namespace = f"shop-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    yield namespace
    kubectl("delete", "namespace", namespace, "--wait=false")


def test_an_upper_pod_runs_below_with_its_dependencies_and_without_secret_values(
    kubectl: Kubectl, lower_cluster: LowerTestCluster, shop: str, tmp_path: Path
) -> None:
    secret_value = f"hunter2-{uuid.uuid4().hex}"
    owner = Owner(f"upper-{uuid.uuid4().hex[:6]}", "vk-lower")
    kubectl("-n", shop, "create", "configmap", "web-config", "--from-literal=color=blue")
    kubectl(
        "-n", shop, "create", "secret", "generic", "web-secret", f"--from-literal=pw={secret_value}"
    )
    kubectl("-n", shop, "create", "serviceaccount", "web")
    pod: JSON = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web-0", "labels": {"app": "web"}},
        "spec": {
            # Bound to a node that has no agent: the pod stays as the apiserver stored it.
            "nodeName": "vk-lower",
            "serviceAccountName": "web",
            "nodeSelector": {"type": "virtual-kubelet"},
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example/web:1",
                    "resources": {"requests": {"cpu": "100m", "memory": "32Mi"}},
                    "env": [
                        {
                            "name": "PASSWORD",
                            "valueFrom": {"secretKeyRef": {"name": "web-secret", "key": "pw"}},
                        }
                    ],
                    "envFrom": [{"configMapRef": {"name": "web-config"}}],
                    "volumeMounts": [{"name": "secret", "mountPath": "/secret"}],
                }
            ],
            "volumes": [{"name": "secret", "secret": {"secretName": "web-secret"}}],
        },
    }
    kubectl("-n", shop, "apply", "-f", "-", input=json.dumps(pod))
    upper = kubectl.json("-n", shop, "get", "pod", "web-0")
    assert any(v["name"].startswith("kube-api-access-") for v in upper["spec"]["volumes"])

    def references() -> dict[tuple[str, str, str], JSON | None]:
        return {
            (kind, shop, name): kubectl.json("-n", shop, "get", kind.lower(), name)
            for kind, name in (
                ("ConfigMap", "web-config"),
                ("Secret", "web-secret"),
                ("ServiceAccount", "web"),
            )
        }

    how = PodTranslation(
        owner=owner,
        namespaces=NamespaceMapping(prefix="up-"),
        virtual_labels={"type": "virtual-kubelet", "kubernetes.io/hostname": "vk-lower"},
    )
    lower_ns = "up-" + shop
    config = lower_yaml(tmp_path, lower_cluster.kubeconfig, namespaces={"prefix": "up-"})
    lk = lower_cluster.kubectl

    async def ours_below(lower: LowerCluster) -> dict[tuple[str, str, str], JSON]:
        found = {}
        for kind in ("ConfigMap", "Secret", "ServiceAccount", "PersistentVolumeClaim"):
            for obj in await lower.list_objects(kind, selector=owner.selector):
                metadata = obj["metadata"]
                found[(kind, metadata["namespace"], metadata["name"])] = obj
        return found

    async def sync(lower: LowerCluster, pods: list[JSON]) -> list[str]:
        plan = plan_dependencies(pods, references(), await ours_below(lower), how)
        assert not (plan.missing or plan.conflicts or plan.refused), plan
        applied = await lower.apply_dependencies(plan, owner)
        return applied.problems + list(applied.conflicts.values())

    async def start(lower: LowerCluster) -> None:
        await lower.check_permissions()  # the admin may do everything
        assert await sync(lower, [upper]) == []
        await lower.create(translate_pod(upper, how))

    # A user's own object in the same lower namespace, with the name a copy would have had.
    create_namespace(lk, lower_ns)
    lk("-n", lower_ns, "create", "configmap", "web-config", "--from-literal=mine=yes")

    run(with_lower(config, start))
    below = wait_for(
        lambda: (
            (p := lk.json("-n", lower_ns, "get", "pod", "web-0"))["status"].get("phase")
            == "Running"
            and p
        ),
        what="the lower pod Running",
    )
    assert below["spec"]["nodeName"] in {n.name for n in lower_cluster.nodes.values()}
    text = json.dumps(below)
    assert secret_value not in text
    assert base64.b64encode(secret_value.encode()).decode() not in text
    # The lower token is the lower account's, mounted by the lower admission.
    assert below["spec"]["serviceAccountName"] == "web-" + owner.key[:8]
    assert is_ours(below, owner)

    status = status_up(below, upper, host_ip="10.0.0.9", now="2026-11-24T06:00:00Z")
    assert status["phase"] == "Running" and status["podIP"] == below["status"]["podIP"]

    # An edit upstairs reaches the lower copy on the next pass.
    kubectl("-n", shop, "patch", "configmap", "web-config", "-p", '{"data":{"color":"red"}}')
    assert run(with_lower(config, lambda lower: sync(lower, [upper]))) == []
    copy = lk.json("-n", lower_ns, "get", "configmap", "web-config-" + owner.key[:8])
    assert copy["data"] == {"color": "red"}

    # No pod left: no stamped copy left, and the user's own object untouched.
    lk("-n", lower_ns, "delete", "pod", "web-0", "--grace-period=0", "--force")
    assert run(with_lower(config, lambda lower: sync(lower, []))) == []
    leftovers = [
        item["metadata"]["name"]
        for kind in KINDS
        for item in lk.json("-n", lower_ns, "get", kind, "-l", owner.selector)["items"]
    ]
    assert leftovers == []
    assert lk.json("-n", lower_ns, "get", "configmap", "web-config")["data"] == {"mine": "yes"}
    lk("delete", "namespace", lower_ns, "--wait=false")


def test_capacity_matches_the_lower_nodes_and_a_cordon_lowers_it(
    lower_cluster: LowerTestCluster, tmp_path: Path
) -> None:
    config = lower_yaml(tmp_path, lower_cluster.kubeconfig)
    mine = {n.name for n in lower_cluster.nodes.values()}

    async def capacity(lower: LowerCluster) -> Any:
        nodes = [n for n in await lower.list_objects("Node") if n["metadata"]["name"] in mine]
        return lower_capacity(nodes, await lower.list_objects("Pod"), lambda pod: False)

    before = run(with_lower(config, capacity))
    assert before.usable_nodes == len(LOWER_NODES)
    assert before.allocatable["example.com/gpu"] == "2"  # only lower-a has it
    assert before.labels["topology.kubernetes.io/region"] == "eu"  # shared by all
    assert "topology.kubernetes.io/zone" not in before.labels  # differs
    assert "kubernetes.io/hostname" not in before.labels
    node_c = lower_cluster.node("lower-c").name
    lower_cluster.kubectl("cordon", node_c)
    try:
        after = run(with_lower(config, capacity))
    finally:
        lower_cluster.kubectl("uncordon", node_c)
    assert after.usable_nodes == len(LOWER_NODES) - 1
    assert (
        parse_quantity(after.allocatable["cpu"]).to_fraction()
        < parse_quantity(before.allocatable["cpu"]).to_fraction()
    )
    assert int(after.allocatable["pods"]) < int(before.allocatable["pods"])


def test_missing_permissions_are_named_and_the_documented_role_grants_them(
    lower_cluster: LowerTestCluster, tmp_path: Path
) -> None:
    lk = lower_cluster.kubectl
    account = f"vk-{uuid.uuid4().hex[:6]}"
    lk("-n", "default", "create", "serviceaccount", account)
    token = lk("-n", "default", "create", "token", account, "--duration=1h").stdout.strip()
    kubeconfig = tmp_path / "limited.kubeconfig"
    write_kubeconfig(
        kubeconfig,
        cluster="lower",
        server=lower_cluster.cluster.server,
        ca_pem=(lower_cluster.cluster.pki / "ca.crt").read_bytes(),
        user=account,
        token=token,
    )
    config = lower_yaml(tmp_path, kubeconfig)
    with pytest.raises(MissingPermissions) as raised:
        run(with_lower(config, lambda lower: lower.check_permissions()))
    message = str(raised.value)
    assert str(config) in message and str(kubeconfig) in message
    assert "denies get pods, list pods" in message and "create pods/exec" in message

    [role_yaml] = re.findall(r"```yaml\n(apiVersion: rbac.*?)```", DOCS.read_text(), re.S)
    role = yaml.safe_load(role_yaml)
    role["metadata"]["name"] = account
    lk.apply(role)
    lk(
        "create",
        "clusterrolebinding",
        account,
        f"--clusterrole={account}",
        f"--serviceaccount=default:{account}",
    )
    try:
        wait_for(
            lambda: run(with_lower(config, lambda lower: lower.check_permissions())) is None,
            timeout=20,
            what="the documented ClusterRole to grant every permission",
        )
    finally:
        lk("delete", "clusterrolebinding,clusterrole", account, "--ignore-not-found")
