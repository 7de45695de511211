"""Backup pods' side: a backup pod (`_backup.is_backup_pod`) is run by the SDK's `PodRunner` as
any pod (restartPolicy Never), on the host, not in a VM; its one run is one backup of a VM pod
of this node (`_backup.run_backup`), its progress the container's log, its outcome the
container's final state. Deleting the pod cancels a backup in progress (its jobs and files
dropped, the guest thawed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from lightkube.resources.core_v1 import Pod

from ...sdk import Terminated
from ...sdk.provider import EventSink, EventType
from ._backend import MachineHandle
from ._backup import (
    BACKUP_MODE,
    BACKUP_OF,
    BACKUP_TARGET,
    Backupable,
    BackupError,
    BackupSource,
    ProgressLog,
    resolve_target,
    run_backup,
)

__all__ = ["BackupPods"]

log = logging.getLogger(__name__)

# A VM pod's running machine and identity (None: no such pod on this node; a None machine: its
# VM is not up).
FindVM = Callable[[str, str], "tuple[MachineHandle | None, BackupSource] | None"]


class BackupPods:
    def __init__(self, allowed: Sequence[Path], find_vm: FindVM, events: EventSink | None) -> None:
        self._allowed, self._find_vm, self._events = list(allowed), find_vm, events
        self._locks: dict[str, asyncio.Lock] = {}  # one backup at a time per VM pod
        self._running: dict[str, asyncio.Task[Terminated]] = {}
        self._closed = False

    async def run(self, pod: Pod, log_path: Path) -> Terminated:
        """The pod's one run (the runner's `run`); `cancel` ends it."""
        meta = pod.metadata
        assert meta is not None
        key = f"{meta.namespace}/{meta.name}"
        task = asyncio.ensure_future(self._backup(pod, log_path))
        self._running[key] = task
        try:
            await asyncio.wait({task})
        finally:
            task.cancel()
            if self._running.get(key) is task:
                del self._running[key]
        if self._closed:  # the agent is going: the next agent runs this pod again
            await asyncio.Future()
        if task.cancelled():
            return Terminated(143, reason="Cancelled")
        return task.result()

    def cancel(self, key: str) -> None:
        """The runner's signal: any signal cancels the backup."""
        task = self._running.get(key)
        if task is None or task.done():
            raise ProcessLookupError(key)
        task.cancel()

    async def aclose(self) -> None:
        """The agent stops: running backups are cancelled, and not reported."""
        self._closed = True
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    def _event(self, pod: Pod, kind: EventType, reason: str, message: str) -> None:
        if self._events is not None:
            self._events.pod_event(pod, kind, reason, message)

    async def _backup(self, pod: Pod, log_path: Path) -> Terminated:
        meta = pod.metadata
        assert meta is not None
        annotations = dict(meta.annotations or {})
        namespace, vm_pod = str(meta.namespace), annotations.get(BACKUP_OF, "")
        progress = ProgressLog(log_path)
        try:
            target = resolve_target(annotations.get(BACKUP_TARGET), self._allowed)
            found = self._find_vm(namespace, vm_pod)
            if found is None:
                raise BackupError("VMNotFound", f"no VM pod {namespace}/{vm_pod} on this node")
            lock = self._locks.setdefault(f"{namespace}/{vm_pod}", asyncio.Lock())
            async with lock:
                found = self._find_vm(namespace, vm_pod)  # it may have stopped meanwhile
                machine, source = found if found is not None else (None, None)
                if machine is None or source is None:
                    raise BackupError(
                        "VMNotRunning", f"the VM of pod {namespace}/{vm_pod} is not running"
                    )
                if not isinstance(machine, Backupable):  # each runtime's own way, or none
                    raise BackupError(
                        "BackupFailed",
                        f"the {machine.runtime} runtime cannot back up a running VM",
                    )
                result = await run_backup(
                    machine,
                    source,
                    target,
                    annotations.get(BACKUP_MODE) or "Auto",
                    backup_pod=str(meta.name),
                    progress=progress,
                )
        except BackupError as e:
            progress(f"failed: {e.reason}: {e.message}")
            self._event(pod, "Warning", e.reason, e.message)
            return Terminated(1, reason=e.reason, message=e.message)
        except Exception as e:  # a bug: still a Failed pod with the reason, not a stuck one
            log.exception("%s/%s: backup failed", namespace, meta.name)
            message = f"{type(e).__name__}: {e}"
            progress(f"failed: {message}")
            self._event(pod, "Warning", "BackupFailed", message)
            return Terminated(1, reason="BackupFailed", message=message)
        finally:
            progress.close()
        summary = f"{result.kind} backup, {result.size_bytes} bytes in "
        summary += f"{result.duration_seconds:.2f} s to {result.path} ({result.consistency})"
        self._event(pod, "Normal", "BackupCompleted", summary)
        return Terminated(0, reason="Completed", message=result.message())
