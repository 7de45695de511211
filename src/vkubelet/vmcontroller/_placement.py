"""A running VM whose template's node selection no longer admits its node moves by itself.

The VM's pod was placed by its template's node selection when it started; the scheduler never
looks again (IgnoredDuringExecution). For a VM, changing the selection is the seed's way of
asking for a migration: when the current node no longer matches, the VirtualMachine reconciler
creates a `VirtualMachineMigration` (visible, named after the VM and the spec generation that
asked for it: one attempt per change, and a restarted controller finds it instead of making
another) to a vm node that does match. When none matches, the VM stays and its condition says
why. `decide_placement` is pure: the VM, its running pod, the nodes and the VM's migrations in,
the condition and the migration to create out.

What "matches" means here is the scheduler's required part: `nodeName`, `nodeSelector`, the
required node-affinity terms, the node's NoSchedule/NoExecute taints against the template's
tolerations; a target must also be Ready and not cordoned. Preferred terms and resources are
left to the target's own admission (a target that cannot start fails the migration, and the VM
stays where it is).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..sdk.scheduling import term_matches, tolerates
from ._base import TERMINAL, template_spec

__all__ = ["NODE_SELECTION_CONDITION", "Placement", "decide_placement", "node_admits"]

NODE_SELECTION_CONDITION: Final = "NodeSelectionMatched"
TRIGGER_ANNOTATION: Final = "vm.vkubelet.io/trigger"  # on a migration the controller made
VM_NODE_CONDITION: Final = "Accelerator"
_BLOCKING: Final = ("NoSchedule", "NoExecute")


@dataclass
class Placement:
    """The `NodeSelectionMatched` condition (status, reason, message) and, maybe, a migration
    manifest to create."""

    status: str
    reason: str
    message: str
    create: dict[str, Any] | None = None


def node_admits(node: Mapping[str, Any], spec: Mapping[str, Any], *, taints: bool = True) -> bool:
    """Whether a pod of `spec` may run on `node` by its required placement (not resources);
    `taints=False`: the selection alone (a NoSchedule taint does not send a running pod away,
    so it never decides that the current node stopped matching)."""
    meta = node.get("metadata") or {}
    name, labels = str(meta.get("name")), dict(meta.get("labels") or {})
    if spec.get("nodeName") and spec["nodeName"] != name:
        return False
    if any(labels.get(k) != str(v) for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms")
    if required and not any(term_matches(t, labels, name) for t in required):
        return False
    if not taints:
        return True
    tolerations = spec.get("tolerations") or []
    return all(
        any(tolerates(t, taint) for t in tolerations)
        for taint in (node.get("spec") or {}).get("taints") or []
        if taint.get("effect") in _BLOCKING
    )


def _usable(node: Mapping[str, Any]) -> bool:
    """A vm node that takes new pods: the provider's condition, Ready, not cordoned."""
    conditions = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []}
    return (
        VM_NODE_CONDITION in conditions
        and (conditions.get("Ready") or {}).get("status") == "True"
        and not (node.get("spec") or {}).get("unschedulable")
    )


def migration_name(vm: Mapping[str, Any]) -> str:
    meta = vm.get("metadata") or {}
    return f"{meta.get('name')}-nodeselection-{meta.get('generation') or 0}"


def decide_placement(
    vm: Mapping[str, Any],
    pod: Mapping[str, Any],
    nodes: Mapping[str, Mapping[str, Any]],
    migrations: Iterable[Mapping[str, Any]],
) -> Placement | None:
    """For the VM's running pod: does its node still match the template's node selection, and
    if not, where to move it. None when there is nothing to say (no node known yet)."""
    meta = vm.get("metadata") or {}
    spec = template_spec(vm)
    here = str((pod.get("spec") or {}).get("nodeName") or "")
    if here not in nodes:
        return None
    if node_admits(nodes[here], spec, taints=False):
        return Placement("True", "Matches", f"node {here} matches the template's node selection")
    vm_name = str(meta.get("name"))
    mine = [m for m in migrations if (m.get("spec") or {}).get("vmName") == vm_name]
    by_name = {str((m.get("metadata") or {}).get("name")): m for m in mine}
    name = migration_name(vm)
    ours = by_name.get(name)
    if ours is not None:
        status = dict(ours.get("status") or {})
        if status.get("phase") == "Failed":
            message = f"the migration {name} to {status.get('targetNode') or '?'} failed: "
            message += str(status.get("message") or status.get("reason") or "")
            return Placement("False", "MigrationFailed", message + f"; the VM stays on {here}")
        target = (ours.get("spec") or {}).get("targetNode")
        return Placement("False", "Migrating", f"moving from {here} to {target} ({name})")
    running = [m for m in mine if (m.get("status") or {}).get("phase") not in TERMINAL]
    if running:  # someone else's migration: let it end first
        other = (running[0].get("metadata") or {}).get("name")
        return Placement("False", "Migrating", f"waiting for the migration {other} to end")
    candidates = sorted(
        n for n, node in nodes.items() if n != here and _usable(node) and node_admits(node, spec)
    )
    if not candidates:
        message = f"node {here} no longer matches the template's node selection, and no other "
        message += "Ready vm node does: the VM stays where it is"
        return Placement("False", "NoMatchingNode", message)
    target = candidates[0]
    create = {
        "apiVersion": "vkubelet.io/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {
            "name": name,
            "namespace": meta.get("namespace"),
            "labels": {"vm.vkubelet.io/name": vm_name},
            "annotations": {TRIGGER_ANNOTATION: "NodeSelection"},
            "ownerReferences": [
                {
                    "apiVersion": "vkubelet.io/v1alpha1",
                    "kind": "VirtualMachine",
                    "name": vm_name,
                    "uid": meta.get("uid"),
                }
            ],
        },
        "spec": {"vmName": vm_name, "targetNode": target},
    }
    return Placement("False", "Migrating", f"moving from {here} to {target} ({name})", create)
