"""The VM provider's config file (`--provider-config vm.yaml`).

    stateDir: /var/lib/vkubelet/vm      # run dirs of the VMs, CRI logs (relative: to this file)
    imageStore: images                   # default <stateDir>/images
    accel: auto                          # auto | kvm | tcg
    reserved: {cpu: "1", memory: 1Gi}    # kept for the host; capacity = host minus this
    podCIDR: 10.213.0.0/24
    imagePrefix: vm.vkubelet.io
    translations: [{name: tiny, url: file:///srv/tiny.qcow2}]
    translationsFile: images.yaml        # re-read when it changes (a mounted ConfigMap); wins
    translationConfigMap:                # re-read from the API; wins over both
      {namespace: kube-system, name: vm-images, kubeconfig: reader.kubeconfig, intervalSeconds: 30}
    imageGCIntervalSeconds: 600
    guestAgentTimeoutSeconds: 300
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import yaml

from ..._fields import reject_unknown
from ...sdk.quantity import QuantityError, parse_quantity
from ._persist import MachineGC, parse_machine_gc
from ._volumes import StorageConfig

__all__ = ["ConfigError", "ConfigMapSource", "VMConfig", "load_config"]

Accel = Literal["auto", "kvm", "tcg"]

_KNOWN = {
    "stateDir",
    "imageStore",
    "accel",
    "reserved",
    "podCIDR",
    "imagePrefix",
    "translations",
    "translationsFile",
    "translationConfigMap",
    "imageGCIntervalSeconds",
    "guestAgentTimeoutSeconds",
    "defaults",
    "machineGC",  # _persist
    "hotplug",
    "storage",
    "backupDirectories",
}
_MIB = 2**20


class ConfigError(ValueError):
    """A bad provider config; the message names the file and the field."""


@dataclass(frozen=True)
class ConfigMapSource:
    """Translation rules in a ConfigMap, read with `kubeconfig`'s credentials (which need `get`
    on that ConfigMap: the node's own identity may read only what its pods reference)."""

    namespace: str
    name: str
    kubeconfig: Path
    interval: float = 30.0


@dataclass(frozen=True)
class VMConfig:
    state_dir: Path
    image_store: Path
    accel: Accel = "auto"
    reserved_millicpu: int = 0
    reserved_memory: int = 256 * _MIB  # bytes
    pod_cidr: str = "10.213.0.0/24"
    image_prefix: str = "vm.vkubelet.io"
    translations: list[dict[str, Any]] = field(default_factory=list)  # as written; vmstore parses
    translations_file: Path | None = None
    translation_config_map: ConfigMapSource | None = None
    image_gc_interval: float = 600.0
    guest_agent_timeout: float = 300.0
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
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    return parse_config(data or {}, origin=where, base=path.parent)


def parse_config(data: object, *, origin: str, base: Path) -> VMConfig:
    """`data` as loaded from `origin`; relative paths are relative to `base`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of options")

    def fail(name: str, why: str) -> ConfigError:
        return ConfigError(f"{origin}: {name}: {why}")

    reject_unknown(data, _KNOWN, "", fail)

    def text(name: str, default: str) -> str:
        value = data.get(name, default)
        if not isinstance(value, str) or not value:
            raise fail(name, f"expected a non-empty string, got {value!r}")
        return value

    def a_path(name: str, default: Path | None) -> Path | None:
        if name not in data:
            return default
        return base / text(name, "")

    def seconds(name: str, default: float) -> float:
        value = data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise fail(name, f"expected a positive number of seconds, got {value!r}")
        return float(value)

    state_dir = a_path("stateDir", base / "vm-state")
    assert state_dir is not None
    image_store = a_path("imageStore", state_dir / "images")
    assert image_store is not None
    accel = data.get("accel", "auto")
    if accel not in ("auto", "kvm", "tcg"):
        raise fail("accel", f"expected auto, kvm or tcg, got {accel!r}")
    reserved_cpu, reserved_memory = _resources(data, "reserved", fail, (0, 256 * _MIB))
    default_cpu, default_memory = _resources(data, "defaults", fail, (1000, 256 * _MIB))
    if default_cpu <= 0 or default_memory < 16 * _MIB:
        raise fail("defaults", "a VM needs at least some CPU and 16Mi of memory")
    cidr = text("podCIDR", "10.213.0.0/24")
    try:
        network = ipaddress.IPv4Network(cidr)
    except ValueError as e:
        raise fail("podCIDR", f"not an IPv4 network: {e}") from None
    if network.prefixlen > 29:
        raise fail("podCIDR", f"{cidr} is too small for a gateway and guests")
    translations = data.get("translations", [])
    if not isinstance(translations, list) or not all(isinstance(r, dict) for r in translations):
        raise fail("translations", "expected a list of rules (mappings with name|regexp, url)")
    backups = data.get("backupDirectories", [])
    if not isinstance(backups, list) or not all(isinstance(d, str) and d for d in backups):
        raise fail("backupDirectories", f"expected a list of directories, got {backups!r}")
    return VMConfig(
        backup_directories=tuple((base / d).resolve() for d in backups),
        translation_config_map=_config_map(data.get("translationConfigMap"), fail, base),
        state_dir=state_dir,
        image_store=image_store,
        accel=cast(Accel, accel),
        reserved_millicpu=reserved_cpu,
        reserved_memory=reserved_memory,
        pod_cidr=str(network),
        image_prefix=text("imagePrefix", "vm.vkubelet.io"),
        translations=list(translations),
        translations_file=a_path("translationsFile", None),
        image_gc_interval=seconds("imageGCIntervalSeconds", 600.0),
        guest_agent_timeout=seconds("guestAgentTimeoutSeconds", 300.0),
        default_millicpu=default_cpu,
        default_memory=default_memory,
        origin=origin,
        machine_gc=parse_machine_gc(data.get("machineGC"), fail, base),
        storage=_storage(data.get("storage"), fail, base),
        **_hotplug(data.get("hotplug"), fail),
    )


def _storage(value: object, fail: Any, base: Path) -> StorageConfig | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"kubeconfig", "intervalSeconds"}:
        raise fail("storage", "expected a mapping with kubeconfig and intervalSeconds")
    if not isinstance(value.get("kubeconfig"), str) or not value["kubeconfig"]:
        raise fail("storage.kubeconfig", f"expected a path, got {value.get('kubeconfig')!r}")
    interval = value.get("intervalSeconds", 2)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
        raise fail("storage.intervalSeconds", f"expected a positive number, got {interval!r}")
    return StorageConfig(base / value["kubeconfig"], float(interval))


def _hotplug(value: object, fail: Any) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - {"maxCpus", "maxMemory", "memorySlots"}:
        raise fail("hotplug", "expected a mapping with maxCpus, maxMemory and/or memorySlots")
    out: dict[str, int] = {}
    for key, field_name in (("maxCpus", "hotplug_max_vcpus"), ("memorySlots", "hotplug_slots")):
        if key in value:
            number = value[key]
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= 255:
                raise fail(f"hotplug.{key}", f"expected a whole number 0-255, got {number!r}")
            out[field_name] = number
    if "maxMemory" in value:
        try:
            out["hotplug_max_memory"] = quantity_bytes(value["maxMemory"])
        except (QuantityError, ValueError) as e:
            raise fail("hotplug.maxMemory", str(e)) from None
    return out


def _config_map(value: object, fail: Any, base: Path) -> ConfigMapSource | None:
    name = "translationConfigMap"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail(name, "expected a mapping with namespace, name and kubeconfig")
    reject_unknown(value, ("namespace", "name", "kubeconfig", "intervalSeconds"), name, fail)
    for key in ("namespace", "name", "kubeconfig"):
        if not isinstance(value.get(key), str) or not value[key]:
            raise fail(f"{name}.{key}", f"expected a non-empty string, got {value.get(key)!r}")
    interval = value.get("intervalSeconds", 30)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
        raise fail(f"{name}.intervalSeconds", f"expected a positive number, got {interval!r}")
    return ConfigMapSource(
        value["namespace"], value["name"], base / value["kubeconfig"], float(interval)
    )


def _resources(
    data: dict[str, Any], name: str, fail: Any, default: tuple[int, int]
) -> tuple[int, int]:
    """`{cpu, memory}` quantities as (millicores, bytes)."""
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, dict) or set(value) - {"cpu", "memory"}:
        raise fail(name, "expected a mapping with cpu and/or memory")
    cpu, memory = default
    try:
        if "cpu" in value:
            cpu = millicpu(value["cpu"])
    except (QuantityError, ValueError) as e:
        raise fail(f"{name}.cpu", str(e)) from None
    try:
        if "memory" in value:
            memory = quantity_bytes(value["memory"])
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
