"""The cluster provider's config file, `lower.yaml`: which lower cluster, and how to map onto it.

    kubeconfig: lower.kubeconfig     # required; relative to this file
    context: lower-admin             # optional; the kubeconfig's current context otherwise
    upperClusterID: prod-eu          # identity of the upper cluster in owner stamps
    namespaces:
      prefix: ""                     # lower namespace = prefix + upper namespace
      map: {default: team-a}         # explicit names; win over the prefix
      create: true                   # create a missing lower namespace
    dependencyNames: suffixed        # or `same`: see docs/cluster-provider.md
    serviceAccounts: lower           # or `none`
    serviceAccountTokens: lower      # or `upper`: short-lived upper tokens (TokenRequest)
    pvcStorageClass: null            # null: keep the upper class; "": lower default; or a name
    publishCommonLabels: true        # labels every lower node shares go on the virtual node
    excludeLabels: [example.com/*]   # never published (patterns)
    resync: {pods: 60, nodes: 30, dependencies: 300}   # seconds between full reconciles
    kubeApiQps: 50                   # client-side limit against the lower apiserver
    kubeApiBurst: 100
    mode: aggregate                  # or `mirror`: one virtual node per lower node
    sharedServiceGrace: 30           # mirror: seconds a Service copy no member needs stays below
    fitCheck: true                   # aggregate: fail a pod no single lower node can take
    cannotFitBackoff: 10             # seconds the node is tainted after such a failure (doubling)
    unschedulableTimeout: 120        # a pod Unschedulable below this long fails (0: waits forever)
    daemonSetPods: refuse            # or `run`; a pod annotation can opt in too
    clusterName: eu-1                # label value naming the lower cluster (default: node name)
    clusterLabel: vkubelet.io/cluster  # the label key carrying it; null: no such label
    webhook: {enabled: true}         # the constraint webhook (see `_admission`)

Errors name the file and the field (`lower.yaml: namespaces.prefix: ...`), as the agent's own
config and the SSH inventory do.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..._fields import PositiveInt, PositiveNumber, Section, decode, read_file
from ...sdk import ConfigError
from ._webhookconfig import WebhookConfig, parse_webhook_config

__all__ = [
    "DEFAULT_CLUSTER_LABEL",
    "LowerConfig",
    "NamespaceMapping",
    "Resync",
    "cluster_label_value",
    "load_lower_config",
]

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# Stamps carry the upper cluster's identity in a label value: at most 63 characters of these.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# A label key: optional DNS subdomain prefix and '/', then a name of at most 63 characters.
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
DEFAULT_CLUSTER_LABEL = "vkubelet.io/cluster"
_Seconds = Annotated[float, Meta(ge=0, description="a number of seconds >= 0")]
_ResyncSeconds = Annotated[float, Meta(ge=1, le=86400, description="seconds in 1..86400")]


class _Namespaces(Section):
    prefix: str = ""
    mapping: Annotated[dict[str, str], Meta(description="a mapping upper: lower")] = msgspec.field(
        default_factory=dict, name="map"
    )
    create: bool = True


class Resync(Section):
    """Seconds between full reconciles; watches deliver changes in between."""

    pods: _ResyncSeconds = 60.0
    nodes: _ResyncSeconds = 30.0
    dependencies: _ResyncSeconds = 300.0


class _File(Section):
    kubeconfig: Annotated[
        str, Meta(min_length=1, description="the lower cluster's kubeconfig, relative to this file")
    ]
    context: Annotated[str, Meta(min_length=1, description="a context name")] | None = None
    upper_cluster_id: (
        Annotated[str, Meta(max_length=63, description="a string of at most 63 characters")] | None
    ) = msgspec.field(default=None, name="upperClusterID")
    namespaces: _Namespaces | None = None
    dependency_names: Literal["suffixed", "same"] = "suffixed"
    service_accounts: Literal["lower", "none"] = "lower"
    service_account_tokens: Literal["lower", "upper"] = "lower"
    pvc_storage_class: Annotated[str, Meta(description='a class name, "" or null')] | None = None
    publish_common_labels: bool = True
    exclude_labels: (
        Annotated[
            list[Annotated[str, Meta(min_length=1)]],
            Meta(description="a list of label keys or patterns"),
        ]
        | None
    ) = None
    resync: Resync | None = None
    kube_api_qps: PositiveNumber | None = None
    kube_api_burst: PositiveInt = 100
    mode: Literal["aggregate", "mirror"] = "aggregate"
    shared_service_grace: _Seconds = 30.0
    fit_check: bool = True
    cannot_fit_backoff: _Seconds = 10.0
    unschedulable_timeout: _Seconds = 120.0
    daemon_set_pods: Literal["refuse", "run"] = "refuse"
    cluster_name: str | None = None
    cluster_label: str | None = DEFAULT_CLUSTER_LABEL
    webhook: (
        Annotated[dict[str, Any], Meta(description="a mapping (enabled, port, ...)")] | None
    ) = None  # read by parse_webhook_config


@dataclass(frozen=True)
class NamespaceMapping:
    """Upper namespace -> lower namespace: the explicit map first, else prefix + name."""

    prefix: str = ""
    explicit: tuple[tuple[str, str], ...] = ()
    create: bool = True

    def lower(self, upper: str) -> str:
        for name, lower in self.explicit:
            if name == upper:
                return lower
        return self.prefix + upper

    def upper(self, lower: str) -> str | None:
        """The upper namespace that maps to `lower`, if any. A pod is run only when this gives
        its own namespace back: the mapping must never send two upper namespaces to one."""
        for name, mapped in self.explicit:
            if mapped == lower:
                return name
        if lower.startswith(self.prefix):
            candidate = lower[len(self.prefix) :]
            if not any(name == candidate for name, _ in self.explicit):
                return candidate
        return None


@dataclass(frozen=True)
class LowerConfig:
    kubeconfig: Path
    source: Path  # the lower.yaml this came from, for messages
    context: str | None = None
    upper_cluster_id: str | None = None
    namespaces: NamespaceMapping = NamespaceMapping()
    dependency_names: Literal["suffixed", "same"] = "suffixed"
    service_accounts: Literal["lower", "none"] = "lower"
    service_account_tokens: Literal["lower", "upper"] = "lower"
    pvc_storage_class: str | None = None
    publish_common_labels: bool = True
    exclude_labels: tuple[str, ...] = ()
    resync: Resync = field(default_factory=Resync)
    kube_api_qps: float | None = None
    kube_api_burst: int = 100
    mode: Literal["aggregate", "mirror"] = "aggregate"
    # Mirror mode: how long a shared Service copy that no member needs stays below, so that a
    # lone replica moving between members does not take its Service down (`held_deletes`).
    shared_service_grace: float = 30.0
    fit_check: bool = True
    cannot_fit_backoff: float = 10.0
    unschedulable_timeout: float = 120.0  # a pod Unschedulable below this long fails; 0: never
    daemon_set_pods: Literal["refuse", "run"] = "refuse"
    # Several lower clusters: every virtual node of this lower cluster carries
    # `cluster_label: cluster_name`, so upper constraints can spread over or choose clusters.
    # None until settled: the provider's factory defaults it to the virtual node's name.
    cluster_name: str | None = None
    cluster_label: str | None = DEFAULT_CLUSTER_LABEL
    webhook: WebhookConfig = field(default_factory=WebhookConfig)

    def label_excluded(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.exclude_labels)


def load_lower_config(path: Path) -> LowerConfig:
    return parse_lower_config(read_file(path), path)


def parse_lower_config(data: Any, path: Path) -> LowerConfig:
    where = str(path)

    def fail(name: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}: {name}: {problem}")

    raw = decode(data, _File, where, what="a mapping with at least `kubeconfig: PATH`")
    cluster_id = raw.upper_cluster_id
    if cluster_id is not None and not _LABEL_VALUE.fullmatch(cluster_id):
        raise fail(
            "upperClusterID",
            f"{cluster_id!r} is not a valid label value (letters, digits, '-', '_', '.')",
        )
    if raw.service_account_tokens == "upper" and raw.service_accounts == "none":
        raise fail(
            "serviceAccountTokens",
            "upper tokens need a service account: not with serviceAccounts: none",
        )
    webhook = parse_webhook_config(where, raw.webhook, path.parent)
    if webhook.enabled and raw.mode == "mirror":
        raise fail(
            "webhook",
            "the constraint webhook is for mode: aggregate (mirrored nodes show the lower labels)",
        )
    return LowerConfig(
        **{
            **msgspec.structs.asdict(raw),  # the fields taken as they are, then the others
            "kubeconfig": path.parent / Path(raw.kubeconfig).expanduser(),
            "source": path,
            "namespaces": _namespaces(where, raw.namespaces or _Namespaces()),
            "exclude_labels": tuple(raw.exclude_labels or ()),
            "resync": raw.resync or Resync(),
            "cluster_name": _cluster_name(where, raw.cluster_name),
            "cluster_label": _cluster_label(where, raw.cluster_label),
            "webhook": webhook,
        }
    )


def _cluster_name(where: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        raise ConfigError(
            f"{where}: clusterName: {value!r} is not a valid label value "
            "(at most 63 letters, digits, '-', '_', '.', starting and ending alphanumeric)"
        )
    return value


def _cluster_label(where: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not _LABEL_KEY.fullmatch(value) or len(value) > 316:
        raise ConfigError(f"{where}: clusterLabel: {value!r} is not a valid label key")
    name = value.rpartition("/")[2]
    if len(name) > 63:
        raise ConfigError(f"{where}: clusterLabel: {value!r}: the name part is over 63 characters")
    return value


def cluster_label_value(node_name: str) -> str:
    """The default `clusterName`: the virtual node's name (mirror mode: the fleet's prefix), cut
    to a label value's 63 characters and ended with a hash of the whole when longer."""
    if len(node_name) <= 63 and _LABEL_VALUE.fullmatch(node_name):
        return node_name
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:10]
    head = re.sub(r"[^-A-Za-z0-9_.]", "-", node_name)[:52].strip("-_.")
    return f"{head}-{digest}" if head else digest


def _namespaces(where: str, raw: _Namespaces) -> NamespaceMapping:
    prefix = raw.prefix
    if prefix and not re.fullmatch(r"[a-z0-9][-a-z0-9]*", prefix):
        raise ConfigError(
            f"{where}: namespaces.prefix: {prefix!r} must start a namespace name "
            "(lower-case letters, digits and '-', starting with a letter or digit)"
        )
    for upper, lower in raw.mapping.items():
        for role, name in (("upper", upper), ("lower", lower)):
            if not _namespace_name(name):
                raise ConfigError(
                    f"{where}: namespaces.map.{upper}: {role} namespace {name!r} is not a "
                    "valid namespace name"
                )
    lowers = list(raw.mapping.values())
    for lower in lowers:
        if lowers.count(lower) > 1:
            raise ConfigError(
                f"{where}: namespaces.map: two upper namespaces map to {lower!r}; "
                "their pods and objects would collide"
            )
    return NamespaceMapping(
        prefix=prefix, explicit=tuple(sorted(raw.mapping.items())), create=raw.create
    )


def _namespace_name(name: str) -> bool:
    return len(name) <= 63 and bool(_DNS1123_LABEL.fullmatch(name))
