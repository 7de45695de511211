"""The switchover's safety with two real QEMUs on this host and the provider's migration parts
(`Migrations`) on both sides, no cluster (issue 27): the source quits its QEMU only when the
target says the guest runs there. A target that dies right after the stream completed (its QEMU
killed before its agent saw the guest run) leaves the VM running at the source: the same
guest, resumed, not a new boot.

The kill is timed from the source's side, the moment its QEMU reports `completed`; the target's
agent looks at its QEMU only after that moment (its status poll is held until then), which is
the window a loaded host opens anyway and the test could not otherwise hit every time.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vkubelet.kube import ApiError
from vkubelet.providers.vm._machine import Disk, Machine, MachineSpec
from vkubelet.providers.vm._migrate import MIGRATE_TO, MIGRATION_TOKEN, Endpoint, MigrationError
from vkubelet.providers.vm._migrations import Migrations
from vkubelet.providers.vm._vm import Launch
from vkubelet.sdk.logs import LogRotation
from vkubelet.testing.harness import eventually

from ...unit.providers.vm.fakes import FakeRunner

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio,
    pytest.mark.skipif(os.geteuid() != 0, reason="QEMU's sockets and processes need root"),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="QEMU not installed"),
]

BOOT_TIMEOUT = 90.0
MIGRATION = "vm.vkubelet.io/Migration"
TARGET_READY = "vm.vkubelet.io/MigrationTarget"


async def _launch(image: Path, run_dir: Path, incoming: bool) -> Machine:
    await asyncio.to_thread(run_dir.mkdir, parents=True)
    root = run_dir / "root.qcow2"
    create = ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(image), str(root)]
    await asyncio.to_thread(subprocess.run, create, check=True)
    spec = MachineSpec(
        name=f"test/{run_dir.name}",
        run_dir=run_dir,
        vcpus=1,
        memory_mib=256,
        disks=(Disk(root, share_rw=True),),
        extra_args=("-incoming", "defer") if incoming else (),
    )
    return await Machine.launch(spec)


class API:
    """The cluster as the source's agent reads it: the target pod (its status from the target's
    runner) on hv-2, a vm node at 127.0.0.1."""

    def __init__(self, target: FakeRunner, token: str) -> None:
        self.target, self.token = target, token

    async def get(self, path: str) -> dict[str, Any]:
        if path == "/api/v1/namespaces/ns/pods/vm-2":
            conditions = [
                {"type": kind, "status": status, "reason": reason, "message": message}
                for kind, (status, reason, message) in self.target.conditions.items()
            ]
            annotations = {"vm.vkubelet.io/migration-source": "vm", MIGRATION_TOKEN: self.token}
            return {
                "metadata": {"name": "vm-2", "annotations": annotations},
                "spec": {"nodeName": "hv-2"},
                "status": {"conditions": conditions},
            }
        if path == "/api/v1/nodes/hv-2":
            return {
                "metadata": {"name": "hv-2"},
                "status": {
                    "conditions": [{"type": "Accelerator", "status": "True"}],
                    "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                },
            }
        raise ApiError(404, "NotFound", path)


def _host(work: Path, api: API | None, tasks: list[asyncio.Task[Any]]) -> SimpleNamespace:
    async def no_route(vm: Any) -> None:
        raise RuntimeError("no pod network in this test")

    def spawn(work: Any, name: str) -> asyncio.Task[Any]:
        tasks.append(asyncio.ensure_future(work))
        return tasks[-1]

    return SimpleNamespace(
        host_ip="127.0.0.1",
        node_name="hv-1" if api is not None else "hv-2",
        upper_api=api,
        event=lambda vm, kind, reason, message: print(f"event {reason}: {message}"),
        spawn=spawn,
        log_path=lambda uid, container, run: work / "logs" / uid / f"{run}.log",
        claim_network=no_route,
        config=SimpleNamespace(log_rotation=LogRotation()),
    )


def _vm(work: Path, key: str, machine: Machine | None, **annotations: str) -> SimpleNamespace:
    directory = work / key.replace("/", "-")
    directory.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(
        key=key, uid=directory.name, dir=directory, container="vm", run=0, migrated=None,
        launch=Launch(), machine=machine, booted_at=1.0, annotations=annotations,
        save=lambda: None,
    )  # fmt: skip


async def test_a_target_killed_right_after_the_stream_completed_leaves_the_vm_at_the_source(
    vm_guest_image: Path, tmp_path: Path
) -> None:
    source = await _launch(vm_guest_image, tmp_path / "src", incoming=False)
    target: Machine | None = None
    tasks: list[asyncio.Task[Any]] = []
    try:
        await source.wait_guest_agent(BOOT_TIMEOUT)
        boot_id = (await source.exec(["cat", "/proc/sys/kernel/random/boot_id"])).stdout
        target = await _launch(vm_guest_image, tmp_path / "dst", incoming=True)
        token = secrets.token_hex(32)
        target_runner, source_runner = FakeRunner(), FakeRunner()

        # The target's side: its agent's `receive`, its status poll held until the kill.
        completed = asyncio.Event()
        polled = target.monitor.status

        async def held_status() -> str:
            await completed.wait()
            return await polled()

        target.monitor.status = held_status  # type: ignore[method-assign]
        target_vm = _vm(tmp_path, "ns/vm-2", None, **{MIGRATION_TOKEN: token})
        receiving = Migrations(_host(tmp_path, None, tasks))
        tasks.append(asyncio.ensure_future(receiving.receive(target_vm, target, target_runner, 0)))  # type: ignore[arg-type]

        async def published() -> bool:
            return target_runner.conditions.get(TARGET_READY, ("",))[0] == "True"

        await eventually(published, within=60, interval=0.05)
        endpoint = Endpoint.from_json(target_runner.conditions[TARGET_READY][2])
        assert endpoint.pod == "vm-2"

        # The source's side: its QEMU says `completed`, and the target's QEMU dies at once.
        executed = source.monitor.execute

        async def killing_at_completion(command: str, arguments: Any = None) -> Any:
            reply = await executed(command, arguments)
            done = command == "query-migrate" and reply.get("status") == "completed"
            if done and not completed.is_set():
                assert target is not None
                os.kill(target.pid, signal.SIGKILL)
                completed.set()
            return reply

        source.monitor.execute = killing_at_completion  # type: ignore[method-assign]
        source_vm = _vm(tmp_path, "ns/vm", source)
        sending = Migrations(_host(tmp_path, API(target_runner, token), tasks))
        annotations = {MIGRATE_TO: endpoint.to_json(), MIGRATION_TOKEN: token}
        sending.update(source_vm, source_runner, annotations)  # type: ignore[arg-type]

        async def decided() -> bool:
            for task in tasks:  # a part that crashed never decides: say why at once
                crash = task.exception() if task.done() and not task.cancelled() else None
                if crash is not None and not isinstance(crash, MigrationError):
                    raise RuntimeError(f"{task!r} crashed") from crash
            return source_runner.conditions.get(MIGRATION, ("", ""))[1] in ("Completed", "Failed")

        await eventually(decided, within=120, interval=0.1)
        _, reason, message = source_runner.conditions[MIGRATION]
        print(f"source: {reason} {message}; target: {target_runner.conditions[TARGET_READY]}")
        assert completed.is_set(), "the stream never completed"
        assert reason == "Failed" and "runs here again" in json.loads(message)["error"]
        assert not source_runner.finished and source_vm.migrated is None
        # The same guest runs on at the source: not a new boot, and it answers.
        assert await source.monitor.status() == "running"
        assert (await source.exec(["cat", "/proc/sys/kernel/random/boot_id"])).stdout == boot_id
        assert not target.running()
        assert target_runner.conditions[TARGET_READY][1] == "Failed"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for machine in (source, target):
            if machine is not None and machine.running():
                await machine.kill()
