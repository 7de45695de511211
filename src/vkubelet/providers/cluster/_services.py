"""Upper Services reflected below, so that in-cluster names keep working for the lower pods.

A lower pod resolves `web` (or `web.shop.svc`) with the *lower* cluster's DNS, so a Service its
pods are part of must exist below too. Which upper Services: those whose selector matches at
least one pod this virtual node runs (same namespace). A reflected Service is deleted once no
pod of this node matches it any more, or once the upper Service is gone.

How the lower Service gets its endpoints: it keeps a **selector**, the upper one plus this
owner's stamp label, so the lower cluster's own EndpointSlice controller picks exactly our lower
pods of that Service (they carry the upper pod's labels and the stamp) and follows their
readiness as the lower kubelets report it. Hence no flat network is needed for those pods, no
upper EndpointSlice is read (a `system:node` identity may not), and another owner's pods with
the same labels in a shared lower namespace are never picked. The price: replicas of the Service
running elsewhere (on other upper nodes) are not endpoints below; reaching them from below needs
the upper Service address and a flat pod network (docs/cluster-provider.md, *Network*).

Only stamped lower Services are updated or deleted; a lower name held by anyone else is a
conflict, left alone. Pure planning here; the plan is carried out as a dependency plan is
(`LowerCluster.apply_dependencies`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._deps import SOURCE_VERSION
from ._stamps import LABEL_OWNER, Owner, stamp, upper_identity

__all__ = [
    "ServicePlan",
    "lower_service",
    "plan_services",
    "selects",
    "selects_anything",
]

JSON = dict[str, Any]
Key = tuple[str, str]  # lower (namespace, name)
# Kept from the upper port: a NodePort is never opened below.
_PORT_FIELDS = ("name", "protocol", "port", "targetPort", "appProtocol")
_SPEC_FIELDS = ("sessionAffinity", "sessionAffinityConfig", "publishNotReadyAddresses")


@dataclass
class ServicePlan:
    create: list[JSON] = field(default_factory=list)
    update: list[JSON] = field(default_factory=list)  # desired, resourceVersion of the current
    replace: list[JSON] = field(default_factory=list)  # headless <-> not: delete, then create
    delete: list[tuple[Key, str]] = field(default_factory=list)  # (key, lower UID)


def selects_anything(service: Mapping[str, Any]) -> bool:
    """Whether the Service selects pods at all (an empty selector picks none: such a Service
    has hand-made endpoints, which are not ours to reflect; nor does ExternalName, which
    ignores its selector: a DNS alias, not ours)."""
    spec = service.get("spec") or {}
    return bool(spec.get("selector")) and spec.get("type") != "ExternalName"


def selects(service: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether the Service's selector picks the pod (see `selects_anything`)."""
    if not selects_anything(service):
        return False
    selector = (service.get("spec") or {}).get("selector") or {}
    service_ns = (service.get("metadata") or {}).get("namespace")
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    return metadata.get("namespace") == service_ns and all(
        labels.get(k) == v for k, v in selector.items()
    )


def lower_service(upper: Mapping[str, Any], owner: Owner, lower_namespace: str) -> JSON:
    """The lower copy of an upper Service: same name (DNS), ClusterIP (or headless), the upper
    selector narrowed to this owner's lower pods."""
    metadata = upper.get("metadata") or {}
    spec = upper.get("spec") or {}
    lower_spec: JSON = {
        "type": "ClusterIP",
        "selector": {**(spec.get("selector") or {}), LABEL_OWNER: owner.key},
        "ports": [
            {k: p[k] for k in _PORT_FIELDS if p.get(k) is not None} for p in spec.get("ports") or []
        ],
    }
    if spec.get("clusterIP") == "None":
        lower_spec["clusterIP"] = "None"
    for key in _SPEC_FIELDS:
        if spec.get(key) is not None:
            lower_spec[key] = spec[key]
    body: JSON = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "namespace": lower_namespace,
            "name": metadata.get("name"),
            "labels": dict(metadata.get("labels") or {}),
            "annotations": {SOURCE_VERSION: str(metadata.get("resourceVersion", ""))},
        },
        "spec": lower_spec,
    }
    return stamp(
        body,
        owner,
        namespace=str(metadata.get("namespace")),
        name=str(metadata.get("name")),
        uid=str(metadata.get("uid", "")),
    )


def _headless(service: Mapping[str, Any]) -> bool:
    return (service.get("spec") or {}).get("clusterIP") == "None"


def plan_services(
    upper_services: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    ours: Mapping[Key, Mapping[str, Any]],
    owner: Owner,
    lower_namespace: Callable[[str], str],
) -> ServicePlan:
    """From the upper Services, the upper pods this node runs and our lower Services (by lower
    key), what to write. `lower_namespace` maps an upper namespace to its lower one."""
    pods = list(pods)
    wanted: dict[Key, JSON] = {}
    for service in upper_services:
        if any(selects(service, pod) for pod in pods):
            metadata = service.get("metadata") or {}
            namespace = lower_namespace(str(metadata.get("namespace")))
            wanted[(namespace, str(metadata.get("name")))] = lower_service(
                service, owner, namespace
            )
    plan = ServicePlan()
    for key, desired in wanted.items():
        current = ours.get(key)
        if current is None:
            plan.create.append(desired)
            continue
        current_meta = current.get("metadata") or {}
        if _headless(current) != _headless(desired):
            plan.delete.append((key, str(current_meta.get("uid", ""))))
            plan.replace.append(desired)
            continue
        source = (current_meta.get("annotations") or {}).get(SOURCE_VERSION)
        if source == desired["metadata"]["annotations"][SOURCE_VERSION] and upper_identity(
            current
        ) == upper_identity(desired):
            continue
        # The apiserver keeps the allocated ClusterIP when an update leaves it out.
        update = {**desired, "metadata": dict(desired["metadata"])}
        update["metadata"]["resourceVersion"] = current_meta.get("resourceVersion")
        if not _headless(current):
            update["spec"] = {
                **desired["spec"],
                **{
                    k: (current.get("spec") or {})[k]
                    for k in ("clusterIP", "clusterIPs")
                    if (current.get("spec") or {}).get(k)
                },
            }
        plan.update.append(update)
    for key, current in ours.items():
        if key not in wanted:
            plan.delete.append((key, str((current.get("metadata") or {}).get("uid", ""))))
    return plan
