"""Upper Services reflected below, with all their ready endpoints, so that in-cluster names
keep working for the lower pods and reach every replica.

A lower pod resolves `web` (or `web.shop.svc`) with the *lower* cluster's DNS, so a Service its
pods are part of must exist below too. Which upper Services: those whose selector matches at
least one pod this virtual node runs (same namespace), or that have an endpoint on one of the
virtual nodes sharing the copies (in mirror mode every member of the fleet: see `nodes`). A
reflected Service is deleted once neither holds any more, or once the upper Service is gone.

How the lower Service gets its endpoints: it has **no selector**; the provider writes its
EndpointSlices, one per upper EndpointSlice of the Service, with the upper endpoints' addresses,
readiness and hostnames. Our own pods' upper addresses are their lower pods' (the provider
reports them up), so the lower copy holds this node's lower pods and the replicas running
elsewhere (on upper workers, other virtual nodes) alike; those others are reached through the
pod network (docs/cluster-provider.md, *Network*). The copy is the same whichever owner writes
it (made from upper data only), which is what lets the members of a mirror fleet share one.
Reading upper EndpointSlices needs a permission a `system:node` identity lacks (`list, watch
endpointslices.discovery.k8s.io`): until they can be read (`upper_slices` None), Services are
still reflected and no EndpointSlice below is written or deleted.

Only stamped lower objects are updated or deleted; a lower name held by anyone else is a
conflict, left alone. Pure planning here; the plan is carried out as a dependency plan is
(`LowerCluster.apply_dependencies`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._deps import SOURCE_VERSION
from ._stamps import Owner, stamp, upper_identity

__all__ = [
    "MANAGED_BY",
    "MANAGER",
    "SERVICE_NAME",
    "ServicePlan",
    "held_deletes",
    "lower_endpoint_slice",
    "lower_service",
    "plan_services",
    "selects",
    "selects_anything",
]

JSON = dict[str, Any]
Key = tuple[str, str]  # (namespace, name)
LowerKey = tuple[str, str, str]  # (kind, namespace, name) below
SERVICE_NAME = "kubernetes.io/service-name"
MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
MANAGER = "cluster-provider.vkubelet.io"  # not the controller's: it leaves our slices alone
# Kept from the upper port: a NodePort is never opened below.
_PORT_FIELDS = ("name", "protocol", "port", "targetPort", "appProtocol")
_SPEC_FIELDS = ("sessionAffinity", "sessionAffinityConfig", "publishNotReadyAddresses")
# Kept from an upper endpoint: its node, zone and pod are the upper cluster's, unknown below.
_ENDPOINT_FIELDS = ("addresses", "conditions", "hostname")
_SLICE_PORT_FIELDS = ("name", "protocol", "port", "appProtocol")


@dataclass
class ServicePlan:
    """Services and EndpointSlices to write below."""

    create: list[JSON] = field(default_factory=list)
    update: list[JSON] = field(default_factory=list)  # desired, resourceVersion of the current
    replace: list[JSON] = field(default_factory=list)  # Services only: delete, then create
    delete: list[tuple[LowerKey, str]] = field(default_factory=list)  # (key, lower UID)


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


def _stamped(body: JSON, upper: Mapping[str, Any], owner: Owner) -> JSON:
    metadata = upper.get("metadata") or {}
    body["metadata"]["annotations"] = {SOURCE_VERSION: str(metadata.get("resourceVersion", ""))}
    return stamp(
        body,
        owner,
        namespace=str(metadata.get("namespace")),
        name=str(metadata.get("name")),
        uid=str(metadata.get("uid", "")),
    )


def lower_service(upper: Mapping[str, Any], owner: Owner, lower_namespace: str) -> JSON:
    """The lower copy of an upper Service: same name (DNS), ClusterIP (or headless), no
    selector (its EndpointSlices are `lower_endpoint_slice`s)."""
    metadata = upper.get("metadata") or {}
    spec = upper.get("spec") or {}
    lower_spec: JSON = {
        "type": "ClusterIP",
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
        },
        "spec": lower_spec,
    }
    return _stamped(body, upper, owner)


def lower_endpoint_slice(upper: Mapping[str, Any], owner: Owner, lower_namespace: str) -> JSON:
    """The lower copy of an upper EndpointSlice: same name, Service and ports; each endpoint's
    addresses, readiness and hostname (`db-0.db` of a headless Service)."""
    metadata = upper.get("metadata") or {}
    service = (metadata.get("labels") or {}).get(SERVICE_NAME, "")
    body: JSON = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": lower_namespace,
            "name": metadata.get("name"),
            "labels": {SERVICE_NAME: service, MANAGED_BY: MANAGER},
        },
        "addressType": upper.get("addressType", "IPv4"),
        "endpoints": [
            {k: e[k] for k in _ENDPOINT_FIELDS if e.get(k) is not None}
            for e in upper.get("endpoints") or []
        ],
        "ports": [
            {k: p[k] for k in _SLICE_PORT_FIELDS if p.get(k) is not None}
            for p in upper.get("ports") or []
        ],
    }
    return _stamped(body, upper, owner)


def _has_endpoint_on(slices: Iterable[Mapping[str, Any]], nodes: Collection[str]) -> bool:
    return any(e.get("nodeName") in nodes for s in slices for e in s.get("endpoints") or [])


def _replaced(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """A Service turned headless (or back), or a copy with a selector (made by a version that
    let the lower controller pick our lower pods): the API cannot update those in place."""
    spec = current.get("spec") or {}
    headless = spec.get("clusterIP") == "None"
    return headless != (desired["spec"].get("clusterIP") == "None") or bool(spec.get("selector"))


def _unchanged(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    source = ((current.get("metadata") or {}).get("annotations") or {}).get(SOURCE_VERSION)
    return source == desired["metadata"]["annotations"][SOURCE_VERSION] and upper_identity(
        current
    ) == upper_identity(desired)


def plan_services(
    upper_services: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    upper_slices: Mapping[Key, Sequence[Mapping[str, Any]]] | None,
    ours: Mapping[LowerKey, Mapping[str, Any]],
    owner: Owner,
    lower_namespace: Callable[[str], str],
    nodes: Collection[str],
) -> ServicePlan:
    """From the upper Services, the upper pods this node runs, the upper EndpointSlices by
    Service (None: unknown), our lower Services and EndpointSlices (by lower key), what to
    write. `nodes`: the virtual nodes sharing these copies (an endpoint on any of them keeps
    its Service below); `lower_namespace` maps an upper namespace to its lower one.

    A Service's EndpointSlices are planned only once the lower Service is ours (in `ours`): a
    lower Service of that name that is someone else's must not get our endpoints through the
    `kubernetes.io/service-name` label. So a new Service's slices come one pass later."""
    pods = list(pods)
    wanted: dict[LowerKey, JSON] = {}
    for service in upper_services:
        metadata = service.get("metadata") or {}
        upper_key = (str(metadata.get("namespace")), str(metadata.get("name")))
        slices = (upper_slices or {}).get(upper_key, ())
        if not selects_anything(service) or not (
            any(selects(service, pod) for pod in pods) or _has_endpoint_on(slices, nodes)
        ):
            continue
        namespace = lower_namespace(upper_key[0])
        service_key = ("Service", namespace, upper_key[1])
        wanted[service_key] = lower_service(service, owner, namespace)
        if service_key not in ours:
            continue  # its slices once it is ours: a name held by someone else gets none
        for upper in slices if upper_slices is not None else ():
            copy = lower_endpoint_slice(upper, owner, namespace)
            wanted[("EndpointSlice", namespace, copy["metadata"]["name"])] = copy
    plan = ServicePlan()
    for key, desired in wanted.items():
        current = ours.get(key)
        if current is None:
            plan.create.append(desired)
            continue
        current_meta = current.get("metadata") or {}
        if key[0] == "Service" and _replaced(current, desired):
            plan.delete.append((key, str(current_meta.get("uid", ""))))
            plan.replace.append(desired)
        elif not _unchanged(current, desired):
            plan.update.append(_update(current, desired))
    for key, current in ours.items():
        if key not in wanted and (key[0] == "Service" or upper_slices is not None):
            plan.delete.append((key, str((current.get("metadata") or {}).get("uid", ""))))
    return plan


def _update(current: Mapping[str, Any], desired: JSON) -> JSON:
    """`desired` as an update of `current`: its resourceVersion, and a Service's allocated
    ClusterIP (the apiserver keeps it when an update leaves it out, but says so)."""
    update = {**desired, "metadata": dict(desired["metadata"])}
    update["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
    spec = current.get("spec") or {}
    if desired["kind"] == "Service" and spec.get("clusterIP") != "None":
        kept = {k: spec[k] for k in ("clusterIP", "clusterIPs") if spec.get(k)}
        update["spec"] = {**desired["spec"], **kept}
    return update


def held_deletes(
    deletes: Sequence[tuple[LowerKey, str]],
    ours: Mapping[LowerKey, Mapping[str, Any]],
    upper_services: Collection[Key],
    unneeded_since: Mapping[LowerKey, float],
    now: float,
    grace: float,
) -> tuple[list[tuple[LowerKey, str]], dict[LowerKey, float]]:
    """Mirror mode: which of a plan's deletes to make now. A shared Service copy no member
    needs while its upper Service still exists is kept, with its EndpointSlices, until it has
    been unneeded for `grace` seconds: a lone replica moving between members (evicted from a
    leaving member, then bound to another) keeps the Service, and its lower ClusterIP, below.
    Returns the deletes to make and, for the next pass, since when each Service kept for this
    reason has been unneeded (`now` and `unneeded_since`: one monotonic clock)."""
    since: dict[LowerKey, float] = {}
    held: set[Key] = set()  # lower (namespace, Service name)
    for key, _ in deletes:
        identity = upper_identity(ours.get(key) or {})
        if key[0] == "Service" and identity is not None and identity[:2] in upper_services:
            since[key] = unneeded_since.get(key, now)
            if now - since[key] < grace:
                held.add((key[1], key[2]))

    def service_of(key: LowerKey) -> Key:
        if key[0] == "Service":
            return (key[1], key[2])
        labels = ((ours.get(key) or {}).get("metadata") or {}).get("labels") or {}
        return (key[1], str(labels.get(SERVICE_NAME, "")))

    return [d for d in deletes if service_of(d[0]) not in held], since
