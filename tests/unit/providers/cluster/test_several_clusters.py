"""Several lower clusters from one agent: every virtual node carries the label naming its lower
cluster (`vkubelet.io/cluster` by default, from `clusterName` or the node's name), constraints
over that label stay upstairs, and an agent config lists several cluster-provider nodes."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import msgspec
import pytest
import yaml
from lightkube.resources.core_v1 import Node

from vkubelet.agent import Agent
from vkubelet.node import ConfigError, load_agent_config
from vkubelet.providers.cluster import (
    ClusterFleet,
    ClusterProvider,
    create,
    load_lower_config,
    open_lower,
    translate_pod,
)
from vkubelet.providers.cluster._config import cluster_label_value

from .fakes import context, lower_yaml, node
from .pods import how, upper_pod

CLUSTER = "vkubelet.io/cluster"


def configured(provider: ClusterProvider) -> dict[str, str]:
    found = msgspec.convert(
        {
            "metadata": {"name": provider.context.node_name, "labels": {"type": "virtual-kubelet"}},
            "spec": {},
            "status": {},
        },
        Node,
    )
    provider.configure_node(found)
    assert found.metadata is not None and found.metadata.labels is not None
    return dict(found.metadata.labels)


def test_the_cluster_name_and_label_are_read_and_checked(tmp_path: Path) -> None:
    default = load_lower_config(lower_yaml(tmp_path))
    assert (default.cluster_label, default.cluster_name) == (CLUSTER, None)
    named = load_lower_config(lower_yaml(tmp_path, clusterName="eu-1", clusterLabel="example/c"))
    assert (named.cluster_label, named.cluster_name) == ("example/c", "eu-1")
    assert load_lower_config(lower_yaml(tmp_path, clusterLabel=None)).cluster_label is None
    with pytest.raises(ConfigError, match="clusterName: 'eu 1' is not a valid label value"):
        load_lower_config(lower_yaml(tmp_path, clusterName="eu 1"))
    with pytest.raises(ConfigError, match="clusterLabel: 'a/b/c' is not a valid label key"):
        load_lower_config(lower_yaml(tmp_path, clusterLabel="a/b/c"))


def test_the_default_cluster_name_is_the_node_name_cut_to_a_label_value() -> None:
    assert cluster_label_value("lower-eu") == "lower-eu"
    long = cluster_label_value("x" * 80)
    assert len(long) <= 63 and long.startswith("xxx") and long != cluster_label_value("x" * 81)


def test_an_aggregate_node_is_labelled_with_its_cluster_by_default_with_its_name(
    tmp_path: Path,
) -> None:
    lower_yaml(tmp_path)
    provider = create(context(tmp_path))
    assert isinstance(provider, ClusterProvider)
    try:
        assert configured(provider)[CLUSTER] == "vk-lower"
        assert provider.how.virtual_labels[CLUSTER] == "vk-lower", "a label of the virtual node"
    finally:
        asyncio.run(provider.lower.aclose())


def test_mirrored_nodes_carry_the_cluster_name_of_their_fleet(tmp_path: Path) -> None:
    lower_yaml(tmp_path, mode="mirror", clusterName="eu-1")
    fleet = create(context(tmp_path))
    assert isinstance(fleet, ClusterFleet)

    async def scenario() -> None:
        member = fleet._member("lower-a")
        provider = member.provider
        assert isinstance(provider, ClusterProvider)
        try:
            provider.capacity.snapshot = {"Node": {"a": node("lower-a", "2")}, "Pod": {}}
            provider.capacity._follow_mirrored(provider.capacity.snapshot)
            labels = configured(provider)
            assert (labels[CLUSTER], member.name) == ("eu-1", "vk-lower-lower-a")
        finally:
            await provider.aclose()
            await fleet.aclose()

    asyncio.run(scenario())


def test_no_cluster_label_when_turned_off(tmp_path: Path) -> None:
    config = load_lower_config(lower_yaml(tmp_path, clusterLabel=""))
    provider = ClusterProvider(config, context(tmp_path), open_lower(config), background=False)
    try:
        assert CLUSTER not in configured(provider)
    finally:
        asyncio.run(provider.lower.aclose())


def test_constraints_over_the_cluster_label_stay_upstairs_and_the_rest_go_down() -> None:
    translation = dataclasses.replace(
        how(), virtual_labels={**how().virtual_labels, CLUSTER: "eu-1"}
    )
    translation = dataclasses.replace(translation, virtual_topology_keys=(CLUSTER,))
    zone = "topology.kubernetes.io/zone"
    spread = [
        {"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "DoNotSchedule"}
        for key in (CLUSTER, zone)
    ]
    anti = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": CLUSTER, "labelSelector": {"matchLabels": {"app": "web"}}}
        ],
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": zone}},
            {"weight": 1, "podAffinityTerm": {"topologyKey": CLUSTER}},
        ],
    }
    pod = upper_pod(
        nodeSelector={CLUSTER: "eu-1", "disk": "ssd"},
        topologySpreadConstraints=spread,
        affinity={"podAntiAffinity": anti},
    )
    lower = translate_pod(pod, translation)["spec"]
    assert lower["nodeSelector"] == {"disk": "ssd"}
    assert [c["topologyKey"] for c in lower["topologySpreadConstraints"]] == [zone]
    assert lower["affinity"] == {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": {"topologyKey": zone}}
            ]
        }
    }
    only_cluster = upper_pod(topologySpreadConstraints=spread[:1])
    assert "topologySpreadConstraints" not in translate_pod(only_cluster, translation)["spec"]


def test_one_agent_config_runs_two_cluster_provider_nodes(tmp_path: Path) -> None:
    for name in ("eu", "us"):
        (tmp_path / name).mkdir()
        lower_yaml(tmp_path / name, clusterName=f"cluster-{name}")
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(
        yaml.safe_dump(
            {
                "nodes": [
                    {"name": f"vk-{n}", "provider": "cluster", "providerConfig": f"{n}/lower.yaml"}
                    for n in ("eu", "us")
                ]
            }
        )
    )
    agent = Agent(load_agent_config(agent_yaml))

    async def scenario() -> None:
        try:
            labels = []
            for provider in agent.providers:
                assert isinstance(provider, ClusterProvider)
                labels.append(configured(provider)[CLUSTER])
            assert labels == ["cluster-eu", "cluster-us"]
            owners = {p.owner.node_name for p in agent.providers if isinstance(p, ClusterProvider)}
            assert owners == {"vk-eu", "vk-us"}, "each node its own owner below"
        finally:
            for provider in agent.providers:
                await agent.close_provider(provider)

    asyncio.run(scenario())
