"""What the provider needs from the machine and image parts, as protocols.

The provider is the kubelet's logic (what to do when); QEMU, the image store, the pod network
and the seed writer are the runtime's (how). Keeping the seam a protocol lets the provider's
unit tests run on a fake, and keeps QEMU's details out of its module: `_runtime.QemuRuntime`
is the real implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._hotplug import Hotplug, HotplugRecords
from ._machine import MachineExit, Usage
from ._qga import ExecOutput, GuestAgent
from ._qmp import Monitor

__all__ = [
    "DomainImport",
    "GuestAddress",
    "LaunchSpec",
    "MachineHandle",
    "MachineRefused",
    "PulledImage",
    "RestoreFailed",
    "Runtime",
    "SavingMachine",
    "Usage",
]


class MachineRefused(Exception):
    """This pod's machine cannot be made here, whatever retries do (a libvirt domain of its
    name that is not the pod's): `reason` is the pod's, the message says what to change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RestoreFailed(Exception):
    """A hibernated machine's saved state cannot be restored (its domain is gone, or the
    runtime refused the image): the machine boots cold. An unreachable daemon is not this."""


class MachineHandle(Protocol):
    """One running machine: a QEMU (`_machine.Machine`) or a libvirt domain
    (`_libvirt.LibvirtMachine`). Its monitor is None without QMP (libvirt, the provider's test
    fake), its guest agent None without one: no hibernation, backup or migration then. Live
    resize goes through `hotplug` (QMP's or libvirt's; None: not live)."""

    @property
    def pid(self) -> int: ...  # QEMU's process; a libvirt domain's id

    @property
    def started(self) -> float: ...  # when the machine started, epoch seconds (kubectl top)

    @property
    def runtime(self) -> str: ...  # "qemu" or "libvirt": refusals name it

    @property
    def monitor(self) -> Monitor | None: ...

    @property
    def agent(self) -> GuestAgent | None: ...

    @property
    def hotplug(self) -> Hotplug | None: ...

    @property
    def console_log(self) -> Path: ...

    @property
    def console_socket(self) -> Path: ...

    async def wait(self) -> MachineExit: ...

    async def wait_guest_agent(self, timeout: float) -> None: ...  # noqa: ASYNC109

    async def exec(
        self,
        argv: Sequence[str],
        stdin: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109 - the guest agent's own limit
    ) -> ExecOutput: ...

    async def stop(self, grace: float) -> MachineExit: ...

    async def end(self, outcome: MachineExit) -> MachineExit: ...

    async def kill(self) -> None: ...

    async def usage(self) -> Usage: ...


@runtime_checkable
class SavingMachine(Protocol):
    """A machine whose runtime saves its memory and device state itself, with the machine's
    definition (libvirt's managed save), rather than through a QMP monitor."""

    @property
    def reference(self) -> str: ...  # what a launch's `restore` names (a domain's UUID)

    async def save_state(self, timeout: float) -> str:  # noqa: ASYNC109
        """Save and stop; what was saved, for the record. Raises MachineError, the guest
        running on, when the runtime refused or took too long."""
        ...


@dataclass(frozen=True)
class PulledImage:
    path: Path
    sha256: str
    size: int  # virtual size, bytes
    format: str = "qcow2"  # or "raw"


@dataclass(frozen=True)
class GuestAddress:
    address: str  # the pod IP
    netns: str | None
    prefix: int = 32  # the guest's view: address/prefix, default route via gateway
    gateway: str | None = None


@dataclass(frozen=True)
class DomainImport:
    """An existing libvirt domain a machine runs as (`_domainimport`): started and stopped,
    never defined or undefined by the runtime; `policy` is what deleting its VirtualMachine
    does to it (Retain or Delete)."""

    name: str  # the domain's
    machine: str  # the machine id (the VirtualMachine's uid)
    owner: str  # namespace/name of the VirtualMachine
    policy: str = "Retain"


@dataclass(frozen=True)
class LaunchSpec:
    name: str  # namespace/name
    run_dir: Path  # the machine's own directory (sockets, console log)
    vcpus: int
    memory_mib: int
    disks: tuple[tuple[Path, str], ...]  # (qcow2 path, bus); first = root
    seed: Path | None
    network_key: str | None  # the pod uid the network was attached for
    accel: str
    # The address the guest was configured with (its seed): a relaunch after the host's
    # network was reset (a reboot) must attach that one again, not the first free one.
    network_address: str | None = None
    # Live resize and hibernation (`_resize`, `_hibernate`): headroom, the devices live resize
    # plugged since the machine was first made (a resume or relaunch recreates them: with QEMU
    # options, in a domain's XML), and extra QEMU options.
    max_vcpus: int | None = None
    max_memory_mib: int | None = None
    memory_slots: int = 0
    hotplug: HotplugRecords = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    # PVC disks (`_volumes`): (qcow2 path, serial), attached after the seed as virtio disks.
    claims: tuple[tuple[Path, str], ...] = ()
    # A live migration's target: QEMU waits for the state (`-incoming defer`) and its disks
    # may be written by others too (the NBD exports the source mirrors onto).
    incoming: bool = False
    # A hibernated machine saved by its runtime (`SavingMachine.reference`): the
    # launch restores it instead of booting; RestoreFailed when it cannot.
    restore: str | None = None
    # An imported domain (libvirt): started as it is defined; disks, seed and network unused.
    domain: DomainImport | None = None


class Runtime(Protocol):
    """The machine and image parts, as the provider uses them."""

    def translate(self, image: str) -> tuple[str, str | None]:
        """(url, sha256) for a pod's image; raises ValueError (TranslationError) naming why."""
        ...

    def set_translation_overrides(self, data: Mapping[str, Any] | None, origin: str) -> None:
        """The ConfigMap's data (None: it is gone); its rules win. Raises ValueError naming the
        field at fault (the previous rules stay)."""
        ...

    async def pull(
        self, image: str, url: str, sha256: str | None, progress: Callable[[int, int | None], None]
    ) -> PulledImage: ...

    async def create_overlay(self, base: PulledImage, path: Path, size: int | None) -> None: ...

    async def create_blank(self, path: Path, size: int) -> None: ...

    async def grow_disk(self, path: Path, size: int) -> None:
        """A powered-off machine's disk (made by `create_overlay`/`create_blank`) grown to
        `size` bytes before it boots; never shrunk (a smaller size is ignored)."""
        ...

    def write_seed(
        self,
        path: Path,
        *,
        pod_name: str,
        pod_namespace: str,
        pod_uid: str,
        annotations: Mapping[str, str],
        files: Mapping[str, bytes],
        network_key: str | None,
        secret_files: Collection[str] = (),
    ) -> None:
        """The cloud-init seed; raises ValueError (CloudInitError) naming the annotation."""
        ...

    async def attach_network(
        self, key: str, address: str | None = None, *, standby: bool = False
    ) -> GuestAddress:
        """The pod's network (idempotent per key); `address`: the one its VM keeps (raises
        `_net.AddressRefused` when this node cannot give it); `standby`: a migration target's,
        routed here only once `claim_network` says the guest arrived."""
        ...

    async def claim_network(self, key: str) -> GuestAddress:
        """The guest's address routes to this pod's link from now on (a migration arrived)."""
        ...

    async def detach_network(self, key: str) -> None: ...

    async def launch(self, spec: LaunchSpec) -> MachineHandle: ...

    async def adopt(self, run_dir: Path) -> MachineHandle | None: ...

    async def probe_accel(self, mode: str) -> tuple[str, str]:
        """(accel, reason) for `auto|kvm|tcg`."""
        ...

    async def host_resources(self) -> tuple[int, int] | None:
        """(millicores, memory bytes) of the host the machines run on when it may not be this
        one (a libvirt daemon's host); None: this host's."""
        ...

    async def ping(self) -> None:
        """Raises, saying why, when this node cannot run machines (a tool missing, the libvirt
        daemon unreachable): the node is NotReady with that message."""
        ...

    async def check_machine(
        self, namespace: str, name: str, pod_uid: str, *, restoring: str | None = None
    ) -> None:
        """Raises MachineRefused when the pod's machine cannot be made (before its disks are);
        `restoring`: the hibernated machine's saved state (`Launch.restore`) the pod resumes,
        which is not in its way."""
        ...

    async def discard_saved(self, reference: str) -> None:
        """Drop a hibernated machine's state that `SavingMachine.save_state` kept (the domain
        and its managed save image); nothing for a runtime that keeps none."""
        ...

    async def check_import(self, request: DomainImport) -> str:
        """The UUID of the existing domain the pod asks to run as; MachineRefused (nothing
        changed) when it cannot: none of that name, another machine's, lacking a console or
        guest agent channel, or a runtime that imports nothing."""
        ...

    async def release_import(self, uuid: str, machine: str, *, delete: bool) -> None:
        """The machine's VirtualMachine is gone: its imported domain is undefined (`delete`)
        or left with vkubelet's metadata removed; a domain not claimed by `machine` is left."""
        ...

    def gc_images(self, in_use: Collection[str]) -> list[str]: ...
