"""The libvirt runtime's pod network (`_lvnet`): the interface a domain carries and the address
book read from the daemon's domains, checked without a daemon
(tests/integration/vm/test_vm_libvirt_network.py sends packets through a real one)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vkubelet.providers.vm._backend import LaunchSpec
from vkubelet.providers.vm._config import Bridged
from vkubelet.providers.vm._domainxml import Owner, domain_xml
from vkubelet.providers.vm._lvnet import (
    LibvirtBridgedNetwork,
    LibvirtRoutedNetwork,
    addresses_in,
    attached_in,
    bridge_refused,
    retarget_network,
    with_network,
)
from vkubelet.providers.vm._net import AddressRefused, GuestNetwork

SPEC = LaunchSpec("ns/vm", Path("/s/m"), 1, 256, (), None, "uid-1", "tcg")
OWNER = Owner("uid-1", "ns", "vm", "hv-1")
GUEST = GuestNetwork("10.224.7.5", 24, "10.224.7.1", "52:54:00:aa:bb:cc")


def _domain(network: GuestNetwork = GUEST, *, key: str = "uid-1", bridge: str | None = None) -> str:
    return with_network(
        domain_xml(SPEC, OWNER, kvm=False), key, "vkvm0123456789a", network, bridge=bridge
    )


def _interface(xml: str) -> ET.Element:
    found = ET.fromstring(xml).find("devices/interface")  # noqa: S314 - our own output
    assert found is not None
    return found


def test_a_routed_domain_has_a_tap_whose_host_side_libvirt_sets_to_the_gateway_and_guest() -> None:
    interface = _interface(_domain())
    assert interface.get("type") == "ethernet"
    assert interface.find("mac").get("address") == GUEST.mac  # type: ignore[union-attr]
    assert interface.find("model").get("type") == "virtio"  # type: ignore[union-attr]
    target = interface.find("target")
    assert target is not None and target.attrib == {"dev": "vkvm0123456789a", "managed": "yes"}
    ip = interface.find("source/ip")
    assert ip is not None
    assert (ip.get("address"), ip.get("prefix"), ip.get("peer")) == (
        "10.224.7.1",
        "32",
        "10.224.7.5",
    )


def test_a_bridged_domain_is_a_port_of_the_site_bridge_with_nothing_routed() -> None:
    interface = _interface(_domain(bridge="br0"))
    assert interface.get("type") == "bridge"
    assert interface.find("source").attrib == {"bridge": "br0"}  # type: ignore[union-attr]
    assert interface.find("source/ip") is None
    assert interface.find("mac").get("address") == GUEST.mac  # type: ignore[union-attr]


def test_the_domain_records_its_network_so_a_restarted_agent_reads_it_back() -> None:
    found = attached_in(_domain())
    assert found is not None
    assert (found.key, found.link, found.network) == ("uid-1", "vkvm0123456789a", GUEST)
    assert attached_in(domain_xml(SPEC, OWNER, kvm=False)) is None  # no network: none
    assert attached_in("not xml") is None


def test_the_addresses_a_domain_holds_include_anyone_s_routed_tap() -> None:
    assert addresses_in(_domain()) == {"10.224.7.5"}
    theirs = (
        "<domain><devices><interface type='ethernet'><source>"
        "<ip address='10.224.7.1' prefix='32' peer='10.224.7.9'/></source></interface>"
        "</devices></domain>"
    )
    assert addresses_in(theirs) == {"10.224.7.9"}


def test_a_restored_domain_keeps_its_interface_with_the_new_pod_s_address_and_gateway() -> None:
    saved = _domain()
    new = GuestNetwork("10.224.9.3", 24, "10.224.9.1", "52:54:00:11:22:33")
    xml = retarget_network(saved, "uid-2", new)
    interface = _interface(xml)
    # the MAC and the tap stay (libvirt refuses a restore whose devices changed)
    assert interface.find("mac").get("address") == GUEST.mac  # type: ignore[union-attr]
    assert interface.find("target").get("dev") == "vkvm0123456789a"  # type: ignore[union-attr]
    ip = interface.find("source/ip")
    assert ip is not None and (ip.get("address"), ip.get("peer")) == ("10.224.9.1", "10.224.9.3")
    found = attached_in(xml)
    assert found is not None and found.key == "uid-2"
    assert found.network == GuestNetwork("10.224.9.3", 24, "10.224.9.1", GUEST.mac)
    plain = domain_xml(SPEC, OWNER, kvm=False)
    assert retarget_network(plain, "uid-2", new) == plain  # saved without a network


class _Daemon:
    """The running domains' XML, as `_running_domains` returns them."""

    def __init__(self, *xml: str) -> None:
        self.xml = list(xml)

    async def __call__(self) -> list[str]:
        return self.xml


async def test_a_new_pod_gets_an_address_no_running_domain_holds() -> None:
    daemon = _Daemon(_domain(GuestNetwork("10.224.7.2", 24, "10.224.7.1", "52:54:00:00:00:01")))
    network = LibvirtRoutedNetwork("10.224.7.0/24", daemon, reserved=lambda: {"10.224.7.3"})
    first = await network.attach("uid-a")
    assert (first.address, first.prefix, first.gateway) == ("10.224.7.4", 24, "10.224.7.1")
    assert first.mac == network.mac("uid-a")  # the seed's
    assert (await network.attach("uid-a")).address == "10.224.7.4"  # idempotent per key
    assert (await network.attach("uid-b")).address == "10.224.7.5"  # not yet in any domain
    await network.detach("uid-b")
    assert (await network.attach("uid-c")).address == "10.224.7.5"


async def test_an_address_a_running_domain_holds_is_refused_to_another_pod() -> None:
    daemon = _Daemon(_domain(GuestNetwork("10.224.7.9", 24, "10.224.7.1", "52:54:00:00:00:01")))
    network = LibvirtRoutedNetwork("10.224.7.0/24", daemon)
    with pytest.raises(AddressRefused) as refused:
        await network.attach("uid-x", "10.224.7.9")
    assert refused.value.reason == "AddressInUse"


async def test_a_restarted_agent_finds_a_running_domain_s_address_by_its_pod() -> None:
    network = LibvirtRoutedNetwork("10.224.7.0/24", _Daemon())
    key = "uid-running"
    running = GuestNetwork("10.224.7.77", 24, "10.224.7.1", network.mac(key))
    daemon = _Daemon(
        with_network(
            domain_xml(SPEC, OWNER, kvm=False), key, network.host_link(key), running, bridge=None
        )
    )
    restarted = LibvirtRoutedNetwork("10.224.7.0/24", daemon)
    assert (await restarted.attach(key)) == running


async def test_a_bridged_pod_takes_a_free_address_of_the_pool() -> None:
    daemon = _Daemon(
        _domain(GuestNetwork("192.0.2.100", 24, "192.0.2.1", "52:54:00:00:00:01"), bridge="br0")
    )
    network = LibvirtBridgedNetwork(
        "br0", "192.0.2.0/24", "192.0.2.1", ("192.0.2.100", "192.0.2.101"), daemon
    )
    assert (await network.attach("uid-a")).address == "192.0.2.101"
    with pytest.raises(AddressRefused) as exhausted:
        await network.attach("uid-b")
    assert exhausted.value.reason == "AddressPoolExhausted"


def test_a_start_that_failed_on_a_missing_bridge_names_the_setting() -> None:
    bridged = Bridged("br0", "192.0.2.0/24", "192.0.2.1", ("192.0.2.100", "192.0.2.101"))
    message = "libvirt qemu+ssh://hv/system: Cannot get interface MTU on 'br0': No such device"
    refused = bridge_refused(bridged, message)
    assert refused is not None and refused.reason == "BridgeMissing"
    assert str(refused).startswith("network.bridge: br0 ") and message in str(refused)
    assert bridge_refused(bridged, "libvirt: something else") is None
    assert bridge_refused(None, message) is None
