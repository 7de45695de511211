"""What the virtual node offers: the lower cluster's free room, never negative.

    allocatable = Σ allocatable of usable lower nodes - Σ requests of the pods bound to them
                  that are not ours and not terminal, clamped at zero per resource

A usable node is Ready, not cordoned and without a NoSchedule/NoExecute taint (an ordinary pod
could not land there). Our own lower pods are not subtracted: the upper scheduler already counts
them against the virtual node, and counting them twice (as tensile-kube does after a restart)
would shrink the node for nothing. Each pod also takes one `pods`. Pending pods the lower
scheduler has not bound take nothing yet: an unschedulable pod must not eat capacity forever.

Pure, so the formula is testable without a cluster; the provider feeds it its watch caches.
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ...sdk.quantity import QuantityError, parse_quantity

__all__ = [
    "NEVER_PUBLISHED",
    "LowerCapacity",
    "common_labels",
    "format_quantity",
    "lower_capacity",
    "mirror_capacity",
    "mirror_labels",
    "node_ready",
    "node_usable",
    "pod_requests",
]

_TERMINAL = {"Succeeded", "Failed"}
_BLOCKING_EFFECTS = {"NoSchedule", "NoExecute"}
# Labels that describe one machine or its role, never a whole cluster.
NEVER_PUBLISHED = ("kubernetes.io/hostname", "node-role.kubernetes.io/*", "node.kubernetes.io/*")


@dataclass(frozen=True)
class LowerCapacity:
    allocatable: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    usable_nodes: int = 0
    # Per resource, the most free on any single lower node (see `_fit.largest_free`).
    largest_free: dict[str, str] = field(default_factory=dict)


def node_usable(node: Mapping[str, Any]) -> bool:
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return False
    if any(t.get("effect") in _BLOCKING_EFFECTS for t in spec.get("taints") or []):
        return False
    return node_ready(node)


def node_ready(node: Mapping[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def lower_capacity(
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    is_ours: Callable[[Mapping[str, Any]], bool],
    *,
    label_excluded: Callable[[str], bool] = lambda key: False,
) -> LowerCapacity:
    usable = [n for n in nodes if node_usable(n)]
    return LowerCapacity(
        allocatable=_free(usable, pods, is_ours),
        labels=common_labels(usable, label_excluded),
        usable_nodes=len(usable),
    )


def _free(
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    is_ours: Callable[[Mapping[str, Any]], bool],
) -> dict[str, str]:
    """The nodes' allocatable minus the requests of the pods bound to them that are not ours
    and not terminal, clamped at zero per resource."""
    names = set()
    free: dict[str, Fraction] = defaultdict(Fraction)
    for node in nodes:
        names.add(str((node.get("metadata") or {}).get("name")))
        for resource, value in ((node.get("status") or {}).get("allocatable") or {}).items():
            free[resource] += _value(value)
    for pod in pods:
        if (pod.get("spec") or {}).get("nodeName") not in names:
            continue
        if (pod.get("status") or {}).get("phase") in _TERMINAL or is_ours(pod):
            continue
        for resource, value in pod_requests(pod).items():
            free[resource] -= value
        free["pods"] -= 1
    return {r: format_quantity(max(v, Fraction(0))) for r, v in sorted(free.items())}


# Mirror mode: a lower node's own labels go up (zone, region, instance type, arch ...), minus
# those that name the machine or its role; the instance type is a shape, so it is kept.
MIRROR_NEVER_PUBLISHED = ("kubernetes.io/hostname", "node-role.kubernetes.io/*")
MIRROR_PUBLISHED_ANYWAY = ("node.kubernetes.io/instance-type",)


def mirror_capacity(
    node: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    is_ours: Callable[[Mapping[str, Any]], bool],
    *,
    label_excluded: Callable[[str], bool] = lambda key: False,
) -> LowerCapacity:
    """One lower node as one virtual node: its allocatable minus the requests of the pods
    bound to it that are not ours (clamped at zero), and its labels. Whether it is usable
    (Ready, cordoned) is the node's condition and `unschedulable`, not a zero capacity."""
    return LowerCapacity(
        allocatable=_free([node], pods, is_ours),
        labels=mirror_labels(node, label_excluded),
        usable_nodes=1 if node_usable(node) else 0,
    )


def mirror_labels(
    node: Mapping[str, Any], excluded: Callable[[str], bool] = lambda key: False
) -> dict[str, str]:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return {
        k: str(v)
        for k, v in sorted(labels.items())
        if not excluded(k)
        and (
            k in MIRROR_PUBLISHED_ANYWAY
            or not any(
                fnmatch.fnmatchcase(k, p) for p in (*MIRROR_NEVER_PUBLISHED, *NEVER_PUBLISHED)
            )
        )
    }


def common_labels(
    nodes: Iterable[Mapping[str, Any]], excluded: Callable[[str], bool] = lambda key: False
) -> dict[str, str]:
    """Labels with the same value on every node (say a region), so upper constraints on them
    select the virtual node. None when there is no node: nothing is known then."""
    common: dict[str, str] | None = None
    for node in nodes:
        labels = dict((node.get("metadata") or {}).get("labels") or {})
        common = (
            labels if common is None else {k: v for k, v in common.items() if labels.get(k) == v}
        )
    return {
        k: v
        for k, v in sorted((common or {}).items())
        if not excluded(k) and not any(fnmatch.fnmatchcase(k, p) for p in NEVER_PUBLISHED)
    }


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Fraction]:
    """A pod's effective requests as the scheduler computes them: the larger of the regular
    containers' sum (plus restartable init containers, i.e. sidecars) and each init container's
    peak (plus the sidecars started before it), plus the RuntimeClass overhead."""
    spec = pod.get("spec") or {}
    total: dict[str, Fraction] = defaultdict(Fraction)
    for container in spec.get("containers") or []:
        _add(total, _requests(container))
    sidecars: dict[str, Fraction] = defaultdict(Fraction)
    init_peak: dict[str, Fraction] = defaultdict(Fraction)
    for container in spec.get("initContainers") or []:
        requests = _requests(container)
        if container.get("restartPolicy") == "Always":
            _add(sidecars, requests)
            for resource, value in sidecars.items():
                init_peak[resource] = max(init_peak[resource], value)
        else:
            for resource in set(requests) | set(sidecars):
                peak = requests.get(resource, Fraction(0)) + sidecars.get(resource, Fraction(0))
                init_peak[resource] = max(init_peak[resource], peak)
    _add(total, sidecars)
    for resource, value in init_peak.items():
        total[resource] = max(total[resource], value)
    _add(total, {r: _value(v) for r, v in (spec.get("overhead") or {}).items()})
    return dict(total)


def _requests(container: Mapping[str, Any]) -> dict[str, Fraction]:
    """Requests, or limits where a request is missing (the API defaults requests to limits)."""
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {r: _value(v) for r, v in merged.items()}


def _add(into: dict[str, Fraction], values: Mapping[str, Fraction]) -> None:
    for resource, value in values.items():
        into[resource] += value


def _value(raw: Any) -> Fraction:
    try:
        return parse_quantity(raw).to_fraction()
    except QuantityError:
        return Fraction(0)  # the API validated it; a value we cannot read counts as nothing


def format_quantity(value: Fraction) -> str:
    """A canonical quantity string: whole units, else milli-units, else nano-units (rounded
    down, so the node never offers more than there is)."""
    if value.denominator == 1:
        return str(value.numerator)
    milli = value * 1000
    if milli.denominator == 1:
        return f"{milli.numerator}m"
    return f"{int(value * 10**9)}n"
