"""Backups on the libvirt runtime: the `DiskBackup` of a domain, through libvirt's backup API.

- The instant is `virDomainBackupBegin` in push mode with a checkpoint defined in the same
  call (`virDomainCheckpointCreateXML`'s XML as its second argument): libvirt starts one
  backup job over every disk listed and creates the checkpoint, a persistent dirty bitmap per
  disk in the qcow2, at that instant. The domain's other disks (the seed, PVC disks: not
  backed up, as with QEMU) are listed with `backup='no'` and `checkpoint='no'`.
- Checkpoints are named `<chain>-<backup id>`, the chain being the target's `bitmap_name`: an
  incremental copies what changed since the previous backup's checkpoint (`<incremental>`),
  then the older checkpoints of the chain are deleted (one per chain stays). A checkpoint that
  is gone (the domain was defined again: a power cycle, an adoption) makes the next backup full.
- The target files are made by the agent beforehand (`run_backup`: a qcow2, for an incremental
  one backed by the previous backup's file) and handed to libvirt with `REUSE_EXTERNAL`, which
  keeps their backing file. libvirt's QEMU opens them **by path on the daemon's host**: with a
  remote daemon the backup directories must be the same paths on both hosts (a shared file
  system), as the disks under `stateDir` must; a daemon that does not see the agent's file
  refuses the backup ("Could not open ...") and nothing is left.
- The freeze is libvirt's `virDomainFSFreeze`/`FSThaw` (libvirt knows the guest is frozen and
  refuses what it must not do meanwhile); the ping and the status are the guest agent's.
- Progress and the outcome are the domain's job info (`virDomainGetJobStats`: the active job,
  then the completed one's `success`/`errmsg`, and its `time_elapsed` for the copy's seconds).
- A failure or a cancel aborts the job (`virDomainAbortJob`) and deletes this backup's new
  checkpoint (libvirt keeps one for an aborted backup); a backup job an interrupted agent left
  is aborted, and checkpoints of the chain the manifest does not know are deleted, before the
  next backup starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ._backup import BackupError, BackupPlan, DiskState, JobProgress
from ._qga import GuestAgent

__all__ = ["LibvirtDiskBackup"]

T = TypeVar("T")
_ABORT_WAIT = 30.0


class BackupStaging(Protocol):
    """Where a daemon that cannot see the agent's files (`libvirt.pool`) writes a backup: its
    own volumes, whose bytes are fetched into the agent's target files once the copy is done
    (`_pool.PoolBackupStaging`). The chain, manifest and restore stay the agent's files."""

    def host_path(self, disk: Path) -> Path:
        """A disk of the pod (the agent's marker file) as the daemon's path of its volume."""
        ...

    async def targets(self, plan: BackupPlan, sizes: Sequence[int]) -> list[Path]:
        """One blank qcow2 volume per disk, of its virtual size; their paths on the host."""
        ...

    async def fetch(self, plan: BackupPlan) -> None:
        """The volumes' bytes into `plan.files` (an incremental one keeping its backing file),
        then the volumes removed."""
        ...

    async def drop(self, plan: BackupPlan) -> None:
        """This backup's volumes removed, if any; never raises."""
        ...


class DomainConnection(Protocol):
    """What this needs of `_libvirt.Connection`: its URI, its thread pool, a domain by UUID."""

    uri: str

    async def run(self, call: Callable[..., T], *args: Any) -> T: ...

    async def domain(self, uuid: str) -> Any: ...


def _binding() -> Any:
    import libvirt  # only where the libvirt runtime runs, which checked it is installed

    return libvirt


def _words(error: BaseException) -> str:
    """libvirt's own message (its exceptions' str() can be empty)."""
    get = getattr(error, "get_error_message", None)
    return str((get() if get is not None else None) or error)


class LibvirtDiskBackup:
    """One backup of a libvirt domain."""

    runtime = "libvirt"

    def __init__(
        self,
        connection: DomainConnection,
        uuid: str,
        agent: GuestAgent,
        staging: BackupStaging | None = None,
    ) -> None:
        self.connection, self.uuid, self.agent = connection, uuid, agent
        self.staging = staging
        self._files: list[Path] = []  # where libvirt writes each disk's copy
        self._sizes: list[int] = []  # each disk's virtual size
        self._disks: list[FileDisk] = []  # the disks backed up, disk order
        self._others: list[str] = []  # the domain's other disk targets (the seed): not backed up
        self._elapsed: float | None = None

    def _failed(self, error: BaseException) -> BackupError:
        return BackupError("BackupFailed", f"libvirt {self.connection.uri}: {_words(error)}")

    async def _domain(self) -> Any:
        domain = await self.connection.domain(self.uuid)
        if domain is None:
            raise BackupError("VMNotRunning", f"libvirt {self.connection.uri}: domain gone")
        return domain

    # -- the guest agent ------------------------------------------------------------------------
    async def guest_ping(self, timeout: float) -> None:  # noqa: ASYNC109
        await self.agent.call("guest-ping", timeout=timeout)

    async def freeze(self, timeout: float) -> int:  # noqa: ASYNC109
        libvirt = _binding()
        domain = await self._domain()
        try:
            call = self.connection.run(domain.fsFreeze, None, 0)
            return int(await asyncio.wait_for(call, timeout))
        except libvirt.libvirtError as e:
            if e.get_error_code() == libvirt.VIR_ERR_OPERATION_TIMEOUT:
                raise TimeoutError(f"fsfreeze: {_words(e)}") from None
            raise RuntimeError(_words(e)) from None

    async def thaw(self, timeout: float) -> int:  # noqa: ASYNC109
        libvirt = _binding()
        domain = await self._domain()
        try:
            return int(await asyncio.wait_for(self.connection.run(domain.fsThaw, None, 0), timeout))
        except libvirt.libvirtError as e:
            raise RuntimeError(_words(e)) from None

    async def thawed(self) -> bool:
        return bool(await self.agent.call("guest-fsfreeze-status") == "thawed")

    # -- the disks -----------------------------------------------------------------------------
    async def inspect(
        self, disks: Sequence[Path], chain: str, since: str | None, progress: Callable[[str], None]
    ) -> list[DiskState]:
        libvirt = _binding()
        domain = await self._domain()
        try:
            await self._abort_leftover_job(domain, progress)
            xml = await self.connection.run(domain.XMLDesc, 0)
            files, every = domain_disks(xml)
            if self.staging is not None:  # the pod's disks are markers of the host's volumes
                disks = [self.staging.host_path(d) for d in disks]
            self._disks = _match(files, disks)
            targets = [d.target for d in self._disks]
            self._others = [t for t in every if t not in targets]
            wanted = f"{chain}-{since}" if since is not None else None
            names = await self._checkpoints(domain, chain)
            stale = [n for n in names if n != wanted]
            if stale:
                progress(f"deleting checkpoints no backup in the manifest counts from: {stale}")
                for name in stale:
                    await self._delete_checkpoint(domain, name)
            dirty = await self._dirty(domain, wanted) if wanted in names else None
            states = []
            for disk in self._disks:
                info = await self.connection.run(domain.blockInfo, disk.target, 0)
                states.append(
                    DiskState(
                        path=Path(disk.path),
                        size=int(info[0]),
                        incremental=dirty is not None and disk.target in dirty,
                        dirty=(dirty or {}).get(disk.target, 0),
                    )
                )
        except libvirt.libvirtError as e:
            raise self._failed(e) from None
        self._sizes = [s.size for s in states]
        return states

    async def _abort_leftover_job(self, domain: Any, progress: Callable[[str], None]) -> None:
        """A backup job an interrupted agent left (libvirt runs it on): aborted, or the new
        backup would be refused for it."""
        libvirt = _binding()
        stats = await self.connection.run(domain.jobStats, 0)
        if stats.get("type", libvirt.VIR_DOMAIN_JOB_NONE) == libvirt.VIR_DOMAIN_JOB_NONE:
            return
        if stats.get("operation") != libvirt.VIR_DOMAIN_JOB_OPERATION_BACKUP:
            return  # another job (a migration, a save): the backup's start says why it waits
        progress("aborting the backup job an interrupted backup left")
        await self._abort_job(domain)

    async def _abort_job(self, domain: Any) -> None:
        libvirt = _binding()
        with contextlib.suppress(libvirt.libvirtError):
            await self.connection.run(domain.abortJob)
        deadline = time.monotonic() + _ABORT_WAIT
        while time.monotonic() < deadline:
            stats = await self.connection.run(domain.jobStats, 0)
            if stats.get("type", libvirt.VIR_DOMAIN_JOB_NONE) == libvirt.VIR_DOMAIN_JOB_NONE:
                return
            await asyncio.sleep(0.1)

    async def _checkpoints(self, domain: Any, chain: str) -> list[str]:
        found = await self.connection.run(domain.listAllCheckpoints, 0)
        names = [str(c.getName()) for c in found]
        return [n for n in names if n.startswith(f"{chain}-")]

    async def _delete_checkpoint(self, domain: Any, name: str) -> None:
        libvirt = _binding()
        try:
            checkpoint = await self.connection.run(domain.checkpointLookupByName, name, 0)
        except libvirt.libvirtError as e:
            if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_CHECKPOINT:
                return
            raise
        await self.connection.run(checkpoint.delete, 0)

    async def _dirty(self, domain: Any, name: str | None) -> dict[str, int]:
        """Bytes written since checkpoint `name`, per disk target it covers."""
        libvirt = _binding()
        checkpoint = await self.connection.run(domain.checkpointLookupByName, name, 0)
        flags = libvirt.VIR_DOMAIN_CHECKPOINT_XML_SIZE | libvirt.VIR_DOMAIN_CHECKPOINT_XML_NO_DOMAIN
        xml = await self.connection.run(checkpoint.getXMLDesc, flags)
        return checkpoint_sizes(xml)

    async def prepare(self, plan: BackupPlan) -> None:
        """libvirt opens the target files itself, by path: the agent's, or the staging's."""
        if self.staging is None:
            self._files = list(plan.files)
            return
        self._files = await self.staging.targets(plan, self._sizes)

    async def begin(self, plan: BackupPlan) -> None:
        libvirt = _binding()
        domain = await self._domain()
        targets = [d.target for d in self._disks]
        backup = backup_xml(plan, targets, self._files, self._others)
        checkpoint = checkpoint_xml(f"{plan.chain}-{plan.backup_id}", self._disks, self._others)
        flags = libvirt.VIR_DOMAIN_BACKUP_BEGIN_REUSE_EXTERNAL
        try:
            await self.connection.run(domain.backupBegin, backup, checkpoint, flags)
        except libvirt.libvirtError as e:
            raise self._failed(e) from None

    async def progress(self) -> JobProgress:
        libvirt = _binding()
        domain = await self._domain()
        try:
            stats = await self.connection.run(domain.jobStats, 0)
            if stats.get("type", libvirt.VIR_DOMAIN_JOB_NONE) != libvirt.VIR_DOMAIN_JOB_NONE:
                done, total = int(stats.get("disk_processed", 0)), int(stats.get("disk_total", 0))
                return JobProgress(done, total, finished=False)
            completed = libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED
            stats = await self.connection.run(domain.jobStats, completed)
        except libvirt.libvirtError as e:
            raise self._failed(e) from None
        done, total = int(stats.get("disk_processed", 0)), int(stats.get("disk_total", 0))
        if "time_elapsed" in stats:
            self._elapsed = int(stats["time_elapsed"]) / 1000
        if stats.get("operation") != libvirt.VIR_DOMAIN_JOB_OPERATION_BACKUP:
            error = "the backup job ended and libvirt kept no result (was libvirtd restarted?)"
            return JobProgress(done, total, finished=True, error=error)
        if not stats.get("success"):
            error = f"libvirt {self.connection.uri}: {stats.get('errmsg') or 'the backup failed'}"
            return JobProgress(done, total, finished=True, error=error)
        return JobProgress(done, total, finished=True)

    async def finish(self, plan: BackupPlan) -> float | None:
        """The chain's older checkpoints deleted: the next incremental counts from this one."""
        if self.staging is not None:  # fails the backup (then `abort`) when it cannot
            await self.staging.fetch(plan)
        libvirt = _binding()
        domain = await self._domain()
        current = f"{plan.chain}-{plan.backup_id}"
        with contextlib.suppress(libvirt.libvirtError):  # kept, they cost only their bitmaps
            for name in await self._checkpoints(domain, plan.chain):
                if name != current:
                    await self._delete_checkpoint(domain, name)
        return self._elapsed

    async def abort(self, plan: BackupPlan) -> None:
        with contextlib.suppress(Exception):
            domain = await self._domain()
            stats = await self.connection.run(domain.jobStats, 0)
            if stats.get("operation") == _binding().VIR_DOMAIN_JOB_OPERATION_BACKUP:
                await self._abort_job(domain)
            await self._delete_checkpoint(domain, f"{plan.chain}-{plan.backup_id}")
        if self.staging is not None:  # after the job: nothing writes them any more
            await self.staging.drop(plan)


@dataclass(frozen=True)
class FileDisk:
    """A disk of the domain that is a file: what a backup copies."""

    target: str  # vda, sdb, ...
    path: str  # as the domain names it, on the daemon's host
    format: str  # its driver's type: only qcow2 keeps a checkpoint's bitmap

    @property
    def bitmaps(self) -> bool:
        return self.format == "qcow2"


def domain_disks(xml: str) -> tuple[list[FileDisk], list[str]]:
    """The domain's file disks (not CD-ROMs), in its order, and every disk target."""
    root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    files: list[FileDisk] = []
    every: list[str] = []
    for disk in root.iterfind("./devices/disk"):
        target, source, driver = disk.find("target"), disk.find("source"), disk.find("driver")
        dev = target.get("dev") if target is not None else None
        if not dev:
            continue
        every.append(dev)
        path = source.get("file") if source is not None else None
        if path and disk.get("device", "disk") == "disk":
            fmt = (driver.get("type") if driver is not None else None) or "raw"
            files.append(FileDisk(dev, path, fmt))
    return files, every


def _match(files: Sequence[FileDisk], disks: Sequence[Path]) -> list[FileDisk]:
    """The domain's disk of each file vkubelet made (given resolved, as libvirt has them); no
    files given: every file disk of the domain (an imported domain's own)."""
    if not disks:
        if not files:
            raise BackupError(
                "BackupFailed",
                "the domain has no file disk (block devices and network disks are not backed up)",
            )
        return list(files)
    by_file = {os.path.realpath(f.path): f for f in files}
    matched = []
    for disk in disks:
        found = by_file.get(os.path.realpath(disk))
        if found is None:
            raise BackupError(
                "BackupFailed",
                f"the domain has no disk {disk}: its disks are not the agent's files "
                "(libvirt.pool, a fleet: not backed up yet)",
            )
        matched.append(found)
    return matched


def backup_xml(
    plan: BackupPlan, targets: Sequence[str], files: Sequence[Path], others: Sequence[str]
) -> str:
    """libvirt's `<domainbackup>` in push mode: each disk into its (existing) target file."""
    root = ET.Element("domainbackup", {"mode": "push"})
    if plan.kind == "incremental":
        assert plan.since is not None
        ET.SubElement(root, "incremental").text = f"{plan.chain}-{plan.since}"
    disks = ET.SubElement(root, "disks")
    for target, path in zip(targets, files, strict=True):
        disk = ET.SubElement(disks, "disk", {"name": target, "backup": "yes", "type": "file"})
        ET.SubElement(disk, "target", {"file": str(path)})
        ET.SubElement(disk, "driver", {"type": "qcow2"})
    for other in others:
        ET.SubElement(disks, "disk", {"name": other, "backup": "no"})
    return ET.tostring(root, encoding="unicode")


def checkpoint_xml(name: str, backed_up: Sequence[FileDisk], others: Sequence[str]) -> str | None:
    """libvirt's `<domaincheckpoint>`: a bitmap on each backed-up qcow2 disk, none elsewhere;
    None when no disk can keep one (raw files: every backup of them is full)."""
    if not any(d.bitmaps for d in backed_up):
        return None
    root = ET.Element("domaincheckpoint")
    ET.SubElement(root, "name").text = name
    disks = ET.SubElement(root, "disks")
    for disk in backed_up:
        ET.SubElement(
            disks, "disk", {"name": disk.target, "checkpoint": "bitmap" if disk.bitmaps else "no"}
        )
    for other in others:
        ET.SubElement(disks, "disk", {"name": other, "checkpoint": "no"})
    return ET.tostring(root, encoding="unicode")


def checkpoint_sizes(xml: str) -> dict[str, int]:
    """A checkpoint's XML (with sizes) → bytes written since it, per disk it has a bitmap of."""
    root = ET.fromstring(xml)  # noqa: S314 - from the libvirt daemon we drive
    sizes = {}
    for disk in root.iterfind("./disks/disk"):
        if disk.get("checkpoint") == "bitmap" and disk.get("name"):
            sizes[str(disk.get("name"))] = int(disk.get("size") or 0)
    return sizes
