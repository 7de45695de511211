"""The backup task on a fake QEMU monitor and guest agent (the real qemu-img makes the files):
targets refused, full then incremental, and the guest thawed on every error path."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from vkubelet.providers.vm._backup import (
    RESTORE_FROM,
    BackupError,
    BackupSource,
    bitmap_name,
    resolve_restore,
    resolve_target,
    restore_if_asked,
    run_backup,
)
from vkubelet.providers.vm._backupqmp import QmpDiskBackup

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")

SIZE = 1 << 20


class FakeAgent:
    def __init__(self, *, freeze_error: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.freeze_error = freeze_error
        self.frozen = False
        self.log: list[tuple[str, Any]] = []

    async def call(self, command: str, arguments: Any = None, **_: Any) -> Any:
        self.calls.append(command)
        self.log.append((f"qga {command}", None))
        if command == "guest-fsfreeze-freeze":
            if self.freeze_error is not None:
                if isinstance(self.freeze_error, TimeoutError):
                    self.frozen = True  # froze, but answered too late
                raise self.freeze_error
            self.frozen = True
            return 1
        if command == "guest-ping":
            if isinstance(self.freeze_error, ConnectionError):
                raise self.freeze_error
            return {}
        if command == "guest-fsfreeze-thaw":
            self.frozen = False
            return 1
        if command == "guest-fsfreeze-status":
            return "frozen" if self.frozen else "thawed"
        raise AssertionError(command)


class FakeMonitor:
    """query-block with `disks` devices; jobs conclude at once; `fail` makes one command fail."""

    def __init__(self, disks: int = 2, *, fail: str | None = None, job_error: str = "") -> None:
        self.disks, self.fail, self.job_error = disks, fail, job_error
        self.bitmaps: dict[str, dict[str, Any]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.nodes: set[str] = set()
        self.fdsets: set[int] = set()
        self.commands: list[tuple[str, Any]] = []

    async def add_fd(self, fd: int) -> int:
        self.fdsets.add(len(self.commands))
        self.commands.append(("add-fd", None))
        return len(self.commands) - 1

    async def execute(self, command: str, arguments: Any = None) -> Any:
        self.commands.append((command, arguments))
        if command == self.fail and (command != "query-jobs" or self.jobs):  # jobs: once copying
            raise RuntimeError(f"{command} failed")
        if command == "query-block":
            return [
                {
                    "device": f"disk{i}",
                    "inserted": {
                        "image": {"virtual-size": SIZE},
                        "dirty-bitmaps": [self.bitmaps[f"disk{i}"]]
                        if f"disk{i}" in self.bitmaps
                        else [],
                    },
                }
                for i in range(self.disks)
            ]
        if command == "blockdev-add":
            self.nodes.add(arguments["node-name"])
        elif command == "blockdev-del":
            self.nodes.discard(arguments["node-name"])
        elif command == "transaction":
            for action in arguments["actions"]:
                data = action["data"]
                if action["type"] == "block-dirty-bitmap-add":
                    self.bitmaps[data["node"]] = {"name": data["name"], "persistent": True}
                elif action["type"] == "blockdev-backup":
                    self.jobs[data["job-id"]] = {
                        "id": data["job-id"],
                        "status": "concluded",
                        "current-progress": 10,
                        "total-progress": 10,
                        **({"error": self.job_error} if self.job_error else {}),
                    }
        elif command == "query-jobs":
            return list(self.jobs.values())
        elif command == "query-named-block-nodes":
            return [{"node-name": n} for n in sorted(self.nodes)] + [{"node-name": "#block1"}]
        elif command == "remove-fd":
            self.fdsets.discard(arguments["fdset-id"])
        elif command == "block-dirty-bitmap-remove":
            self.bitmaps.pop(arguments["node"], None)
        elif command == "job-dismiss":
            self.jobs.pop(arguments["id"], None)
        return {}

    def names(self) -> list[str]:
        return [c for c, _ in self.commands]


class FakeMachine:
    runtime = "qemu"

    def __init__(self, monitor: FakeMonitor, agent: FakeAgent) -> None:
        self.monitor, self.agent = monitor, agent
        agent.log = monitor.commands  # one sequence of what QEMU and the guest were asked

    def disk_backup(self) -> QmpDiskBackup:
        return QmpDiskBackup(self.monitor, self.agent)  # type: ignore[arg-type]


def _source(where: Path, disks: int = 2) -> BackupSource:
    """The VM's disks: small real qcow2 files (the space check measures them)."""
    (where / "vm").mkdir(parents=True, exist_ok=True)
    paths = tuple(where / "vm" / f"d{i}.qcow2" for i in range(disks))
    for path in paths:
        if not path.exists():
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "1M"], check=True)
    return BackupSource("ns", "db-abcde", "uid-1", "db", None, paths)


def _backup(machine: FakeMachine, target: Path, mode: str = "Auto") -> Any:
    lines: list[str] = []
    result = asyncio.run(
        run_backup(machine, _source(target), target, mode, backup_pod="b", progress=lines.append)
    )
    return result, lines


def test_directory_targets_must_be_absolute_and_inside_the_allowed_directories(
    tmp_path: Path,
) -> None:
    allowed = [tmp_path / "backups"]
    assert resolve_target(json.dumps({"directory": str(tmp_path / "backups/x")}), allowed) == (
        tmp_path / "backups/x"
    )
    for target, words in (
        ({"directory": "backups"}, "is relative"),
        ({"directory": "/etc"}, "outside this node's backup directories"),
        ({"directory": str(tmp_path / "backups/../etc")}, "must not contain '..'"),
        ({"persistentVolumeClaim": "data"}, "not resolved to a directory"),
        ({"persistentVolumeClaim": "data", "path": "/srv"}, "outside"),
        ({"directory": "/a", "persistentVolumeClaim": "b"}, "exactly one of"),
    ):
        with pytest.raises(BackupError, match=words) as caught:
            resolve_target(json.dumps(target), allowed)
        assert caught.value.reason == "TargetRefused"
    with pytest.raises(BackupError, match="missing"):
        resolve_target(None, allowed)


def test_a_symlink_out_of_the_allowed_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "backups").mkdir()
    (tmp_path / "backups" / "escape").symlink_to("/etc")
    with pytest.raises(BackupError, match="outside"):
        resolve_target(
            json.dumps({"directory": str(tmp_path / "backups/escape")}), [tmp_path / "backups"]
        )


def test_first_backup_is_full_with_a_new_persistent_bitmap_then_incremental_chained(
    tmp_path: Path,
) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent())
    first, _ = _backup(machine, tmp_path)
    assert first.kind == "full" and first.consistency == "filesystem-consistent"
    chain = tmp_path / "ns" / "db"
    actions = next(c[1]["actions"] for c in machine.monitor.commands if c[0] == "transaction")
    assert [a["type"] for a in actions] == ["block-dirty-bitmap-add", "blockdev-backup"] * 2
    assert actions[0]["data"] == {"node": "disk0", "name": bitmap_name(chain), "persistent": True}
    assert actions[1]["data"]["sync"] == "full"
    # frozen only around the transaction, thawed before the copy is waited for
    names = machine.monitor.names()
    transaction = names.index("transaction")
    assert names.index("qga guest-fsfreeze-freeze") < transaction
    assert names.index("qga guest-fsfreeze-thaw") < names.index("query-jobs", transaction)
    assert machine.agent.calls == ["guest-ping", "guest-fsfreeze-freeze", "guest-fsfreeze-thaw"]
    assert not machine.monitor.nodes and not machine.monitor.fdsets and not machine.monitor.jobs
    second, _ = _backup(machine, tmp_path)
    assert second.kind == "incremental"
    actions = [c[1]["actions"] for c in machine.monitor.commands if c[0] == "transaction"][1]
    assert [a["type"] for a in actions] == ["blockdev-backup"] * 2
    assert actions[0]["data"]["sync"] == "incremental"
    manifest = json.loads((chain / "manifest.json").read_text())
    assert [b["kind"] for b in manifest["backups"]] == ["full", "incremental"]
    assert manifest["backups"][1]["files"] == [
        "0002-incremental/disk0.qcow2",
        "0002-incremental/disk1.qcow2",
    ]
    assert resolve_restore(str(chain / "manifest.json"), [tmp_path], "ns") == [
        chain / "0002-incremental/disk0.qcow2",
        chain / "0002-incremental/disk1.qcow2",
    ]
    assert any("done: incremental" in line for line in _backup(machine, tmp_path)[1][-1:])


def test_a_disk_without_the_bitmap_gets_a_full_backup_and_incremental_mode_fails(
    tmp_path: Path,
) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent())
    _backup(machine, tmp_path)
    machine.monitor.bitmaps.clear()  # a VM killed: QEMU dropped its bitmaps
    with pytest.raises(BackupError, match="incremental backup is impossible"):
        _backup(machine, tmp_path, "Incremental")
    assert _backup(machine, tmp_path)[0].kind == "full"


@pytest.mark.parametrize("fail", ["transaction", "query-jobs"])
def test_the_guest_is_thawed_and_partial_files_removed_when_the_backup_fails(
    tmp_path: Path, fail: str
) -> None:
    machine = FakeMachine(FakeMonitor(fail=fail), FakeAgent())
    with pytest.raises(BackupError, match=f"{fail} failed") as caught:
        _backup(machine, tmp_path)
    assert caught.value.reason == "BackupFailed"
    assert machine.agent.calls[-1] == "guest-fsfreeze-thaw" and not machine.agent.frozen
    assert not machine.monitor.nodes and not machine.monitor.fdsets  # targets closed
    assert not list((tmp_path / "ns" / "db").glob("0001-*"))
    assert not (tmp_path / "ns" / "db" / "manifest.json").exists()


def test_a_failed_job_fails_the_backup_with_qemu_s_words_and_the_guest_thawed(
    tmp_path: Path,
) -> None:
    machine = FakeMachine(FakeMonitor(job_error="No space left on device"), FakeAgent())
    with pytest.raises(BackupError, match="No space left on device"):
        _backup(machine, tmp_path)
    assert not machine.agent.frozen and not machine.monitor.nodes and not machine.monitor.fdsets


def test_a_cancelled_backup_cancels_its_jobs_and_removes_its_files_the_guest_thawed(
    tmp_path: Path,
) -> None:
    monitor = FakeMonitor()
    machine = FakeMachine(monitor, FakeAgent())

    async def scenario() -> None:
        original = monitor.execute
        copying = asyncio.Event()

        async def slow(command: str, arguments: Any = None) -> Any:
            if command == "query-jobs" and monitor.jobs:
                copying.set()
                for job in monitor.jobs.values():
                    job["status"] = "running"
            return await original(command, arguments)

        monitor.execute = slow  # type: ignore[method-assign]
        task = asyncio.create_task(
            run_backup(machine, _source(tmp_path), tmp_path, "Auto", backup_pod="b", progress=print)
        )
        await copying.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert (
        "job-cancel" in monitor.names()
        and not monitor.nodes
        and not monitor.fdsets
        and not machine.agent.frozen
    )
    assert not list((tmp_path / "ns" / "db").glob("0001-*"))


@pytest.mark.parametrize(
    "error", [ConnectionError("guest agent: no sync"), RuntimeError("fsfreeze refused")]
)
def test_without_an_answering_agent_the_backup_is_crash_consistent(
    tmp_path: Path, error: Exception
) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent(freeze_error=error))
    result, lines = _backup(machine, tmp_path)
    assert result.consistency.startswith("crash-consistent") and str(error) in result.consistency
    assert json.loads(result.message())["consistency"] == result.consistency
    assert any("crash-consistent" in line for line in lines)


def test_a_freeze_that_timed_out_is_thawed(tmp_path: Path) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent(freeze_error=TimeoutError("late")))
    result, _ = _backup(machine, tmp_path)
    assert result.consistency.startswith("crash-consistent")
    assert "guest-fsfreeze-thaw" in machine.agent.calls and not machine.agent.frozen


def test_a_failed_full_backup_drops_its_new_bitmap_so_the_next_one_is_full_again(
    tmp_path: Path,
) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent())
    _backup(machine, tmp_path)
    machine.monitor.job_error = "I/O error"
    with pytest.raises(BackupError):
        _backup(machine, tmp_path, "Full")
    assert not machine.monitor.bitmaps
    machine.monitor.job_error = ""
    assert _backup(machine, tmp_path)[0].kind == "full"


def test_restore_from_one_backup_s_directory_takes_that_point_of_the_chain(
    tmp_path: Path,
) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent())
    first, _ = _backup(machine, tmp_path)
    _backup(machine, tmp_path)
    assert resolve_restore(first.path, [tmp_path], "ns")[0] == Path(first.path) / "disk0.qcow2"
    with pytest.raises(BackupError, match="not a backup's path"):
        resolve_restore("nightly", [tmp_path], "ns")


def test_jobs_and_targets_an_interrupted_backup_left_in_qemu_are_removed_first(
    tmp_path: Path,
) -> None:
    monitor = FakeMonitor()
    monitor.nodes.add("vkb-0001-0")
    monitor.jobs["vkb-0001-0"] = {"id": "vkb-0001-0", "status": "concluded"}
    machine = FakeMachine(monitor, FakeAgent())
    result, lines = _backup(machine, tmp_path)
    assert result.kind == "full"
    assert ("blockdev-del", {"node-name": "vkb-0001-0"}) in monitor.commands
    assert ("job-dismiss", {"id": "vkb-0001-0"}) in monitor.commands
    assert not monitor.nodes and not monitor.jobs
    assert any("interrupted backup" in line for line in lines)


def test_the_copy_is_timed_by_qemu_s_job_events() -> None:
    from vkubelet.providers.vm._backupqmp import _job_seconds

    def event(job: str, status: str, at: float) -> dict[str, Any]:
        stamp = {"seconds": int(at), "microseconds": round((at % 1) * 1e6)}
        return {
            "event": "JOB_STATUS_CHANGE",
            "data": {"id": job, "status": status},
            "timestamp": stamp,
        }

    events = [
        event("vkb-0001-0", "created", 10.0),
        event("vkb-0001-0", "running", 10.1),
        event("vkb-0001-1", "running", 10.2),
        event("other", "running", 1.0),
        event("vkb-0001-1", "concluded", 10.4),
        event("vkb-0001-0", "concluded", 10.35),
    ]
    assert _job_seconds(events, {"vkb-0001-0", "vkb-0001-1"}) == pytest.approx(0.3)
    assert _job_seconds(events[:2], {"vkb-0001-0"}) is None


def test_a_target_without_room_for_the_copy_is_refused_before_the_freeze(tmp_path: Path) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent())
    full = shutil._ntuple_diskusage(10, 9, 1)
    with (
        mock.patch("shutil.disk_usage", return_value=full),
        pytest.raises(BackupError, match="1 bytes free") as caught,
    ):
        _backup(machine, tmp_path)
    assert caught.value.reason == "TargetRefused"
    assert machine.agent.calls == [] and "transaction" not in machine.monitor.names()


def test_restore_sources_must_be_inside_the_allowed_directories(tmp_path: Path) -> None:
    with pytest.raises(BackupError, match="outside"):
        resolve_restore("/etc/shadow", [tmp_path], "ns")
    with pytest.raises(BackupError, match="no backup manifest"):
        resolve_restore(str(tmp_path / "ns/db/manifest.json"), [tmp_path], "ns")


def test_a_pod_restores_only_a_backup_of_its_own_namespace_and_only_files_in_it(
    tmp_path: Path,
) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent())
    _backup(machine, tmp_path)
    manifest = tmp_path / "ns" / "db" / "manifest.json"
    with pytest.raises(BackupError, match="of namespace 'ns', not of this pod's namespace 'b'"):
        resolve_restore(str(manifest), [tmp_path], "b")
    data = json.loads(manifest.read_text())
    data["backups"][-1]["files"] = ["../../../elsewhere/disk0.qcow2"]
    manifest.write_text(json.dumps(data))
    with pytest.raises(BackupError, match="outside it"):
        resolve_restore(str(manifest), [tmp_path], "ns")


def test_backup_directories_in_the_config_are_resolved_and_default_to_the_state_dir(
    tmp_path: Path,
) -> None:
    from vkubelet.providers.vm._config import ConfigError, parse_config

    config = parse_config({"backupDirectories": ["b", "/srv/x"]}, origin="vm.yaml", base=tmp_path)
    assert config.backup_roots == ((tmp_path / "b").resolve(), Path("/srv/x"))
    default = parse_config({"stateDir": "s"}, origin="vm.yaml", base=tmp_path)
    assert default.backup_roots == ((tmp_path / "s").resolve() / "backups",)
    with pytest.raises(ConfigError, match=r"vm\.yaml: backupDirectories"):
        parse_config({"backupDirectories": "/srv"}, origin="vm.yaml", base=tmp_path)


def _restore(manifest: Path, allowed: Path, disks: list[Path]) -> None:
    annotations = {RESTORE_FROM: str(manifest)}
    asyncio.run(restore_if_asked("ns", annotations, disks, [allowed], None))


def _qcow2(path: Path, *options: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", *options, str(path), "1M"], check=True
    )


def _sums(*paths: Path) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def test_backups_are_private_and_restore_through_their_own_chain(tmp_path: Path) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent())
    _backup(machine, tmp_path / "backups")
    _backup(machine, tmp_path / "backups")  # incremental: backed by the full one, relatively
    chain = tmp_path / "backups" / "ns" / "db"
    for directory in (chain.parent, chain, chain / "0001-full", chain / "0002-incremental"):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    for f in (chain / "manifest.json", *chain.glob("*/*.qcow2")):
        assert f.stat().st_mode & 0o777 == 0o600, f
    disks = [tmp_path / "pod" / "root.qcow2", tmp_path / "pod" / "empty-data.qcow2"]
    disks[0].parent.mkdir()
    _restore(chain / "manifest.json", tmp_path / "backups", disks)
    assert all(d.stat().st_mode & 0o777 == 0o600 for d in disks)


def test_a_restore_never_follows_a_symlink_or_a_backing_file_out_of_the_backup(
    tmp_path: Path,
) -> None:
    machine = FakeMachine(FakeMonitor(), FakeAgent())
    _backup(machine, tmp_path / "backups")
    chain = tmp_path / "backups" / "ns" / "db"
    # another namespace's VM disk, inside the backup directories, and a file of the host
    theirs = tmp_path / "backups" / "other" / "db" / "0001-full" / "disk0.qcow2"
    _qcow2(theirs)
    host = tmp_path / "host-file"
    host.write_bytes(b"secret" * 1000)
    before = _sums(theirs, host)
    pod_disk = tmp_path / "pod" / "root.qcow2"
    pod_disk.parent.mkdir()
    entry = chain / "0001-full" / "disk0.qcow2"
    json_name = "json:" + json.dumps({"file.filename": str(host)})
    planted: list[tuple[str, Callable[[], None]]] = [
        ("not a file of the backup", lambda: entry.symlink_to(theirs)),
        ("not a file of the backup", lambda: _qcow2(entry, "-b", str(theirs), "-F", "qcow2")),
        ("is backed by", lambda: _qcow2(entry, "-b", str(host), "-F", "raw")),
        ("is backed by", lambda: _qcow2(entry, "-u", "-b", json_name, "-F", "qcow2")),
    ]
    for words, plant in planted:
        entry.unlink()
        plant()
        with pytest.raises(BackupError, match=words) as caught:
            _restore(chain / "manifest.json", tmp_path / "backups", [pod_disk])
        assert caught.value.reason == "RestoreFailed"
        assert not pod_disk.exists()
    assert _sums(theirs, host) == before
