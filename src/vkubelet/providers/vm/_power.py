"""The provider's side of hibernation and live resize: the few decisions the provider's hooks
delegate here, so that `_provider.py` carries only one-line calls.

- launch: a pod of a machine whose state was saved resumes it (same layout, `-incoming`), else
  boots cold with the pod's current size (resizes deferred to the next power cycle land here);
  two pods of one machine never run at once (they would share its disk).
- power off: a pod deleted with `power-off: Hibernate` saves its state instead of shutting down;
  the container's final state says `Hibernated` (or `HibernateFailed`, then a normal shutdown).
- update: CPU/memory/root-disk changes applied live where possible (`_resize.decide`), the rest
  reported as the kubelet reports a resize it cannot do now.
"""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from ...sdk import ProviderError, ResolvedPod
from . import _hibernate, _resize, _volumes
from ._backend import MachineHandle
from ._config import VMConfig, quantity_bytes
from ._machine import MachineExit
from ._qga import GuestAgentError, GuestAgentUnavailable
from ._qmp import ExecuteError, MonitorUnavailable
from ._spec import MachinePlan

if TYPE_CHECKING:
    from ._provider import _VM, VMProvider

__all__ = ["PowerState", "decorate"]

_MIB = 2**20
_LIVE_ERRORS = (
    _resize.ResizeError,
    ExecuteError,
    MonitorUnavailable,
    GuestAgentError,
    GuestAgentUnavailable,
    TimeoutError,
    OSError,
)


@dataclass
class PowerState:
    outcome: tuple[str, str] | None = None  # (Hibernated|HibernateFailed, message)
    hibernate: bool = False  # the deleted pod asked for it
    resize: _resize.ResizeState | None = None
    pending_since: datetime | None = None
    resizes: int = 0
    root_size: int | None = None  # the root disk's size as last resized live


def decorate(status: PodStatus, power: PowerState, container: str) -> None:
    if power.outcome is not None:
        reason, message = power.outcome
        for cs in status.containerStatuses or []:
            if cs.name == container and cs.state is not None and cs.state.terminated is not None:
                cs.state.terminated.reason = reason
                cs.state.terminated.message = message or None
    if power.resize is not None:
        _resize.decorate(status, power.resize, container, power.pending_since)


def _resources(pod: Pod) -> dict[str, Any]:
    container = pod.spec.containers[0] if pod.spec and pod.spec.containers else None
    resources = container.resources if container is not None else None
    if resources is None:
        return {}
    return {
        k: dict(v) for k, v in (("requests", resources.requests), ("limits", resources.limits)) if v
    }


def machine_dir(provider: VMProvider, pod: Pod) -> Path | None:
    return _hibernate.machine_dir(pod, provider.config.state_dir)


def launch_extras(pod: Pod, plan: MachinePlan, config: VMConfig) -> dict[str, Any]:
    """The live-resize headroom a new machine starts with (recorded in its launch)."""
    annotations = dict((pod.metadata.annotations if pod.metadata else None) or {})
    try:
        room = _resize.headroom_for(
            annotations,
            _resize.Size(plan.vcpus, plan.memory_mib),
            config.hotplug_max_vcpus,
            config.hotplug_max_memory,
            config.hotplug_slots,
        )
    except ValueError as e:
        raise ProviderError("CreateContainerConfigError", str(e)) from None
    return {
        "max_vcpus": room.max_vcpus,
        "max_memory_mib": room.max_memory_mib,
        "memory_slots": room.slots,
        "hotplug": {},
    }


def launch_spec_extras(launch: dict[str, Any]) -> dict[str, Any]:
    return {
        "max_vcpus": launch.get("max_vcpus"),
        "max_memory_mib": launch.get("max_memory_mib"),
        "memory_slots": int(launch.get("memory_slots", 0)),
        "extra_args": _volumes.drive_args(launch) + _resize.hotplug_args(launch),
    }


# -- PVC disks ----------------------------------------------------------------------------------
def start_storage(provider: VMProvider) -> None:
    """The disk provisioner of this node, when the config gives it credentials."""
    storage = provider.config.storage
    if storage is None:
        return
    provisioner = _volumes.DiskProvisioner(
        provider.node_name, storage, provider.config.volume_root, provider.runtime.create_blank
    )
    provider.disk_provisioner = provisioner
    provider._tasks.spawn(provisioner.run(), name="disk provisioner")


async def claim_disks(provider: VMProvider, vm: _VM, plan: MachinePlan) -> dict[str, Any]:
    """The pod's PVC disks, for its launch (a claim not bound yet: retried with back-off)."""
    if not plan.claims:
        return {}
    provisioner = provider.disk_provisioner
    if provisioner is None:
        raise ProviderError(
            "CreateContainerConfigError",
            "spec.volumes: persistentVolumeClaim disks need `storage` in the node's vm config",
        )
    namespace = str(vm.pod.metadata.namespace if vm.pod.metadata else "default")
    disks = [await provisioner.claim_disk(namespace, claim) for claim in plan.claims]
    return {"claims": [[str(d.path), d.serial] for d in disks]}


def _headroom(launch: dict[str, Any]) -> _resize.Headroom:
    return _resize.Headroom(
        int(launch.get("max_vcpus") or launch["vcpus"]),
        int(launch.get("max_memory_mib") or launch["memory_mib"]),
        int(launch.get("memory_slots", 0)),
    )


async def launch(provider: VMProvider, vm: _VM) -> MachineHandle:
    """Start the VM's machine: resumed from its saved state if it has one, else a cold boot."""
    directory = machine_dir(provider, vm.pod)
    if directory is not None:
        for other in provider.vms.values():
            running = other is not vm and other.machine is not None
            if running and machine_dir(provider, other.pod) == directory:
                name = other.pod.metadata.name if other.pod.metadata else "?"
                raise RuntimeError(f"its machine still runs as pod {name}; waiting for it")
    saved = _hibernate.saved_state(directory)
    if saved is not None and directory is not None:
        if (why := saved.compatible(vm.launch)) is not None:
            provider._event(vm, "Warning", "ResumeRefused", f"booting cold: {why}")
            _hibernate.drop_state(directory)
        else:
            handle = await _resume(provider, vm, directory, saved)
            if handle is not None:
                return handle
    return await _cold(provider, vm)


async def _cold(provider: VMProvider, vm: _VM) -> MachineHandle:
    if vm.plan is not None:  # the pod's size now (a deferred resize lands here)
        vm.launch = {
            **vm.launch,
            "vcpus": vm.plan.vcpus,
            "memory_mib": vm.plan.memory_mib,
            **launch_extras(vm.pod, vm.plan, provider.config),
        }
        vm.save()
    vm.power.resize = _resize.ResizeState(applied=_resources(vm.pod))
    vm.power.outcome = None
    return await provider.runtime.launch(provider._launch_spec(vm))


async def _resume(
    provider: VMProvider, vm: _VM, directory: Path, saved: _hibernate.Saved
) -> MachineHandle | None:
    vm.launch = _hibernate.resumed_launch(vm.launch, saved)
    vm.save()
    spec = provider._launch_spec(vm)
    spec = replace(spec, extra_args=spec.extra_args + _hibernate.incoming_args(saved))
    handle = await provider.runtime.launch(spec)
    machine = _hibernate.controls(handle)
    if machine is None:
        return handle
    try:
        took = await _hibernate.resume(machine, directory)
    except (_hibernate.HibernateError, ExecuteError, MonitorUnavailable) as e:
        provider._event(vm, "Warning", "ResumeFailed", f"booting cold: {e}")
        with contextlib.suppress(Exception):
            await handle.kill()
        _hibernate.drop_state(directory)
        return None
    running = _resize.running_size(vm.launch)
    vm.power.resize = _resize.ResizeState(applied=_resources(vm.pod))
    if vm.plan is not None and (vm.plan.vcpus, vm.plan.memory_mib) != (
        running.vcpus,
        running.memory_mib,
    ):
        vm.power.resize.pending = (
            "Deferred",
            f"resumed with the hibernated size ({running.vcpus} vCPUs, "
            f"{running.memory_mib} MiB): {_resize.NEXT_POWER_CYCLE}",
        )
        vm.power.pending_since = datetime.now(UTC)
    vm.power.outcome = None
    old = saved.launch.get("address")
    if old and vm.address and old != vm.address:
        await _readdress(provider, vm, machine, str(old), vm.address)
    provider._event(
        vm,
        "Normal",
        "Resumed",
        f"resumed from hibernation in {took:.2f} s ({saved.size} bytes of state, "
        f"saved {time.time() - saved.saved_at:.0f} s ago)",
    )
    return handle


# The guest's interface holding address $1 gets $2/$3 instead, the default route via $4, and
# forgets its neighbours (the new pod's gateway link has another MAC). Arguments, never code.
# The old address goes first: deleting a primary address deletes the secondaries of its subnet.
_READDRESS = (
    'dev=$(ip -o -4 addr show | while read -r _ d _ a _; do [ "${a%/*}" = "$1" ] && echo "$d" '
    '&& break; done); [ -n "$dev" ] || exit 3; ip addr del "$1/$3" dev "$dev" && '
    'ip addr add "$2/$3" dev "$dev" && ip route replace default via "$4" dev "$dev" && '
    'ip neigh flush dev "$dev"'
)


async def _readdress(provider: VMProvider, vm: _VM, machine: Any, old: str, new: str) -> None:
    """A resumed guest still has its previous pod's address (the pod network is keyed by the
    pod): move it to this pod's, through the guest agent, so probes, port-forward and Services
    reach it. A guest without `ip` (or an agent) keeps the old one: a Warning says so."""
    network = ipaddress.IPv4Network(provider.config.pod_cidr)
    gateway = str(network.network_address + 1)  # as `_net.PodNetwork` assigns it
    argv = ["sh", "-c", _READDRESS, "sh", old, new, str(network.prefixlen), gateway]
    try:
        result = await machine.agent.exec(argv, timeout=10)
        failed = result.exit_code != 0
        why = result.stderr.decode(errors="replace")[:200] or f"exit {result.exit_code}"
    except (GuestAgentError, GuestAgentUnavailable, TimeoutError, OSError) as e:
        failed, why = True, str(e)
    if failed:
        provider._event(
            vm,
            "Warning",
            "ReaddressFailed",
            f"the resumed guest keeps its previous address {old} (not {new}): {why}",
        )


def power_off(
    provider: VMProvider, vm: _VM, handle: MachineHandle, grace: float
) -> Coroutine[Any, Any, object] | None:
    """Hibernation instead of a shutdown, when the pod asks for it and has a machine."""
    directory = machine_dir(provider, vm.pod)
    if directory is None or not (vm.power.hibernate or _hibernate.wants_hibernate(vm.pod)):
        return None
    machine = _hibernate.controls(handle)
    if machine is None:
        return None
    return _hibernate_or_stop(provider, vm, handle, machine, directory, grace)


async def _hibernate_or_stop(
    provider: VMProvider,
    vm: _VM,
    handle: MachineHandle,
    machine: Any,
    directory: Path,
    grace: float,
) -> object:
    started = time.monotonic()
    try:
        message = await _hibernate.hibernate(
            machine,
            directory,
            {**vm.launch, "address": vm.address},
            timeout=max(grace * 0.8, 5.0),
        )
    except (_hibernate.HibernateError, OSError) as e:
        vm.power.outcome = (_hibernate.HIBERNATE_FAILED, str(e))
        provider._event(vm, "Warning", _hibernate.HIBERNATE_FAILED, f"shutting down: {e}")
        _hibernate.drop_state(directory)
        return await handle.stop(max(grace - (time.monotonic() - started), 1.0))
    vm.power.outcome = (_hibernate.HIBERNATED, message)
    provider._event(vm, "Normal", _hibernate.HIBERNATED, message)
    return await machine.end(MachineExit(0, _hibernate.HIBERNATED, message))


def deleting(vm: _VM, pod: Pod) -> None:
    """The pod as deleted (its newest annotations: a controller sets power-off just before)."""
    vm.power.hibernate = _hibernate.wants_hibernate(pod)


# -- resize -------------------------------------------------------------------------------------
def _push(provider: VMProvider, vm: _VM) -> None:
    meta = vm.pod.metadata
    runner = provider.runners.get(f"{meta.namespace}/{meta.name}") if meta else None
    if runner is not None:
        provider._notify(runner.as_pod())


def _set_pending(vm: _VM, pending: tuple[str, str] | None) -> None:
    state = vm.power.resize
    assert state is not None
    if pending != state.pending:
        vm.power.pending_since = datetime.now(UTC)
    state.pending = pending


def _root_size_wanted(pod: Pod, plan: MachinePlan | None) -> int | None:
    annotations = dict((pod.metadata.annotations if pod.metadata else None) or {})
    for name in _resize.ROOT_DISK_ANNOTATIONS:
        if name in annotations:
            with contextlib.suppress(ValueError):
                return quantity_bytes(annotations[name])
    return plan.root_size if plan is not None else None


async def resize(
    provider: VMProvider,
    vm: _VM,
    resolved: ResolvedPod,
    plan: MachinePlan | None,
    refused: str | None,
) -> bool:
    """Apply a changed size to the running VM; True if `refused` (the pod's new size does not
    fit the node) was taken as an infeasible resize."""
    vm.pod = resolved.pod
    if vm.power.resize is None:
        vm.power.resize = _resize.ResizeState(applied={})
    state = vm.power.resize
    if refused is not None:
        if ".resources" not in refused and "VirtletVCPUCount" not in refused:
            return False
        _set_pending(vm, ("Infeasible", refused))
        _push(provider, vm)
        return True
    assert plan is not None
    machine = _hibernate.controls(vm.machine) if vm.booted_at is not None else None
    if vm.plan is not None:
        vm.plan = replace(vm.plan, vcpus=plan.vcpus, memory_mib=plan.memory_mib)
    if machine is None or not vm.launch:
        # Not running (yet): the next launch takes the pod's size.
        state.applied = _resources(vm.pod)
        _set_pending(vm, None)
        return False
    current = _resize.running_size(vm.launch)
    desired = _resize.Size(plan.vcpus, plan.memory_mib)
    if current != desired:
        hotplug = vm.launch.get("hotplug") or {}
        decision = _resize.decide(
            current,
            desired,
            _headroom(vm.launch),
            dimms=len(hotplug.get("dimms", [])),
            node_vcpus=max(provider.millicpu // 1000, 1),
            node_memory_mib=provider.memory // _MIB,
        )
        state.in_progress, state.error = True, None
        _push(provider, vm)
        try:
            await _resize.add_vcpus(machine, vm.launch, decision.vcpus, wait=30.0)
            await _resize.add_memory(machine, vm.launch, decision.memory_mib, wait=30.0)
        except _LIVE_ERRORS as e:
            state.error = f"live resize failed: {e}"
            provider._event(vm, "Warning", "ResizeFailed", state.error)
        finally:
            state.in_progress = False
            vm.save()
        if state.error is None:
            reached = _resize.running_size(vm.launch)
            provider._event(
                vm,
                "Normal",
                "Resized",
                f"{reached.vcpus} vCPUs, {reached.memory_mib} MiB (live)",
            )
            if decision.pending is None:
                state.applied = _resources(vm.pod)
            _set_pending(vm, decision.pending)
    else:
        state.applied = _resources(vm.pod)
        _set_pending(vm, None)
    await _grow_root(provider, vm, machine, _root_size_wanted(vm.pod, plan))
    _push(provider, vm)
    return False


async def _grow_root(provider: VMProvider, vm: _VM, machine: Any, wanted: int | None) -> None:
    if wanted is None or wanted == vm.power.root_size:
        return
    try:
        size = await _resize.root_disk_size(machine)
        if wanted > size:
            wanted = -(-wanted // 512) * 512
            await _resize.grow_root_disk(machine, wanted)
            provider._event(vm, "Normal", "RootDiskResized", f"{size} -> {wanted} bytes (live)")
        elif wanted < size:
            provider._event(
                vm,
                "Warning",
                "RootDiskShrinkRefused",
                f"the root disk is {size} bytes; a root disk cannot shrink to {wanted}",
            )
        vm.power.root_size = wanted
    except _LIVE_ERRORS as e:
        provider._event(vm, "Warning", "ResizeFailed", f"root disk: {e}")
