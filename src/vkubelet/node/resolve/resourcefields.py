"""`resourceFieldRef` values (pkg/api/v1/resource, kubelet defaultPodLimitsForDownwardAPI)."""

from __future__ import annotations

from typing import Any, Final

from ...sdk.quantity import ZERO, Quantity, QuantityError, divide_ceil, parse_quantity
from .fieldpath import FieldSelectorError
from .jsonvalues import obj, seq, text
from .sources import JSON

_STANDARD_RESOURCES: Final = frozenset({"cpu", "memory", "ephemeral-storage"})
_POD_LEVEL_RESOURCES: Final = ("cpu", "memory")


def _quantity_of(values: JSON, name: str, what: str) -> Quantity:
    raw = values.get(name)
    if raw is None:
        return ZERO
    try:
        return parse_quantity(raw)
    except QuantityError as err:
        raise FieldSelectorError(f"{what} {name}: {err}") from err


def default_limits(container: JSON, allocatable: JSON) -> dict[str, Any]:
    """The container's limits, with unset or zero cpu/memory/ephemeral-storage limits replaced by
    `allocatable` (MergeContainerResourceLimits). A container without a limit can use the whole
    node, so that is what `limits.*` reports; hugepages are never overcommitted, so never defaulted.
    """
    limits = dict(obj(obj(container.get("resources")).get("limits")))
    for name in sorted(_STANDARD_RESOURCES):
        if _quantity_of(limits, name, "limit").is_zero and name in allocatable:
            limits[name] = allocatable[name]
    return limits


def env_allocatable(pod: JSON, node_allocatable: JSON) -> JSON:
    """What unset container limits default to for env vars: pod-level limits when the pod has
    them (PodLevelResources), else the node's allocatable."""
    pod_limits = obj(obj(obj(pod.get("spec")).get("resources")).get("limits"))
    supported = [k for k in pod_limits if k in _POD_LEVEL_RESOURCES or k.startswith("hugepages-")]
    if not supported:
        return node_allocatable
    allocatable = dict(node_allocatable)
    for name in _POD_LEVEL_RESOURCES:
        if name in allocatable and not _quantity_of(pod_limits, name, "pod limit").is_zero:
            allocatable[name] = pod_limits[name]
    return allocatable


def resource_field_value(selector: JSON, limits: JSON, requests: JSON) -> str:
    """The value of a `resourceFieldRef` given the (already defaulted) limits and requests.

    The result is ceil(value / divisor); an unset or zero divisor means 1.
    """
    resource = text(selector.get("resource"))
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or not (
        name in _STANDARD_RESOURCES or name.startswith("hugepages-")
    ):
        raise FieldSelectorError(f"unsupported container resource : {resource}")
    raw_divisor = selector.get("divisor")
    try:
        divisor = ZERO if raw_divisor is None else parse_quantity(raw_divisor)
    except QuantityError as err:
        raise FieldSelectorError(f"divisor: {err}") from err
    if divisor.is_zero:
        divisor = Quantity(1, 0)
    quantity = _quantity_of(limits if kind == "limits" else requests, name, kind)
    return str(divide_ceil(quantity, divisor))


def find_container(pod: JSON, name: str) -> JSON:
    """A regular or init container by name (findContainerInPod; ephemeral ones have no limits)."""
    spec = obj(pod.get("spec"))
    for key in ("containers", "initContainers"):
        for container in seq(spec.get(key)):
            if text(obj(container).get("name")) == name:
                return obj(container)
    raise FieldSelectorError(f"container {name} not found")


def env_resource_value(selector: JSON, pod: JSON, container: JSON, allocatable: JSON) -> str:
    """containerResourceRuntimeValue over the kubelet's defaulted pod copy.

    Quirk kept: the kubelet defaults the limits of the container being started and of the pod's
    regular containers, not of init containers looked up by `containerName`.
    """
    target_name = text(selector.get("containerName"))
    if target_name:
        target = find_container(pod, target_name)
        is_regular = any(
            text(obj(c).get("name")) == target_name
            for c in seq(obj(pod.get("spec")).get("containers"))
        )
        if not is_regular:
            limits: JSON = obj(obj(target.get("resources")).get("limits"))
            return resource_field_value(selector, limits, _requests(target))
        container = target
    return resource_field_value(
        selector, default_limits(container, allocatable), _requests(container)
    )


def _requests(container: JSON) -> JSON:
    return obj(obj(container.get("resources")).get("requests"))
