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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import yaml

from ..._fields import reject_unknown
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

_TOP_KEYS = {
    "kubeconfig",
    "context",
    "upperClusterID",
    "namespaces",
    "dependencyNames",
    "serviceAccounts",
    "serviceAccountTokens",
    "pvcStorageClass",
    "publishCommonLabels",
    "excludeLabels",
    "resync",
    "kubeApiQps",
    "kubeApiBurst",
    "mode",
    "fitCheck",
    "cannotFitBackoff",
    "unschedulableTimeout",
    "daemonSetPods",
    "clusterName",
    "clusterLabel",
    "webhook",
}
_NAMESPACE_KEYS = {"prefix", "map", "create"}
_RESYNC_KEYS = {"pods", "nodes", "dependencies"}
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# Stamps carry the upper cluster's identity in a label value: at most 63 characters of these.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# A label key: optional DNS subdomain prefix and '/', then a name of at most 63 characters.
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
DEFAULT_CLUSTER_LABEL = "vkubelet.io/cluster"


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
class Resync:
    """Seconds between full reconciles; watches deliver changes in between."""

    pods: float = 60.0
    nodes: float = 30.0
    dependencies: float = 300.0


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
    resync: Resync = Resync()
    kube_api_qps: float | None = None
    kube_api_burst: int = 100
    mode: Literal["aggregate", "mirror"] = "aggregate"
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
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{where}: cannot read it: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with at least `kubeconfig: PATH`")
    return parse_lower_config(data, path)


def parse_lower_config(data: dict[str, Any], path: Path) -> LowerConfig:
    where = str(path)

    def fail(name: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}: {name}: {problem}")

    reject_unknown(data, _TOP_KEYS, "", _failure(where))
    kubeconfig = data.get("kubeconfig")
    if not isinstance(kubeconfig, str) or not kubeconfig:
        raise fail("kubeconfig", "required: the lower cluster's kubeconfig (relative to this file)")
    context = data.get("context")
    if context is not None and (not isinstance(context, str) or not context):
        raise fail("context", "expected a context name")
    cluster_id = data.get("upperClusterID")
    if cluster_id is not None:
        if not isinstance(cluster_id, str) or len(cluster_id) > 63:
            raise fail("upperClusterID", "expected a string of at most 63 characters")
        if not _LABEL_VALUE.fullmatch(cluster_id):
            raise fail(
                "upperClusterID",
                f"{cluster_id!r} is not a valid label value (letters, digits, '-', '_', '.')",
            )
    service_accounts = _choice(where, data, "serviceAccounts", ("lower", "none"))
    tokens = _choice(where, data, "serviceAccountTokens", ("lower", "upper"))
    if tokens == "upper" and service_accounts == "none":
        raise fail(
            "serviceAccountTokens",
            "upper tokens need a service account: not with serviceAccounts: none",
        )
    webhook = parse_webhook_config(where, data.get("webhook"), path.parent)
    if webhook.enabled and data.get("mode") == "mirror":
        raise fail(
            "webhook",
            "the constraint webhook is for mode: aggregate (mirrored nodes show the lower labels)",
        )
    return LowerConfig(
        kubeconfig=path.parent / Path(kubeconfig).expanduser(),
        source=path,
        context=context,
        upper_cluster_id=cluster_id,
        namespaces=_namespaces(where, data.get("namespaces")),
        dependency_names=cast(
            Literal["suffixed", "same"],
            _choice(where, data, "dependencyNames", ("suffixed", "same")),
        ),
        service_accounts=cast(Literal["lower", "none"], service_accounts),
        service_account_tokens=cast(Literal["lower", "upper"], tokens),
        pvc_storage_class=_storage_class(where, data.get("pvcStorageClass")),
        publish_common_labels=_flag(where, "publishCommonLabels", data, True),
        exclude_labels=_patterns(where, data.get("excludeLabels")),
        resync=_resync(where, data.get("resync")),
        kube_api_qps=_number(where, "kubeApiQps", data.get("kubeApiQps")),
        kube_api_burst=_count(where, "kubeApiBurst", data.get("kubeApiBurst"), 100),
        mode=cast(
            Literal["aggregate", "mirror"], _choice(where, data, "mode", ("aggregate", "mirror"))
        ),
        fit_check=_flag(where, "fitCheck", data, True),
        daemon_set_pods=cast(
            Literal["refuse", "run"], _choice(where, data, "daemonSetPods", ("refuse", "run"))
        ),
        cannot_fit_backoff=_seconds(where, "cannotFitBackoff", data.get("cannotFitBackoff"), 10.0),
        unschedulable_timeout=_seconds(
            where, "unschedulableTimeout", data.get("unschedulableTimeout"), 120.0
        ),
        cluster_name=_cluster_name(where, data.get("clusterName")),
        cluster_label=_cluster_label(where, data.get("clusterLabel", DEFAULT_CLUSTER_LABEL)),
        webhook=webhook,
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


def _namespaces(where: str, raw: Any) -> NamespaceMapping:
    if raw is None:
        return NamespaceMapping()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: namespaces: expected a mapping (prefix, map, create)")
    reject_unknown(raw, _NAMESPACE_KEYS, "namespaces", _failure(where))
    prefix = raw.get("prefix", "")
    if not isinstance(prefix, str) or (prefix and not re.fullmatch(r"[a-z0-9][-a-z0-9]*", prefix)):
        raise ConfigError(
            f"{where}: namespaces.prefix: {prefix!r} must start a namespace name "
            "(lower-case letters, digits and '-', starting with a letter or digit)"
        )
    explicit = raw.get("map") or {}
    if not isinstance(explicit, dict):
        raise ConfigError(f"{where}: namespaces.map: expected a mapping upper: lower")
    pairs: list[tuple[str, str]] = []
    for upper, lower in explicit.items():
        for role, name in (("upper", upper), ("lower", lower)):
            if not isinstance(name, str) or not _namespace_name(name):
                raise ConfigError(
                    f"{where}: namespaces.map.{upper}: {role} namespace {name!r} is not a "
                    "valid namespace name"
                )
        pairs.append((upper, lower))
    lowers = [lower for _, lower in pairs]
    for lower in lowers:
        if lowers.count(lower) > 1:
            raise ConfigError(
                f"{where}: namespaces.map: two upper namespaces map to {lower!r}; "
                "their pods and objects would collide"
            )
    return NamespaceMapping(
        prefix=prefix,
        explicit=tuple(sorted(pairs)),
        create=_flag(where, "namespaces.create", raw, True, key="create"),
    )


def _namespace_name(name: str) -> bool:
    return len(name) <= 63 and bool(_DNS1123_LABEL.fullmatch(name))


def _resync(where: str, raw: Any) -> Resync:
    if raw is None:
        return Resync()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: resync: expected a mapping like {{pods: 60, nodes: 30}}")
    reject_unknown(raw, _RESYNC_KEYS, "resync", _failure(where))
    values = {}
    for key in sorted(_RESYNC_KEYS):
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{where}: resync.{key}: expected seconds in 1..86400")
            if not 1 <= value <= 86400:
                raise ConfigError(f"{where}: resync.{key}: expected seconds in 1..86400")
            values[key] = float(value)
    return Resync(**values)


def _choice(where: str, data: dict[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    value = data.get(name, allowed[0])
    if value not in allowed:
        raise ConfigError(f"{where}: {name}: expected one of {', '.join(allowed)} (got {value!r})")
    return str(value)


def _storage_class(where: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f'{where}: pvcStorageClass: expected a class name, "" or null')
    return value


def _flag(where: str, name: str, data: dict[str, Any], default: bool, *, key: str = "") -> bool:
    value = data.get(key or name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {name}: expected true or false")
    return value


def _patterns(where: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"{where}: excludeLabels: expected a list of label keys or patterns")
    return tuple(value)


def _number(where: str, name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where}: {name}: expected a positive number")
    return float(value)


def _count(where: str, name: str, value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: {name}: expected a positive integer")
    return value


def _failure(where: str) -> Callable[[str, str], ConfigError]:
    return lambda field, problem: ConfigError(f"{where}: {field}: {problem}")


def _seconds(where: str, name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"{where}: {name}: expected a number of seconds >= 0 (got {value!r})")
    return float(value)
