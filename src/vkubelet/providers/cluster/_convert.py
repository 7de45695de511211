"""JSON <-> lightkube models and small value helpers shared by the provider's modules."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import msgspec
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from ...sdk.clock import now_rfc3339
from ...sdk.quantity import parse_quantity
from ._stamps import ANNOTATION_NAME, ANNOTATION_NAMESPACE, ANNOTATION_NODE, ANNOTATION_UID

__all__ = [
    "JSON",
    "epoch",
    "name_key",
    "newer",
    "newest",
    "now_rfc3339",
    "requests_and_limits",
    "to_json",
    "uid_of",
    "upper_view",
]

JSON = dict[str, Any]


def newest(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Of two pods' copies of one referenced object, the later one: a pod not yet updated
    must not roll a lower copy back to what it saw."""
    if a is None or b is None:
        return a or b

    def version(obj: Mapping[str, Any]) -> int:
        try:
            return int((obj.get("metadata") or {}).get("resourceVersion", "0"))
        except ValueError:
            return 0

    return b if version(b) >= version(a) else a


def requests_and_limits(resources: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """Comparable requests and limits (quantities as the API canonicalises them may differ in
    spelling, "1000m" vs "1", so compare exact values)."""

    def values(section: Mapping[str, Any] | None) -> dict[str, Any]:
        return {k: parse_quantity(v).to_fraction() for k, v in (section or {}).items()}

    resources = resources or {}
    return values(resources.get("requests")), values(resources.get("limits"))


def epoch(timestamp: Any, default: float) -> float:
    """An RFC 3339 time as seconds since the epoch (`default` when missing or unreadable)."""
    try:
        return datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return default


def name_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    metadata = obj.get("metadata") or {}
    return (str(metadata.get("namespace")), str(metadata.get("name")))


def uid_of(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    return str(metadata.get("uid") or f"{metadata.get('namespace')}/{metadata.get('name')}")


def to_json(obj: Any) -> JSON:
    result: JSON = msgspec.to_builtins(obj) if obj is not None else {}
    return result


def upper_view(lower: Mapping[str, Any], status: PodStatus) -> Pod:
    """The upper pod a stamped lower pod stands for, as far as the lower copy tells."""
    annotations = (lower.get("metadata") or {}).get("annotations") or {}
    return msgspec.convert(
        {
            "metadata": {
                "namespace": annotations.get(ANNOTATION_NAMESPACE),
                "name": annotations.get(ANNOTATION_NAME),
                "uid": annotations.get(ANNOTATION_UID),
                "annotations": {
                    k: v for k, v in annotations.items() if not k.startswith("vkubelet.io/upper")
                },
            },
            # The virtual node it was stamped for: the agent deletes an orphan only if provably
            # its own.
            "spec": {
                "nodeName": annotations.get(ANNOTATION_NODE),
                "containers": (lower.get("spec") or {}).get("containers") or [],
            },
            "status": to_json(status),
        },
        Pod,
    )


def newer(obj: Mapping[str, Any], version: str) -> bool:
    """Whether `obj` was written after a list at `version` (a pod created while the list ran
    is missing from it without having vanished). Resource versions are etcd revisions."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion", "0")) > int(version)
    except ValueError:
        return True  # cannot tell: never conclude that a pod vanished
