"""Keeps the provider's pods in line with the API's, and the API's pod status with the provider's.

Two keyed queues do the work: `sync` (API → provider: create, update, delete) and `status`
(provider → API: status patches, and removing the API object once a deleted pod's containers have
all stopped — at once, not after the whole grace period as in the reference). Invariants:

- a pod is created in the provider only when the provider does not already run that pod (same
  UID): restarting the agent adopts running pods and never re-creates them;
- a provider pod is deleted without an API request only when it is provably ours: its node is this
  node and the API, after a complete list, has no pod with its UID;
- status is written only when something a user can see changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from ..sdk.provider import PodLifecycleHandler, PodNotifier, ProviderError, ResolvedPod
from ._events import NORMAL, WARNING, EventRecorder, ObjectRef
from ._kube import STRATEGIC_MERGE_PATCH, ApiError, KubeClient, Unreachable
from ._objects import ObjectCache, content
from ._podrecord import PodRecord, digest, visible_status
from ._reflector import Handler, Reflector
from ._resolution import Resolution, ResolutionFailed, Resolver
from ._workqueue import WorkQueue

log = logging.getLogger(__name__)

TERMINAL = ("Succeeded", "Failed")
# On the provider's copy of a pod (never the API's): a digest of what the provider was given,
# so that after a restart the agent can tell whether the pod it adopts is up to date.
APPLIED_ANNOTATION = "vkubelet.io/applied"


class PodController:
    def __init__(
        self,
        client: KubeClient,
        node_name: str,
        provider: PodLifecycleHandler,
        recorder: EventRecorder,
        resolver_factory: Callable[[ObjectCache], Resolver],
        *,
        workers: int = 32,
        status_poll_interval: float = 5.0,
    ) -> None:
        self._client = client
        self.node_name = node_name
        self._provider = provider
        self._recorder = recorder
        self._status_poll_interval = status_poll_interval
        self.reflector: Reflector[PodRecord] = Reflector(
            client,
            "/api/v1/pods",
            PodRecord,
            Handler(self._on_add, self._on_update, self._on_delete),
            params={"fieldSelector": f"spec.nodeName={node_name}"},
            name=f"pods of {node_name}",
            decode=PodRecord.from_json,
        )
        self.objects = ObjectCache(client, self._on_object_change)
        self._resolver = resolver_factory(self.objects)
        self.sync_queue = WorkQueue(self._sync, name=f"{node_name}/sync", workers=workers)
        self.status_queue = WorkQueue(
            self._sync_status, name=f"{node_name}/status", workers=workers
        )
        self._known: dict[str, str] = {}  # pod key -> UID the provider runs
        self._gone: dict[str, PodRecord] = {}  # last API state of pods deleted from the API
        self._applied: dict[str, bytes] = {}  # pod key -> digest of what the provider was given
        self._deleting: dict[str, str] = {}  # pod key -> UID we asked the provider to stop
        # Latest provider status (and the UID it is about) not yet reconciled with the API;
        # dropped once it is, so that memory per running pod stays small.
        self._reported: dict[str, tuple[str, dict[str, Any]]] = {}
        self._terminated: dict[str, str] = {}  # pod key -> UID whose containers have all stopped
        self._waiting: dict[str, tuple[str, str, str]] = {}  # pod key -> (UID, reason, message)
        # pod key -> (UID, digest of the status we wrote, digest of the API's status after it):
        # the API's status also holds conditions the provider does not report (PodScheduled),
        # so comparing a report with it alone would find a difference every time.
        self._written: dict[str, tuple[str, bytes, bytes]] = {}
        self.ready = asyncio.Event()
        self.creates = 0
        self.updates = 0
        self.deletes = 0

    # -- inputs -----------------------------------------------------------------------------------
    def _on_add(self, record: PodRecord) -> None:
        self.sync_queue.add(record.key)

    def _on_update(self, old: PodRecord, new: PodRecord) -> None:
        # Our own status writes come back as updates; only spec and metadata changes need a sync,
        # and becoming terminal (which releases the pod's object watches).
        if new.spec_or_meta_changed(old) or (new.terminal and not old.terminal):
            self.sync_queue.add(new.key)
        elif new.deleting:
            self.status_queue.add(new.key)

    def _on_delete(self, record: PodRecord) -> None:
        self._gone[record.key] = record
        self.sync_queue.add(record.key)

    def _on_object_change(self, ref: tuple[str, str, str], users: set[str]) -> None:
        log.info("%s %s/%s changed; re-syncing %d pod(s)", *ref, len(users))
        for key in users:
            self.sync_queue.add(key)

    def _on_provider_pod(self, pod: Pod) -> None:
        """Push notification from the provider: remember the latest status and schedule a write."""
        meta = pod.metadata
        if pod.status is not None and meta is not None:
            key = f"{meta.namespace}/{meta.name}"
            # A provider that does not say which pod it means is talking about the one it runs.
            self._take_report(key, meta.uid or self._known.get(key, ""), pod.status)

    def _take_report(self, key: str, uid: str, status: PodStatus) -> None:
        reported: dict[str, Any] = msgspec.to_builtins(status)
        self._reported[key] = (uid, reported)
        if _all_terminated(reported):
            self._terminated[key] = uid
        else:
            self._terminated.pop(key, None)
        self.status_queue.add(key)

    # -- run --------------------------------------------------------------------------------------
    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.reflector.run(), name=f"{self.node_name} reflector")
            await self.reflector.synced.wait()
            await self._reconcile_provider()
            if isinstance(self._provider, PodNotifier):
                self._provider.notify_pods(self._on_provider_pod)
            else:
                group.create_task(self._poll_status())
            group.create_task(self.sync_queue.run())
            group.create_task(self.status_queue.run())
            self.ready.set()

    async def _reconcile_provider(self) -> None:
        """Adopt the provider's pods that the API still has; remove those provably orphaned."""
        running = await self._provider.list_pods()
        for pod in running:
            meta = pod.metadata
            if meta is None:
                continue
            key = f"{meta.namespace}/{meta.name}"
            record = self.reflector.items.get(key)
            if record is not None and record.uid == meta.uid:
                self._known[key] = record.uid
                if pod.status is not None:
                    self._take_report(key, record.uid, pod.status)
                continue
            node = pod.spec.nodeName if pod.spec else None
            if node == self.node_name and meta.uid:
                log.info(
                    "pod %s (uid %s) runs in the provider but not in the API; deleting it",
                    key,
                    meta.uid,
                )
                try:
                    await self._provider.delete_pod(pod, 0)
                except Exception as e:  # one pod never stops the node; the next start retries
                    log.warning("pod %s: the provider could not delete the orphan: %s", key, e)
            else:
                log.warning("provider pod %s is not provably this node's; leaving it alone", key)
        log.info("node %s: adopted %d running pod(s)", self.node_name, len(self._known))

    async def _poll_status(self) -> None:
        """For providers without push notifications: ask for every live pod's status."""
        while True:
            await asyncio.sleep(self._status_poll_interval)
            for key, record in list(self.reflector.items.items()):
                if key not in self._known or record.terminal:
                    continue
                with contextlib.suppress(Exception):
                    status = await self._provider.get_pod_status(record.namespace, record.name)
                    if status is not None:
                        self._take_report(key, record.uid, status)

    # -- API -> provider --------------------------------------------------------------------------
    async def _sync(self, key: str) -> None:
        record = self.reflector.items.get(key)
        known_uid = self._known.get(key)
        if record is None:
            await self._forget(key)
            return
        if known_uid is not None and known_uid != record.uid:
            # Same name, new pod: the old one must stop before the new one starts. After a relist
            # the API's old pod may never have been seen deleted: ask the provider for its own.
            gone = self._gone.pop(key, None)
            old = gone.pod() if gone is not None and gone.uid == known_uid else None
            if old is None:
                old = await self._provider.get_pod(record.namespace, record.name)
            if old is not None and old.metadata is not None and old.metadata.uid == known_uid:
                await self._provider_delete(key, old, known_uid, 0)
            for state in (self._known, self._applied, self._deleting, self._reported):
                state.pop(key, None)
            self._terminated.pop(key, None)
            self._written.pop(key, None)
        if record.deleting:
            await self._sync_deletion(key, record)
            return
        if record.terminal:
            self.objects.release(key)  # its ConfigMap/Secret watches close once no pod uses them
            return
        pod = record.pod()
        if await self._deadline_exceeded(key, record, pod):
            return
        try:
            resolved = await self._resolver.resolve(key, pod)
        except ResolutionFailed as e:
            for reason, message in e.events or [(e.reason, e.message)]:
                self._event(record, WARNING, reason, message)
            if key in self._known:
                # Already running: its containers keep the environment and files they have (as
                # with the kubelet); the object's watch re-syncs the pod when it is back.
                return
            # Like the kubelet: a volume that cannot be set up leaves the container "being
            # created" (the FailedMount event says why); bad env config is its own reason.
            waiting = "ContainerCreating" if e.reason == "FailedMount" else e.reason
            await self._write_waiting(record, pod, waiting, e.message)
            if e.permanent:
                return  # no retry helps; the object's watch re-syncs the pod when it changes
            raise
        for reason, message in resolved.warnings:
            self._event(record, WARNING, reason, message)
        if resolved.refresh_after is not None:
            self.sync_queue.add_after(key, resolved.refresh_after)
        applied = _digest(resolved.pod)
        _mark_applied(resolved.pod, applied)
        existing: Pod | None = None
        if key not in self._known:
            existing = await self._provider.get_pod(record.namespace, record.name)
            if existing is None or existing.metadata is None or existing.metadata.uid != record.uid:
                await self._create(key, record, resolved, applied)
                return
            self._known[key] = record.uid  # adopted; never re-create
        if self._applied.get(key) != applied:
            if key not in self._applied:
                # Adopted after a restart: update only if the provider's copy says it was given
                # something else; a provider that keeps no annotations is not disturbed.
                if existing is None:
                    existing = await self._provider.get_pod(record.namespace, record.name)
                annotations = (
                    existing.metadata.annotations if existing and existing.metadata else None
                ) or {}
                if annotations.get(APPLIED_ANNOTATION) in (None, applied.hex()):
                    self._applied[key] = applied
                    return
            try:
                await self._provider.update_pod(resolved.pod)
            except ProviderError as e:
                self._event(record, WARNING, "ProviderUpdateFailed", e.message)
                if e.permanent:
                    return
                raise
            self._applied[key] = applied
            self.updates += 1
            self._event(record, NORMAL, "Updated", "provider updated the pod")

    async def _deadline_exceeded(self, key: str, record: PodRecord, pod: Pod) -> bool:
        """Enforce spec.activeDeadlineSeconds as the kubelet does: stop the pod, mark it Failed."""
        deadline = pod.spec.activeDeadlineSeconds if pod.spec else None
        started = pod.status.startTime if pod.status else None
        if deadline is None or started is None:
            return False
        left = deadline - (datetime.now(UTC) - started).total_seconds()
        if left > 0:
            self.sync_queue.add_after(key, left)
            return False
        message = "Pod was active on the node longer than the specified deadline"
        if key in self._known and self._deleting.get(key) != record.uid:
            await self._provider_delete(key, pod, record.uid, 0)
        await self._write_failed(record, "DeadlineExceeded", message)
        self._event(record, WARNING, "DeadlineExceeded", message)
        return True

    async def _create(
        self, key: str, record: PodRecord, resolved: Resolution, applied: bytes
    ) -> None:
        try:
            await self._provider.create_pod(resolved.pod)
        except ProviderError as e:
            self._event(record, WARNING, e.reason or "ProviderCreateFailed", e.message)
            if e.permanent:
                await self._write_failed(record, e.reason or "ProviderFailed", e.message)
                self._known[key] = record.uid
                return
            raise
        except Exception as e:
            self._event(record, WARNING, "ProviderCreateFailed", f"{type(e).__name__}: {e}")
            raise
        self._known[key] = record.uid
        self._applied[key] = applied
        self._waiting.pop(key, None)
        self.creates += 1
        self._event(record, NORMAL, "Created", "pod started by the provider")
        if key in self._reported:
            self.status_queue.add(key)  # reported before create_pod returned

    async def _sync_deletion(self, key: str, record: PodRecord) -> None:
        if self._known.get(key) != record.uid:
            # The provider never ran it (or already forgot it): nothing to wait for.
            await self._remove_from_api(record)
            return
        if self._deleting.get(key) != record.uid:
            grace = 30 if record.deletion_grace is None else int(record.deletion_grace)
            await self._provider_delete(key, record.pod(), record.uid, grace)
            self._event(record, NORMAL, "Killing", "stopping the pod's containers")
            # If the provider never reports the stop, look for ourselves after the grace period.
            self.sync_queue.add_after(key, grace + 1)
        else:
            running = await self._provider.get_pod(record.namespace, record.name)
            if running is None or running.metadata is None or running.metadata.uid != record.uid:
                self._terminated[key] = record.uid  # the provider no longer runs it
        self.status_queue.add(key)

    async def _provider_delete(self, key: str, pod: Pod, uid: str, grace: int) -> None:
        try:
            await self._provider.delete_pod(pod, grace)
        except ProviderError as e:
            log.warning("pod %s: the provider could not delete it: %s", key, e.message)
            if not e.permanent:
                raise
        self._deleting[key] = uid  # only now: a failed call is retried by the queue
        self.deletes += 1

    async def _forget(self, key: str) -> None:
        """The API object is gone: make sure the provider stops the pod, then drop our state."""
        last = self._gone.pop(key, None)
        uid = self._known.get(key)
        stopped = uid is not None and self._deleting.get(key) == uid == self._terminated.get(key)
        if uid is not None and last is not None and not stopped:
            existing = await self._provider.get_pod(last.namespace, last.name)
            if existing is not None and existing.metadata and existing.metadata.uid == uid:
                await self._provider_delete(key, last.pod(), uid, 0)
        self._known.pop(key, None)
        self._applied.pop(key, None)
        self._deleting.pop(key, None)
        self._reported.pop(key, None)
        self._terminated.pop(key, None)
        self._waiting.pop(key, None)
        self._written.pop(key, None)
        self.objects.release(key)
        self._resolver.forget(key)
        self.sync_queue.forget(key)
        self.status_queue.forget(key)

    # -- provider -> API --------------------------------------------------------------------------
    async def _sync_status(self, key: str) -> None:
        record = self.reflector.items.get(key)
        if record is None or self._known.get(key) != record.uid:
            return  # gone, or a report about an older pod of the same name
        terminated = self._terminated.get(key) == record.uid
        if record.deleting and terminated and not record.finalizers:
            # The object is about to disappear: its final status would be one more write that
            # nobody can read, so go straight to removing it.
            await self._remove_from_api(record)
            return
        entry = self._reported.get(key)
        if entry is not None:
            uid, reported = entry
            wanted = visible_status(reported)
            if (
                uid == record.uid
                and not record.terminal
                and record.status_digest != wanted
                and self._written.get(key) != (uid, wanted, record.status_digest)
            ):
                answer = await self._patch_status(record, reported)
                if reported.get("phase") == "Running" and record.phase != "Running":
                    self._event(record, NORMAL, "Started", "the pod's containers are running")
                if answer is not None:
                    self._written[key] = (uid, wanted, visible_status(answer.get("status")))
            if self._reported.get(key) is entry:
                del self._reported[key]
        if record.deleting and terminated:
            await self._remove_from_api(record)

    async def _patch_status(
        self, record: PodRecord, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The pod as the API stored it, or None if it is gone or was replaced."""
        patch = {"metadata": {"uid": record.uid}, "status": status}
        try:
            return await self._client.patch(
                f"/api/v1/namespaces/{record.namespace}/pods/{record.name}/status",
                patch,
                content_type=STRATEGIC_MERGE_PATCH,
            )
        except ApiError as e:
            if e.not_found or e.conflict:
                return None  # deleted or replaced meanwhile; the watch will tell us
            raise

    async def _remove_from_api(self, record: PodRecord) -> None:
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": record.uid}}
        try:
            await self._client.delete(
                f"/api/v1/namespaces/{record.namespace}/pods/{record.name}", body
            )
        except ApiError as e:
            if not (e.not_found or e.conflict):
                raise

    async def _write_waiting(self, record: PodRecord, pod: Pod, reason: str, message: str) -> None:
        if self._waiting.get(record.key) == (record.uid, reason, message):
            return  # written already: retries do not rewrite an unchanged status
        containers = pod.spec.containers if pod.spec else []
        status = {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": c.name,
                    "ready": False,
                    "restartCount": 0,
                    "image": c.image or "",
                    "imageID": "",
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
                for c in containers
            ],
        }
        with contextlib.suppress(ApiError, Unreachable):
            await self._patch_status(record, status)
            self._waiting[record.key] = (record.uid, reason, message)

    async def _write_failed(self, record: PodRecord, reason: str, message: str) -> None:
        await self._patch_status(record, {"phase": "Failed", "reason": reason, "message": message})

    def _event(self, record: PodRecord, type: str, reason: str, message: str) -> None:
        ref = ObjectRef("Pod", record.namespace, record.name, record.uid)
        self._recorder.emit(ref, type, reason, message)


def _all_terminated(status: dict[str, Any]) -> bool:
    if status.get("phase") in TERMINAL:
        return True
    statuses = status.get("containerStatuses") or []
    return bool(statuses) and all("terminated" in (s.get("state") or {}) for s in statuses)


def _mark_applied(pod: ResolvedPod, applied: bytes) -> None:
    meta = pod.pod.metadata
    if meta is not None:
        meta.annotations = {**(meta.annotations or {}), APPLIED_ANNOTATION: applied.hex()}


def _digest(pod: ResolvedPod) -> bytes:
    """What the provider was given: a change means it must hear about it (update_pod).

    Only what a provider acts on: the resolved spec, labels, annotations, volume contents and
    (for a pass-through provider) the content of the objects the pod references — not the
    status or resourceVersion, which change with every status write (a digest of the whole pod
    made each re-sync of a running pod an update_pod).
    """
    meta = pod.pod.metadata
    labels = meta.labels if meta else None
    annotations = dict((meta.annotations if meta else None) or {})
    annotations.pop(APPLIED_ANNOTATION, None)
    parts: tuple[Any, ...] = (pod.pod.spec, labels, annotations, pod.volumes)
    if pod.references:  # only then: digests of pods adopted from an older agent stay the same
        parts += ([(ref, content(ref[0], pod.references[ref])) for ref in sorted(pod.references)],)
    return digest(parts)


__all__ = ["PodController", "PodStatus", "ResolvedPod"]
