"""A fleet of libvirt hosts: one virtual node per hypervisor, all driven by one agent process.

    runtime: libvirt                    # implied; every other key of the vm config is a
    stateDir: /var/lib/vkubelet/vm      # default shared by the hosts (stateDir and imageStore
    defaults: {cpu: "1", memory: 256Mi} # get a subdirectory per host)
    libvirt:
      pool: {name: vkubelet, path: /var/lib/libvirt/images/vkubelet}   # (the default)
    hosts:
      - name: hv-1                      # the node's name
        uri: qemu+ssh://root@192.0.2.11/system
        identityFile: hv-1.key          # relative to this file: the URI's keyfile=
        noVerify: false                 # true: the URI's no_verify=1 (host key not checked)
        # how the other hosts' daemons reach this one's for a live migration (`_lvmigrate`),
        # with a key and known hosts on *those hosts*; default: uri, whose keyfile= is the
        # agent's path: set it
        migrationURI: qemu+libssh://root@192.0.2.11/system?keyfile=/etc/vkubelet/migrate.key
        podCIDR: 10.213.1.0/24          # default: the shared one
        network: {clusterDNS: [10.96.0.10]}   # merged over the shared `network`
        labels: {example.com/rack: r1}
        taints: ["example.com/hv=1:NoSchedule"]

The addresses each host hands out (routed: its podCIDR; bridged: its network.pool) must not
overlap another host's: each host picks its VMs' addresses alone, and a site routes each
routed host's range to it, so two hosts of one range would give out the same address.

The agent's fleet mechanism runs the nodes (`NodeFleet`, as the ssh provider's devices): each
host is a `VMProvider` with its own libvirt connection, so an unreachable host makes only its
own node NotReady (its ping fails with libvirt's message). The daemons never read the agent's
files: disks and seeds are volumes of a storage pool on each host (`_pool`); the VMs' network
is made by libvirt on each host (`_lvnet`), nothing on the agent's. The file is read when the
agent starts (the chart restarts the agent when its ConfigMap changes).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
from msgspec import Meta

from ..._fields import FilePath, Section, decode, read_file
from ...sdk import ConfigError, FleetNode, parse_taint
from ...sdk.provider import EventSink
from ._config import LibvirtPool, VMConfig, parse_config
from ._pool import PooledLibvirtRuntime
from ._provider import VMProvider

__all__ = ["FleetHost", "VMFleet", "load_fleet"]

_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_Text = Annotated[str, Meta(min_length=1)]
_SSH_TRANSPORTS = ("ssh", "libssh", "libssh2")


class _Host(Section):
    name: _Text
    uri: _Text
    identity_file: FilePath | None = None
    no_verify: bool = False
    migration_uri: _Text | None = msgspec.field(default=None, name="migrationURI")
    pod_cidr: _Text | None = msgspec.field(default=None, name="podCIDR")
    network: dict[str, Any] | None = None
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    taints: list[_Text] | None = None


@dataclass(frozen=True)
class FleetHost:
    """One host of the fleet: its node and the config of that node's provider."""

    name: str
    config: VMConfig
    labels: dict[str, str]
    taints: list[dict[str, str]] | None


def load_fleet(path: Path) -> list[FleetHost] | None:
    """The hosts of a fleet config (None: `path` is a single node's config, no `hosts`)."""
    raw = read_file(path)
    if not isinstance(raw, dict) or "hosts" not in raw:
        return None
    return parse_fleet(raw, origin=str(path), base=path.parent)


def parse_fleet(raw: dict[str, Any], *, origin: str, base: Path) -> list[FleetHost]:
    def fail(field: str, why: str) -> ConfigError:
        return ConfigError(f"{origin}: {field}: {why}")

    shared = {k: v for k, v in raw.items() if k != "hosts"}
    for own in ("uri", "migrationURI"):
        if own in (shared.get("libvirt") or {}):
            raise fail(f"libvirt.{own}", f"a fleet's hosts each have their own: hosts[].{own}")
    shared.setdefault("runtime", "libvirt")
    if shared["runtime"] != "libvirt":
        raise fail("runtime", "a fleet of hosts is of libvirt hosts: runtime: libvirt")
    defaults = parse_config(shared, origin=origin, base=base)
    hosts = decode(raw["hosts"], list[_Host], origin, at="hosts", what="a list of hosts")
    if not hosts:
        raise fail("hosts", "no host: list at least one")
    # The daemons never see the agent's files: always a pool (the default one unless set).
    pool = defaults.libvirt_pool or LibvirtPool()
    seen: set[str] = set()
    fleet = []
    for index, host in enumerate(hosts):
        where = f"hosts[{index}]"
        if not _DNS1123.fullmatch(host.name) or len(host.name) > 63:
            raise fail(f"{where}.name", f"{host.name!r} is not a node name (lowercase DNS label)")
        if host.name in seen:
            raise fail(f"{where}.name", f"{host.name!r} is listed twice")
        seen.add(host.name)
        uri = host_uri(host, base, partial(fail, f"{where}.uri"))
        try:
            taints = None if host.taints is None else [parse_taint(t) for t in host.taints]
        except ConfigError as e:
            raise fail(f"{where}.taints", str(e)) from None
        # podCIDR and network, checked as the single-node config checks them.
        mine: dict[str, Any] = {"podCIDR": host.pod_cidr} if host.pod_cidr else {}
        if host.network is not None:
            mine["network"] = {**(shared.get("network") or {}), **host.network}
        checked = parse_config({**shared, **mine}, origin=f"{origin}: {where}", base=base)
        migration = host.migration_uri
        if migration is not None and ("://" not in migration or not urlsplit(migration).hostname):
            raise fail(
                f"{where}.migrationURI",
                f"{migration!r} is not a libvirt URI naming this host as the other hosts reach "
                "it (qemu+libssh://root@hv-1/system?keyfile=/etc/vkubelet/migrate.key)",
            )
        config = replace(
            checked,
            libvirt_uri=uri,
            libvirt_migration_uri=migration,
            libvirt_pool=pool,
            state_dir=defaults.state_dir / host.name,
            image_store=defaults.image_store / host.name,
            origin=f"{origin}: {where}",
        )
        fleet.append(FleetHost(host.name, config, dict(host.labels), taints))
    _refuse_overlaps(fleet, fail)
    return fleet


def handed_out(config: VMConfig) -> tuple[str, list[ipaddress.IPv4Network]]:
    """The field naming the addresses a host gives its VMs, and those addresses."""
    if (bridged := config.bridged) is not None:
        first, last = (ipaddress.IPv4Address(a) for a in bridged.pool)
        return "network.pool", list(ipaddress.summarize_address_range(first, last))
    return "podCIDR", [ipaddress.IPv4Network(config.pod_cidr)]


def _refuse_overlaps(fleet: Sequence[FleetHost], fail: Callable[[str, str], ConfigError]) -> None:
    """Two hosts that may give out the same address are refused, naming the later one's field
    (see the module)."""
    seen: list[tuple[str, str, list[ipaddress.IPv4Network]]] = []
    for index, host in enumerate(fleet):
        field, ranges = handed_out(host.config)
        for name, other_field, others in seen:
            if any(a.overlaps(b) for a in ranges for b in others):
                raise fail(
                    f"hosts[{index}].{field}",
                    f"overlaps {name}'s {other_field} (each host hands out its own addresses: "
                    "give every host a range of its own)",
                )
        seen.append((host.name, field, ranges))


def host_uri(host: _Host, base: Path, fail: Callable[[str], ConfigError]) -> str:
    """The host's URI with `keyfile=` (the identity file, absolute), `no_verify=1` and (ssh)
    `no_tty=1` added; the key's path is all that is ever written (logged, shown), never its
    content."""
    if "://" not in host.uri:
        raise fail(f"{host.uri!r} is not a libvirt URI (qemu+ssh://root@hv-1/system)")
    parts = urlsplit(host.uri)
    transport = parts.scheme.partition("+")[2]
    query = parse_qsl(parts.query, keep_blank_values=True)
    if (host.identity_file is not None or host.no_verify) and transport not in _SSH_TRANSPORTS:
        raise fail("identityFile and noVerify need an ssh transport (qemu+ssh://...)")
    names = {name for name, _ in query}
    if host.identity_file is not None:
        if "keyfile" in names:
            raise fail("keyfile= is in the URI and identityFile is set: keep one")
        # Absolute, symlinks kept: a mounted Secret's files are links into a directory that
        # is replaced when the Secret changes.
        query.append(("keyfile", str((base / host.identity_file).absolute())))
    if host.no_verify and "no_verify" not in names:
        query.append(("no_verify", "1"))
    if transport == "ssh" and "no_tty" not in names:
        # The agent has no terminal: ssh must fail rather than wait for a passphrase.
        query.append(("no_tty", "1"))
    return urlunsplit(parts._replace(query=urlencode(query, safe="/")))


class VMFleet:
    """Implements `NodeFleet`: one VMProvider per host, each its own node."""

    def __init__(
        self, hosts: Sequence[FleetHost], *, host_ip: str, events: EventSink | None
    ) -> None:
        self.members = []
        for host in hosts:
            runtime = PooledLibvirtRuntime(host.config, host.name)
            provider = VMProvider(host.name, host.config, runtime, host_ip=host_ip, events=events)
            self.members.append(
                FleetNode(name=host.name, provider=provider, labels=host.labels, taints=host.taints)
            )

    async def watch_nodes(self) -> AsyncIterator[Sequence[FleetNode]]:
        yield list(self.members)
        await asyncio.Event().wait()  # the hosts are the file's when the agent started
