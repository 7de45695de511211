"""Backups on the libvirt runtime, on a fake domain (the real qemu-img makes the target files):
what libvirt is asked (push mode into the agent's files, a checkpoint per backup, the seed left
out), the chain's checkpoints, and what a refused, failed or cancelled backup leaves: nothing.
tests/integration/vm/test_vm_libvirt.py backs up and restores a real domain."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vkubelet.providers.vm._backup import BackupError, BackupSource, bitmap_name, run_backup

libvirt = pytest.importorskip("libvirt", reason="libvirt-python is not installed")

from vkubelet.providers.vm._backuplibvirt import LibvirtDiskBackup  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")

SIZE = 1 << 20


class FakeCheckpoint:
    def __init__(self, domain: FakeDomain, name: str, bitmaps: tuple[str, ...] = ("vda", "vdb")):
        self.domain, self.name, self.bitmaps = domain, name, bitmaps

    def getName(self) -> str:
        return self.name

    def delete(self, flags: int) -> int:
        self.domain.checkpoints.pop(self.name, None)
        return 0

    def getXMLDesc(self, flags: int) -> str:
        return (
            f"<domaincheckpoint><name>{self.name}</name><disks>"
            + "".join(
                f"<disk name='{disk}' checkpoint='bitmap' "
                f"size='{self.domain.dirty if disk == 'vda' else 0}'/>"
                for disk in self.bitmaps
            )
            + "</disks></domaincheckpoint>"
        )


class FakeDomain:
    """Two disks (vda, vdb) and the seed (vdc); a backup job runs `steps` polls, then ends as
    `outcome` says."""

    def __init__(self, disks: tuple[Path, ...], seed: Path) -> None:
        self.disks, self.seed = disks, seed
        self.formats = ("qcow2", "qcow2")  # the disks' driver types
        self.seed_device = "disk"  # vkubelet's seed; a site's domain may have a CD-ROM there
        self.checkpoints: dict[str, FakeCheckpoint] = {}
        self.calls: list[tuple[str, Any]] = []
        self.frozen = False
        self.refuse: str | None = None  # backupBegin's error
        self.outcome: dict[str, Any] = {"success": True}
        self.steps = 0
        self.job = 0  # polls left of the running job
        self.completed: dict[str, Any] = {}
        self.dirty = 4096
        self.copying: asyncio.Event | None = None  # set at the job's first progress

    def XMLDesc(self, flags: int) -> str:
        disks = "".join(
            f"<disk type='file' device='{device}'><driver name='qemu' type='{fmt}'/>"
            f"<source file='{path}'/><target dev='{dev}' bus='virtio'/></disk>"
            for path, dev, fmt, device in [
                (self.disks[0], "vda", self.formats[0], "disk"),
                (self.disks[1], "vdb", self.formats[1], "disk"),
                (self.seed, "vdc", "raw", self.seed_device),
            ]
        )
        return f"<domain><devices>{disks}</devices></domain>"

    def blockInfo(self, target: str, flags: int) -> list[int]:
        return [SIZE, SIZE, SIZE]

    def listAllCheckpoints(self, flags: int) -> list[FakeCheckpoint]:
        return list(self.checkpoints.values())

    def checkpointLookupByName(self, name: str, flags: int) -> FakeCheckpoint:
        if name not in self.checkpoints:
            error = libvirt.libvirtError("no checkpoint")
            error.err = (libvirt.VIR_ERR_NO_DOMAIN_CHECKPOINT, 0, "no checkpoint", 0)
            raise error
        return self.checkpoints[name]

    def fsFreeze(self, mountpoints: Any, flags: int) -> int:
        self.calls.append(("fsFreeze", None))
        self.frozen = True
        return 2

    def fsThaw(self, mountpoints: Any, flags: int) -> int:
        self.calls.append(("fsThaw", None))
        self.frozen = False
        return 2

    def backupBegin(self, backup: str, checkpoint: str | None, flags: int) -> int:
        self.calls.append(("backupBegin", (backup, checkpoint, flags)))
        if self.refuse:
            # Its words set here: a bare libvirtError takes the thread's last libvirt error,
            # which another test's real connection may have left (CI got "Broken pipe").
            error = libvirt.libvirtError(self.refuse)
            error.err = (libvirt.VIR_ERR_OPERATION_FAILED, 0, self.refuse, 0)
            raise error
        if checkpoint is not None:
            root = ET.fromstring(checkpoint)  # noqa: S314 - the test's own
            name = root.findtext("name")
            assert name
            bitmaps = tuple(
                str(d.get("name"))
                for d in root.iterfind("./disks/disk")
                if d.get("checkpoint") == "bitmap"
            )
            self.checkpoints[name] = FakeCheckpoint(self, name, bitmaps)  # kept if the job fails
        self.job = self.steps + 1
        return 0

    def jobStats(self, flags: int) -> dict[str, Any]:
        if flags == libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED:
            return self.completed
        if self.job:
            self.job -= 1
            if self.job:
                if self.copying is not None:
                    self.copying.set()
                return {
                    "type": libvirt.VIR_DOMAIN_JOB_UNBOUNDED,
                    "operation": libvirt.VIR_DOMAIN_JOB_OPERATION_BACKUP,
                    "disk_processed": 1,
                    "disk_total": 2,
                }
            self.completed = {
                "type": libvirt.VIR_DOMAIN_JOB_COMPLETED,
                "operation": libvirt.VIR_DOMAIN_JOB_OPERATION_BACKUP,
                "disk_processed": 2,
                "disk_total": 2,
                "time_elapsed": 250,
                **self.outcome,
            }
        return {"type": libvirt.VIR_DOMAIN_JOB_NONE}

    def abortJob(self) -> int:
        self.calls.append(("abortJob", None))
        self.job = 0
        self.completed = {"operation": libvirt.VIR_DOMAIN_JOB_OPERATION_BACKUP, "success": False}
        return 0


class FakeConnection:
    uri = "qemu+ssh://root@hv-1/system"

    def __init__(self, domain: FakeDomain) -> None:
        self._domain = domain

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        await asyncio.sleep(0)
        return call(*args)

    async def domain(self, uuid: str) -> Any:
        return self._domain


class FakeAgent:
    def __init__(self, domain: FakeDomain) -> None:
        self.domain = domain

    async def call(self, command: str, arguments: Any = None, **_: Any) -> Any:
        if command == "guest-ping":
            return {}
        if command == "guest-fsfreeze-status":
            return "frozen" if self.domain.frozen else "thawed"
        raise AssertionError(command)


class FakeStaging:
    """A pool's staging: the pod's disks are markers (`<name>.marker`) of the domain's files;
    libvirt writes into `<host>/<backup id>-<i>`, fetched into the agent's files."""

    def __init__(self, host: Path) -> None:
        self.host = host
        self.fetched: list[str] = []
        self.dropped: list[str] = []

    def host_path(self, disk: Path) -> Path:
        return disk.with_name(disk.name.removesuffix(".marker"))

    async def targets(self, plan: Any, sizes: Any) -> list[Path]:
        return [self.host / f"{plan.backup_id}-{i}" for i in range(len(sizes))]

    async def fetch(self, plan: Any) -> None:
        self.fetched.append(plan.backup_id)

    async def drop(self, plan: Any) -> None:
        self.dropped.append(plan.backup_id)


class FakeMachine:
    runtime = "libvirt"

    def __init__(self, domain: FakeDomain, staging: FakeStaging | None = None) -> None:
        self.domain, self.staging = domain, staging

    def disk_backup(self) -> LibvirtDiskBackup:
        agent: Any = FakeAgent(self.domain)
        return LibvirtDiskBackup(FakeConnection(self.domain), "uuid-1", agent, self.staging)


def _machine(where: Path) -> tuple[FakeMachine, BackupSource]:
    (where / "vm").mkdir(parents=True, exist_ok=True)
    paths = tuple(where / "vm" / f"d{i}.qcow2" for i in range(2))
    for path in paths:
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "1M"], check=True)
    seed = where / "vm" / "seed.iso"
    seed.write_bytes(b"")
    source = BackupSource("ns", "db-abcde", "uid-1", "db", None, paths)
    return FakeMachine(FakeDomain(paths, seed)), source


def _backup(machine: FakeMachine, source: BackupSource, target: Path, mode: str = "Auto") -> Any:
    return asyncio.run(
        run_backup(machine, source, target, mode, backup_pod="b", progress=lambda _: None)
    )


def _begins(domain: FakeDomain) -> list[tuple[ET.Element, ET.Element, int]]:
    return [
        (ET.fromstring(a[0]), ET.fromstring(a[1]), a[2])  # noqa: S314 - the test's own
        for c, a in domain.calls
        if c == "backupBegin"
    ]


def _imported(machine: FakeMachine, source: BackupSource) -> BackupSource:
    """The same domain as an imported one: vkubelet made none of its disks, and the seed is
    the site's CD-ROM."""
    machine.domain.seed_device = "cdrom"
    return BackupSource(source.namespace, source.pod, source.pod_uid, source.vm_name, None, ())


def test_an_imported_domain_s_own_file_disks_are_backed_up_full_then_incrementally(
    tmp_path: Path,
) -> None:
    machine, source = _machine(tmp_path)
    imported = _imported(machine, source)
    first = _backup(machine, imported, tmp_path / "backups")
    second = _backup(machine, imported, tmp_path / "backups")
    assert (first.kind, second.kind) == ("full", "incremental")
    (backup, checkpoint, _), (incremental, _, _) = _begins(machine.domain)
    copied = {d.get("name"): d.get("backup") for d in backup.iterfind("./disks/disk")}
    assert copied == {"vda": "yes", "vdb": "yes", "vdc": "no"}  # its file disks, not its CD-ROM
    marks = {d.get("name"): d.get("checkpoint") for d in checkpoint.iterfind("./disks/disk")}
    assert marks == {"vda": "bitmap", "vdb": "bitmap", "vdc": "no"}
    assert incremental.findtext("incremental") is not None
    manifest = (tmp_path / "backups" / "ns" / "db" / "manifest.json").read_text()
    assert "0002-incremental/disk1.qcow2" in manifest


def test_a_raw_disk_keeps_no_checkpoint_and_every_backup_of_it_is_full(tmp_path: Path) -> None:
    machine, source = _machine(tmp_path)
    domain = machine.domain
    imported = _imported(machine, source)
    domain.formats = ("qcow2", "raw")  # a site's raw disk beside a qcow2 one: no bitmap on it
    _backup(machine, imported, tmp_path / "backups")
    _, checkpoint, _ = _begins(domain)[0]
    marks = {d.get("name"): d.get("checkpoint") for d in checkpoint.iterfind("./disks/disk")}
    assert marks == {"vda": "bitmap", "vdb": "no", "vdc": "no"}
    assert _backup(machine, imported, tmp_path / "backups").kind == "full"
    with pytest.raises(BackupError, match="incremental backup is impossible"):
        _backup(machine, imported, tmp_path / "backups", "Incremental")

    domain.formats = ("raw", "raw")  # nothing can keep a checkpoint: libvirt is asked for none
    domain.checkpoints.clear()
    domain.calls.clear()
    assert _backup(machine, imported, tmp_path / "raw").kind == "full"
    ((_, args),) = [c for c in domain.calls if c[0] == "backupBegin"]
    assert args[1] is None and not domain.checkpoints


def test_a_full_then_an_incremental_backup_through_libvirt_s_backup_api_and_checkpoints(
    tmp_path: Path,
) -> None:
    machine, source = _machine(tmp_path)
    domain = machine.domain
    chain_dir = tmp_path / "backups" / "ns" / "db"
    chain = bitmap_name(chain_dir)
    first = _backup(machine, source, tmp_path / "backups")
    assert first.kind == "full" and first.consistency == "filesystem-consistent"
    assert first.copy_seconds == pytest.approx(0.25)  # libvirt's time_elapsed
    backup, checkpoint, flags = _begins(domain)[0]
    assert flags == libvirt.VIR_DOMAIN_BACKUP_BEGIN_REUSE_EXTERNAL  # the agent's files
    assert backup.get("mode") == "push" and backup.find("incremental") is None
    disks = {d.get("name"): d for d in backup.iterfind("./disks/disk")}
    assert disks["vda"].find("target").get("file") == str(chain_dir / "0001-full/disk0.qcow2")  # type: ignore[union-attr]
    assert disks["vdb"].find("target").get("file") == str(chain_dir / "0001-full/disk1.qcow2")  # type: ignore[union-attr]
    assert disks["vdc"].get("backup") == "no"  # the seed
    assert checkpoint.findtext("name") == f"{chain}-0001"
    marks = {d.get("name"): d.get("checkpoint") for d in checkpoint.iterfind("./disks/disk")}
    assert marks == {"vda": "bitmap", "vdb": "bitmap", "vdc": "no"}
    # frozen around the start only
    assert [c for c, _ in domain.calls] == ["fsFreeze", "backupBegin", "fsThaw"]
    assert (chain_dir / "0001-full/disk0.qcow2").exists()

    second = _backup(machine, source, tmp_path / "backups")
    assert second.kind == "incremental"
    backup, checkpoint, _ = _begins(domain)[1]
    assert backup.findtext("incremental") == f"{chain}-0001"
    assert checkpoint.findtext("name") == f"{chain}-0002"
    assert list(domain.checkpoints) == [f"{chain}-0002"]  # one per chain: the latest
    info = subprocess.run(
        ["qemu-img", "info", "--output=json", str(chain_dir / "0002-incremental/disk0.qcow2")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '"backing-filename": "../0001-full/disk0.qcow2"' in info


def test_a_checkpoint_gone_makes_the_next_backup_full_and_incremental_mode_fails(
    tmp_path: Path,
) -> None:
    machine, source = _machine(tmp_path)
    _backup(machine, source, tmp_path)
    machine.domain.checkpoints.clear()  # the domain was defined again (a power cycle)
    with pytest.raises(BackupError, match="incremental backup is impossible"):
        _backup(machine, source, tmp_path, "Incremental")
    assert _backup(machine, source, tmp_path).kind == "full"


def _nothing_left(machine: FakeMachine, tmp_path: Path) -> None:
    domain = machine.domain
    assert not domain.checkpoints and not domain.frozen
    assert not list((tmp_path / "ns" / "db").glob("0001-*"))
    assert not (tmp_path / "ns" / "db" / "manifest.json").exists()


def test_with_a_staging_libvirt_copies_into_its_volumes_which_are_fetched_or_dropped(
    tmp_path: Path,
) -> None:
    """`libvirt.pool`: the pod's disks are markers, mapped to the domain's volumes; libvirt
    writes into the staging's targets, fetched after a success, dropped after a failure."""
    machine, source = _machine(tmp_path)
    staging = FakeStaging(tmp_path / "host")
    pooled = FakeMachine(machine.domain, staging)
    markers = tuple(d.with_name(d.name + ".marker") for d in source.disks)
    marked = BackupSource("ns", "db-abcde", "uid-1", "db", None, markers)
    assert _backup(pooled, marked, tmp_path / "backups").kind == "full"
    backup, _, _ = _begins(machine.domain)[0]
    files = {d.get("name"): d.find("target") for d in backup.iterfind("./disks/disk")}
    assert files["vda"].get("file") == str(tmp_path / "host" / "0001-0")  # type: ignore[union-attr]
    assert staging.fetched == ["0001"] and staging.dropped == []
    machine.domain.refuse = "Could not open the target"
    with pytest.raises(BackupError, match="Could not open"):
        _backup(pooled, marked, tmp_path / "backups")
    assert staging.fetched == ["0001"] and staging.dropped == ["0002"]


def test_a_backup_libvirt_refuses_fails_with_its_words_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    machine, source = _machine(tmp_path)
    machine.domain.refuse = "Could not open '/srv/b/disk0.qcow2': No such file or directory"
    with pytest.raises(BackupError, match="Could not open") as caught:
        _backup(machine, source, tmp_path)
    assert caught.value.reason == "BackupFailed" and "qemu+ssh://" in caught.value.message
    _nothing_left(machine, tmp_path)


def test_a_failed_job_fails_the_backup_and_drops_its_checkpoint_and_files(tmp_path: Path) -> None:
    machine, source = _machine(tmp_path)
    machine.domain.steps = 2
    machine.domain.outcome = {"success": False, "errmsg": "No space left on device"}
    with pytest.raises(BackupError, match="No space left on device"):
        _backup(machine, source, tmp_path)
    _nothing_left(machine, tmp_path)


def test_a_cancelled_backup_aborts_libvirt_s_job_and_leaves_nothing(tmp_path: Path) -> None:
    machine, source = _machine(tmp_path)
    domain = machine.domain
    domain.steps = 10**6  # copies until cancelled

    async def scenario() -> None:
        domain.copying = asyncio.Event()
        task = asyncio.create_task(
            run_backup(machine, source, tmp_path, "Auto", backup_pod="b", progress=print)
        )
        await domain.copying.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert ("abortJob", None) in domain.calls
    _nothing_left(machine, tmp_path)


def test_a_backup_job_and_checkpoints_an_interrupted_agent_left_are_removed_first(
    tmp_path: Path,
) -> None:
    machine, source = _machine(tmp_path)
    domain = machine.domain
    chain = bitmap_name(tmp_path / "ns" / "db")
    stale = f"{chain}-0007"  # made by a backup the manifest never recorded
    domain.checkpoints[stale] = FakeCheckpoint(domain, stale)
    other = "vkubelet-backup-0123456789abcdef-0003"  # another target's chain: kept
    domain.checkpoints[other] = FakeCheckpoint(domain, other)
    domain.job = 10**6  # still copying
    result = _backup(machine, source, tmp_path)
    assert result.kind == "full"  # the manifest knows no backup: 0001 was never finished
    assert ("abortJob", None) in domain.calls
    assert sorted(domain.checkpoints) == sorted([other, f"{chain}-0001"])  # the stale one gone


def test_a_disk_that_is_not_the_domain_s_file_is_refused_before_anything_is_made(
    tmp_path: Path,
) -> None:
    machine, source = _machine(tmp_path)
    machine.domain.disks = (tmp_path / "pool" / "vol-0", tmp_path / "pool" / "vol-1")  # a pool
    with pytest.raises(BackupError, match=r"libvirt\.pool") as caught:
        _backup(machine, source, tmp_path)
    assert caught.value.reason == "BackupFailed"
    assert machine.domain.calls == [] and not list((tmp_path / "ns" / "db").iterdir())


def test_an_imported_domain_without_a_file_disk_is_refused_and_nothing_is_made(
    tmp_path: Path,
) -> None:
    machine, source = _machine(tmp_path)
    block = (
        "<domain><devices><disk type='block' device='disk'><source dev='/dev/vg0/db'/>"
        "<target dev='vda' bus='virtio'/></disk></devices></domain>"
    )
    machine.domain.XMLDesc = lambda flags: block  # type: ignore[method-assign]
    with pytest.raises(BackupError, match="no file disk") as caught:
        _backup(machine, _imported(machine, source), tmp_path)
    assert caught.value.reason == "BackupFailed"
    assert [c for c, _ in machine.domain.calls] == [] and not machine.domain.checkpoints
    assert list((tmp_path / "ns" / "db").iterdir()) == []
