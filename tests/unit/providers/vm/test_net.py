"""Pod network naming and guest network data (the `ip` side is proven in tests/integration/vm)."""

from __future__ import annotations

import json
import re

import pytest

from vkubelet.providers.vm._net import AddressRefused, GuestNetwork, NetworkError, PodNetwork


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


def test_a_bridged_guest_gets_the_subnet_s_prefix_and_the_configured_gateway() -> None:
    from vkubelet.providers.vm._net import BridgedNetwork

    network = BridgedNetwork("br0", "192.0.2.0/24", "192.0.2.254", ("192.0.2.100", "192.0.2.101"))
    assert network.prefix_for("192.0.2.101") == 24
    guest = network._guest("uid-1", "192.0.2.100")
    assert (guest.address, guest.prefix, guest.gateway) == ("192.0.2.100", 24, "192.0.2.254")
    with pytest.raises(AddressRefused, match=r"outside network\.pool 192\.0\.2\.100-192"):
        network.prefix_for("192.0.2.102")


async def test_a_bridged_pool_hands_out_free_addresses_then_says_it_is_exhausted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vkubelet.providers.vm import _net

    network = _net.BridgedNetwork(
        "br0", "192.0.2.0/24", "192.0.2.1", ("192.0.2.100", "192.0.2.102"),
        reserved=lambda: {"192.0.2.101"},
    )  # fmt: skip
    other = network.host_link("another-vm")
    links = [
        {"ifname": other, "ifalias": "vkubelet-address=192.0.2.100"},
        {"ifname": "eth0", "ifalias": "vkubelet-address=192.0.2.102"},  # not a VM link
    ]

    async def ip(*args: str, check: bool = True) -> str:
        assert args == ("-j", "link", "show")
        return json.dumps(links)

    monkeypatch.setattr(_net, "_ip", ip)
    assert await network._free_address() == "192.0.2.102"
    links[1]["ifname"] = network.host_link("third-vm")
    with pytest.raises(AddressRefused, match=r"network\.pool 192\.0\.2\.100-192\.0\.2\.102"):
        await network._free_address()


async def test_a_bridged_attach_to_a_missing_bridge_is_refused_before_anything_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vkubelet.providers.vm import _net

    calls: list[tuple[str, ...]] = []

    async def ip(*args: str, check: bool = True) -> str:
        calls.append(args)
        return "[]" if args[0] == "-j" else ""

    monkeypatch.setattr(_net, "_ip", ip)
    network = _net.BridgedNetwork(
        "vkbrnothere0", "192.0.2.0/24", "192.0.2.1", ("192.0.2.100", "192.0.2.100")
    )
    with pytest.raises(_net.NetworkRefused, match=r"network\.bridge: bridge vkbrnothere0") as e:
        await network.attach("uid-1")
    assert e.value.reason == "BridgeMissing"
    assert all(call[0] == "-j" for call in calls)  # only looked: nothing made


async def test_a_routed_node_reads_other_vm_links_and_never_deletes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bridged node's link routes nothing: a routed node on the same machine looking for free
    addresses must not take it for a half-made link of its own (it used to delete it)."""
    from vkubelet.providers.vm import _net

    bridged = PodNetwork("10.88.0.0/24").host_link("bridged-vm")
    calls: list[tuple[str, ...]] = []

    async def ip(*args: str, check: bool = True) -> str:
        calls.append(args)
        if args[:2] == ("-o", "link"):
            return f"7: {bridged}@if2: <BROADCAST,UP> mtu 1500 master br0\n"
        return ""

    monkeypatch.setattr(_net, "_ip", ip)
    assert await PodNetwork("10.88.0.0/24")._free_address() == "10.88.0.2"
    assert not [call for call in calls if "del" in call]
