"""The controller process: leader election, watches, a work queue, the reconcilers.

While this instance leads, one Reflector per reconciler's resource and one on the pods labelled
`vm.vkubelet.io/name` turn changes into keys; a key is reconciled by one worker at a time
(changes arriving meanwhile queue it once more), failures are retried with a growing delay, a
reconciler's own requeue delay is honoured, and everything the watches know of is queued again
periodically (a reconciler's time-based steps need no watch event). The leader's work is
cancelled as soon as the Lease is lost (see `vkubelet.kube`'s `LeaderElector`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Final

from ..kube import (
    PODS,
    EventRecorder,
    Handler,
    KubeClient,
    KubeLeases,
    LeaderElector,
    LeaseTiming,
    Reflector,
    Unreachable,
    WorkQueue,
    default_identity,
    label_selector,
)
from ._backup import BackupReconciler
from ._base import NAME_LABEL, Context, PodWatcher, Reconciler, Watched
from ._migration import MigrationReconciler
from ._vm import VirtualMachineReconciler

__all__ = ["ControllerConfig", "VMController", "default_reconcilers", "run_controller"]

log = logging.getLogger(__name__)

LEASE_NAME: Final = "vkubelet-vm-controller"
COMPONENT: Final = "vkubelet-vm-controller"
# A failed reconcile is retried after 0.5 s, doubling to a minute.
_RETRY_DELAY: Final = 0.5
_MAX_RETRY_DELAY: Final = 60.0


def default_reconcilers() -> list[Reconciler]:
    """The VirtualMachine, VirtualMachineBackup and VirtualMachineMigration reconcilers."""
    return [VirtualMachineReconciler(), BackupReconciler(), MigrationReconciler()]


@dataclass(frozen=True)
class ControllerConfig:
    lease_namespace: str = "kube-system"
    identity: str = ""
    namespace: str | None = None  # watch one namespace; None: all
    workers: int = 4
    resync: float = 30.0
    timing: LeaseTiming = field(default_factory=LeaseTiming)


def _key(index: int, namespace: str, name: str) -> str:
    """A work queue key: the reconciler's index and the object (names hold no '/')."""
    return f"{index}/{namespace}/{name}"


class VMController:
    """The leader's work (`run`); `run_controller` wraps it in leader election."""

    def __init__(
        self,
        client: KubeClient,
        reconcilers: Sequence[Reconciler],
        config: ControllerConfig,
        *,
        identity: str = "",
    ) -> None:
        self.client, self.reconcilers, self.config = client, list(reconcilers), config
        self.events = EventRecorder(client, component=COMPONENT, host=identity)
        self.ctx = Context(client, self.events)
        self.queue = WorkQueue(
            self._reconcile,
            name="vm controller",
            workers=config.workers,
            base_delay=_RETRY_DELAY,
            max_delay=_MAX_RETRY_DELAY,
            outage=(Unreachable,),
            outage_max_delay=_MAX_RETRY_DELAY,
        )
        self.reflectors = [
            self._reflector(
                reconciler.resource.path(config.namespace), partial(self._keys_of, index)
            )
            for index, reconciler in enumerate(self.reconcilers)
        ]
        self.pods = self._reflector(
            PODS.path(config.namespace), self._keys_of_pod, {NAME_LABEL: None}
        )

    def _reflector(
        self,
        path: str,
        keys: Callable[[Watched], list[str]],
        labels: dict[str, str | None] | None = None,
    ) -> Reflector[Watched]:
        def queue(obj: Watched) -> None:
            for key in keys(obj):
                self.queue.add(key)

        handler = Handler(queue, lambda _old, new: queue(new), queue)
        params = {"labelSelector": label_selector(labels)} if labels else None
        return Reflector(self.client, path, Watched, handler, params=params)

    def _keys_of(self, index: int, obj: Watched) -> list[str]:
        meta = obj.metadata
        return [_key(index, str(meta.namespace), meta.name)] if meta.name else []

    def _keys_of_pod(self, pod: Watched) -> list[str]:
        return [
            _key(index, namespace, name)
            for index, reconciler in enumerate(self.reconcilers)
            if isinstance(reconciler, PodWatcher)
            for namespace, name in reconciler.keys_for_pod(pod)
        ]

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.events.run())
            group.create_task(self.queue.run())
            for reflector in [*self.reflectors, self.pods]:
                group.create_task(reflector.run())
            group.create_task(self._resync())

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync)
            for index, reflector in enumerate(self.reflectors):
                for obj in list(reflector.items.values()):
                    for key in self._keys_of(index, obj):
                        self.queue.add(key)

    async def _reconcile(self, key: str) -> None:
        number, namespace, name = key.split("/", 2)
        reconciler = self.reconcilers[int(number)]
        log.debug("reconcile %s %s/%s", reconciler.resource.kind, namespace, name)
        after = await reconciler.reconcile(self.ctx, namespace, name)
        if after is not None:
            self.queue.add_after(key, max(after, 0.0))


async def run_controller(
    client: KubeClient,
    config: ControllerConfig,
    reconcilers: Sequence[Reconciler] | None = None,
) -> None:
    """Campaign for the Lease and, while leading, run the controller; for ever (cancel to stop:
    the Lease is released so that another instance takes over at once)."""
    identity = config.identity or default_identity()
    elector = LeaderElector(
        KubeLeases(client),
        namespace=config.lease_namespace,
        identity=identity,
        name=LEASE_NAME,
        timing=config.timing,
    )
    controller = VMController(
        client,
        reconcilers if reconcilers is not None else default_reconcilers(),
        config,
        identity=identity,
    )
    try:
        await elector.run(controller.run)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(elector.release())
