"""What a VM pod's guest is told at first boot: the cloud-init seed's content.

The seed is a NoCloud seed (the default) or an OpenStack ConfigDrive, chosen per pod by an
annotation (below): some images only enable the ConfigDrive datasource. Two kinds of guest read
it. A real distribution runs cloud-init, which reads NoCloud's `meta-data`, `user-data` and
`network-config` (YAML, netplan v2) or ConfigDrive's `meta_data.json`, `user_data` and
`network_data.json` (OpenStack's formats). The project's small test guest has no cloud-init: its
init reads plain files under `vkubelet/` on the same ISO (`extra_files`, the same for both
kinds), line by line, never evaluated:

    vkubelet/hostname            one line
    vkubelet/network             lines MAC=.., ADDRESS=a.b.c.d/nn, GATEWAY=.., DNS=a b (spaces)
    vkubelet/files/<abs path>    a file to copy to <abs path> (its mode travels in the ISO's
                                 Rock Ridge entries: `modes` below, given to write_seed_iso)
    vkubelet/authorized_keys     OpenSSH authorized_keys

Pod annotations shape user-data and meta-data. Virtlet's names are honoured so its pods move over
unchanged; the project's own names (under `vm.vkubelet.io/`) do the same and are applied after
virtlet's (so they win where only one value can hold):

| virtlet annotation                | project annotation (`vm.vkubelet.io/...`) |
|-----------------------------------|-------------------------------------------|
| VirtletCloudInitUserData          | cloud-init-user-data                      |
| VirtletCloudInitUserDataOverwrite | cloud-init-user-data-overwrite            |
| VirtletCloudInitUserDataScript    | cloud-init-user-data-script               |
| VirtletCloudInitMetaData          | cloud-init-meta-data                      |
| VirtletSSHKeys                    | ssh-keys                                  |
| VirtletCloudInitImageType         | cloud-init-type                           |

- user-data: a YAML mapping merged into the generated cloud-config: mappings merged key by key,
  lists appended (the user's items after the pod's), other values replaced;
- user-data-overwrite: "true" makes that mapping the whole user-data (no generated write_files
  or keys there; the small guest's extras still carry them);
- user-data-script: raw user-data (e.g. a `#!/bin/sh` script) used verbatim, replacing all else;
- meta-data: a YAML (or JSON) mapping merged over the generated instance-id, local-hostname and
  public-keys;
- ssh-keys: authorized keys, one per line (blank and `#` lines skipped), added to the pod's;
- cloud-init-type: `nocloud` (the default) or `configdrive`.

Generated meta-data holds instance-id (the pod UID), local-hostname (the pod name, cut to 63
characters as the kubelet does) and public-keys (as virtlet: they survive an overwrite). A
ConfigDrive's meta_data.json says the same in OpenStack's names: uuid, hostname, name (the whole
pod name) and public_keys (a mapping key0, key1, ...); the meta-data annotation is merged over
those names there. Its network_data.json gives the pod's address as OpenStack does: one link
(ethernet_mac_address, named eth0 like the netplan's set-name), one static network on it with
the default route, and dns services (OpenStack's format has no search domains: a ConfigDrive
guest gets the nameservers only; netplan's `nameservers.search` and the small guest's `SEARCH=`
carry them).

Generated user-data holds what the pod needs: `write_files` for its volume files and env file
(base64, so any bytes survive; mode 0644 unless `modes` says otherwise, e.g. 0600 for secrets) and
`ssh_authorized_keys`. Virtlet's `@virtlet-mount-script@` placeholder is not substituted.
Checked by hand against Debian 12's cloud-init 22.4.2: the user-data passes its strict schema and
the network-config renders a static eth0 with the default route. The same cloud-init's ConfigDrive
reader and `convert_net_json`, run on the host over a ConfigDrive's files, gave the instance-id,
hostname, keys and user-data, and a systemd-networkd eth0 with the address, route and DNS.

A broken annotation is a CloudInitError naming the annotation and the YAML line, so the pod's
status points at the fix. File contents (secrets among them) never reach an error or a log.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, cast

import yaml

__all__ = [
    "ANNOTATIONS",
    "CloudInitError",
    "GuestNetworkLike",
    "SeedContent",
    "SeedKind",
    "build_seed_content",
    "guest_hostname",
]

_PREFIX: Final = "vm.vkubelet.io/"


@dataclass(frozen=True)
class _Names:
    user_data: str
    overwrite: str
    script: str
    meta_data: str
    ssh_keys: str
    seed_kind: str


VIRTLET: Final = _Names(
    user_data="VirtletCloudInitUserData",
    overwrite="VirtletCloudInitUserDataOverwrite",
    script="VirtletCloudInitUserDataScript",
    meta_data="VirtletCloudInitMetaData",
    ssh_keys="VirtletSSHKeys",
    seed_kind="VirtletCloudInitImageType",
)
OURS: Final = _Names(
    user_data=_PREFIX + "cloud-init-user-data",
    overwrite=_PREFIX + "cloud-init-user-data-overwrite",
    script=_PREFIX + "cloud-init-user-data-script",
    meta_data=_PREFIX + "cloud-init-meta-data",
    ssh_keys=_PREFIX + "ssh-keys",
    seed_kind=_PREFIX + "cloud-init-type",
)
ANNOTATIONS: Final = (VIRTLET, OURS)  # in the order they apply

SeedKind = Literal["nocloud", "configdrive"]
_KINDS: Final[tuple[SeedKind, ...]] = ("nocloud", "configdrive")
_MAC: Final = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
_DOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DEFAULT_MODE: Final = 0o644


class CloudInitError(ValueError):
    """Seed content that cannot be built; the message names the annotation or field at fault."""


class GuestNetworkLike(Protocol):
    """The guest's address as the pod network gives it (vmruntime's GuestNetwork)."""

    @property
    def address(self) -> str: ...
    @property
    def prefix(self) -> int: ...
    @property
    def gateway(self) -> str: ...
    @property
    def mac(self) -> str: ...
    @property
    def dns(self) -> tuple[str, ...]: ...
    @property
    def search(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class SeedContent:
    """The seed's files in `kind`'s formats: meta_data is meta-data (YAML) or meta_data.json,
    network_config is network-config (netplan) or network_data.json."""

    meta_data: str
    user_data: str
    network_config: str | None
    extra_files: Mapping[str, bytes]
    kind: SeedKind = "nocloud"


def guest_hostname(pod_name: str) -> str:
    """The pod name as a hostname: at most 63 characters, as the kubelet truncates it."""
    return pod_name[:63].rstrip("-.") or "vm"


def build_seed_content(
    pod_name: str,
    pod_uid: str,
    annotations: Mapping[str, str],
    files: Mapping[str, bytes],
    network: GuestNetworkLike | None,
    ssh_keys: Sequence[str] = (),
    *,
    modes: Mapping[str, int] | None = None,
) -> SeedContent:
    """The seed for one pod. `files` maps absolute guest paths to contents (volumes, the env
    file); `modes` gives their permissions (default 0644)."""
    modes = modes or {}
    kind = _seed_kind(annotations)
    hostname = guest_hostname(pod_name)
    paths = sorted(files)
    for path in paths:
        _check_path(path)
    for path, mode in modes.items():
        if not 0 <= mode <= 0o7777:
            raise CloudInitError(f"files: mode {mode!r} of {path} is not a permission mode")

    keys = _keys(ssh_keys, "ssh keys")
    for names in ANNOTATIONS:
        keys.extend(_keys(annotations.get(names.ssh_keys, "").splitlines(), names.ssh_keys))
    keys = list(dict.fromkeys(keys))

    meta: dict[str, Any]
    if kind == "configdrive":
        meta = {"uuid": pod_uid, "hostname": hostname, "name": pod_name}
        if keys:
            meta["public_keys"] = {f"key{i}": key for i, key in enumerate(keys)}
    else:
        meta = {"instance-id": pod_uid, "local-hostname": hostname}
        if keys:
            # Also in meta-data, as virtlet does: NoCloud installs these even when an annotation
            # overwrites the user-data.
            meta["public-keys"] = list(keys)
    for names in ANNOTATIONS:
        meta.update(_mapping(annotations, names.meta_data))

    generated: dict[str, Any] = {}
    if files:
        generated["write_files"] = [
            {
                "path": path,
                "encoding": "b64",
                "content": base64.b64encode(files[path]).decode(),
                "permissions": f"0{modes.get(path, _DEFAULT_MODE):o}",
            }
            for path in paths
        ]
    if keys:
        generated["ssh_authorized_keys"] = list(keys)
    user: dict[str, Any] = generated
    script: str | None = None
    for names in ANNOTATIONS:
        given = _mapping(annotations, names.user_data)
        overwrite = _flag(annotations, names.overwrite)
        user = given if overwrite else merge(user, given, names.user_data)
        if names.script in annotations:
            script = annotations[names.script]
    user_data = script if script is not None else "#cloud-config\n" + _dump(user)

    extra: dict[str, bytes] = {"vkubelet/hostname": (hostname + "\n").encode()}
    network_config = None
    if network is not None:
        _check_network(network)
        if kind == "configdrive":
            network_config = _json(_network_data(network))
        else:
            network_config = _dump(_netplan(network))
        lines = [
            f"MAC={network.mac.lower()}",
            f"ADDRESS={network.address}/{network.prefix}",
            f"GATEWAY={network.gateway}",
        ]
        if network.dns:
            lines.append("DNS=" + " ".join(network.dns))
        if network.search:
            lines.append("SEARCH=" + " ".join(network.search))
        extra["vkubelet/network"] = ("\n".join(lines) + "\n").encode()
    for path in paths:
        extra["vkubelet/files" + path] = files[path]
    if keys:
        extra["vkubelet/authorized_keys"] = "".join(key + "\n" for key in keys).encode()
    return SeedContent(
        meta_data=_json(meta) if kind == "configdrive" else _dump(meta),
        user_data=user_data,
        network_config=network_config,
        extra_files=extra,
        kind=kind,
    )


def _seed_kind(annotations: Mapping[str, str]) -> SeedKind:
    kind: SeedKind = "nocloud"
    for names in ANNOTATIONS:
        value = annotations.get(names.seed_kind)
        if value is None:
            continue
        if value.strip().lower() not in _KINDS:
            raise CloudInitError(
                f"annotation {names.seed_kind}: must be nocloud or configdrive, got {value!r}"
            )
        kind = cast(SeedKind, value.strip().lower())
    return kind


_GENERATED: Final = frozenset({"write_files", "ssh_authorized_keys"})


def merge(
    base: Mapping[str, Any],
    given: Mapping[str, Any],
    where: str,
    *,
    protected: frozenset[str] = _GENERATED,
) -> dict[str, Any]:
    """cloud-config merge as virtlet does it: mappings merged key by key, lists appended (the
    user's items after the earlier ones), anything else replaced by the user's value. Replacing
    the pod's own write_files or ssh_authorized_keys with something that is not a list is an
    error: it would silently drop the pod's files or keys."""
    merged = dict(base)
    for key, value in given.items():
        mine = merged.get(key)
        if isinstance(mine, Mapping) and isinstance(value, Mapping):
            merged[key] = merge(mine, value, f"{where}: {key}", protected=frozenset())
        elif isinstance(mine, list) and isinstance(value, list):
            merged[key] = [*mine, *value]
        elif key in protected and key in merged and not isinstance(value, list):
            raise CloudInitError(
                f"annotation {where}: {key}: must be a list (merged with the pod's)"
            )
        else:
            merged[key] = value
    return merged


def _mapping(annotations: Mapping[str, str], name: str) -> dict[str, Any]:
    text = annotations.get(name)
    if text is None or not text.strip():
        return {}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise CloudInitError(f"annotation {name}:{line} {problem}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CloudInitError(
            f"annotation {name}: must be a YAML mapping, not {type(value).__name__}"
        )
    return value


def _flag(annotations: Mapping[str, str], name: str) -> bool:
    value = annotations.get(name)
    if value is None:
        return False
    if value.strip().lower() in ("true", "1", "yes"):
        return True
    if value.strip().lower() in ("false", "0", "no", ""):
        return False
    raise CloudInitError(f"annotation {name}: must be true or false, got {value!r}")


def _keys(lines: Sequence[str], where: str) -> list[str]:
    keys = []
    for line in lines:
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(ord(c) < 32 for c in key):
            raise CloudInitError(f"{where}: a key contains a control character")
        keys.append(key)
    return keys


def _check_path(path: str) -> None:
    if (
        not path.startswith("/")
        or posixpath.normpath(path) != path
        or path == "/"
        or any(ord(c) < 32 for c in path)
    ):
        raise CloudInitError(f"files: {path!r} is not a normalised absolute file path")


def _check_network(network: GuestNetworkLike) -> None:
    def ip(value: str, field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        try:
            return ipaddress.ip_address(value)
        except ValueError:
            raise CloudInitError(f"network.{field}: {value!r} is not an IP address") from None

    address = ip(network.address, "address")
    if not 0 <= network.prefix <= address.max_prefixlen:
        raise CloudInitError(f"network.prefix: {network.prefix!r} is out of range")
    ip(network.gateway, "gateway")
    for server in network.dns:
        ip(server, "dns")
    for domain in network.search:
        if not _DOMAIN.fullmatch(domain):
            raise CloudInitError(f"network.search: {domain!r} is not a DNS domain")
    if not _MAC.fullmatch(network.mac.lower()):
        raise CloudInitError(f"network.mac: {network.mac!r} is not a MAC address")


def _netplan(network: GuestNetworkLike) -> dict[str, Any]:
    default = "0.0.0.0/0" if ipaddress.ip_address(network.address).version == 4 else "::/0"
    eth0: dict[str, Any] = {
        "match": {"macaddress": network.mac.lower()},
        "set-name": "eth0",
        "addresses": [f"{network.address}/{network.prefix}"],
        # "to: default" is newer than some guests' cloud-init; the explicit prefix is not.
        "routes": [{"to": default, "via": network.gateway}],
    }
    if network.dns:
        eth0["nameservers"] = {"addresses": list(network.dns)}
        if network.search:
            eth0["nameservers"]["search"] = list(network.search)
    return {"version": 2, "ethernets": {"eth0": eth0}}


def _network_data(network: GuestNetworkLike) -> dict[str, Any]:
    """OpenStack's network_data.json for the pod's one static address."""
    interface = ipaddress.ip_interface(f"{network.address}/{network.prefix}")
    v4 = interface.version == 4
    # The default route's destination, not an address anything binds to.
    any_address = "0.0.0.0" if v4 else "::"  # noqa: S104
    dns = [{"type": "dns", "address": server} for server in network.dns]
    return {
        "links": [
            {
                "id": "eth0",
                "name": "eth0",
                "type": "phy",
                "ethernet_mac_address": network.mac.lower(),
            }
        ],
        "networks": [
            {
                "id": "network0",
                "link": "eth0",
                "type": "ipv4" if v4 else "ipv6",
                "ip_address": network.address,
                "netmask": str(interface.netmask),
                "routes": [
                    {"network": any_address, "netmask": any_address, "gateway": network.gateway}
                ],
                "services": dns,
            }
        ],
        "services": dns,
    }


def _json(data: Mapping[str, Any]) -> str:
    # default=str: a meta-data annotation is YAML, whose dates and times JSON has no type for.
    return json.dumps(dict(data), indent=2, default=str) + "\n"


def _dump(data: Mapping[str, Any]) -> str:
    # ASCII only: PyYAML writes some Unicode line breaks (U+0085) raw, which breaks the document.
    return yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False)
