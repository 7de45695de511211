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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightkube.resources.core_v1 import Pod

from ..._files import write_atomic
from . import _persist
from ._machine import Machine
from ._qmp import ExecuteError, MonitorUnavailable

__all__ = [
    "HIBERNATED",
    "HIBERNATE_FAILED",
    "MACHINE_ANNOTATION",
    "POWER_OFF_ANNOTATION",
    "HibernateError",
    "Saved",
    "controls",
    "hibernate",
    "incoming_args",
    "machine_dir",
    "resume",
    "saved_state",
    "wants_hibernate",
]

MACHINE_ANNOTATION = "vm.vkubelet.io/machine"
POWER_OFF_ANNOTATION = "vm.vkubelet.io/power-off"
HIBERNATED = "Hibernated"
HIBERNATE_FAILED = "HibernateFailed"
# What must be equal between the saved machine and the one that resumes it.
_LAYOUT = ("vcpus", "memory_mib", "max_vcpus", "max_memory_mib", "memory_slots", "hotplug")


class HibernateError(RuntimeError):
    """Saving or loading the state failed; the message says where."""


def _annotations(pod: Pod) -> dict[str, str]:
    return dict((pod.metadata.annotations if pod.metadata else None) or {})


def machine_dir(pod: Pod, state_dir: Path) -> Path | None:
    """The persistent directory of the pod's machine; None for a plain pod or an unsafe id
    (which `_persist` refuses with a clear error when the disks are prepared)."""
    try:
        return _persist.machine_dir(state_dir, pod)
    except ValueError:
        return None


def wants_hibernate(pod: Pod) -> bool:
    return _annotations(pod).get(POWER_OFF_ANNOTATION, "").strip().lower() == "hibernate"


def controls(handle: object) -> Machine | None:
    """The QEMU machine behind the provider's handle (None for a test fake: no live control)."""
    machine = getattr(handle, "machine", None)
    return machine if isinstance(machine, Machine) else None


def _state_dir(directory: Path) -> Path:
    return directory / "hibernate"


@dataclass(frozen=True)
class Saved:
    """A saved state: the file and the launch layout it needs."""

    state: Path
    launch: dict[str, Any]
    saved_at: float
    size: int

    def compatible(self, launch: dict[str, Any]) -> str | None:
        """Why `launch` cannot resume this state, or None when it can: the writable disks must
        be the very files the hibernated guest had (the seed, read-only, may be another)."""
        mine = [str(d[0]) for d in launch.get("disks", [])]
        saved = [str(d[0]) for d in self.launch.get("disks", [])]
        if mine != saved:
            return (
                f"the pod's disks {mine} are not the hibernated machine's {saved} "
                "(only disks kept in the machine's directory survive its pods)"
            )
        claims = [str(c[0]) for c in launch.get("claims") or []]
        if claims != [str(c[0]) for c in self.launch.get("claims") or []]:
            return "the pod's persistentVolumeClaim disks differ from the hibernated machine's"
        if bool(launch.get("seed")) != bool(self.launch.get("seed")):
            return "the seed disk differs"
        return None


def saved_state(directory: Path | None) -> Saved | None:
    if directory is None:
        return None
    where = _state_dir(directory)
    try:
        meta = json.loads((where / "meta.json").read_text())
        state = where / "state"
        return Saved(state, dict(meta["launch"]), float(meta["savedAt"]), state.stat().st_size)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def drop_state(directory: Path) -> None:
    shutil.rmtree(_state_dir(directory), ignore_errors=True)


async def _migration_done(machine: Machine, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
    """Until QEMU's migration job ends; its last `query-migrate` reply."""
    deadline = time.monotonic() + timeout
    while True:
        info = await machine.monitor.execute("query-migrate")
        status = str(info.get("status", ""))
        if status in ("completed", "failed", "cancelled"):
            return dict(info)
        if time.monotonic() > deadline:
            with contextlib.suppress(ExecuteError, MonitorUnavailable):
                await machine.monitor.execute("migrate_cancel")
            raise HibernateError(f"saving the state took longer than {timeout:g} s")
        await asyncio.sleep(0.05)


async def hibernate(
    machine: Machine,
    directory: Path,
    launch: dict[str, Any],
    timeout: float = 120.0,  # noqa: ASYNC109
) -> str:
    """Pause the guest and save its state into `directory`; what was saved, for the record. The
    caller then ends QEMU (`Machine.end`). On failure the guest runs on (HibernateError): the
    caller shuts it down normally."""
    where = _state_dir(directory)
    where.mkdir(parents=True, exist_ok=True)
    partial = where / "state.partial"
    partial.unlink(missing_ok=True)
    (where / "meta.json").unlink(missing_ok=True)
    started = time.monotonic()
    try:
        await machine.monitor.execute("stop")
        await machine.monitor.execute(
            "migrate", {"uri": "exec:cat > " + shlex.quote(str(partial.resolve()))}
        )
        info = await _migration_done(machine, timeout)
    except (ExecuteError, MonitorUnavailable) as e:
        await _running_again(machine)
        raise HibernateError(f"QEMU refused to save the state: {e}") from None
    except HibernateError:
        await _running_again(machine)
        raise
    if info.get("status") != "completed":
        await _running_again(machine)
        raise HibernateError(
            f"saving the state {info.get('status')}: {info.get('error-desc', 'no reason given')}"
        )
    partial.replace(where / "state")
    meta = {"launch": launch, "savedAt": time.time(), "seconds": time.monotonic() - started}
    write_atomic(where / "meta.json", json.dumps(meta))
    size = (where / "state").stat().st_size
    return f"state saved ({size} bytes) in {time.monotonic() - started:.2f} s"


async def _running_again(machine: Machine) -> None:
    with contextlib.suppress(ExecuteError, MonitorUnavailable):
        await machine.monitor.execute("cont")


def incoming_args(saved: Saved) -> tuple[str, ...]:
    return ("-incoming", "exec:cat " + shlex.quote(str(saved.state.resolve())))


def resumed_launch(launch: dict[str, Any], saved: Saved) -> dict[str, Any]:
    """The pod's launch with the saved machine's layout (it must be the same to load the state)."""
    return {**launch, **{k: saved.launch[k] for k in _LAYOUT if k in saved.launch}}


async def resume(machine: Machine, directory: Path, timeout: float = 120.0) -> float:  # noqa: ASYNC109
    """Wait until the incoming state is loaded, run the guest, drop the state; seconds taken."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        try:
            status = await machine.monitor.status()
        except MonitorUnavailable as e:
            raise HibernateError(f"QEMU ended while loading the state: {e}") from None
        if status != "inmigrate":
            break
        if time.monotonic() > deadline:
            raise HibernateError(f"loading the state took longer than {timeout:g} s")
        await asyncio.sleep(0.05)
    info = await machine.monitor.execute("query-migrate")
    if info.get("status") not in (None, "completed"):
        raise HibernateError(f"loading the state {info.get('status')}")
    if status in ("paused", "postmigrate", "prelaunch"):
        await machine.monitor.execute("cont")
    drop_state(directory)
    return time.monotonic() - started
