"""One VM pod as the provider keeps it, and the narrow view of the provider its parts get.

The parts (hibernation, live resize, migration) act on a `VM` and reach the provider only
through `VMHost`: an event, a task, a log path, a status push, a machine launched. They never
import the provider, so the provider composes them and not the other way round.

`Launch` is what a restarted agent needs to launch the VM's machine again; it is kept in the
VM's `state.json` (and, for hibernation, beside the saved state) under the same keys as ever,
so that an agent adopts the VMs an older one left.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from lightkube.models.core_v1 import (
    ContainerStatus,
    PodCondition,
    PodStatus,
    ResourceRequirements,
)
from lightkube.resources.core_v1 import Pod

from ..._files import write_atomic
from ...sdk import PodRunner, Waiting
from ...sdk.provider import EventType, UpperAPI
from ._backend import DomainImport, GuestAddress, MachineHandle
from ._config import VMConfig
from ._spec import MachinePlan

__all__ = [
    "ADDRESS_ANNOTATION",
    "VM",
    "Launch",
    "PowerState",
    "ResizeState",
    "VMHost",
    "decorate",
    "pod_annotations",
]


@dataclass
class Launch:
    """How the VM's machine is launched: its shape, disks, seed and network, the live-resize
    headroom and the devices live resize plugged since (`_resize`)."""

    name: str = ""  # namespace/name
    vcpus: int = 1
    memory_mib: int = 0
    disks: list[tuple[str, str]] = field(default_factory=list)  # (path, bus); first = root
    seed: str | None = None
    network_key: str | None = None  # the pod uid the network was attached for
    max_vcpus: int | None = None
    max_memory_mib: int | None = None
    memory_slots: int = 0
    # {"cpus": [{driver, id, props}], "dimms": [{id, mib}]}: recreated for a resume
    hotplug: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    claims: list[tuple[str, str]] = field(default_factory=list)  # PVC disks: (path, serial)
    migrated_in: bool = False  # a migration target whose VM arrived: it boots like any VM
    address: str | None = None  # the guest's address (kept with a hibernated state)
    domain: DomainImport | None = None  # an imported domain: no disks, seed or network of ours

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
            "disks": [list(d) for d in self.disks],
            "seed": self.seed,
            "network_key": self.network_key,
            "max_vcpus": self.max_vcpus,
            "max_memory_mib": self.max_memory_mib,
            "memory_slots": self.memory_slots,
            "hotplug": self.hotplug,
        }
        if self.claims:
            data["claims"] = [list(c) for c in self.claims]
        if self.migrated_in:
            data["migratedIn"] = True
        if self.address is not None:
            data["address"] = self.address
        if self.domain is not None:
            data["domain"] = asdict(self.domain)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Launch:
        """A launch as `to_json` (or an older agent) wrote it; missing keys take defaults."""
        return cls(
            name=str(data.get("name", "")),
            vcpus=int(data.get("vcpus", 1)),
            memory_mib=int(data.get("memory_mib", 0)),
            disks=[(str(p), str(bus)) for p, bus in data.get("disks") or []],
            seed=data.get("seed") or None,
            network_key=data.get("network_key"),
            max_vcpus=data.get("max_vcpus"),
            max_memory_mib=data.get("max_memory_mib"),
            memory_slots=int(data.get("memory_slots") or 0),
            hotplug=dict(data.get("hotplug") or {}),
            claims=[(str(p), str(s)) for p, s in data.get("claims") or []],
            migrated_in=bool(data.get("migratedIn")),
            address=data.get("address"),
            domain=DomainImport(**data["domain"]) if data.get("domain") else None,
        )


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


@dataclass
class PowerState:
    outcome: tuple[str, str] | None = None  # (Hibernated|HibernateFailed, message)
    hibernate: bool = False  # the deleted pod asked for it
    resize: ResizeState | None = None
    pending_since: datetime | None = None
    root_size: int | None = None  # the root disk's size as last resized live


@dataclass
class VM:
    """One VM pod's bookkeeping (what outlives the agent is in `dir`)."""

    pod: Pod
    dir: Path
    plan: MachinePlan | None = None
    address: str | None = None
    image_sha256: str | None = None
    launch: Launch | None = None  # None until its disks, seed and network are made
    waiting: Waiting = field(default_factory=Waiting)  # while preparing
    status: PodStatus | None = None  # while preparing
    machine: MachineHandle | None = None
    adopted: MachineHandle | None = None  # the first run after an agent restart uses it
    ended: int | None = None  # or: that run ended (this exit code) while no agent ran
    started_wall: float = 0.0  # when the current run's machine started (epoch seconds)
    run: int = 0
    booted_at: float | None = None
    # The pod's startTime and the current run's startedAt (the guest up), kept in state.json so
    # that a restarted agent reports them unchanged, as a kubelet does.
    start_time: datetime = field(default_factory=lambda: datetime.now(UTC))
    started_at: datetime | None = None
    power: PowerState = field(default_factory=PowerState)  # hibernate, resize
    migrated: str | None = None  # migrated away: the outcome (JSON); the pod ends with the run
    guest_address: str | None = None  # an imported domain's pod IP, as its guest says (_guestaddr)

    @property
    def uid(self) -> str:
        return str(self.pod.metadata.uid)  # type: ignore[union-attr]

    @property
    def container(self) -> str:
        return str(self.pod.spec.containers[0].name)  # type: ignore[union-attr]

    @property
    def run_dir(self) -> Path:
        """QEMU's own directory (sockets, pid, console). Short: unix socket paths have a
        108-byte limit."""
        return self.dir / "m"

    @property
    def key(self) -> str:
        meta = self.pod.metadata
        assert meta is not None
        return f"{meta.namespace}/{meta.name}"

    @property
    def annotations(self) -> dict[str, str]:
        return pod_annotations(self.pod)

    @property
    def up(self) -> bool:
        """Its machine runs and the guest has booted."""
        return self.machine is not None and self.booted_at is not None

    def save(self) -> None:
        state = {
            "run": self.run,
            "address": self.address,
            "image": self.image_sha256,
            "launch": self.launch.to_json() if self.launch is not None else {},
            "startTime": self.start_time.isoformat(),
            "startedAt": self.started_at.isoformat() if self.started_at else None,
        }
        write_atomic(self.dir / "state.json", json.dumps(state))


#: The address a VM's pod asks for: the one the VM keeps (set by the VM controller).
ADDRESS_ANNOTATION = "vm.vkubelet.io/address"


def pod_annotations(pod: Pod) -> dict[str, str]:
    return dict((pod.metadata.annotations if pod.metadata else None) or {})


class VMHost(Protocol):
    """What the provider gives its parts: they act on a `VM`, the provider does the rest."""

    @property
    def config(self) -> VMConfig: ...

    @property
    def host_ip(self) -> str: ...

    @property
    def node_name(self) -> str: ...

    @property
    def upper_api(self) -> UpperAPI | None:
        """The agent's client of the cluster (None until the agent gave it)."""
        ...

    @property
    def millicpu(self) -> int: ...  # allocatable

    @property
    def memory(self) -> int: ...  # allocatable, bytes

    def event(self, vm: VM, kind: EventType, reason: str, message: str) -> None: ...

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...

    def log_path(self, uid: str, container: str, run: int) -> Path: ...

    def runner(self, vm: VM) -> PodRunner | None: ...

    def publish(self, vm: VM) -> None:
        """The running VM's pod status, reported now (not at the runner's next change)."""
        ...

    async def launch_machine(
        self, vm: VM, extra_args: tuple[str, ...] = (), *, restore: str | None = None
    ) -> MachineHandle:
        """The VM's machine, launched from `vm.launch` (`restore`: from the state its runtime
        saved, `LaunchSpec.restore`)."""
        ...

    async def discard_saved(self, reference: str) -> None:
        """The runtime's saved state of a hibernated machine, dropped (`Runtime.discard_saved`)."""
        ...

    async def claim_network(self, vm: VM) -> GuestAddress:
        """The VM's address routes to its link here from now on (a migrated guest arrived);
        the guest's view of its network (address, prefix, gateway) on this node."""
        ...


def decorate(
    status: PodStatus, power: PowerState, container: str, container_id: str | None = None
) -> None:
    """What only the VM knows on the status the SDK built: the running machine's container ID
    (`<runtime>://<pid or domain id>`, as a kubelet's names its runtime: the VM controller's
    status.runtime), a hibernation's outcome as the container's final state, the kubelet's
    in-place resize fields."""
    if container_id is not None:
        for cs in status.containerStatuses or []:
            if cs.name == container:
                cs.containerID = container_id
    if power.outcome is not None:
        reason, message = power.outcome
        for cs in status.containerStatuses or []:
            if cs.name == container and cs.state is not None and cs.state.terminated is not None:
                cs.state.terminated.reason = reason
                cs.state.terminated.message = message or None
    if power.resize is not None:
        _decorate_resize(status, power.resize, container, power.pending_since)


def _decorate_resize(
    status: PodStatus, state: ResizeState, container: str, since: datetime | None
) -> None:
    for cs in status.containerStatuses or []:
        if isinstance(cs, ContainerStatus) and cs.name == container:
            requests = state.applied.get("requests") or None
            limits = state.applied.get("limits") or None
            cs.resources = ResourceRequirements(requests=requests, limits=limits)
            cs.allocatedResources = dict(requests or limits or {}) or None
    conditions = [c for c in status.conditions or [] if not c.type.startswith("PodResize")]
    now = (since or datetime.now(UTC)).replace(microsecond=0)

    def report(kind: str, why: tuple[str | None, str | None] | None) -> None:
        """True with `why` (reason, message); else False, once it was reported True."""
        if why is not None or kind in state.reported:
            reason, message = why or (None, None)
            on = "True" if why is not None else "False"
            conditions.append(
                PodCondition(
                    type=kind, status=on, reason=reason, message=message, lastTransitionTime=now
                )
            )
            state.reported |= {kind}

    report("PodResizePending", state.pending)
    error = ("Error", state.error) if state.error else None
    report("PodResizeInProgress", error or ((None, None) if state.in_progress else None))
    status.conditions = conditions
