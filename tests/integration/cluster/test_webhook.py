"""The constraint webhook against two real clusters, the real agent and real kubectl: a pod asking
for `disktype: ssd` (a label only one lower node has, so the virtual node does not publish it) is
admitted upstairs with that selector moved into the annotation, scheduled to the virtual node and
run below on the ssd node. With the agent stopped, pods are still created (failurePolicy Ignore)
and, once it is back, each one it never saw gets a Warning Event naming the webhook. kube-system
is never touched, even labelled to opt in."""

from __future__ import annotations

import contextlib
import json
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    node_ready,
    start_agent,
    wait_for,
)

from ..clusters import LowerCluster

JSON = dict[str, Any]
TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}
OPT_IN = "vkubelet.io/constraint-webhook"
ANNOTATION = "vkubelet.io/lower-constraints"
SKIPPED = "ConstraintWebhookSkipped"


@dataclass
class WebhookNode:
    name: str
    agent: AgentProcess
    ssd_node: str  # the one lower node labelled disktype=ssd
    namespace: str  # opted in upstairs (namespace label)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def webhook_node(
    kube_cluster: Cluster,
    kubectl: Kubectl,
    lower_cluster: LowerCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WebhookNode]:
    workdir = tmp_path_factory.mktemp("webhook")
    name = f"vk-wh-{uuid.uuid4().hex[:6]}"
    lk = lower_cluster.kubectl
    ssd_node = lower_cluster.node("lower-b").name
    namespace = f"wh-{uuid.uuid4().hex[:6]}"
    config = workdir / "lower.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": str(lower_cluster.kubeconfig),
                "upperClusterID": f"wh-{uuid.uuid4().hex[:6]}",
                "webhook": {
                    "enabled": True,
                    "port": _free_port(),
                    "timeoutSeconds": 2,
                    "auditSeconds": 2,
                },
            }
        )
    )
    with contextlib.ExitStack() as cleanup:
        # Labelled before the agent starts, so its first snapshot (fit check) has the label.
        lk("label", "node", ssd_node, "disktype=ssd", "--overwrite")
        cleanup.callback(lk, "label", "node", ssd_node, "disktype-", check=False)
        agent = start_agent(
            kube_cluster, workdir, provider="cluster", config=config, name=name, address="127.0.0.1"
        )
        cleanup.callback(lambda: print(agent.log()[-6000:]))
        cleanup.callback(kubectl, "delete", "node", name, "--ignore-not-found", "--wait=false")
        cleanup.callback(
            kubectl,
            "delete",
            "mutatingwebhookconfiguration",
            f"vkubelet-constraints-{name}",
            "--ignore-not-found",
            check=False,
        )
        cleanup.callback(agent.stop)
        create_namespace(kubectl, namespace)
        cleanup.callback(kubectl, "delete", "namespace", namespace, "--wait=false", check=False)
        cleanup.callback(lk, "delete", "namespace", namespace, "--wait=false", check=False)
        kubectl("label", "namespace", namespace, f"{OPT_IN}=enabled")
        wait_for(lambda: node_ready(kubectl, name), what=f"node {name} Ready")
        wait_for(lambda: webhook_serves(kubectl, namespace), what="the webhook to answer")
        yield WebhookNode(name, agent, ssd_node, namespace)


def pod(name: str, node: str, labels: dict[str, str] | None = None) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "nodeSelector": {"disktype": "ssd", "kubernetes.io/hostname": node},
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "registry.example/db:1"}],
        },
    }


def create(kubectl: Kubectl, namespace: str, manifest: JSON) -> JSON:
    created: JSON = json.loads(
        kubectl(
            "-n", namespace, "create", "-o", "json", "-f", "-", input=json.dumps(manifest)
        ).stdout
    )
    return created


def webhook_serves(kubectl: Kubectl, namespace: str) -> bool:
    """A server-side dry run goes through admission: annotated once the webhook answers."""
    probe = pod(f"probe-{uuid.uuid4().hex[:6]}", "nowhere")
    out = kubectl(
        "-n",
        namespace,
        "create",
        "--dry-run=server",
        "-o",
        "json",
        "-f",
        "-",
        input=json.dumps(probe),
    )
    return ANNOTATION in (json.loads(out.stdout)["metadata"].get("annotations") or {})


def skipped_events(kubectl: Kubectl, namespace: str, name: str) -> list[JSON]:
    events: list[JSON] = kubectl.json(
        "-n",
        namespace,
        "get",
        "events",
        "--field-selector",
        f"involvedObject.name={name},reason={SKIPPED}",
    )["items"]
    return events


def test_a_ssd_pod_is_admitted_scheduled_to_the_virtual_node_and_runs_below_on_the_ssd_node(
    kubectl: Kubectl, lower_cluster: LowerCluster, webhook_node: WebhookNode
) -> None:
    ns, node = webhook_node.namespace, webhook_node.name
    created = create(kubectl, ns, pod("db", node))
    # Upstairs: only the virtual-node selection is left for the upper scheduler.
    assert created["spec"]["nodeSelector"] == {"kubernetes.io/hostname": node}
    moved = json.loads(created["metadata"]["annotations"][ANNOTATION])
    assert moved["nodeSelector"] == {"disktype": "ssd"}

    def running_upstairs() -> bool:
        found: JSON = kubectl.json("-n", ns, "get", "pod", "db")
        return bool(
            found["spec"].get("nodeName") == node and found["status"].get("phase") == "Running"
        )

    wait_for(running_upstairs, timeout=60, what="pod db Running on the virtual node")
    below = lower_cluster.kubectl.json("-n", ns, "get", "pod", "db")
    assert below["spec"]["nodeName"] == webhook_node.ssd_node
    assert below["spec"]["nodeSelector"] == {"disktype": "ssd"}
    assert ANNOTATION not in (below["metadata"].get("annotations") or {})

    # A namespace that did not opt in, and a pod that did not either: not touched.
    other = create_namespace(kubectl, f"wh-other-{uuid.uuid4().hex[:6]}")
    try:
        untouched = create(kubectl, other, pod("db", node))
        assert untouched["spec"]["nodeSelector"]["disktype"] == "ssd"
        assert ANNOTATION not in (untouched["metadata"].get("annotations") or {})
        by_label = create(kubectl, other, pod("db-2", node, {OPT_IN: "enabled"}))
        assert by_label["spec"]["nodeSelector"] == {"kubernetes.io/hostname": node}
    finally:
        kubectl("delete", "namespace", other, "--wait=false")


def test_with_the_agent_stopped_pods_are_created_and_reported_when_it_returns_never_in_kube_system(
    kubectl: Kubectl, webhook_node: WebhookNode
) -> None:
    ns, node = webhook_node.namespace, webhook_node.name
    system_pods: list[str] = []
    kubectl("label", "namespace", "kube-system", f"{OPT_IN}=enabled", "--overwrite")
    try:
        # Running agent: kube-system is not touched even though it is labelled, while the
        # control pod created right after proves the webhook answered at that moment.
        system = create(
            kubectl, "kube-system", pod(f"wh-{uuid.uuid4().hex[:6]}", node, {OPT_IN: "enabled"})
        )
        system_pods.append(system["metadata"]["name"])
        assert system["spec"]["nodeSelector"]["disktype"] == "ssd"
        assert ANNOTATION not in (system["metadata"].get("annotations") or {})
        control = create(kubectl, ns, pod("control", node))
        assert ANNOTATION in control["metadata"]["annotations"]

        webhook_node.agent.stop()
        # Stopped: pods are still created (failurePolicy Ignore), constraints left in place.
        blind = create(kubectl, ns, pod("blind", node))
        assert blind["spec"]["nodeSelector"]["disktype"] == "ssd"
        assert ANNOTATION not in (blind["metadata"].get("annotations") or {})
        system = create(
            kubectl, "kube-system", pod(f"wh-{uuid.uuid4().hex[:6]}", node, {OPT_IN: "enabled"})
        )
        system_pods.append(system["metadata"]["name"])

        webhook_node.agent.start()
        events = wait_for(
            lambda: skipped_events(kubectl, ns, "blind"),
            timeout=60,
            what="a Warning Event about pod blind",
        )
        assert events[0]["type"] == "Warning"
        assert f"vkubelet-constraints-{node}" in events[0]["message"]
        # The audit has run since both were created: the kube-system pods got no warning.
        for name in system_pods:
            assert skipped_events(kubectl, "kube-system", name) == []
        assert skipped_events(kubectl, ns, "control") == []
        wait_for(lambda: node_ready(kubectl, node), what=f"node {node} Ready again")
    finally:
        kubectl("label", "namespace", "kube-system", f"{OPT_IN}-", check=False)
        for name in system_pods:
            kubectl("-n", "kube-system", "delete", "pod", name, "--wait=false", check=False)
