"""The VirtualMachineMigration reconciler: live migration with plain Kubernetes objects.

A migration is two pods of one VirtualMachine and two annotations (the provider's side is
`providers/vm/_migrate.py`):
1. a target pod, a copy of the VM's running pod with `vm.vkubelet.io/migration-source: <source
   pod>` and the label `vm.vkubelet.io/migration: <migration>`, bound to `spec.targetNode` or,
   without one, left to the scheduler with the pod's own constraints plus "not the source's node";
2. its provider reports the pod condition `vm.vkubelet.io/MigrationTarget` (True, message: the
   endpoint JSON); the reconciler copies that into the source pod's `vm.vkubelet.io/migrate-to`;
3. the source's provider reports `vm.vkubelet.io/Migration` (reason Running/Completed/Failed,
   message JSON with progress, downtime, and the `target` it speaks of); Completed: the source
   pod is deleted (its container already ended, reason `Migrated`), the target is the VM's pod;
   Failed: the target pod is deleted and `migrate-to` removed, the VM runs on at the source.

Level-triggered: `decide` is a pure function of the migration, the VM, its pods and the nodes;
it never relies on memory kept between calls, so a restarted controller resumes (or fails) a
migration from the pods' annotations and conditions. A vm node is a node with the vm
provider's `Accelerator` condition.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..kube import PODS, ObjectRef
from ._base import (
    BACKUP_OF_ANNOTATION,
    MIGRATE_TO_ANNOTATION,
    MIGRATION_SOURCE_ANNOTATION,
    NAME_LABEL,
    TERMINAL,
    Context,
    Watched,
    annotations_of,
    condition_of,
    delete_pod,
    meta_of,
    nodes_by_name,
    patch_pod,
    read,
    require_on_node,
    vm_pods,
    write_status,
)
from ._placement import TRIGGER_ANNOTATION, VM_NODE_CONDITION, node_admits
from ._resources import VirtualMachine, VirtualMachineMigration
from ._vm import ADDRESS_ANNOTATION

__all__ = ["MigrationReconciler", "Step", "decide"]

MIGRATION_LABEL = "vm.vkubelet.io/migration"  # on the target pod: the migration's name
# The per-migration secret: on the target pod from its creation, on the source beside
# `migrate-to`; the target's agent refuses any connection that does not start with it.
MIGRATION_TOKEN = "vm.vkubelet.io/migration-token"  # noqa: S105 - its name, not its value
TARGET_CONDITION = "vm.vkubelet.io/MigrationTarget"
MIGRATION_CONDITION = "vm.vkubelet.io/Migration"
_POLL = 1.0
# The vm provider's waiting reasons for an address it cannot give (`providers/vm/_net`).
ADDRESS_REFUSALS: Final = ("InvalidAddress", "AddressOutOfRange", "AddressInUse")


@dataclass
class Step:
    """What to do now; `status` is merged into the migration's status."""

    status: dict[str, Any] = field(default_factory=dict)
    create: dict[str, Any] | None = None
    annotate: dict[str, dict[str, str | None]] = field(default_factory=dict)  # pod -> patch
    delete: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue: float | None = None


def _json(text: object) -> dict[str, Any]:
    try:
        value = json.loads(str(text))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _node_problem(nodes: Mapping[str, Mapping[str, Any]], name: str, source: str) -> str | None:
    node = nodes.get(name)
    if node is None:
        return f"node {name} does not exist"
    if not _is_vm_node(node):
        return f"node {name} is not a vm node"
    if name == source:
        return f"node {name} already runs the VM"
    return None


def _outside_selection(
    node: Mapping[str, Any], migration: Mapping[str, Any], vm: Mapping[str, Any] | None
) -> str | None:
    """A target outside the VM template's node selection is refused: the VM would run where
    its own spec says it must not, and the node-selection reconciler (`_placement`) would
    move it straight back."""
    if vm is None or annotations_of(migration).get(TRIGGER_ANNOTATION) == "NodeSelection":
        return None
    template = dict(((vm.get("spec") or {}).get("template") or {}).get("spec") or {})
    if node_admits(node, template, taints=False):
        return None
    name = (node.get("metadata") or {}).get("name")
    return (
        f"node {name} does not match the VirtualMachine's node selection"
        " (spec.template.spec nodeName/nodeSelector/required node affinity);"
        " change the template to move the VM there"
    )


def vm_nodes(nodes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The nodes a VM can move to: those the vm provider runs (its node condition)."""
    return sorted(name for name, node in nodes.items() if _is_vm_node(node))


def _is_vm_node(node: Mapping[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == VM_NODE_CONDITION for c in conditions)


def target_pod(
    migration: Mapping[str, Any],
    source: Mapping[str, Any],
    node: str | None,
    candidates: list[str] | None = None,
    template: Mapping[str, Any] | None = None,
) -> Any:
    """A copy of the VM's pod for `node` (None: the scheduler picks among the `candidates`, the
    vm nodes: a pod that tolerates every virtual-kubelet taint could otherwise land on a node of
    another provider; never the source's node)."""
    meta, name = meta_of(source), str(meta_of(migration).get("name"))
    spec = copy.deepcopy(dict(source.get("spec") or {}))
    source_node = spec.pop("nodeName", None)
    # The service account's token volume is the admission plugin's: it adds its own again.
    tokens = {v["name"] for v in spec.get("volumes") or [] if v["name"].startswith("kube-api-")}
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v["name"] not in tokens]
    for container in spec.get("containers") or []:
        mounts = container.get("volumeMounts") or []
        container["volumeMounts"] = [m for m in mounts if m.get("name") not in tokens]
    if node is not None and template is not None:
        # Moved because the template's node selection changed: the target carries the new one
        # (pinned to its node, as the VM reconciler pins a machine), not the one left behind.
        for key in ("nodeSelector", "affinity"):
            spec.pop(key, None)
            if template.get(key):
                spec[key] = copy.deepcopy(template[key])
        pin = {"key": "metadata.name", "operator": "In", "values": [node]}
        require_on_node(spec, "matchFields", [pin])
    if node is not None:
        spec["nodeName"] = node
    elif source_node:
        away = [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [source_node]}]
        if candidates is not None:  # no other vm node: unschedulable, the scheduler says so
            others = [n for n in candidates if n != source_node] or [source_node]
            away.append({"key": "kubernetes.io/hostname", "operator": "In", "values": others})
        require_on_node(spec, "matchExpressions", away)
    annotations = {
        k: v
        for k, v in annotations_of(source).items()
        if k not in (MIGRATE_TO_ANNOTATION, MIGRATION_TOKEN)
    }
    annotations[MIGRATION_SOURCE_ANNOTATION] = str(meta["name"])
    annotations[MIGRATION_TOKEN] = secrets.token_hex(32)
    if ip := (source.get("status") or {}).get("podIP"):
        annotations[ADDRESS_ANNOTATION] = str(ip)  # the guest keeps its address there
    labels = {**(meta.get("labels") or {}), MIGRATION_LABEL: name}
    vm_name = labels.get(NAME_LABEL) or str(meta["name"])
    metadata: dict[str, Any] = {
        "generateName": f"{vm_name}-",
        "namespace": meta.get("namespace"),
        "labels": labels,
        "annotations": annotations,
    }
    if meta.get("ownerReferences"):
        metadata["ownerReferences"] = copy.deepcopy(meta["ownerReferences"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _address_refused(pod: Mapping[str, Any]) -> str | None:
    """The vm provider's refusal of the address a pod asks for (its waiting reason), if any."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ADDRESS_REFUSALS:
            return f"{waiting['reason']}: {waiting.get('message') or ''}".rstrip(": ")
    return None


def _template_placement(
    migration: Mapping[str, Any], vm: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The VM template's pod spec when the migration was made because its node selection
    changed (`_placement`): the target pod takes that selection."""
    if annotations_of(migration).get(TRIGGER_ANNOTATION) != "NodeSelection" or vm is None:
        return None
    return dict(((vm.get("spec") or {}).get("template") or {}).get("spec") or {})


def decide(
    migration: Mapping[str, Any],
    vm: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    nodes: Mapping[str, Mapping[str, Any]],
) -> Step:
    """The next step of `migration`, from the objects alone."""
    name = str(meta_of(migration).get("name"))
    spec, status = dict(migration.get("spec") or {}), dict(migration.get("status") or {})
    live = [p for p in pods if not meta_of(p).get("deletionTimestamp")]
    by_name = {str(meta_of(p).get("name")): p for p in live}
    targets = [p for p in live if (meta_of(p).get("labels") or {}).get(MIGRATION_LABEL) == name]
    target = targets[0] if targets else None
    source = by_name.get(str(status.get("sourcePod") or ""))
    step = Step()

    def fail(reason: str, message: str) -> Step:
        step.status.update(phase="Failed", reason=reason, message=message)
        step.delete += [str(meta_of(t)["name"]) for t in targets]
        if source is not None and MIGRATE_TO_ANNOTATION in annotations_of(source):
            step.annotate[str(meta_of(source)["name"])] = {
                MIGRATE_TO_ANNOTATION: None,
                MIGRATION_TOKEN: None,
            }
        step.events.append(("Warning", reason, message))
        step.requeue = None
        return step

    if status.get("phase") in TERMINAL:
        if status["phase"] == "Failed":  # a target left by an interrupted clean-up
            step.delete += [str(meta_of(t)["name"]) for t in targets]
        return step
    vm_name = str(spec.get("vmName"))
    if vm is None:
        return fail("VMNotFound", f"VirtualMachine {vm_name} does not exist")

    if not status.get("sourcePod") and target is not None:
        # Created by a pass whose status write did not happen: take it up from the target.
        source = by_name.get(annotations_of(target).get(MIGRATION_SOURCE_ANNOTATION, ""))
        if source is None:
            return fail("SourceGone", "the VM's pod went away")
        step.status.update(
            phase="Scheduling",
            sourcePod=meta_of(source)["name"],
            sourceNode=str((source.get("spec") or {}).get("nodeName") or ""),
            targetPod=meta_of(target)["name"],
            progress=0,
        )
        step.requeue = _POLL
        return step
    if not status.get("sourcePod"):  # Pending: start
        running = [
            p
            for p in live
            if (p.get("status") or {}).get("phase") == "Running"
            # a target only while its source lives (a completed one is the VM's pod)
            and annotations_of(p).get(MIGRATION_SOURCE_ANNOTATION) not in by_name
            and BACKUP_OF_ANNOTATION not in annotations_of(p)
        ]
        if not running:
            return fail("VMNotRunning", f"VirtualMachine {vm_name} has no running pod to move")
        source = running[0]
        source_node = str((source.get("spec") or {}).get("nodeName") or "")
        wanted = spec.get("targetNode")
        if wanted and (problem := _node_problem(nodes, str(wanted), source_node)):
            return fail("InvalidTarget", problem)
        if wanted and (problem := _outside_selection(nodes[str(wanted)], migration, vm)):
            return fail("InvalidTarget", problem)
        step.create = target_pod(
            migration,
            source,
            str(wanted) if wanted else None,
            vm_nodes(nodes),
            _template_placement(migration, vm),
        )
        step.status.update(
            phase="Preparing" if wanted else "Scheduling",
            sourcePod=meta_of(source)["name"],
            sourceNode=source_node,
            progress=0,
        )
        if wanted:
            step.status["targetNode"] = wanted
        step.events.append(("Normal", "Migrating", f"from {source_node} to {wanted or '(any)'}"))
        step.requeue = _POLL
        return step

    source_node = str(status.get("sourceNode") or "")
    if target is None:
        if status.get("targetPod"):
            return fail("TargetGone", f"the target pod {status['targetPod']} went away")
        if source is None:
            return fail("SourceGone", f"the source pod {status['sourcePod']} went away")
        step.create = target_pod(
            migration,
            source,
            spec.get("targetNode"),
            vm_nodes(nodes),
            _template_placement(migration, vm),
        )
        step.requeue = _POLL
        return step
    target_name = str(meta_of(target)["name"])
    step.status["targetPod"] = target_name
    ready = condition_of(target, TARGET_CONDITION)
    endpoint = _json(ready.get("message")) if ready.get("status") == "True" else {}
    # The source's outcome is this migration's when we annotated it (our name beside the
    # endpoint) and the condition speaks of that endpoint: never an earlier migration's.
    given = annotations_of(source or {})
    sent = _json(given.get(MIGRATE_TO_ANNOTATION)) if given.get(MIGRATION_LABEL) == name else {}
    outcome = condition_of(source, MIGRATION_CONDITION)
    report = _json(outcome.get("message"))
    ours = bool(sent) and report.get("target") == f"{sent.get('host')}:{sent.get('migrationPort')}"

    if source is None:
        # Completed and already deleted (by the VM reconciler, say): the target says so.
        if ready.get("reason") == "Completed":
            step.status.update(phase="Succeeded", progress=100, reason="Completed", message="")
            step.events.append(("Normal", "Migrated", f"the VM runs on {status.get('targetNode')}"))
            return step
        return fail("SourceGone", f"the source pod {status['sourcePod']} went away")
    sending = ours and outcome.get("reason") == "Running"  # (finishing: the history)
    arrived = ready.get("reason") == "Completed" and not sending
    if arrived or (ours and outcome.get("reason") == "Completed"):
        # The target's word that the guest runs there is final (a source whose agent or QEMU
        # went away mid-way may say Failed; it never runs the guest again after a switchover).
        step.status.update(
            phase="Succeeded",
            progress=100,
            downtimeMilliseconds=int(report.get("downtimeMilliseconds", 0)),
            totalMilliseconds=int(report.get("totalMilliseconds", 0)),
            reason="Completed",
            message="",
        )
        step.delete.append(str(status["sourcePod"]))
        step.events.append(("Normal", "Migrated", outcome.get("message") or ""))
        return step
    if ours and outcome.get("reason") == "Failed":
        return fail("MigrationFailed", str(report.get("error") or "the migration failed"))

    node = (target.get("spec") or {}).get("nodeName")
    if not node:
        scheduled = condition_of(target, "PodScheduled")
        if scheduled.get("reason") == "Unschedulable":
            message = f"no vm node can take the VM: {scheduled.get('message', '')}"
            return fail("Unschedulable", message)
        step.status["phase"] = "Scheduling"
        step.requeue = _POLL
        return step
    if problem := _node_problem(nodes, str(node), source_node):
        return fail("InvalidTarget", problem)
    step.status["targetNode"] = node
    if ready.get("reason") == "Failed":
        return fail("TargetFailed", str(ready.get("message") or "the target failed"))
    if (refused := _address_refused(target)) is not None:
        return fail("AddressRefused", f"node {node} cannot take the VM's address: {refused}")
    if (target.get("status") or {}).get("phase") in TERMINAL:
        return fail("TargetFailed", f"the target pod {target_name} ended")
    if not endpoint:
        step.status["phase"] = "Preparing"
        step.requeue = _POLL
        return step
    step.status["phase"] = "Migrating"
    if annotations_of(source).get(MIGRATE_TO_ANNOTATION) != ready["message"]:
        step.annotate[str(status["sourcePod"])] = {
            MIGRATE_TO_ANNOTATION: str(ready["message"]),
            MIGRATION_LABEL: name,
            MIGRATION_TOKEN: annotations_of(target).get(MIGRATION_TOKEN),
        }
    elif ours:
        step.status["progress"] = int(report.get("progress", 0))
    step.requeue = _POLL
    return step


class MigrationReconciler:
    """`decide`, applied: reads the objects, takes the step, writes the status."""

    resource = VirtualMachineMigration

    def keys_for_pod(self, pod: Watched) -> Iterable[tuple[str, str]]:
        meta = pod.metadata
        name = (meta.labels or {}).get(MIGRATION_LABEL) or (meta.annotations or {}).get(
            MIGRATION_LABEL
        )
        if name:
            yield str(meta.namespace), name

    async def reconcile(self, ctx: Context, namespace: str, name: str) -> float | None:
        migration = await read(ctx, VirtualMachineMigration, name, namespace)
        if migration is None:
            return None
        vm_name = str((migration.get("spec") or {}).get("vmName"))
        vm = await read(ctx, VirtualMachine, vm_name, namespace)
        pods = await vm_pods(ctx, namespace, vm_name)
        step = decide(migration, vm, pods, await nodes_by_name(ctx))
        obj = ObjectRef.of(migration)
        if step.create is not None:
            created = await ctx.client.create(PODS.path(namespace), step.create)
            step.status["targetPod"] = created["metadata"]["name"]
        for pod, changes in step.annotate.items():
            await patch_pod(ctx, namespace, pod, {"metadata": {"annotations": changes}})
        for pod in step.delete:
            await delete_pod(ctx, namespace, pod)
        await write_status(ctx, VirtualMachineMigration, migration, step.status)
        for kind, reason, message in step.events:
            ctx.events.emit(obj, kind, reason, message)
        return step.requeue
