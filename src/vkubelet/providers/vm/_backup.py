"""Backup pods and restores: a consistent copy of a running VM's disks, full then incremental.

A pod with annotation `vm.vkubelet.io/backup-of: <VM pod>` (image `vm.vkubelet.io/backup`,
restartPolicy Never, bound to the VM's node) is not a VM: it is one backup task of the VM pod
named, in the same namespace. Its one container runs the task and ends Succeeded (termination
message `{"kind","sizeBytes","durationSeconds","path"}`) or Failed with a reason (`VMNotFound`,
`TargetRefused`, `BackupFailed`, ...). Its log is the task's progress. This module is the
engine and knows no pod; `_backups` runs the pods.

How a backup is taken, and why (the same for every runtime; how each runtime copies the
disks and counts the guest's writes is its `DiskBackup`: `_backupqmp` for QEMU through QMP,
`_backuplibvirt` for libvirt's backup API):
- The guest's filesystems are frozen through the guest agent, so the copy is what a clean
  unmount would leave. A guest without an answering agent is copied crash-consistent, and the
  result says so.
- The runtime starts the copy of every disk at one instant (and, for a full backup, the chain's
  record of writes from it: a dirty bitmap, a libvirt checkpoint); the copy-before-write of its
  backup jobs holds that instant, so the guest is thawed as soon as the copy started; the
  copying goes on while the guest runs.
- The thaw is in a `finally`: no error path leaves the guest frozen. A failure or a cancel
  stops the copy, drops this backup's new record of writes and removes its files.
- A target without room for the copy is refused before the freeze (`qemu-img measure`, or the
  runtime's count of the bytes written since the previous backup): one that filled up mid-copy
  would fail the copy-before-write, i.e. the guest's own writes.
- The target files are made here with qemu-img before the copy: a full backup's a
  self-contained qcow2, an incremental one's a qcow2 whose backing file is the previous
  backup's (relative path): the chain of files is the disk at each backup. The record of
  writes is named after the target directory (`bitmap_name`), so backups of one VM to two
  targets keep two independent chains. A disk whose runtime kept no record for this chain (a
  VM that was killed, a new disk) gets a full backup, whatever the mode asked (`Incremental`
  then fails instead: it cannot be honoured).

Layout of a target: `<target>/<namespace>/<vm>/manifest.json` (the chain: every backup with
kind, files, sizes, times, consistency, the VM's identity) and one directory per backup,
`0001-full/disk0.qcow2 ...`, `0002-incremental/...`. Targets are checked against the node's
allow-list (`backupDirectories` in the provider config), because a pod author names them and the
agent writes as root; restores read only from there, for the same reason.

Restore: a VM pod with `vm.vkubelet.io/restore-from: <manifest, or a backup directory>` gets its
disks (root first, then its emptyDir disks, in order) built from that backup (the latest one for a
manifest) with `qemu-img convert`, which reads through the chain and writes one flat qcow2, before
its first boot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..._files import make_private, private_dir, write_atomic
from ...sdk.logs import LogWriter
from ...sdk.retry import Backoff
from ._disks import DiskError, _qemu_img, resize

__all__ = [
    "BACKUP_IMAGE",
    "BACKUP_MODE",
    "BACKUP_OF",
    "BACKUP_TARGET",
    "RESTORE_FROM",
    "BackupError",
    "BackupPlan",
    "BackupResult",
    "BackupSource",
    "Backupable",
    "DiskBackup",
    "DiskState",
    "JobProgress",
    "is_backup_pod",
    "resolve_restore",
    "resolve_target",
    "restore_disks",
    "restore_if_asked",
    "run_backup",
]

log = logging.getLogger(__name__)

BACKUP_OF = "vm.vkubelet.io/backup-of"
BACKUP_TARGET = "vm.vkubelet.io/backup-target"
BACKUP_MODE = "vm.vkubelet.io/backup-mode"
RESTORE_FROM = "vm.vkubelet.io/restore-from"
BACKUP_IMAGE = "vm.vkubelet.io/backup"
MANIFEST = "manifest.json"
_FREEZE_TIMEOUT = 20.0  # a freeze syncs the guest's dirty data first: it may take a while
_PING_TIMEOUT = 3.0
_THAW_ATTEMPTS = 5
_POLL = 0.2
_SPACE_MARGIN = 8 * 2**20  # per disk: qcow2 metadata, and what the guest writes meanwhile


class BackupError(Exception):
    """A backup or restore that cannot be done; `reason` is the container's terminated reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class DiskState:
    """One disk of the running machine, as its runtime sees it before a backup."""

    path: Path  # its file, as the runtime names it (on the runtime's host)
    size: int  # virtual size, bytes: the target file's
    incremental: bool  # the runtime counts this chain's writes since the previous backup
    dirty: int = 0  # bytes written since then (what an incremental copies)


@dataclass(frozen=True)
class BackupPlan:
    """One backup, decided by `run_backup`: what a runtime's `DiskBackup` carries out."""

    kind: str  # full | incremental
    backup_id: str  # 0001, 0002, ...: names this backup's jobs and records in the runtime
    chain: str  # `bitmap_name` of the target: names the chain's record of writes
    since: str | None  # the previous backup's id (what an incremental counts from)
    disks: tuple[Path, ...]  # the machine's disk files, root first
    files: tuple[Path, ...]  # the target qcow2 files, made already, one per disk


@dataclass(frozen=True)
class JobProgress:
    done: int  # bytes copied so far
    total: int
    finished: bool
    error: str = ""  # the runtime's words when it finished failing


class DiskBackup(Protocol):
    """How one runtime copies a running machine's disks at one instant and counts what the
    guest writes after it: QMP's block jobs and dirty bitmaps (`_backupqmp`), libvirt's backup
    API and checkpoints (`_backuplibvirt`). What a backup is (targets, the chain of files, the
    manifest, the space check, the freeze around the instant, cleaning up after a failure) is
    `run_backup`'s and the same for every runtime. One instance serves one backup."""

    @property
    def runtime(self) -> str: ...  # named in errors

    async def guest_ping(self, timeout: float) -> None: ...  # noqa: ASYNC109

    async def freeze(self, timeout: float) -> int:  # noqa: ASYNC109
        """Freeze the guest's filesystems (how many); raises when the agent cannot or did
        not answer in time (TimeoutError: it may have frozen them)."""
        ...

    async def thaw(self, timeout: float) -> int: ...  # noqa: ASYNC109

    async def thawed(self) -> bool: ...  # the guest agent says nothing is frozen

    async def inspect(
        self, disks: Sequence[Path], chain: str, since: str | None, progress: Callable[[str], None]
    ) -> list[DiskState]:
        """Each disk's state, once what an interrupted backup of this machine left is gone
        (said through `progress`); BackupError when a disk is not the machine's. No `disks`:
        the machine's own disks, every one it has (an imported domain's: vkubelet made none),
        or BackupError when the runtime cannot list them."""
        ...

    async def prepare(self, plan: BackupPlan) -> None:
        """Whatever must be ready before the instant (the targets opened), outside the freeze."""
        ...

    async def begin(self, plan: BackupPlan) -> None:
        """The instant: every disk's copy starts at once, and a full backup starts the chain's
        record of writes. Called with the guest frozen: it must return quickly."""
        ...

    async def progress(self) -> JobProgress: ...

    async def finish(self, plan: BackupPlan) -> float | None:
        """After the copy succeeded: the runtime's own resources released, records older than
        this backup dropped; the copy's seconds as the runtime measured them (None: unknown)."""
        ...

    async def abort(self, plan: BackupPlan) -> None:
        """After a failure or a cancel: no copy left running, no target left open, and this
        backup's new record of writes dropped (the next backup counts from the last good one).
        Never raises."""
        ...


@runtime_checkable
class Backupable(Protocol):
    """A running machine that can be backed up: its runtime's `DiskBackup`."""

    def disk_backup(self) -> DiskBackup: ...


@dataclass(frozen=True)
class BackupSource:
    """The VM pod being backed up, as the provider knows it."""

    namespace: str
    pod: str
    pod_uid: str
    vm_name: str  # the VirtualMachine's name (label vm.vkubelet.io/name) or the pod's
    machine: str | None  # vm.vkubelet.io/machine, when the pod is an incarnation of one
    # Root first; QEMU's device ids are disk0, disk1, ... None made by vkubelet (an imported
    # domain): the runtime backs up the domain's own disks.
    disks: tuple[Path, ...]


@dataclass(frozen=True)
class BackupResult:
    kind: str  # full | incremental
    size_bytes: int
    duration_seconds: float
    path: str  # the backup's directory (a restore source)
    consistency: str
    copy_seconds: float = 0.0  # the block jobs alone (what scales with the data copied)

    def message(self) -> str:
        return json.dumps(
            {
                "kind": self.kind,
                "sizeBytes": self.size_bytes,
                "durationSeconds": round(self.duration_seconds, 3),
                "path": self.path,
                "consistency": self.consistency,
                "copySeconds": round(self.copy_seconds, 3),
            },
            separators=(",", ":"),
        )


def is_backup_pod(annotations: Mapping[str, str] | None) -> bool:
    return bool((annotations or {}).get(BACKUP_OF))


# -- targets ---------------------------------------------------------------------------------
def _allowed(path: Path, allowed: Sequence[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == a or a in real.parents for a in (Path(os.path.realpath(d)) for d in allowed))


def _absolute_directory(text: object, what: str, allowed: Sequence[Path]) -> Path:
    if not isinstance(text, str) or not text:
        raise BackupError("TargetRefused", f"{what}: expected an absolute path, got {text!r}")
    path = Path(text)
    if not path.is_absolute():
        raise BackupError("TargetRefused", f"{what}: {text!r} is relative; give an absolute path")
    if ".." in path.parts:
        raise BackupError("TargetRefused", f"{what}: {text!r} must not contain '..'")
    if not _allowed(path, allowed):
        shown = ", ".join(str(a) for a in allowed) or "none configured"
        raise BackupError(
            "TargetRefused",
            f"{what}: {text} is outside this node's backup directories ({shown}; "
            "provider config backupDirectories)",
        )
    return path


def resolve_target(raw: str | None, allowed: Sequence[Path]) -> Path:
    """The directory a backup goes to, from the pod's `backup-target` annotation (the JSON of
    a VirtualMachineBackup's spec.target). A PVC is accepted when the controller resolved it to
    a local or hostPath PV's directory (`{"persistentVolumeClaim": name, "path": "/abs"}`); that
    path must be allowed like any directory."""
    if not raw:
        raise BackupError("TargetRefused", f"annotation {BACKUP_TARGET} is missing")
    try:
        target = json.loads(raw)
    except ValueError as e:
        raise BackupError("TargetRefused", f"{BACKUP_TARGET}: not JSON: {e}") from None
    if not isinstance(target, dict):
        raise BackupError("TargetRefused", f"{BACKUP_TARGET}: expected a JSON object")
    if "directory" in target and "persistentVolumeClaim" not in target:
        return _absolute_directory(target["directory"], "target.directory", allowed)
    if "persistentVolumeClaim" in target and "directory" not in target:
        claim = target["persistentVolumeClaim"]
        if "path" not in target:
            raise BackupError(
                "TargetRefused",
                f"target.persistentVolumeClaim {claim!r}: not resolved to a directory on this "
                "node (only claims bound to a local or hostPath PersistentVolume can hold "
                "backups; the VirtualMachineBackup controller resolves them)",
            )
        return _absolute_directory(
            target["path"], f"target.persistentVolumeClaim {claim!r} (its volume's path)", allowed
        )
    raise BackupError(
        "TargetRefused",
        f"{BACKUP_TARGET}: expected exactly one of directory or persistentVolumeClaim, "
        f"got {sorted(target)}",
    )


CHAIN_PREFIX = "vkubelet-backup-"  # every chain's bitmaps (QEMU) and checkpoints (libvirt)


def bitmap_name(chain_dir: Path) -> str:
    return CHAIN_PREFIX + hashlib.sha256(str(chain_dir).encode()).hexdigest()[:16]


# -- the manifest ------------------------------------------------------------------------------
def read_manifest(chain_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((chain_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise BackupError("BackupFailed", f"{chain_dir / MANIFEST}: unreadable: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("backups"), list):
        raise BackupError("BackupFailed", f"{chain_dir / MANIFEST}: not a backup manifest")
    return data


def _write_manifest(chain_dir: Path, data: Mapping[str, Any]) -> None:
    write_atomic(chain_dir / MANIFEST, json.dumps(data, indent=2) + "\n", mode=0o600, durable=True)


def _fsync(path: Path) -> None:
    """On disk before the manifest names it: a backup listed is a backup that survives a crash."""
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- the backup -----------------------------------------------------------------------------
@dataclass
class _Guest:
    """The guest's filesystems during one backup: `frozen` until a thaw succeeded."""

    engine: DiskBackup
    progress: Callable[[str], None]
    frozen: bool = False


async def _freeze(guest: _Guest) -> str:
    """Freeze the guest's filesystems; the consistency the backup will have."""
    try:  # a quick ping first: a guest without an agent should not cost the freeze's timeout
        await guest.engine.guest_ping(_PING_TIMEOUT)
    except Exception as e:
        guest.progress(f"guest agent not answering ({e}); the backup is crash-consistent")
        return f"crash-consistent (guest agent: {e})"
    guest.frozen = True  # from here on every path thaws (a freeze may act before it answers)
    try:
        count = await guest.engine.freeze(_FREEZE_TIMEOUT)
    except Exception as e:  # no agent, an agent without fsfreeze, a timeout: crash-consistent
        # An agent that could not be reached, or refused (qemu-ga thaws what it froze when
        # the freeze fails), froze nothing; one that did not answer in time may have.
        guest.frozen = isinstance(e, TimeoutError)
        guest.progress(f"guest filesystems not frozen ({e}); the backup is crash-consistent")
        return f"crash-consistent (guest agent: {e})"
    guest.progress(f"guest filesystems frozen ({count})")
    return "filesystem-consistent"


async def _thaw(guest: _Guest) -> None:
    if not guest.frozen:
        return
    for attempt in range(_THAW_ATTEMPTS):
        try:
            count = await guest.engine.thaw(_FREEZE_TIMEOUT)
            guest.frozen = False
            guest.progress(f"guest filesystems thawed ({count})")
            return
        except Exception as e:
            with contextlib.suppress(Exception):  # not frozen at all (the freeze failed): done
                if await guest.engine.thawed():
                    guest.frozen = False
                    return
            if attempt == _THAW_ATTEMPTS - 1:
                guest.progress(f"could not thaw the guest's filesystems: {e}")
                raise BackupError(
                    "ThawFailed", f"could not thaw the guest's filesystems: {e}"
                ) from None
            await asyncio.sleep(0.5)


async def run_backup(
    machine: Backupable,
    source: BackupSource,
    target: Path,
    mode: str,
    *,
    backup_pod: str,
    progress: Callable[[str], None],
) -> BackupResult:
    """Take one backup of the running machine into `target`; raises BackupError."""
    if mode not in ("Auto", "Full", "Incremental"):
        raise BackupError("BackupFailed", f"{BACKUP_MODE}: expected Auto, Full or Incremental")
    engine = machine.disk_backup()
    started = time.monotonic()
    chain_dir = target / source.namespace / source.vm_name
    try:  # a tenant's disks: the agent's alone, older backups tightened too
        private_dir(target / source.namespace)
        private_dir(chain_dir)
        make_private(chain_dir)
    except OSError as e:
        raise BackupError("TargetRefused", f"cannot create {chain_dir}: {e}") from None
    manifest = read_manifest(chain_dir) or {
        "version": 1,
        "vm": {"namespace": source.namespace, "name": source.vm_name},
        "backups": [],
    }
    previous = manifest["backups"][-1] if manifest["backups"] else None
    since = str(previous["id"]) if previous is not None else None
    chain = bitmap_name(chain_dir)
    try:
        disks = await engine.inspect(source.disks, chain, since, progress)
    except BackupError:
        raise
    except Exception as e:  # the machine going away, typically
        raise BackupError("BackupFailed", f"{type(e).__name__}: {e}") from None
    if not disks:  # never a backup of nothing
        raise BackupError("BackupFailed", "the VM has no disk to back up")
    paths = tuple(d.path for d in disks)
    can_increment = (
        previous is not None
        and all(d.incremental for d in disks)
        and len(previous.get("files", [])) == len(disks)
    )
    if mode == "Incremental" and not can_increment:
        why = (
            "no previous backup in this target"
            if previous is None
            else (
                "the VM's disks carry no valid dirty bitmap for this target (the VM was restarted "
                "uncleanly, or its disks changed)"
            )
        )
        raise BackupError("BackupFailed", f"an incremental backup is impossible: {why}")
    kind = "incremental" if can_increment and mode != "Full" else "full"
    number = int(previous["id"]) + 1 if previous else 1
    backup_id = f"{number:04d}"
    backup_dir = chain_dir / f"{backup_id}-{kind}"
    progress(f"{kind} backup {backup_id} of {source.namespace}/{source.pod} to {backup_dir}")
    shutil.rmtree(backup_dir, ignore_errors=True)  # a failed earlier attempt's leftovers
    await _check_space(chain_dir, disks, kind)
    backup_dir.mkdir(mode=0o700)
    files = tuple(backup_dir / f"disk{i}.qcow2" for i in range(len(disks)))
    plan = BackupPlan(kind, backup_id, chain, since, paths, files)
    guest = _Guest(engine, progress)
    consistency = ""
    try:
        for i, disk in enumerate(disks):
            options = ["-f", "qcow2"]
            if kind == "incremental":
                assert previous is not None
                back = chain_dir / previous["files"][i]
                # relative: the chain stays valid when the target directory is moved
                options += ["-b", str(Path("..") / back.relative_to(chain_dir)), "-F", "qcow2"]
            await _qemu_img(["create", "-q", *options, str(files[i]), str(disk.size)])
        await engine.prepare(plan)
        copy_started = time.monotonic()
        consistency = await _freeze(guest)
        try:
            await engine.begin(plan)
        finally:
            await _thaw(guest)  # the copy's copy-before-write holds the point in time now
        progress("backup jobs started, guest running")
        await _wait(engine, progress)
        copy_seconds = await engine.finish(plan) or time.monotonic() - copy_started
    except BaseException as e:  # cancelled too (the backup pod deleted): clean up, then go
        try:
            await engine.abort(plan)
            shutil.rmtree(backup_dir, ignore_errors=True)
        finally:
            await _thaw(guest)
        if isinstance(e, Exception) and not isinstance(e, BackupError):
            raise BackupError("BackupFailed", f"{type(e).__name__}: {e}") from None
        raise
    size = sum(f.stat().st_size for f in files)
    for f in files:
        _fsync(f)
    duration = time.monotonic() - started
    manifest["vm"].update(
        pod=source.pod, podUid=source.pod_uid, machine=source.machine, namespace=source.namespace
    )
    manifest["backups"].append(
        {
            "id": backup_id,
            "kind": kind,
            "directory": backup_dir.name,
            "files": [str(f.relative_to(chain_dir)) for f in files],
            "sizeBytes": size,
            "durationSeconds": round(duration, 3),
            "copySeconds": round(copy_seconds, 3),
            "finishedAt": _now(),
            "consistency": consistency,
            "pod": source.pod,
            "backupPod": backup_pod,
        }
    )
    _write_manifest(chain_dir, manifest)
    progress(f"done: {kind}, {size} bytes in {duration:.2f} s, manifest {chain_dir / MANIFEST}")
    return BackupResult(kind, size, duration, str(backup_dir), consistency, copy_seconds)


async def _check_space(chain_dir: Path, disks: Sequence[DiskState], kind: str) -> None:
    """Refuse a target without room for the copy, before anything starts: a target that fills
    up mid-copy fails the copy-before-write, i.e. the guest's own writes (and the drives'
    default `werror=enospc` pauses the VM)."""
    needed = len(disks) * _SPACE_MARGIN
    for i, disk in enumerate(disks):
        if kind == "full" and not disk.path.exists():  # on a remote runtime host
            needed += disk.size  # at most the disk's virtual size
        elif kind == "full":
            try:
                out = await _qemu_img(
                    ["measure", "-U", "--output=json", "-O", "qcow2", str(disk.path)]
                )
                needed += int(json.loads(out)["required"])
            except (DiskError, ValueError, KeyError) as e:
                raise BackupError("BackupFailed", f"cannot measure disk{i}: {e}") from None
        else:
            needed += disk.dirty
    free = shutil.disk_usage(chain_dir).free
    if free < needed:
        raise BackupError(
            "TargetRefused",
            f"{chain_dir}: {free} bytes free, this {kind} backup needs about {needed}",
        )


async def _wait(engine: DiskBackup, progress: Callable[[str], None]) -> None:
    """Until the copy is done, its progress in the log every 10 %; BackupError when it failed."""
    shown = -1
    pause = Backoff(initial=0.01, cap=_POLL, jitter=0.0)  # a small incremental takes milliseconds
    while True:
        state = await engine.progress()
        total = state.total or 1
        percent = state.done * 100 // total
        if percent // 10 > shown // 10:
            shown = percent
            progress(f"copied {percent}% ({state.done} of {total} bytes)")
        if state.finished:
            if state.error:
                raise BackupError("BackupFailed", state.error)
            return
        await pause.wait()


# -- restore -------------------------------------------------------------------------------
def resolve_restore(text: str, allowed: Sequence[Path], namespace: str) -> list[Path]:
    """The disk files (root first) of the backup `text` names: a manifest (its latest backup) or
    one backup's directory. Only under the node's backup directories, and only a backup of a
    VM of the pod's own namespace: the backup directories hold every namespace's disks."""
    if not text.startswith("/"):
        raise BackupError(
            "RestoreFailed",
            f"{RESTORE_FROM}: {text!r} is not a backup's path (a manifest.json or a backup "
            "directory, as a VirtualMachineBackup's status.path gives it)",
        )
    path = _absolute_directory(text, RESTORE_FROM, allowed)
    if path.name == MANIFEST:
        chain_dir, wanted = path.parent, None
    else:
        chain_dir, wanted = path.parent, path.name
    manifest = read_manifest(chain_dir)
    if manifest is None:
        raise BackupError("RestoreFailed", f"{RESTORE_FROM}: no backup manifest at {chain_dir}")
    owner = (manifest.get("vm") or {}).get("namespace")
    if owner != namespace:
        raise BackupError(
            "RestoreFailed",
            f"{RESTORE_FROM}: {text} is a backup of a VM of namespace {owner!r}, not of this "
            f"pod's namespace {namespace!r}",
        )
    backups = [b for b in manifest["backups"] if wanted is None or b.get("directory") == wanted]
    if not backups:
        raise BackupError("RestoreFailed", f"{RESTORE_FROM}: no backup {text} in the manifest")
    names = [Path(str(f)) for f in backups[-1]["files"]]
    if any(name.is_absolute() or ".." in name.parts for name in names):
        raise BackupError("RestoreFailed", f"{RESTORE_FROM}: the manifest names files outside it")
    files = [chain_dir / name for name in names]
    for f in files:
        if not f.exists():
            raise BackupError("RestoreFailed", f"{RESTORE_FROM}: {f} is missing")
        _inside(f, chain_dir)
    return files


def _inside(path: Path, chain_dir: Path) -> Path:
    """`path` with every symlink resolved, refused unless that is a file of the backup itself:
    a link planted in a backup must not copy another VM's disk (or a host file) into the pod's."""
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(chain_dir))
    if root not in real.parents or not real.is_file():
        raise BackupError(
            "RestoreFailed",
            f"{RESTORE_FROM}: {path} is not a file of the backup {chain_dir} (it resolves to "
            f"{real}); a restore reads only the backup's own files",
        )
    return real


async def check_chain(disk: Path, chain_dir: Path) -> Path:
    """Refuse a backup file whose qcow2 chain leaves the backup: a backing file (or external
    data file) elsewhere would be read into the restored disk. Each level is inspected without
    opening its backing file (`qemu-img info` without --backing-chain), so a hostile name is
    never opened; only plain relative or absolute paths to qcow2 files of the backup pass.
    Returns the disk's resolved path, the one to read: QEMU resolves a relative backing name
    against the directory of the name it opened, as this check does."""
    top = current = _inside(disk, chain_dir)
    seen: set[Path] = set()
    while (real := _inside(current, chain_dir)) not in seen:
        seen.add(real)
        try:
            out = await _qemu_img(
                ["info", "--force-share", "--output=json", "-f", "qcow2", str(real)]
            )
            info = json.loads(out)
        except (DiskError, ValueError) as e:
            raise BackupError("RestoreFailed", f"{RESTORE_FROM}: {disk}: {e}") from None
        specific = (info.get("format-specific") or {}).get("data") or {}
        if specific.get("data-file"):
            raise BackupError(
                "RestoreFailed",
                f"{RESTORE_FROM}: {current} keeps its data in an external file "
                f"({specific['data-file']}); a backup's files are self-contained",
            )
        backing = info.get("backing-filename")
        if not backing:
            return top
        fmt = info.get("backing-filename-format")
        if ":" in str(backing) or fmt != "qcow2":
            raise BackupError(
                "RestoreFailed",
                f"{RESTORE_FROM}: {current} is backed by {backing!r} ({fmt}); a backup's "
                "chain holds only qcow2 files of the backup",
            )
        current = current.parent / str(backing)  # an absolute name stays itself, as in QEMU
    raise BackupError("RestoreFailed", f"{RESTORE_FROM}: {disk}: its backing chain is a loop")


async def restore_disks(sources: Sequence[Path], disks: Sequence[Path]) -> None:
    """Write each wanted disk from its backup chain (one flat qcow2, written under a temporary
    name then renamed: a half-made disk never looks made)."""
    for source, disk in zip(sources, disks, strict=False):
        tmp = disk.with_name(f".{disk.name}.restore")
        try:
            await _qemu_img(
                ["convert", "-q", "-f", "qcow2", "-O", "qcow2", str(source), str(tmp)],
                limit=3600,
            )
        except DiskError as e:
            tmp.unlink(missing_ok=True)
            raise BackupError("RestoreFailed", str(e)) from None
        tmp.replace(disk)


class ProgressLog:
    """The backup pod's container log: one CRI line per progress line (`kubectl logs`)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = LogWriter(path)

    def __call__(self, line: str) -> None:
        log.info("backup: %s", line)
        self._writer.write("stdout", (line + "\n").encode())

    def close(self) -> None:
        self._writer.close()


async def restore_if_asked(
    namespace: str,
    annotations: Mapping[str, str],
    disks: Sequence[Path],
    allowed: Sequence[Path],
    root_size: int | None,
) -> None:
    """Before a VM pod's first boot: its disks (root first) from the backup its
    `restore-from` annotation names; disks that exist already (a later boot) are kept."""
    text = annotations.get(RESTORE_FROM)
    if not text or disks[0].exists():
        return
    chain_dir = Path(text).parent  # a manifest's, or a backup directory's
    sources = [await check_chain(s, chain_dir) for s in resolve_restore(text, allowed, namespace)]
    wanted = [(s, d) for s, d in zip(sources, disks, strict=False) if not d.exists()]
    await restore_disks([s for s, _ in wanted], [d for _, d in wanted])
    if root_size is not None:
        with contextlib.suppress(DiskError):  # never shrinks: a smaller ask keeps the backup's
            await resize(disks[0], root_size)
