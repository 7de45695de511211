"""Owner stamps: how the provider recognises, in a shared lower cluster, the objects it created.

Every lower object the provider creates carries labels (for cheap server-side selection) and
annotations (the full, readable identity) naming the upper cluster, the virtual node and the upper
object. Every update and delete path asks `is_ours` first, so two upper clusters, or two virtual
nodes of one upper cluster, can share a lower cluster, and the user's own lower objects (which
carry no stamps) are never touched, whatever their names.

A label value holds at most 63 characters, and a node name up to 253, so the owner label is a
hash of (upper cluster, virtual node); `is_ours` then checks the annotations as well, so a hash
collision cannot make another owner's object look like ours.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

__all__ = [
    "ANNOTATION_CLUSTER",
    "ANNOTATION_NAME",
    "ANNOTATION_NAMESPACE",
    "ANNOTATION_NODE",
    "ANNOTATION_UID",
    "LABEL_OWNER",
    "LABEL_UID",
    "Claim",
    "Owner",
    "claim",
    "dependency_name",
    "describe_owner",
    "is_ours",
    "stamp",
    "upper_identity",
]

LABEL_OWNER = "vkubelet.io/owner"
LABEL_UID = "vkubelet.io/upper-uid"
ANNOTATION_CLUSTER = "vkubelet.io/upper-cluster"
ANNOTATION_NODE = "vkubelet.io/virtual-node"
ANNOTATION_NAMESPACE = "vkubelet.io/upper-namespace"
ANNOTATION_NAME = "vkubelet.io/upper-name"
ANNOTATION_UID = "vkubelet.io/upper-uid"
# Keys under our prefix that an upper object may not carry down: they would forge a stamp.
_STAMP_KEYS = {LABEL_OWNER, LABEL_UID, ANNOTATION_CLUSTER, ANNOTATION_NODE}
_STAMP_KEYS |= {ANNOTATION_NAMESPACE, ANNOTATION_NAME, ANNOTATION_UID}

JSON = dict[str, Any]


@dataclass(frozen=True)
class Owner:
    """One virtual node of one upper cluster: the unit that owns lower objects."""

    cluster_id: str
    node_name: str

    @property
    def key(self) -> str:
        """The owner label's value: 20 hex digits, stable across restarts and processes."""
        digest = hashlib.sha256(f"{self.cluster_id}/{self.node_name}".encode()).hexdigest()
        return digest[:20]

    @property
    def selector(self) -> str:
        """A label selector for list/watch of this owner's objects."""
        return f"{LABEL_OWNER}={self.key}"


def stamp(obj: Mapping[str, Any], owner: Owner, *, namespace: str, name: str, uid: str) -> JSON:
    """`obj` with the owner stamps for the upper object (namespace, name, uid) added.

    Stamp keys the upper object carried itself are replaced, never trusted.
    """
    metadata = dict(obj.get("metadata") or {})
    labels = {k: v for k, v in (metadata.get("labels") or {}).items() if k not in _STAMP_KEYS}
    annotations = {
        k: v for k, v in (metadata.get("annotations") or {}).items() if k not in _STAMP_KEYS
    }
    labels[LABEL_OWNER] = owner.key
    if uid:
        labels[LABEL_UID] = uid
    annotations |= {
        ANNOTATION_CLUSTER: owner.cluster_id,
        ANNOTATION_NODE: owner.node_name,
        ANNOTATION_NAMESPACE: namespace,
        ANNOTATION_NAME: name,
        ANNOTATION_UID: uid,
    }
    metadata["labels"] = labels
    metadata["annotations"] = annotations
    return {**obj, "metadata": metadata}


def is_ours(obj: Mapping[str, Any] | None, owner: Owner) -> bool:
    """Whether `obj` carries this owner's stamps (the label and both identity annotations)."""
    if obj is None:
        return False
    metadata = obj.get("metadata") or {}
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    return (
        labels.get(LABEL_OWNER) == owner.key
        and annotations.get(ANNOTATION_CLUSTER) == owner.cluster_id
        and annotations.get(ANNOTATION_NODE) == owner.node_name
    )


def upper_identity(obj: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, name, uid) of the upper object a stamped lower object stands for."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    try:
        return (
            str(annotations[ANNOTATION_NAMESPACE]),
            str(annotations[ANNOTATION_NAME]),
            str(annotations[ANNOTATION_UID]),
        )
    except KeyError:
        return None


def describe_owner(obj: Mapping[str, Any]) -> str:
    """Who owns a lower object, in words, for conflict messages."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    cluster, node = annotations.get(ANNOTATION_CLUSTER), annotations.get(ANNOTATION_NODE)
    if cluster is None or node is None:
        return "not created by vkubelet (the lower cluster's own object)"
    return f"owned by virtual node {node!r} of upper cluster {cluster!r}"


class Claim(Enum):
    """What the provider may do with the lower name an upper object maps to."""

    FREE = "free"  # nothing there: create it
    OURS = "ours"  # ours, for this very upper object: adopt / update it
    STALE = "stale"  # ours, for an earlier upper object of the same name: delete it first
    TAKEN = "taken"  # someone else's: never touch; report a conflict


def claim(existing: Mapping[str, Any] | None, owner: Owner, upper_uid: str | None) -> Claim:
    """Decide over the object found at a lower name. `upper_uid=None` accepts any of our UIDs
    (a dependency shared by name, such as a ConfigMap re-created upstairs)."""
    if existing is None:
        return Claim.FREE
    if not is_ours(existing, owner):
        return Claim.TAKEN
    identity = upper_identity(existing)
    if upper_uid is None or (identity is not None and identity[2] == upper_uid):
        return Claim.OURS
    return Claim.STALE


_MAX_NAME = 253


def dependency_name(owner: Owner, kind: str, name: str, mode: Literal["suffixed", "same"]) -> str:
    """The lower name of an upper ConfigMap, Secret, ServiceAccount or PVC.

    `same` keeps the name (a clash with another owner is reported as a conflict). `suffixed`
    appends 8 hex digits of the owner's key, so two owners never want the same lower name.
    The service account `default` exists in every namespace and is never renamed (nor created).
    """
    if mode == "same" or (kind == "ServiceAccount" and name == "default"):
        return name
    suffix = "-" + owner.key[:8]
    if len(name) + len(suffix) <= _MAX_NAME:
        return name + suffix
    # Too long: cut, and keep the cut-off part distinguishable by a hash of the whole name.
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    head = name[: _MAX_NAME - len(suffix) - len(digest) - 1].rstrip(".-")
    return f"{head}-{digest}{suffix}"
