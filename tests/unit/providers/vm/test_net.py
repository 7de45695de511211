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
