"""The controller process: leader election, watches, a work queue, the reconcilers.

While this instance leads, one watch per reconciler's resource and one on the pods labelled
`vm.vkubelet.io/name` turn changes into keys; a key is reconciled by one worker at a time
(changes arriving meanwhile queue it once more), failures are retried with a growing delay, a
reconciler's own requeue delay is honoured, and everything is resynced periodically (a missed
watch event costs at most one resync interval). The leader's work is cancelled as soon as the
Lease is lost (see `_lease`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from lightkube import ALL_NS, AsyncClient
from lightkube.operators import exists
from lightkube.resources.core_v1 import Pod

from ._base import NAME_LABEL, Context, EventRecorder, PodWatcher, Reconciler
from ._lease import LEASE_NAME, LeaderElector, LeaseTiming, LightkubeLeases
from ._vm import VirtualMachineReconciler

__all__ = ["ControllerConfig", "VMController", "default_reconcilers", "run_controller"]

log = logging.getLogger(__name__)

Key = tuple[int, str, str]  # (reconciler index, namespace, name)
_MAX_BACKOFF: Final = 60.0


def default_reconcilers() -> list[Reconciler]:
    """The VirtualMachine reconciler, and those of backups and migrations when installed."""
    reconcilers: list[Reconciler] = [VirtualMachineReconciler()]
    for module, attribute in (
        ("vkubelet.vmcontroller._backup", "BackupReconciler"),
        ("vkubelet.vmcontroller._migration", "MigrationReconciler"),
    ):
        try:
            imported = __import__(module, fromlist=[attribute])
        except ImportError:
            continue
        factory = getattr(imported, attribute, None)
        if factory is not None:
            reconcilers.append(factory())
    return reconcilers


@dataclass(frozen=True)
class ControllerConfig:
    lease_namespace: str = "kube-system"
    identity: str = ""
    namespace: str | None = None  # watch one namespace; None: all
    workers: int = 4
    resync: float = 30.0
    timing: LeaseTiming = field(default_factory=LeaseTiming)


class _Queue:
    """Keys to reconcile: each at most once in the queue and handled by one worker at a time."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._dirty: set[Key] = set()
        self._active: set[Key] = set()
        self._timers: set[asyncio.TimerHandle] = set()

    def add(self, key: Key) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._active:
            self._queue.put_nowait(key)

    def add_after(self, key: Key, delay: float) -> None:
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._timers.discard(handle)
            self.add(key)

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    async def get(self) -> Key:
        key = await self._queue.get()
        self._dirty.discard(key)
        self._active.add(key)
        return key

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._dirty:
            self._queue.put_nowait(key)

    def close(self) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()


class VMController:
    """The leader's work (`run`); `run_controller` wraps it in leader election."""

    def __init__(
        self,
        client: AsyncClient,
        reconcilers: Sequence[Reconciler],
        config: ControllerConfig,
    ) -> None:
        self.client, self.reconcilers, self.config = client, list(reconcilers), config
        self.events = EventRecorder(client)
        self.ctx = Context(client, self.events)
        self._failures: dict[Key, int] = {}
        self.reconciled = 0  # reconcile passes run (for tests and logs)

    @property
    def _ns(self) -> str:
        return self.config.namespace or ALL_NS

    async def run(self) -> None:
        queue = _Queue()
        try:
            async with asyncio.TaskGroup() as group:
                for index, reconciler in enumerate(self.reconcilers):
                    group.create_task(self._watch(queue, index, reconciler))
                group.create_task(self._watch_pods(queue))
                group.create_task(self._resync(queue))
                for number in range(self.config.workers):
                    group.create_task(self._work(queue), name=f"vm worker {number}")
        finally:
            queue.close()
            await self.events.aclose()

    async def _enqueue_all(self, queue: _Queue) -> None:
        for index, reconciler in enumerate(self.reconcilers):
            obj: Any
            try:
                async for obj in self.client.list(reconciler.resource, namespace=self._ns):
                    meta = _metadata(obj)
                    if meta is not None and meta.name:
                        queue.add((index, str(meta.namespace), str(meta.name)))
            except Exception as e:
                log.warning("cannot list %s: %s", reconciler.resource.__name__, e)

    async def _resync(self, queue: _Queue) -> None:
        while True:
            await self._enqueue_all(queue)
            await asyncio.sleep(self.config.resync)

    async def _watch(self, queue: _Queue, index: int, reconciler: Reconciler) -> None:
        def keys(obj: Any) -> list[Key]:
            meta = _metadata(obj)
            if meta is not None and meta.name:
                return [(index, str(meta.namespace), str(meta.name))]
            return []

        await self._keep_watching(
            queue, reconciler.resource.__name__, reconciler.resource, None, keys
        )

    async def _watch_pods(self, queue: _Queue) -> None:
        watchers = [(i, r) for i, r in enumerate(self.reconcilers) if isinstance(r, PodWatcher)]

        def keys(pod: Any) -> list[Key]:
            return [
                (index, namespace, name)
                for index, reconciler in watchers
                for namespace, name in reconciler.keys_for_pod(pod)
            ]

        await self._keep_watching(queue, "VM pods", Pod, {NAME_LABEL: exists()}, keys)

    async def _keep_watching(
        self,
        queue: _Queue,
        what: str,
        resource: Any,
        labels: Any,
        keys: Callable[[Any], list[Key]],
    ) -> None:
        """Watch for ever; after an error (the apiserver away, the CRD not installed yet) wait
        1 s doubling to 30 s, then re-list everything (events may have been missed)."""
        failures = 0
        while True:
            try:
                async for _, obj in self.client.watch(resource, namespace=self._ns, labels=labels):
                    failures = 0
                    for key in keys(obj):
                        queue.add(key)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                log.log(
                    logging.WARNING if failures in (1, 5) else logging.DEBUG,
                    "watch of %s ended: %s; watching again",
                    what,
                    e,
                )
            await asyncio.sleep(min(2.0 ** max(failures - 1, 0), 30.0))
            await self._enqueue_all(queue)

    async def _work(self, queue: _Queue) -> None:
        while True:
            key = await queue.get()
            index, namespace, name = key
            reconciler = self.reconcilers[index]
            try:
                self.reconciled += 1
                log.debug("reconcile %s %s/%s", reconciler.resource.__name__, namespace, name)
                after = await reconciler.reconcile(self.ctx, namespace, name)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                delay = min(0.5 * 2 ** (failures - 1), _MAX_BACKOFF)
                log.warning(
                    "%s %s/%s: reconcile failed (%s: %s); again in %.1fs",
                    reconciler.resource.__name__,
                    namespace,
                    name,
                    type(e).__name__,
                    e,
                    delay,
                )
                queue.add_after(key, delay)
            else:
                self._failures.pop(key, None)
                if after is not None:
                    queue.add_after(key, max(after, 0.0))
            finally:
                queue.done(key)


def default_identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def run_controller(
    client: AsyncClient,
    config: ControllerConfig,
    reconcilers: Sequence[Reconciler] | None = None,
) -> None:
    """Campaign for the Lease and, while leading, run the controller; for ever (cancel to stop:
    the Lease is released so that another instance takes over at once)."""
    identity = config.identity or default_identity()
    elector = LeaderElector(
        LightkubeLeases(client),
        namespace=config.lease_namespace,
        identity=identity,
        name=LEASE_NAME,
        timing=config.timing,
    )
    controller = VMController(
        client, reconcilers if reconcilers is not None else default_reconcilers(), config
    )
    try:
        await elector.run(controller.run)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(elector.release())


def _metadata(obj: Any) -> Any:
    return obj.metadata
