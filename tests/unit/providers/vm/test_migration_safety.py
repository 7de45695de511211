"""Issue 27: a source connects only to the endpoint a vm node published for this migration
(`endpoint_problem`), and quits its QEMU only once the target says the guest runs there; a
target that failed after the stream ended gets the guest resumed at the source."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vkubelet.providers.vm import _migrations
from vkubelet.providers.vm._migrate import Endpoint, MigrationError, until_running
from vkubelet.providers.vm._migrations import Migrations, endpoint_problem, target_verdict
from vkubelet.providers.vm._vm import Launch
from vkubelet.sdk.logs import LogRotation

from .fakes import FakeRunner
from .test_migration_resume import FakeQEMU, FakeTarget

TOKEN = "a" * 64
PUBLISHED = Endpoint("10.0.0.2", 4000, 4001, 4002, ("disk0",), pod="vm-2")
TARGET: dict[str, Any] = {
    "metadata": {
        "name": "vm-2",
        "annotations": {
            "vm.vkubelet.io/migration-source": "vm",
            "vm.vkubelet.io/migration-token": TOKEN,
        },
    },
    "spec": {"nodeName": "hv-2"},
    "status": {
        "conditions": [
            {
                "type": "vm.vkubelet.io/MigrationTarget",
                "status": "True",
                "reason": "Ready",
                "message": PUBLISHED.to_json(),
            }
        ]
    },
}
NODE: dict[str, Any] = {
    "metadata": {"name": "hv-2"},
    "status": {
        "conditions": [{"type": "Accelerator", "status": "True"}],
        "addresses": [
            {"type": "InternalIP", "address": "10.0.0.2"},
            {"type": "Hostname", "address": "10.0.0.9"},
        ],
    },
}


def _problem(endpoint: Endpoint, token: str = TOKEN, target: Any = None, node: Any = None) -> Any:
    return endpoint_problem(
        endpoint, token, "vm", "hv-1", TARGET if target is None else target, node or NODE
    )


def test_the_endpoint_the_target_published_passes_with_a_bandwidth_added() -> None:
    assert _problem(PUBLISHED) is None
    assert _problem(Endpoint.from_json(PUBLISHED.to_json()[:-1] + ',"maxBandwidth":9}')) is None


def _changed(path: list[str], value: Any, of: dict[str, Any]) -> dict[str, Any]:
    changed = copy.deepcopy(of)
    place = changed
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = value
    return changed


@pytest.mark.parametrize(
    ("endpoint", "token", "target", "node", "why"),
    [
        # another address, or another port, than the target published
        (Endpoint("10.9.9.9", 4000, 4001, 4002, ("disk0",), pod="vm-2"), TOKEN, None, None,
         "not the one target pod vm-2 published"),
        (Endpoint("10.0.0.2", 22, 4001, 4002, ("disk0",), pod="vm-2"), TOKEN, None, None,
         "not the one target pod vm-2 published"),
        (PUBLISHED, "b" * 64, None, None, "migration-token is not the one of target pod vm-2"),
        (PUBLISHED, TOKEN,
         _changed(["metadata", "annotations", "vm.vkubelet.io/migration-source"], "x", TARGET),
         None, "pod vm-2 is not a migration target of this pod"),
        (PUBLISHED, TOKEN, _changed(["status", "conditions"], [], TARGET), None,
         "not the one target pod vm-2 published"),
        (PUBLISHED, TOKEN, None, _changed(["status", "conditions"], [], NODE),
         "node hv-2 is not a vm node"),
        # a target pod that published an address its node does not have
        (PUBLISHED, TOKEN, None,
         _changed(["status", "addresses"], [{"type": "ExternalIP", "address": "10.0.0.2"}], NODE),
         "10.0.0.2 is not an InternalIP address of node hv-2"),
        (PUBLISHED, TOKEN, _changed(["spec", "nodeName"], "hv-1", TARGET),
         _changed(["metadata", "name"], "hv-1", NODE), "target pod vm-2 is on this node"),
    ],
)  # fmt: skip
def test_a_migrate_to_that_is_not_the_targets_own_is_refused_naming_why(
    endpoint: Endpoint, token: str, target: Any, node: Any, why: str
) -> None:
    problem = _problem(endpoint, token, target, node)
    assert problem is not None and why in problem


def test_the_target_pods_word_is_final_only_when_its_qemu_runs_or_is_gone() -> None:
    def with_reason(reason: str) -> dict[str, Any]:
        ready = {"type": "vm.vkubelet.io/MigrationTarget", "reason": reason, "message": "m"}
        return {"status": {"conditions": [ready], "phase": "Pending"}}

    assert target_verdict(with_reason("Completed")) == "running"
    assert target_verdict(with_reason("Failed")) == "failed: m"
    assert target_verdict(None) == "failed: the target pod is gone"
    assert target_verdict(with_reason("Ready")) is None  # loading, perhaps: wait, never guess
    assert target_verdict({"status": {"phase": "Failed"}}) == "failed: the target pod ended"


def _broken_tailer(*args: Any, **kwargs: Any) -> Any:
    raise AttributeError("'SimpleNamespace' object has no attribute 'config'")


async def _target_console(verdict: bytes) -> tuple[asyncio.Server, list[bytes]]:
    """A target's console port: takes the token and the history, answers `verdict`."""
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read())
        writer.write(verdict)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0), received


@pytest.mark.parametrize("history", ["readable", "broken"])
@pytest.mark.parametrize("verdict", [b"failed: load of migration failed\n", b"running\n"])
async def test_the_source_quits_only_when_the_target_runs_the_guest_else_resumes_it(
    tmp_path: Path, verdict: bytes, history: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if history == "broken":  # a bug in the console's part must not leave the guest paused
        monkeypatch.setattr(_migrations, "ConsoleTailer", _broken_tailer)
    server, received = await _target_console(verdict)
    port = server.sockets[0].getsockname()[1]
    endpoint = Endpoint("127.0.0.1", 1, 2, port, ("disk0",), pod="vm-2")
    events: list[str] = []
    host = SimpleNamespace(
        event=lambda vm, kind, reason, message: events.append(reason),
        log_path=lambda uid, container, run: tmp_path / "logs" / f"{run}.log",
        config=SimpleNamespace(log_rotation=LogRotation()),
        upper_api=None,
    )
    vm = SimpleNamespace(
        dir=tmp_path, uid="u1", key="ns/vm", container="vm", run=0, migrated=None, launch=Launch()
    )
    migrations = Migrations(host)
    record = {"endpoint": endpoint.to_json(), "token": TOKEN, "message": "{}"}
    migrations._write_record(vm, **record, state="completed")  # type: ignore[arg-type]
    qemu = FakeQEMU("completed", running="postmigrate")
    machine = SimpleNamespace(monitor=qemu, console_log=tmp_path / "console.log")
    runner = FakeRunner()
    async with server:
        await migrations.resume_outgoing(vm, machine, runner)  # type: ignore[arg-type]
    assert received == [TOKEN.encode() + b"\n"]  # the token first, then the (empty) history
    _, reason, message = runner.conditions["vm.vkubelet.io/Migration"]
    if verdict == b"running\n":
        assert reason == "Completed" and qemu.quitted and runner.finished
        assert "cont" not in qemu.calls
        return
    assert reason == "Failed" and "load of migration failed" in json.loads(message)["error"]
    assert "cont" in qemu.calls and not qemu.quitted and not runner.finished
    assert vm.migrated is None and "MigrationFailed" in events
    assert json.loads((tmp_path / "migration.json").read_text())["state"] == "failed"


@pytest.mark.parametrize("stuck", ["paused", "guest-panicked"])
async def test_a_target_whose_guest_loaded_but_never_runs_fails_instead_of_waiting_for_ever(
    stuck: str,
) -> None:
    """Paused: QEMU loaded the state but could not take the disks back, so did not start the
    guest; its source waits for the target's word, which must come."""
    with pytest.raises(MigrationError, match=f"did not start here .QEMU: {stuck}"):
        target = FakeTarget(["inmigrate", "inmigrate", stuck], "completed")
        await asyncio.wait_for(until_running(target), 5)  # (the former rule waited for ever)
