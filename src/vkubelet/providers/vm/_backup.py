"""Backup pods and restores: a consistent copy of a running VM's disks, full then incremental.

A pod with annotation `vm.vkubelet.io/backup-of: <VM pod>` (image `vm.vkubelet.io/backup`,
restartPolicy Never, bound to the VM's node) is not a VM: it is one backup task of the VM pod
named, in the same namespace. Its one container runs the task and ends Succeeded (termination
message `{"kind","sizeBytes","durationSeconds","path"}`) or Failed with a reason (`VMNotFound`,
`TargetRefused`, `BackupFailed`, ...). Its log is the task's progress. This module is the
engine and knows no pod; `_backups` runs the pods.

How a backup is taken, and why:
- The guest's filesystems are frozen through the guest agent (`guest-fsfreeze-freeze`), so the
  copy is what a clean unmount would leave. A guest without an answering agent is copied
  crash-consistent, and the result says so.
- One QMP `transaction` starts a `blockdev-backup` job per disk (and, for a full backup, creates
  the persistent dirty bitmap the next incremental reads): all disks at the same instant. The
  backup job's copy-before-write filter makes that instant the point in time, so the guest is
  thawed as soon as the transaction returns; the copying goes on while the guest runs.
- The thaw is in a `finally`: no error path leaves the guest frozen.
- A target without room for the copy is refused before the freeze (`qemu-img measure`, or the
  bitmaps' dirty bytes): one that filled up mid-copy would fail the copy-before-write, i.e. the
  guest's own writes (QEMU 7.2's blockdev-backup has no `on-cbw-error=break-snapshot`).
- Target files reach QEMU as open descriptors (`add-fd`, `/dev/fdset/N`), not paths: QEMU runs
  under `ip netns exec`, in a mount namespace of its own that does not see what was mounted on
  the host after it started (a target volume, say). For the same reason an incremental target
  is opened without its backing chain (`backing: null`); the job only writes into it, and
  clusters that became zero are written as qcow2 zero flags, which mask the backing file.
- A full backup copies every disk whole (`sync=full`) into a self-contained qcow2; an incremental
  one (`sync=incremental` with the bitmap, cleared by QEMU only on success) copies the clusters
  written since the previous backup into a qcow2 whose backing file is that backup's: the chain
  of files is the disk at each backup. The bitmap's name is derived from the target directory,
  so backups of one VM to two targets keep two independent chains. A disk without the bitmap (a
  VM that was killed, whose bitmap QEMU then drops as inconsistent; a new disk) gets a full
  backup, whatever the mode asked (`Incremental` then fails instead: it cannot be honoured).

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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

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
    "BackupResult",
    "BackupSource",
    "Backupable",
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


class Backupable(Protocol):
    """A running machine as the backup needs it: its QMP monitor and its guest agent (None: a
    runtime without them, which cannot back up)."""

    @property
    def monitor(self) -> Any: ...

    @property
    def agent(self) -> Any: ...

    @property
    def runtime(self) -> str: ...  # named when it cannot back up


@dataclass(frozen=True)
class BackupSource:
    """The VM pod being backed up, as the provider knows it."""

    namespace: str
    pod: str
    pod_uid: str
    vm_name: str  # the VirtualMachine's name (label vm.vkubelet.io/name) or the pod's
    machine: str | None  # vm.vkubelet.io/machine, when the pod is an incarnation of one
    disks: tuple[Path, ...]  # root first; QEMU's device ids are disk0, disk1, ...


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


def bitmap_name(chain_dir: Path) -> str:
    return "vkubelet-backup-" + hashlib.sha256(str(chain_dir).encode()).hexdigest()[:16]


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
class _Run:
    machine: Backupable
    source: BackupSource
    progress: Callable[[str], None]
    frozen: bool = False
    targets: list[str] = field(default_factory=list)  # blockdev node names added
    jobs: list[str] = field(default_factory=list)
    # A full backup's new bitmaps: dropped if it fails, else the next incremental would count
    # from this failed backup's instant instead of from the last good one.
    new_bitmaps: list[tuple[str, str]] = field(default_factory=list)
    fdsets: list[int] = field(default_factory=list)  # the target files, handed to QEMU


async def _freeze(run: _Run) -> str:
    """Freeze the guest's filesystems; the consistency the backup will have."""
    try:  # a quick ping first: a guest without an agent should not cost the freeze's timeout
        await run.machine.agent.call("guest-ping", timeout=_PING_TIMEOUT)
    except Exception as e:
        run.progress(f"guest agent not answering ({e}); the backup is crash-consistent")
        return f"crash-consistent (guest agent: {e})"
    run.frozen = True  # from here on every path thaws (a freeze may act before it answers)
    try:
        count = await run.machine.agent.call("guest-fsfreeze-freeze", timeout=_FREEZE_TIMEOUT)
    except Exception as e:  # no agent, an agent without fsfreeze, a timeout: crash-consistent
        # An agent that could not be reached, or refused (qemu-ga thaws what it froze when
        # the freeze fails), froze nothing; one that did not answer in time may have.
        run.frozen = isinstance(e, TimeoutError)
        run.progress(f"guest filesystems not frozen ({e}); the backup is crash-consistent")
        return f"crash-consistent (guest agent: {e})"
    run.progress(f"guest filesystems frozen ({count})")
    return "filesystem-consistent"


async def _thaw(run: _Run) -> None:
    if not run.frozen:
        return
    for attempt in range(_THAW_ATTEMPTS):
        try:
            count = await run.machine.agent.call("guest-fsfreeze-thaw", timeout=_FREEZE_TIMEOUT)
            run.frozen = False
            run.progress(f"guest filesystems thawed ({count})")
            return
        except Exception as e:
            with contextlib.suppress(Exception):  # not frozen at all (the freeze failed): done
                if await run.machine.agent.call("guest-fsfreeze-status") == "thawed":
                    run.frozen = False
                    return
            if attempt == _THAW_ATTEMPTS - 1:
                run.progress(f"could not thaw the guest's filesystems: {e}")
                raise BackupError(
                    "ThawFailed", f"could not thaw the guest's filesystems: {e}"
                ) from None
            await asyncio.sleep(0.5)


async def _block_devices(run: _Run) -> dict[str, dict[str, Any]]:
    reply = await run.machine.monitor.execute("query-block")
    return {str(b.get("device")): b for b in reply if b.get("inserted")}


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
    if machine.monitor is None or machine.agent is None:
        raise BackupError(
            "BackupFailed", f"the {machine.runtime} runtime cannot back up a running VM yet"
        )
    started = time.monotonic()
    chain_dir = target / source.namespace / source.vm_name
    bitmap = bitmap_name(chain_dir)
    run = _Run(machine, source, progress)
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
    try:
        await _clear_leftovers(run)
        devices = await _block_devices(run)
    except Exception as e:  # QEMU going away, typically
        raise BackupError("BackupFailed", f"{type(e).__name__}: {e}") from None
    names = [f"disk{i}" for i in range(len(source.disks))]
    missing = [n for n in names if n not in devices]
    if missing:
        raise BackupError("BackupFailed", f"the VM has no block device {missing[0]}")
    previous = manifest["backups"][-1] if manifest["backups"] else None
    has_bitmap = all(_usable(_bitmap(devices, n, bitmap)) for n in names)
    can_increment = (
        previous is not None and has_bitmap and len(previous.get("files", [])) == len(names)
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
    await _check_space(chain_dir, source, devices, names, bitmap, kind)
    backup_dir.mkdir(mode=0o700)
    files = [backup_dir / f"disk{i}.qcow2" for i in range(len(names))]
    consistency = ""
    listener: Any = None
    try:
        for i, name in enumerate(names):
            size = int(devices[name]["inserted"]["image"]["virtual-size"])
            options = ["-f", "qcow2"]
            if kind == "incremental":
                assert previous is not None
                back = chain_dir / previous["files"][i]
                # relative: the chain stays valid when the target directory is moved
                options += ["-b", str(Path("..") / back.relative_to(chain_dir)), "-F", "qcow2"]
            await _qemu_img(["create", "-q", *options, str(files[i]), str(size)])
            node = f"vkb-{backup_id}-{i}"
            # By descriptor, not path: QEMU's mount namespace may not see the target's mount.
            # So the target is opened without its backing chain (which QEMU could not open by
            # path either): the job only writes, and zero clusters are written as zero flags,
            # which mask the backing file when the chain is read (checked with qemu-img compare).
            fd = os.open(files[i], os.O_RDWR | os.O_CLOEXEC)
            try:
                run.fdsets.append(await machine.monitor.add_fd(fd))
            finally:
                os.close(fd)
            target_node: dict[str, Any] = {
                "driver": "qcow2",
                "node-name": node,
                "file": {"driver": "file", "filename": f"/dev/fdset/{run.fdsets[-1]}"},
            }
            if kind == "incremental":
                target_node["backing"] = None
            await machine.monitor.execute("blockdev-add", target_node)
            run.targets.append(node)
        actions: list[dict[str, Any]] = []
        for i, name in enumerate(names):
            job = f"vkb-{backup_id}-{i}"
            backup: dict[str, Any] = {
                "device": name,
                "target": run.targets[i],
                "job-id": job,
                "auto-dismiss": False,
            }
            if kind == "full":
                # The bitmap starts with this backup: cleared (or made) in the same transaction.
                found = _bitmap(devices, name, bitmap)
                if found is not None and not _usable(found):
                    await machine.monitor.execute(
                        "block-dirty-bitmap-remove", {"node": name, "name": bitmap}
                    )
                    found = None
                action = (
                    "block-dirty-bitmap-clear" if found is not None else "block-dirty-bitmap-add"
                )
                data: dict[str, Any] = {"node": name, "name": bitmap}
                if found is None:
                    data["persistent"] = True
                actions.append({"type": action, "data": data})
                backup["sync"] = "full"
            else:
                backup.update(sync="incremental", bitmap=bitmap)
            actions.append({"type": "blockdev-backup", "data": backup})
            run.jobs.append(job)
        run_jobs = list(run.jobs)
        # QEMU's own timestamps of the jobs' state changes time the copy: our polling and the
        # thaw's round trip to the guest would blur it.
        listen = getattr(machine.monitor, "listen", None)
        listener = listen(("JOB_STATUS_CHANGE",)) if listen is not None else None
        copy_started = time.monotonic()
        consistency = await _freeze(run)
        try:
            await machine.monitor.execute("transaction", {"actions": actions})
        except Exception:
            run.jobs.clear()  # the transaction is all or nothing: no job started
            raise
        finally:
            await _thaw(run)  # the jobs' copy-before-write holds the point in time now
        if kind == "full":
            run.new_bitmaps = [(name, bitmap) for name in names]
        progress("backup jobs started, guest running")
        await _wait_jobs(run)
        copy_seconds = time.monotonic() - copy_started
        if listener is not None:
            copy_seconds = _job_seconds(listener.clear(), names=set(run_jobs)) or copy_seconds
            machine.monitor.forget(listener)
    except BaseException as e:  # cancelled too (the backup pod deleted): clean up, then go
        if listener is not None:
            machine.monitor.forget(listener)
        try:
            await _clean_up(run, backup_dir)
        finally:
            await _thaw(run)
        if isinstance(e, Exception) and not isinstance(e, BackupError):
            raise BackupError("BackupFailed", f"{type(e).__name__}: {e}") from None
        raise
    await _drop_targets(run)
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


def _bitmap(devices: Mapping[str, Any], device: str, name: str) -> dict[str, Any] | None:
    """The device's dirty bitmap `name`, as `query-block` lists it."""
    found = devices[device]["inserted"].get("dirty-bitmaps", [])
    return next((m for m in found if m.get("name") == name), None)


def _usable(bitmap: dict[str, Any] | None) -> bool:
    """Counts writes since the last backup: persistent, and not dropped as inconsistent."""
    return bitmap is not None and bool(bitmap.get("persistent")) and not bitmap.get("inconsistent")


def _job_seconds(events: Sequence[Mapping[str, Any]], names: set[str]) -> float | None:
    """From the first job running to the last one done, by QEMU's event timestamps."""
    starts, ends = [], []
    for event in events:
        data, stamp = event.get("data") or {}, event.get("timestamp") or {}
        if data.get("id") not in names or "seconds" not in stamp:
            continue
        moment = int(stamp["seconds"]) + int(stamp.get("microseconds", 0)) / 1e6
        if data.get("status") == "running":
            starts.append(moment)
        elif data.get("status") in ("waiting", "pending", "concluded"):
            ends.append(moment)
    if not starts or not ends:
        return None
    return max(max(ends) - min(starts), 0.0)


async def _check_space(
    chain_dir: Path,
    source: BackupSource,
    devices: Mapping[str, Any],
    names: Sequence[str],
    bitmap: str,
    kind: str,
) -> None:
    """Refuse a target without room for the copy, before anything starts: a target that fills
    up mid-copy fails the jobs' copy-before-write, i.e. the guest's own writes (and the drives'
    default `werror=enospc` pauses the VM)."""
    needed = len(names) * _SPACE_MARGIN
    for i, name in enumerate(names):
        if kind == "full":
            try:
                out = await _qemu_img(
                    ["measure", "-U", "--output=json", "-O", "qcow2", str(source.disks[i])]
                )
                needed += int(json.loads(out)["required"])
            except (DiskError, ValueError, KeyError) as e:
                raise BackupError("BackupFailed", f"cannot measure disk {name}: {e}") from None
        else:
            needed += int((_bitmap(devices, name, bitmap) or {}).get("count", 0))
    free = shutil.disk_usage(chain_dir).free
    if free < needed:
        raise BackupError(
            "TargetRefused",
            f"{chain_dir}: {free} bytes free, this {kind} backup needs about {needed}",
        )


async def _wait_jobs(run: _Run) -> None:
    shown = -1
    pause = Backoff(initial=0.01, cap=_POLL, jitter=0.0)  # a small incremental takes milliseconds
    while True:
        jobs = {
            str(j["id"]): j
            for j in await run.machine.monitor.execute("query-jobs")
            if j["id"] in run.jobs
        }
        done = sum(int(j.get("current-progress", 0)) for j in jobs.values())
        total = sum(int(j.get("total-progress", 0)) for j in jobs.values()) or 1
        percent = done * 100 // total
        if percent // 10 > shown // 10:
            shown = percent
            run.progress(f"copied {percent}% ({done} of {total} bytes)")
        if len(jobs) < len(run.jobs):
            raise BackupError("BackupFailed", "a backup job vanished (the VM stopped?)")
        errors = [f"{j['id']}: {j['error']}" for j in jobs.values() if j.get("error")]
        if all(j["status"] == "concluded" for j in jobs.values()):
            for job in list(run.jobs):
                with contextlib.suppress(Exception):
                    await run.machine.monitor.execute("job-dismiss", {"id": job})
                run.jobs.remove(job)
            if errors:
                raise BackupError("BackupFailed", "; ".join(errors))
            return
        await pause.wait()


async def _drop_targets(run: _Run) -> None:
    for node in list(run.targets):
        with contextlib.suppress(Exception):
            await run.machine.monitor.execute("blockdev-del", {"node-name": node})
        run.targets.remove(node)
    for fdset in list(run.fdsets):
        with contextlib.suppress(Exception):
            await run.machine.monitor.execute("remove-fd", {"fdset-id": fdset})
        run.fdsets.remove(fdset)


async def _clear_leftovers(run: _Run) -> None:
    """Jobs and target nodes an earlier backup left in this QEMU (its agent was killed midway):
    they would hold the names this backup is about to use, and the target files open."""
    monitor = run.machine.monitor
    run.jobs = [str(j["id"]) for j in await monitor.execute("query-jobs") if _ours(j.get("id"))]
    run.targets = [
        str(n["node-name"])
        for n in await monitor.execute("query-named-block-nodes", {"flat": True})
        if _ours(n.get("node-name"))
    ]
    if run.jobs or run.targets:
        run.progress(f"removing what an interrupted backup left: {run.jobs + run.targets}")
        await _cancel_jobs(run)
        await _drop_targets(run)


def _ours(name: object) -> bool:
    return isinstance(name, str) and name.startswith("vkb-")


async def _clean_up(run: _Run, backup_dir: Path) -> None:
    """After a failure: no job left running, no target left open, no partial files."""
    await _cancel_jobs(run)
    for node, name in run.new_bitmaps:
        with contextlib.suppress(Exception):
            await run.machine.monitor.execute(
                "block-dirty-bitmap-remove", {"node": node, "name": name}
            )
    await _drop_targets(run)
    shutil.rmtree(backup_dir, ignore_errors=True)


async def _cancel_jobs(run: _Run) -> None:
    for job in list(run.jobs):
        with contextlib.suppress(Exception):
            await run.machine.monitor.execute("job-cancel", {"id": job, "force": True})
    for _ in range(50):
        try:
            live = {j["id"] for j in await run.machine.monitor.execute("query-jobs")}
        except Exception:
            break
        pending = [j for j in run.jobs if j in live]
        for job in pending:
            with contextlib.suppress(Exception):
                await run.machine.monitor.execute("job-dismiss", {"id": job})
        if not pending:
            break
        await asyncio.sleep(_POLL)
    run.jobs.clear()


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
