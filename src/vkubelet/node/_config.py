"""The agent's configuration file (YAML), for one process serving several virtual nodes.

    kubeconfig: ~/.kube/config          # optional; else $KUBECONFIG / in-cluster
    kubeApiQps: 500                     # optional client-side limit (default: none)
    kubeApiBurst: 1000
    podSyncWorkers: 96
    certDir: pki                        # default ~/.local/state/vkubelet/pki (a subdir per cluster)
    approveOwnCSRs: auto                # auto (on a vkubelet dev cluster), true or false
    nodes:
      - name: vk-mock-0
        provider: mock
        providerConfig: mock.json       # relative to this file
        kubeletPort: 10250
        internalIP: 127.0.0.1
        labels: {zone: lab-1}
        taints: []                      # omit for the default provider taint; [] for none

Errors name the file and the field, e.g. `agent.yaml: nodes[1].kubeletPort: expected an integer`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .._fields import reject_unknown
from ..kube import ClientOptions
from ..sdk.config import ConfigError, parse_taint
from ._agent import AgentConfig, NodeSpec
from ._nodecontroller import NodeSettings

_NODE_KEYS = {"name", "provider", "providerConfig", "kubeletPort", "internalIP", "labels", "taints"}
_TOP_KEYS = {
    "kubeconfig",
    "kubeApiQps",
    "kubeApiBurst",
    "podSyncWorkers",
    "nodes",
    "kubeletAPI",
    "tlsCertFile",
    "tlsPrivateKeyFile",
    "clientCAFile",
    "certDir",
    "approveOwnCSRs",
    "insecureKubeletAPI",
}
# A node name is a DNS-1123 subdomain.
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def load_agent_config(path: Path) -> AgentConfig:
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    reject_unknown(data, _TOP_KEYS, "", _failure(where))
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ConfigError(f"{where}: nodes: expected a non-empty list")
    specs = [_node(where, f"nodes[{i}]", raw, path.parent) for i, raw in enumerate(nodes)]
    names = [s.settings.name for s in specs]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ConfigError(f"{where}: nodes: duplicate name {sorted(duplicates)[0]!r}")

    def file_option(name: str) -> Path | None:
        value = data.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {name}: expected a path")
        return path.parent / Path(value).expanduser()  # relative to this file

    def flag(name: str, default: bool) -> bool:
        value = data.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {name}: expected true or false")
        return value

    approve = data.get("approveOwnCSRs", "auto")
    if approve not in ("auto", True, False):
        raise ConfigError(f"{where}: approveOwnCSRs: expected auto, true or false")
    if (data.get("tlsCertFile") is None) != (data.get("tlsPrivateKeyFile") is None):
        raise ConfigError(f"{where}: tlsCertFile and tlsPrivateKeyFile go together")
    extra: dict[str, Any] = {}
    if data.get("certDir") is not None:
        extra["cert_dir"] = file_option("certDir")
    return AgentConfig(
        kubelet_api=flag("kubeletAPI", True),
        tls_cert_file=file_option("tlsCertFile"),
        tls_key_file=file_option("tlsPrivateKeyFile"),
        client_ca_file=file_option("clientCAFile"),
        approve_csrs=None if approve == "auto" else bool(approve),
        insecure_kubelet_api=flag("insecureKubeletAPI", False),
        **extra,
        nodes=specs,
        kubeconfig=file_option("kubeconfig"),
        client=ClientOptions(
            qps=_number(where, "kubeApiQps", data.get("kubeApiQps")),
            burst=_count(where, "kubeApiBurst", data.get("kubeApiBurst"), 1000),
        ),
        workers=_count(where, "podSyncWorkers", data.get("podSyncWorkers"), 96),
    )


def _node(where: str, at: str, raw: Any, base: Path) -> NodeSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {at}: expected a mapping")
    reject_unknown(raw, _NODE_KEYS, at, _failure(where))
    for required in ("name", "provider"):
        if not isinstance(raw.get(required), str) or not raw[required]:
            raise ConfigError(f"{where}: {at}.{required}: required (a string)")
    if len(raw["name"]) > 253 or not _DNS1123.fullmatch(raw["name"]):
        raise ConfigError(
            f"{where}: {at}.name: {raw['name']!r} is not a valid node name "
            "(lowercase letters, digits, '-' and '.')"
        )
    port = raw.get("kubeletPort", 10250)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"{where}: {at}.kubeletPort: expected an integer port")
    labels = raw.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise ConfigError(f"{where}: {at}.labels: expected a mapping of strings")
    taints = raw.get("taints")
    parsed_taints = None
    if taints is not None:
        if not isinstance(taints, list):
            raise ConfigError(f"{where}: {at}.taints: expected a list of key=value:Effect")
        try:
            parsed_taints = [parse_taint(str(t)) for t in taints]
        except ConfigError as e:
            raise ConfigError(f"{where}: {at}.taints: {e}") from None
    ip = raw.get("internalIP", "127.0.0.1")
    try:
        ipaddress.ip_address(ip if isinstance(ip, str) else "")
    except ValueError:
        raise ConfigError(f"{where}: {at}.internalIP: {ip!r} is not an IP address") from None
    provider_config = raw.get("providerConfig")
    if provider_config is not None and not isinstance(provider_config, str):
        raise ConfigError(f"{where}: {at}.providerConfig: expected a path")
    return NodeSpec(
        settings=NodeSettings(
            name=raw["name"],
            provider=raw["provider"],
            labels=labels,
            taints=parsed_taints,
            kubelet_port=port,
            addresses=[
                {"type": "InternalIP", "address": str(ip)},
                {"type": "Hostname", "address": raw["name"]},
            ],
        ),
        provider_config=(base / provider_config) if provider_config else None,
    )


def _failure(where: str) -> Callable[[str, str], ConfigError]:
    return lambda field, problem: ConfigError(f"{where}: {field}: {problem}")


def _count(where: str, name: str, value: Any, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: {name}: expected a positive integer")
    return value


def _number(where: str, name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: {name}: expected a positive number")
    return float(value)
