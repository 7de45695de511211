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
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from ._events import NORMAL, WARNING, EventRecorder, ObjectRef
from ._kube import STRATEGIC_MERGE_PATCH, ApiError, KubeClient, Unreachable
from ._objects import ObjectCache
from ._reflector import Handler, Reflector, key_of
from ._resolution import Resolution, ResolutionFailed, Resolver
from ._workqueue import WorkQueue
from .provider import PodLifecycleHandler, PodNotifier, ProviderError, ResolvedPod

log = logging.getLogger(__name__)

TERMINAL = ("Succeeded", "Failed")


def _builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj) if obj is not None else None


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
        self.reflector: Reflector[Pod] = Reflector(
            client,
            "/api/v1/pods",
            Pod,
            Handler(self._on_add, self._on_update, self._on_delete),
            params={"fieldSelector": f"spec.nodeName={node_name}"},
            name=f"pods of {node_name}",
        )
        self.objects = ObjectCache(client, self._on_object_change)
        self._resolver = resolver_factory(self.objects)
        self.sync_queue = WorkQueue(self._sync, name=f"{node_name}/sync", workers=workers)
        self.status_queue = WorkQueue(
            self._sync_status, name=f"{node_name}/status", workers=workers
        )
        self._known: dict[str, str] = {}  # pod key -> UID the provider runs
        self._gone: dict[str, Pod] = {}  # last API state of pods deleted from the API
        self._applied: dict[str, str] = {}  # pod key -> digest of what the provider was given
        self._deleting: dict[str, str] = {}  # pod key -> UID we asked the provider to stop
        self._reported: dict[str, dict[str, Any]] = {}  # pod key -> latest provider status
        self.ready = asyncio.Event()
        self.creates = 0
        self.updates = 0
        self.deletes = 0

    # -- inputs -----------------------------------------------------------------------------------
    def _on_add(self, pod: Pod) -> None:
        self.sync_queue.add(key_of(pod))

    def _on_update(self, old: Pod, new: Pod) -> None:
        # Our own status writes come back as updates; only spec and metadata changes need a sync.
        om, nm = old.metadata, new.metadata
        if (
            old.spec != new.spec
            or om.deletionTimestamp != nm.deletionTimestamp  # type: ignore[union-attr]
            or om.labels != nm.labels  # type: ignore[union-attr]
            or om.annotations != nm.annotations  # type: ignore[union-attr]
            or om.uid != nm.uid  # type: ignore[union-attr]
        ):
            self.sync_queue.add(key_of(new))
        elif nm.deletionTimestamp is not None:  # type: ignore[union-attr]
            self.status_queue.add(key_of(new))

    def _on_delete(self, pod: Pod) -> None:
        key = key_of(pod)
        self._gone[key] = pod
        self.sync_queue.add(key)

    def _on_object_change(self, ref: tuple[str, str, str], users: set[str]) -> None:
        log.info("%s %s/%s changed; re-syncing %d pod(s)", *ref, len(users))
        for key in users:
            self.sync_queue.add(key)

    def _on_provider_pod(self, pod: Pod) -> None:
        """Push notification from the provider: remember the latest status and schedule a write."""
        if pod.status is None:
            return
        key = key_of(pod)
        self._reported[key] = _builtins(pod.status)
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
            key = key_of(pod)
            uid = pod.metadata.uid  # type: ignore[union-attr]
            api_pod = self.reflector.items.get(key)
            if api_pod is not None and api_pod.metadata.uid == uid:  # type: ignore[union-attr]
                self._known[key] = str(uid)
                if pod.status is not None:
                    self._reported[key] = _builtins(pod.status)
                    self.status_queue.add(key)
                continue
            node = pod.spec.nodeName if pod.spec else None
            if node == self.node_name and uid:
                log.info(
                    "pod %s (uid %s) runs in the provider but not in the API; deleting it", key, uid
                )
                await self._provider.delete_pod(pod, 0)
            else:
                log.warning("provider pod %s is not provably this node's; leaving it alone", key)
        log.info("node %s: adopted %d running pod(s)", self.node_name, len(self._known))

    async def _poll_status(self) -> None:
        """For providers without push notifications: ask for every live pod's status."""
        while True:
            await asyncio.sleep(self._status_poll_interval)
            for key, pod in list(self.reflector.items.items()):
                if key not in self._known or (pod.status and pod.status.phase in TERMINAL):
                    continue
                meta = pod.metadata
                with contextlib.suppress(Exception):
                    status = await self._provider.get_pod_status(meta.namespace, meta.name)  # type: ignore[union-attr, arg-type]
                    if status is not None:
                        self._reported[key] = _builtins(status)
                        self.status_queue.add(key)

    # -- API -> provider --------------------------------------------------------------------------
    async def _sync(self, key: str) -> None:
        pod = self.reflector.items.get(key)
        known_uid = self._known.get(key)
        if pod is None:
            await self._forget(key)
            return
        uid = str(pod.metadata.uid)  # type: ignore[union-attr]
        if known_uid is not None and known_uid != uid:
            # Same name, new pod: the old one must stop before the new one starts.
            await self._provider_delete(key, self._gone.get(key) or pod, 0)
        if pod.metadata.deletionTimestamp is not None:  # type: ignore[union-attr]
            await self._sync_deletion(key, pod)
            return
        if pod.status is not None and pod.status.phase in TERMINAL:
            return
        try:
            resolved = await self._resolver.resolve(key, pod)
        except ResolutionFailed as e:
            for reason, message in e.events or [(e.reason, e.message)]:
                self._event(pod, WARNING, reason, message)
            await self._write_waiting(pod, e.reason, e.message)
            raise
        for reason, message in resolved.warnings:
            self._event(pod, WARNING, reason, message)
        if resolved.refresh_after is not None:
            self.sync_queue.add_after(key, resolved.refresh_after)
        digest = _digest(resolved.pod)
        if key not in self._known:
            existing = await self._provider.get_pod(*key.split("/", 1))
            if existing is not None and existing.metadata.uid == uid:  # type: ignore[union-attr]
                self._known[key] = uid  # adopted; never re-create
                self._applied.setdefault(key, digest)
                return
            await self._create(key, pod, resolved, digest)
        elif self._applied.get(key) != digest:
            if key not in self._applied:  # adopted after a restart: remember, don't disturb
                self._applied[key] = digest
                return
            try:
                await self._provider.update_pod(resolved.pod)
            except ProviderError as e:
                self._event(pod, WARNING, "ProviderUpdateFailed", e.message)
                if e.permanent:
                    return
                raise
            self._applied[key] = digest
            self.updates += 1
            self._event(pod, NORMAL, "Updated", "provider updated the pod")

    async def _create(self, key: str, pod: Pod, resolved: Resolution, digest: str) -> None:
        try:
            await self._provider.create_pod(resolved.pod)
        except ProviderError as e:
            self._event(pod, WARNING, e.reason or "ProviderCreateFailed", e.message)
            if e.permanent:
                await self._write_failed(pod, e.reason or "ProviderFailed", e.message)
                self._known[key] = str(pod.metadata.uid)  # type: ignore[union-attr]
                return
            raise
        except Exception as e:
            self._event(pod, WARNING, "ProviderCreateFailed", f"{type(e).__name__}: {e}")
            raise
        self._known[key] = str(pod.metadata.uid)  # type: ignore[union-attr]
        self._applied[key] = digest
        self.creates += 1
        self._event(pod, NORMAL, "Created", "pod started by the provider")

    async def _sync_deletion(self, key: str, pod: Pod) -> None:
        uid = str(pod.metadata.uid)  # type: ignore[union-attr]
        if self._known.get(key) != uid:
            # The provider never ran it (or already forgot it): nothing to wait for.
            await self._remove_from_api(pod)
            return
        if self._deleting.get(key) != uid:
            grace = pod.metadata.deletionGracePeriodSeconds  # type: ignore[union-attr]
            await self._provider_delete(key, pod, 30 if grace is None else int(grace))
            self._event(pod, NORMAL, "Killing", "stopping the pod's containers")
        self.status_queue.add(key)

    async def _provider_delete(self, key: str, pod: Pod, grace: int) -> None:
        self._deleting[key] = str(pod.metadata.uid)  # type: ignore[union-attr]
        try:
            await self._provider.delete_pod(pod, grace)
        except ProviderError as e:
            self._event(pod, WARNING, "ProviderDeleteFailed", e.message)
            if not e.permanent:
                raise
        self.deletes += 1

    async def _forget(self, key: str) -> None:
        """The API object is gone: make sure the provider stops the pod, then drop our state."""
        last = self._gone.pop(key, None)
        if key in self._known and last is not None:
            uid = self._known[key]
            if self._deleting.get(key) != uid or not self._all_terminated(key):
                existing = await self._provider.get_pod(*key.split("/", 1))
                if existing is not None and existing.metadata.uid == uid:  # type: ignore[union-attr]
                    await self._provider_delete(key, last, 0)
        self._known.pop(key, None)
        self._applied.pop(key, None)
        self._deleting.pop(key, None)
        self._reported.pop(key, None)
        self.objects.release(key)
        self._resolver.forget(key)
        self.sync_queue.forget(key)
        self.status_queue.forget(key)

    # -- provider -> API --------------------------------------------------------------------------
    async def _sync_status(self, key: str) -> None:
        pod = self.reflector.items.get(key)
        reported = self._reported.get(key)
        if pod is None or reported is None:
            return
        api_status = _builtins(pod.status) or {}
        uid = str(pod.metadata.uid)  # type: ignore[union-attr]
        if self._known.get(key) != uid:
            return  # a report about an older pod of the same name
        if api_status.get("phase") not in TERMINAL and _visible(api_status) != _visible(reported):
            await self._patch_status(pod, reported)
        if pod.metadata.deletionTimestamp is not None and self._all_terminated(key):  # type: ignore[union-attr]
            await self._remove_from_api(pod)

    def _all_terminated(self, key: str) -> bool:
        reported = self._reported.get(key) or {}
        if reported.get("phase") in TERMINAL:
            return True
        statuses = reported.get("containerStatuses") or []
        return bool(statuses) and all("terminated" in (s.get("state") or {}) for s in statuses)

    async def _patch_status(self, pod: Pod, status: dict[str, Any]) -> None:
        meta = pod.metadata
        patch = {"metadata": {"uid": meta.uid}, "status": status}  # type: ignore[union-attr]
        try:
            await self._client.patch(
                f"/api/v1/namespaces/{meta.namespace}/pods/{meta.name}/status",  # type: ignore[union-attr]
                patch,
                content_type=STRATEGIC_MERGE_PATCH,
            )
        except ApiError as e:
            if e.not_found or e.conflict:
                return  # deleted or replaced meanwhile; the watch will tell us
            raise

    async def _remove_from_api(self, pod: Pod) -> None:
        meta = pod.metadata
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta.uid}}  # type: ignore[union-attr]
        try:
            await self._client.delete(
                f"/api/v1/namespaces/{meta.namespace}/pods/{meta.name}",  # type: ignore[union-attr]
                body,
            )
        except ApiError as e:
            if not (e.not_found or e.conflict):
                raise

    async def _write_waiting(self, pod: Pod, reason: str, message: str) -> None:
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
            await self._patch_status(pod, status)

    async def _write_failed(self, pod: Pod, reason: str, message: str) -> None:
        await self._patch_status(pod, {"phase": "Failed", "reason": reason, "message": message})

    def _event(self, pod: Pod, type: str, reason: str, message: str) -> None:
        meta = pod.metadata
        ref = ObjectRef("Pod", str(meta.namespace), str(meta.name), str(meta.uid))  # type: ignore[union-attr]
        self._recorder.emit(ref, type, reason, message)


def _digest(pod: ResolvedPod) -> str:
    """What the provider was given: a change means it must hear about it (update_pod)."""
    digest = hashlib.sha256(msgspec.json.encode(pod.pod))
    digest.update(msgspec.json.encode(pod.volumes))
    return digest.hexdigest()


def _visible(status: dict[str, Any]) -> Any:
    """The parts of a status a user sees; equal projections mean no write is needed."""

    def conditions(items: list[dict[str, Any]] | None) -> list[tuple[Any, ...]]:
        return sorted(
            (c.get("type"), c.get("status"), c.get("reason"), c.get("message")) for c in items or []
        )

    def containers(items: list[dict[str, Any]] | None) -> list[tuple[Any, ...]]:
        return sorted(
            (
                c.get("name"),
                c.get("ready"),
                c.get("started"),
                c.get("restartCount"),
                msgspec.json.encode(c.get("state") or {}),
                msgspec.json.encode(c.get("lastState") or {}),
            )
            for c in items or []
        )

    return (
        status.get("phase"),
        status.get("reason"),
        status.get("message"),
        status.get("podIP"),
        status.get("hostIP"),
        status.get("startTime"),
        conditions(status.get("conditions")),
        containers(status.get("containerStatuses")),
        containers(status.get("initContainerStatuses")),
    )


__all__ = ["PodController", "PodStatus", "ResolvedPod"]
