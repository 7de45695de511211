"""Live resize as the provider does it, whatever the runtime: it plugs through the machine's
`Hotplug` (QMP's or libvirt's; here a fake one), onlines through the guest agent, and reports
the size in the pod's status. The two real implementations: QMP's command sequence below,
libvirt's in test_libvirt.py (libvirt's test driver) and tests/integration/vm."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vkubelet.providers.vm._hotplug import QmpHotplug, ResizeError
from vkubelet.providers.vm._provider import VMProvider
from vkubelet.providers.vm._qga import GuestAgent
from vkubelet.sdk import ResolvedPod
from vkubelet.testing.harness import eventually

from .fakes import Events, FakeMachine, FakeRuntime, make_pod

BLOCK = 128


class FakeGuest(GuestAgent):
    """A guest whose kernel sees what is plugged offline until its agent onlines it."""

    def __init__(self, vcpus: int, memory_mib: int) -> None:
        super().__init__(Path("/nonexistent"))
        self.cpus = [True] * vcpus
        self.blocks = [True] * (memory_mib // BLOCK)

    async def call(
        self,
        command: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        if command == "guest-get-vcpus":
            return [{"logical-id": i, "online": on} for i, on in enumerate(self.cpus)]
        if command == "guest-get-memory-blocks":
            return [{"phys-index": i, "online": on} for i, on in enumerate(self.blocks)]
        assert arguments is not None
        if command == "guest-set-vcpus":
            for cpu in arguments["vcpus"]:
                self.cpus[cpu["logical-id"]] = True
            return len(arguments["vcpus"])
        if command == "guest-set-memory-blocks":
            for block in arguments["mem-blks"]:
                self.blocks[block["phys-index"]] = True
            return [
                {"phys-index": b["phys-index"], "response": "success"}
                for b in arguments["mem-blks"]
            ]
        raise AssertionError(command)


class FakeHotplug:
    """A runtime's `Hotplug`: plugs into `guest` (offline), or refuses memory with `refuse`."""

    def __init__(self, guest: FakeGuest, refuse: str | None = None) -> None:
        self.guest, self.refuse = guest, refuse
        self.plugged: list[tuple[str, int]] = []

    async def plug_vcpu(self, name: str, total: int) -> dict[str, Any]:
        self.guest.cpus.append(False)
        assert len(self.guest.cpus) == total
        self.plugged.append((name, total))
        return {"id": name}

    async def plug_memory(self, name: str, mib: int) -> dict[str, Any]:
        if self.refuse is not None:
            raise ResizeError(self.refuse)
        self.guest.blocks += [False] * (mib // BLOCK)
        self.plugged.append((name, mib))
        return {"id": name, "mib": mib}

    async def root_disk_size(self) -> int:
        return 2**30

    async def grow_root_disk(self, size: int) -> None:
        raise AssertionError("not asked")


def _sized(cpu: str, memory: str) -> ResolvedPod:
    resources = {"limits": {"cpu": cpu, "memory": memory}}
    pod = make_pod(
        containers=[{"name": "vm", "image": "vm.vkubelet.io/tiny", "resources": resources}]
    )
    return ResolvedPod(pod)


async def _running(provider: VMProvider, runtime: FakeRuntime) -> FakeMachine:
    await provider.create_pod(_sized("1", "256Mi"))

    async def booted() -> bool:
        vm = provider.vms.get("ns/vm")
        return vm is not None and vm.booted_at is not None

    await eventually(booted)
    return next(iter(runtime.machines.values()))


async def _limits(provider: VMProvider) -> dict[str, Any]:
    pod = await provider.get_pod("ns", "vm")
    assert pod is not None and pod.status is not None and pod.status.containerStatuses
    resources = pod.status.containerStatuses[0].resources
    return dict(resources.limits or {}) if resources is not None else {}


def _conditions(pod: Any) -> dict[str, tuple[str, str | None, str | None]]:
    return {c.type: (c.status, c.reason, c.message) for c in pod.status.conditions or []}


async def test_a_resize_plugs_through_the_runtime_s_hotplug_and_the_guest_onlines_it(
    provider: VMProvider, runtime: FakeRuntime, events: Events
) -> None:
    machine = await _running(provider, runtime)
    guest = FakeGuest(1, 256)
    hotplug = FakeHotplug(guest)
    machine.agent, machine.hotplug = guest, hotplug
    await provider.update_pod(_sized("2", "768Mi"))
    assert hotplug.plugged == [("vcpu1", 2), ("dimm1", 512)]
    assert guest.cpus == [True, True] and guest.blocks == [True] * 6  # all online
    assert await _limits(provider) == {"cpu": "2", "memory": "768Mi"}
    assert ("Normal", "Resized", "2 vCPUs, 768 MiB (live)") in events.pod
    launch = provider.vms["ns/vm"].launch
    assert launch is not None
    assert launch.hotplug == {"cpus": [{"id": "vcpu1"}], "dimms": [{"id": "dimm1", "mib": 512}]}
    # the records are what the next launch of the machine starts with (a relaunch, a resume)
    assert provider._launch_spec(provider.vms["ns/vm"]).hotplug == launch.hotplug


async def test_a_plug_the_runtime_refuses_fails_the_resize_with_its_words_and_the_vm_runs_on(
    provider: VMProvider, runtime: FakeRuntime, events: Events
) -> None:
    machine = await _running(provider, runtime)
    guest = FakeGuest(1, 256)
    machine.agent = guest
    machine.hotplug = FakeHotplug(guest, refuse="libvirt test:///default: no more slots")
    await provider.update_pod(_sized("2", "768Mi"))
    failed = "live resize failed: libvirt test:///default: no more slots"
    assert ("Warning", "ResizeFailed", failed) in events.pod
    pod = await provider.get_pod("ns", "vm")
    assert _conditions(pod)["PodResizeInProgress"] == ("True", "Error", failed)
    assert await _limits(provider) == {"cpu": "1", "memory": "256Mi"}  # what runs
    launch = provider.vms["ns/vm"].launch
    assert launch is not None and launch.hotplug == {"cpus": [{"id": "vcpu1"}], "dimms": []}
    assert not machine.exit.done() and not machine.stops
    # asked for what runs (the vCPU was plugged): nothing to do, and nothing is wrong any more
    await provider.update_pod(_sized("2", "256Mi"))
    pod = await provider.get_pod("ns", "vm")
    assert _conditions(pod)["PodResizeInProgress"] == ("False", None, None)
    assert await _limits(provider) == {"cpu": "2", "memory": "256Mi"}


async def test_a_machine_whose_runtime_cannot_plug_fails_the_resize_naming_the_runtime(
    provider: VMProvider, runtime: FakeRuntime, events: Events
) -> None:
    machine = await _running(provider, runtime)
    assert machine.hotplug is None
    await provider.update_pod(_sized("2", "256Mi"))
    failed = "live resize failed: the fake runtime cannot resize VMs live yet"
    assert ("Warning", "ResizeFailed", failed) in events.pod
    assert await _limits(provider) == {"cpu": "1", "memory": "256Mi"}
    assert not machine.exit.done()


class _Monitor:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any] | None]] = []

    async def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        self.calls.append((command, arguments))
        if command == "query-hotpluggable-cpus":
            return [
                {"type": "qemu64-x86_64-cpu", "props": {"socket-id": 2, "core-id": 0}},
                {"type": "qemu64-x86_64-cpu", "props": {"socket-id": 1, "core-id": 0}},
                {"type": "qemu64-x86_64-cpu", "props": {"socket-id": 0}, "qom-path": "/m/0"},
            ]
        return {}


async def test_qmp_plugs_the_first_free_cpu_slot_and_a_dimm_on_its_own_backend() -> None:
    monitor = _Monitor()
    hotplug = QmpHotplug(monitor)  # type: ignore[arg-type]
    cpu = await hotplug.plug_vcpu("vcpu1", 2)
    assert cpu == {
        "driver": "qemu64-x86_64-cpu",
        "id": "vcpu1",
        "props": {"socket-id": 1, "core-id": 0},
    }
    assert monitor.calls[-1] == (
        "device_add",
        {"driver": "qemu64-x86_64-cpu", "id": "vcpu1", "socket-id": 1, "core-id": 0},
    )
    assert await hotplug.plug_memory("dimm1", 512) == {"id": "dimm1", "mib": 512}
    assert monitor.calls[-2:] == [
        (
            "object-add",
            {"qom-type": "memory-backend-ram", "id": "mem-dimm1", "size": 512 * 2**20},
        ),
        ("device_add", {"driver": "pc-dimm", "id": "dimm1", "memdev": "mem-dimm1"}),
    ]
