"""A libvirt live migration carries the console history as QEMU's does (`Migrations`): the
target pod publishes its token-checked console port beside the libvirt endpoint, the source's
agent sends its console history there once libvirt moved the domain, and the target puts it
first in its run's log. Two `Migrations` on loopback, the domains faked
(tests/integration/vm/test_vm_libvirt_migration.py moves a real one between two lab hosts)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vkubelet.providers.vm._lvmigrate import ArrivingDomain, MigratableDomain
from vkubelet.providers.vm._machine import MachineExit
from vkubelet.providers.vm._migrate import (
    DomainTarget,
    Endpoint,
    MigrationError,
    Outcome,
    Progress,
)
from vkubelet.providers.vm._migrations import Migrations
from vkubelet.providers.vm._vm import Launch
from vkubelet.sdk.logs import LogRotation
from vkubelet.testing.harness import eventually

from .fakes import FakeRunner

TOKEN = "c3" * 32
SOURCE_ANNOTATION = "vm.vkubelet.io/migration-source"
TOKEN_ANNOTATION = "vm.vkubelet.io/migration-token"
MIGRATE_TO = "vm.vkubelet.io/migrate-to"
TARGET_CONDITION = "vm.vkubelet.io/MigrationTarget"
MIGRATION = "vm.vkubelet.io/Migration"
BOOT = b"SeaBIOS\r\nvkubelet-guest: booted hostname=vm\r\ntick 1\r\ntick 2\r\n"


class SourceDomain:
    """A running libvirt machine (`MigratableDomain`): its console file, and a migration that
    prints one more line here, then (`refusal` None) hands the guest to `target`."""

    runtime = "libvirt"
    monitor = None

    def __init__(self, directory: Path, target: TargetDomain, refusal: str | None = None) -> None:
        self.console_log = directory / "console.log"
        self.console_log.write_bytes(BOOT)
        self.target, self.refusal = target, refusal
        self.gone = asyncio.Event()

    async def migrate_to(
        self,
        target: DomainTarget,
        report: Callable[[Progress], None],
        *,
        max_bandwidth: int | None = None,
    ) -> Outcome:
        with self.console_log.open("ab") as console:
            console.write(b"tick 3\r\n")  # the last line before the switchover
        if self.refusal is not None:
            raise MigrationError(self.refusal)
        self.target.arrived.set()
        self.gone.set()  # its console stream ends with its QEMU
        return Outcome(downtime_ms=80, total_ms=3000, wall_ms=3100, ram_bytes=1, disk_bytes=2)

    async def follow_migration(self, report: Callable[[Progress], None]) -> Outcome:
        raise MigrationError("no migration job")  # (this fake's moves are its own calls)

    async def wait(self) -> MachineExit:
        await self.gone.wait()
        return MachineExit(0, "Migrated")


@dataclass
class TargetDomain:
    """A libvirt target's machine before the domain came (`ArrivingDomain`)."""

    target: DomainTarget
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    agent: Any = None

    async def arrive(self) -> None:
        await self.arrived.wait()


def _domain_target(*, imported: bool) -> DomainTarget:
    return DomainTarget(
        uri="qemu+libssh://root@hv-2/system",
        domain="ns_vm-2",
        files=() if imported else (("vda", "/b/root.qcow2"),),
        owner=("u2", "ns", "vm-2", "hv-2"),
        directory="/b/imported/u2" if imported else "",
    )


class API:
    """The cluster as the source's `_refusal` reads it: the target pod (its condition the
    target runner's) and its node."""

    def __init__(self, target: FakeRunner) -> None:
        self.target = target

    async def get(self, path: str) -> dict[str, Any]:
        if path.endswith("/nodes/hv-2"):
            return {
                "metadata": {"name": "hv-2"},
                "status": {
                    "conditions": [{"type": "Accelerator", "status": "True"}],
                    "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                },
            }
        status, reason, message = self.target.conditions[TARGET_CONDITION]
        condition = {"type": TARGET_CONDITION, "status": status, "reason": reason}
        return {
            "metadata": {
                "name": "vm-2",
                "annotations": {SOURCE_ANNOTATION: "vm", TOKEN_ANNOTATION: TOKEN},
            },
            "spec": {"nodeName": "hv-2"},
            "status": {"conditions": [{**condition, "message": message}]},
        }


def _host(tmp_path: Path, node: str, api: API | None = None) -> SimpleNamespace:
    def spawn(work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        return asyncio.ensure_future(work)

    async def claim_network(vm: Any) -> None:
        return None

    return SimpleNamespace(
        node_name=node,
        host_ip="127.0.0.1",
        upper_api=api,
        config=SimpleNamespace(log_rotation=LogRotation()),
        event=lambda vm, kind, reason, message: None,
        spawn=spawn,
        log_path=lambda uid, container, run: tmp_path / "logs" / uid / f"{container}-{run}.log",
        claim_network=claim_network,
    )


def _vm(tmp_path: Path, name: str, uid: str, annotations: dict[str, str]) -> SimpleNamespace:
    directory = tmp_path / uid
    directory.mkdir()
    return SimpleNamespace(
        dir=directory,
        uid=uid,
        key=f"ns/{name}",
        container="vm",
        run=0,
        migrated=None,
        launch=Launch(),
        annotations=annotations,
        machine=None,
        booted_at=1.0,
        save=lambda: None,
    )


@dataclass
class Pair:
    """A target pod waiting for the domain and a source pod about to send it."""

    source: Migrations
    target: Migrations
    source_vm: Any
    target_vm: Any
    source_runner: FakeRunner
    target_runner: FakeRunner
    receiving: asyncio.Task[None]
    endpoint: Endpoint

    def target_log(self) -> bytes:
        path: Path = self.target.host.log_path("u2", "vm", 0)
        return path.read_bytes() if path.exists() else b""

    async def migrate(self) -> None:
        annotations = {MIGRATE_TO: self.endpoint.to_json(), TOKEN_ANNOTATION: TOKEN}
        self.source.update(self.source_vm, self.source_runner, annotations)  # type: ignore[arg-type]
        await asyncio.wait_for(self.source.settled(self.source_vm), 10)


async def _pair(tmp_path: Path, *, imported: bool = False, refusal: str | None = None) -> Pair:
    target_runner, source_runner = FakeRunner(), FakeRunner()
    target = Migrations(_host(tmp_path, "hv-2"))
    source = Migrations(_host(tmp_path, "hv-1", API(target_runner)))
    arriving = TargetDomain(_domain_target(imported=imported))
    assert isinstance(arriving, ArrivingDomain)
    target_vm = _vm(tmp_path, "vm-2", "u2", {SOURCE_ANNOTATION: "vm", TOKEN_ANNOTATION: TOKEN})
    receiving = asyncio.ensure_future(target.receive(target_vm, arriving, target_runner, 0))  # type: ignore[arg-type]
    await eventually(lambda: TARGET_CONDITION in target_runner.conditions)
    endpoint = Endpoint.from_json(target_runner.conditions[TARGET_CONDITION][2])
    source_vm = _vm(tmp_path, "vm", "u1", {})
    source_vm.machine = SourceDomain(source_vm.dir, arriving, refusal)
    assert isinstance(source_vm.machine, MigratableDomain)
    return Pair(
        source, target, source_vm, target_vm, source_runner, target_runner, receiving, endpoint
    )


async def test_the_target_s_log_starts_with_the_source_s_console_history_each_line_once(
    tmp_path: Path,
) -> None:
    pair = await _pair(tmp_path)
    assert pair.endpoint.console_port > 0  # its token-checked console port, as on QEMU
    assert (pair.endpoint.migration_port, pair.endpoint.nbd_port) == (0, 0)
    await pair.migrate()
    await asyncio.wait_for(pair.receiving, 10)
    assert pair.source_runner.conditions[MIGRATION][1] == "Completed"
    assert pair.source_runner.finished and pair.source_vm.migrated is not None
    assert pair.target_runner.conditions[TARGET_CONDITION][1] == "Completed"
    # The boot and every line up to the switchover, in order, once (CRI lines: the
    # source's timestamps); the guest's next line is the target's console tailer's.
    log = pair.target_log()
    lines = [line.split(b" ", 3)[3] for line in log.splitlines()]
    assert lines == [b"SeaBIOS", b"vkubelet-guest: booted hostname=vm", b"tick 1", b"tick 2",
                     b"tick 3"]  # fmt: skip
    source_log = pair.source.host.log_path("u1", "vm", 0).read_bytes()
    assert log == source_log  # what `kubectl logs` showed at the source


async def test_an_imported_domain_s_history_comes_along_as_any_domain_s(
    tmp_path: Path,
) -> None:
    pair = await _pair(tmp_path, imported=True)
    assert pair.endpoint.console_port != 0
    await pair.migrate()
    await asyncio.wait_for(pair.receiving, 10)
    assert pair.source_runner.conditions[MIGRATION][1] == "Completed"
    assert pair.target_log() == pair.source.host.log_path("u1", "vm", 0).read_bytes()


async def test_a_refused_libvirt_migration_sends_no_history_and_the_vm_runs_on_at_the_source(
    tmp_path: Path,
) -> None:
    pair = await _pair(tmp_path, refusal="libvirt: Operation not supported: pre-creation")
    await pair.migrate()
    _, reason, message = pair.source_runner.conditions[MIGRATION]
    assert reason == "Failed" and "pre-creation" in json.loads(message)["error"]
    assert not pair.source_runner.finished and pair.source_vm.migrated is None
    assert not pair.receiving.done()  # the target still waits for the domain
    pair.receiving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pair.receiving
    assert pair.target_log() == b""


async def test_a_libvirt_target_without_a_token_fails_without_publishing_an_endpoint(
    tmp_path: Path,
) -> None:
    runner = FakeRunner()
    target = Migrations(_host(tmp_path, "hv-2"))
    vm = _vm(tmp_path, "vm-2", "u2", {SOURCE_ANNOTATION: "vm"})
    arriving = TargetDomain(_domain_target(imported=False))
    with pytest.raises(MigrationError, match="migration-token"):
        await target.receive(vm, arriving, runner, 0)  # type: ignore[arg-type]
    status, reason, _ = runner.conditions[TARGET_CONDITION]
    assert (status, reason) == ("False", "Failed")
