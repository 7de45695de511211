"""Mirror mode's parts: a lower pod pinned to its one lower node, that node's capacity and
labels, member names, and the fleet following lower nodes that appear and vanish."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
import pytest
from lightkube.resources.core_v1 import Node

from vkubelet.kube import KubeClient
from vkubelet.node import ConfigError
from vkubelet.providers.cluster import (
    ClusterFleet,
    ClusterProvider,
    LowerCluster,
    load_lower_config,
    member_name,
    open_lower,
    translate_pod,
)
from vkubelet.providers.cluster._capacity import mirror_capacity
from vkubelet.providers.cluster._stamps import stamp
from vkubelet.testing.harness import eventually

from .fakes import context, lower_yaml, node, pod
from .pods import OWNER, how, upper_pod

JSON = dict[str, Any]


def test_a_lower_pod_is_pinned_to_its_lower_node_in_every_required_term() -> None:
    bare = translate_pod(upper_pod(), how(lower_node="lower-a"))
    terms = bare["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    pin = {"key": "metadata.name", "operator": "In", "values": ["lower-a"]}
    assert terms == [{"matchFields": [pin]}]
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    disk = {"key": "disk", "operator": "Exists"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchExpressions": [disk]}]
            }
        }
    }
    pinned = translate_pod(upper_pod(affinity=affinity), how(lower_node="lower-a"))
    terms = pinned["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [zone], "matchFields": [pin]},
        {"matchExpressions": [disk], "matchFields": [pin]},
    ]


def test_a_mirrored_node_offers_its_allocatable_minus_pods_not_ours_and_its_own_labels() -> None:
    lower = node(
        "lower-a",
        "4",
        labels={
            "topology.kubernetes.io/zone": "a",
            "node.kubernetes.io/instance-type": "m5.large",
            "kubernetes.io/arch": "arm64",
            "kubernetes.io/hostname": "lower-a",
            "node-role.kubernetes.io/worker": "",
            "node.kubernetes.io/exclude-from-external-load-balancers": "",
        },
    )
    theirs, ours, elsewhere = pod("1", "lower-a"), pod("500m", "lower-a"), pod("2", "lower-b")
    ours["metadata"]["uid"] = "ours"
    capacity = mirror_capacity(
        lower, [theirs, ours, elsewhere], lambda p: p["metadata"]["uid"] == "ours"
    )
    assert capacity.allocatable["cpu"] == "3"
    assert capacity.allocatable["pods"] == "9"
    assert capacity.labels == {
        "kubernetes.io/arch": "arm64",
        "node.kubernetes.io/instance-type": "m5.large",
        "topology.kubernetes.io/zone": "a",
    }


def test_member_names_derive_from_the_virtual_node_and_the_lower_node() -> None:
    assert member_name("lower-eu", "node-1") == "lower-eu-node-1"
    long = member_name("lower-eu", "n" * 300)
    assert len(long) <= 253 and long.startswith("lower-eu-nnn")
    assert long != member_name("lower-eu", "n" * 299)


def mirror_provider(tmp_path: Path) -> ClusterProvider:
    config = load_lower_config(lower_yaml(tmp_path))
    return ClusterProvider(
        config, context(tmp_path), open_lower(config), background=False, lower_node="lower-a"
    )


def test_a_mirrored_node_follows_its_lower_nodes_cordon_readiness_and_labels(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        provider = mirror_provider(tmp_path)
        try:
            (unknown,) = provider.node_conditions()
            assert (unknown.status, unknown.reason) == ("False", "LowerNodeUnknown")
            lower = node("lower-a", "4", labels={"topology.kubernetes.io/zone": "a"})
            lower["spec"]["unschedulable"] = True
            objects = {"Node": {"lower-a": lower}, "Pod": {}}
            provider.capacity.snapshot = objects
            provider.capacity._follow_mirrored(objects)
            configured = msgspec.convert(
                {
                    "metadata": {"name": "vk-lower", "labels": {"type": "virtual-kubelet"}},
                    "spec": {},
                    "status": {},
                },
                Node,
            )
            provider.configure_node(configured)
            assert configured.spec is not None and configured.spec.unschedulable is True
            assert configured.metadata is not None and configured.metadata.labels is not None
            assert configured.metadata.labels["topology.kubernetes.io/zone"] == "a"
            assert configured.status is not None and configured.status.allocatable is not None
            assert configured.status.allocatable["cpu"] == "4"
            assert list(provider.node_conditions()) == []

            lower["status"]["conditions"] = [
                {"type": "Ready", "status": "Unknown", "message": "Kubelet stopped posting"}
            ]
            provider.capacity._follow_mirrored(objects)
            (ready,) = provider.node_conditions()
            assert (ready.status, ready.reason) == ("False", "LowerNodeNotReady")
            assert "Kubelet stopped posting" in ready.message

            objects["Node"].clear()
            provider.capacity._follow_mirrored(objects)
            (gone,) = provider.node_conditions()
            assert gone.reason == "LowerNodeGone"
        finally:
            await provider.aclose()

    asyncio.run(scenario())


def test_the_fleet_follows_lower_nodes_appearing_and_vanishing(tmp_path: Path) -> None:
    config = load_lower_config(lower_yaml(tmp_path, mode="mirror"))
    events: asyncio.Queue[bytes] = asyncio.Queue()

    async def scenario() -> None:
        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.params.get("watch") in ("true", "1"):
                return httpx.Response(200, stream=Stream(events))
            nodes = [node("a", "1"), node("b", "1")]
            return httpx.Response(200, json={"items": nodes, "metadata": {"resourceVersion": "5"}})

        real = open_lower(config)
        lower = LowerCluster(
            KubeClient(real.client.config, transport=httpx.MockTransport(handler)), config
        )
        fleet = ClusterFleet(config, context(tmp_path), lower)
        seen = fleet.watch_nodes()
        try:
            first = await anext(seen)
            assert [m.name for m in first] == ["vk-lower-a", "vk-lower-b"]
            providers = {m.name: m.provider for m in first}
            for kind, name in (("ADDED", "c"), ("DELETED", "a")):
                events.put_nowait(
                    json.dumps({"type": kind, "object": node(name, "1")}).encode() + b"\n"
                )
            added = await asyncio.wait_for(anext(seen), 5)
            assert [m.name for m in added] == ["vk-lower-a", "vk-lower-b", "vk-lower-c"]
            removed = await asyncio.wait_for(anext(seen), 5)
            assert [m.name for m in removed] == ["vk-lower-b", "vk-lower-c"]
            assert removed[0].provider is providers["vk-lower-b"], "an unchanged member stays"
            assert isinstance(removed[0].provider, ClusterProvider)
            assert removed[0].provider.how.lower_node == "b"
            assert removed[0].provider.owner != OWNER
        finally:
            await seen.aclose()
            for member in fleet._members.values():
                assert isinstance(member.provider, ClusterProvider)
                await member.provider.aclose()
            await fleet.aclose()

    asyncio.run(scenario())


class Stream(httpx.AsyncByteStream):
    def __init__(self, queue: asyncio.Queue[bytes]) -> None:
        self.queue = queue

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield await self.queue.get()


def test_a_lower_pod_on_a_vanished_lower_node_is_deleted_without_grace(tmp_path: Path) -> None:
    async def scenario() -> None:
        provider = mirror_provider(tmp_path)
        try:
            provider.capacity.snapshot = {"Node": {"a": node("lower-a", "1")}, "Pod": {}}
            assert not provider.capacity.on_vanished_node({"spec": {"nodeName": "lower-a"}})
            assert provider.capacity.on_vanished_node({"spec": {"nodeName": "lower-x"}})
            assert not provider.capacity.on_vanished_node({"spec": {}}), (
                "not bound: the scheduler's"
            )
        finally:
            await provider.aclose()

    asyncio.run(scenario())


def test_our_lower_pods_being_deleted_on_a_lower_node_that_vanishes_are_deleted_at_once(
    tmp_path: Path,
) -> None:
    """Whichever the lower watches report first, the node's deletion or the pod's."""

    def lower(name: str, where: str, *, deleting: bool = True, ours: bool = True) -> JSON:
        obj: JSON = {"metadata": {"name": name, "namespace": "shop", "uid": f"u-{name}"}}
        obj["spec"] = {"nodeName": where}
        if ours:
            obj = stamp(obj, provider.owner, namespace="shop", name=name, uid=f"up-{name}")
        if deleting:
            obj["metadata"]["deletionTimestamp"] = "2026-11-25T00:00:00Z"
        return obj

    forced: list[str] = []

    async def force(meta: JSON) -> None:
        forced.append(meta["name"])

    async def scenario() -> None:
        try:
            provider.capacity._force_delete = force  # type: ignore[method-assign]
            pods = [
                lower("evicted", "lower-a"),
                lower("running", "lower-a", deleting=False),
                lower("elsewhere", "lower-b"),
                lower("not-ours", "lower-a", ours=False),
            ]
            provider.capacity._lower_listed(
                "Node", {"a": node("lower-a", "1"), "b": node("lower-b", "1")}
            )
            provider.capacity._lower_listed("Pod", {p["metadata"]["uid"]: p for p in pods})
            provider.capacity._lower_node_deleted(node("lower-a", "1"))
            provider.capacity.pod_changed(lower("later", "lower-a"))
            provider.capacity.pod_changed(lower("later-b", "lower-b"))
            await eventually(lambda: len(forced) == 2, what="two forced deletions")
            assert sorted(forced) == ["evicted", "later"]
        finally:
            await provider.aclose()

    provider = mirror_provider(tmp_path)
    asyncio.run(scenario())


def test_the_modes_and_their_options_are_read_and_checked(tmp_path: Path) -> None:
    config = load_lower_config(
        lower_yaml(tmp_path, mode="mirror", fitCheck=False, cannotFitBackoff=0, daemonSetPods="run")
    )
    assert (config.mode, config.fit_check, config.cannot_fit_backoff) == ("mirror", False, 0.0)
    assert config.daemon_set_pods == "run"
    default = load_lower_config(lower_yaml(tmp_path))
    assert (default.mode, default.fit_check, default.daemon_set_pods) == (
        "aggregate",
        True,
        "refuse",
    )
    with pytest.raises(ConfigError, match="mode: expected one of aggregate, mirror"):
        load_lower_config(lower_yaml(tmp_path, mode="mirrored"))
    with pytest.raises(ConfigError, match="cannotFitBackoff"):
        load_lower_config(lower_yaml(tmp_path, cannotFitBackoff=-1))
