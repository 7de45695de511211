"""The pod network of libvirt domains: what libvirt itself configures on the daemon's host.

A libvirt-run QEMU lives in the daemon's network namespace, on the daemon's host, which may be
another machine: the QEMU runtime's per-VM netns and veth (`_net`) are of no use to it. So the
domain's XML carries the network, and libvirt makes it when the domain starts and removes it
when it ends; a remote host needs nothing from the agent but the URI.

- **routed** (the default): `<interface type='ethernet'>`, a tap libvirt makes (named as the
  QEMU runtime names a VM's host link, `vkvm<hash>`), whose `<source><ip address=GATEWAY
  prefix='32' peer=GUEST/>` libvirt 9.0 sets on the daemon's host: the tap holds the node's
  gateway (the same /32 on every VM's tap) and, through the peer, the kernel's /32 route to the
  guest. Checked on the lab: `inet <gateway> peer <guest>/32` on the tap and `<guest> dev
  <tap> proto kernel scope link src <gateway>`; the tap goes with the domain. Two domains'
  taps with the same gateway and their own peers start side by side, and the host routes
  between them (`ip route get <guest 2> from <guest 1> iif <tap 1>` names tap 2).
- **What libvirt cannot set** is the host's own configuration, so it is a requirement of the
  hypervisor host (docs/vm-provider.md, The libvirt runtime): forwarding (`net.ipv4.ip_forward=1`,
  or `net.ipv4.conf.default.forwarding=1` and the uplink's), since a tap takes the `default`
  settings when libvirt makes it and no one sets its own; and `net.ipv4.conf.default.proxy_arp=1`,
  so a guest's ARP for a neighbour of its range (another VM of the host, on its own tap) is
  answered by the host, which routes it: without it a guest reaches the gateway (an address of
  its tap, answered anyway) and everything beyond it, but not the VMs beside it. The agent
  cannot check either remotely. The lab (`testing.virtlab`) sets both on its hosts.
- **host-only** is refused with this runtime (config error): whether a tap forwards is the
  host's setting above, not the domain's, and a remote agent's own probes need the host to
  forward anyway.
- **bridged**: `<interface type='bridge'>` on the site's bridge of the daemon's host; the host
  routes nothing for the guest. A bridge missing there fails the domain's start (libvirt says
  so); the pod then waits, its reason `BridgeMissing` naming `network.bridge`.
- **The MAC** is the one the seed names (`PodNetwork.mac` of the pod's UID), so the guest's
  configuration finds its interface.
- **The domain is the state.** Its `<metadata>` holds vkubelet's network element (`NETWORK_URI`:
  the pod UID it was attached for, address, prefix, gateway, MAC, link): a restarted agent reads
  a running domain's address back from there, and a new pod's address is chosen among those no
  running domain of the daemon holds (ours by that element, anyone's routed tap by its `peer`).
  Inactive domains do not count: a hibernated VM's address is kept by its machine's record, and
  its next pod asks for it. A hibernated domain's restore keeps its interface (libvirt checks
  that a restored device matches the saved one: the MAC and model stay), with the new pod's
  address and gateway (`retarget_network`). A live migration to another host (`_lvmigrate`)
  does the same to the destination XML, and also names the target pod's tap (or bridge): the
  MAC stays, the host side becomes the target node's gateway with the target pod's address
  as its peer.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from ._backend import MachineRefused
from ._config import Bridged, VMConfig
from ._net import BridgedNetwork, GuestNetwork, NetworkError, PodNetwork

__all__ = [
    "NETWORK_URI",
    "Attached",
    "LibvirtBridgedNetwork",
    "LibvirtRoutedNetwork",
    "addresses_in",
    "attached_in",
    "bridge_refused",
    "libvirt_network",
    "retarget_network",
    "with_network",
]

#: The namespace of vkubelet's network element in a domain's `<metadata>`.
NETWORK_URI = "https://vkubelet.io/xmlns/vm-network/1"
ET.register_namespace("vkubelet-net", NETWORK_URI)
_TAG = f"{{{NETWORK_URI}}}interface"


@dataclass(frozen=True)
class Attached:
    """A domain's network as its metadata records it."""

    key: str  # the pod UID the network was attached for
    link: str  # the tap's name on the daemon's host
    network: GuestNetwork


def _interface(network: GuestNetwork, link: str, bridge: str | None) -> ET.Element:
    interface = ET.Element("interface", {"type": "bridge" if bridge else "ethernet"})
    ET.SubElement(interface, "mac", {"address": network.mac})
    source = ET.SubElement(interface, "source")
    if bridge:
        source.set("bridge", bridge)
    else:
        _host_side(source, network)
    ET.SubElement(interface, "target", {"dev": link, **({} if bridge else {"managed": "yes"})})
    ET.SubElement(interface, "model", {"type": "virtio"})
    return interface


def _host_side(source: ET.Element, network: GuestNetwork) -> None:
    """The tap's gateway address with the guest as its peer: libvirt sets both, and the kernel
    routes the guest's /32 over the tap."""
    for old in source.findall("ip"):
        source.remove(old)
    ip = {"address": network.gateway, "prefix": "32", "peer": network.address}
    ET.SubElement(source, "ip", {"family": "ipv4", **ip})


def _element(key: str, link: str, network: GuestNetwork) -> ET.Element:
    return ET.Element(
        _TAG,
        {
            "key": key,
            "link": link,
            "address": network.address,
            "prefix": str(network.prefix),
            "gateway": network.gateway,
            "mac": network.mac,
        },
    )


def with_network(
    xml: str, key: str, link: str, network: GuestNetwork, *, bridge: str | None
) -> str:
    """The domain's XML with the pod's interface (routed: a tap with the host side set;
    bridged: a port of `bridge`) and the network element in its metadata."""
    root = ET.fromstring(xml)  # noqa: S314 - made by `_domainxml`
    devices = root.find("devices")
    if devices is None:
        devices = ET.SubElement(root, "devices")
    devices.append(_interface(network, link, bridge))
    metadata = root.find("metadata")
    if metadata is None:
        metadata = ET.SubElement(root, "metadata")
    metadata.append(_element(key, link, network))
    return ET.tostring(root, encoding="unicode")


def attached_in(xml: str) -> Attached | None:
    """The network vkubelet's element of a domain's XML records (None: not ours, or none)."""
    try:
        root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    except ET.ParseError:
        return None
    element = root.find(f"./metadata/{_TAG}")
    if element is None:
        return None
    values = {k: element.get(k) for k in ("key", "link", "address", "prefix", "gateway", "mac")}
    if not all(values.values()) or not str(values["prefix"]).isdigit():
        return None
    address, gateway, mac = (str(values[k]) for k in ("address", "gateway", "mac"))
    network = GuestNetwork(address, int(str(values["prefix"])), gateway, mac)
    return Attached(str(values["key"]), str(values["link"]), network)


def addresses_in(xml: str) -> set[str]:
    """The guest addresses a domain holds: vkubelet's element, and the `peer` of any routed
    tap (a domain someone else made the same way)."""
    try:
        root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    except ET.ParseError:
        return set()
    found = {str(ip.get("peer")) for ip in root.iterfind("./devices/interface/source/ip[@peer]")}
    if (attached := attached_in(xml)) is not None:
        found.add(attached.network.address)
    return found


def retarget_network(
    xml: str,
    key: str,
    network: GuestNetwork,
    *,
    link: str | None = None,
    bridge: str | None = None,
) -> str:
    """A saved domain's XML for the machine's next pod: its routed tap's host side and the
    network element say the new pod's address and gateway. The interface itself (MAC, model,
    tap name) stays: libvirt refuses a restore whose devices differ from the saved ones. A
    domain saved without vkubelet's element (no network) is returned as it was. A live
    migration's destination XML (`_lvmigrate`) also takes the target's tap name (`link`) or
    bridge: host-side settings, which a migration may change (the MAC stays)."""
    root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    element = root.find(f"./metadata/{_TAG}")
    if element is None:
        return xml
    mac = element.get("mac") or network.mac
    kept = GuestNetwork(network.address, network.prefix, network.gateway, mac)
    for interface in root.iterfind("./devices/interface"):
        found = interface.find("mac")
        if found is None or found.get("address") != mac:
            continue
        source = interface.find("source")
        if source is None:
            source = ET.SubElement(interface, "source")
        if interface.get("type") == "bridge" and bridge:
            source.set("bridge", bridge)
        if interface.get("type") != "ethernet":
            continue
        _host_side(source, kept)
        target = interface.find("target")
        if link and target is not None:
            target.set("dev", link)
    link = link or element.get("link") or ""
    metadata = root.find("metadata")
    assert metadata is not None
    metadata.remove(element)
    metadata.append(_element(key, link, kept))
    return ET.tostring(root, encoding="unicode")


DomainsXML = Callable[[], Awaitable[Sequence[str]]]


class _OnDaemon(PodNetwork):
    """The address book of a libvirt runtime's network, on top of `PodNetwork`'s rules (its
    range, gateway, shared ranges, MAC and link names): nothing is made on the agent's host.
    An attach records the pod's address here until the domain carries it; the running domains
    of the daemon (`domains`: their XML) say which addresses are taken and, after an agent
    restart, which one a pod's domain has."""

    _domains: DomainsXML
    _attached: dict[str, str]  # link -> address, attached by this agent

    async def _running(self) -> list[Attached | set[str]]:
        return [attached_in(xml) or addresses_in(xml) for xml in await self._domains()]

    async def _guest_address(self, link: str) -> str | None:
        if link in self._attached:
            return self._attached[link]
        for found in await self._running():
            if isinstance(found, Attached) and found.link == link:
                self._attached[link] = found.network.address
                return found.network.address
        return None

    async def _used_addresses(self) -> set[str]:
        used = {self.gateway, *self._attached.values()}
        for found in await self._running():
            used |= {found.network.address} if isinstance(found, Attached) else found
        return used

    async def _create(self, key: str, address: str, *, standby: bool = False) -> None:
        self._attached[self.host_link(key)] = address

    async def _settle(self, link: str) -> None:
        """Nothing: the tap's settings are libvirt's and the host's (see the module)."""

    async def detach(self, key: str) -> None:
        """Forget the address: the tap went with the domain (libvirt removes what it made)."""
        self._attached.pop(self.host_link(key), None)

    async def claim(self, key: str) -> GuestNetwork:
        address = await self._guest_address(self.host_link(key))
        if address is None:
            raise NetworkError(f"no domain has the network of {key}")
        return self._guest(key, address)


class LibvirtRoutedNetwork(_OnDaemon):
    """Routed mode on a libvirt daemon's host (see the module)."""

    def __init__(
        self,
        cidr: str,
        domains: DomainsXML,
        *,
        shared: Sequence[str] = (),
        reserved: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        PodNetwork.__init__(self, cidr, forward=True, shared=shared, reserved=reserved)
        self._domains, self._attached = domains, {}


class LibvirtBridgedNetwork(_OnDaemon, BridgedNetwork):
    """Bridged mode on a libvirt daemon's host: the bridge is the daemon's host's."""

    def __init__(
        self,
        bridge: str,
        subnet: str,
        gateway: str,
        pool: tuple[str, str],
        domains: DomainsXML,
        *,
        reserved: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        BridgedNetwork.__init__(self, bridge, subnet, gateway, pool, reserved=reserved)
        self._domains, self._attached = domains, {}


def libvirt_network(
    config: VMConfig, domains: DomainsXML, reserved: Callable[[], Collection[str]]
) -> PodNetwork:
    """The network of the config's mode on the daemon's host (host-only is refused by the
    config with this runtime)."""
    if (bridged := config.bridged) is not None:
        return LibvirtBridgedNetwork(
            bridged.bridge, bridged.subnet, bridged.gateway, bridged.pool, domains,
            reserved=reserved,
        )  # fmt: skip
    return LibvirtRoutedNetwork(
        config.pod_cidr, domains, shared=config.shared_pod_cidrs, reserved=reserved
    )


def bridge_refused(bridged: Bridged | None, message: str) -> MachineRefused | None:
    """A domain's start that failed because the daemon's host has no `network.bridge` (libvirt
    9.0: "Cannot get interface MTU on 'br0': No such device"): the pod's reason, naming the
    setting. The agent cannot look at a remote host's links itself (libvirt's interface
    driver may read another view of them), so the start is what tells."""
    if bridged is None or f"'{bridged.bridge}'" not in message:
        return None
    return MachineRefused(
        "BridgeMissing",
        f"network.bridge: {bridged.bridge} is not usable on the libvirt host ({message})",
    )
