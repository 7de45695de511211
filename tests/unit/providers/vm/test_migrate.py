"""The migration endpoint and progress the provider publishes (the seam with the controller)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from vkubelet.providers.vm import _migrate
from vkubelet.providers.vm._migrate import Endpoint, MigrationError, Progress
from vkubelet.providers.vm._qmp import Monitor
from vkubelet.testing.harness import eventually


def test_the_endpoint_round_trips_through_its_json_and_the_controller_may_add_a_bandwidth() -> None:
    endpoint = Endpoint("10.0.0.2", 4000, 4001, 4002, ("disk0", "disk1"))
    data = json.loads(endpoint.to_json())
    assert data == {
        "host": "10.0.0.2",
        "migrationPort": 4000,
        "nbdPort": 4001,
        "consolePort": 4002,
        "disks": ["disk0", "disk1"],
    }
    limited = Endpoint.from_json(json.dumps({**data, "maxBandwidth": 1_000_000}))
    assert limited.max_bandwidth == 1_000_000 and limited.disks == ("disk0", "disk1")
    assert limited.target == "10.0.0.2:4000"


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "{}",
        '{"host": "h", "migrationPort": 0, "nbdPort": 1, "consolePort": 2, "disks": []}',
    ],
)
def test_a_broken_endpoint_is_refused_naming_the_annotation(text: str) -> None:
    with pytest.raises(MigrationError, match=r"vm\.vkubelet\.io/migrate-to"):
        Endpoint.from_json(text)


def test_progress_counts_disks_and_memory_and_stays_below_100_until_done() -> None:
    progress = Progress(disk_done=50, disk_total=100, ram_done=0, ram_total=100)
    assert progress.percent == 25
    progress.ram_done = 100
    progress.disk_done = 100
    assert progress.percent == 99
    assert json.loads(progress.message()) == {"phase": "mirroring", "progress": 99}


# -- the provider's hooks, on the fake runtime of test_provider ---------------------------------
def _condition(pod: Any, kind: str) -> Any:
    for condition in pod.status.conditions or []:
        if condition.type == kind:
            return condition
    return None


async def test_migrate_to_on_a_vm_that_cannot_migrate_fails_and_the_vm_runs_on(
    tmp_path: Path,
) -> None:
    from vkubelet.sdk import ResolvedPod

    from .fakes import Events, FakeRuntime, make_pod, provider_for, state

    provider = provider_for(tmp_path, FakeRuntime(), Events())
    await provider.create_pod(ResolvedPod(make_pod()))

    async def running() -> bool:
        _, status = await state(provider)
        return status is not None and status.state.running is not None

    await eventually(running)
    pod = make_pod()
    endpoint = Endpoint("10.0.0.2", 4000, 4001, 4002, ("disk0",))
    assert pod.metadata is not None
    pod.metadata.annotations = {
        "vm.vkubelet.io/migrate-to": endpoint.to_json(),
        "vm.vkubelet.io/migration-token": "t" * 64,
    }
    await provider.update_pod(ResolvedPod(pod))

    async def failed() -> bool:
        current = await provider.get_pod("ns", "vm")
        condition = _condition(current, "vm.vkubelet.io/Migration")
        return condition is not None and condition.reason == "Failed"

    await eventually(failed)
    current = await provider.get_pod("ns", "vm")
    report = json.loads(_condition(current, "vm.vkubelet.io/Migration").message)
    assert report["target"] == "10.0.0.2:4000" and "cannot migrate" in report["error"]
    assert await running()
    await provider.aclose()


async def test_a_migration_target_waits_for_the_vm_and_reports_why_it_cannot(
    tmp_path: Path,
) -> None:
    from vkubelet.sdk import ResolvedPod

    from .fakes import Events, FakeRuntime, make_pod, provider_for

    runtime = FakeRuntime()
    provider = provider_for(tmp_path, runtime, Events())
    pod = make_pod("vm-2")
    assert pod.metadata is not None
    pod.metadata.annotations = {"vm.vkubelet.io/migration-source": "vm"}
    await provider.create_pod(ResolvedPod(pod))

    async def failed() -> bool:
        current = await provider.get_pod("ns", "vm-2")
        condition = _condition(current, "vm.vkubelet.io/MigrationTarget") if current else None
        return condition is not None and condition.reason == "Failed"

    await eventually(failed)
    assert runtime.launches[0].incoming  # QEMU started waiting for the state
    await provider.aclose()


class SlowSwitchoverQEMU(Monitor):
    """QEMU after `migrate-continue`: its migration thread leaves pre-switchover a moment
    later, and a second continue once it completed fails as QEMU's does."""

    def __init__(self) -> None:  # no socket
        self.state, self.continues, self.queries_after = "pre-switchover", 0, 0

    def listen(self, names: Any) -> Any:
        return None

    def forget(self, listener: Any) -> None:
        pass

    async def execute(self, command: str, arguments: Any = None) -> Any:
        if command == "query-migrate":
            if self.continues:
                self.queries_after += 1
                if self.queries_after == 3:
                    self.state = "completed"
            info: dict[str, Any] = {"status": self.state}
            if self.state == "completed":
                info |= {"downtime": 12, "total-time": 900}
            return info
        if command == "query-jobs":
            return [{"id": "migrate-disk0", "status": "ready"}]
        if command == "migrate-continue":
            if self.state != "pre-switchover" or self.continues:
                raise RuntimeError("Migration not in expected state")  # QEMU's ExecuteError
            self.continues += 1
        return {}


async def test_the_switchover_is_continued_once_though_qemu_still_says_pre_switchover(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def no_wait(listener: Any) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(_migrate, "_nap", no_wait)
    qemu = SlowSwitchoverQEMU()
    info = await _migrate._until_migrated(qemu, ["migrate-disk0"], Progress(), lambda _: None)
    assert (info["status"], qemu.continues) == ("completed", 1)
