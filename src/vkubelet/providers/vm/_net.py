"""The pod network: one network namespace per VM, joined to the host by a veth pair.

Per VM (the virtlet model, measured in notes/vm.md): a netns holding a bridge that joins QEMU's
tap and one end of a veth pair; the other end stays on the host, holds the gateway address (/32,
the same on every such link) and carries a /32 route to the guest. So the host, and the agent on
it, reaches every guest IP without a shared bridge, and a VM's links vanish with its netns.
Guest-to-guest traffic would need IP forwarding on the host, which we do not switch on.

The kernel is the state: a re-attach after an agent restart finds the netns and reads the guest
address back from the host route, so nothing has to be stored. Names are derived from the key
(the pod UID), short enough for IFNAMSIZ.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from ._qga import GuestAgent, GuestAgentError, GuestAgentUnavailable

#: The tap device inside every VM's netns (one VM per netns, so one fixed name).
TAP_NAME = "vktap0"
_BRIDGE = "vkbr0"
_PEER = "vkveth0"
_IFNAMSIZ = 15
_HEX = frozenset("0123456789abcdef")


class NetworkError(RuntimeError):
    """An `ip` command failed, or the CIDR has no free address."""


@dataclass(frozen=True)
class GuestNetwork:
    address: str
    prefix: int
    gateway: str
    mac: str
    dns: tuple[str, ...] = ()

    def seed_file(self) -> bytes:
        """The `vkubelet/network` file the small test guest reads."""
        lines = [f"MAC={self.mac}", f"ADDRESS={self.address}/{self.prefix}"]
        lines += [f"GATEWAY={self.gateway}", *(f"DNS={d}" for d in self.dns)]
        return ("\n".join(lines) + "\n").encode()


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


class PodNetwork:
    def __init__(self, cidr: str, *, prefix: str = "vkvm") -> None:
        self.network = ipaddress.IPv4Network(cidr)
        if self.network.num_addresses < 4:
            raise NetworkError(f"pod CIDR {cidr} is too small")
        if len(prefix) > _IFNAMSIZ - 6:
            raise NetworkError(f"link prefix {prefix!r} is too long (at most {_IFNAMSIZ - 6})")
        self.prefix = prefix
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

    async def attach(self, key: str, address: str | None = None) -> GuestNetwork:
        """Create (or find) the VM's netns, bridge, tap and host link; idempotent per key."""
        async with self._lock:
            link = self.host_link(key)
            existing = await self._guest_address(link)
            if existing is None:
                chosen = address or await self._free_address()
                if ipaddress.IPv4Address(chosen) not in self.network:
                    raise NetworkError(f"address {chosen} is outside the pod CIDR {self.network}")
                if address is not None and address in await self._used_addresses():
                    # The VM's guest is configured with it (its seed): another address would
                    # leave it unreachable, and two links routing one address break both.
                    raise NetworkError(f"address {address} of this VM is taken by another one")
                await self._create(key, chosen)
            else:
                chosen = existing
            return GuestNetwork(chosen, self.network.prefixlen, self.gateway, self.mac(key))

    async def detach(self, key: str) -> None:
        """Remove the VM's links and netns; nothing to do when they are already gone."""
        async with self._lock:
            await _ip("link", "del", self.host_link(key), check=False)
            await _ip("netns", "del", self.netns(key), check=False)

    async def _guest_address(self, link: str) -> str | None:
        """The guest address routed over an existing host link (None: no such link, or broken)."""
        routes = await _ip("-4", "route", "show", "dev", link, check=False)
        for line in routes.splitlines():
            first = line.split()[0] if line.split() else ""
            if first and "/" not in first and first != "default":
                return first
        if routes == "" and await _ip("link", "show", link, check=False):
            await _ip("link", "del", link, check=False)  # half-made by an interrupted attach
        return None

    async def _used_addresses(self) -> set[str]:
        """The gateway's and every attached VM's, as the kernel's links and routes say."""
        used: set[str] = {self.gateway}
        listing = await _ip("-o", "link", "show", check=False)
        for line in listing.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            tag = name.removeprefix(self.prefix)
            if name != tag and len(name) == _IFNAMSIZ and all(c in _HEX for c in tag):
                address = await self._guest_address(name)
                if address:
                    used.add(address)
        return used

    async def _free_address(self) -> str:
        used = await self._used_addresses()
        for host in self.network.hosts():
            if str(host) not in used:
                return str(host)
        raise NetworkError(f"pod CIDR {self.network} has no free address")

    async def _create(self, key: str, address: str) -> None:
        ns, link = self.netns(key), self.host_link(key)
        if not (await _ip("netns", "list", check=False)).count(ns):
            await _ip("netns", "add", ns)
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
            ("addr", "add", f"{self.gateway}/32", "dev", link),
            ("link", "set", link, "up"),
            ("route", "replace", f"{address}/32", "dev", link, "src", self.gateway),
        ]
        # A netns left by an interrupted attach may hold some of these already.
        await _ip("-n", ns, "link", "del", _BRIDGE, check=False)
        await _ip("-n", ns, "link", "del", TAP_NAME, check=False)
        await _ip("-n", ns, "link", "del", _PEER, check=False)
        for step in steps:
            await _ip(*step)
        _proxy_arp(link)


def _proxy_arp(link: str) -> None:
    """The guest's ARP for other pod addresses is answered by the host (routed from there)."""
    Path(f"/proc/sys/net/ipv4/conf/{link}/proxy_arp").write_text("1")


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
    pod_cidr: str,
    timeout: float | None = None,  # noqa: ASYNC109 - the guest agent's own limit
) -> str | None:
    """Give a running guest this pod's address, through its agent: a guest resumed from
    hibernation, or arrived by migration, still has the address of the pod it left. Returns
    why that failed (the guest keeps its old address), or None."""
    network = ipaddress.IPv4Network(pod_cidr)
    gateway = str(network.network_address + 1)  # as `PodNetwork` assigns it
    argv = ["sh", "-c", _READDRESS, "sh", f"{address}/{network.prefixlen}", gateway]
    try:
        result = await agent.exec(argv, timeout=timeout)
    except (GuestAgentError, GuestAgentUnavailable, TimeoutError, OSError) as e:
        return str(e) or type(e).__name__
    if result.exit_code != 0:
        return result.stderr.decode(errors="replace")[:200] or f"exit {result.exit_code}"
    return None
