"""The lower copies of the ConfigMaps, Secrets, ServiceAccounts and claims our pods need, kept
matching what the running pods need (`_deps` plans, this applies and remembers)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ...kube import ApiError
from ...sdk.provider import ProviderError, ResolvedPod, UpperAPI
from ...sdk.tasks import TaskSet
from ._config import LowerConfig
from ._convert import JSON, newest, to_json
from ._deps import KINDS, SOURCE_VERSION, Key, plan_dependencies
from ._lower import LowerCluster
from ._refs import Reference
from ._stamps import is_ours, upper_identity
from ._translate import PodTranslation, needed_references

__all__ = ["DependencySync", "Prepared"]

log = logging.getLogger(__name__)

# A pod as handed over, the translation settings, its JSON and the references it needs below.
Prepared = tuple[ResolvedPod, PodTranslation, JSON, set[Reference]]


class DependencySync:
    """Our lower dependency copies. It reads the provider's pods (`running()`, and `given`:
    upper "namespace/name" -> pod) and tells it nothing but a pod's blockers; `pods_changed`
    lets the Service reflection know the set of running pods moved."""

    def __init__(
        self,
        config: LowerConfig,
        lower: LowerCluster,
        how: Callable[[], PodTranslation],
        running: Callable[[], list[ResolvedPod]],
        given: Mapping[str, ResolvedPod],
        still_adopting: Callable[[], bool],
        pods_changed: Callable[[], None],
        spawned: TaskSet,
    ) -> None:
        self.config, self.lower, self._how, self._running = config, lower, how, running
        self._given, self._still_adopting, self._pods_changed = given, still_adopting, pods_changed
        self._spawned = spawned
        self.upper: UpperAPI | None = None  # to tell released claims from kept ones
        self._lock = asyncio.Lock()
        self.copies: dict[Key, JSON] | None = None  # our lower dependency copies
        self._prepared: dict[str, Prepared] = {}  # see prepared
        self._releasing: asyncio.Task[None] | None = None  # see release_soon
        self._release_wanted = False

    def prepared(self, pod: ResolvedPod) -> Prepared:
        """The pod as JSON and the references its lower pod needs, worked out once per pod the
        agent hands over (and translation settings), not on every plan."""
        how = self._how()
        known = self._prepared.get(f"{pod.namespace}/{pod.name}")
        if known is not None and known[0] is pod and known[1] is how:
            return known
        upper = to_json(pod.pod)
        return (pod, how, upper, needed_references(upper, how))

    async def for_pod(self, pod: ResolvedPod) -> None:
        """Before a pod starts, the lower copies it needs. When our copies already hold every
        object it needs at least at the version it was given (always so for a pod that needs
        nothing but its namespace), a plan would write nothing for it: only the namespace is
        made sure of. A plan covers every running pod, so planning on each start made a burst
        quadratic (17 % of the agent's CPU in a 1,000-pod burst)."""
        key = f"{pod.namespace}/{pod.name}"
        prepared = self._prepared[key] = self.prepared(pod)
        namespace = self._how().lower_namespace(pod.namespace)
        async with self._lock:  # a plan under way may be deleting a copy it needs
            covered = self._copies_cover(pod, prepared[3])
            if covered:
                self._pods_changed()  # the pods changed: so may the Services below
                try:
                    await self.lower.ensure_namespace(namespace, self._how().owner)
                except ApiError as e:
                    message = f"namespace {namespace}: {e.message or e.reason}"
                    raise ProviderError("LowerDependencyFailed", message, permanent=False) from None
        if not covered:
            await self.sync(block_for=key)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync.dependencies)
            await self.sync(relist=True)

    async def _release_claims(self, unused: list[Key], uids: Mapping[Key, str]) -> None:
        """Lower claims no pod uses are deleted once their upper claim is gone (or re-created:
        another UID), never while it exists: a StatefulSet pod between two lives keeps its
        data. An upper claim this agent may not read (the Node authorizer lets a node read
        only its pods' claims) is kept: not knowing is not gone."""
        if self.upper is None or self.copies is None:
            return
        for key in unused:
            identity = upper_identity(self.copies.get(key) or {})
            if identity is None:
                continue
            namespace, name, uid = identity
            path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}"
            try:
                upper = await self.upper.get(path)
            except ApiError as e:
                if not e.not_found:
                    continue
                upper = {}
            if (upper.get("metadata") or {}).get("uid") == uid:
                continue
            kind, lower_namespace, lower_name = key
            await self.lower.call(
                self.lower.delete(kind, lower_namespace, lower_name, uid=uids.get(key))
            )
            self.copies.pop(key, None)
            log.info("lower claim %s/%s released: its upper claim is gone", *key[1:])

    def _copies_cover(self, pod: ResolvedPod, needed: set[Reference]) -> bool:
        """Whether our known lower copies hold everything `pod` needs, each ours and copied
        from the upper object at the version the pod was given or later."""
        if self.copies is None:
            return False
        lower_namespace = self._how().lower_namespace(pod.namespace)
        for ref in needed:
            if ref.kind == "ServiceAccount" and ref.name == "default":
                continue  # the lower namespace's own account
            source = pod.references.get((ref.kind, pod.namespace, ref.name))
            copy = self.copies.get(
                (ref.kind, lower_namespace, self._how().lower_name(ref.kind, ref.name))
            )
            if source is None or copy is None or not is_ours(copy, self._how().owner):
                return False
            copied = ((copy.get("metadata") or {}).get("annotations") or {}).get(SOURCE_VERSION)
            given = (source.get("metadata") or {}).get("resourceVersion")
            try:
                if int(str(copied)) < int(str(given)):
                    return False  # the pod was given a later version: the copy is updated
            except ValueError:
                return False
        return True

    def release_soon(self) -> None:
        """Drop the copies no pod needs any more, once for a run of deletions: a plan covers
        every running pod, so one per deleted pod made removing a burst quadratic."""
        self._release_wanted = True
        if self._releasing is None or self._releasing.done():
            self._releasing = self._spawned.spawn(self._release(), name="release copies")

    async def _release(self) -> None:
        while self._release_wanted:
            self._release_wanted = False
            await self.sync()

    async def sync(self, block_for: str | None = None, *, relist: bool = False) -> None:
        """Make the lower copies match what the pods need; raise for `block_for`'s blockers.

        The copies we own are listed (by owner label) once and on every periodic resync, and
        otherwise known from our own writes, so starting a pod costs no list requests.
        """
        self._pods_changed()  # the pods changed: so may the Services they need below
        async with self._lock:
            running = self._running()
            references: dict[Key, Mapping[str, Any] | None] = {}
            for pod in running:
                for key, obj in pod.references.items():
                    references[key] = newest(references.get(key), obj)
            prepared = {f"{p.namespace}/{p.name}": self.prepared(p) for p in running}
            self._prepared = prepared  # drops the pods no longer running
            if self.copies is None or relist:
                copies: dict[Key, JSON] = {}
                for kind in KINDS:
                    for obj in await self.lower.call(
                        self.lower.list_objects(kind, selector=self._how().owner.selector)
                    ):
                        meta = obj["metadata"]
                        copies[(kind, meta["namespace"], meta["name"])] = obj
                self.copies = copies
            plan = plan_dependencies(
                [upper for _, _, upper, _ in prepared.values()],
                references,
                self.copies,
                self._how(),
                pvc_storage_class=self.config.pvc_storage_class,
                needed={k: refs for k, (_, _, _, refs) in prepared.items()},
            )
            if self._still_adopting():
                plan.delete.clear()
                plan.release.clear()
            applied = await self.lower.apply_dependencies(plan, self._how().owner)
            for key, obj in applied.written.items():
                if obj is None:
                    self.copies.pop(key, None)
                else:
                    self.copies[key] = obj
            if relist:  # an upper read per unused claim: at the periodic resync only
                await self._release_claims(plan.release, plan.uids)
        if block_for is None:
            return
        why = plan.blocked.get(block_for)
        if why is not None:
            permanent = "not found" not in why
            reason = "LowerDependencyConflict" if permanent else "DependencyMissing"
            raise ProviderError(reason, why, permanent=permanent)
        given = self._given.get(block_for)
        if given is not None and applied.conflicts:
            how, refs = self._how(), self.prepared(given)[3]
            namespace = how.lower_namespace(given.namespace)
            needed = {(r.kind, namespace, how.lower_name(r.kind, r.name)) for r in refs}
            for key, message in applied.conflicts.items():
                if key in needed:
                    raise ProviderError("LowerDependencyConflict", message)
        if applied.problems:
            raise ProviderError(
                "LowerDependencyFailed", "; ".join(applied.problems), permanent=False
            )
