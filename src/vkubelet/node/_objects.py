"""The API objects this node's pods reference, kept current, one watch (or poll) each.

The reference implementation watches every ConfigMap and Secret in the cluster (memory grows with
the cluster, and a node identity under the Node authorizer may not even list them). Like the real
kubelet, we watch exactly the objects our pods use — `fieldSelector=metadata.name=<name>`, which
the Node authorizer permits for objects referenced by pods bound to the node — and tell the pod
controller which pods to re-sync when one changes. Each watch is a `Reflector` over that
one-name selector (relists on 410, back-off, resume from bookmarks, as every other watch).

ServiceAccounts and PersistentVolumeClaims (which pass-through providers need) the Node
authorizer lets a node only `get`, by name: those are polled instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..kube import ApiError, Handler, KubeClient, Reflector, Unreachable

Ref = tuple[str, str, str]  # (kind, namespace, name); kind is one of _PLURAL's keys

_PLURAL = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "ServiceAccount": "serviceaccounts",
    "PersistentVolumeClaim": "persistentvolumeclaims",
}
_WATCHABLE = frozenset({"ConfigMap", "Secret"})
# How often an object that cannot be watched is read again.
POLL_INTERVAL = 30.0


class ReadFailed(Exception):
    """The object could not be read (forbidden, apiserver down) — distinct from 'not found'."""


@dataclass
class _Entry:
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    obj: dict[str, Any] | None = None
    error: str | None = None
    users: set[str] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


class ObjectCache:
    def __init__(self, client: KubeClient, on_change: Callable[[Ref, set[str]], None]) -> None:
        self._client = client
        self._poll_interval = POLL_INTERVAL
        self._on_change = on_change
        self._entries: dict[Ref, _Entry] = {}
        self._by_user: dict[str, set[Ref]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def use(self, user: str, refs: set[Ref], *, wait: float = 10.0) -> None:
        """Make `user` (a pod key) depend on exactly `refs`, and wait until they are loaded."""
        previous = self._by_user.get(user, set())
        for ref in previous - refs:
            self._release(user, ref)
        if not refs:
            self._by_user.pop(user, None)  # most pods reference nothing: keep no entry for them
            return
        self._by_user[user] = set(refs)
        entries = []
        for ref in refs:
            entry = self._entries.get(ref)
            if entry is None:
                entry = self._entries[ref] = _Entry()
                follow = self._watch if ref[0] in _WATCHABLE else self._poll
                entry.task = asyncio.create_task(follow(ref, entry), name=f"watch {ref}")
            entry.users.add(user)
            entries.append(entry)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                for entry in entries:
                    await entry.loaded.wait()

    def release(self, user: str) -> None:
        """`user` needs none of its objects any more (it was deleted or has terminated); an
        object's watch stops when its last user releases it."""
        for ref in self._by_user.pop(user, set()):
            self._release(user, ref)

    def _release(self, user: str, ref: Ref) -> None:
        entry = self._entries.get(ref)
        if entry is None:
            return
        entry.users.discard(user)
        if not entry.users:
            del self._entries[ref]
            if entry.task:
                entry.task.cancel()

    def get(self, ref: Ref) -> dict[str, Any] | None:
        """The object, None if it does not exist; ReadFailed if we could not tell."""
        entry = self._entries.get(ref)
        if entry is None or not entry.loaded.is_set():
            raise ReadFailed(f"{ref[0]} {ref[1]}/{ref[2]} has not been read yet")
        if entry.error is not None:
            raise ReadFailed(entry.error)
        return entry.obj

    async def aclose(self) -> None:
        tasks = [e.task for e in self._entries.values() if e.task]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._entries.clear()

    async def _watch(self, ref: Ref, entry: _Entry) -> None:
        kind, namespace, name = ref

        def store(*_: object) -> None:
            # At most one object has the name (keyed by UID, a re-created one is a second for a
            # moment): what the pods see is whichever the store holds now, or none.
            self._store(ref, entry, next(iter(reflector.items.values()), None))

        def listed() -> None:
            # A listing that changed nothing still answers the first read, or one that failed.
            if not entry.loaded.is_set() or entry.error is not None:
                store()

        handler: Handler[dict[str, Any]] = Handler(
            store, store, store, on_listed=listed, on_error=lambda e: self._failed(ref, entry, e)
        )
        reflector = Reflector(
            self._client,
            f"/api/v1/namespaces/{namespace}/{_PLURAL[kind]}",
            dict,
            handler,
            params={"fieldSelector": f"metadata.name={name}"},
            name=f"{kind} {namespace}/{name}",
        )
        await reflector.run()

    async def _poll(self, ref: Ref, entry: _Entry) -> None:
        kind, namespace, name = ref
        path = f"/api/v1/namespaces/{namespace}/{_PLURAL[kind]}/{name}"
        while True:
            try:
                raw = await self._client.request_raw("GET", path)
                self._store(ref, entry, msgspec.json.decode(raw))
            except ApiError as e:
                if e.not_found:
                    self._store(ref, entry, None)
                else:
                    self._failed(ref, entry, e)
            except Unreachable as e:
                self._failed(ref, entry, e)
            await asyncio.sleep(self._poll_interval)

    def _failed(self, ref: Ref, entry: _Entry, error: ApiError | Unreachable) -> None:
        # The first read, and a refusal at any time, fail the pods' reads; a passing outage
        # keeps the last object seen.
        refused = isinstance(error, ApiError) and error.status in (401, 403)
        if not entry.loaded.is_set() or refused:
            entry.error = f"{ref[0]} {ref[1]}/{ref[2]}: {error}"
            entry.loaded.set()

    def _store(self, ref: Ref, entry: _Entry, obj: dict[str, Any] | None) -> None:
        first = not entry.loaded.is_set()
        # Readable again after an error: the pods that failed to read it must hear of it now,
        # not at their next back-off retry (which may be minutes away).
        recovered = entry.error is not None
        changed = (
            recovered
            or entry.obj is None
            or obj is None
            or content(ref[0], entry.obj) != content(ref[0], obj)
        )
        entry.obj = obj
        entry.error = None
        entry.loaded.set()
        if changed and not first:
            self._on_change(ref, set(entry.users))


def content(kind: str, obj: Mapping[str, Any] | None) -> Any:
    """What a pod can depend on in `obj`: a change here is a change to tell its pods about.

    ConfigMaps and Secrets: their data. Other kinds: everything but the metadata that changes
    with every write (resourceVersion, managedFields...), so a PVC's binding is seen.
    """
    if obj is None:
        return None
    if kind in _WATCHABLE:
        return obj.get("data"), obj.get("binaryData")
    meta = obj.get("metadata") or {}
    kept = {k: v for k, v in obj.items() if k != "metadata"}
    return kept, meta.get("labels"), meta.get("annotations"), meta.get("uid")
