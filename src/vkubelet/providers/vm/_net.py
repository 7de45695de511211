"""The pod network: one network namespace per VM, joined to the host by a veth pair.

Per VM (the virtlet model, measured in notes/vm.md): a netns holding a bridge that joins QEMU's
tap and one end of a veth pair; the other end stays on the host, holds the gateway address (/32,
the same on every such link) and carries a /32 route to the guest. So the host, and the agent on
it, reaches every guest IP without a shared bridge, and a VM's links vanish with its netns.

*Routed* mode (the default) lets the host forward what arrives on each VM's link: forwarding is
switched on for that link alone (`net.ipv4.conf.<link>.forwarding`), never the machine's
`ip_forward`, so a guest reaches the pod network through the host's routes and the rest of the
machine forwards nothing new. Packets *to* a VM arrive on some other link of the host (a dev
cluster's bridge, the host's uplink), which must forward too; the /32 route takes them on.
*Host-only* mode leaves forwarding off: only the host reaches its VMs. *Bridged* mode
(`BridgedNetwork`) puts the host end on an existing bridge of the site instead: no gateway
address, no route, no forwarding on the host; the guest's address comes from a pool.

The kernel is the state: a re-attach after an agent restart finds the netns and reads the guest
address back from the host route, so nothing has to be stored. Names are derived from the key
(the pod UID), short enough for IFNAMSIZ.

A VM keeps its address (issue 26): each new pod of it asks for it (`attach(address=...)`). It
may lie outside this node's pod CIDR when the VM moved here from another vm node: `shared`
lists the ranges the nodes share (the cluster's virtual pod range), whose addresses this node
accepts and routes; such a guest's prefix is the shared range's, so this node's gateway is
on-link for it. A migration target attaches on *standby*: its /32 route gets a high metric while
the source's still carries the traffic, and `claim` makes it the route when the guest arrives
(on one machine both nodes share the routing table, so the /32 moves from link to link).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import subprocess
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._qga import GuestAgent, GuestAgentError, GuestAgentUnavailable

#: The tap device inside every VM's netns (one VM per netns, so one fixed name).
TAP_NAME = "vktap0"
_BRIDGE = "vkbr0"
_PEER = "vkveth0"
_IFNAMSIZ = 15
_HEX = frozenset("0123456789abcdef")


#: The metric of a migration target's /32 until the guest arrives (the source's route is 0).
STANDBY_METRIC = 1000


class NetworkError(RuntimeError):
    """An `ip` command failed, or the CIDR has no free address."""


class NetworkRefused(NetworkError):
    """A pod this node cannot attach as configured: `reason` is the pod's waiting reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class AddressRefused(NetworkRefused):
    """A requested address this node cannot give (or, bridged, no address left in the pool)."""


@dataclass(frozen=True)
class GuestNetwork:
    address: str
    prefix: int
    gateway: str
    mac: str
    dns: tuple[str, ...] = ()
    search: tuple[str, ...] = ()  # DNS search domains

    def seed_file(self) -> bytes:
        """The `vkubelet/network` file the small test guest reads."""
        lines = [f"MAC={self.mac}", f"ADDRESS={self.address}/{self.prefix}"]
        lines += [f"GATEWAY={self.gateway}", *(f"DNS={d}" for d in self.dns)]
        lines += [f"SEARCH={d}" for d in self.search]
        return ("\n".join(lines) + "\n").encode()


def pod_dns_search(namespace: str, domain: str) -> tuple[str, ...]:
    """The search list a kubelet gives a pod of `namespace` (dnsPolicy ClusterFirst)."""
    return (f"{namespace}.svc.{domain}", f"svc.{domain}", domain)


async def _ip(*args: str, check: bool = True) -> str:
    process = await asyncio.create_subprocess_exec(
        "ip",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if check and process.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {err.decode(errors='replace').strip()}")
    return out.decode()


def is_vm_link(name: str, prefix: str = "vkvm") -> bool:
    """Whether `name` is a VM's host link (as `PodNetwork.host_link` names them)."""
    tag = name.removeprefix(prefix)
    return name != tag and len(name) == _IFNAMSIZ and all(c in _HEX for c in tag)


def host_routes() -> list[dict[str, Any]]:
    """Every IPv4 route of this host, every table (local addresses included), as `ip -j`."""
    listing = subprocess.run(
        ["ip", "-j", "-4", "route", "show", "table", "all"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    routes: list[dict[str, Any]] = json.loads(listing or "[]")
    return routes


def foreign_routes(cidr: str, routes: list[dict[str, Any]], prefix: str = "vkvm") -> list[str]:
    """The `routes` that overlap `cidr` and are not on a VM's link: a pod range that another
    network of the host already covers would send the VMs' packets (or the host's own) the wrong
    way, so the node refuses it."""
    network = ipaddress.IPv4Network(cidr)
    found: list[str] = []
    for route in routes:
        dst, dev = route.get("dst", "default"), route.get("dev", "")
        if dst == "default" or is_vm_link(dev, prefix):
            continue
        try:
            overlaps = ipaddress.IPv4Network(dst, strict=False).overlaps(network)
        except ValueError:
            continue
        if overlaps:
            found.append(f"{dst} dev {dev or '-'} table {route.get('table', 'main')}")
    return found


class PodNetwork:
    def __init__(
        self,
        cidr: str,
        *,
        prefix: str = "vkvm",
        forward: bool = True,
        shared: Sequence[str] = (),
        reserved: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """`shared`: the ranges this node shares with other vm nodes (see the module);
        `reserved`: addresses kept for VMs that are powered off here (never handed out)."""
        self.network = ipaddress.IPv4Network(cidr)
        if self.network.num_addresses < 4:
            raise NetworkError(f"pod CIDR {cidr} is too small")
        if len(prefix) > _IFNAMSIZ - 6:
            raise NetworkError(f"link prefix {prefix!r} is too long (at most {_IFNAMSIZ - 6})")
        self.prefix = prefix
        self.forward = forward  # routed mode (see the module doc)
        self.shared = tuple(ipaddress.IPv4Network(s) for s in shared)
        self.reserved = reserved
        self.gateway = str(self.network.network_address + 1)
        self._lock = asyncio.Lock()

    def _tag(self, key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[: _IFNAMSIZ - len(self.prefix)]

    def netns(self, key: str) -> str:
        return f"{self.prefix}-{self._tag(key)}"

    def host_link(self, key: str) -> str:
        return f"{self.prefix}{self._tag(key)}"

    def mac(self, key: str) -> str:
        digest = hashlib.sha256(b"mac:" + key.encode()).digest()
        return "52:54:00:" + ":".join(f"{b:02x}" for b in digest[:3])

    async def attach(
        self, key: str, address: str | None = None, *, standby: bool = False
    ) -> GuestNetwork:
        """Create (or find) the VM's netns, bridge, tap and host link; idempotent per key.
        `address`: the one the VM keeps (AddressRefused when this node cannot give it);
        `standby`: a migration target's, still routed to the source (see the module)."""
        async with self._lock:
            link = self.host_link(key)
            existing = await self._guest_address(link)
            if existing is None:
                chosen = address or await self._free_address()
                self.prefix_for(chosen)  # refuses an address outside what this node routes
                if address is not None and not standby and address in await self._used_addresses():
                    # The VM's guest is configured with it (its seed): another address would
                    # leave it unreachable, and two links routing one address break both.
                    raise AddressRefused(
                        "AddressInUse", f"address {address} of this VM is taken by another one"
                    )
                await self._create(key, chosen, standby=standby)
            else:
                chosen = existing
            # Also on a link an earlier agent made: the mode may have changed since.
            await self._settle(link)
            return self._guest(key, chosen)

    async def _settle(self, link: str) -> None:
        _link_settings(link, forward=self.forward)

    async def claim(self, key: str) -> GuestNetwork:
        """The arrived guest's /32 routes over this VM's link from now on (a migration target's
        standby route becomes the route, taking it from the source's link on one machine)."""
        async with self._lock:
            link = self.host_link(key)
            address = await self._guest_address(link)
            if address is None:
                raise NetworkError(f"VM link {link} is gone")
            route = f"{address}/32"
            await _ip("route", "replace", route, "dev", link, "src", self.gateway)
            await _ip(
                "route", "del", route, "dev", link, "metric", str(STANDBY_METRIC), check=False
            )
            return self._guest(key, address)

    def prefix_for(self, address: str) -> int:
        """The guest's prefix length: the pod CIDR's, or the shared range's holding it.
        AddressRefused when it is in neither, or is the gateway or a network's edge."""
        ip = ipaddress.IPv4Address(address)
        for network in (self.network, *self.shared):
            if ip in network:
                if ip in (network.network_address, network.broadcast_address) or (
                    address == self.gateway
                ):
                    raise AddressRefused(
                        "AddressOutOfRange", f"address {address} is not a host address here"
                    )
                return network.prefixlen
        ranges = ", ".join(str(n) for n in self.shared) or "none"
        raise AddressRefused(
            "AddressOutOfRange",
            f"address {address} is outside this node's podCIDR {self.network} and its "
            f"sharedPodCIDRs ({ranges})",
        )

    def _guest(self, key: str, address: str) -> GuestNetwork:
        try:
            prefix = self.prefix_for(address)
        except AddressRefused:  # attached before a shared range was removed from the config
            prefix = self.network.prefixlen
        return GuestNetwork(address, prefix, self.gateway, self.mac(key))

    async def detach(self, key: str) -> None:
        """Remove the VM's links and netns; nothing to do when they are already gone."""
        async with self._lock:
            await _ip("link", "del", self.host_link(key), check=False)
            await _ip("netns", "del", self.netns(key), check=False)

    async def _guest_address(self, link: str) -> str | None:
        """The guest address routed over this VM's host link (None: no such link, or broken)."""
        routes = await _ip("-4", "route", "show", "dev", link, check=False)
        if routes == "" and await _ip("link", "show", link, check=False):
            await _ip("link", "del", link, check=False)  # half-made by an interrupted attach
        return _host_route(routes)

    async def _used_addresses(self) -> set[str]:
        """The gateway's and every attached VM's, as the kernel's links and routes say, and
        every host route's (another node's VM on this machine, a VM migrated away)."""
        used: set[str] = {self.gateway}
        for line in (await _ip("-4", "route", "show", "table", "main", check=False)).splitlines():
            first = line.split()[0] if line.split() else ""
            if first and "/" not in first and first != "default":
                used.add(first)
        listing = await _ip("-o", "link", "show", check=False)
        for line in listing.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if is_vm_link(name, self.prefix):
                # Only read: another node's link (a bridged one routes nothing) is not ours to fix.
                address = await _routed_address(name)
                if address:
                    used.add(address)
        return used

    async def _free_address(self) -> str:
        used = await self._used_addresses() | set(self.reserved())
        for host in self.network.hosts():
            if str(host) not in used:
                return str(host)
        raise NetworkError(f"pod CIDR {self.network} has no free address")

    async def _create(self, key: str, address: str, *, standby: bool = False) -> None:
        """The VM's netns and links; a failure removes them again (nothing half-made stays)."""
        ns, link = self.netns(key), self.host_link(key)
        if not (await _ip("netns", "list", check=False)).count(ns):
            await _ip("netns", "add", ns)
        try:
            await self._create_links(ns, link)
            await self._host_end(link, address, standby=standby)
        except NetworkError:
            await _ip("link", "del", link, check=False)
            await _ip("netns", "del", ns, check=False)
            raise

    async def _create_links(self, ns: str, link: str) -> None:
        steps: list[tuple[str, ...]] = [
            ("link", "add", link, "type", "veth", "peer", "name", _PEER, "netns", ns),
            ("-n", ns, "link", "add", _BRIDGE, "type", "bridge"),
            ("-n", ns, "tuntap", "add", "dev", TAP_NAME, "mode", "tap"),
            ("-n", ns, "link", "set", _PEER, "master", _BRIDGE),
            ("-n", ns, "link", "set", TAP_NAME, "master", _BRIDGE),
            ("-n", ns, "link", "set", "lo", "up"),
            ("-n", ns, "link", "set", _PEER, "up"),
            ("-n", ns, "link", "set", TAP_NAME, "up"),
            ("-n", ns, "link", "set", _BRIDGE, "up"),
        ]
        # A netns left by an interrupted attach may hold some of these already.
        await _ip("-n", ns, "link", "del", _BRIDGE, check=False)
        await _ip("-n", ns, "link", "del", TAP_NAME, check=False)
        await _ip("-n", ns, "link", "del", _PEER, check=False)
        for step in steps:
            await _ip(*step)

    async def _host_end(self, link: str, address: str, *, standby: bool) -> None:
        """The gateway address and the guest's /32 route on the host's end of the link."""
        await _ip("addr", "add", f"{self.gateway}/32", "dev", link)
        await _ip("link", "set", link, "up")
        route = ("route", "replace", f"{address}/32", "dev", link, "src", self.gateway)
        await _ip(*route, *(("metric", str(STANDBY_METRIC)) if standby else ()))


async def _routed_address(link: str) -> str | None:
    """The guest address of a /32 route over `link`, if any (only read)."""
    return _host_route(await _ip("-4", "route", "show", "dev", link, check=False))


def _host_route(routes: str) -> str | None:
    """The first host route (an address without a prefix) of `ip route show` output."""
    for line in routes.splitlines():
        first = line.split()[0] if line.split() else ""
        if first and "/" not in first and first != "default":
            return first
    return None


def bridge_missing(bridge: str) -> str | None:
    """Why `bridge` cannot take VMs (it does not exist, or is not a bridge), or None."""
    if Path(f"/sys/class/net/{bridge}/bridge").is_dir():
        return None
    if Path(f"/sys/class/net/{bridge}").exists():
        return f"network.bridge: {bridge} is not a bridge"
    return f"network.bridge: bridge {bridge} does not exist on this host"


#: Bridged mode records a VM's address on its host link (`ip link set <link> alias ...`).
_ALIAS = "vkubelet-address="


class BridgedNetwork(PodNetwork):
    """Bridged mode: the host end of each VM's link joins an existing host `bridge` (the site's
    flat L2 network), and the guest takes an address of `pool` in `subnet` with `gateway` as
    its default route. The host routes and forwards nothing for it (no address, no route on the
    link); the site's network carries its packets. The kernel is the state here too: the
    address is the link's alias, read back by a restarted agent, and the aliases of every VM
    link of this machine say which addresses of the pool are taken."""

    def __init__(
        self,
        bridge: str,
        subnet: str,
        gateway: str,
        pool: tuple[str, str],
        *,
        prefix: str = "vkvm",
        reserved: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        super().__init__(subnet, prefix=prefix, forward=False, reserved=reserved)
        self.bridge = bridge
        self.gateway = gateway
        self.pool = (ipaddress.IPv4Address(pool[0]), ipaddress.IPv4Address(pool[1]))

    def pool_text(self) -> str:
        return f"{self.pool[0]}-{self.pool[1]}"

    def _check_bridge(self) -> None:
        if (why := bridge_missing(self.bridge)) is not None:
            raise NetworkRefused("BridgeMissing", why)

    async def claim(self, key: str) -> GuestNetwork:
        """Nothing routes to a bridged guest: it announces itself on the L2 network."""
        async with self._lock:
            address = await self._guest_address(self.host_link(key))
            if address is None:
                raise NetworkError(f"VM link {self.host_link(key)} is gone")
            return self._guest(key, address)

    def prefix_for(self, address: str) -> int:
        if self.pool[0] <= ipaddress.IPv4Address(address) <= self.pool[1]:
            return self.network.prefixlen
        raise AddressRefused(
            "AddressOutOfRange", f"address {address} is outside network.pool {self.pool_text()}"
        )

    def _guest(self, key: str, address: str) -> GuestNetwork:
        return GuestNetwork(address, self.network.prefixlen, self.gateway, self.mac(key))

    async def _settle(self, link: str) -> None:
        """(Re)join the bridge: a bridge deleted and made again has lost its ports."""
        self._check_bridge()
        await _ip("link", "set", link, "master", self.bridge)
        await _ip("link", "set", link, "up")  # an attach interrupted before it did

    async def _guest_address(self, link: str) -> str | None:
        listing = await _ip("-j", "link", "show", "dev", link, check=False)
        links: list[dict[str, Any]] = json.loads(listing or "[]")
        if not links:
            return None
        alias = str(links[0].get("ifalias", ""))
        if alias.startswith(_ALIAS):
            return alias.removeprefix(_ALIAS)
        await _ip("link", "del", link, check=False)  # half-made by an interrupted attach
        return None

    async def _used_addresses(self) -> set[str]:
        """The gateway's and the address on every VM link's alias (this node's and any other
        node's on this machine sharing the pool)."""
        used = {self.gateway}
        listing: list[dict[str, Any]] = json.loads(await _ip("-j", "link", "show") or "[]")
        for link in listing:
            alias = str(link.get("ifalias", ""))
            if is_vm_link(str(link.get("ifname", "")), self.prefix) and alias.startswith(_ALIAS):
                used.add(alias.removeprefix(_ALIAS))
        return used

    async def _free_address(self) -> str:
        used = await self._used_addresses() | set(self.reserved())
        first, last = self.pool
        for number in range(int(first), int(last) + 1):
            if str(ipaddress.IPv4Address(number)) not in used:
                return str(ipaddress.IPv4Address(number))
        raise AddressRefused(
            "AddressPoolExhausted",
            f"network.pool {self.pool_text()}: every address is taken by a VM of this host",
        )

    async def _create(self, key: str, address: str, *, standby: bool = False) -> None:
        self._check_bridge()  # before anything is made
        await super()._create(key, address, standby=standby)

    async def _host_end(self, link: str, address: str, *, standby: bool) -> None:
        """The address in the link's alias first (a link on the bridge always says whose it
        is), then the bridge; no address, no route, no forwarding on the host."""
        await _ip("link", "set", link, "alias", _ALIAS + address)
        await _ip("link", "set", link, "master", self.bridge)
        await _ip("link", "set", link, "up")


def _link_settings(link: str, *, forward: bool) -> None:
    """proxy_arp: the guest's ARP for other addresses of its range (other VMs) is answered by
    the host, which routes them; forwarding: what the guest sends beyond the host is forwarded
    (routed mode), or dropped (host-only)."""
    conf = Path(f"/proc/sys/net/ipv4/conf/{link}")
    (conf / "proxy_arp").write_text("1")
    (conf / "forwarding").write_text("1" if forward else "0")


# The guest's interface (the first but lo: a VM has one) gets address $1 (address/prefix)
# instead of the IPv4 ones it has, the default route via $2, and forgets its neighbours (the new
# pod's gateway link has another MAC). The addresses are arguments, never part of the script.
_READDRESS = (
    'for d in /sys/class/net/*; do n="${d##*/}"; [ "$n" = lo ] && continue; '
    'ip -4 addr flush dev "$n" && ip addr add "$1" dev "$n" && ip link set "$n" up && '
    'ip route replace default via "$2" dev "$n" && ip neigh flush dev "$n"; exit $?; done; exit 3'
)


async def readdress(
    agent: GuestAgent,
    address: str,
    prefix: int,
    gateway: str,
    timeout: float | None = None,  # noqa: ASYNC109 - the guest agent's own limit
) -> str | None:
    """Give a running guest this node's view of its address (`address/prefix`, default route
    via `gateway`), through its agent: a guest resumed from hibernation, or arrived by
    migration, still has the network of the pod it left. Returns why that failed (the guest
    keeps its old network), or None."""
    argv = ["sh", "-c", _READDRESS, "sh", f"{address}/{prefix}", gateway]
    try:
        result = await agent.exec(argv, timeout=timeout)
    except (GuestAgentError, GuestAgentUnavailable, TimeoutError, OSError) as e:
        return str(e) or type(e).__name__
    if result.exit_code != 0:
        return result.stderr.decode(errors="replace")[:200] or f"exit {result.exit_code}"
    return None
