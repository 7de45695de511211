"""The pod IP of an imported libvirt domain: the address its guest has, as the guest says.

An imported domain (`_domainimport`) keeps its own NICs: vkubelet gives it no address, so the
node's address would be wrong in its pod's `status.podIP` (a Service selecting the pod would
send to the node). What is right is the guest's own address, which only the guest knows: its
guest agent's view through libvirt (`virDomainInterfaceAddresses`, source AGENT), or, with no
agent answering, the peer of a routed tap in the domain's XML (`<interface type='ethernet'>`
with `<ip peer=…>`: the address libvirt routes to the guest). It is read while the machine runs,
never before its start (a guest without an agent still starts), and again at an interval, so
that a renewed DHCP lease shows.

As a kubelet does for a pod whose sandbox has no IP: until an address is known the pod has none
(no `podIP`: no Service sends to it, `status.podIP` in its env is empty); once known it is
kept until another is read (a guest agent that stops answering, or a guest between two leases,
does not take the pod's address away; the kubelet keeps a pod's IPs too).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

#: How often the guest's address is read: until one is known (the guest is still getting its
#: lease), then to notice a change. One guest-agent call through libvirt each.
UNKNOWN_INTERVAL = 2.0
KNOWN_INTERVAL = 10.0


@runtime_checkable
class AddressSource(Protocol):
    """A machine whose guest can tell its address (`_libvirt.LibvirtMachine`)."""

    async def guest_address(self) -> str | None: ...


def first_ipv4(interfaces: Mapping[str, Any]) -> str | None:
    """The first global IPv4 address in libvirt's `interfaceAddresses` answer (interface name
    → {"addrs": [{"type", "addr", "prefix"}], "hwaddr"}), in the guest's interface order;
    loopback and link-local addresses are no pod's."""
    for interface in interfaces.values():
        for entry in (interface or {}).get("addrs") or []:
            try:
                address = ipaddress.ip_address(str(entry.get("addr", "")))
            except ValueError:
                continue
            if address.version == 4 and not (address.is_loopback or address.is_link_local):
                return str(address)
    return None


def routed_peer(xml: str) -> str | None:
    """The guest address of the domain's first routed tap (`<interface type='ethernet'>` whose
    `<ip>` has a `peer`), None without one."""
    try:
        root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    except ET.ParseError:
        return None
    for interface in root.iterfind("./devices/interface[@type='ethernet']"):
        for ip in interface.iter("ip"):
            peer = ip.get("peer", "").split("/", 1)[0]
            try:
                if ipaddress.ip_address(peer).version == 4:
                    return peer
            except ValueError:
                continue
    return None


async def follow(read: Callable[[], Awaitable[str | None]], changed: Callable[[str], None]) -> None:
    """Read the guest's address until cancelled, calling `changed` with each new one. A failed
    read (the daemon away) is logged and tried again at the next interval."""
    known: str | None = None
    while True:
        try:
            address = await read()
        except Exception as e:
            log.debug("the guest's address could not be read: %s", e)
            address = None
        if address is not None and address != known:
            known = address
            changed(address)
        await asyncio.sleep(KNOWN_INTERVAL if known is not None else UNKNOWN_INTERVAL)
