"""Replica options that must hold before anything starts: Lease names valid whatever the
identity, one group for the same nodes, sharding refusing configs it cannot run, no replica for
a vm node; and the fenced client of work under a Lease."""

from __future__ import annotations

import re
from pathlib import Path

import httpx2 as httpx
import pytest

from vkubelet.agent import ReplicaOptions
from vkubelet.agent._leases import FencedClient, group_of, lease_name
from vkubelet.agent._sharding import check_shardable
from vkubelet.kube import LeaseTiming, Unreachable
from vkubelet.node import AgentConfig, ConfigError, NodeSettings, NodeSpec
from vkubelet.testing.fakeapi import kubeconfig

from .cli import invoke

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def test_lease_names_are_dns_subdomains_whatever_the_identity() -> None:
    for parts in [("member", "abc", "My_Host.Example-1234-ffee"), ("node", "x" * 300)]:
        name = lease_name(*parts)
        assert DNS_SUBDOMAIN.match(name) and len(name) <= 253
    assert lease_name("node", "vk-0") == "vkubelet-node-vk-0"  # kept readable when valid
    assert lease_name("a", "B_c") != lease_name("a", "b-c")  # rewritten names stay distinct


def test_replicas_with_the_same_nodes_in_any_order_form_one_group() -> None:
    assert group_of(["a", "b", "c"]) == group_of(["c", "a", "b"]) != group_of(["a", "b"])


def options(health_port: int) -> ReplicaOptions:
    return ReplicaOptions("ns", "me", LeaseTiming(), shard=True, health_port=health_port)


def config(*ports: int, kubelet_api: bool = True) -> AgentConfig:
    nodes = [
        NodeSpec(NodeSettings(name=f"n{i}", provider="mock", kubelet_port=port), Path("m.json"))
        for i, port in enumerate(ports)
    ]
    return AgentConfig(nodes=nodes, kubelet_api=kubelet_api)


def test_sharding_needs_a_kubelet_port_per_node_apart_from_the_replicas_health_port() -> None:
    check_shardable(config(10251, 10252), options(10250))
    with pytest.raises(ConfigError, match=r"n1: .*kubeletPort of its own"):
        check_shardable(config(10251, 10251), options(10250))
    with pytest.raises(ConfigError, match=r"n0: .*/healthz has port 10250"):
        check_shardable(config(10250, 10251), options(10250))
    check_shardable(config(10250, 10250, kubelet_api=False), options(10250))  # no API: no port


async def test_a_fenced_client_sends_no_write_once_the_lease_lapsed_but_still_reads() -> None:
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.method)
        return httpx.Response(200, json={})

    client = FencedClient(kubeconfig(), transport=httpx.MockTransport(handler))
    holds = True
    client.may_write = lambda: holds
    await client.patch("/api/v1/nodes/n", {"metadata": {}})
    holds = False
    with pytest.raises(Unreachable, match="fenced"):
        await client.patch("/api/v1/nodes/n", {"metadata": {}})
    with pytest.raises(Unreachable, match="fenced"):
        await client.heartbeat("/apis/coordination.k8s.io/v1/namespaces/x/leases/n", {})
    await client.get("/api/v1/nodes/n")
    assert sent == ["PATCH", "GET"]
    await client.aclose()


@pytest.mark.parametrize("flag", ["--leader-elect", "--shard"])
def test_no_replica_may_take_over_a_vm_node_whose_disks_are_on_its_host(flag: str) -> None:
    args = ["run", "--provider", "vm", "--nodename", "hv-1", flag]
    result = invoke(*args)
    assert result.exit_code == 1
    assert "vm node hv-1: its VMs and their disks live on this host" in result.output
