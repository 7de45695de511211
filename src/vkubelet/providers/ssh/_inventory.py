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
        containerRuntime: none      # podman | docker | auto (detected) | none: other images
        runtimeCommand: [podman]    # how to call it (default: its name)
        runtimeRunArgs: []          # added to every `run` (e.g. --ulimit nofile=1024:1024)
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..._fields import FilePath, Section, check_quantities, decode, read_file
from ...sdk import ConfigError, parse_taint
from ...sdk.backoff import INITIAL_SECONDS, MAX_SECONDS

__all__ = ["DeviceConfig", "Inventory", "load_inventory"]

_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_Text = Annotated[str, Meta(min_length=1)]
_Seconds = Annotated[float, Meta(gt=0, le=86400, description="seconds in (0, 86400]")]


class _Backoff(Section):
    initial: _Seconds = INITIAL_SECONDS
    most: _Seconds = msgspec.field(default=MAX_SECONDS, name="max")


class _Reconnect(Section):
    """The link's reconnect back-off: short enough that a device back on the network is
    connected again soon, long enough not to hammer one that is gone."""

    initial: _Seconds = 1.0
    most: _Seconds = msgspec.field(default=30.0, name="max")


class _Settings(Section):
    """What `defaults` may set for every device."""

    user: _Text | None = None
    port: Annotated[int, Meta(ge=1, le=65535)] = 22
    identity_file: FilePath | None = None
    agent: bool = False
    known_hosts: FilePath | None = None
    insecure_ignore_host_key: bool = False
    pod_dir: _Text = ".vkubelet"
    host_images: Annotated[list[_Text], Meta(description="a list of image names or patterns")] = (
        msgspec.field(default_factory=lambda: ["host"])
    )
    allow_host_path: bool = False
    container_runtime: Literal["none", "podman", "docker", "auto"] = "none"
    runtime_command: Annotated[list[_Text], Meta(min_length=1)] | None = None
    runtime_run_args: list[_Text] = msgspec.field(default_factory=list)
    max_sessions: Annotated[float, Meta(ge=2, le=10000)] = 10
    connect_timeout: Annotated[float, Meta(ge=0.1, le=600)] = 10
    ping_interval: Annotated[float, Meta(ge=0.1, le=3600)] = 10
    labels: dict[str, Any] | None = None  # values are taken as strings, as are capacity's
    taints: Annotated[list[str], Meta(description="a list like [key=value:NoSchedule]")] | None = (
        None
    )
    capacity: (
        Annotated[dict[str, Any], Meta(description="a mapping like {cpu: '4', memory: 4Gi}")] | None
    ) = None
    restart_backoff: _Backoff | None = None
    reconnect_backoff: _Reconnect | None = None


class _Device(_Settings, kw_only=True):
    name: _Text
    address: _Text


class _File(Section):
    defaults: dict[str, Any] | None = None
    devices: list[Any] | None = None


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
    container_runtime: str = "none"  # none | podman | docker | auto: what runs other images
    runtime_command: tuple[str, ...] = ()  # how to call the runtime; () = its name
    runtime_run_args: tuple[str, ...] = ()
    max_sessions: int = 10
    connect_timeout: float = 10.0
    ping_interval: float = 10.0
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[tuple[tuple[str, str], ...], ...] | None = None
    capacity: tuple[tuple[str, str], ...] = ()
    backoff_initial: float = INITIAL_SECONDS  # the kubelet's restart back-off
    backoff_max: float = MAX_SECONDS
    reconnect_initial: float = 1.0  # the link's reconnect back-off
    reconnect_max: float = 30.0

    def runs_image(self, image: str) -> bool:
        return any(fnmatch.fnmatchcase(image, pattern) for pattern in self.host_images)

    def taint_list(self) -> list[dict[str, str]] | None:
        return None if self.taints is None else [dict(t) for t in self.taints]


@dataclass(frozen=True)
class Inventory:
    devices: tuple[DeviceConfig, ...]


def load_inventory(path: Path) -> Inventory:
    where = str(path)
    data = read_file(path)
    top = decode(
        {} if data is None else data, _File, where, what="a mapping with `devices` (and `defaults`)"
    )
    defaults = top.defaults or {}
    decode(defaults, _Settings, where, at="defaults")
    devices = []
    for i, raw in enumerate(top.devices or []):
        at = f"devices[{i}]"
        merged = {**defaults, **raw} if isinstance(raw, dict) else raw
        devices.append(_device(where, at, decode(merged, _Device, where, at=at), path.parent))
    names = [d.name for d in devices]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{where}: devices: duplicate name {name!r}")
    return Inventory(tuple(devices))


def _device(where: str, at: str, raw: _Device, base: Path) -> DeviceConfig:
    def fail(name: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}: {at}.{name}: {problem}")

    def file(value: str | None) -> Path | None:
        return None if value is None else base / Path(value).expanduser()

    if len(raw.name) > 253 or not _DNS1123.fullmatch(raw.name):
        raise fail("name", f"{raw.name!r} is not a valid node name (lower-case DNS-1123 subdomain)")
    if raw.identity_file is None and not raw.agent:
        raise fail("identityFile", "required (or `agent: true` to use ssh-agent)")
    if raw.known_hosts is None and not raw.insecure_ignore_host_key:
        raise fail(
            "knownHosts",
            "required: host keys are verified (`insecureIgnoreHostKey: true` turns that off)",
        )
    if "\n" in raw.pod_dir or "\0" in raw.pod_dir:
        raise fail("podDir", "must be a single-line path")
    taints = None
    if raw.taints is not None:
        try:
            taints = tuple(tuple(sorted(parse_taint(t).items())) for t in raw.taints)
        except ConfigError as e:
            raise fail("taints", str(e)) from None
    capacity = {str(k): str(v) for k, v in (raw.capacity or {}).items()}
    check_quantities(capacity, where, f"{at}.capacity")
    backoff = raw.restart_backoff or _Backoff()
    if backoff.most < backoff.initial:
        raise fail("restartBackoff.max", "must not be less than initial")
    reconnect = raw.reconnect_backoff or _Reconnect()
    if reconnect.most < reconnect.initial:
        raise fail("reconnectBackoff.max", "must not be less than initial")
    return DeviceConfig(
        name=raw.name,
        address=raw.address,
        port=raw.port,
        user=raw.user or os.environ.get("USER", "root"),
        identity_file=file(raw.identity_file),
        agent=raw.agent,
        known_hosts=file(raw.known_hosts),
        insecure_ignore_host_key=raw.insecure_ignore_host_key,
        pod_dir=raw.pod_dir,
        host_images=tuple(raw.host_images),
        allow_host_path=raw.allow_host_path,
        container_runtime=raw.container_runtime,
        runtime_command=tuple(raw.runtime_command or ()),
        runtime_run_args=tuple(raw.runtime_run_args),
        max_sessions=int(raw.max_sessions),
        connect_timeout=raw.connect_timeout,
        ping_interval=raw.ping_interval,
        labels=tuple(sorted((str(k), str(v)) for k, v in (raw.labels or {}).items())),
        taints=taints,
        capacity=tuple(sorted(capacity.items())),
        backoff_initial=backoff.initial,
        backoff_max=backoff.most,
        reconnect_initial=reconnect.initial,
        reconnect_max=reconnect.most,
    )
