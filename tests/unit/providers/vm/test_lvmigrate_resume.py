"""A libvirt source's agent restarted in the middle of a migration: libvirt's daemon goes on
with a peer-to-peer migration whose client died, so the restarted agent follows the job (the
domain moved: Completed, the run ends Migrated; it did not: Failed, the VM runs here), and a
domain that left while no agent ran is confirmed by the target's word."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vkubelet.providers.vm._migrate import DomainTarget, Endpoint, MigrationError, Outcome, Progress
from vkubelet.providers.vm._migrations import Migrations
from vkubelet.providers.vm._vm import Launch
from vkubelet.sdk.logs import LogRotation

from .fakes import FakeRunner

TARGET = DomainTarget(
    uri="qemu+ssh://root@10.0.0.3/system",
    domain="ns_vm-2",
    files=(("vda", "/var/lib/vk/vm-2/root.qcow2"),),
    owner=("uid-2", "ns", "vm-2", "hv-2"),
)
# console port 0: no history to hand over (nothing listens in these tests)
ENDPOINT = Endpoint("10.0.0.3", 0, 0, 0, ("vda",), pod="vm-2", libvirt=TARGET)


class Following:
    """An adopted libvirt source whose daemon runs the previous agent's migration on: it
    reports progress once, then the domain moved (`outcome`) or stayed (`error`)."""

    runtime = "libvirt"
    monitor = None

    def __init__(self, directory: Path, error: str | None = None) -> None:
        self.console_log = directory / "console.log"
        self.error = error
        self.gone = asyncio.Event()

    async def migrate_to(self, *args: Any, **kwargs: Any) -> Outcome:
        raise AssertionError("a restarted agent never starts the migration again")

    async def follow_migration(self, report: Callable[[Progress], None]) -> Outcome:
        report(Progress(phase="migrating", ram_done=1, ram_total=4))
        if self.error is not None:
            raise MigrationError(self.error)
        self.gone.set()
        return Outcome(downtime_ms=90, total_ms=20000, wall_ms=12000, ram_bytes=7, disk_bytes=1)

    async def wait(self) -> None:
        await self.gone.wait()


class TargetSays:
    """The API, where the target pod's `MigrationTarget` has `reason`."""

    def __init__(self, reason: str | None) -> None:
        self.reason = reason

    async def get(self, path: str) -> dict[str, Any]:
        assert path == "/api/v1/namespaces/ns/pods/vm-2"
        ready = {"type": "vm.vkubelet.io/MigrationTarget", "status": "True", "reason": "Ready"}
        if self.reason is not None:
            ready = {**ready, "status": "False", "reason": self.reason}
        return {"status": {"conditions": [ready]}}


def _setup(
    tmp_path: Path, target_says: str | None = None
) -> tuple[Migrations, Any, FakeRunner, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    host = SimpleNamespace(
        event=lambda vm, kind, reason, message: events.append((reason, message)),
        log_path=lambda uid, container, run: tmp_path / "logs" / f"{run}.log",
        config=SimpleNamespace(log_rotation=LogRotation()),
        upper_api=TargetSays(target_says),
        spawn=lambda work, name: asyncio.ensure_future(work),
    )
    vm = SimpleNamespace(
        dir=tmp_path, uid="u1", key="ns/vm", container="vm", run=0, migrated=None, launch=Launch()
    )
    migrations = Migrations(host)
    record = {"endpoint": ENDPOINT.to_json(), "token": "t" * 64, "state": "running"}
    migrations._write_record(vm, **record)  # type: ignore[arg-type]
    return migrations, vm, FakeRunner(), events


def _condition(runner: FakeRunner) -> tuple[str, dict[str, Any]]:
    _, reason, message = runner.conditions["vm.vkubelet.io/Migration"]
    return reason, json.loads(message)


def _state(tmp_path: Path) -> str:
    return str(json.loads((tmp_path / "migration.json").read_text())["state"])


async def test_a_move_libvirt_finished_after_the_agent_died_ends_the_source_run_migrated(
    tmp_path: Path,
) -> None:
    migrations, vm, runner, _ = _setup(tmp_path)
    machine = Following(tmp_path)
    migrations.resume(vm, machine, runner)  # type: ignore[arg-type]
    await machine.gone.wait()  # the domain left this host...
    await migrations.settled(vm)  # ...and the run's end waits for the word on it
    reason, report = _condition(runner)
    assert reason == "Completed" and report["downtimeMilliseconds"] == 90
    assert report["target"] == ENDPOINT.target
    assert runner.finished and vm.migrated is not None and _state(tmp_path) == "completed"


async def test_a_move_libvirt_did_not_finish_leaves_the_vm_running_here_saying_why(
    tmp_path: Path,
) -> None:
    migrations, vm, runner, events = _setup(tmp_path)
    why = "libvirt's migration ended without moving the VM while no agent watched it"
    migrations.resume(vm, Following(tmp_path, error=why), runner)  # type: ignore[arg-type]
    await migrations.settled(vm)
    reason, report = _condition(runner)
    assert reason == "Failed" and why in report["error"] and "agent restarted" in report["error"]
    assert "the VM runs here" in report["error"]
    assert not runner.finished and vm.migrated is None and _state(tmp_path) == "failed"
    assert events[-1][0] == "MigrationFailed"


async def test_a_domain_gone_while_no_agent_ran_is_migrated_when_the_target_runs_it(
    tmp_path: Path,
) -> None:
    migrations, vm, runner, _ = _setup(tmp_path, target_says="Completed")
    await migrations.departed(vm)
    ended = migrations.ended_while_away(vm, runner)  # type: ignore[arg-type]
    assert ended is not None and ended.reason == "Migrated" and runner.finished
    assert _condition(runner)[0] == "Completed"


async def test_a_domain_gone_while_no_agent_ran_that_the_target_never_got_is_interrupted(
    tmp_path: Path,
) -> None:
    migrations, vm, runner, _ = _setup(tmp_path, target_says="Failed")
    await migrations.departed(vm)
    ended = migrations.ended_while_away(vm, runner)  # type: ignore[arg-type]
    assert ended is not None and ended.reason == "MigrationInterrupted" and runner.finished


# -- following the daemon's job (the binding, no daemon) -----------------------------------------
class _Job:
    """A source domain as libvirt reports it: one (state, job stats) per look."""

    def __init__(self, *looks: tuple[tuple[int, int], dict[str, int]]) -> None:
        self.looks = list(looks)
        self.look = looks[0]

    def state(self) -> tuple[int, int]:
        self.look = self.looks.pop(0) if len(self.looks) > 1 else self.looks[0]
        return self.look[0]

    def jobStats(self) -> dict[str, int]:
        return self.look[1]


class _Conn:
    def domainEventRegisterAny(self, *args: Any) -> int:
        return 1

    def domainEventDeregisterAny(self, callback: int) -> None:
        pass


class _Connection:
    uri = "qemu+ssh://root@hv-1/system"

    def __init__(self, domain: _Job) -> None:
        self.found = domain

    async def run(self, call: Any, *args: Any) -> Any:
        return call(*args)

    async def domain(self, uuid: str) -> object:
        return self.found

    async def get(self) -> _Conn:
        return _Conn()


async def test_a_restarted_source_follows_the_daemon_s_job_until_the_domain_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed")
    from vkubelet.providers.vm import _lvmigrate

    monkeypatch.setattr(_lvmigrate, "_FOLLOW", 0.0)
    running = (libvirt.VIR_DOMAIN_RUNNING, 1)
    job = {"type": libvirt.VIR_DOMAIN_JOB_UNBOUNDED, "operation": 5, "memory_processed": 4}
    left = (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED)
    reports: list[int] = []
    domain = _Job((running, job), (running, {**job, "memory_processed": 8}), (left, {}))
    outcome = await _lvmigrate.follow_outgoing(
        _Connection(domain), "u-1", lambda p: reports.append(p.ram_done)
    )
    assert reports == [4, 8] and outcome.ram_bytes == 8


async def test_a_restarted_source_whose_domain_runs_here_without_a_job_says_it_did_not_move() -> (
    None
):
    libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed")
    from vkubelet.providers.vm import _lvmigrate

    running = (libvirt.VIR_DOMAIN_RUNNING, 1)
    idle = _Job((running, {"type": libvirt.VIR_DOMAIN_JOB_NONE}))
    with pytest.raises(MigrationError, match="ended without moving the VM"):
        await _lvmigrate.follow_outgoing(_Connection(idle), "u-1", lambda p: None)
    backup = {"type": libvirt.VIR_DOMAIN_JOB_UNBOUNDED, "operation": 9}  # not a migration
    with pytest.raises(MigrationError, match="not its migration"):
        await _lvmigrate.follow_outgoing(_Connection(_Job((running, backup))), "u-1", print)


async def test_a_restarted_target_opens_its_console_port_again_on_the_published_port() -> None:
    """So its endpoint stays the one the source was given (a history yet to come still can)."""
    from vkubelet.providers.vm._migrate import ConsolePort

    first = ConsolePort("t" * 64)
    port = await first.open("127.0.0.1")
    first.close()  # (asyncio's Server.close closes the listening socket there and then)
    again = ConsolePort("t" * 64)
    assert await again.open("127.0.0.1", port) == port
    taken = ConsolePort("t" * 64)  # the port is someone else's now: another one
    other = await taken.open("127.0.0.1", port)
    assert other not in (0, port)
    again.close()
    taken.close()


def _gone(libvirt: Any) -> BaseException:
    class Gone(libvirt.libvirtError):  # type: ignore[misc]
        def get_error_code(self) -> int:
            return int(libvirt.VIR_ERR_NO_DOMAIN)

    return Gone("no domain")


class _Arriving:
    """The target host, where the incoming domain is seen once (paused), then is gone."""

    uri = "qemu+ssh://root@hv-2/system"

    def __init__(self, libvirt: Any) -> None:
        self.libvirt, self.looks = libvirt, 0
        owner = '<pod xmlns="https://vkubelet.io/xmlns/vm-domain/1" uid="uid-2"/>'
        self.domain = SimpleNamespace(
            UUIDString=lambda: "u-2",
            state=lambda: (libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_MIGRATION),
        )
        self.owner = owner

    async def get(self) -> Any:
        return SimpleNamespace(lookupByName=self.lookup)

    def lookup(self, name: str) -> Any:
        self.looks += 1
        if self.looks > 1:
            raise _gone(self.libvirt)
        return self.domain

    async def run(self, call: Any, *args: Any) -> Any:
        return call(*args)

    async def metadata(self, domain: Any, uri: str) -> str:
        return self.owner


async def test_a_target_whose_incoming_domain_went_away_fails_saying_the_vm_runs_at_the_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed")
    from vkubelet.providers.vm import _lvmigrate

    monkeypatch.setattr(_lvmigrate, "_POLL", 0.0)
    monkeypatch.setattr(_lvmigrate, "owner_of", lambda xml: SimpleNamespace(pod_uid="uid-2"))
    seen: list[Any] = []

    async def saw(domain: Any) -> None:
        seen.append(domain)

    host = _Arriving(libvirt)
    with pytest.raises(MigrationError, match="went away before it ran here"):
        await _lvmigrate.arrival(host, "ns_vm-2", "uid-2", saw)
    assert seen == [host.domain]
