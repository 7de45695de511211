"""The SSH provider's inventory: a YAML file of devices, read again whenever it changes.

    defaults:                       # optional; every device inherits these
      user: pi
      identityFile: keys/id_ed25519 # relative to this file; or `agent: true` for ssh-agent
      knownHosts: known_hosts       # host keys are verified unless insecureIgnoreHostKey: true
    devices:
      - name: board-1               # the node's name
        address: 10.0.0.5
        port: 22
        labels: {example.com/model: rpi4}
        taints: ["example.com/device=rpi:NoSchedule"]
        capacity: {cpu: "4", memory: 4Gi, pods: "20"}   # what is left out is discovered
        podDir: .vkubelet           # relative to the user's home on the device
        hostImages: [host]          # images whose pods run as plain processes on the device
        allowHostPath: false        # hostPath volumes are refused unless this is true
        maxSessions: 10             # the device's sshd MaxSessions (sshd's default is 10)
        restartBackoff: {initial: 10, max: 300}   # seconds, as a kubelet's CrashLoopBackOff

Errors name the file and the field (`lab.yaml: devices[1].port: expected an integer in
1..65535`) and a broken file never takes running devices down: the agent keeps the last good
inventory until the file is fixed.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..._fields import reject_unknown
from ...sdk import ConfigError, parse_taint
from ...sdk.backoff import INITIAL_SECONDS, MAX_SECONDS
from ...sdk.quantity import parse_quantity

__all__ = ["DeviceConfig", "Inventory", "load_inventory"]

_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SETTINGS = {
    "user",
    "port",
    "identityFile",
    "agent",
    "knownHosts",
    "insecureIgnoreHostKey",
    "podDir",
    "hostImages",
    "allowHostPath",
    "maxSessions",
    "connectTimeout",
    "pingInterval",
    "labels",
    "taints",
    "capacity",
    "restartBackoff",
}
_DEVICE_KEYS = _SETTINGS | {"name", "address"}


@dataclass(frozen=True)
class DeviceConfig:
    """One device as the inventory describes it. Equal configs mean "nothing changed"."""

    name: str
    address: str
    port: int = 22
    user: str = field(default_factory=lambda: os.environ.get("USER", "root"))
    identity_file: Path | None = None
    agent: bool = False
    known_hosts: Path | None = None
    insecure_ignore_host_key: bool = False
    pod_dir: str = ".vkubelet"
    host_images: tuple[str, ...] = ("host",)
    allow_host_path: bool = False
    max_sessions: int = 10
    connect_timeout: float = 10.0
    ping_interval: float = 10.0
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[tuple[tuple[str, str], ...], ...] | None = None
    capacity: tuple[tuple[str, str], ...] = ()
    backoff_initial: float = INITIAL_SECONDS  # the kubelet's restart back-off
    backoff_max: float = MAX_SECONDS

    def runs_image(self, image: str) -> bool:
        return any(fnmatch.fnmatchcase(image, pattern) for pattern in self.host_images)

    def taint_list(self) -> list[dict[str, str]] | None:
        return None if self.taints is None else [dict(t) for t in self.taints]


@dataclass(frozen=True)
class Inventory:
    devices: tuple[DeviceConfig, ...]


def load_inventory(path: Path) -> Inventory:
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{where}: cannot read it: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with `devices` (and `defaults`)")
    fail = _failure(where)
    reject_unknown(data, ("defaults", "devices"), "", fail)
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where}: defaults: expected a mapping")
    reject_unknown(defaults, _SETTINGS, "defaults", fail)
    raw_devices = data.get("devices") or []
    if not isinstance(raw_devices, list):
        raise ConfigError(f"{where}: devices: expected a list")
    devices = []
    for i, raw in enumerate(raw_devices):
        at = f"devices[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: {at}: expected a mapping")
        reject_unknown(raw, _DEVICE_KEYS, at, fail)
        devices.append(_device(where, at, {**defaults, **raw}, path.parent))
    names = [d.name for d in devices]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{where}: devices: duplicate name {name!r}")
    return Inventory(tuple(devices))


def _device(where: str, at: str, raw: dict[str, Any], base: Path) -> DeviceConfig:
    def fail(name: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}: {at}.{name}: {problem}")

    def text(name: str, default: str | None = None) -> str:
        value = raw.get(name, default)
        if not isinstance(value, str) or not value:
            raise fail(name, "expected a non-empty string")
        return value

    def flag(name: str, default: bool) -> bool:
        value = raw.get(name, default)
        if not isinstance(value, bool):
            raise fail(name, "expected true or false")
        return value

    def number(name: str, default: float, low: float, high: float) -> float:
        value = raw.get(name, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise fail(name, f"expected a number in {low:g}..{high:g}")
        return float(value)

    def file(name: str) -> Path | None:
        value = raw.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise fail(name, "expected a path")
        return base / Path(value).expanduser()

    name = text("name")
    if len(name) > 253 or not _DNS1123.fullmatch(name):
        raise fail("name", f"{name!r} is not a valid node name (lower-case DNS-1123 subdomain)")
    port = raw.get("port", 22)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise fail("port", "expected an integer in 1..65535")
    agent = flag("agent", False)
    identity = file("identityFile")
    if identity is None and not agent:
        raise fail("identityFile", "required (or `agent: true` to use ssh-agent)")
    known_hosts = file("knownHosts")
    insecure = flag("insecureIgnoreHostKey", False)
    if known_hosts is None and not insecure:
        raise fail(
            "knownHosts",
            "required: host keys are verified (`insecureIgnoreHostKey: true` turns that off)",
        )
    pod_dir = text("podDir", ".vkubelet")
    if "\n" in pod_dir or "\0" in pod_dir:
        raise fail("podDir", "must be a single-line path")
    images = raw.get("hostImages", ["host"])
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise fail("hostImages", "expected a list of image names or patterns")
    labels = raw.get("labels") or {}
    if not isinstance(labels, dict):
        raise fail("labels", "expected a mapping")
    taints = raw.get("taints")
    parsed_taints = None
    if taints is not None:
        if not isinstance(taints, list):
            raise fail("taints", "expected a list like [key=value:NoSchedule]")
        try:
            parsed_taints = tuple(tuple(sorted(parse_taint(str(t)).items())) for t in taints)
        except ConfigError as e:
            raise fail("taints", str(e)) from None
    capacity = raw.get("capacity") or {}
    if not isinstance(capacity, dict):
        raise fail("capacity", "expected a mapping like {cpu: '4', memory: 4Gi}")
    for key, value in capacity.items():
        try:
            parse_quantity(str(value))
        except ValueError:
            raise fail(f"capacity.{key}", f"{value!r} is not a Kubernetes quantity") from None
    backoff = raw.get("restartBackoff") or {}
    if not isinstance(backoff, dict) or set(backoff) - {"initial", "max"}:
        raise fail("restartBackoff", "expected {initial: seconds, max: seconds}")
    initial = backoff.get("initial", INITIAL_SECONDS)
    most = backoff.get("max", MAX_SECONDS)
    for key, value in (("initial", initial), ("max", most)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86400:
            raise fail(f"restartBackoff.{key}", "expected seconds in (0, 86400]")
    if most < initial:
        raise fail("restartBackoff.max", "must not be less than initial")
    return DeviceConfig(
        name=name,
        address=text("address"),
        port=port,
        user=text("user", os.environ.get("USER", "root")),
        identity_file=identity,
        agent=agent,
        known_hosts=known_hosts,
        insecure_ignore_host_key=insecure,
        pod_dir=pod_dir,
        host_images=tuple(images),
        allow_host_path=flag("allowHostPath", False),
        max_sessions=int(number("maxSessions", 10, 2, 10000)),
        connect_timeout=number("connectTimeout", 10, 0.1, 600),
        ping_interval=number("pingInterval", 10, 0.1, 3600),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        taints=parsed_taints,
        capacity=tuple(sorted((str(k), str(v)) for k, v in capacity.items())),
        backoff_initial=float(initial),
        backoff_max=float(most),
    )


def _failure(where: str) -> Callable[[str, str], ConfigError]:
    return lambda field, problem: ConfigError(f"{where}: {field}: {problem}")
