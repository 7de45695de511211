"""The VirtualMachine reconciler: replicas 1 = one pod made from the template, 0 = none.

The decision (`decide`) is pure: from the VirtualMachine and the pods labelled with its name
it says what to create, annotate, delete and patch, and what the status is. `reconcile` reads
those objects from the apiserver (a quorum read each time, never a cache), applies the
decision and writes the status.

Never two pods of one VM: a pod is created only when the VM has none at all, terminating ones
included (the old QEMU must have stopped before another opens the same disks), and the list
comes from the apiserver right before the create. A controller restarted between a create and
its status write finds the pod on its next pass and does not create another; the Lease makes
sure only one controller acts.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from ..kube import PODS, STRATEGIC_MERGE_PATCH, ApiError, ObjectRef
from ..sdk.backoff import go_duration
from ..sdk.quantity import QuantityError, parse_quantity
from ._backup import RestoreError, restore_path
from ._base import (
    BACKUP_OF_ANNOTATION,
    MACHINE_ANNOTATION,
    MIGRATE_TO_ANNOTATION,
    MIGRATION_SOURCE_ANNOTATION,
    NAME_LABEL,
    POWER_OFF_ANNOTATION,
    ROOT_DISK_SIZE_ANNOTATION,
    Context,
    Watched,
    annotations_of,
    condition_of,
    controller_ref,
    delete_pod,
    meta_of,
    nodes_by_name,
    patch_pod,
    read,
    require_on_node,
    template_spec,
    vm_pods,
    write_status,
)
from ._placement import NODE_SELECTION_CONDITION, decide_placement
from ._powerbackoff import delay_for, failure_of, parse_time, ran_long_enough, stamp
from ._resources import VirtualMachine, VirtualMachineMigration

__all__ = ["Decision", "VirtualMachineReconciler", "decide", "pod_for"]

log = logging.getLogger(__name__)

# The root disk size names the provider reads at creation (ours first, then virtlet's).
ROOT_SIZE_KEYS: Final = (
    ROOT_DISK_SIZE_ANNOTATION,
    "vm.vkubelet.io/root-size",
    "VirtletRootVolumeSize",
)
RESTORE_FROM_ANNOTATION: Final = "vm.vkubelet.io/restore-from"
# The address a VM's pod asks the vm provider for: the VM keeps its address (status.ip).
ADDRESS_ANNOTATION: Final = "vm.vkubelet.io/address"
# An imported libvirt domain the pod runs as (`spec.importDomain`), and what deleting the VM
# does to it: the vm provider's `_domainimport` reads them.
DOMAIN_ANNOTATION: Final = "vm.vkubelet.io/domain"
DOMAIN_DELETION_POLICY_ANNOTATION: Final = "vm.vkubelet.io/domain-deletion-policy"
_UNSETTLED_REQUEUE: Final = 5.0  # while starting or stopping: look again (the watch may lag)
_FAILED_REQUEUE: Final = 30.0


@dataclass
class Decision:
    create: dict[str, Any] | None = None  # a pod manifest
    power_off: dict[str, str] = field(default_factory=dict)  # pod -> mode, then delete it
    delete: list[str] = field(default_factory=list)  # pods to delete as they are
    patch: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod -> metadata patch
    resize: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod -> pods/resize patch
    status: dict[str, Any] = field(default_factory=dict)
    requeue: float | None = None
    event: tuple[str, str, str] | None = None  # (type, reason, message), once per decision


def root_size(annotations: Mapping[str, str]) -> str | None:
    for key in ROOT_SIZE_KEYS:
        if annotations.get(key):
            return annotations[key]
    return None


def _template(vm: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    template = dict((vm.get("spec") or {}).get("template") or {})
    return dict(template.get("metadata") or {}), template_spec(vm)


def desired_labels(vm: Mapping[str, Any]) -> dict[str, str]:
    tmeta, _ = _template(vm)
    return {**(tmeta.get("labels") or {}), NAME_LABEL: str(meta_of(vm)["name"])}


def pod_for(vm: Mapping[str, Any]) -> dict[str, Any]:
    """The VM's pod: the template, named `<vm>-<random>`, owned by and labelled with the VM,
    annotated with the machine (the VM's uid: the provider keeps its disks under it), the
    imported domain it runs as if any (`spec.importDomain`), and with the VM's address
    (status.ip, kept across power cycles: its guest, Services' endpoints and whoever
    remembers it expect it; a template that names an address itself wins)."""
    meta = meta_of(vm)
    tmeta, tspec = _template(vm)
    annotations = {**(tmeta.get("annotations") or {}), MACHINE_ANNOTATION: str(meta["uid"])}
    if ip := (vm.get("status") or {}).get("ip"):
        annotations.setdefault(ADDRESS_ANNOTATION, str(ip))
    if (size := root_size(annotations)) is not None:
        annotations[ROOT_DISK_SIZE_ANNOTATION] = size
        annotations["vm.vkubelet.io/root-size"] = size
    if imported := (vm.get("spec") or {}).get("importDomain"):
        # The controller's word wins over the template's: the domain is the VM's own.
        annotations[DOMAIN_ANNOTATION] = str(imported["name"])
        policy = str(imported.get("deletionPolicy") or "Retain")
        annotations[DOMAIN_DELETION_POLICY_ANNOTATION] = policy
    restore = (vm.get("spec") or {}).get("restoreFrom") or {}
    if restore.get("backup") and not (vm.get("status") or {}).get("machineNode"):
        # Only the first power-on restores: later ones boot the machine's own disks. The name
        # is resolved to the backup's path by the backup reconciler's `restore_path`.
        annotations[RESTORE_FROM_ANNOTATION] = str(restore["backup"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{meta['name']}-",
            "namespace": meta.get("namespace"),
            "labels": desired_labels(vm),
            "annotations": annotations,
            "ownerReferences": [controller_ref("VirtualMachine", vm)],
        },
        "spec": _pinned(copy.deepcopy(tspec), (vm.get("status") or {}).get("machineNode")),
    }


def _pinned(spec: dict[str, Any], node: str | None) -> dict[str, Any]:
    """The pod spec, required to run on `node` (where the machine's disks are) unless the
    template names a node itself: a power-on elsewhere would start from fresh disks. The pin is
    ANDed into every node-affinity term the template has."""
    if not node or spec.get("nodeName"):
        return spec
    pin = {"key": "metadata.name", "operator": "In", "values": [node]}
    require_on_node(spec, "matchFields", [pin])
    return spec


def _owned(vm: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    uid = meta_of(vm).get("uid")
    refs = meta_of(pod).get("ownerReferences") or []
    if any(ref.get("uid") == uid for ref in refs):
        return True
    return annotations_of(pod).get(MACHINE_ANNOTATION) == uid


def _container_state(pod: Mapping[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return dict((statuses[0] if statuses else {}).get("state") or {})


def _runtime_of(pod: Mapping[str, Any] | None) -> str | None:
    """The runtime the VM runs on (qemu, libvirt): its container ID's scheme, as a kubelet's
    `containerd://...` names its runtime."""
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    container_id = (statuses[0] if statuses else {}).get("containerID") or ""
    scheme, found, _ = str(container_id).partition("://")
    return scheme if found and scheme else None


def _resources(spec: Mapping[str, Any]) -> tuple[str, dict[str, dict[str, str]]] | None:
    """(container name, its cpu/memory requests and limits) of a pod spec; requests default to
    the limits, as the apiserver defaults them."""
    containers = spec.get("containers") or []
    if not containers:
        return None
    resources = containers[0].get("resources") or {}
    picked = {
        kind: {k: str(v) for k, v in (resources.get(kind) or {}).items() if k in ("cpu", "memory")}
        for kind in ("requests", "limits")
    }
    for key, value in picked["limits"].items():
        picked["requests"].setdefault(key, value)
    return str(containers[0].get("name")), picked


def _same(a: str | None, b: str | None) -> bool:
    """Two quantities equal in value ("1024Mi" is "1Gi": the apiserver rewrites them)."""
    if a is None or b is None:
        return a == b
    try:
        return parse_quantity(a).to_fraction() == parse_quantity(b).to_fraction()
    except QuantityError:
        return a == b


def _resize_needed(want: dict[str, dict[str, str]], have: dict[str, dict[str, str]]) -> bool:
    """Whether a value the template sets differs from the pod's (what it leaves out is kept)."""
    return any(
        not _same(value, have[kind].get(key)) for kind in want for key, value in want[kind].items()
    )


def _sort_key(pod: Mapping[str, Any]) -> tuple[bool, str, str]:
    """The pod to keep when (through some accident) there are several: a running one first,
    then the oldest."""
    running = "running" in _container_state(pod)
    meta = meta_of(pod)
    return (not running, str(meta.get("creationTimestamp") or ""), str(meta.get("name")))


def _phase_of(pod: Mapping[str, Any]) -> str:
    if (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
        return "Failed"
    if annotations_of(pod).get(MIGRATE_TO_ANNOTATION):
        return "Migrating"
    return "Running" if "running" in _container_state(pod) else "Starting"


def _unscheduled(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The scheduler's reason a pod has no node yet (e.g. no vm node fits), if it gave one."""
    condition = condition_of(pod, "PodScheduled")
    if condition.get("status") != "False":
        return None
    return {**condition, "reason": condition.get("reason") or "Unschedulable"}


def _condition(
    old: Iterable[Mapping[str, Any]],
    type: str,
    status: str,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    """A condition keeping its lastTransitionTime while its status does not change."""
    previous = next((c for c in old if c.get("type") == type), None)
    since = now
    if previous is not None and previous.get("status") == status:
        since = previous.get("lastTransitionTime") or now
    condition: dict[str, Any] = {"type": type, "status": status, "lastTransitionTime": since}
    if reason:
        condition["reason"] = reason
    if message:
        condition["message"] = message
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def decide(
    vm: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    *,
    failure: tuple[str, str] | None = None,
    now: datetime | None = None,
) -> Decision:
    """What to do for `vm` given the pods carrying its name label (`failure`: the reason and
    message of this pass's failed create, for the status)."""
    now = now or datetime.now(UTC)
    now_stamp = stamp(now)
    meta, spec = meta_of(vm), dict(vm.get("spec") or {})
    old_status = dict(vm.get("status") or {})
    generation = meta.get("generation")
    replicas = int(spec.get("replicas", 1))
    mode = str(spec.get("powerOffMode") or "Shutdown")
    decision = Decision()
    if meta.get("deletionTimestamp"):
        return decision  # the garbage collector deletes the pods (owner references)

    own = [p for p in pods if _owned(vm, p) and BACKUP_OF_ANNOTATION not in annotations_of(p)]
    terminating = [p for p in own if meta_of(p).get("deletionTimestamp")]
    live = [p for p in own if not meta_of(p).get("deletionTimestamp")]
    live_names = {meta_of(p).get("name") for p in live}
    # A migration target is the migration reconciler's while its source pod lives.
    targets = [p for p in live if annotations_of(p).get(MIGRATION_SOURCE_ANNOTATION) in live_names]
    finished = [
        p
        for p in live
        if p not in targets and (p.get("status") or {}).get("phase") in ("Failed", "Succeeded")
    ]
    # An ended source of a live target (its QEMU died mid-migration) is the migration
    # reconciler's too: whether the guest arrived decides which pod goes, and which node keeps
    # the machine (status.machineNode); deleting it here would make the target the VM's pod.
    sources = {annotations_of(p).get(MIGRATION_SOURCE_ANNOTATION) for p in targets}
    held = [p for p in finished if meta_of(p).get("name") in sources]
    terminal = [p for p in finished if p not in held]
    active = sorted((p for p in live if p not in targets and p not in finished), key=_sort_key)
    last_power_off = old_status.get("lastPowerOff")
    for pod in terminating:  # the provider's word on how the power-off went, while visible
        ended = _container_state(pod).get("terminated") or {}
        if ended.get("reason") == "Hibernated":
            last_power_off = "Hibernate"
        elif ended.get("reason") == "HibernateFailed":
            last_power_off = "Shutdown"  # the state could not be saved: it shut down instead

    # The power-on back-off (`_powerbackoff`): kept in the status, so it outlives the controller.
    restarts = int(old_status.get("restarts") or 0)
    last_failure = dict(old_status.get("lastFailure") or {})
    next_start = parse_time(old_status.get("nextStartAfter"))
    if replicas == 0 or (last_failure and last_failure.get("observedGeneration") != generation):
        restarts, next_start = 0, None  # stopped, or the spec changed: the next power-on is now
    backing_off = False
    if replicas == 0:
        for pod in active:
            decision.power_off[str(meta_of(pod)["name"])] = mode
            last_power_off = mode
        decision.delete += [str(meta_of(p)["name"]) for p in targets + terminal]
        kept = None
    else:
        kept = active[0] if active else None
        failed = max(
            terminal, key=lambda p: str(meta_of(p).get("creationTimestamp") or ""), default=None
        )
        if (
            kept is None
            and failed is not None
            and meta_of(failed).get("name") != last_failure.get("podName")
        ):
            restarts = 1 if ran_long_enough(failed, now) else restarts + 1
            delay = delay_for(restarts)
            reason, message = failure_of(failed)
            last_failure = {
                "podName": meta_of(failed).get("name"),
                "reason": reason,
                "message": message,
                "time": now_stamp,
                "observedGeneration": generation,
            }
            next_start = now + delay
            decision.event = (
                "Warning",
                "BackOff",
                f"back-off {go_duration(delay.total_seconds())} powering on VirtualMachine "
                f"{meta.get('name')}: {reason}: {message}",
            )
        backing_off = kept is None and next_start is not None and now < next_start
        if backing_off:
            assert next_start is not None
            # The failed pod stays until then: `kubectl get pods` shows why.
            decision.requeue = max((next_start - now).total_seconds(), 0.5)
        else:
            next_start = None
            decision.delete += [str(meta_of(p)["name"]) for p in terminal]
            if not own and failure is None:
                decision.create = pod_for(vm)
        for extra in active[1:]:  # never two: keep the running (or oldest) one
            decision.power_off[str(meta_of(extra)["name"])] = "Shutdown"
        if kept is not None:
            _sync(vm, kept, decision)

    # -- status --
    if kept is not None:
        phase = "Migrating" if targets else _phase_of(kept)
    elif held and replicas:
        phase = "Migrating"
    elif (active and replicas == 0) or terminating:
        phase = "Stopping"
    elif replicas == 0:
        phase = "Hibernated" if last_power_off == "Hibernate" else "Stopped"
    elif failure is not None or terminal or backing_off:
        phase = "Failed"
    else:
        phase = "Starting"
    pod_status = dict((kept or {}).get("status") or {})
    conditions = old_status.get("conditions") or []
    ready = condition_of(kept, "Ready")
    if ready:
        ready_condition = _condition(
            conditions,
            "Ready",
            str(ready.get("status")),
            str(ready.get("reason") or ""),
            str(ready.get("message") or ""),
            generation,
            now_stamp,
        )
    else:
        why = {"Stopped": "PoweredOff", "Hibernated": "Hibernated"}.get(phase, phase)
        ready_condition = _condition(conditions, "Ready", "False", why, "", generation, now_stamp)
    if phase == "Failed" and failure is None and last_failure.get("reason"):
        # The failed pod's words, not just "Failed", while the VM waits to power on again.
        ready_condition["reason"] = str(last_failure["reason"])
        if last_failure.get("message"):
            ready_condition["message"] = str(last_failure["message"])
    waiting = _container_state(kept or {}).get("waiting") or {}
    unscheduled = _unscheduled(kept or {})
    why_not = unscheduled or (waiting if waiting.get("reason") else None)
    if why_not and ready_condition["status"] != "True":
        ready_condition["reason"] = why_not["reason"]
        if why_not.get("message"):
            ready_condition["message"] = str(why_not["message"])[:512]
    new_conditions = [ready_condition]
    if failure is not None:
        reason, message = failure
        new_conditions.append(
            _condition(conditions, "Synced", "False", reason, message, generation, now_stamp)
        )
    else:
        new_conditions.append(
            _condition(conditions, "Synced", "True", "", "", generation, now_stamp)
        )
    kept_meta = meta_of(kept or {})
    decision.status = {
        "phase": phase,
        "nodeName": ((kept or {}).get("spec") or {}).get("nodeName") or None,
        "ip": pod_status.get("podIP") or old_status.get("ip") or None,  # kept while off
        "podName": kept_meta.get("name") or None,
        "machine": meta.get("uid"),
        "machineNode": next(
            (
                p["spec"]["nodeName"]
                for p in ([kept] if kept else []) + active + terminating
                if (p.get("spec") or {}).get("nodeName")
            ),
            old_status.get("machineNode"),
        ),
        "runtime": _runtime_of(kept) or old_status.get("runtime"),  # kept while off
        "observedGeneration": generation,
        "replicas": len(active),
        "selector": f"{NAME_LABEL}={meta.get('name')}",
        "lastPowerOff": last_power_off,
        "restarts": restarts,
        "lastFailure": last_failure or None,
        "nextStartAfter": stamp(next_start) if next_start else None,
        "conditions": new_conditions,
    }
    if backing_off:
        pass  # the requeue is the rest of the back-off
    elif phase in ("Starting", "Stopping", "Migrating") or decision.create or decision.power_off:
        decision.requeue = _UNSETTLED_REQUEUE
    elif failure is not None:
        decision.requeue = _FAILED_REQUEUE
    return decision


def _sync(vm: Mapping[str, Any], pod: Mapping[str, Any], decision: Decision) -> None:
    """Carry template changes to the running pod: labels (Services select VMs by them), the
    root disk size (an annotation the provider grows the disk from) and CPU/memory (the
    `pods/resize` subresource, Kubernetes' in-place resize). Other template changes apply at
    the next power-on."""
    name = str(meta_of(pod)["name"])
    labels = dict(meta_of(pod).get("labels") or {})
    wanted = desired_labels(vm)
    patch_labels: dict[str, str | None] = {k: v for k, v in wanted.items() if labels.get(k) != v}
    patch_labels.update({k: None for k in labels if k not in wanted})
    patch: dict[str, Any] = {}
    if patch_labels:
        patch["labels"] = patch_labels
    tmeta, tspec = _template(vm)
    size = root_size(dict(tmeta.get("annotations") or {}))
    annotations = annotations_of(pod)
    if size is not None and annotations.get(ROOT_DISK_SIZE_ANNOTATION) != size:
        patch["annotations"] = {ROOT_DISK_SIZE_ANNOTATION: size, "vm.vkubelet.io/root-size": size}
    if patch:
        decision.patch[name] = {"metadata": patch}
    want, have = _resources(tspec), _resources(dict(pod.get("spec") or {}))
    if (
        want is not None
        and have is not None
        and want[0] == have[0]
        and _resize_needed(want[1], have[1])
    ):
        resources = {k: v for k, v in want[1].items() if v}
        decision.resize[name] = {
            "spec": {"containers": [{"name": want[0], "resources": resources}]}
        }


class VirtualMachineReconciler:
    resource = VirtualMachine

    def keys_for_pod(self, pod: Watched) -> Iterable[tuple[str, str]]:
        meta = pod.metadata
        if meta.labels and NAME_LABEL in meta.labels:
            yield str(meta.namespace), meta.labels[NAME_LABEL]

    async def reconcile(self, ctx: Context, namespace: str, name: str) -> float | None:
        client = ctx.client
        vm_dict = await read(ctx, VirtualMachine, name, namespace)
        if vm_dict is None:
            return None
        vm = ObjectRef.of(vm_dict)
        pods = await vm_pods(ctx, namespace, name)
        now = datetime.now(UTC)
        decision = decide(vm_dict, pods, now=now)
        failure = None
        if decision.event is not None:
            ctx.events.emit(vm, *decision.event)
        for pod_name, mode in decision.power_off.items():
            await self._power_off(ctx, vm, namespace, pod_name, mode)
        for pod_name in decision.delete:
            await delete_pod(ctx, namespace, pod_name)
        if decision.create is not None:
            failure = await _resolve_restore(ctx, namespace, decision.create)
            if failure is not None:
                ctx.events.emit(vm, "Warning", failure[0], failure[1])
        if decision.create is not None and failure is None:
            try:
                created = await client.create(PODS.path(namespace), decision.create)
                created_name = created["metadata"]["name"]
                log.info("%s/%s: powering on: created pod %s", namespace, name, created_name)
                ctx.events.emit(vm, "Normal", "PoweringOn", f"Created pod {created_name}")
            except ApiError as e:
                failure = ("FailedCreate", f"the pod was refused: {e.message}")
                ctx.events.emit(vm, "Warning", "FailedCreate", failure[1])
        for pod_name, patch in decision.patch.items():
            await patch_pod(ctx, namespace, pod_name, patch)
        for pod_name, patch in decision.resize.items():
            log.info("%s/%s: resizing pod %s: %s", namespace, name, pod_name, patch)
            try:
                await client.patch(
                    PODS.path(namespace, pod_name, "resize"), patch, STRATEGIC_MERGE_PATCH
                )
                ctx.events.emit(vm, "Normal", "Resizing", f"resize of {pod_name}: {patch}")
            except ApiError as e:
                if not e.not_found:
                    log.warning("%s/%s: resize refused: %s", namespace, name, e.message)
                    failure = (
                        "ResizeRefused",
                        f"pods/resize refused: {e.message}; the template's resources "
                        "apply at the next power-on",
                    )
                    ctx.events.emit(vm, "Warning", "ResizeRefused", failure[1])
        if failure is not None:
            decision = decide(vm_dict, pods, failure=failure, now=now)
        await self._place(ctx, vm, vm_dict, pods, decision)
        await write_status(ctx, VirtualMachine, vm_dict, decision.status)
        before = (vm_dict.get("status") or {}).get("phase")
        after = decision.status.get("phase")
        if after and after != before:
            kind = "Warning" if after == "Failed" else "Normal"
            message = f"phase {before or 'none'} -> {after}"
            ready = next(c for c in decision.status["conditions"] if c["type"] == "Ready")
            if after == "Failed" and ready.get("message"):
                message += f": {ready.get('reason')}: {ready['message']}"
            ctx.events.emit(vm, kind, str(after), message)
        return decision.requeue

    async def _place(
        self,
        ctx: Context,
        vm: ObjectRef,
        vm_dict: Mapping[str, Any],
        pods: list[dict[str, Any]],
        decision: Decision,
    ) -> None:
        """A Running VM whose node no longer matches its template's node selection: a
        migration to one that does (see `_placement`), and the NodeSelectionMatched condition."""
        old = (vm_dict.get("status") or {}).get("conditions") or []
        if decision.status.get("phase") == "Migrating":  # keep saying why while it moves
            kept = [c for c in old if c.get("type") == NODE_SELECTION_CONDITION]
            decision.status["conditions"] = [*decision.status["conditions"], *kept]
        if decision.status.get("phase") != "Running":
            return
        pod = next((p for p in pods if meta_of(p).get("name") == decision.status["podName"]), None)
        if pod is None:
            return
        namespace = str(meta_of(vm_dict).get("namespace"))
        try:
            nodes = await nodes_by_name(ctx)
            found = await ctx.client.get(VirtualMachineMigration.path(namespace))
            migrations: list[dict[str, Any]] = found.get("items") or []
        except ApiError as e:
            if e.status not in (403, 404):
                raise
            # Without the migration CRD or the permission to list nodes, VMs stay where they
            # are: everything else the reconciler does must not depend on it.
            log.debug("node selection not checked: %s", e.message)
            return
        placement = decide_placement(vm_dict, pod, nodes, migrations)
        if placement is None:
            return
        if placement.create is not None:
            try:
                await ctx.client.create(VirtualMachineMigration.path(namespace), placement.create)
            except ApiError as e:
                if not e.conflict:  # 409: made by an earlier pass
                    raise
            else:
                log.info("%s: %s", meta_of(vm_dict).get("name"), placement.message)
                ctx.events.emit(vm, "Normal", "NodeSelectionChanged", placement.message)
        elif placement.reason == "NoMatchingNode" and not any(
            c.get("reason") == "NoMatchingNode" for c in old
        ):
            ctx.events.emit(vm, "Warning", "NoMatchingNode", placement.message)
        condition = _condition(
            old,
            NODE_SELECTION_CONDITION,
            placement.status,
            placement.reason,
            placement.message,
            meta_of(vm_dict).get("generation"),
            stamp(datetime.now(UTC)),
        )
        decision.status["conditions"] = [*decision.status["conditions"], condition]
        if placement.reason == "Migrating":
            decision.requeue = min(decision.requeue or _UNSETTLED_REQUEUE, _UNSETTLED_REQUEUE)

    async def _power_off(
        self, ctx: Context, vm: ObjectRef, namespace: str, pod_name: str, mode: str
    ) -> None:
        """Annotate the power-off mode, then delete: the provider reads the annotation when
        the deletion reaches it (a restart in between annotates again, then deletes)."""
        patch = {"metadata": {"annotations": {POWER_OFF_ANNOTATION: mode}}}
        if not await patch_pod(ctx, namespace, pod_name, patch):
            return
        if await delete_pod(ctx, namespace, pod_name):
            log.info(
                "%s/%s: powering off (%s): deleted pod %s",
                namespace,
                vm.name,
                mode,
                pod_name,
            )
            ctx.events.emit(vm, "Normal", "PoweringOff", f"{mode}: deleting pod {pod_name}")


async def _resolve_restore(
    ctx: Context, namespace: str, pod: dict[str, Any]
) -> tuple[str, str] | None:
    """`spec.restoreFrom.backup` names a backup; the provider needs its directory, which only
    the backup's status knows, and the backup lives on the node that took it: the new pod goes
    there unless its template already places it. A failure (the backup missing or not
    succeeded) is for the status, and then no pod is made."""
    annotations = pod["metadata"]["annotations"]
    backup = annotations.get(RESTORE_FROM_ANNOTATION)
    if not backup or backup.startswith("/"):
        return None
    try:
        path, node = await restore_path(ctx, namespace, backup)
    except RestoreError as e:
        return ("RestoreFailed", str(e))
    annotations[RESTORE_FROM_ANNOTATION] = path
    if node and not pod["spec"].get("nodeName"):
        pod["spec"]["nodeName"] = node
    return None
