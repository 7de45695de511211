"""The ClusterProvider class driven as the agent would drive a pass-through provider, against
two real clusters: the upper pod as its apiserver stores it, plus its references, becomes a
running lower pod; status comes up pushed; an image update reaches it; a restarted provider
adopts it without re-creating it; a lower pod deleted behind its back fails the upper pod; the
lower scheduler's refusal is visible, a pod no single lower node can take is refused at once; the
node's capacity and labels come from the lower nodes.

(The agent does not yet hand providers pods as written, so this test plays the agent's part.)
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from lightkube.resources.core_v1 import Node, Pod

from vkubelet.providers.cluster import ClusterProvider, load_lower_config, open_lower
from vkubelet.sdk import ContainerLogOptions, ProviderContext, ProviderError, ResolvedPod
from vkubelet.testing import Kubectl, create_namespace
from vkubelet.testing.harness import eventually

from ..clusters import LowerCluster as LowerTestCluster
from ..clusters import restart_clients_of_the_apiserver

JSON = dict[str, Any]


@pytest.fixture
def shop(kubectl: Kubectl) -> Iterator[str]:
    namespace = f"shop-{uuid.uuid4().hex[:6]}"
    create_namespace(kubectl, namespace)
    yield namespace
    kubectl("delete", "namespace", namespace, "--wait=false")


def test_the_provider_runs_adopts_updates_and_fails_pods_in_the_lower_cluster(
    kubectl: Kubectl, lower_cluster: LowerTestCluster, shop: str, tmp_path: Path
) -> None:
    node_name = f"vk-{uuid.uuid4().hex[:6]}"
    kubectl("-n", shop, "create", "configmap", "web-config", "--from-literal=color=blue")
    kubectl("-n", shop, "create", "secret", "generic", "web-secret", "--from-literal=pw=hunter2x")

    def upper_pod(name: str, cpu: str = "100m", **more: Any) -> tuple[Pod, dict[Any, Any]]:
        manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {"app": "web"},
                # The lower mock node "prints" the env it resolved: proof the copies work below.
                "annotations": {"mock.vkubelet.io/print-env": "true"},
            },
            "spec": {
                **more,
                "nodeName": node_name,
                "containers": [
                    {
                        "name": "app",
                        "image": "registry.example/web:1",
                        "resources": {"requests": {"cpu": cpu}},
                        "envFrom": [{"configMapRef": {"name": "web-config"}}],
                        "env": [
                            {
                                "name": "PW",
                                "valueFrom": {"secretKeyRef": {"name": "web-secret", "key": "pw"}},
                            }
                        ],
                    }
                ],
            },
        }
        kubectl("-n", shop, "apply", "-f", "-", input=json.dumps(manifest))
        stored = kubectl.json("-n", shop, "get", "pod", name)
        refs = {
            (kind, shop, ref): kubectl.json("-n", shop, "get", kind.lower(), ref)
            for kind, ref in (("ConfigMap", "web-config"), ("Secret", "web-secret"))
        }
        return msgspec.convert(stored, Pod), refs

    config_path = tmp_path / "lower.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": str(lower_cluster.kubeconfig),
                "upperClusterID": "upper-test",
                "namespaces": {"prefix": "up-"},
                # A long capacity resync: changes must come through the watches.
                "resync": {"pods": 5, "nodes": 120},
            }
        )
    )
    events = RecordedEvents()
    context = ProviderContext(
        node_name=node_name,
        config_path=config_path,
        internal_ip="10.0.0.9",
        kubelet_port=0,
        events=events,
    )
    lk = lower_cluster.kubectl
    lower_ns = "up-" + shop

    def new_provider() -> ClusterProvider:
        config = load_lower_config(config_path)
        return ClusterProvider(config, context, open_lower(config))

    async def scenario() -> None:
        provider = new_provider()
        pushed: list[Pod] = []
        provider.notify_pods(pushed.append)
        web, refs = upper_pod("web-0")
        await create(provider, ResolvedPod(web, references=refs))

        async def phase(p: ClusterProvider, name: str) -> str | None:
            status = await p.get_pod_status(shop, name)
            return None if status is None else status.phase

        await eventually(
            lambda: _eq(phase(provider, "web-0"), "Running"),
            what="web-0 Running",
            within=60,
            interval=0.3,
        )
        await eventually(
            lambda: any(p.status and p.status.podIP for p in pushed),
            what="a pushed status with the lower pod IP",
            within=60,
            interval=0.3,
        )
        below = lk.json("-n", lower_ns, "get", "pod", "web-0")
        assert "hunter2x" not in json.dumps(below)
        status = await provider.get_pod_status(shop, "web-0")
        assert status is not None and status.podIP == below["status"]["podIP"]
        assert status.hostIP == "10.0.0.9"

        # The lower scheduler's event comes up, naming the lower node.
        await eventually(
            lambda: any(e[1] == "Scheduled" for e in events.pods if e[0] == "web-0"),
            what="the lower Scheduled event mirrored",
            within=60,
            interval=0.3,
        )
        scheduled = next(e for e in events.pods if e[0] == "web-0" and e[1] == "Scheduled")
        assert scheduled[2].startswith("lower cluster: Successfully assigned")
        assert below["spec"]["nodeName"] in scheduled[2]

        # `kubectl logs` upstairs reads the lower pod's log: the env the lower node resolved
        # from the lower copies, though the lower pod spec holds no value.
        logs = b"".join(
            [
                chunk
                async for chunk in provider.container_logs(
                    shop, "web-0", "app", ContainerLogOptions(timestamps=True)
                )
            ]
        ).decode()
        assert "PW=hunter2x" in logs and "color=blue" in logs, logs
        tail = b"".join(
            [
                c
                async for c in provider.container_logs(
                    shop, "web-0", "app", ContainerLogOptions(tail_lines=1)
                )
            ]
        )
        assert tail.count(b"\n") == 1

        # `kubectl top`: the lower kubelets' numbers for our pod, under its upper name.
        if os.geteuid() == 0:  # the lower nodes have proxiable addresses (see clusters.py)
            summary = await provider.stats_summary()
            [stats] = summary["pods"]
            assert web.metadata is not None
            assert stats["podRef"] == {"namespace": shop, "name": "web-0", "uid": web.metadata.uid}
            assert summary["node"]["nodeName"] == node_name
            assert summary["node"]["cpu"]["usageNanoCores"] == stats["cpu"]["usageNanoCores"] > 0
            metrics = await provider.metrics_resource()
            assert f'namespace="{shop}",pod="web-0"' in metrics
            assert lower_ns not in metrics
            assert "\nnode_cpu_usage_seconds_total " in metrics

        # An image change upstairs reaches the lower pod.
        updated = kubectl.json("-n", shop, "get", "pod", "web-0")
        updated["spec"]["containers"][0]["image"] = "registry.example/web:2"
        await provider.update_pod(ResolvedPod(msgspec.convert(updated, Pod), references=refs))
        image = lk.json("-n", lower_ns, "get", "pod", "web-0")["spec"]["containers"][0]["image"]
        assert image == "registry.example/web:2"

        # An in-place resize upstairs is sent to the lower pod's resize subresource. (Upstairs
        # it needs the node to exist, so the test edits the stored pod.) The lower mock nodes do
        # not declare resize support, so the lower API refuses: that refusal is what comes back.
        resized = json.loads(json.dumps(updated))
        resized["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "200m"
        with pytest.raises(ProviderError) as refused:
            await provider.update_pod(ResolvedPod(msgspec.convert(resized, Pod), references=refs))
        assert refused.value.message.startswith("lower cluster: resize the lower pod: ")
        assert "resize" in refused.value.message.split(": ", 2)[2]

        # Capacity and labels come from the lower nodes.
        node = msgspec.convert(
            {"metadata": {"name": node_name, "labels": {"type": "virtual-kubelet"}}, "status": {}},
            Node,
        )

        async def configured() -> bool:
            provider.configure_node(node)
            return bool(node.status and node.status.allocatable)

        await eventually(
            configured, what="capacity from the lower cluster", within=60, interval=0.3
        )
        assert node.metadata is not None and node.metadata.labels is not None
        assert node.metadata.labels["topology.kubernetes.io/region"] == "eu"
        assert node.status is not None and node.status.allocatable is not None
        assert node.status.allocatable["example.com/gpu"] == "2"
        pods_before = int(node.status.allocatable["pods"])

        # A cordon below shows upstairs within seconds.
        node_c = lower_cluster.node("lower-c").name
        lk("cordon", node_c)
        try:

            async def shrunk() -> bool:
                provider.configure_node(node)
                assert node.status is not None and node.status.allocatable is not None
                return int(node.status.allocatable["pods"]) < pods_before

            await eventually(
                shrunk, what="the cordon reflected in the capacity", within=10, interval=0.3
            )
        finally:
            lk("uncordon", node_c)
        await provider.aclose()

        # A restarted provider adopts the pod: same lower pod, nothing re-created.
        lower_uid = lk.json("-n", lower_ns, "get", "pod", "web-0")["metadata"]["uid"]
        provider = new_provider()
        pushed = []
        provider.notify_pods(pushed.append)
        listed = await provider.list_pods()
        assert [(p.metadata.name, p.metadata.uid) for p in listed if p.metadata] == [
            ("web-0", web.metadata.uid if web.metadata else None)
        ]
        await create(provider, ResolvedPod(msgspec.convert(updated, Pod), references=refs))
        assert lk.json("-n", lower_ns, "get", "pod", "web-0")["metadata"]["uid"] == lower_uid

        # Deleted below behind our back: the upper pod fails, with the reason.
        lk("-n", lower_ns, "delete", "pod", "web-0", "--grace-period=0", "--force")
        await eventually(
            lambda: _eq(phase(provider, "web-0"), "Failed"),
            what="web-0 Failed",
            within=60,
            interval=0.3,
        )
        failed = await provider.get_pod_status(shop, "web-0")
        assert failed is not None and failed.reason == "LowerPodDeleted"

        # Too big for any single lower node: refused at once (the fit check on the capacity
        # loop's snapshot), nothing created below.
        huge, refs = upper_pod("huge-0", cpu="64")
        with pytest.raises(ProviderError) as refused:
            await create(provider, ResolvedPod(huge, references=refs))
        assert refused.value.reason == "LowerClusterCannotFit", refused.value
        assert "lacking cpu" in refused.value.message
        assert "huge-0" not in lk("-n", lower_ns, "get", "pods", "-o", "name").stdout

        # What the fit check does not model (pod affinity): the lower scheduler's reason shows
        # upstairs.
        never = {"matchLabels": {"app": f"nothing-{uuid.uuid4().hex[:6]}"}}
        affinity = {
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": never, "topologyKey": "kubernetes.io/hostname"}
                ]
            }
        }
        big, refs = upper_pod("big-0", affinity=affinity)
        await create(provider, ResolvedPod(big, references=refs))

        async def unschedulable() -> bool:
            status = await provider.get_pod_status(shop, "big-0")
            return status is not None and status.reason == "Unschedulable"

        await eventually(unschedulable, what="big-0 Unschedulable below", within=60, interval=0.3)
        status = await provider.get_pod_status(shop, "big-0")
        assert status is not None and status.phase == "Pending"
        assert status.message is not None and "affinity" in status.message

        # Deleting through the provider removes the lower pod and reports it stopped.
        await provider.delete_pod(big, 0)
        await eventually(
            lambda: any(
                p.metadata and p.metadata.name == "big-0" and p.status and p.status.phase
                for p in pushed
            ),
            what="big-0's final status pushed",
            within=60,
            interval=0.3,
        )
        assert lk("-n", lower_ns, "get", "pod", "big-0", check=False).returncode != 0
        await provider.aclose()

    asyncio.run(scenario())
    lk("delete", "namespace", lower_ns, "--wait=false")


async def create(provider: ClusterProvider, pod: ResolvedPod) -> None:
    """create_pod, retried on transient errors as the agent's queue does."""
    deadline = time.monotonic() + 30
    while True:
        try:
            await provider.create_pod(pod)
            return
        except ProviderError as e:
            if e.permanent or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.5)


class RecordedEvents:
    def __init__(self) -> None:
        self.pods: list[tuple[str, str, str]] = []

    def pod_event(self, pod: Pod, type: str, reason: str, message: str) -> None:
        self.pods.append((str(pod.metadata.name if pod.metadata else ""), reason, message))

    def node_event(self, node_name: str, type: str, reason: str, message: str) -> None:
        pass


async def _eq(value: Awaitable[Any], expected: Any) -> bool:
    return bool((await value) == expected)


def test_an_unreachable_lower_cluster_makes_the_node_not_ready_and_fails_no_pod(
    kubectl: Kubectl, lower_cluster: LowerTestCluster, shop: str, tmp_path: Path
) -> None:
    node_name = f"vk-{uuid.uuid4().hex[:6]}"
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "steady"},
        "spec": {"nodeName": node_name, "containers": [{"name": "app", "image": "busybox"}]},
    }
    kubectl("-n", shop, "apply", "-f", "-", input=json.dumps(manifest))
    upper = msgspec.convert(kubectl.json("-n", shop, "get", "pod", "steady"), Pod)
    config_path = tmp_path / "lower.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": str(lower_cluster.kubeconfig),
                "upperClusterID": "upper-outage",
                "resync": {"pods": 2, "nodes": 1},
            }
        )
    )
    context = ProviderContext(
        node_name=node_name, config_path=config_path, internal_ip="10.0.0.9", kubelet_port=0
    )
    cluster = lower_cluster.cluster
    reused = bool(os.environ.get("VKUBELET_LOWER_CLUSTER"))

    async def scenario() -> None:
        config = load_lower_config(config_path)
        provider = ClusterProvider(config, context, open_lower(config))
        pushed: list[Pod] = []
        provider.notify_pods(pushed.append)
        await create(provider, ResolvedPod(upper))

        async def phase() -> str | None:
            status = await provider.get_pod_status(shop, "steady")
            return None if status is None else status.phase

        await eventually(
            lambda: _eq(phase(), "Running"), what="steady Running", within=60, interval=0.3
        )
        lower_uid = lower_cluster.kubectl.json("-n", shop, "get", "pod", "steady")["metadata"][
            "uid"
        ]
        await provider.ping()
        assert provider.node_conditions() == []

        cluster.stop_component("kube-apiserver")
        try:
            with pytest.raises(Exception):  # noqa: B017  (Unreachable, whatever the cause)
                await provider.ping()
            [condition] = provider.node_conditions()
            assert (condition.type, condition.status) == ("Ready", "False")
            assert condition.reason == "LowerClusterUnreachable"
            # Over a window longer than the pod resync: the pod is never declared lost.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                assert await phase() == "Running"
                await asyncio.sleep(0.5)
        finally:
            cluster.start_component("kube-apiserver", tie_to_parent=not reused)
            restart_clients_of_the_apiserver(cluster, tie_to_parent=not reused)

        async def healthy() -> bool:
            try:
                await provider.ping()
            except Exception:
                return False
            return provider.node_conditions() == []

        await eventually(healthy, what="the lower cluster answering again", within=90, interval=0.3)
        # The pod watch is back (it sees a change made after the outage) and, having re-listed,
        # still finds the pod: nothing failed or redone.
        lower_cluster.kubectl("-n", shop, "annotate", "pod", "steady", "healed=yes")

        async def watch_back() -> bool:
            seen = provider._lower_pods.get(f"{shop}/steady") or {}
            return bool((seen.get("metadata") or {}).get("annotations", {}).get("healed") == "yes")

        await eventually(
            watch_back,
            what="the pod watch to see a change after the outage",
            within=90,
            interval=0.3,
        )
        assert await phase() == "Running"
        assert not any(p.status and p.status.phase == "Failed" for p in pushed)
        below = lower_cluster.kubectl.json("-n", shop, "get", "pod", "steady")
        assert below["metadata"]["uid"] == lower_uid
        await provider.delete_pod(upper, 0)
        await provider.aclose()

    asyncio.run(scenario())


def test_two_upper_clusters_share_a_lower_cluster_without_touching_each_other(
    kubectl: Kubectl, lower_cluster: LowerTestCluster, shop: str, tmp_path: Path
) -> None:
    """Two providers standing for two upper clusters (same pod and ConfigMap names upstairs, as
    two real clusters would have): each runs its pods, copies its own dependencies, and cleaning
    up one leaves the other's alone; a pod name both want in one lower namespace is refused to
    the second, with the first one's name in the message."""
    kubectl("-n", shop, "create", "configmap", "app-config", "--from-literal=k=v")
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app-0"},
        "spec": {
            "nodeName": "vk-shared",
            "containers": [
                {
                    "name": "app",
                    "image": "busybox",
                    "envFrom": [{"configMapRef": {"name": "app-config"}}],
                }
            ],
        },
    }
    kubectl("-n", shop, "apply", "-f", "-", input=json.dumps(manifest))
    upper = msgspec.convert(kubectl.json("-n", shop, "get", "pod", "app-0"), Pod)
    refs = {("ConfigMap", shop, "app-config"): kubectl.json("-n", shop, "get", "cm", "app-config")}
    lk = lower_cluster.kubectl

    def provider(cluster_id: str, prefix: str) -> ClusterProvider:
        path = tmp_path / f"{cluster_id}.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "kubeconfig": str(lower_cluster.kubeconfig),
                    "upperClusterID": cluster_id,
                    "namespaces": {"prefix": prefix},
                }
            )
        )
        config = load_lower_config(path)
        context = ProviderContext(
            node_name="vk-shared", config_path=path, internal_ip="10.0.0.9", kubelet_port=0
        )
        return ClusterProvider(config, context, open_lower(config))

    async def started(cluster_id: str, prefix: str) -> ClusterProvider:
        """A provider as the agent starts one: its pods below listed before any create."""
        fresh = provider(cluster_id, prefix)
        await fresh.list_pods()
        return fresh

    async def scenario() -> None:
        a, b = await started("upper-a", "shared-"), await started("upper-b", "shared-")
        await create(a, ResolvedPod(upper, references=refs))
        with pytest.raises(ProviderError) as raised:
            await create(b, ResolvedPod(upper, references=refs))
        assert raised.value.reason == "LowerNameConflict"
        assert (
            "owned by virtual node 'vk-shared' of upper cluster 'upper-a'" in raised.value.message
        )
        await b.aclose()
        # In a namespace of its own, b's pod runs beside a's.
        b = await started("upper-b", "b-")
        await create(b, ResolvedPod(upper, references=refs))
        await eventually(
            lambda: _eq(_phase(a, shop, "app-0"), "Running"),
            what="a's app-0 Running",
            within=60,
            interval=0.3,
        )
        await eventually(
            lambda: _eq(_phase(b, shop, "app-0"), "Running"),
            what="b's app-0 Running",
            within=60,
            interval=0.3,
        )
        copies = {
            item["metadata"]["namespace"]: item["metadata"]["name"]
            for ns in ("shared-" + shop, "b-" + shop)
            for item in lk.json("-n", ns, "get", "configmaps", "-l", "vkubelet.io/owner")["items"]
        }
        assert len(copies) == 2 and len(set(copies.values())) == 2
        # a stops its pod: its copy goes, b's pod and copy stay.
        await a.delete_pod(upper, 0)
        await eventually(
            lambda: (
                not lk.json("-n", "shared-" + shop, "get", "configmaps", "-l", "vkubelet.io/owner")[
                    "items"
                ]
            ),
            what="a's copy removed once its pod is gone",
            within=60,
            interval=0.3,
        )
        assert lk.json("-n", "b-" + shop, "get", "pod", "app-0")["status"]["phase"] == "Running"
        assert lk.json("-n", "b-" + shop, "get", "configmap", copies["b-" + shop])
        await b.delete_pod(upper, 0)
        await a.aclose()
        await b.aclose()

    asyncio.run(scenario())
    for ns in ("shared-" + shop, "b-" + shop):
        lk("delete", "namespace", ns, "--wait=false", "--ignore-not-found")


async def _phase(provider: ClusterProvider, namespace: str, name: str) -> str | None:
    status = await provider.get_pod_status(namespace, name)
    return None if status is None else status.phase
