"""Hibernation: a VM pod deleted with `vm.vkubelet.io/power-off: Hibernate` saves its RAM and
device state into its machine's persistent directory; the machine's next pod resumes from it.

Why QEMU migration to a file: QEMU 7.2 has no `file:` migration URI, but `migrate` to
`exec:cat > FILE` streams the same state a live migration sends (zero pages skipped, so the file
is about the guest's used memory), and a QEMU started with `-incoming exec:cat FILE` loads it.
The guest is paused first (`stop`): nothing is dirtied while the state is written, so the
migration is one pass. The command line is a shell's, so the path is quoted, and it is made of
the node's stateDir and a machine id checked to be a plain name: no pod field reaches it as is.

Resuming needs the *same* machine: the same disks (the machine's persistent root overlay,
unchanged since the save: nothing but the hibernated QEMU wrote it, and the machine is never run
twice), the same device layout (vCPUs, memory, headroom and the devices hotplugged by live
resize, all recorded in `meta.json` beside the state). A layout that no longer matches (the
new pod has other disks) is refused and the machine boots cold; the state is then dropped.

The machine's directory is `_persist`'s (`<stateDir>/machines/<machine>/`).

With the libvirt runtime the state is libvirt's own (managed save, `SavingMachine`): kept with
the domain on the daemon's host, not in a file here; `meta.json` names the domain (URI, UUID)
and the next pod's launch restores it (`LaunchSpec.restore`). Dropping such a state removes
the domain and its image (`VMHost.discard_saved`). A state is resumed only by the runtime and
daemon that saved it: another (the node's config changed) is `ResumeRefused`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lightkube.resources.core_v1 import Pod

from ..._files import private_dir, write_atomic
from . import _persist, _resize
from ._backend import MachineHandle, RestoreFailed, SavingMachine
from ._config import VMConfig
from ._machine import MachineError, MachineExit
from ._net import readdress
from ._qmp import ExecuteError, Monitor, MonitorUnavailable
from ._vm import VM, Launch, ResizeState, VMHost, pod_annotations

__all__ = [
    "HIBERNATED",
    "HIBERNATE_FAILED",
    "POWER_OFF_ANNOTATION",
    "HibernateError",
    "Saved",
    "hibernate",
    "incoming_args",
    "launch",
    "machine_dir",
    "power_off",
    "resume",
    "saved_state",
    "wants_hibernate",
]

POWER_OFF_ANNOTATION = "vm.vkubelet.io/power-off"
HIBERNATED = "Hibernated"
HIBERNATE_FAILED = "HibernateFailed"


class HibernateError(RuntimeError):
    """Saving or loading the state failed; the message says where."""


def machine_dir(pod: Pod, state_dir: Path) -> Path | None:
    """The persistent directory of the pod's machine; None for a plain pod or an unsafe id
    (which `_persist` refuses with a clear error when the disks are prepared)."""
    try:
        return _persist.machine_dir(state_dir, pod)
    except ValueError:
        return None


def wants_hibernate(pod: Pod) -> bool:
    return pod_annotations(pod).get(POWER_OFF_ANNOTATION, "").strip().lower() == "hibernate"


def _state_dir(directory: Path) -> Path:
    return directory / "hibernate"


@dataclass(frozen=True)
class Saved:
    """A saved state: the file (or the libvirt domain keeping it) and the launch layout it
    needs."""

    state: Path
    launch: Launch
    saved_at: float
    size: int
    domain: str | None = None  # libvirt's managed save: the domain's UUID (no state file)
    uri: str | None = None  # ... on this daemon

    def here(self, config: VMConfig) -> str | None:
        """Why this node cannot resume the state, or None when it can: only the runtime (and
        the libvirt daemon) that saved it can."""
        if self.domain is None:
            if config.runtime != "qemu":
                return f"the state was saved by the qemu runtime; this node's is {config.runtime}"
            return None
        if config.runtime != "libvirt" or config.libvirt_uri != self.uri:
            now = config.libvirt_uri if config.runtime == "libvirt" else "the qemu runtime"
            return f"the state is kept by libvirt {self.uri}; this node uses {now}"
        return None

    def compatible(self, launch: Launch) -> str | None:
        """Why `launch` cannot resume this state, or None when it can: the writable disks must
        be the very files the hibernated guest had (the seed, read-only, may be another)."""
        mine = [path for path, _ in launch.disks]
        saved = [path for path, _ in self.launch.disks]
        if mine != saved:
            return (
                f"the pod's disks {mine} are not the hibernated machine's {saved} "
                "(only disks kept in the machine's directory survive its pods)"
            )
        if [p for p, _ in launch.claims] != [p for p, _ in self.launch.claims]:
            return "the pod's persistentVolumeClaim disks differ from the hibernated machine's"
        if bool(launch.seed) != bool(self.launch.seed):
            return "the seed disk differs"
        return None


def saved_state(directory: Path | None) -> Saved | None:
    if directory is None:
        return None
    where = _state_dir(directory)
    try:
        meta = json.loads((where / "meta.json").read_text())
        state = where / "state"
        launch = Launch.from_json(dict(meta["launch"]))
        if (kept := meta.get("libvirt")) is not None:
            domain, uri = str(kept["domain"]), str(kept["uri"])
            return Saved(state, launch, float(meta["savedAt"]), 0, domain, uri)
        return Saved(state, launch, float(meta["savedAt"]), state.stat().st_size)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def drop_state(directory: Path) -> None:
    shutil.rmtree(_state_dir(directory), ignore_errors=True)


async def _migration_done(monitor: Monitor, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
    """Until QEMU's migration job ends; its last `query-migrate` reply."""
    deadline = time.monotonic() + timeout
    while True:
        info = await monitor.execute("query-migrate")
        status = str(info.get("status", ""))
        if status in ("completed", "failed", "cancelled"):
            return dict(info)
        if time.monotonic() > deadline:
            with contextlib.suppress(ExecuteError, MonitorUnavailable):
                await monitor.execute("migrate_cancel")
            raise HibernateError(f"saving the state took longer than {timeout:g} s")
        await asyncio.sleep(0.05)


async def hibernate(
    monitor: Monitor,
    directory: Path,
    launch: Launch,
    timeout: float = 120.0,  # noqa: ASYNC109
) -> str:
    """Pause the guest and save its state into `directory`; what was saved, for the record. The
    caller then ends QEMU (`Machine.end`). On failure the guest runs on (HibernateError): the
    caller shuts it down normally."""
    where = private_dir(_state_dir(directory))
    partial = where / "state.partial"
    partial.unlink(missing_ok=True)
    # The guest's memory: created owner-only here, so that QEMU's `cat >` keeps that mode.
    os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    (where / "meta.json").unlink(missing_ok=True)
    started = time.monotonic()
    try:
        await monitor.execute("stop")
        await monitor.execute(
            "migrate", {"uri": "exec:cat > " + shlex.quote(str(partial.resolve()))}
        )
        info = await _migration_done(monitor, timeout)
        if info.get("status") != "completed":
            why = info.get("error-desc", "no reason given")
            raise HibernateError(f"saving the state {info.get('status')}: {why}")
    except (ExecuteError, MonitorUnavailable, HibernateError) as e:
        with contextlib.suppress(ExecuteError, MonitorUnavailable):
            await monitor.execute("cont")  # the guest runs on
        if isinstance(e, HibernateError):
            raise
        raise HibernateError(f"QEMU refused to save the state: {e}") from None
    partial.replace(where / "state")
    meta = {
        "launch": launch.to_json(),
        "savedAt": time.time(),
        "seconds": time.monotonic() - started,
    }
    write_atomic(where / "meta.json", json.dumps(meta), mode=0o600)
    size = (where / "state").stat().st_size
    return f"state saved ({size} bytes) in {time.monotonic() - started:.2f} s"


def incoming_args(saved: Saved) -> tuple[str, ...]:
    return ("-incoming", "exec:cat " + shlex.quote(str(saved.state.resolve())))


def resumed_launch(launch: Launch, saved: Saved) -> Launch:
    """The pod's launch with the saved machine's layout (it must be the same to load the state)."""
    layout = saved.launch
    return replace(
        launch,
        vcpus=layout.vcpus,
        memory_mib=layout.memory_mib,
        max_vcpus=layout.max_vcpus,
        max_memory_mib=layout.max_memory_mib,
        memory_slots=layout.memory_slots,
        hotplug=layout.hotplug,
    )


async def resume(monitor: Monitor, directory: Path, timeout: float = 120.0) -> float:  # noqa: ASYNC109
    """Wait until the incoming state is loaded, run the guest, drop the state; seconds taken."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        try:
            status = await monitor.status()
        except MonitorUnavailable as e:
            raise HibernateError(f"QEMU ended while loading the state: {e}") from None
        if status != "inmigrate":
            break
        if time.monotonic() > deadline:
            raise HibernateError(f"loading the state took longer than {timeout:g} s")
        await asyncio.sleep(0.05)
    info = await monitor.execute("query-migrate")
    if info.get("status") not in (None, "completed"):
        raise HibernateError(f"loading the state {info.get('status')}")
    if status in ("paused", "postmigrate", "prelaunch"):
        await monitor.execute("cont")
    drop_state(directory)
    return time.monotonic() - started


# -- the pod's power cycle ----------------------------------------------------------------------
async def launch(host: VMHost, vm: VM) -> MachineHandle:
    """Start the VM's machine: resumed from its saved state if it has one, else a cold boot
    with the pod's current size (a resize deferred to the next power cycle lands here)."""
    directory = machine_dir(vm.pod, host.config.state_dir)
    saved = saved_state(directory)
    assert vm.launch is not None
    if saved is not None and directory is not None:
        why = saved.here(host.config) or saved.compatible(vm.launch)
        if why is not None:
            host.event(vm, "Warning", "ResumeRefused", f"booting cold: {why}")
            await _drop(host, vm, directory, saved)
        else:
            handle = await _resume(host, vm, directory, saved)
            if handle is not None:
                return handle
    if vm.plan is not None:  # the pod's size now
        vm.launch = _resize.sized(vm.launch, vm.pod, vm.plan, host.config)
        vm.save()
    vm.power.resize = ResizeState(applied=_resize.resources(vm.pod))
    vm.power.outcome = None
    return await host.launch_machine(vm)


async def _drop(host: VMHost, vm: VM, directory: Path, saved: Saved) -> None:
    """A state that will not be resumed: the runtime's part (a libvirt domain) and the file."""
    if saved.domain is not None and saved.here(host.config) is None:
        try:
            await host.discard_saved(saved.domain)
        except MachineError as e:
            message = f"the hibernated domain {saved.domain} was not removed: {e}"
            host.event(vm, "Warning", "DiscardFailed", message)
    drop_state(directory)


async def _resume(host: VMHost, vm: VM, directory: Path, saved: Saved) -> MachineHandle | None:
    assert vm.launch is not None
    vm.launch = resumed_launch(vm.launch, saved)
    vm.save()
    if saved.domain is not None:  # libvirt's managed save: restored by the launch itself
        started = time.monotonic()
        try:
            handle = await host.launch_machine(vm, restore=saved.domain)
        except RestoreFailed as e:
            host.event(vm, "Warning", "ResumeFailed", f"booting cold: {e}")
            await _drop(host, vm, directory, saved)
            return None
        drop_state(directory)
        took = time.monotonic() - started
        return await _resumed(host, vm, handle, saved, took)
    handle = await host.launch_machine(vm, incoming_args(saved))
    if handle.monitor is None:
        return handle
    try:
        took = await resume(handle.monitor, directory)
    except (HibernateError, ExecuteError, MonitorUnavailable) as e:
        host.event(vm, "Warning", "ResumeFailed", f"booting cold: {e}")
        with contextlib.suppress(Exception):
            await handle.kill()
        drop_state(directory)
        return None
    return await _resumed(host, vm, handle, saved, took)


async def _resumed(
    host: VMHost, vm: VM, handle: MachineHandle, saved: Saved, took: float
) -> MachineHandle:
    """The resumed machine's bookkeeping: its size, its address, the event."""
    assert vm.launch is not None
    running = _resize.running_size(vm.launch)
    vm.power.resize = ResizeState(applied=_resize.resources(vm.pod))
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
    old = saved.launch.address
    if old and vm.address and old != vm.address and handle.agent is not None:
        # The guest still has its previous pod's address (a pod that does not ask for its
        # VM's address, `ADDRESS_ANNOTATION`, gets a free one): it gets this pod's, so that
        # probes, port-forward and Services reach it.
        network = await host.claim_network(vm)
        why = await readdress(
            handle.agent, network.address, network.prefix, network.gateway or "", timeout=10
        )
        if why is not None:
            message = f"the resumed guest keeps its previous address {old} (not {vm.address}): "
            host.event(vm, "Warning", "ReaddressFailed", message + why)
    what = f"{saved.size} bytes of state" if saved.domain is None else "libvirt's managed save"
    host.event(
        vm,
        "Normal",
        "Resumed",
        f"resumed from hibernation in {took:.2f} s ({what}, "
        f"saved {time.time() - saved.saved_at:.0f} s ago)",
    )
    return handle


def power_off(
    host: VMHost, vm: VM, handle: MachineHandle, grace: float
) -> Coroutine[Any, Any, object] | None:
    """Hibernation instead of a shutdown, when the pod asks for it and has a machine."""
    directory = machine_dir(vm.pod, host.config.state_dir)
    if directory is None or not (vm.power.hibernate or wants_hibernate(vm.pod)):
        return None
    if handle.monitor is None:
        if isinstance(handle, SavingMachine):
            return _save_or_stop(host, vm, handle, handle, directory, grace)
        why = f"the {handle.runtime} runtime cannot hibernate a VM yet; shutting down"
        host.event(vm, "Warning", HIBERNATE_FAILED, why)
        return None
    return _hibernate_or_stop(host, vm, handle, handle.monitor, directory, grace)


async def _save_or_stop(
    host: VMHost,
    vm: VM,
    handle: MachineHandle,
    saving: SavingMachine,
    directory: Path,
    grace: float,
) -> object:
    """Hibernation by the runtime itself (libvirt's managed save). The record is written
    first, naming the domain: an agent that stops mid-save leaves a state its next pod finds."""
    assert vm.launch is not None
    where = private_dir(_state_dir(directory))
    meta = {
        "launch": replace(vm.launch, address=vm.address).to_json(),
        "savedAt": time.time(),
        "libvirt": {"uri": host.config.libvirt_uri, "domain": saving.reference},
    }

    async def save(timeout: float) -> str:  # noqa: ASYNC109
        write_atomic(where / "meta.json", json.dumps(meta), mode=0o600)
        return await saving.save_state(timeout)

    return await _saved_or_stopped(host, vm, handle, directory, grace, save, MachineError)


async def _hibernate_or_stop(
    host: VMHost, vm: VM, handle: MachineHandle, monitor: Monitor, directory: Path, grace: float
) -> object:
    assert vm.launch is not None
    launch = replace(vm.launch, address=vm.address)

    async def save(timeout: float) -> str:  # noqa: ASYNC109
        return await hibernate(monitor, directory, launch, timeout=timeout)

    return await _saved_or_stopped(host, vm, handle, directory, grace, save, HibernateError)


async def _saved_or_stopped(
    host: VMHost,
    vm: VM,
    handle: MachineHandle,
    directory: Path,
    grace: float,
    save: Callable[[float], Awaitable[str]],
    refused: type[Exception],
) -> object:
    """The machine's state saved within 80 % of the grace period and the container ended as
    hibernated; a save that fails leaves no state behind and the guest is shut down with the
    rest of the grace."""
    started = time.monotonic()
    try:
        message = await save(max(grace * 0.8, 5.0))
    except (refused, OSError) as e:
        vm.power.outcome = (HIBERNATE_FAILED, str(e))
        host.event(vm, "Warning", HIBERNATE_FAILED, f"shutting down: {e}")
        drop_state(directory)
        return await handle.stop(max(grace - (time.monotonic() - started), 1.0))
    vm.power.outcome = (HIBERNATED, message)
    host.event(vm, "Normal", HIBERNATED, message)
    return await handle.end(MachineExit(0, HIBERNATED, message))
