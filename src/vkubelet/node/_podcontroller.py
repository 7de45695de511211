"""Keeps the provider's pods in line with the API's, and the API's pod status with the provider's.

Two keyed queues do the work: `sync` (API → provider: create, update, delete) and `status`
(provider → API: status patches, and removing the API object once a deleted pod's containers have
all stopped — at once, not after the whole grace period as in the reference). Invariants:

- a pod is created in the provider only when the provider does not already run that pod (same
  UID): restarting the agent adopts running pods and never re-creates them;
- a provider pod is deleted without an API request only when it is provably ours: its node is this
  node and the API, after a complete list, has no pod with its UID;
- status is written only when something a user can see changed, and counts as written only
  once the API accepted it;
- provider calls for one pod never overlap (the sync queue and the status poll share a per-pod
  lock), as the provider contract promises.

What the controller knows of each pod beyond the API's copy is one `PodState` (`_podstate`),
changed only through its named transitions. A provider's status push is accepted from the very
start (the callback is registered before the API's pods are listed and running pods adopted)
and kept until the pod it is about exists.

Pod IPs: a provider that learns the pod's address only after `create_pod` (a VM, a lower
cluster) reports `podIP` or `podIPs` in a later status; the agent fills in the other and writes
both. The downward API's `status.podIP` in env is resolved once, before `create_pod`, as the
kubelet does with the sandbox's address: from the provider's `PodNetwork.pod_ips` if it has
that capability, else the node's InternalIP (as for a host-network pod). A later address does
not change the env of a running pod (it would mean an `update_pod` with a different env).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Pod

from ..kube import (
    NORMAL,
    STRATEGIC_MERGE_PATCH,
    WARNING,
    ApiError,
    EventRecorder,
    Handler,
    KubeClient,
    ObjectRef,
    Reflector,
    Unreachable,
    WorkQueue,
)
from ..sdk.provider import (
    AdoptsPods,
    EphemeralContainers,
    PodLifecycleHandler,
    PodNotifier,
    ProviderError,
    ResolvedPod,
)
from ..sdk.tasks import run_supervised
from ._objects import ObjectCache, content
from ._podrecord import PodRecord, digest, merged_status, visible_status
from ._podstate import PodState
from ._resolution import Resolution, ResolutionFailed, Resolver

log = logging.getLogger(__name__)

# A provider's transient create failure with one of these reasons is the containers' waiting
# reason while the create is retried (a kubelet's CreateContainerError: a full disk, say).
_CONTAINER_WAITING = frozenset({"CreateContainerError"})

# Failures of the status poll are logged at most this often (the poll runs every few seconds).
POLL_ERROR_LOG_INTERVAL = 60.0
# How long after its start a node still watches for the moment it is first in sync.
IN_SYNC_LOG_LIMIT = 600.0
# On the provider's copy of a pod (never the API's): a digest of what the provider was given,
# so that after a restart the agent can tell whether the pod it adopts is up to date.
APPLIED_ANNOTATION = "vkubelet.io/applied"


class _ProviderCalls:
    """Per-pod mutual exclusion of provider calls: the provider contract promises that calls
    for one pod never overlap, and the sync queue and the status poll both call it. A lock
    exists only while some call for its pod is under way or waiting."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def busy(self, key: str) -> bool:
        return key in self._locks

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class PodController:
    def __init__(
        self,
        client: KubeClient,
        node_name: str,
        provider: PodLifecycleHandler,
        recorder: EventRecorder,
        resolver_factory: Callable[[ObjectCache], Resolver],
        *,
        workers: int = 96,
        status_poll_interval: float = 5.0,
    ) -> None:
        self._client = client
        self.node_name = node_name
        self._provider = provider
        self._adopts = provider if isinstance(provider, AdoptsPods) else None  # checked once
        self._ephemeral = provider if isinstance(provider, EphemeralContainers) else None
        self._recorder = recorder
        self._status_poll_interval = status_poll_interval
        self.reflector: Reflector[PodRecord] = Reflector(
            client,
            "/api/v1/pods",
            PodRecord,
            Handler(self._on_add, self._on_update, self._on_delete),
            params={"fieldSelector": f"spec.nodeName={node_name}"},
            name=f"pods of {node_name}",
            decode=PodRecord,
        )
        self.objects = ObjectCache(client, self._on_object_change)
        self._resolver = resolver_factory(self.objects)
        self.sync_queue = WorkQueue(
            self._sync,
            name=f"{node_name}/sync",
            workers=workers,
            outage=(Unreachable,),
            explained=(ResolutionFailed,),
        )
        self.status_queue = WorkQueue(
            self._sync_status, name=f"{node_name}/status", workers=workers, outage=(Unreachable,)
        )
        self.states: dict[str, PodState] = {}  # pod key -> what we know beyond the API's copy
        # Adopted at start: key -> (UID, the applied annotation of the provider's listed copy),
        # read by the pod's first sync instead of asking the provider for each pod again.
        self._listed_applied: dict[str, tuple[str, str | None]] = {}
        self._calls = _ProviderCalls()
        self._poll_errors_logged = -POLL_ERROR_LOG_INTERVAL
        self.ready = asyncio.Event()
        self.creates = 0
        self.updates = 0
        self.deletes = 0
        if isinstance(provider, PodNotifier):
            # First of all, before the node is even registered: a provider may push as soon as
            # it has somewhere to push to, and its reports are kept until their pods are known.
            provider.notify_pods(self._on_provider_pod)

    def _state(self, key: str) -> PodState:
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = PodState()
        return state

    def _running_uid(self, key: str) -> str | None:
        state = self.states.get(key)
        return None if state is None else state.uid

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
        self._state(record.key).deleted_from_api(record)
        self.sync_queue.add(record.key)

    def _on_object_change(self, ref: tuple[str, str, str], users: set[str]) -> None:
        log.info("%s %s/%s changed; re-syncing %d pod(s)", *ref, len(users))
        for key in users:
            self.sync_queue.add(key)

    def _on_provider_pod(self, pod: Pod) -> None:
        """Push notification from the provider: remember the latest status and schedule a write.

        Registered when the controller is made, so a report may come before the API's pods
        are listed or the pod adopted: it is kept in the pod's state until then.
        """
        meta = pod.metadata
        if pod.status is not None and meta is not None:
            key = f"{meta.namespace}/{meta.name}"
            # A provider that does not say which pod it means is talking about the one it runs.
            self._take_report(key, meta.uid or "", pod.status)

    def _take_report(self, key: str, uid: str, status: PodStatus) -> None:
        if self._state(key).reported(uid, _with_ips(msgspec.to_builtins(status))):
            self.status_queue.add(key)

    # -- run --------------------------------------------------------------------------------------
    async def run(self, *, after: asyncio.Event | None = None) -> None:
        """`after`: set once the provider may be touched (the node registered); the API's pods
        are listed meanwhile."""
        started = asyncio.get_running_loop().time()
        async with asyncio.TaskGroup() as group:
            group.create_task(self.reflector.run(), name=f"{self.node_name} reflector")
            await self.reflector.synced.wait()
            if after is not None:
                await after.wait()
            await self._reconcile_provider()
            if not isinstance(self._provider, PodNotifier):
                name = f"{self.node_name} status poll"
                group.create_task(run_supervised(self._poll_status, name=name), name=name)
            group.create_task(self.sync_queue.run())
            group.create_task(self.status_queue.run())
            self.ready.set()
            await self._in_sync(started)

    async def _in_sync(self, started: float) -> None:
        """Log once when the pods found at start have all been synced (how long a restart
        takes to reconcile; bench/resilience.py reads it)."""
        loop = asyncio.get_running_loop()
        while len(self.sync_queue) or self.sync_queue.retrying:
            if loop.time() - started > IN_SYNC_LOG_LIMIT:
                return  # some pod keeps failing: its retries are logged
            await asyncio.sleep(0.05)
        log.info(
            "node %s: in sync with the API %.2f s after its pod controller started (%d pods)",
            self.node_name,
            loop.time() - started,
            len(self.reflector.items),
        )

    async def _reconcile_provider(self) -> None:
        """Adopt the provider's pods that the API still has; remove those provably orphaned."""
        # Reports pushed while list_pods runs may be newer than its answer; earlier ones are not.
        before = {key: state.report for key, state in self.states.items()}
        running = await self._provider.list_pods()
        adopted = 0
        for pod in running:
            meta = pod.metadata
            if meta is None:
                continue
            key = f"{meta.namespace}/{meta.name}"
            record = self.reflector.items.get(key)
            if record is not None and record.uid == meta.uid:
                state = self._state(key)
                state.adopted(record.uid)
                annotations = meta.annotations or {}
                self._listed_applied[key] = (record.uid, annotations.get(APPLIED_ANNOTATION))
                adopted += 1
                pushed = state.report is not None and state.report is not before.get(key)
                if pod.status is not None and not pushed:
                    self._take_report(key, record.uid, pod.status)
                elif pushed:
                    self.status_queue.add(key)
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
        log.info("node %s: adopted %d running pod(s)", self.node_name, adopted)

    async def _poll_status(self) -> None:
        """For providers without push notifications: ask for every live pod's status.

        Each call holds the pod's provider lock, so it never overlaps a create, update or delete
        of the same pod; a pod whose sync is under way is skipped until the next round. Failures
        are logged (at most once a minute, with how many pods failed) and never end the poll.
        """
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._status_poll_interval)
            failed: list[tuple[str, Exception]] = []
            for key, record in list(self.reflector.items.items()):
                if self._running_uid(key) != record.uid or record.terminal or self._calls.busy(key):
                    continue
                async with self._calls.hold(key):
                    try:
                        status = await self._provider.get_pod_status(record.namespace, record.name)
                    except Exception as e:
                        failed.append((key, e))
                        continue
                if status is not None and self._running_uid(key) == record.uid:
                    self._take_report(key, record.uid, status)
            if failed:
                now = loop.time()
                quiet = now - self._poll_errors_logged < POLL_ERROR_LOG_INTERVAL
                if not quiet:
                    self._poll_errors_logged = now
                key, error = failed[0]
                log.log(
                    logging.DEBUG if quiet else logging.WARNING,
                    "node %s: get_pod_status failed for %d pod(s), e.g. %s: %s: %s",
                    self.node_name,
                    len(failed),
                    key,
                    type(error).__name__,
                    error,
                )

    # -- API -> provider --------------------------------------------------------------------------
    async def _sync(self, key: str) -> None:
        async with self._calls.hold(key):
            await self._sync_pod(key)

    async def _sync_pod(self, key: str) -> None:
        record = self.reflector.items.get(key)
        if record is None:
            await self._forget(key)
            return
        state = self._state(key)
        known_uid = state.uid
        if known_uid is not None and known_uid != record.uid:
            # Same name, new pod: the old one must stop before the new one starts. After a relist
            # the API's old pod may never have been seen deleted: ask the provider for its own.
            gone = state.gone
            old = gone.pod() if gone is not None and gone.uid == known_uid else None
            if old is None:
                old = await self._provider.get_pod(record.namespace, record.name)
            if old is not None and old.metadata is not None and old.metadata.uid == known_uid:
                await self._provider_delete(key, old, known_uid, 0)
            state.replaced()
        if record.deleting:
            await self._sync_deletion(key, record, state)
            return
        if record.terminal:
            self.objects.release(key)  # its ConfigMap/Secret watches close once no pod uses them
            await self._resolver.forget(key)  # nor its tokens, nor IPs it never used
            return
        pod = record.pod()
        if await self._deadline_exceeded(key, record, pod, state):
            return
        try:
            resolved = await self._resolver.resolve(key, pod)
        except ResolutionFailed as e:
            for reason, message in e.events or [(e.reason, e.message)]:
                self._event(record, WARNING, reason, message)
            if state.uid is not None:
                # Already running: its containers keep the environment and files they have (as
                # with the kubelet) until the pod resolves again. A missing object's watch
                # re-syncs the pod when it is back, but a transient failure (Services not yet
                # read after a restart, a token request during an outage) has no watch to do it:
                # retried, or an update made meanwhile (seen first by a restarted agent as an
                # adopted pod's stale digest) would never reach the provider.
                if e.permanent:
                    return
                raise
            # Like the kubelet: a volume that cannot be set up leaves the container "being
            # created" (the FailedMount event says why); bad env config is its own reason.
            waiting = "ContainerCreating" if e.reason == "FailedMount" else e.reason
            await self._write_waiting(record, pod, state, waiting, e.message)
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
        if state.uid is None:
            existing = await self._provider.get_pod(record.namespace, record.name)
            if existing is None or existing.metadata is None or existing.metadata.uid != record.uid:
                await self._create(key, record, resolved, applied, state)
                return
            state.adopted(record.uid)  # never re-create
        stale = state.applied != applied
        if stale and not await self._apply(key, record, resolved.pod, applied, state, existing):
            return
        await self._sync_ephemeral(record, resolved.pod, state, resolved.ephemeral_failures)

    async def _apply(
        self,
        key: str,
        record: PodRecord,
        resolved: ResolvedPod,
        applied: bytes,
        state: PodState,
        existing: Pod | None,
    ) -> bool:
        """Give the running pod's new spec to the provider (or, for a pod adopted after a
        restart, only tell it of the pod); False if it refused for good."""
        if state.applied is None:
            # Adopted after a restart: update only if the provider's copy says it was given
            # something else; a provider that keeps no annotations is not disturbed.
            given = await self._given(key, record, existing)
            if given in (None, applied.hex()):
                if self._adopts is not None:
                    adopt = self._adopts.adopt_pod(resolved)
                    if not await self._told(record, adopt, "ProviderAdoptFailed"):
                        return False
                state.applied_now(applied)
                return True
        update = self._provider.update_pod(resolved)
        if not await self._told(record, update, "ProviderUpdateFailed"):
            return False
        state.applied_now(applied)
        self.updates += 1
        self._event(record, NORMAL, "Updated", "provider updated the pod")
        return True

    async def _sync_ephemeral(
        self,
        record: PodRecord,
        resolved: ResolvedPod,
        state: PodState,
        unresolved: Mapping[str, ResolutionFailed],
    ) -> None:
        """Hand each ephemeral container added to the running pod (`kubectl debug`) to the
        provider, once. One it cannot run is reported waiting with the reason, not left
        silent: `kubectl debug` would wait for it forever. One whose env cannot be resolved
        (`unresolved`) waits with CreateContainerConfigError, as with the kubelet, until it
        can be: the watch of what it references re-syncs the pod."""
        spec = resolved.pod.spec
        added = [c.name for c in (spec.ephemeralContainers if spec else None) or ()]
        added = [
            name
            for name in added
            if name not in state.ephemeral or _unresolved(state.ephemeral[name])
        ]
        changed = False
        for name, error in unresolved.items():
            said = {"reason": error.reason, "message": error.message}
            if state.ephemeral.get(name) != said:
                for reason, message in error.events or [(error.reason, error.message)]:
                    self._event(record, WARNING, reason, message)
                state.ephemeral_handed(name, said)
                changed = True
        retry = next((e for e in unresolved.values() if not e.permanent), None)
        if not added and not changed:
            if retry is not None:
                raise retry
            return
        for name in added:
            if self._ephemeral is None:
                message = f"the provider of node {self.node_name} cannot run ephemeral containers"
                waiting = {"reason": "EphemeralContainersNotSupported", "message": message}
                self._event(record, WARNING, "EphemeralContainersNotSupported", message)
            else:
                try:
                    await self._ephemeral.start_ephemeral_container(resolved, name)
                except ProviderError as e:
                    self._event(record, WARNING, "FailedToStartEphemeralContainer", e.message)
                    if not e.permanent:
                        raise
                    waiting = {"reason": e.reason, "message": e.message}
                else:
                    waiting = None
            state.ephemeral_handed(name, waiting)
        if any(state.ephemeral.values()):
            await self._write_ephemeral_waiting(record, state)
        if retry is not None:
            raise retry  # a read that failed: tried again later

    async def _told(self, record: PodRecord, call: Awaitable[None], failed: str) -> bool:
        """Whether the provider took `call`; its ProviderError is a Warning event `failed`,
        then False if permanent (no retry helps), else raised for a retry."""
        try:
            await call
        except ProviderError as e:
            self._event(record, WARNING, failed, e.message)
            if e.permanent:
                return False
            raise
        return True

    async def _given(self, key: str, record: PodRecord, existing: Pod | None) -> str | None:
        """The applied digest on the provider's copy of an adopted pod: as `list_pods` showed it
        at start (nothing but this controller changes the provider's pod meanwhile), else from
        `existing` or the provider."""
        listed = self._listed_applied.pop(key, None)
        if listed is not None and listed[0] == record.uid and existing is None:
            return listed[1]
        if existing is None:
            existing = await self._provider.get_pod(record.namespace, record.name)
        annotations = existing.metadata.annotations if existing and existing.metadata else None
        return (annotations or {}).get(APPLIED_ANNOTATION)

    async def _deadline_exceeded(
        self, key: str, record: PodRecord, pod: Pod, state: PodState
    ) -> bool:
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
        if state.uid == record.uid and not state.deleting:
            await self._provider_delete(key, pod, record.uid, 0)
        await self._write_failed(record, "DeadlineExceeded", message)
        self._event(record, WARNING, "DeadlineExceeded", message)
        return True

    async def _create(
        self, key: str, record: PodRecord, resolved: Resolution, applied: bytes, state: PodState
    ) -> None:
        try:
            await self._provider.create_pod(resolved.pod)
        except ProviderError as e:
            self._event(record, WARNING, e.reason or "ProviderCreateFailed", e.message)
            if e.permanent:
                await self._write_failed(record, e.reason or "ProviderFailed", e.message)
                state.adopted(record.uid)  # refused for good: never created again
                return
            if e.reason in _CONTAINER_WAITING:  # as a kubelet shows it while it retries
                await self._write_waiting(record, resolved.pod.pod, state, e.reason, e.message)
            raise
        except Exception as e:
            self._event(record, WARNING, "ProviderCreateFailed", f"{type(e).__name__}: {e}")
            raise
        state.created(record.uid, applied)
        self.creates += 1
        self._event(record, NORMAL, "Created", "pod started by the provider")
        if state.report_for(record.uid) is not None:
            self.status_queue.add(key)  # reported before create_pod returned

    async def _sync_deletion(self, key: str, record: PodRecord, state: PodState) -> None:
        if state.uid != record.uid:
            # The provider never ran it (or already forgot it): nothing to wait for.
            await self._remove_from_api(record)
            return
        if not state.deleting:
            grace = 30 if record.deletion_grace is None else int(record.deletion_grace)
            await self._provider_delete(key, record.pod(), record.uid, grace)
            self._event(record, NORMAL, "Killing", "stopping the pod's containers")
            # If the provider never reports the stop, look for ourselves after the grace period.
            self.sync_queue.add_after(key, grace + 1)
        else:
            running = await self._provider.get_pod(record.namespace, record.name)
            if running is None or running.metadata is None or running.metadata.uid != record.uid:
                state.provider_stopped(record.uid)
        self.status_queue.add(key)

    async def _provider_delete(self, key: str, pod: Pod, uid: str, grace: int) -> None:
        try:
            await self._provider.delete_pod(pod, grace)
        except ProviderError as e:
            log.warning("pod %s: the provider could not delete it: %s", key, e.message)
            if not e.permanent:
                raise
        self._state(key).deletion_requested(uid)  # only now: a failed call is retried
        self.deletes += 1

    async def _forget(self, key: str) -> None:
        """The API object is gone: make sure the provider stops the pod, then drop our state."""
        state = self.states.get(key)
        if state is not None:
            uid, last = state.uid, state.gone
            if uid is not None and last is not None and not state.stopped_pod():
                existing = await self._provider.get_pod(last.namespace, last.name)
                if existing is not None and existing.metadata and existing.metadata.uid == uid:
                    await self._provider_delete(key, last.pod(), uid, 0)
            self.states.pop(key, None)
        self._listed_applied.pop(key, None)
        self.objects.release(key)
        await self._resolver.forget(key)
        self.sync_queue.forget(key)
        self.status_queue.forget(key)

    # -- provider -> API --------------------------------------------------------------------------
    async def _sync_status(self, key: str) -> None:
        record = self.reflector.items.get(key)
        state = self.states.get(key)
        if state is None:
            return
        if record is None:
            if state.uid is None and state.gone is None:
                # A report about a pod the API does not have (any more): nobody will read it.
                self.states.pop(key, None)
            return
        if state.uid != record.uid:
            return  # not running yet (the report waits for create_pod), or an older pod's report
        terminated = state.stopped
        if record.deleting and terminated and not record.finalizers:
            # The object is about to disappear: its final status would be one more write that
            # nobody can read, so go straight to removing it.
            await self._remove_from_api(record)
            return
        reported = state.report_for(record.uid)
        refused = any(state.ephemeral.values())
        if reported is not None and refused and "ephemeralContainerStatuses" in reported:
            # A report replaces the whole list: keep the agent's word on those refused.
            listed = reported["ephemeralContainerStatuses"]
            reported["ephemeralContainerStatuses"] = _ephemeral_amended(record, state, listed)
        if reported is not None:
            wanted = visible_status(reported)
            if (
                not record.terminal
                and record.status_digest != wanted
                and state.written != (wanted, record.status_digest)
            ):
                if state.written is None and _shows_already(record, reported):
                    # An adopted pod's first report, as the API has it from before the restart:
                    # no write (the digests differ only by what the report leaves alone).
                    state.written_status(wanted, record.status_digest)
                else:
                    stored = await self._patch_status(record, reported)
                    if stored is not None:  # only what the API accepted counts as written
                        state.written_status(wanted, visible_status(stored))
                        if reported.get("phase") == "Running" and record.phase != "Running":
                            self._event(
                                record, NORMAL, "Started", "the pod's containers are running"
                            )
            state.report_done(reported)
        if record.deleting and terminated:
            await self._remove_from_api(record)

    async def _patch_status(
        self, record: PodRecord, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The status as the API stored it, or None if the pod is gone or was replaced.

        Only the status of the answer is decoded: the rest of the pod (its managedFields
        above all) is most of the answer, and this is the agent's most frequent request."""
        patch = {
            "metadata": {"uid": record.uid},
            "status": _replacing_ip_lists(_clearing_stale_reasons(status)),
        }
        try:
            answer = await self._client.request_raw(
                "PATCH",
                f"/api/v1/namespaces/{record.namespace}/pods/{record.name}/status",
                body=patch,
                content_type=STRATEGIC_MERGE_PATCH,
            )
        except ApiError as e:
            if e.not_found or e.conflict:
                return None  # deleted or replaced meanwhile; the watch will tell us
            raise
        return _decode_status(answer).status or {}

    async def _remove_from_api(self, record: PodRecord) -> None:
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": record.uid}}
        try:
            await self._client.delete(
                f"/api/v1/namespaces/{record.namespace}/pods/{record.name}", body
            )
        except ApiError as e:
            if not (e.not_found or e.conflict):
                raise

    async def _write_waiting(
        self, record: PodRecord, pod: Pod, state: PodState, reason: str, message: str
    ) -> None:
        if state.waiting == (record.uid, reason, message):
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
        try:
            answer = await self._patch_status(record, status)
        except (ApiError, Unreachable) as e:
            log.info("pod %s: waiting status not written: %s", record.key, e)
            return
        if answer is not None:
            state.waiting_written(record.uid, reason, message)

    async def _write_ephemeral_waiting(self, record: PodRecord, state: PodState) -> None:
        """Report the ephemeral containers the provider cannot run as waiting, with why. The
        list is replaced as a whole by a patch: the others keep what the API shows of them."""
        current = _decode_status(record.raw).status or {}
        statuses = _ephemeral_amended(record, state, current.get("ephemeralContainerStatuses"))
        try:
            await self._patch_status(record, {"ephemeralContainerStatuses": statuses})
        except (ApiError, Unreachable) as e:
            log.info("pod %s: ephemeral container status not written: %s", record.key, e)
            raise

    async def _write_failed(self, record: PodRecord, reason: str, message: str) -> None:
        await self._patch_status(record, {"phase": "Failed", "reason": reason, "message": message})

    def _event(self, record: PodRecord, type: str, reason: str, message: str) -> None:
        ref = ObjectRef("Pod", record.namespace, record.name, record.uid)
        self._recorder.emit(ref, type, reason, message)


def _unresolved(waiting: dict[str, str] | None) -> bool:
    """Whether an ephemeral container waits for its env to resolve (it may resolve now)."""
    return waiting is not None and waiting.get("reason") == "CreateContainerConfigError"


def _ephemeral_amended(
    record: PodRecord, state: PodState, statuses: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`statuses` (a provider's report, or the API's) with the waiting state the agent reports
    for each ephemeral container the provider cannot run."""
    images = {c.name: c.image or "" for c in (record.pod().spec.ephemeralContainers or ())}  # type: ignore[union-attr]
    by_name = {s.get("name"): s for s in statuses or []}
    for name, waiting in state.ephemeral.items():
        if waiting is not None and name in images:
            by_name[name] = {
                "name": name,
                "image": images[name],
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": waiting},
            }
    return list(by_name.values())


def _clearing_stale_reasons(status: dict[str, Any]) -> dict[str, Any]:
    """A strategic merge patch merges conditions by type: a condition that turned True without
    a reason would keep the reason and message it had while False ("Ready: True,
    ContainersNotReady"). The kubelet sends the deletions explicitly; so do we."""
    conditions = status.get("conditions")
    if not conditions:
        return status
    cleared = [{"reason": None, "message": None, **c} for c in conditions]
    return {**status, "conditions": cleared}


def _replacing_ip_lists(status: dict[str, Any]) -> dict[str, Any]:
    """A strategic merge patch merges `podIPs` and `hostIPs` by address: a node whose address
    changed (a replica that took over on another machine) would add its new address beside the
    old one, which the API refuses (one IP per family), and the pod's status could never be
    written again. The kubelet sends a deletion for each old address; a replace directive in
    the list says the same without reading the current status."""
    for field in ("podIPs", "hostIPs"):
        if status.get(field):
            status = {**status, field: [*status[field], {"$patch": "replace"}]}
    return status


class _StatusOnly(msgspec.Struct):
    status: dict[str, Any] | None = None


_decode_status = msgspec.json.Decoder(_StatusOnly).decode


def _shows_already(record: PodRecord, report: dict[str, Any]) -> bool:
    """Whether the API's status already shows everything `report` would write: a strategic
    merge patch leaves alone what a report does not state (the PodScheduled condition, say),
    so an unchanged pod's report digests differently from the API's status and only this
    finer look tells. Asked only before the first write for a pod (an adopted one, mostly) and
    when the phases agree (a new pod's first report never does), so its decode is rare."""
    if record.phase != report.get("phase"):
        return False
    current = _decode_status(record.raw).status or {}
    return visible_status(merged_status(current, report)) == record.status_digest


def _with_ips(status: dict[str, Any]) -> dict[str, Any]:
    """A report with `podIP` and `podIPs` (and `hostIP`/`hostIPs`) consistent, as the API wants
    them: a provider that learns the pod's address after `create_pod` may report either."""
    for single, plural in (("podIP", "podIPs"), ("hostIP", "hostIPs")):
        one, many = status.get(single), status.get(plural)
        if one and not many:
            status[plural] = [{"ip": one}]
        elif many and not one:
            first = many[0].get("ip") if isinstance(many[0], dict) else None
            if first:
                status[single] = first
    return status


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
    spec = pod.pod.spec
    if spec is not None and spec.ephemeralContainers:
        # Handed over by `start_ephemeral_container`, never as an update.
        spec = msgspec.structs.replace(spec, ephemeralContainers=None)
    parts: tuple[Any, ...] = (spec, labels, annotations, pod.volumes)
    if pod.references:  # only then: digests of pods adopted from an older agent stay the same
        parts += ([(ref, content(ref[0], pod.references[ref])) for ref in sorted(pod.references)],)
    return digest(parts)
