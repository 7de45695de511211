"""What a restarted agent does with a migration its predecessor left (the source's record and
QEMU's own state): finish it when the switchover happened, else roll it back; a source whose
QEMU died meanwhile never boots the guest again by itself."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vkubelet.providers.vm._migrate import Endpoint, MigrationError
from vkubelet.providers.vm._migrations import Migrations
from vkubelet.providers.vm._qmp import Monitor
from vkubelet.providers.vm._vm import Launch
from vkubelet.sdk.logs import LogRotation

from .fakes import FakeRunner

ENDPOINT = Endpoint("127.0.0.1", 1, 2, 3, ("disk0",), pod="vm-2")  # nothing listens there


class FakeQEMU(Monitor):
    def __init__(self, migration: str, running: str = "running") -> None:  # no socket
        self.migration, self.running, self.calls = migration, running, []  # type: ignore[var-annotated]
        self.quitted = False

    async def execute(self, command: str, arguments: Any = None) -> Any:
        self.calls.append(command)
        if command == "query-migrate":
            info: dict[str, Any] = {"status": self.migration}
            if self.migration == "completed":
                info.update({"downtime": 40, "total-time": 900, "ram": {"transferred": 7}})
            return info
        if command == "migrate_cancel":
            self.migration, self.running = "cancelled", "running"
        if command == "query-jobs":
            return (
                [{"id": "migrate-disk0", "status": "concluded"}]
                if "job-dismiss" not in self.calls
                else []
            )
        if command == "query-named-block-nodes":
            return [{"node-name": "migrate-nbd-disk0"}, {"node-name": "n0"}]
        if command == "query-status":
            return {"status": self.running}
        return {}

    async def quit(self) -> None:
        self.quitted = True


class TargetArrived:
    """The API, where the target pod says the guest runs there (its console port, nothing
    listening, gave no verdict)."""

    async def get(self, path: str) -> dict[str, Any]:
        assert path == "/api/v1/namespaces/ns/pods/vm-2"
        ready = {"type": "vm.vkubelet.io/MigrationTarget", "status": "False", "reason": "Completed"}
        return {"status": {"conditions": [ready]}}


def _setup(tmp_path: Path, state: str, **record: Any) -> tuple[Migrations, Any, FakeRunner]:
    events: list[tuple[str, str]] = []
    host = SimpleNamespace(
        event=lambda vm, kind, reason, message: events.append((reason, message)),
        log_path=lambda uid, container, run: tmp_path / "logs" / f"{run}.log",
        config=SimpleNamespace(log_rotation=LogRotation()),
        events=events,
        upper_api=TargetArrived(),
    )
    vm = SimpleNamespace(
        dir=tmp_path, uid="u1", key="ns/vm", container="vm", run=0, migrated=None, launch=Launch()
    )
    migrations = Migrations(host)
    migrations._write_record(
        vm,  # type: ignore[arg-type]
        endpoint=ENDPOINT.to_json(),
        token="t" * 64,
        state=state,
        **record,
    )
    return migrations, vm, FakeRunner()


def _condition(runner: FakeRunner) -> tuple[str, dict[str, Any]]:
    _, reason, message = runner.conditions["vm.vkubelet.io/Migration"]
    return reason, json.loads(message)


async def test_a_migration_left_running_is_cancelled_and_the_guest_runs_on_here(
    tmp_path: Path,
) -> None:
    migrations, vm, runner = _setup(tmp_path, "running")
    qemu = FakeQEMU("pre-switchover", running="finish-migrate")
    await migrations.resume_outgoing(vm, SimpleNamespace(monitor=qemu), runner)  # type: ignore[arg-type]
    assert "migrate_cancel" in qemu.calls and "migrate-continue" not in qemu.calls
    assert "blockdev-del" in qemu.calls and not qemu.quitted
    reason, report = _condition(runner)
    assert reason == "Failed" and "agent restarted" in report["error"]
    assert report["target"] == ENDPOINT.target
    assert json.loads((tmp_path / "migration.json").read_text())["state"] == "failed"
    assert not runner.finished and vm.migrated is None
    assert (tmp_path / "migration.json").stat().st_mode & 0o077 == 0  # it holds the token


async def test_a_migration_qemu_completed_while_no_agent_ran_is_finished(tmp_path: Path) -> None:
    migrations, vm, runner = _setup(tmp_path, "running")
    qemu = FakeQEMU("completed", running="postmigrate")
    machine = SimpleNamespace(monitor=qemu, console_log=tmp_path / "console.log")
    await migrations.resume_outgoing(vm, machine, runner)  # type: ignore[arg-type]
    assert "migrate_cancel" not in qemu.calls and "cont" not in qemu.calls
    reason, report = _condition(runner)
    assert reason == "Completed" and report["downtimeMilliseconds"] == 40
    assert runner.finished and qemu.quitted and vm.migrated is not None
    assert json.loads((tmp_path / "migration.json").read_text())["state"] == "completed"


@pytest.mark.parametrize(
    ("state", "ending"), [("completed", "Migrated"), ("running", "MigrationInterrupted")]
)
def test_a_source_whose_qemu_died_while_no_agent_ran_never_boots_again(
    tmp_path: Path, state: str, ending: str
) -> None:
    message = json.dumps({"progress": 100, "target": ENDPOINT.target})
    migrations, vm, runner = _setup(tmp_path, state, message=message)
    ended = migrations.ended_while_away(vm, runner)  # type: ignore[arg-type]
    assert ended is not None and ended.reason == ending and runner.finished


async def test_a_failed_migration_is_reported_again_after_a_restart(tmp_path: Path) -> None:
    failed = json.dumps({"error": "Broken pipe", "target": ENDPOINT.target})
    migrations, vm, runner = _setup(tmp_path, "failed", message=failed)
    qemu = FakeQEMU("failed")
    await migrations.resume_outgoing(vm, SimpleNamespace(monitor=qemu), runner)  # type: ignore[arg-type]
    assert _condition(runner) == ("Failed", json.loads(failed)) and not qemu.calls


class FakeTarget(Monitor):
    """A target QEMU: its run state, and its incoming migration's state."""

    def __init__(self, states: list[str], incoming: str | None) -> None:  # no socket
        self.states, self.incoming, self.calls = states, incoming, []  # type: ignore[var-annotated]

    async def execute(self, command: str, arguments: Any = None) -> Any:
        self.calls.append(command)
        if command == "query-status":
            return {"status": self.states.pop(0) if len(self.states) > 1 else self.states[0]}
        if command == "query-migrate":
            return {"status": self.incoming} if self.incoming else {}
        return {}


def _target(tmp_path: Path) -> tuple[Migrations, Any, FakeRunner]:
    spawned: list[Any] = []
    host = SimpleNamespace(
        event=lambda vm, kind, reason, message: None,
        spawn=lambda coro, name: spawned.append(coro.close()),
    )
    vm = SimpleNamespace(dir=tmp_path, uid="u2", launch=Launch(), save=lambda: None)
    return Migrations(host), vm, FakeRunner()


@pytest.mark.parametrize(
    ("states", "incoming"),
    [(["running"], None), (["inmigrate", "inmigrate", "running"], "active")],
)
async def test_a_restarted_target_agent_takes_a_vm_that_arrived_or_is_arriving(
    tmp_path: Path, states: list[str], incoming: str | None
) -> None:
    migrations, vm, runner = _target(tmp_path)
    qemu = FakeTarget(states, incoming)
    await migrations.resume_incoming(vm, SimpleNamespace(monitor=qemu), runner)  # type: ignore[arg-type]
    assert vm.launch.migrated_in is True
    assert runner.conditions["vm.vkubelet.io/MigrationTarget"][1] == "Completed"


async def test_a_restarted_target_agent_stops_a_target_no_stream_reached(tmp_path: Path) -> None:
    """Its ports died with the old agent: no source can reach it any more."""
    migrations, vm, runner = _target(tmp_path)
    qemu = FakeTarget(["inmigrate"], None)
    with pytest.raises(MigrationError, match="restarted before the VM came"):
        await migrations.resume_incoming(vm, SimpleNamespace(monitor=qemu), runner)  # type: ignore[arg-type]
    assert not vm.launch.migrated_in
    assert runner.conditions["vm.vkubelet.io/MigrationTarget"][1] == "Failed"
