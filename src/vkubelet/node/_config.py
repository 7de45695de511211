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
from pathlib import Path
from typing import Annotated, Any, Literal

from msgspec import Meta, field

from .._fields import FilePath, PositiveInt, PositiveNumber, Section, decode, read_file
from ..kube import ClientOptions
from ..sdk.config import ConfigError, parse_taint
from ._agent import AgentConfig, NodeSpec
from ._nodecontroller import NodeSettings

# A node name is a DNS-1123 subdomain.
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class _Node(Section):
    name: str
    provider: Annotated[str, Meta(min_length=1)]
    provider_config: FilePath | None = None
    kubelet_port: Annotated[int, Meta(ge=0, le=65535)] = 10250
    internal_ip: str = field(default="127.0.0.1", name="internalIP")
    labels: dict[str, str] = field(default_factory=dict)
    taints: Annotated[list[str], Meta(description="a list of key=value:Effect")] | None = None


class _File(Section):
    nodes: Annotated[list[_Node], Meta(min_length=1, description="a non-empty list")]
    kubeconfig: FilePath | None = None
    kube_api_qps: PositiveNumber | None = None
    kube_api_burst: PositiveInt = 1000
    pod_sync_workers: PositiveInt = 96
    kubelet_api: bool = field(default=True, name="kubeletAPI")
    tls_cert_file: FilePath | None = None
    tls_private_key_file: FilePath | None = None
    client_ca_file: FilePath | None = field(default=None, name="clientCAFile")
    cert_dir: FilePath | None = None
    approve_own_cs_rs: Annotated[
        Literal["auto"] | bool, Meta(description="auto, true or false")
    ] = field(default="auto", name="approveOwnCSRs")
    insecure_kubelet_api: bool = field(default=False, name="insecureKubeletAPI")


def load_agent_config(path: Path) -> AgentConfig:
    where = str(path)
    data = decode(read_file(path), _File, where, what="a mapping at the top level")
    specs = [_node(where, f"nodes[{i}]", raw, path.parent) for i, raw in enumerate(data.nodes)]
    names = [s.settings.name for s in specs]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ConfigError(f"{where}: nodes: duplicate name {sorted(duplicates)[0]!r}")

    def file(value: str | None) -> Path | None:
        return None if value is None else path.parent / Path(value).expanduser()  # relative

    if (data.tls_cert_file is None) != (data.tls_private_key_file is None):
        raise ConfigError(f"{where}: tlsCertFile and tlsPrivateKeyFile go together")
    extra: dict[str, Any] = {}
    if data.cert_dir is not None:
        extra["cert_dir"] = file(data.cert_dir)
    approve = data.approve_own_cs_rs
    return AgentConfig(
        kubelet_api=data.kubelet_api,
        tls_cert_file=file(data.tls_cert_file),
        tls_key_file=file(data.tls_private_key_file),
        client_ca_file=file(data.client_ca_file),
        approve_csrs=None if approve == "auto" else approve,
        insecure_kubelet_api=data.insecure_kubelet_api,
        **extra,
        nodes=specs,
        kubeconfig=file(data.kubeconfig),
        client=ClientOptions(qps=data.kube_api_qps, burst=data.kube_api_burst),
        workers=data.pod_sync_workers,
    )


def _node(where: str, at: str, raw: _Node, base: Path) -> NodeSpec:
    if len(raw.name) > 253 or not _DNS1123.fullmatch(raw.name):
        raise ConfigError(
            f"{where}: {at}.name: {raw.name!r} is not a valid node name "
            "(lowercase letters, digits, '-' and '.')"
        )
    taints = None
    if raw.taints is not None:
        try:
            taints = [parse_taint(t) for t in raw.taints]
        except ConfigError as e:
            raise ConfigError(f"{where}: {at}.taints: {e}") from None
    try:
        ipaddress.ip_address(raw.internal_ip)
    except ValueError:
        raise ConfigError(
            f"{where}: {at}.internalIP: {raw.internal_ip!r} is not an IP address"
        ) from None
    return NodeSpec(
        settings=NodeSettings(
            name=raw.name,
            provider=raw.provider,
            labels=dict(raw.labels),
            taints=taints,
            kubelet_port=raw.kubelet_port,
            addresses=[
                {"type": "InternalIP", "address": raw.internal_ip},
                {"type": "Hostname", "address": raw.name},
            ],
        ),
        provider_config=(base / raw.provider_config) if raw.provider_config else None,
    )
