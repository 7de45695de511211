"""Backups on the QEMU runtime: the `DiskBackup` of a QEMU the agent drives through QMP.

- The instant is one QMP `transaction` that starts a `blockdev-backup` job per disk and, for a
  full backup, adds (or clears) the chain's **persistent dirty bitmap** per disk: all disks at
  the same instant, and the bitmap counts from it. The jobs' copy-before-write filter holds
  that instant while the guest writes on.
- An incremental copies what the bitmap counted (`sync=incremental`); QEMU clears the bitmap
  only when the job succeeds. A bitmap QEMU dropped as inconsistent (the VM was killed) or a
  disk without it (a new disk) cannot be incremental.
- Target files reach QEMU as open descriptors (`add-fd`, `/dev/fdset/N`), not paths: QEMU runs
  under `ip netns exec`, in a mount namespace of its own that does not see what was mounted on
  the host after it started (a target volume, say). For the same reason an incremental target
  is opened without its backing chain (`backing: null`); the job only writes into it, and
  clusters that became zero are written as qcow2 zero flags, which mask the backing file.
- QEMU 7.2's blockdev-backup has no `on-cbw-error=break-snapshot`: a target that fills up fails
  the guest's own writes, hence `run_backup`'s space check before the instant.
- The freeze is the guest agent's `guest-fsfreeze-freeze`, through the agent's own socket.
- Jobs and target nodes are named `vkb-<backup id>-<disk>`: what an interrupted backup left (its
  agent was killed midway) is found by that prefix and removed before the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._backup import BackupError, BackupPlan, DiskState, JobProgress
from ._qga import GuestAgent
from ._qmp import Monitor

__all__ = ["QmpDiskBackup"]

_POLL = 0.2


class QmpDiskBackup:
    """One backup of a QEMU machine, through its monitor and guest agent."""

    runtime = "qemu"

    def __init__(self, monitor: Monitor, agent: GuestAgent) -> None:
        self.monitor, self.agent = monitor, agent
        self._devices: dict[str, dict[str, Any]] = {}
        self._names: list[str] = []  # QEMU's device ids of the disks: disk0, disk1, ...
        self._targets: list[str] = []  # blockdev node names added
        self._jobs: list[str] = []
        self._started_jobs: list[str] = []
        # A full backup's new bitmaps: dropped if it fails, else the next incremental would count
        # from this failed backup's instant instead of from the last good one.
        self._new_bitmaps: list[tuple[str, str]] = []
        self._fdsets: list[int] = []  # the target files, handed to QEMU
        self._listener: Any = None

    # -- the guest agent ------------------------------------------------------------------------
    async def guest_ping(self, timeout: float) -> None:  # noqa: ASYNC109
        await self.agent.call("guest-ping", timeout=timeout)

    async def freeze(self, timeout: float) -> int:  # noqa: ASYNC109
        return int(await self.agent.call("guest-fsfreeze-freeze", timeout=timeout))

    async def thaw(self, timeout: float) -> int:  # noqa: ASYNC109
        return int(await self.agent.call("guest-fsfreeze-thaw", timeout=timeout))

    async def thawed(self) -> bool:
        return bool(await self.agent.call("guest-fsfreeze-status") == "thawed")

    # -- the disks -----------------------------------------------------------------------------
    async def inspect(
        self, disks: Sequence[Path], chain: str, since: str | None, progress: Callable[[str], None]
    ) -> list[DiskState]:
        if not disks:  # this runtime runs only machines vkubelet made, with their disks
            raise BackupError("BackupFailed", "the VM has no disk vkubelet made")
        await self._clear_leftovers(progress)
        reply = await self.monitor.execute("query-block")
        self._devices = {str(b.get("device")): b for b in reply if b.get("inserted")}
        self._names = [f"disk{i}" for i in range(len(disks))]
        missing = [n for n in self._names if n not in self._devices]
        if missing:
            raise BackupError("BackupFailed", f"the VM has no block device {missing[0]}")
        states = []
        for name, path in zip(self._names, disks, strict=True):
            bitmap = _bitmap(self._devices, name, chain)
            states.append(
                DiskState(
                    path=path,
                    size=int(self._devices[name]["inserted"]["image"]["virtual-size"]),
                    incremental=_usable(bitmap),
                    dirty=int((bitmap or {}).get("count", 0)),
                )
            )
        return states

    async def prepare(self, plan: BackupPlan) -> None:
        for i, path in enumerate(plan.files):
            node = f"vkb-{plan.backup_id}-{i}"
            # By descriptor, not path: QEMU's mount namespace may not see the target's mount.
            # So the target is opened without its backing chain (which QEMU could not open by
            # path either): the job only writes, and zero clusters are written as zero flags,
            # which mask the backing file when the chain is read (checked with qemu-img compare).
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                self._fdsets.append(await self.monitor.add_fd(fd))
            finally:
                os.close(fd)
            target_node: dict[str, Any] = {
                "driver": "qcow2",
                "node-name": node,
                "file": {"driver": "file", "filename": f"/dev/fdset/{self._fdsets[-1]}"},
            }
            if plan.kind == "incremental":
                target_node["backing"] = None
            await self.monitor.execute("blockdev-add", target_node)
            self._targets.append(node)
        # QEMU's own timestamps of the jobs' state changes time the copy: our polling and the
        # thaw's round trip to the guest would blur it.
        listen = getattr(self.monitor, "listen", None)
        self._listener = listen(("JOB_STATUS_CHANGE",)) if listen is not None else None

    async def begin(self, plan: BackupPlan) -> None:
        actions: list[dict[str, Any]] = []
        jobs = []
        for i, name in enumerate(self._names):
            job = f"vkb-{plan.backup_id}-{i}"
            backup: dict[str, Any] = {
                "device": name,
                "target": self._targets[i],
                "job-id": job,
                "auto-dismiss": False,
            }
            if plan.kind == "full":
                # The bitmap starts with this backup: cleared (or made) in the same transaction.
                found = _bitmap(self._devices, name, plan.chain)
                if found is not None and not _usable(found):
                    await self.monitor.execute(
                        "block-dirty-bitmap-remove", {"node": name, "name": plan.chain}
                    )
                    found = None
                action = (
                    "block-dirty-bitmap-clear" if found is not None else "block-dirty-bitmap-add"
                )
                data: dict[str, Any] = {"node": name, "name": plan.chain}
                if found is None:
                    data["persistent"] = True
                actions.append({"type": action, "data": data})
                backup["sync"] = "full"
            else:
                backup.update(sync="incremental", bitmap=plan.chain)
            actions.append({"type": "blockdev-backup", "data": backup})
            jobs.append(job)
        # the transaction is all or nothing: no job started when it fails
        await self.monitor.execute("transaction", {"actions": actions})
        self._jobs, self._started_jobs = list(jobs), list(jobs)
        if plan.kind == "full":
            self._new_bitmaps = [(name, plan.chain) for name in self._names]

    async def progress(self) -> JobProgress:
        jobs = {
            str(j["id"]): j
            for j in await self.monitor.execute("query-jobs")
            if j["id"] in self._jobs
        }
        done = sum(int(j.get("current-progress", 0)) for j in jobs.values())
        total = sum(int(j.get("total-progress", 0)) for j in jobs.values())
        if len(jobs) < len(self._jobs):
            raise BackupError("BackupFailed", "a backup job vanished (the VM stopped?)")
        if not all(j["status"] == "concluded" for j in jobs.values()):
            return JobProgress(done, total, finished=False)
        errors = [f"{j['id']}: {j['error']}" for j in jobs.values() if j.get("error")]
        for job in list(self._jobs):
            with contextlib.suppress(Exception):
                await self.monitor.execute("job-dismiss", {"id": job})
            self._jobs.remove(job)
        return JobProgress(done, total, finished=True, error="; ".join(errors))

    async def finish(self, plan: BackupPlan) -> float | None:
        seconds = None
        if self._listener is not None:
            seconds = _job_seconds(self._listener.clear(), names=set(self._started_jobs))
            self.monitor.forget(self._listener)
            self._listener = None
        await self._drop_targets()
        return seconds

    async def abort(self, plan: BackupPlan) -> None:
        if self._listener is not None:
            self.monitor.forget(self._listener)
            self._listener = None
        await self._cancel_jobs()
        for node, name in self._new_bitmaps:
            with contextlib.suppress(Exception):
                remove = {"node": node, "name": name}
                await self.monitor.execute("block-dirty-bitmap-remove", remove)
        await self._drop_targets()

    # -- cleaning up ---------------------------------------------------------------------------
    async def _drop_targets(self) -> None:
        for node in list(self._targets):
            with contextlib.suppress(Exception):
                await self.monitor.execute("blockdev-del", {"node-name": node})
            self._targets.remove(node)
        for fdset in list(self._fdsets):
            with contextlib.suppress(Exception):
                await self.monitor.execute("remove-fd", {"fdset-id": fdset})
            self._fdsets.remove(fdset)

    async def _clear_leftovers(self, progress: Callable[[str], None]) -> None:
        """Jobs and target nodes an earlier backup left in this QEMU (its agent was killed
        midway): they would hold the names this backup is about to use, and the files open."""
        monitor = self.monitor
        jobs = await monitor.execute("query-jobs")
        self._jobs = [str(j["id"]) for j in jobs if _ours(j.get("id"))]
        self._targets = [
            str(n["node-name"])
            for n in await monitor.execute("query-named-block-nodes", {"flat": True})
            if _ours(n.get("node-name"))
        ]
        if self._jobs or self._targets:
            progress(f"removing what an interrupted backup left: {self._jobs + self._targets}")
            await self._cancel_jobs()
            await self._drop_targets()

    async def _cancel_jobs(self) -> None:
        for job in list(self._jobs):
            with contextlib.suppress(Exception):
                await self.monitor.execute("job-cancel", {"id": job, "force": True})
        for _ in range(50):
            try:
                live = {j["id"] for j in await self.monitor.execute("query-jobs")}
            except Exception:
                break
            pending = [j for j in self._jobs if j in live]
            for job in pending:
                with contextlib.suppress(Exception):
                    await self.monitor.execute("job-dismiss", {"id": job})
            if not pending:
                break
            await asyncio.sleep(_POLL)
        self._jobs.clear()


def _ours(name: object) -> bool:
    return isinstance(name, str) and name.startswith("vkb-")


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
