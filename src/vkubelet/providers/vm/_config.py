"""The VM provider's config file (`--provider-config vm.yaml`).

    stateDir: /var/lib/vkubelet/vm      # run dirs of the VMs, CRI logs (relative: to this file)
    imageStore: images                   # default <stateDir>/images
    accel: auto                          # auto | kvm | tcg
    runtime: qemu                        # qemu (QEMU driven directly) | libvirt (`_libvirt`)
    libvirt: {uri: "qemu:///system"}     # runtime libvirt: the daemon, local or remote
    # libvirt.pool: {name: vkubelet, path: /var/lib/libvirt/images/vkubelet}: the disks and
    # the seed as volumes of this directory pool of the daemon (`_pool`), not agent files
    # libvirt: {migrationURI: ...}       # how other hosts' daemons reach this one (default: uri)
    reserved: {cpu: "1", memory: 1Gi}    # kept for the host; capacity = host minus this
    podCIDR: 10.213.0.0/24               # this node's VMs' addresses (no other route may cover it)
    network:                             # `_net`
      mode: routed                       # routed (default) | host-only | bridged
      # bridged only: an existing host bridge, its subnet, gateway and the VMs' address pool
      # bridge: br0, subnet: 192.0.2.0/24, gateway: 192.0.2.1, pool: 192.0.2.100-192.0.2.150
      clusterDNS: [10.96.0.10]           # the guests' nameservers (default: none), and their
      clusterDomain: cluster.local       # search list <ns>.svc.<domain> svc.<domain> <domain>
    sharedPodCIDRs: [10.213.0.0/16]      # other vm nodes' ranges a VM migrated here keeps
    imagePrefix: vm.vkubelet.io
    translations: [{name: tiny, url: file:///srv/tiny.qcow2}]
    translationsFile: images.yaml        # re-read when it changes (a mounted ConfigMap); wins
    translationConfigMap:                # re-read from the API; wins over both
      {namespace: kube-system, name: vm-images, kubeconfig: reader.kubeconfig, intervalSeconds: 30}
    imageGCIntervalSeconds: 600
    guestAgentTimeoutSeconds: 300
    containerLogMaxSize: 10Mi            # the console's CRI log rotates at this size (kubelet's)
    containerLogMaxFiles: 5              # and keeps this many files (the current one included)
    defaults: {cpu: "1", memory: 256Mi}
    hotplug: {maxCpus: 4, maxMemory: 2Gi, memorySlots: 4}   # live-resize headroom (0: none)
    storage: {kubeconfig: provisioner.kubeconfig, intervalSeconds: 2}  # PVC disks (`_volumes`)
    backupDirectories: [/srv/backups]    # where backup pods may write (default <stateDir>/backups)

Everything is checked when the agent starts, and every error names the file and the field: a
typo should stop the agent with a message, not surface later as a pod that never boots.
Translation rules are kept as written here; `vmstore`'s `parse_rules` reads them (with the file
as their origin) when the provider starts.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..._fields import FilePath, PositiveNumber, Section, decode, read_file
from ...sdk import ConfigError
from ...sdk.logs import LogRotation
from ...sdk.quantity import QuantityError, parse_quantity
from ._persist import MachineGC
from ._volumes import StorageConfig

__all__ = [
    "Bridged",
    "ConfigError",
    "ConfigMapSource",
    "LibvirtPool",
    "VMConfig",
    "load_config",
]

Accel = Literal["auto", "kvm", "tcg"]
#: routed: the host forwards between its VMs and the pod network; host-only: only the host (and
#: the agent on it) reaches them; bridged: the VMs join an existing host bridge (a flat L2
#: network of the site) with addresses from a pool.
NetworkMode = Literal["routed", "host-only", "bridged"]
#: qemu: the agent starts QEMU itself on this host; libvirt: a libvirt daemon (local or remote,
#: `libvirt.uri`) runs each VM as a domain.
RuntimeKind = Literal["qemu", "libvirt"]

_MIB = 2**20
_DOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\.?")
_Text = Annotated[str, Meta(min_length=1)]
_Seconds = Annotated[float, Meta(gt=0, description="a positive number of seconds")]
_Count = Annotated[int, Meta(ge=0, le=255, description="a whole number 0-255")]


class _Resources(Section):
    cpu: str | float | None = None  # quantities
    memory: str | float | None = None


class _ConfigMap(Section):
    namespace: _Text
    name: _Text
    kubeconfig: _Text
    interval_seconds: PositiveNumber = 30.0


class _MachineGC(Section):  # _persist
    kubeconfig: FilePath | None = None  # None: the process's own (a pod's service account)
    interval_seconds: PositiveNumber = 300.0


class _Storage(Section):  # _volumes
    kubeconfig: FilePath
    interval_seconds: PositiveNumber = 2.0


class _Hotplug(Section):
    max_cpus: _Count | None = None
    max_memory: str | float | None = None
    memory_slots: _Count | None = None


class _Network(Section):
    mode: NetworkMode = "routed"
    cluster_dns: Annotated[list[_Text], Meta(description="a list of IP addresses")] = msgspec.field(
        default_factory=list, name="clusterDNS"
    )
    cluster_domain: _Text = "cluster.local"
    bridge: _Text | None = None
    subnet: _Text | None = None
    gateway: _Text | None = None
    pool: _Text | None = None


class _Pool(Section):
    name: _Text = "vkubelet"
    path: _Text = "/var/lib/libvirt/images/vkubelet"


class _Libvirt(Section):
    uri: _Text = "qemu:///system"
    pool: _Pool | None = None
    migration_uri: _Text | None = msgspec.field(default=None, name="migrationURI")


class _File(Section):
    state_dir: FilePath | None = None
    image_store: FilePath | None = None
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    runtime: RuntimeKind = "qemu"
    libvirt: _Libvirt | None = None
    reserved: _Resources | None = None
    pod_cidr: _Text = msgspec.field(default="10.213.0.0/24", name="podCIDR")
    network: _Network | None = None
    shared_pod_cidrs: Annotated[list[_Text], Meta(description="a list of IPv4 networks")] = (
        msgspec.field(default_factory=list, name="sharedPodCIDRs")
    )
    image_prefix: _Text = "vm.vkubelet.io"
    translations: Annotated[
        list[dict[str, Any]], Meta(description="a list of rules (mappings with name|regexp, url)")
    ] = msgspec.field(default_factory=list)
    translations_file: FilePath | None = None
    translation_config_map: _ConfigMap | None = None
    image_gc_interval_seconds: _Seconds = msgspec.field(
        default=600.0, name="imageGCIntervalSeconds"
    )
    guest_agent_timeout_seconds: _Seconds = 300.0
    container_log_max_size: str | int = "10Mi"
    container_log_max_files: Annotated[
        int, Meta(ge=2, description="a whole number, at least 2")
    ] = 5
    defaults: _Resources | None = None
    machine_gc: _MachineGC | None = msgspec.field(default=None, name="machineGC")
    hotplug: _Hotplug | None = None
    storage: _Storage | None = None
    backup_directories: Annotated[list[_Text], Meta(description="a list of directories")] = (
        msgspec.field(default_factory=list)
    )


@dataclass(frozen=True)
class ConfigMapSource:
    """Translation rules in a ConfigMap, read with `kubeconfig`'s credentials (which need `get`
    on that ConfigMap: the node's own identity may read only what its pods reference)."""

    namespace: str
    name: str
    kubeconfig: Path
    interval: float = 30.0


@dataclass(frozen=True)
class Bridged:
    """Bridged mode's settings, checked: `pool` is (first, last), inclusive, inside `subnet`."""

    bridge: str
    subnet: str
    gateway: str
    pool: tuple[str, str]


@dataclass(frozen=True)
class LibvirtPool:
    """A directory storage pool of the libvirt daemon holding the VMs' disks and seeds, made
    (defined, built, started) when missing: for a daemon that cannot see the agent's files."""

    name: str = "vkubelet"
    path: str = "/var/lib/libvirt/images/vkubelet"


@dataclass(frozen=True)
class VMConfig:
    state_dir: Path
    image_store: Path
    accel: Accel = "auto"
    runtime: RuntimeKind = "qemu"
    libvirt_uri: str = "qemu:///system"
    libvirt_pool: LibvirtPool | None = None  # `_pool`: disks as volumes of the daemon's pool
    # The URI other hosts' libvirt daemons reach this one's with, for a live migration to it
    # (`_lvmigrate`); None: `libvirt_uri`.
    libvirt_migration_uri: str | None = None
    reserved_millicpu: int = 0
    reserved_memory: int = 256 * _MIB  # bytes
    pod_cidr: str = "10.213.0.0/24"
    network_mode: NetworkMode = "routed"
    cluster_dns: tuple[str, ...] = ()  # the guests' nameservers; () = none
    cluster_domain: str = "cluster.local"
    bridged: Bridged | None = None  # network.mode bridged
    # Other vm nodes' ranges whose addresses this node takes for a VM that moved here (it
    # keeps its address, `_net`): the cluster's virtual pod range the nodes share.
    shared_pod_cidrs: tuple[str, ...] = ()
    image_prefix: str = "vm.vkubelet.io"
    translations: list[dict[str, Any]] = field(default_factory=list)  # as written; vmstore parses
    translations_file: Path | None = None
    translation_config_map: ConfigMapSource | None = None
    image_gc_interval: float = 600.0
    guest_agent_timeout: float = 300.0
    log_rotation: LogRotation = field(default_factory=LogRotation)  # the console's CRI log
    default_millicpu: int = 1000
    default_memory: int = 256 * _MIB
    origin: str = "<defaults>"  # the file, for messages
    machine_gc: MachineGC | None = None  # _persist: remove machines whose VirtualMachine is gone
    # Live-resize headroom (`_resize`): QEMU starts with room for this many vCPUs and this much
    # memory in that many DIMM slots (pod annotations may change it per VM).
    hotplug_max_vcpus: int = 4
    hotplug_max_memory: int = 2 * 2**30
    hotplug_slots: int = 4
    storage: StorageConfig | None = None  # the PVC disk provisioner's credentials (`_volumes`)

    @property
    def volume_root(self) -> Path:
        """Disk images of provisioned PVs (they outlive pods and VMs)."""
        return self.state_dir / "volumes"

    # Backup pods write and restores read only below these (absolute); () = <stateDir>/backups.
    backup_directories: tuple[Path, ...] = ()

    @property
    def backup_roots(self) -> tuple[Path, ...]:
        return self.backup_directories or (self.state_dir.resolve() / "backups",)

    @property
    def run_root(self) -> Path:
        """One directory per VM (by pod UID): QEMU's sockets, console log, pod.json, state."""
        return self.state_dir / "vms"

    @property
    def log_root(self) -> Path:
        """CRI log files: <uid>/<container>/<run>.log."""
        return self.state_dir / "logs"


def load_config(path: Path | None) -> VMConfig:
    """Read and check `path`; without a file, defaults under /var/lib/vkubelet/vm."""
    if path is None:
        state = Path("/var/lib/vkubelet/vm")
        return VMConfig(state_dir=state, image_store=state / "images")
    return parse_config(read_file(path) or {}, origin=str(path), base=path.parent)


def parse_config(data: object, *, origin: str, base: Path) -> VMConfig:
    """`data` as loaded from `origin`; relative paths are relative to `base`."""
    raw = decode(data, _File, origin, what="a mapping of options")

    def fail(name: str, why: str) -> ConfigError:
        return ConfigError(f"{origin}: {name}: {why}")

    state_dir = base / raw.state_dir if raw.state_dir is not None else base / "vm-state"
    image_store = base / raw.image_store if raw.image_store is not None else state_dir / "images"
    reserved_cpu, reserved_memory = _resources(raw.reserved, "reserved", fail, (0, 256 * _MIB))
    default_cpu, default_memory = _resources(raw.defaults, "defaults", fail, (1000, 256 * _MIB))
    if default_cpu <= 0 or default_memory < 16 * _MIB:
        raise fail("defaults", "a VM needs at least some CPU and 16Mi of memory")
    try:
        network = ipaddress.IPv4Network(raw.pod_cidr)
    except ValueError as e:
        raise fail("podCIDR", f"not an IPv4 network: {e}") from None
    if network.prefixlen > 29:
        raise fail("podCIDR", f"{raw.pod_cidr} is too small for a gateway and guests")
    net = raw.network or _Network()
    for i, server in enumerate(net.cluster_dns):
        try:
            ipaddress.ip_address(server)
        except ValueError:
            raise fail(f"network.clusterDNS[{i}]", f"{server!r} is not an IP address") from None
    if not _DOMAIN.fullmatch(net.cluster_domain):
        raise fail("network.clusterDomain", f"{net.cluster_domain!r} is not a DNS domain")
    bridged = _bridged(net, fail)
    if raw.runtime == "libvirt" and net.mode == "host-only":
        raise fail(
            "network.mode",
            "host-only is not available with runtime: libvirt (whether a VM's tap forwards is "
            "the daemon's host's own setting, which libvirt does not set): use routed or bridged",
        )
    if raw.libvirt is not None and raw.runtime != "libvirt":
        raise fail("libvirt", "only for runtime: libvirt")
    libvirt_uri = (raw.libvirt or _Libvirt()).uri
    if "://" not in libvirt_uri:
        raise fail(
            "libvirt.uri",
            f"{libvirt_uri!r} is not a libvirt URI (qemu:///system, qemu+ssh://host/system)",
        )
    pool = (raw.libvirt or _Libvirt()).pool
    if pool is not None and not pool.path.startswith("/"):
        raise fail("libvirt.pool.path", f"{pool.path!r} is not an absolute path (the daemon's)")
    migration_uri = (raw.libvirt or _Libvirt()).migration_uri
    if migration_uri is not None and "://" not in migration_uri:
        raise fail(
            "libvirt.migrationURI",
            f"{migration_uri!r} is not a libvirt URI (qemu+ssh://host/system)",
        )
    shared = []
    for index, cidr in enumerate(raw.shared_pod_cidrs):
        try:
            shared.append(ipaddress.IPv4Network(cidr))
        except ValueError as e:
            raise fail(f"sharedPodCIDRs[{index}]", f"not an IPv4 network: {e}") from None
    cm = raw.translation_config_map
    gc, storage = raw.machine_gc, raw.storage
    return VMConfig(
        backup_directories=tuple((base / d).resolve() for d in raw.backup_directories),
        translation_config_map=ConfigMapSource(
            cm.namespace, cm.name, base / cm.kubeconfig, cm.interval_seconds
        )
        if cm
        else None,
        state_dir=state_dir,
        image_store=image_store,
        accel=raw.accel,
        runtime=raw.runtime,
        libvirt_uri=libvirt_uri,
        libvirt_pool=LibvirtPool(pool.name, pool.path) if pool is not None else None,
        libvirt_migration_uri=migration_uri,
        reserved_millicpu=reserved_cpu,
        reserved_memory=reserved_memory,
        pod_cidr=str(network),
        network_mode=net.mode,
        cluster_dns=tuple(net.cluster_dns),
        cluster_domain=net.cluster_domain.rstrip("."),
        bridged=bridged,
        shared_pod_cidrs=tuple(str(n) for n in shared),
        image_prefix=raw.image_prefix,
        translations=raw.translations,
        translations_file=base / raw.translations_file if raw.translations_file else None,
        image_gc_interval=raw.image_gc_interval_seconds,
        guest_agent_timeout=raw.guest_agent_timeout_seconds,
        log_rotation=_log_rotation(raw, fail),
        default_millicpu=default_cpu,
        default_memory=default_memory,
        origin=origin,
        machine_gc=MachineGC(base / gc.kubeconfig if gc.kubeconfig else None, gc.interval_seconds)
        if gc
        else None,
        storage=StorageConfig(base / storage.kubeconfig, storage.interval_seconds)
        if storage
        else None,
        **_hotplug(raw.hotplug or _Hotplug(), fail),
    )


_BRIDGED_ONLY = ("bridge", "subnet", "gateway", "pool")


def _bridged(net: _Network, fail: Callable[[str, str], ConfigError]) -> Bridged | None:
    """Bridged mode's settings, all required there and refused elsewhere (a `pool` under routed
    mode would be silently ignored); the pool and gateway must be host addresses of the subnet,
    and the gateway outside the pool."""
    values = {name: getattr(net, name) for name in _BRIDGED_ONLY}
    if net.mode != "bridged":
        for name, value in values.items():
            if value is not None:
                raise fail(f"network.{name}", "only for network.mode bridged")
        return None
    for name, value in values.items():
        if value is None:
            raise fail(f"network.{name}", "required with network.mode bridged")
    bridge, subnet_text, gateway_text, pool_text = (str(values[n]) for n in _BRIDGED_ONLY)
    if len(bridge) > 15 or any(c in bridge for c in "/ :") or bridge in (".", ".."):
        raise fail("network.bridge", f"{bridge!r} is not a network interface name")
    try:
        subnet = ipaddress.IPv4Network(subnet_text)
    except ValueError as e:
        raise fail("network.subnet", f"not an IPv4 network: {e}") from None
    if subnet.prefixlen > 30:
        raise fail("network.subnet", f"{subnet} is too small for a gateway and guests")

    def host(name: str, text: str) -> ipaddress.IPv4Address:
        try:
            address = ipaddress.IPv4Address(text.strip())
        except ValueError:
            raise fail(f"network.{name}", f"{text!r} is not an IPv4 address") from None
        if address not in subnet or address in (subnet.network_address, subnet.broadcast_address):
            raise fail(f"network.{name}", f"{address} is not a host address of subnet {subnet}")
        return address

    gateway = host("gateway", gateway_text)
    first_text, dash, last_text = pool_text.partition("-")
    if not dash:
        raise fail("network.pool", f"{pool_text!r} is not a range first-last")
    first, last = host("pool", first_text), host("pool", last_text)
    if first > last:
        raise fail("network.pool", f"{pool_text!r} ends before it starts")
    if first <= gateway <= last:
        raise fail("network.pool", f"{pool_text} holds the gateway {gateway}")
    return Bridged(bridge, str(subnet), str(gateway), (str(first), str(last)))


def _log_rotation(raw: _File, fail: Callable[[str, str], ConfigError]) -> LogRotation:
    try:
        size = quantity_bytes(raw.container_log_max_size)
    except (QuantityError, ValueError) as e:
        raise fail("containerLogMaxSize", str(e)) from None
    if size < LogRotation.MIN_BYTES:
        raise fail("containerLogMaxSize", f"at least {LogRotation.MIN_BYTES // 1024}Ki")
    return LogRotation(max_bytes=size, max_files=raw.container_log_max_files)


def _hotplug(raw: _Hotplug, fail: Callable[[str, str], ConfigError]) -> dict[str, int]:
    out = {"hotplug_max_vcpus": raw.max_cpus, "hotplug_slots": raw.memory_slots}
    try:
        out["hotplug_max_memory"] = (
            None if raw.max_memory is None else quantity_bytes(raw.max_memory)
        )
    except (QuantityError, ValueError) as e:
        raise fail("hotplug.maxMemory", str(e)) from None
    return {k: v for k, v in out.items() if v is not None}


def _resources(
    raw: _Resources | None,
    name: str,
    fail: Callable[[str, str], ConfigError],
    default: tuple[int, int],
) -> tuple[int, int]:
    """`{cpu, memory}` quantities as (millicores, bytes)."""
    cpu, memory = default
    if raw is None:
        return default
    try:
        if raw.cpu is not None:
            cpu = millicpu(raw.cpu)
    except (QuantityError, ValueError) as e:
        raise fail(f"{name}.cpu", str(e)) from None
    try:
        if raw.memory is not None:
            memory = quantity_bytes(raw.memory)
    except (QuantityError, ValueError) as e:
        raise fail(f"{name}.memory", str(e)) from None
    if cpu < 0 or memory < 0:
        raise fail(name, "negative quantities make no sense here")
    return cpu, memory


def millicpu(value: object) -> int:
    """A CPU quantity in millicores, rounded up (as the kubelet rounds requests)."""
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise ValueError(f"expected a quantity, got {value!r}")
    fraction = parse_quantity(value).to_fraction() * 1000
    return -(-fraction.numerator // fraction.denominator)


def quantity_bytes(value: object) -> int:
    """A memory quantity in bytes, rounded up."""
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise ValueError(f"expected a quantity, got {value!r}")
    fraction = parse_quantity(value).to_fraction()
    return -(-fraction.numerator // fraction.denominator)
