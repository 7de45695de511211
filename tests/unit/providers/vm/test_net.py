"""Pod network naming and guest network data (the `ip` side is proven in tests/integration/vm)."""

from __future__ import annotations

import re

import pytest

from vkubelet.providers.vm._net import GuestNetwork, NetworkError, PodNetwork


def test_names_are_short_enough_for_ifnamsiz_deterministic_and_distinct_per_key() -> None:
    network = PodNetwork("10.88.0.0/24")
    keys = [f"7c9e6679-7425-40de-944b-e07fc1f90a{i:02d}" for i in range(50)]
    links = {network.host_link(k) for k in keys}
    assert len(links) == len(keys)
    assert all(len(name) <= 15 for name in links)
    assert len({network.netns(k) for k in keys}) == len(keys)  # netns names have no IFNAMSIZ
    assert network.host_link(keys[0]) == PodNetwork("10.88.0.0/24").host_link(keys[0])


def test_mac_is_stable_per_key_in_qemus_locally_administered_range() -> None:
    network = PodNetwork("10.88.0.0/24")
    mac = network.mac("pod-uid-1")
    assert re.fullmatch(r"52:54:00(:[0-9a-f]{2}){3}", mac)
    assert mac == network.mac("pod-uid-1") != network.mac("pod-uid-2")


def test_gateway_is_the_first_address_of_the_cidr() -> None:
    assert PodNetwork("10.88.4.0/22").gateway == "10.88.4.1"


@pytest.mark.parametrize(
    ("cidr", "prefix"), [("10.88.0.0/31", "vkvm"), ("10.88.0.0/24", "muchtoolongprefix")]
)
def test_unusable_cidr_or_prefix_is_refused(cidr: str, prefix: str) -> None:
    with pytest.raises(NetworkError):
        PodNetwork(cidr, prefix=prefix)


def test_seed_file_is_the_key_value_lines_the_small_guest_reads() -> None:
    network = GuestNetwork("10.88.0.5", 24, "10.88.0.1", "52:54:00:aa:bb:cc", ("10.96.0.10",))
    assert network.seed_file() == (
        b"MAC=52:54:00:aa:bb:cc\nADDRESS=10.88.0.5/24\nGATEWAY=10.88.0.1\nDNS=10.96.0.10\n"
    )


def test_a_pod_range_that_another_route_of_the_host_covers_is_named_vm_links_are_not() -> None:
    from vkubelet.providers.vm._net import foreign_routes

    link = PodNetwork("10.224.1.0/24").host_link("uid-1")
    routes = [
        {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
        {"dst": "192.0.2.0/24", "dev": "eth0"},
        {"dst": "10.224.1.7", "dev": link},  # a VM's /32 and the gateway on its link
        {"type": "local", "dst": "10.224.1.1", "dev": link, "table": "local"},
        {"dst": "10.224.0.0/16", "dev": "br0"},
        {"type": "local", "dst": "10.224.1.9", "dev": "eth1", "table": "local"},
        {"type": "unreachable", "dst": "10.224.1.128/25"},
    ]
    assert foreign_routes("10.224.1.0/24", routes) == [
        "10.224.0.0/16 dev br0 table main",
        "10.224.1.9 dev eth1 table local",
        "10.224.1.128/25 dev - table main",
    ]
    assert foreign_routes("10.224.2.0/24", routes) == ["10.224.0.0/16 dev br0 table main"]


def test_the_search_list_is_the_kubelet_s_for_the_pod_s_namespace() -> None:
    from vkubelet.providers.vm._net import pod_dns_search

    assert pod_dns_search("shop", "cluster.local") == (
        "shop.svc.cluster.local",
        "svc.cluster.local",
        "cluster.local",
    )
