# ruff: noqa: ASYNC109, ASYNC240
"""The VM provider on a fake runtime: machines that boot at once (or when told), a runtime that
records launches, seeds and networks, events kept in lists, and the provider built over them.
Shared by the provider's tests of pods, persistent machines and migration."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightkube.resources.core_v1 import Pod

from vkubelet.providers.vm._backend import (
    DomainImport,
    GuestAddress,
    LaunchSpec,
    MachineRefused,
    PulledImage,
    Usage,
)
from vkubelet.providers.vm._config import VMConfig
from vkubelet.providers.vm._hotplug import Hotplug
from vkubelet.providers.vm._machine import MachineExit
from vkubelet.providers.vm._provider import VMProvider
from vkubelet.providers.vm._qga import ExecOutput, GuestAgent
from vkubelet.providers.vm._qmp import Monitor

GI = 2**30


class FakeMachine:
    count = 0
    runtime = "fake"

    def __init__(self, spec: LaunchSpec) -> None:
        FakeMachine.count += 1
        self.pid = 1000 + FakeMachine.count
        self.started = time.time()
        self.spec = spec
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        self.console_log = spec.run_dir / "console.log"
        self.console_socket = spec.run_dir / "console.sock"
        self.agent_up = asyncio.Event()
        self.monitor: Monitor | None = None  # no QEMU: no hibernation, live resize, migration
        self.agent: GuestAgent | None = None
        self.hotplug: Hotplug | None = None  # no live resize
        self.exit: asyncio.Future[MachineExit] = asyncio.get_running_loop().create_future()
        self.stops: list[float] = []
        self.execs: list[tuple[list[str], bytes]] = []
        self.address: str | None = None  # what its guest says it has (`guest_address`)
        self.address_reads = 0
        self.console(b"SeaBIOS\r\nbooting vm\r\n")

    def console(self, data: bytes) -> None:
        with self.console_log.open("ab") as f:
            f.write(data)

    def power_off(self, code: int = 0) -> None:
        self.console(b"reboot: Power down\r\n")
        if not self.exit.done():
            self.exit.set_result(MachineExit(code, "Completed" if code == 0 else "Error"))

    async def wait(self) -> MachineExit:
        return await asyncio.shield(self.exit)

    async def wait_guest_agent(self, timeout: float) -> None:
        await asyncio.wait_for(self.agent_up.wait(), timeout)

    async def exec(
        self, argv: Sequence[str], stdin: bytes = b"", timeout: float | None = None
    ) -> ExecOutput:
        self.execs.append((list(argv), stdin))
        if argv[:1] == ["false"]:
            return ExecOutput(3, b"", b"no\n")
        return ExecOutput(0, b"out:" + stdin, b"")

    async def stop(self, grace: float) -> MachineExit:
        self.stops.append(grace)
        self.console(b"shutdown requested\r\n")
        self.power_off()
        return await self.wait()

    async def end(self, outcome: Any) -> MachineExit:
        self.power_off(outcome.code)
        return await self.wait()

    async def kill(self) -> None:
        if not self.exit.done():
            self.exit.set_result(MachineExit(137, "Error"))

    async def usage(self) -> Usage:
        return Usage(cpu_ns=5 * 10**9, memory_bytes=300 * 2**20)

    async def guest_address(self) -> str | None:
        self.address_reads += 1
        return self.address


@dataclass
class FakeRuntime:
    rules: dict[str, str] = field(default_factory=lambda: {"vm.vkubelet.io/tiny": "file:///t"})
    machines: dict[Path, FakeMachine] = field(default_factory=dict)
    launches: list[LaunchSpec] = field(default_factory=list)
    seeds: list[dict[str, Any]] = field(default_factory=list)
    detached: list[str] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)  # discard_saved
    attached: list[tuple[str, str | None, bool]] = field(default_factory=list)
    boot_at_once: bool = True
    refused: str | None = None  # check_machine refuses every machine, saying this
    unhealthy: str | None = None  # ping raises, saying this
    remote_host: tuple[int, int] | None = None  # host_resources: (millicores, bytes)
    imports: dict[str, str] = field(default_factory=dict)  # importable domains: name -> UUID
    released: list[tuple[str, str, bool]] = field(default_factory=list)  # release_import
    grown: list[tuple[Path, int]] = field(default_factory=list)  # grow_disk

    def set_translation_overrides(self, data: Mapping[str, Any] | None, origin: str) -> None:
        pass

    def translate(self, image: str) -> tuple[str, str | None]:
        if image not in self.rules:
            raise ValueError(f"image {image!r}: no translation rule matches")
        return self.rules[image], None

    async def pull(
        self, image: str, url: str, sha256: str | None, progress: Callable[[int, int | None], None]
    ) -> PulledImage:
        progress(50, 100)
        progress(100, 100)
        return PulledImage(Path("/images/data/abc"), "abc", GI)

    async def create_overlay(self, base: PulledImage, path: Path, size: int | None) -> None:
        path.write_bytes(b"overlay")

    async def create_blank(self, path: Path, size: int) -> None:
        path.write_bytes(b"blank")

    async def grow_disk(self, path: Path, size: int) -> None:
        self.grown.append((path, size))

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
        self.seeds.append({"name": pod_name, "files": dict(files)})
        path.write_bytes(b"seed")

    async def attach_network(
        self, key: str, address: str | None = None, *, standby: bool = False
    ) -> GuestAddress:
        self.attached.append((key, address, standby))
        return GuestAddress(address or "10.213.0.2", f"vkvm-{key[:8]}", 24, "10.213.0.1")

    async def claim_network(self, key: str) -> GuestAddress:
        return GuestAddress("10.213.0.2", f"vkvm-{key[:8]}", 24, "10.213.0.1")

    async def detach_network(self, key: str) -> None:
        self.detached.append(key)

    async def launch(self, spec: LaunchSpec) -> FakeMachine:
        self.launches.append(spec)
        machine = FakeMachine(spec)
        if self.boot_at_once:
            machine.agent_up.set()
        self.machines[spec.run_dir] = machine
        return machine

    async def adopt(self, run_dir: Path) -> FakeMachine | None:
        machine = self.machines.get(run_dir)
        return machine if machine is not None and not machine.exit.done() else None

    async def probe_accel(self, mode: str) -> tuple[str, str]:
        return "tcg", "KVM cannot boot a guest here"

    async def host_resources(self) -> tuple[int, int] | None:
        return self.remote_host

    async def ping(self) -> None:
        if self.unhealthy is not None:
            raise RuntimeError(self.unhealthy)

    async def check_machine(
        self, namespace: str, name: str, pod_uid: str, *, restoring: str | None = None
    ) -> None:
        if self.refused is not None:
            raise MachineRefused("DomainExists", self.refused)

    async def discard_saved(self, reference: str) -> None:
        self.discarded.append(reference)

    async def check_import(self, request: DomainImport) -> str:
        if request.name not in self.imports:
            raise MachineRefused("DomainNotFound", f"domain {request.name!r} does not exist")
        return self.imports[request.name]

    async def release_import(self, uuid: str, machine: str, *, delete: bool) -> None:
        self.released.append((uuid, machine, delete))

    def gc_images(self, in_use: Collection[str]) -> list[str]:
        return []


@dataclass
class Events:
    pod: list[tuple[str, str, str]] = field(default_factory=list)
    node: list[tuple[str, str, str]] = field(default_factory=list)

    def pod_event(self, pod: Pod, type: str, reason: str, message: str) -> None:
        self.pod.append((type, reason, message))

    def node_event(self, node_name: str, type: str, reason: str, message: str) -> None:
        self.node.append((type, reason, message))


class FakeRunner:
    """A pod's runner as the migration parts (`Migrations`) use it: the conditions they set
    and whether they ended its run."""

    def __init__(self) -> None:
        self.conditions: dict[str, tuple[str, str, str]] = {}
        self.finished = False

    def set_condition(self, kind: str, status: str, reason: str, message: str) -> None:
        self.conditions[kind] = (status, reason, message)

    def finish(self) -> None:
        self.finished = True


def make_pod(name: str = "vm", image: str = "vm.vkubelet.io/tiny", **spec: Any) -> Pod:
    body = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "vm", "image": image}], **spec},
    }
    return Pod.from_dict(body)  # type: ignore[return-value]


def provider_for(
    tmp_path: Path, runtime: FakeRuntime, events: Events, *, gc_interval: float = 600.0
) -> VMProvider:
    config = VMConfig(
        state_dir=tmp_path / "s",
        image_store=tmp_path / "s" / "images",
        reserved_millicpu=1000,
        reserved_memory=GI,
        image_gc_interval=gc_interval,
    )
    provider = VMProvider(
        "hv-1",
        config,
        runtime,
        host_ip="192.0.2.1",
        events=events,
        host_millicpu=4000,
        host_memory=8 * GI,
    )
    provider.notify_pods(PUSHED.append)
    return provider


PUSHED: list[Pod] = []


async def state(provider: VMProvider, name: str = "vm") -> tuple[str, Any]:
    pod = await provider.get_pod("ns", name)
    assert pod is not None and pod.status is not None
    statuses = pod.status.containerStatuses or []
    return str(pod.status.phase), statuses[0] if statuses else None


async def launched(runtime: FakeRuntime) -> bool:
    return bool(runtime.machines)
