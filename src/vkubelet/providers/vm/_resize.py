"""Live resize of a running VM: vCPUs, memory and the root disk, as in-place pod resize asks.

Kubernetes' in-place resize (`kubectl patch pod --subresource resize`) changes the container's
resources in the pod spec; the node agent hands the pod to `update_pod`, and the kubelet's answer
is in the status: `containerStatuses[].allocatedResources` / `.resources` (what now runs) and the
conditions `PodResizeInProgress` and `PodResizePending` (reason `Deferred`: later; `Infeasible`:
never on this node).

What can be done live, and how (the decision is `decide`, pure and unit-tested):
- more vCPUs, up to the headroom QEMU started with (`-smp N,maxcpus=M`): `device_add` of the CPU
  type `query-hotpluggable-cpus` lists, then the guest agent onlines them (`guest-set-vcpus`);
- more memory, in 128 MiB multiples (the guest's memory block), up to `maxmem` and while DIMM
  slots are free: `object-add memory-backend-ram` + `device_add pc-dimm`, then the guest agent
  onlines the new blocks (`guest-set-memory-blocks`);
- a bigger root disk (annotation `vm.vkubelet.io/root-disk-size`): `block_resize`.
Fewer vCPUs, less memory, more than the headroom: applied at the next power cycle (`Deferred`).
More than the node has: `Infeasible`. A disk never shrinks (a Warning event).

Headroom costs: the guest reserves per-CPU areas for `maxcpus` possible CPUs and QEMU builds
ACPI hotplug tables (no host memory is taken by `maxmem` until a DIMM is plugged); the devices
hotplugged are recorded in the launch so that a resume from hibernation recreates them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from lightkube.models.core_v1 import ContainerStatus, PodCondition, PodStatus, ResourceRequirements

from ._config import quantity_bytes
from ._machine import Machine

__all__ = [
    "BLOCK_MIB",
    "ROOT_DISK_ANNOTATIONS",
    "Decision",
    "Headroom",
    "ResizeState",
    "Size",
    "decide",
    "headroom_for",
    "hotplug_args",
]

BLOCK_MIB = 128  # x86-64 memory block: the unit the guest onlines
ROOT_DISK_ANNOTATIONS = ("vm.vkubelet.io/root-disk-size",)
MAX_CPUS_ANNOTATION = "vm.vkubelet.io/max-cpus"
MAX_MEMORY_ANNOTATION = "vm.vkubelet.io/max-memory"
NEXT_POWER_CYCLE = "applied at next power cycle"
_MIB = 2**20


@dataclass(frozen=True)
class Size:
    vcpus: int
    memory_mib: int


@dataclass(frozen=True)
class Headroom:
    max_vcpus: int
    max_memory_mib: int
    slots: int


@dataclass(frozen=True)
class Decision:
    """What to do live (`vcpus`, `memory_mib`: the sizes to reach now) and what waits."""

    vcpus: int
    memory_mib: int
    pending: tuple[str, str] | None = None  # (Deferred|Infeasible, message)


def headroom_for(
    annotations: dict[str, str], size: Size, max_vcpus: int, max_memory: int, slots: int
) -> Headroom:
    """The headroom a new machine of `size` starts with (config, or the pod's annotations)."""
    if MAX_CPUS_ANNOTATION in annotations:
        try:
            max_vcpus = int(annotations[MAX_CPUS_ANNOTATION])
        except ValueError:
            raise ValueError(
                f"metadata.annotations[{MAX_CPUS_ANNOTATION}]: expected a whole number"
            ) from None
    if MAX_MEMORY_ANNOTATION in annotations:
        try:
            max_memory = quantity_bytes(annotations[MAX_MEMORY_ANNOTATION])
        except ValueError as e:
            raise ValueError(f"metadata.annotations[{MAX_MEMORY_ANNOTATION}]: {e}") from None
    max_memory_mib = max(size.memory_mib, max_memory // _MIB)
    return Headroom(
        max_vcpus=min(max(size.vcpus, max_vcpus), 255),
        max_memory_mib=max_memory_mib,
        slots=slots if max_memory_mib > size.memory_mib else 0,
    )


def decide(
    current: Size,
    desired: Size,
    headroom: Headroom,
    *,
    dimms: int,
    node_vcpus: int,
    node_memory_mib: int,
) -> Decision:
    """What of `desired` can be reached live from `current`; the rest, and why, as pending."""
    if desired.vcpus > node_vcpus or desired.memory_mib > node_memory_mib:
        what = "vCPUs" if desired.vcpus > node_vcpus else "memory"
        have = f"{node_vcpus}" if what == "vCPUs" else f"{node_memory_mib} MiB"
        return Decision(
            current.vcpus,
            current.memory_mib,
            ("Infeasible", f"Node didn't have enough capacity: {what} (the node has {have})"),
        )
    why: list[str] = []
    vcpus = current.vcpus
    if desired.vcpus > current.vcpus:
        if desired.vcpus <= headroom.max_vcpus:
            vcpus = desired.vcpus
        else:
            why.append(
                f"{desired.vcpus} vCPUs exceed the {headroom.max_vcpus} the machine can hotplug"
            )
    elif desired.vcpus < current.vcpus:
        why.append("vCPUs cannot be removed live")
    memory = current.memory_mib
    grow = desired.memory_mib - current.memory_mib
    if grow > 0:
        if grow % BLOCK_MIB:
            why.append(f"memory grows live in {BLOCK_MIB} MiB steps, not by {grow} MiB")
        elif desired.memory_mib > headroom.max_memory_mib:
            why.append(
                f"{desired.memory_mib} MiB exceed the {headroom.max_memory_mib} MiB "
                "the machine can hotplug"
            )
        elif dimms >= headroom.slots:
            why.append(f"all {headroom.slots} memory slots are used")
        else:
            memory = desired.memory_mib
    elif grow < 0:
        why.append("memory cannot be removed live")
    pending = ("Deferred", f"{'; '.join(why)}: {NEXT_POWER_CYCLE}") if why else None
    return Decision(vcpus, memory, pending)


def hotplug_args(launch: dict[str, Any]) -> tuple[str, ...]:
    """QEMU options that recreate the devices live resize plugged (for a resume: the incoming
    machine must have the same devices as the one whose state it loads)."""
    args: list[str] = []
    hotplug = launch.get("hotplug") or {}
    for cpu in hotplug.get("cpus", []):
        props = ",".join(f"{k}={int(v)}" for k, v in sorted(cpu["props"].items()))
        args += ["-device", f"{cpu['driver']},id={cpu['id']},{props}"]
    for dimm in hotplug.get("dimms", []):
        args += ["-object", f"memory-backend-ram,id=mem-{dimm['id']},size={int(dimm['mib'])}M"]
        args += ["-device", f"pc-dimm,id={dimm['id']},memdev=mem-{dimm['id']}"]
    return tuple(args)


def running_size(launch: dict[str, Any]) -> Size:
    hotplug = launch.get("hotplug") or {}
    return Size(
        int(launch["vcpus"]) + len(hotplug.get("cpus", [])),
        int(launch["memory_mib"]) + sum(int(d["mib"]) for d in hotplug.get("dimms", [])),
    )


class ResizeError(RuntimeError):
    pass


async def add_vcpus(machine: Machine, launch: dict[str, Any], total: int, wait: float) -> None:
    """Plug CPUs until the machine has `total`, online them in the guest."""
    hotplug = launch.setdefault("hotplug", {})
    cpus: list[dict[str, Any]] = hotplug.setdefault("cpus", [])
    have = running_size(launch).vcpus
    if total <= have:
        return
    slots = await machine.monitor.execute("query-hotpluggable-cpus")
    free = sorted(
        (s for s in slots if not s.get("qom-path")),
        key=lambda s: tuple(sorted(s["props"].items())),
    )
    for slot in free[: total - have]:
        device = f"vcpu{len(cpus) + 1}"
        props = {k: int(v) for k, v in slot["props"].items() if k.endswith("-id")}
        await machine.monitor.execute("device_add", {"driver": slot["type"], "id": device, **props})
        cpus.append({"driver": slot["type"], "id": device, "props": props})
    await _online_vcpus(machine, total, wait)


async def _online_vcpus(machine: Machine, total: int, wait: float) -> None:
    deadline = time.monotonic() + wait
    while True:
        vcpus = await machine.agent.call("guest-get-vcpus")
        offline = [
            {"logical-id": v["logical-id"], "online": True} for v in vcpus if not v["online"]
        ]
        if offline:
            await machine.agent.call("guest-set-vcpus", {"vcpus": offline})
        elif len(vcpus) >= total:
            return
        if time.monotonic() > deadline:
            raise ResizeError(f"the guest shows {len(vcpus)} of {total} vCPUs")
        await asyncio.sleep(0.2)


async def add_memory(machine: Machine, launch: dict[str, Any], total_mib: int, wait: float) -> None:
    """Plug one DIMM with the missing memory, online its blocks in the guest."""
    hotplug = launch.setdefault("hotplug", {})
    dimms: list[dict[str, Any]] = hotplug.setdefault("dimms", [])
    grow = total_mib - running_size(launch).memory_mib
    if grow <= 0:
        return
    device = f"dimm{len(dimms) + 1}"
    await machine.monitor.execute(
        "object-add",
        {"qom-type": "memory-backend-ram", "id": f"mem-{device}", "size": grow * _MIB},
    )
    await machine.monitor.execute(
        "device_add", {"driver": "pc-dimm", "id": device, "memdev": f"mem-{device}"}
    )
    dimms.append({"id": device, "mib": grow})
    deadline = time.monotonic() + wait
    while True:
        blocks = await machine.agent.call("guest-get-memory-blocks")
        offline = [
            {"phys-index": b["phys-index"], "online": True} for b in blocks if not b["online"]
        ]
        if not offline:
            if len(blocks) * BLOCK_MIB >= total_mib - BLOCK_MIB:  # blocks cover the new total
                return
        else:
            await machine.agent.call("guest-set-memory-blocks", {"mem-blks": offline})
        if time.monotonic() > deadline:
            raise ResizeError("the guest did not online the new memory")
        await asyncio.sleep(0.2)


async def root_disk_size(machine: Machine) -> int:
    for device in await machine.monitor.execute("query-block"):
        if device.get("device") == "disk0":
            return int(device["inserted"]["image"]["virtual-size"])
    raise ResizeError("the root disk is not attached")


async def grow_root_disk(machine: Machine, size: int) -> None:
    await machine.monitor.execute("block_resize", {"device": "disk0", "size": size})


# -- status ----------------------------------------------------------------------------------
@dataclass
class ResizeState:
    """What the provider reports about resizes of one VM."""

    applied: dict[str, Any]  # the container's resources (requests/limits) now in effect
    pending: tuple[str, str] | None = None
    in_progress: bool = False
    error: str | None = None
    # The status is merged into the API's (strategic merge patch): a condition once reported
    # stays until it is reported otherwise, so a resolved one is reported False.
    reported: frozenset[str] = frozenset()


def decorate(status: PodStatus, state: ResizeState, container: str, since: datetime | None) -> None:
    """The kubelet's in-place resize fields on a pod status built by the SDK."""
    for cs in status.containerStatuses or []:
        if isinstance(cs, ContainerStatus) and cs.name == container:
            requests = state.applied.get("requests") or None
            limits = state.applied.get("limits") or None
            cs.resources = ResourceRequirements(requests=requests, limits=limits)
            cs.allocatedResources = dict(requests or limits or {}) or None
    conditions = [c for c in status.conditions or [] if not c.type.startswith("PodResize")]
    now = (since or datetime.now(UTC)).replace(microsecond=0)
    if state.pending is not None:
        reason, message = state.pending
        conditions.append(
            PodCondition(
                type="PodResizePending",
                status="True",
                reason=reason,
                message=message,
                lastTransitionTime=now,
            )
        )
    elif "PodResizePending" in state.reported:
        conditions.append(
            PodCondition(type="PodResizePending", status="False", lastTransitionTime=now)
        )
    if state.in_progress or state.error:
        conditions.append(
            PodCondition(
                type="PodResizeInProgress",
                status="True",
                reason="Error" if state.error else None,
                message=state.error,
                lastTransitionTime=now,
            )
        )
    elif "PodResizeInProgress" in state.reported:
        conditions.append(
            PodCondition(type="PodResizeInProgress", status="False", lastTransitionTime=now)
        )
    state.reported |= {c.type for c in conditions if c.type.startswith("PodResize")}
    status.conditions = conditions
