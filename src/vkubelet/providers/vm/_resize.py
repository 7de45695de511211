"""Live resize of a running VM: vCPUs, memory and the root disk, as in-place pod resize asks.

Kubernetes' in-place resize (`kubectl patch pod --subresource resize`) changes the container's
resources in the pod spec; the node agent hands the pod to `update_pod`, and the kubelet's answer
is in the status: `containerStatuses[].allocatedResources` / `.resources` (what now runs) and the
conditions `PodResizeInProgress` and `PodResizePending` (reason `Deferred`: later; `Infeasible`:
never on this node).

What can be done live, and how (the decision is `decide`, pure and unit-tested; the plugging is
the machine's runtime's, `_hotplug.Hotplug`: QMP's `device_add` for QEMU, libvirt's own calls
for a domain; this module sees only that interface):
- more vCPUs, up to the headroom the machine started with (`-smp N,maxcpus=M`, a domain's
  `<vcpu current=N>M`): one CPU plugged at a time, then the guest agent onlines them
  (`guest-set-vcpus`);
- more memory, in 128 MiB multiples (the guest's memory block), up to `maxmem` and while DIMM
  slots are free: one DIMM, then the guest agent onlines the new blocks
  (`guest-set-memory-blocks`);
- a bigger root disk (annotation `vm.vkubelet.io/root-disk-size`).
Fewer vCPUs, less memory, more than the headroom: applied at the next power cycle (`Deferred`).
More than the node has: `Infeasible`. A disk never shrinks (a Warning event). A machine whose
runtime cannot plug (no `hotplug`) fails the resize, saying so; it runs on as it was.

Headroom costs: the guest reserves per-CPU areas for `maxcpus` possible CPUs and QEMU builds
ACPI hotplug tables (no host memory is taken by `maxmem` until a DIMM is plugged); the devices
hotplugged are recorded in the launch so that a resume from hibernation recreates them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from lightkube.resources.core_v1 import Pod

from ...sdk import ProviderError, ResolvedPod
from ._backend import MachineHandle
from ._config import VMConfig, quantity_bytes
from ._hotplug import Hotplug, ResizeError
from ._qga import GuestAgent, GuestAgentError, GuestAgentUnavailable
from ._qmp import ExecuteError, MonitorUnavailable
from ._spec import MachinePlan
from ._vm import VM, Launch, ResizeState, VMHost, pod_annotations

__all__ = [
    "BLOCK_MIB",
    "ROOT_DISK_ANNOTATIONS",
    "Decision",
    "Headroom",
    "ResizeError",
    "Size",
    "decide",
    "headroom_for",
    "resize",
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


def running_size(launch: Launch) -> Size:
    return Size(
        launch.vcpus + len(launch.hotplug.get("cpus", [])),
        launch.memory_mib + sum(int(d["mib"]) for d in launch.hotplug.get("dimms", [])),
    )


def headroom(launch: Launch) -> Headroom:
    return Headroom(
        launch.max_vcpus or launch.vcpus,
        launch.max_memory_mib or launch.memory_mib,
        launch.memory_slots,
    )


def sized(launch: Launch, pod: Pod, plan: MachinePlan, config: VMConfig) -> Launch:
    """`launch` with the pod's size and the live-resize headroom a new machine starts with."""
    try:
        room = headroom_for(
            pod_annotations(pod),
            Size(plan.vcpus, plan.memory_mib),
            config.hotplug_max_vcpus,
            config.hotplug_max_memory,
            config.hotplug_slots,
        )
    except ValueError as e:
        raise ProviderError("CreateContainerConfigError", str(e)) from None
    return replace(
        launch,
        vcpus=plan.vcpus,
        memory_mib=plan.memory_mib,
        max_vcpus=room.max_vcpus,
        max_memory_mib=room.max_memory_mib,
        memory_slots=room.slots,
        hotplug={},
    )


def _controls(machine: MachineHandle) -> tuple[Hotplug, GuestAgent]:
    if machine.hotplug is None or machine.agent is None:
        raise ResizeError(f"the {machine.runtime} runtime cannot resize VMs live yet")
    return machine.hotplug, machine.agent


async def add_vcpus(machine: MachineHandle, launch: Launch, total: int, wait: float) -> None:
    """Plug CPUs until the machine has `total`, online them in the guest."""
    hotplug, agent = _controls(machine)
    cpus = launch.hotplug.setdefault("cpus", [])
    have = running_size(launch).vcpus
    if total <= have:
        return
    for count in range(have + 1, total + 1):  # one at a time: each is recorded once plugged
        cpus.append(await hotplug.plug_vcpu(f"vcpu{len(cpus) + 1}", count))
    shows = f"the guest shows {{}} of {total} vCPUs"
    await _online(agent, "vcpus", "logical-id", "vcpus", total, wait, shows)


async def _online(
    agent: GuestAgent, kind: str, key: str, argument: str, wanted: int, wait: float, failed: str
) -> None:
    """Online what the guest has offline (`guest-get-<kind>`, `guest-set-<kind>`) until it has
    `wanted` units; else ResizeError(`failed`, given the count it shows)."""
    deadline = time.monotonic() + wait
    while True:
        units = await agent.call(f"guest-get-{kind}")
        offline = [{key: u[key], "online": True} for u in units if not u["online"]]
        if offline:
            await agent.call(f"guest-set-{kind}", {argument: offline})
        elif len(units) >= wanted:
            return
        if time.monotonic() > deadline:
            raise ResizeError(failed.format(len(units)))
        await asyncio.sleep(0.2)


async def add_memory(machine: MachineHandle, launch: Launch, total_mib: int, wait: float) -> None:
    """Plug one DIMM with the missing memory, online its blocks in the guest."""
    hotplug, agent = _controls(machine)
    dimms = launch.hotplug.setdefault("dimms", [])
    grow = total_mib - running_size(launch).memory_mib
    if grow <= 0:
        return
    dimms.append(await hotplug.plug_memory(f"dimm{len(dimms) + 1}", grow))
    blocks = -(-(total_mib - BLOCK_MIB) // BLOCK_MIB)  # the blocks that cover the new total
    failed = "the guest did not online the new memory"
    await _online(agent, "memory-blocks", "phys-index", "mem-blks", blocks, wait, failed)


async def root_disk_size(machine: MachineHandle) -> int:
    hotplug, _ = _controls(machine)
    return await hotplug.root_disk_size()


async def grow_root_disk(machine: MachineHandle, size: int) -> None:
    hotplug, _ = _controls(machine)
    await hotplug.grow_root_disk(size)


# -- the pod's resize ---------------------------------------------------------------------------
_LIVE_ERRORS = (
    ResizeError,
    ExecuteError,
    MonitorUnavailable,
    GuestAgentError,
    GuestAgentUnavailable,
    TimeoutError,
    OSError,
)


def resources(pod: Pod) -> dict[str, Any]:
    """The container's requests and limits, as the status reports them in effect."""
    container = pod.spec.containers[0] if pod.spec and pod.spec.containers else None
    wanted = container.resources if container is not None else None
    if wanted is None:
        return {}
    return {k: dict(v) for k, v in (("requests", wanted.requests), ("limits", wanted.limits)) if v}


def _set_pending(vm: VM, pending: tuple[str, str] | None) -> None:
    state = vm.power.resize
    assert state is not None
    if pending != state.pending:
        vm.power.pending_since = datetime.now(UTC)
    state.pending = pending


def _root_size_wanted(pod: Pod, plan: MachinePlan | None) -> int | None:
    given = pod_annotations(pod)
    for name in ROOT_DISK_ANNOTATIONS:
        if name in given:
            with contextlib.suppress(ValueError):
                return quantity_bytes(given[name])
    return plan.root_size if plan is not None else None


def refuse(host: VMHost, vm: VM, pod: Pod, why: str) -> None:
    """A machine whose size is not vkubelet's to change (an imported domain): a pod asking for
    another size than it runs with is an `Infeasible` resize saying why, cleared when it asks
    for the running size again; the status keeps reporting what runs."""
    if vm.power.resize is None:
        vm.power.resize = ResizeState(applied=resources(vm.pod))
    state = vm.power.resize
    vm.pod = pod
    pending = None if resources(pod) == state.applied else ("Infeasible", why)
    if pending != state.pending:
        _set_pending(vm, pending)
        host.publish(vm)


async def resize(
    host: VMHost, vm: VM, resolved: ResolvedPod, plan: MachinePlan | None, refused: str | None
) -> bool:
    """Apply a changed size to the running VM; True if `refused` (the pod's new size does not
    fit the node) was taken as an infeasible resize."""
    vm.pod = resolved.pod
    if vm.power.resize is None:
        vm.power.resize = ResizeState(applied={})
    state = vm.power.resize
    if refused is not None:
        if ".resources" not in refused and "VirtletVCPUCount" not in refused:
            return False
        _set_pending(vm, ("Infeasible", refused))
        host.publish(vm)
        return True
    assert plan is not None
    machine = vm.machine if vm.booted_at is not None else None
    if vm.plan is not None:
        vm.plan = replace(vm.plan, vcpus=plan.vcpus, memory_mib=plan.memory_mib)
    if machine is None or vm.launch is None:
        # Not running (yet): the next launch takes the pod's size.
        state.applied = resources(vm.pod)
        _set_pending(vm, None)
        return False
    launch = vm.launch
    current = running_size(launch)
    desired = Size(plan.vcpus, plan.memory_mib)
    if current != desired:
        decision = decide(
            current,
            desired,
            headroom(launch),
            dimms=len(launch.hotplug.get("dimms", [])),
            node_vcpus=max(host.millicpu // 1000, 1),
            node_memory_mib=host.memory // _MIB,
        )
        state.in_progress, state.error = True, None
        host.publish(vm)
        try:
            await add_vcpus(machine, launch, decision.vcpus, wait=30.0)
            await add_memory(machine, launch, decision.memory_mib, wait=30.0)
        except _LIVE_ERRORS as e:
            state.error = f"live resize failed: {e}"
            host.event(vm, "Warning", "ResizeFailed", state.error)
        finally:
            state.in_progress = False
            vm.save()
        if state.error is None:
            reached = running_size(launch)
            message = f"{reached.vcpus} vCPUs, {reached.memory_mib} MiB (live)"
            host.event(vm, "Normal", "Resized", message)
            if decision.pending is None:
                state.applied = resources(vm.pod)
            _set_pending(vm, decision.pending)
    else:  # the pod asks for what runs: a failed step before is over too
        state.applied, state.error = resources(vm.pod), None
        _set_pending(vm, None)
    await _grow_root(host, vm, machine, _root_size_wanted(vm.pod, plan))
    host.publish(vm)
    return False


async def _grow_root(host: VMHost, vm: VM, machine: MachineHandle, wanted: int | None) -> None:
    if wanted is None or wanted == vm.power.root_size:
        return
    try:
        size = await root_disk_size(machine)
        if wanted > size:
            wanted = -(-wanted // 512) * 512
            await grow_root_disk(machine, wanted)
            host.event(vm, "Normal", "RootDiskResized", f"{size} -> {wanted} bytes (live)")
        elif wanted < size:
            host.event(
                vm,
                "Warning",
                "RootDiskShrinkRefused",
                f"the root disk is {size} bytes; a root disk cannot shrink to {wanted}",
            )
        vm.power.root_size = wanted
    except _LIVE_ERRORS as e:
        host.event(vm, "Warning", "ResizeFailed", f"root disk: {e}")
