"""Scheduling constraints meant for the lower cluster, moved out of the upper scheduler's sight
into one versioned annotation (by the constraint webhook) and put back on the lower pod.

In aggregate mode the upper scheduler sees one virtual node, not the lower nodes. A pod that
asks for `disktype: ssd`, a label only some lower nodes carry, fits no upper node and stays
Pending, although the lower cluster could run it. So the webhook moves what only the lower
scheduler can judge into the annotation `vkubelet.io/lower-constraints`, leaves upstairs what
selects virtual nodes, and the provider restores the original when it builds the lower pod.

What *targets virtual nodes* (stays upstairs), decided by key alone:

- label keys (nodeSelector keys, node-affinity expression keys, topology spread
  `topologyKey`): `type` (virtual-kubelet's `type=virtual-kubelet`), `kubernetes.io/hostname`
  and `kubernetes.io/role` (virtual node name and role), `vkubelet.io/*` and
  `virtual-kubelet.io/*`;
- node-affinity `matchFields` (only `metadata.name` exists: upstairs, a virtual node's name);
- taint keys (tolerations): `virtual-kubelet.io/*` (the provider taint), `vkubelet.io/*` (our
  own taints, e.g. the cannot-fit one), `node.kubernetes.io/*` (not-ready, unreachable, ...:
  what the upper node lifecycle puts on the virtual node) and the empty key (operator Exists
  without key tolerates every taint, the virtual node's included);
- plus whatever the provider config's `webhook.keepKeys` patterns add.

Everything else moves: nodeSelector entries, required node-affinity terms, tolerations and topology
spread constraints. Preferred node affinity and pod (anti-)affinity are not touched (soft, or about
pods, not nodes); the lower pod gets them anyway, as it gets everything that stays upstairs.

Required node-affinity terms are ORed, their expressions ANDed: upstairs each term keeps its
virtual-node expressions, and if one term is left empty the upper pod gets no required node
affinity at all (that alternative is met by any node). The annotation keeps the original
required affinity whole.

`restore(move(x)) == x` for every pod as the API returns it (which omits empty maps and lists),
and `move` is idempotent: it restores first, so a reinvoked webhook (other webhooks added
constraints after us) moves exactly what the pod now has. Lists keep their order: a moved item is
recorded with its index.
"""

from __future__ import annotations

import copy
import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...sdk.provider import ProviderError

__all__ = [
    "ANNOTATION",
    "VERSION",
    "ConstraintsError",
    "VirtualKeys",
    "lower_view",
    "move",
    "moved_constraints",
    "restore",
    "set_or_drop",
]

JSON = dict[str, Any]

ANNOTATION = "vkubelet.io/lower-constraints"
VERSION = 1
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
VIRTUAL_LABEL_KEYS = (
    "type",
    "kubernetes.io/hostname",
    "kubernetes.io/role",
    "vkubelet.io/*",
    "virtual-kubelet.io/*",
)
VIRTUAL_TAINT_KEYS = ("", "virtual-kubelet.io/*", "vkubelet.io/*", "node.kubernetes.io/*")
_RECORD_KEYS = {"v", "nodeSelector", "requiredNodeAffinity", "tolerations", "topologySpread"}


class ConstraintsError(ValueError):
    """The annotation cannot be read: the lower pod's constraints are unknown."""


@dataclass(frozen=True)
class VirtualKeys:
    """Which label and taint keys select virtual nodes (shell patterns)."""

    labels: tuple[str, ...] = VIRTUAL_LABEL_KEYS
    taints: tuple[str, ...] = VIRTUAL_TAINT_KEYS

    def with_extra(self, patterns: Sequence[str]) -> VirtualKeys:
        return VirtualKeys((*self.labels, *patterns), (*self.taints, *patterns))

    def label(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) for p in self.labels)

    def taint(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) for p in self.taints)


DEFAULT_KEYS = VirtualKeys()


def move(pod: Mapping[str, Any], keys: VirtualKeys = DEFAULT_KEYS) -> JSON:
    """`pod` with its lower-cluster constraints moved into the annotation (always set, `{"v":1}`
    when nothing moved: it marks the pod as seen by the webhook)."""
    out = copy.deepcopy(dict(restore(pod)))
    record: JSON = {"v": VERSION}
    spec = out.get("spec")
    if isinstance(spec, dict):
        _move_node_selector(spec, keys, record)
        _move_required_affinity(spec, keys, record)
        _move_listed(spec, "tolerations", lambda t: keys.taint(str(t.get("key", ""))), record)
        _move_listed(
            spec,
            "topologySpreadConstraints",
            lambda c: keys.label(str(c.get("topologyKey", ""))),
            record,
            record_key="topologySpread",
        )
    metadata = out.setdefault("metadata", {})
    annotations = metadata.setdefault("annotations", {})
    annotations[ANNOTATION] = json.dumps(record, separators=(",", ":"), sort_keys=True)
    return out


def restore(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """`pod` with the annotation's constraints put back and the annotation removed; `pod`
    itself (not a copy) when it has none. Raises ConstraintsError for an unreadable one."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(ANNOTATION)
    if raw is None:
        return pod
    record = _parse(raw)
    out = copy.deepcopy(dict(pod))
    metadata = out["metadata"]
    del metadata["annotations"][ANNOTATION]
    if not metadata["annotations"]:
        del metadata["annotations"]
    if len(record) == 1:  # only the version: nothing was moved
        return out
    spec = out.setdefault("spec", {})
    if "nodeSelector" in record:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **record["nodeSelector"]}
    if "requiredNodeAffinity" in record:
        affinity = spec.setdefault("affinity", {})
        affinity.setdefault("nodeAffinity", {})[_REQUIRED] = record["requiredNodeAffinity"]
    for field, record_key in (
        ("tolerations", "tolerations"),
        ("topologySpreadConstraints", "topologySpread"),
    ):
        if record_key in record:
            items = list(spec.get(field) or [])
            for at, item in record[record_key]:
                items.insert(at, item)
            spec[field] = items
    return out


def moved_constraints(pod: Mapping[str, Any]) -> JSON | None:
    """The annotation's record (None without one), for messages and checks."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
    return None if raw is None else _parse(raw)


# -- moving ---------------------------------------------------------------------------------


def _move_node_selector(spec: JSON, keys: VirtualKeys, record: JSON) -> None:
    selector = spec.get("nodeSelector")
    if not isinstance(selector, dict):
        return
    moved = {k: v for k, v in selector.items() if not keys.label(k)}
    if not moved:
        return
    record["nodeSelector"] = moved
    set_or_drop(spec, "nodeSelector", {k: v for k, v in selector.items() if k not in moved})


def _move_required_affinity(spec: JSON, keys: VirtualKeys, record: JSON) -> None:
    affinity = spec.get("affinity")
    node_affinity = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    required = node_affinity.get(_REQUIRED) if isinstance(node_affinity, dict) else None
    if not isinstance(required, dict):
        return
    assert isinstance(affinity, dict) and isinstance(node_affinity, dict)
    terms = required.get("nodeSelectorTerms") or []
    kept = [_virtual_part(term, keys) for term in terms]
    if kept == terms:
        return
    record["requiredNodeAffinity"] = required
    if all(kept):
        node_affinity[_REQUIRED] = {**required, "nodeSelectorTerms": kept}
    else:  # a term met by any node: upstairs, the pod is not constrained by node affinity
        del node_affinity[_REQUIRED]
        set_or_drop(affinity, "nodeAffinity", node_affinity)
        set_or_drop(spec, "affinity", affinity)


def _virtual_part(term: Mapping[str, Any], keys: VirtualKeys) -> JSON:
    out = dict(term)
    expressions = term.get("matchExpressions")
    if expressions:
        kept = [e for e in expressions if keys.label(str(e.get("key", "")))]
        set_or_drop(out, "matchExpressions", kept)
    return out


def _move_listed(
    spec: JSON, field: str, stays: Any, record: JSON, *, record_key: str | None = None
) -> None:
    items = spec.get(field)
    if not isinstance(items, list):
        return
    moved = [[at, item] for at, item in enumerate(items) if not stays(item)]
    if not moved:
        return
    record[record_key or field] = moved
    set_or_drop(spec, field, [item for item in items if stays(item)])


def set_or_drop(holder: JSON, key: str, value: Any) -> None:
    if value:
        holder[key] = value
    else:
        holder.pop(key, None)


# -- reading the annotation -----------------------------------------------------------------


def _parse(raw: Any) -> JSON:
    try:
        record = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ConstraintsError(f"{ANNOTATION}: not JSON: {e}") from None
    if not isinstance(record, dict):
        raise ConstraintsError(f"{ANNOTATION}: expected a JSON object")
    if record.get("v") != VERSION:
        raise ConstraintsError(
            f"{ANNOTATION}: version {record.get('v')!r} is unknown (this agent reads version "
            f"{VERSION}); upgrade the agent"
        )
    unknown = sorted(set(record) - _RECORD_KEYS)
    if unknown:
        raise ConstraintsError(f"{ANNOTATION}: unknown field {unknown[0]!r}")
    selector = record.get("nodeSelector", {})
    if not isinstance(selector, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
    ):
        raise ConstraintsError(f"{ANNOTATION}: nodeSelector: expected string keys and values")
    required = record.get("requiredNodeAffinity", {})
    if not isinstance(required, dict):
        raise ConstraintsError(f"{ANNOTATION}: requiredNodeAffinity: expected an object")
    for key in ("tolerations", "topologySpread"):
        items = record.get(key, [])
        if not isinstance(items, list) or not all(_indexed(item) for item in items):
            raise ConstraintsError(f"{ANNOTATION}: {key}: expected a list of [index, object]")
        if [at for at, _ in items] != sorted({at for at, _ in items}):
            raise ConstraintsError(f"{ANNOTATION}: {key}: indexes must ascend")
    return record


def _indexed(item: Any) -> bool:
    return (
        isinstance(item, list)
        and len(item) == 2
        and isinstance(item[0], int)
        and not isinstance(item[0], bool)
        and item[0] >= 0
        and isinstance(item[1], dict)
    )


def lower_view(upper: Mapping[str, Any]) -> Mapping[str, Any]:
    """The upper pod with its moved constraints back, as the lower pod is built from it. An
    unreadable annotation fails the pod: run unconstrained, it could land anywhere below."""
    try:
        return restore(upper)
    except ConstraintsError as e:
        raise ProviderError("LowerConstraintsUnreadable", str(e)) from None
