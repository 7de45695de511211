"""Which ConfigMaps, Secrets, ServiceAccounts and PVCs must exist below, from the pods upstairs.

Pure: from the upper pods this virtual node runs, the upper objects they reference (as the agent
hands them over in `ResolvedPod.references`) and the lower objects found at the relevant names,
a plan of what to create, update, replace and delete. Reference counting is implicit: a lower
copy is wanted while at least one non-terminal pod of this node references it, and the plan is
recomputed from scratch each time, so a count can never drift.

Only objects carrying this owner's stamps are ever updated or deleted; a lower name held by
anyone else is a conflict, reported and left alone. PVCs hold data: an unused lower PVC is only
*released* (the provider deletes it once the upper PVC itself is gone), never deleted because a
StatefulSet pod is between two lives. Secrets of type service-account-token are never copied:
they are upper credentials.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._refs import Reference
from ._stamps import Claim, claim, describe_owner, is_ours, stamp
from ._status import copy_of
from ._tokens import ROLE_LABEL, is_token_secret
from ._translate import PodTranslation, needed_references

__all__ = [
    "KINDS",
    "SOURCE_VERSION",
    "Conflict",
    "DependencyPlan",
    "Key",
    "Missing",
    "lower_copy",
    "plan_dependencies",
]

JSON = dict[str, Any]
Key = tuple[str, str, str]  # (kind, namespace, name)
KINDS = ("ConfigMap", "Secret", "ServiceAccount", "PersistentVolumeClaim")
# The upper object's resourceVersion the lower copy was made from: a copy is rewritten only when
# the upper object changed (no content hash of a Secret is ever written anywhere).
SOURCE_VERSION = "vkubelet.io/upper-resource-version"
_SA_TOKEN = "kubernetes.io/service-account-token"  # noqa: S105  (a type, not a secret)
_TERMINAL = {"Succeeded", "Failed"}


@dataclass(frozen=True)
class Missing:
    """A required upper object that does not exist (yet): the pods that need it wait."""

    key: Key
    pods: tuple[str, ...]


@dataclass(frozen=True)
class Conflict:
    """A lower name this owner needs is held by someone else."""

    key: Key  # lower (kind, namespace, name)
    upper: Key
    message: str


@dataclass
class DependencyPlan:
    namespaces: set[str] = field(default_factory=set)
    create: list[JSON] = field(default_factory=list)
    update: list[JSON] = field(default_factory=list)  # desired objects, resourceVersion set
    replace: list[JSON] = field(default_factory=list)  # immutable or retyped: delete, create
    delete: list[Key] = field(default_factory=list)
    release: list[Key] = field(default_factory=list)  # unused PVCs; delete once gone upstairs
    # UIDs of the lower objects in `delete`, `release` and `replace`: deletes are made with a
    # UID precondition, so an object re-created by someone else meanwhile is never removed.
    uids: dict[Key, str] = field(default_factory=dict)
    missing: list[Missing] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    refused: list[tuple[Key, str]] = field(default_factory=list)
    # upper pod "namespace/name" -> why it cannot start yet (missing, conflict, refused)
    blocked: dict[str, str] = field(default_factory=dict)


def plan_dependencies(
    pods: Iterable[Mapping[str, Any]],
    references: Mapping[Key, Mapping[str, Any] | None],
    lower: Mapping[Key, Mapping[str, Any]],
    how: PodTranslation,
    *,
    pvc_storage_class: str | None = None,
    needed: Mapping[str, Iterable[Reference]] | None = None,
) -> DependencyPlan:
    """`lower` holds the lower objects at the names the pods map to, plus every lower object of
    these kinds carrying this owner's stamps (the provider lists them by the owner label).
    `needed` may give `needed_references` of pods ("namespace/name") already worked out: the
    provider plans on every pod start, and re-deriving them for every running pod each time
    made a burst quadratic."""
    plan = DependencyPlan()
    users: dict[Key, list[str]] = defaultdict(list)  # upper key -> pods using it
    required: set[Key] = set()
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in _TERMINAL:
            continue
        metadata = pod.get("metadata") or {}
        namespace = str(metadata.get("namespace", "default"))
        pod_name = f"{namespace}/{metadata.get('name')}"
        plan.namespaces.add(how.lower_namespace(namespace))
        known = None if needed is None else needed.get(pod_name)
        for ref in needed_references(pod, how) if known is None else known:
            if ref.kind == "ServiceAccount" and ref.name == "default":
                continue  # the lower namespace's own account
            key = (ref.kind, namespace, ref.name)
            users[key].append(pod_name)
            if not ref.optional:
                required.add(key)
    wanted: set[Key] = set()
    for key, pod_names in sorted(users.items()):
        kind, namespace, name = key
        lower_key = (kind, how.lower_namespace(namespace), how.lower_name(kind, name))
        source = references.get(key)
        if source is None:
            if key in required:
                plan.missing.append(Missing(key, tuple(pod_names)))
                for pod_name in pod_names:
                    plan.blocked.setdefault(pod_name, f"{kind} {namespace}/{name} not found")
            continue
        if kind == "Secret" and source.get("type") == _SA_TOKEN:
            why = (
                f"Secret {namespace}/{name} is a service-account token of the upper cluster; "
                "it is never copied to the lower cluster"
            )
            plan.refused.append((key, why))
            for pod_name in pod_names:
                plan.blocked.setdefault(pod_name, why)
            continue
        wanted.add(lower_key)
        existing = lower.get(lower_key)
        desired = lower_copy(source, how, key=key, pvc_storage_class=pvc_storage_class)
        # A claim is its data: one re-created upstairs (another UID) is a new, empty volume,
        # never the old claim's copy below. Other kinds are shared by name.
        upper_uid = str(metadata_of(source).get("uid") or "") or None
        verdict = claim(existing, how.owner, upper_uid if kind == "PersistentVolumeClaim" else None)
        if verdict is Claim.TAKEN:
            assert existing is not None
            message = (
                f"lower {kind} {lower_key[1]}/{lower_key[2]} already exists and is "
                f"{describe_owner(existing)}; it is left alone"
            )
            plan.conflicts.append(Conflict(lower_key, key, message))
            for pod_name in pod_names:
                plan.blocked.setdefault(pod_name, message)
        elif verdict is Claim.FREE:
            plan.create.append(desired)
        elif verdict is Claim.STALE:
            assert existing is not None
            plan.replace.append(desired)
            plan.uids[lower_key] = str(metadata_of(existing).get("uid", ""))
        else:
            assert existing is not None
            _plan_change(plan, kind, existing, desired)
    for lower_key, obj in sorted(lower.items()):
        if lower_key in wanted or lower_key[0] not in KINDS or not is_ours(obj, how.owner):
            continue
        if is_token_secret(obj):
            continue  # a pod's upper tokens: kept and removed with the pod (`_tokens`)
        (plan.release if lower_key[0] == "PersistentVolumeClaim" else plan.delete).append(lower_key)
        plan.uids[lower_key] = str((obj.get("metadata") or {}).get("uid", ""))
    return plan


def metadata_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _plan_change(
    plan: DependencyPlan, kind: str, existing: Mapping[str, Any], desired: JSON
) -> None:
    version = ((existing.get("metadata") or {}).get("annotations") or {}).get(SOURCE_VERSION)
    if version == desired["metadata"]["annotations"][SOURCE_VERSION]:
        return
    if kind == "PersistentVolumeClaim":
        return  # a claim's spec is (mostly) immutable; a bound claim is never rewritten
    retyped = kind == "Secret" and existing.get("type", "Opaque") != desired.get("type", "Opaque")
    if existing.get("immutable") or retyped:
        plan.replace.append(desired)
        metadata = desired["metadata"]
        key = (kind, str(metadata["namespace"]), str(metadata["name"]))
        plan.uids[key] = str((existing.get("metadata") or {}).get("uid", ""))
        return
    desired["metadata"]["resourceVersion"] = (existing.get("metadata") or {}).get("resourceVersion")
    plan.update.append(desired)


def lower_copy(
    source: Mapping[str, Any],
    how: PodTranslation,
    *,
    key: Key | None = None,
    pvc_storage_class: str | None = None,
) -> JSON:
    """The stamped lower copy of an upper ConfigMap, Secret, ServiceAccount or PVC.

    `key` says what it is: objects from a list or watch carry no `kind` of their own."""
    metadata = source.get("metadata") or {}
    kind, namespace, name = key or (
        str(source.get("kind")),
        str(metadata.get("namespace")),
        str(metadata.get("name")),
    )
    body: JSON = {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {
            "name": how.lower_name(kind, name),
            "namespace": how.lower_namespace(namespace),
            # Our own role label is not copied: a copy is never taken for a token Secret.
            "labels": {k: v for k, v in (metadata.get("labels") or {}).items() if k != ROLE_LABEL},
            "annotations": {SOURCE_VERSION: str(metadata.get("resourceVersion", ""))},
        },
    }
    if kind in ("ConfigMap", "Secret"):
        for field_name in ("data", "binaryData", "immutable", "type"):
            if field_name in source:
                body[field_name] = copy_of(source[field_name])
    elif kind == "ServiceAccount":
        if "automountServiceAccountToken" in source:
            body["automountServiceAccountToken"] = source["automountServiceAccountToken"]
    elif kind == "PersistentVolumeClaim":
        spec = source.get("spec") or {}
        lower_spec: JSON = {
            "accessModes": copy_of(spec.get("accessModes") or ["ReadWriteOnce"]),
            "resources": {"requests": copy_of((spec.get("resources") or {}).get("requests") or {})},
        }
        if "volumeMode" in spec:
            lower_spec["volumeMode"] = spec["volumeMode"]
        storage_class = (
            spec.get("storageClassName") if pvc_storage_class is None else pvc_storage_class
        )
        if storage_class:
            lower_spec["storageClassName"] = storage_class
        body["spec"] = lower_spec
    stamped = stamp(
        body, how.owner, namespace=namespace, name=name, uid=str(metadata.get("uid", ""))
    )
    return stamped
