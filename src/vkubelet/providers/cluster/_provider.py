"""The cluster provider: the parts (`_translate`, `_deps`, `_status`, `_capacity`) wired to the
agent's provider protocols over one lower-cluster client. This module holds the pod lifecycle,
the one reflector of the lower pods and the node protocol; every other concern is a part that
owns its state: `_capacityloop` (capacity and labels), `_depsync` (dependency copies),
`_servicesync` (Services below), `_tokenkeeper` (upper tokens), `_eventmirror` (lower Events)
and `_verbs` (kubectl verbs).

It must be a pass-through provider (`PassThroughPods`): an agent that resolved env first would
give it pods with Secret values written into `env`, to be copied into the lower pod spec.

State is kept in the lower cluster, not in this process: the lower pods carry owner stamps, so a
restarted agent finds them by label (`list_pods`) and adopts them; nothing is re-created.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgspec
from lightkube.models.core_v1 import PodStatus, Taint
from lightkube.resources.core_v1 import Node, Pod

from ...kube import PODS, STRATEGIC_MERGE_PATCH, ApiError, Handler, Reflector, Unreachable
from ...sdk.provider import (
    NodeCondition,
    ProviderContext,
    ProviderError,
    ResolvedPod,
    UpperAPI,
)
from ...sdk.tasks import TaskSet, run_supervised
from ._admission import ConstraintWebhook
from ._capacityloop import CANNOT_FIT_TAINT, LARGEST_FREE_ANNOTATION, CapacityFollowing
from ._config import LowerConfig
from ._convert import (
    JSON,
    newer,
    now_rfc3339,
    requests_and_limits,
    to_json,
    uid_of,
    upper_view,
)
from ._depsync import DependencySync
from ._eventmirror import EventMirror
from ._lower import LowerCluster, MissingPermissions
from ._servicesync import ServiceReflection, SharedServices
from ._stamps import Claim, Owner, claim, describe_owner, is_ours, upper_identity
from ._status import gone_status, status_up, vanished_reason
from ._tokenkeeper import UpperTokens
from ._translate import PodTranslation, ephemeral_containers, translate_pod
from ._verbs import LowerVerbs

__all__ = ["RUN_DAEMON_SET_ANNOTATION", "ClusterProvider"]

RUN_DAEMON_SET_ANNOTATION = "vkubelet.io/run-on-virtual-node"
# How long a new lower pod's plain Pending status is held back at most (see `_hold_pending`).
PENDING_HOLD = 5.0
# Waiting reasons of a container the lower kubelet is still creating: they tell nothing yet.
_BEING_CREATED = ("ContainerCreating", "PodInitializing")
# How long plans wait, after a start, for the agent to hand back the pods found running below.
ADOPTION_WAIT = 300.0

log = logging.getLogger(__name__)


class ClusterProvider:
    """One virtual node standing for a whole lower cluster. It keeps the pod lifecycle and the
    node protocol; each other concern is a part owning its state (`capacity`, `deps`,
    `services`, `tokens`, `verbs`, `events`), reading the pods through a narrow view."""

    pass_through = True

    def __init__(
        self,
        config: LowerConfig,
        context: ProviderContext,
        lower: LowerCluster,
        *,
        background: bool = True,
        lower_node: str | None = None,
        shared_services: SharedServices | None = None,
    ) -> None:
        """`background=False` leaves out the watch, capacity and resync loops (unit tests).
        `lower_node`: mirror mode, this virtual node stands for that one lower node, and shares
        the Services below with the other members (`shared_services`)."""
        self.config, self.context, self.lower = config, context, lower
        self._background = background
        self.how = PodTranslation(
            owner=Owner(config.upper_cluster_id or "", context.node_name),
            namespaces=config.namespaces,
            dependency_names=config.dependency_names,
            service_accounts=config.service_accounts,
            service_account_tokens=config.service_account_tokens,
            virtual_labels={"type": "virtual-kubelet", "kubernetes.io/hostname": context.node_name},
            lower_node=lower_node,
            virtual_topology_keys=(config.cluster_label,) if config.cluster_label else (),
        )
        self._lower_node = lower_node
        self._pods: dict[str, ResolvedPod] = {}  # upper "namespace/name" -> what we were given
        # Both keyed by name, as the lower pod's name is the upper one: only one lower pod can
        # exist per key, but an upper pod deleted and re-created at once (a StatefulSet) has
        # late lower events about the old UID, so every event is checked against the UID.
        self._lower_pods: dict[str, JSON] = {}  # upper "namespace/name" -> lower pod, if seen
        self._pods_listed = False  # whether _lower_pods has been filled by a first listing
        # Our lower pods `list_pods` found whose upper pods the agent has not handed back yet
        # (`adopt_pod`), and until when (monotonic) to wait for them: see `_still_adopting`.
        self._adopting: set[str] = set()
        self._adopting_listed = False  # whether `list_pods` has run
        self._adopting_until = time.monotonic() + ADOPTION_WAIT
        self._deleting: dict[str, str] = {}  # upper "namespace/name" -> UID we are deleting
        self._failed: dict[str, JSON] = {}  # upper pods whose lower pod vanished: final status
        self._notify: Callable[[Pod], None] | None = None
        self._node_notify: Callable[[Node], None] | None = None
        self._unreachable: str | None = None
        self._denied: str | None = None  # missing lower permissions, as MissingPermissions says
        self._started = False  # the background loops (`_start`)
        self._spawned = TaskSet(f"cluster {context.node_name}")  # they and short-lived tasks
        # Pods whose lower pod this agent created lately (loop time) and whose Pending status
        # is being held back (see `_hold_pending`).
        self._created_at: dict[str, float] = {}
        self._held: set[str] = set()
        # Pods whose lower pod the lower scheduler cannot place: since when (loop time), with
        # the upper UID (see `_check_unschedulable`).
        self._unschedulable: dict[str, tuple[float, str]] = {}
        # The upper cluster, when the agent hands us its client (`use_upper_api`): Services to
        # reflect, tokens to mint, the default upper cluster ID.
        self._upper: UpperAPI | None = None
        self._owner_known = config.upper_cluster_id is not None
        self._owner_lock = asyncio.Lock()
        self._identity_problem: str | None = None
        name, events, spawned = context.node_name, context.events, self._spawned

        def how() -> PodTranslation:
            return self.how

        self.capacity = CapacityFollowing(
            config, lower, lambda: self.owner, self._notify_node, events, name, spawned, lower_node
        )
        self.services = ServiceReflection(
            config,
            lower,
            how,
            self._running_in,
            self._still_adopting,
            events,
            name,
            shared_services,
        )
        self.deps = DependencySync(
            config,
            lower,
            how,
            self._running,
            self._pods,
            self._still_adopting,
            self.services.changed,
            spawned,
        )
        self.tokens = UpperTokens(
            config, lower, how, self._pods, self._deleting, self._still_adopting, spawned
        )
        self.verbs = LowerVerbs(lower, name, self._lower_pods, how)
        # kubectl's verbs are the lower pod's own, through the lower API (`_verbs`).
        self.container_logs = self.verbs.container_logs
        self.exec_in_container = self.verbs.exec_in_container
        self.attach_to_container = self.verbs.attach_to_container
        self.port_forward = self.verbs.port_forward
        self.stats_summary = self.verbs.stats_summary
        self.metrics_resource = self.verbs.metrics_resource
        self.events = EventMirror(lower.client, self._upper_pod_of, events)
        self.lower_pod_reflector: Reflector[JSON] = Reflector(
            lower.client,
            "/api/v1/pods",
            dict,
            Handler(
                self._lower_pod_seen,
                lambda _old, new: self._lower_pod_seen(new),
                self._lower_pod_gone,
                on_listed=self._lower_pods_listed,
            ),
            relist_every=max(1, int(config.resync.pods)),
        )

    @property
    def owner(self) -> Owner:
        return self.how.owner

    def _still_adopting(self) -> bool:
        """Whether pods found running below at start-up are still to be handed back by the
        agent. Until they are, `_pods` holds only some of the pods we run, and a plan made from
        it would delete the copies, Services and token Secrets the others use: plans then
        create and update, and delete nothing. A pod deleted below (an orphan the agent
        removed) is not waited for, nor any pod after 5 minutes (a pod the agent cannot
        resolve any more is never handed back). Before `list_pods` (which the agent calls at
        start-up, after its pod watch's first list) nothing is known: the background loops,
        started earlier, wait for it too."""
        if time.monotonic() >= self._adopting_until:
            self._adopting.clear()
            return False
        if not self._adopting_listed:
            return self._background
        self._adopting -= self._pods.keys()
        self._adopting &= self._lower_pods.keys()
        return bool(self._adopting)

    def use_upper_api(self, api: UpperAPI) -> None:
        self._upper = self.capacity.upper = self.deps.upper = api
        self.services.upper = self.tokens.upper = api

    def admission_webhook(self) -> ConstraintWebhook | None:
        webhook = self.config.webhook
        if not webhook.enabled:
            return None
        return ConstraintWebhook(self.context.node_name, webhook, self.context.internal_ip)

    # -- the pods as the parts see them ------------------------------------------------------
    def _running(self) -> list[ResolvedPod]:
        """The pods that run (or are to): given, neither being deleted nor failed."""
        return [
            p
            for k, p in self._pods.items()
            if self._deleting.get(k) != p.uid and k not in self._failed
        ]

    def _running_in(self, namespaces: set[str]) -> list[JSON]:
        """The running pods in `namespaces`, as JSON prepared once per pod (not per call)."""
        return [self.deps.prepared(p)[2] for p in self._running() if p.namespace in namespaces]

    def _upper_pod_of(self, namespace: str, name: str, uid: str | None) -> Pod | None:
        """The upper pod our lower pod `namespace/name` (of `uid`, if given) stands for.
        Looked up by name (the lower pod's name is the upper one), not by a scan of every pod
        per event: with ~3 lower events per pod, a scan made a burst quadratic."""
        upper_namespace = self.how.namespaces.upper(namespace)
        key = f"{upper_namespace}/{name}"
        lower = self._lower_pods.get(key)
        if upper_namespace is None or lower is None:
            return None
        metadata = lower.get("metadata") or {}
        if (metadata.get("namespace"), metadata.get("name")) != (namespace, name) or uid not in (
            None,
            metadata.get("uid"),
        ):
            return None
        given = self._pods.get(key)
        return None if given is None else given.pod

    def _notify_node(self) -> None:
        if self._node_notify is not None:
            self._node_notify(msgspec.convert({"metadata": {"name": self.context.node_name}}, Node))

    async def _ensure_owner(self) -> None:
        """Settle the owner stamps before the first lower call. Without `upperClusterID`, the
        upper cluster's identity is the UID of its kube-system namespace (as Liqo does): stable
        for the cluster's life, distinct between clusters, and readable by the agent."""
        if self._owner_known:
            return
        async with self._owner_lock:
            if self._owner_known:
                return
            cluster_id = ""
            if self._upper is not None:
                try:
                    found = await self._upper.get("/api/v1/namespaces/kube-system")
                except ApiError as e:
                    self._identity_problem = (
                        f"{self.config.source}: upperClusterID is not set, and the upper "
                        "cluster's kube-system namespace (whose UID is the default) cannot be "
                        f"read: {e.message or e.reason}; set upperClusterID"
                    )
                    log.error("%s", self._identity_problem)
                    self._notify_node()
                    raise ProviderError(
                        "UpperClusterIDUnknown", self._identity_problem, permanent=False
                    ) from None
                cluster_id = str((found.get("metadata") or {}).get("uid") or "")
            owner = Owner(cluster_id, self.context.node_name)
            self.how = dataclasses.replace(self.how, owner=owner)
            self._identity_problem = None
            self._owner_known = True
            log.info("node %s: upper cluster ID %r", self.context.node_name, cluster_id)

    # -- start and stop ----------------------------------------------------------------
    def _start(self) -> None:
        if self._started or not self._background:
            return
        self._started = True
        name = self.context.node_name
        loops: dict[str, Callable[[], Awaitable[None]]] = {
            "lower permissions": self._check_access,
            "lower pods": self.lower_pod_reflector.run,
            "capacity": self.capacity.run,
            "dependencies": self.deps.run,
            "lower events": self.events.reflector.run,
        }
        if self._upper is not None and self.config.service_account_tokens == "upper":
            loops["tokens"] = self.tokens.run
        if self._upper is not None:
            loops["upper services"] = self.services.follow
            loops["upper endpointslices"] = self.services.follow_slices
            loops["services below"] = self.services.run
        for what, loop in loops.items():
            work = run_supervised(self._once_owner_known(loop), name=f"cluster {name}: {what}")
            self._spawned.spawn(work, name=what)

    def _once_owner_known(
        self, loop: Callable[[], Awaitable[None]]
    ) -> Callable[[], Awaitable[None]]:
        """Every loop reads or writes stamped lower objects: none starts before the owner
        stamps are settled (`_ensure_owner`)."""

        async def run() -> None:
            await self._ensure_owner()
            await loop()

        return run

    async def aclose(self) -> None:
        await self._spawned.aclose()
        await self.lower.aclose()

    # -- pod lifecycle ----------------------------------------------------------------
    async def create_pod(self, pod: ResolvedPod) -> None:
        try:
            await self._create_pod(pod)
        except BaseException:
            self._forget_unstarted(pod)
            raise

    def _forget_unstarted(self, pod: ResolvedPod) -> None:
        """After a failed create: unless its lower pod exists (a create whose answer was lost),
        the pod is not ours to keep. The agent calls `create_pod` again; but if the upper pod
        is deleted first, no `delete_pod` comes for a pod that never started, and an entry
        left here would keep its copies and Services below for good."""
        key = f"{pod.namespace}/{pod.name}"
        if self._pods.get(key) is not pod:
            return
        identity = upper_identity(self._lower_pods.get(key) or {})
        if identity is None or identity[2] != pod.uid:
            del self._pods[key]

    async def _create_pod(self, pod: ResolvedPod) -> None:
        self._start()
        await self._ensure_owner()
        key = f"{pod.namespace}/{pod.name}"
        lower_namespace = self.how.namespaces.lower(pod.namespace)
        if self.how.namespaces.upper(lower_namespace) != pod.namespace:
            # Two upper namespaces would share one lower namespace: their pods would replace
            # each other and their Secrets would be one copy. Refuse, never merge them.
            raise ProviderError(
                "NamespaceMappingConflict",
                f"upper namespace {pod.namespace} maps to lower namespace {lower_namespace}, "
                f"which another upper namespace ({self.how.namespaces.upper(lower_namespace)}) "
                "maps to as well; give it its own lower namespace in the provider config",
            )
        self._refuse_daemon_set_pod(pod)
        self._pods[key] = pod
        self._failed.pop(key, None)
        self._deleting.pop(key, None)  # an earlier pod's deletion is not this pod's
        if self._about_another(key, self._lower_pods.get(key)):
            del self._lower_pods[key]  # an earlier pod's lower pod: not this pod's status
        await self.deps.for_pod(pod)
        await self.tokens.deliver(pod)  # before adoption too: a restart mints fresh ones
        body = translate_pod(self.deps.prepared(pod)[2], self.how)  # its JSON, made once
        namespace = body["metadata"]["namespace"]
        if self._pods_listed and key not in self._lower_pods:
            # The lower pod watch knows no pod of ours by this name: create at once, and read
            # only if the name turns out taken (a second round trip per pod halves a burst).
            existing = await self._create_or_find(key, body)
            if existing is None:
                return
        else:
            existing = await self.lower.call(self.lower.get("Pod", namespace, pod.name))
        verdict = claim(existing, self.owner, pod.uid)
        if verdict is Claim.OURS:
            assert existing is not None
            self._remember(key, existing)  # adopted: never created twice
            return
        if verdict is Claim.TAKEN:
            assert existing is not None
            if (existing.get("metadata") or {}).get("deletionTimestamp"):
                # Going away (a StatefulSet pod force-deleted upstairs and re-created on
                # another virtual node sharing this lower cluster): wait for it, not fail.
                raise _replacing(
                    f"lower pod {namespace}/{pod.name} ({describe_owner(existing)}) is being "
                    "removed first"
                )
            raise ProviderError(
                "LowerNameConflict",
                f"lower pod {namespace}/{pod.name} already exists and is "
                f"{describe_owner(existing)}; it is left alone",
            )
        if verdict is Claim.STALE:
            assert existing is not None
            uid = str(existing["metadata"].get("uid", ""))
            await self.lower.call(
                self.lower.delete("Pod", namespace, pod.name, grace_period=0, uid=uid)
            )
            raise _replacing(f"an earlier lower pod {namespace}/{pod.name} is being removed first")
        if await self._create_or_find(key, body) is not None:
            raise _replacing(
                f"lower pod {namespace}/{pod.name} appeared while it was being created"
            )

    async def _create_or_find(self, key: str, body: JSON) -> JSON | None:
        """Create the lower pod: None when created, else the pod that already holds the name."""
        await self.capacity.check_fit(body)
        # Before the request: the watch often sees the new pod before its answer is processed.
        self._created_at[key] = asyncio.get_running_loop().time()
        try:
            created = await self.lower.call(self.lower.create(body), what="create the lower pod")
        except BaseException as e:
            self._created_at.pop(key, None)
            if not isinstance(e, ApiError) or not e.conflict:
                raise
            meta = body["metadata"]
            found: JSON | None = await self.lower.call(
                self.lower.get("Pod", meta["namespace"], meta["name"])
            )
            if found is not None:
                return found
            raise _replacing(
                f"lower pod {meta['namespace']}/{meta['name']} was being removed"
            ) from None
        self._remember(key, created)
        return None

    def _remember(self, key: str, lower: JSON) -> None:
        """Record a lower pod a request returned, unless the pod watch has already seen a later
        version of it: its events often arrive before the create's answer is processed (the
        lower pod is scheduled and Running within ~100 ms), and the stale Pending copy would
        then stand until the next re-list, a minute later."""
        known = self._lower_pods.get(key)
        if known is not None and uid_of(known) == uid_of(lower):
            with contextlib.suppress(ValueError):
                if int(_version(known)) > int(_version(lower)):
                    return
        self._lower_pods[key] = lower

    def _refuse_daemon_set_pod(self, pod: ResolvedPod) -> None:
        """DaemonSet pods are per-machine agents (log shippers, CNI, node exporters): on a
        virtual node they would run once somewhere below, serving no machine, and a DaemonSet
        tolerating every taint lands one on each virtual node. Refused for good, as a kubelet
        refuses a pod at admission (Failed; the DaemonSet controller backs off), unless the
        config or the pod's annotation asks for it."""
        if self.config.daemon_set_pods == "run":
            return
        metadata = pod.pod.metadata
        if metadata is None or not any(
            o.kind == "DaemonSet" and o.controller for o in metadata.ownerReferences or []
        ):
            return
        if (metadata.annotations or {}).get(RUN_DAEMON_SET_ANNOTATION) == "true":
            return
        raise ProviderError(
            "DaemonSetPodRefused",
            f"DaemonSet pods do not run on virtual node {self.context.node_name} (it stands for "
            "a lower cluster, not a machine); to run this one anyway, annotate the DaemonSet's "
            f'pod template {RUN_DAEMON_SET_ANNOTATION}: "true", or set daemonSetPods: run in '
            "the provider config",
        )

    async def adopt_pod(self, pod: ResolvedPod) -> None:
        """After a restart, a pod that runs below: ours again, with what it needs below (its
        lower pod is found ours and not created again; upper tokens are minted afresh)."""
        await self.create_pod(pod)

    async def update_pod(self, pod: ResolvedPod) -> None:
        await self._ensure_owner()
        key = f"{pod.namespace}/{pod.name}"
        previous = self._pods.get(key)
        self._pods[key] = pod
        await self.deps.sync()
        body = translate_pod(to_json(pod.pod), self.how)
        spec = body["spec"]
        patch: JSON = {
            "metadata": {
                "labels": dict(body["metadata"].get("labels") or {}),
                "annotations": dict(body["metadata"].get("annotations") or {}),
            },
            "spec": {
                kind: [{"name": c["name"], "image": c["image"]} for c in spec.get(kind) or []]
                for kind in ("initContainers", "containers")
            },
        }
        if "activeDeadlineSeconds" in spec:
            patch["spec"]["activeDeadlineSeconds"] = spec["activeDeadlineSeconds"]
        if previous is not None and previous.uid == pod.uid:
            # A merge patch keeps the keys it does not name: the ones removed upstairs (a pod
            # taken out of a Service by its label) are removed by name. Only those we sent:
            # the lower cluster's own (its admission's) stay.
            sent = translate_pod(to_json(previous.pod), self.how)["metadata"]
            for field in ("labels", "annotations"):
                for name in sent.get(field) or {}:
                    patch["metadata"][field].setdefault(name, None)
        namespace = body["metadata"]["namespace"]
        current = self._lower_pods.get(key) or await self.lower.call(
            self.lower.get("Pod", namespace, pod.name)
        )
        if current is None or not is_ours(current, self.owner):
            return  # not (or no longer) ours: nothing to update
        # The API only lets tolerations be added, and lower admission may have added its own:
        # send the lower list plus the new ones, never a shorter list.
        existing = list((current.get("spec") or {}).get("tolerations") or [])
        added = [t for t in spec.get("tolerations") or [] if t not in existing]
        if added:
            patch["spec"]["tolerations"] = existing + added
        path = PODS.path(namespace, pod.name)
        patch["metadata"]["uid"] = current.get("metadata", {}).get("uid")
        patched = await self.lower.call(
            self.lower.client.patch(path, patch, STRATEGIC_MERGE_PATCH), what="update the lower pod"
        )
        # In-place resize goes through its own subresource (Kubernetes 1.33+).
        lower_resources = {
            c["name"]: c.get("resources") or {}
            for c in (patched.get("spec") or {}).get("containers") or []
        }
        resized = [
            {"name": c["name"], "resources": c.get("resources") or {}}
            for c in spec.get("containers") or []
            if requests_and_limits(c.get("resources"))
            != requests_and_limits(lower_resources.get(c["name"]))
        ]
        if resized:
            body = {"spec": {"containers": resized}}
            await self.lower.call(
                self.lower.client.patch(f"{path}/resize", body, STRATEGIC_MERGE_PATCH),
                what="resize the lower pod",
            )

    async def start_ephemeral_container(self, pod: ResolvedPod, name: str) -> None:
        """`kubectl debug` upstairs: the container is added to the lower pod through its
        `ephemeralcontainers` subresource; the lower kubelet runs it, its status is reflected
        up with the pod's, and attach reaches it through the lower apiserver."""
        await self._ensure_owner()
        key = f"{pod.namespace}/{pod.name}"
        current = self._lower_pods.get(key)
        if current is None or not is_ours(current, self.owner):
            raise ProviderError(
                "NotFound", f"pod {key} does not run in the lower cluster", permanent=False
            )
        self._pods[key] = pod  # its spec names the container (the kubelet API checks)
        lower_spec = current.get("spec") or {}
        if any(c.get("name") == name for c in lower_spec.get("ephemeralContainers") or []):
            return  # handed again after an agent restart
        added = [c for c in ephemeral_containers(to_json(pod.pod), self.how) if c["name"] == name]
        metadata = current.get("metadata") or {}
        path = PODS.path(str(metadata.get("namespace")), str(metadata.get("name")))
        # A strategic merge patch merges ephemeral containers by name: only this one is added.
        patch = {"metadata": {"uid": metadata.get("uid")}, "spec": {"ephemeralContainers": added}}
        await self.lower.call(
            self.lower.client.patch(f"{path}/ephemeralcontainers", patch, STRATEGIC_MERGE_PATCH),
            what=f"add ephemeral container {name} to the lower pod",
        )

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        await self._ensure_owner()
        meta = pod.metadata
        assert meta is not None
        key, upper_uid = f"{meta.namespace}/{meta.name}", str(meta.uid or "")
        self._deleting[key] = upper_uid  # before the lookup: its DELETED event may come first
        namespace, name = self.how.lower_namespace(str(meta.namespace)), str(meta.name)
        # First the lower pod as the watch (or our create) last saw it: one lower request per
        # deletion instead of two. The delete carries its UID as a precondition, so a stale
        # copy deletes nothing; then the pod is read, as it is when no copy is known.
        known = self._lower_pods.get(key)
        if known is not None and await self._delete_lower(known, upper_uid, grace_period_seconds):
            return  # its DELETED event finishes the deletion (`_push_gone`)
        current = await self.lower.call(self.lower.get("Pod", namespace, name))
        if current is not None and await self._delete_lower(
            current, upper_uid, grace_period_seconds
        ):
            return
        self._gone_without_lower(key, upper_uid, pod)

    async def _delete_lower(self, lower: JSON, upper_uid: str, grace_period: int) -> bool:
        """Delete `lower` if it is ours and stands for the upper pod `upper_uid`, by its UID;
        whether it was deleted (False: not ours, another pod's, gone or replaced)."""
        if not is_ours(lower, self.owner):
            return False
        identity = upper_identity(lower)
        if identity is not None and identity[2] != upper_uid:
            return False
        metadata = lower["metadata"]
        if self.capacity.on_vanished_node(lower):
            grace_period = 0  # no kubelet is left to stop it gracefully
        deleted: bool = await self.lower.call(
            self.lower.delete(
                "Pod",
                str(metadata["namespace"]),
                str(metadata["name"]),
                grace_period=grace_period,
                uid=str(metadata.get("uid", "")),
            )
        )
        return deleted

    def _gone_without_lower(self, key: str, uid: str, pod: Pod) -> None:
        """No lower pod of ours stands for `pod` (refused for good, vanished, or never made), so
        no lower DELETED event will finish its deletion: forget it now (a later pod of its name
        would otherwise be left out of the dependency copies) and report it stopped."""
        if self._deleting.get(key) == uid:
            del self._deleting[key]
        given = self._pods.get(key)
        if given is not None and given.uid != uid:
            return  # the pod of this name is a newer one: only the deletion mark was ours
        self._pods.pop(key, None)
        identity = upper_identity(self._lower_pods.get(key) or {})
        if identity is None or identity[2] == uid:
            self._lower_pods.pop(key, None)  # deleted below before we saw its DELETED event
        failed = self._failed.pop(key, None)
        self.deps.release_soon()
        self.tokens.drop(key, uid)
        if self._notify is None:
            return
        upper = to_json(given.pod if given is not None else pod)
        if failed is not None:
            upper["status"] = failed
        status = gone_status(upper, reason="Deleted", message="", now=now_rfc3339())
        self._notify(msgspec.convert({**upper, "status": status}, Pod))

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        key = f"{namespace}/{name}"
        status = await self.get_pod_status(namespace, name)
        if status is None:
            return None
        lower = self._lower_pods.get(key)
        given = self._pods.get(key)
        if given is not None:
            upper = to_json(given.pod)
            upper["status"] = to_json(status)
            return msgspec.convert(upper, Pod)
        assert lower is not None
        return upper_view(lower, status)

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        key = f"{namespace}/{name}"
        if key in self._failed:
            return msgspec.convert(self._failed[key], PodStatus)
        lower = self._lower_pods.get(key)
        given = self._pods.get(key)
        upper = to_json(given.pod) if given is not None else {}
        if lower is None:
            return None
        return msgspec.convert(self._status_up(lower, upper), PodStatus)

    async def list_pods(self) -> list[Pod]:
        self._start()
        await self._ensure_owner()
        pods = await self.lower.call(self.lower.list_objects("Pod", selector=self.owner.selector))
        found = []
        for lower in pods:
            key = self._key_of(lower)
            if key is None:
                continue
            if not self._about_another(key, lower):
                self._remember(key, lower)
            if key not in self._pods:
                self._adopting.add(key)
            found.append(upper_view(lower, msgspec.convert(self._status_up(lower, {}), PodStatus)))
        if not self._adopting_listed:
            self._adopting_listed = True
            self._adopting_until = time.monotonic() + ADOPTION_WAIT
        return found

    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._notify = callback
        self._start()

    # -- node ----------------------------------------------------------------
    async def ping(self) -> None:
        try:
            await self.lower.server_version()
        except (Unreachable, ApiError) as e:
            self._unreachable = str(e)
            raise
        self._unreachable = None

    def node_conditions(self) -> Sequence[NodeCondition]:
        if self._lower_node is not None and not self._unreachable:
            problem = self._mirrored_problem()
            if problem is not None:
                return [problem]
        if self._identity_problem:
            return [
                NodeCondition("Ready", "False", "UpperClusterIDUnknown", self._identity_problem)
            ]
        if self._denied:
            return [NodeCondition("Ready", "False", "LowerPermissionsMissing", self._denied)]
        if self._unreachable:
            return [
                NodeCondition(
                    "Ready",
                    "False",
                    "LowerClusterUnreachable",
                    f"lower cluster {self.lower.client.server}: {self._unreachable}",
                )
            ]
        if self._lower_node is None and not self.capacity.known:
            # Ready with no allocatable yet would be a node the scheduler cannot use, and
            # the labels published from below would be missing for a moment.
            message = "waiting for the first listing of the lower cluster's nodes and pods"
            return [NodeCondition("Ready", "False", "LowerClusterUnknown", message)]
        return []

    def _mirrored_problem(self) -> NodeCondition | None:
        """Mirror mode: Ready follows the lower node's own Ready."""
        where = f"lower node {self._lower_node}"
        if self.capacity.snapshot is None:
            message = f"{where}: waiting for the first listing of the lower cluster"
            return NodeCondition("Ready", "False", "LowerNodeUnknown", message)
        if self.capacity.mirrored is None:
            return NodeCondition("Ready", "False", "LowerNodeGone", f"{where} does not exist")
        for condition in (self.capacity.mirrored.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "Ready":
                if condition.get("status") == "True":
                    return None
                message = condition.get("message") or condition.get("reason") or ""
                return NodeCondition(
                    "Ready", "False", "LowerNodeNotReady", f"{where} is not ready: {message}"
                )
        return NodeCondition("Ready", "False", "LowerNodeNotReady", f"{where} states no Ready")

    def configure_node(self, node: Node) -> None:
        assert node.status is not None and node.metadata is not None
        if self._lower_node is not None:
            self._configure_mirror(node)
            return
        allocatable = dict(self.capacity.capacity.allocatable)
        node.status.capacity = dict(allocatable)
        node.status.allocatable = dict(allocatable)
        # The node's own labels (the agent's and the operator's, not those published from
        # below): scheduling terms on them only chose this node and are dropped on the way down.
        common = self.capacity.capacity.labels
        own = {k: v for k, v in (node.metadata.labels or {}).items() if common.get(k) != v}
        own.setdefault("kubernetes.io/hostname", self.context.node_name)
        own.update(self._cluster_label())
        node.metadata.annotations = {
            **(node.metadata.annotations or {}),
            LARGEST_FREE_ANNOTATION: self.capacity.largest_free_annotation(),
        }
        if node.spec is not None and self.capacity.cannot_fit_tainted():
            node.spec.taints = [
                *(node.spec.taints or []),
                Taint(key=CANNOT_FIT_TAINT["key"], effect=CANNOT_FIT_TAINT["effect"]),
            ]
        if own != self.how.virtual_labels:  # a new `how` re-prepares every pod
            self.how = dataclasses.replace(self.how, virtual_labels=own)
        labels = {**(node.metadata.labels or {}), **self._cluster_label()}
        if self.config.publish_common_labels:
            for key, value in self.capacity.capacity.labels.items():
                if not self.config.label_excluded(key):
                    labels.setdefault(key, value)
        node.metadata.labels = labels

    def _cluster_label(self) -> dict[str, str]:
        """`vkubelet.io/cluster: <clusterName>`: which lower cluster this virtual node stands
        for, so upper constraints can spread over clusters or choose one."""
        label, name = self.config.cluster_label, self.config.cluster_name
        return {label: name} if label and name else {}

    def _configure_mirror(self, node: Node) -> None:
        """One lower node's shape: its allocatable (minus pods not ours), its labels (over the
        agent's defaults: its arch, say), and its cordon once it has been seen."""
        assert node.status is not None and node.metadata is not None
        allocatable = dict(self.capacity.capacity.allocatable)
        node.status.capacity = dict(allocatable)
        node.status.allocatable = dict(allocatable)
        published = self.capacity.capacity.labels if self.config.publish_common_labels else {}
        labels = {**(node.metadata.labels or {}), **published, **self._cluster_label()}
        own = {k: v for k, v in labels.items() if published.get(k) != v}
        own["kubernetes.io/hostname"] = self.context.node_name
        if own != self.how.virtual_labels:  # a new `how` re-prepares every pod
            self.how = dataclasses.replace(self.how, virtual_labels=own)
        node.metadata.labels = labels
        node.metadata.annotations = {
            **(node.metadata.annotations or {}),
            "vkubelet.io/lower-node": str(self._lower_node),
        }
        if self.capacity.mirrored is not None and node.spec is not None:
            node.spec.unschedulable = bool(
                (self.capacity.mirrored.get("spec") or {}).get("unschedulable")
            )

    def notify_node_status(self, callback: Callable[[Node], None]) -> None:
        self._node_notify = callback

    async def _check_access(self) -> None:
        """Once the lower apiserver answers, name every permission it denies (the node stays
        NotReady with them until the agent is restarted with better credentials)."""
        try:
            await self.lower.check_permissions()
        except MissingPermissions as e:
            self._denied = str(e)
            log.error("%s", e)
            self.context.events.node_event(
                self.context.node_name, "Warning", "LowerPermissionsMissing", str(e)
            )
            self._notify_node()

    # -- the one reflector of the lower pods ---------------------------------------------
    # Every lower pod, listed, watched and re-listed every `resync.pods` seconds so a pod that
    # vanished without an event is noticed. It feeds both consumers: the capacity snapshot
    # (pods not ours take room; per-node usage for the fit check) and our pods' statuses (the
    # pods carrying our stamps). A second watch of our pods by label cost each of their events
    # twice (received, decoded: ~4 % of the agent's CPU in a burst).
    async def _follow_pods(self) -> None:
        await self._once_owner_known(self.lower_pod_reflector.run)()

    def _lower_pod_seen(self, lower: JSON) -> None:
        self.capacity.pod_changed(lower)
        key = self._key_of(lower)
        if key is not None:
            self._observed(key, lower)

    def _lower_pod_gone(self, lower: JSON) -> None:
        self.capacity.pod_changed(lower, deleted=True)
        key = self._key_of(lower)
        if key is not None:
            self._vanished(key, lower)

    def _lower_pods_listed(self) -> None:
        """After a listing: a lower pod known only from a request's answer (created, adopted)
        that the listing lacks, and was not written after it, vanished unseen."""
        listing = self.lower_pod_reflector.items
        self.capacity.listed(listing)
        self._pods_listed = True
        version = self.lower_pod_reflector.resource_version or ""
        for key, known in list(self._lower_pods.items()):
            if uid_of(known) not in listing and not newer(known, version):
                self._vanished(key, known)

    def _key_of(self, lower: Mapping[str, Any]) -> str | None:
        if not is_ours(lower, self.owner):
            return None
        identity = upper_identity(lower)
        return None if identity is None else f"{identity[0]}/{identity[1]}"

    def _about_another(self, key: str, lower: Mapping[str, Any] | None) -> bool:
        """Whether `lower` stands for another upper pod than the one we run under `key`: an
        earlier pod of the same name, whose late events must not touch the current one."""
        given = self._pods.get(key)
        identity = None if lower is None else upper_identity(lower)
        return given is not None and identity is not None and identity[2] != given.uid

    def _observed(self, key: str, lower: JSON) -> None:
        if self._about_another(key, lower):
            return
        previous = self._lower_pods.get(key)
        self._lower_pods[key] = lower
        self._follow_unschedulable(key, lower)
        if previous is not None and previous.get("status") == lower.get("status"):
            return
        self._push(key)

    def _vanished(self, key: str, lower: Mapping[str, Any]) -> None:
        identity = upper_identity(lower)
        if self._about_another(key, lower):
            assert identity is not None
            if self._deleting.get(key) == identity[2]:
                del self._deleting[key]  # an earlier pod's deletion finished
            return
        tracked = self._lower_pods.get(key)
        if tracked is not None and identity is not None and upper_identity(tracked) != identity:
            return  # an orphan's lower pod of another UID: not the one we know
        last = self._lower_pods.pop(key, None)
        self._unschedulable.pop(key, None)
        given = self._pods.get(key)
        if given is not None and key in self._failed and self._deleting.get(key) != given.uid:
            return  # we failed it and removed its lower pod (`_give_up_unschedulable`)
        if given is None or self._deleting.get(key) == given.uid:
            self._push_gone(key, last)
            return
        reason, message = vanished_reason(last)
        self._failed[key] = self._ended(given.pod, last, reason, message)["status"]
        self.services.changed()
        log.warning("pod %s: %s", key, message)
        self.context.events.pod_event(given.pod, "Warning", reason, message)
        self._push(key)

    def _follow_unschedulable(self, key: str, lower: Mapping[str, Any]) -> None:
        """Note when the lower scheduler starts refusing a pod. The fit check passes a pod that
        fits the snapshot, but it reserves nothing, the snapshot ages, and it does not judge
        everything (pod affinity, volumes): a pod can still sit Unschedulable below, where no
        controller replaces it. tensile-kube needs a descheduler for this; here the provider
        itself gives up after `unschedulableTimeout` (`_give_up_unschedulable`)."""
        limit = self.config.unschedulable_timeout
        given = self._pods.get(key)
        if limit <= 0 or given is None or not _unschedulable(lower):
            self._unschedulable.pop(key, None)
            return
        if self._unschedulable.get(key, (0.0, ""))[1] == given.uid:
            return
        loop = asyncio.get_running_loop()
        self._unschedulable[key] = (loop.time(), given.uid)
        loop.call_later(limit, self._give_up_unschedulable, key, given.uid)

    def _give_up_unschedulable(self, key: str, uid: str) -> None:
        """Still Unschedulable below after the timeout: fail the upper pod (its controller makes
        a replacement), taint the node for the back-off so the replacement goes elsewhere, and
        remove the lower pod (it never ran)."""
        since = self._unschedulable.pop(key, None)
        given, lower = self._pods.get(key), self._lower_pods.get(key)
        if since is None or since[1] != uid or given is None or given.uid != uid:
            return
        if lower is None or not _unschedulable(lower) or key in self._failed:
            return
        scheduled = next(
            c for c in (lower.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodScheduled"
        )  # fmt: skip
        message = (
            f"the lower cluster could not schedule this pod for "
            f"{self.config.unschedulable_timeout:.0f}s: {scheduled.get('message') or 'no reason'}"
        )
        self._failed[key] = self._ended(given.pod, lower, UNSCHEDULABLE_BELOW, message)["status"]
        log.warning("pod %s: %s", key, message)
        self.context.events.pod_event(given.pod, "Warning", UNSCHEDULABLE_BELOW, message)
        if self.config.mode == "aggregate" and self.capacity.start_cannot_fit_backoff(message):
            self._spawned.spawn(self.capacity.taint_published(), name=f"taint for {key}")
        self._push(key)
        namespace, _, name = key.partition("/")
        lower_uid = str((lower.get("metadata") or {}).get("uid", ""))
        self._spawned.spawn(
            self.lower.call(
                self.lower.delete(
                    "Pod", self.how.lower_namespace(namespace), name, grace_period=0, uid=lower_uid
                )
            ),
            name=f"remove unschedulable {key}",
        )

    def _push(self, key: str) -> None:
        if self._notify is None or self._hold_pending(key):
            return
        self._held.discard(key)  # pushed now: its held status is out of date
        report = self._report(key)
        if report is not None:
            self._notify(report)

    def _hold_pending(self, key: str) -> bool:
        """Whether to hold back the status of a lower pod created less than `PENDING_HOLD` ago
        that is still plainly Pending (`_nothing_to_tell`): it is nearly always Running a
        moment later, and the upper pod is Pending already, so holding it saves an upper status
        write per pod (and its push). Once the hold ends, the status of that moment goes up;
        anything else (Running, a reason such as Unschedulable, a container waiting for an
        image, a vanished pod) goes up at once.

        The hold is seconds, not a fraction of one: in a burst the lower cluster takes a few
        seconds from create to Running (a 0.5 s hold let ~30 % of the pods of a 1,000-pod burst
        through, one more upper write each, when the upper apiserver is busiest)."""
        created = self._created_at.get(key)
        if created is None:
            return False
        left = created + PENDING_HOLD - asyncio.get_running_loop().time()
        lower = self._lower_pods.get(key)
        if left <= 0 or lower is None or key in self._failed or not _nothing_to_tell(lower):
            self._created_at.pop(key, None)
            return False
        if key not in self._held:
            self._held.add(key)
            asyncio.get_running_loop().call_later(left, self._hold_over, key)
        return True

    def _hold_over(self, key: str) -> None:
        self._created_at.pop(key, None)
        if key in self._held:  # nothing pushed since: push what there is now
            self._push(key)

    def _report(self, key: str) -> Pod | None:
        """What a push says: which pod (namespace, name, UID) and its status, nothing else —
        the agent reads no more of it, and converting the whole upper pod for each push cost
        4 % of the agent's CPU in a burst. Made at once, not in a task of its own."""
        given = self._pods.get(key)
        if key in self._failed:
            status: JSON = self._failed[key]
        else:
            lower = self._lower_pods.get(key)
            if lower is None:
                return None
            upper: JSON = {}
            if given is not None:
                spec = given.pod.spec
                gates = spec.readinessGates if spec is not None else None
                upper = {
                    "spec": {"readinessGates": to_json(gates) if gates else []},
                    "status": to_json(given.pod.status),
                }
            status = self._status_up(lower, upper)
        if given is not None:
            namespace, name, uid = given.namespace, given.name, given.uid
        else:
            identity = upper_identity(self._lower_pods.get(key) or {})
            if identity is None:
                return None
            namespace, name, uid = identity
        metadata = {"namespace": namespace, "name": name, "uid": uid}
        return msgspec.convert({"metadata": metadata, "status": status}, Pod)

    def _push_gone(self, key: str, last: JSON | None) -> None:
        """Our own deletion finished: report the containers stopped, so the agent removes it,
        and drop the copies no other pod needs."""
        given = self._pods.pop(key, None)
        self._deleting.pop(key, None)
        self.deps.release_soon()
        identity = None if last is None else upper_identity(last)
        uid = identity[2] if identity is not None else (given.uid if given is not None else "")
        if uid:
            self.tokens.drop(key, uid)
        if given is None or self._notify is None:
            return
        self._notify(msgspec.convert(self._ended(given.pod, last, "Deleted", ""), Pod))

    def _ended(self, pod: Pod, last: JSON | None, reason: str, message: str) -> JSON:
        """The upper pod (as JSON) with its final status: as its lower pod was last seen, then
        Failed for `reason` unless it had ended already."""
        upper = to_json(pod)
        if last is not None:
            upper["status"] = self._status_up(last, upper)
        upper["status"] = gone_status(upper, reason=reason, message=message, now=now_rfc3339())
        return upper

    def _status_up(self, lower: Mapping[str, Any], upper: Mapping[str, Any]) -> JSON:
        return status_up(lower, upper, host_ip=self.context.internal_ip, now=now_rfc3339())


def _replacing(message: str) -> ProviderError:
    """The lower pod's name is held by a pod on its way out: the agent retries the create."""
    return ProviderError("LowerPodReplacing", message, permanent=False)


def _version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion", ""))


UNSCHEDULABLE_BELOW = "LowerClusterUnschedulable"


def _nothing_to_tell(lower: Mapping[str, Any]) -> bool:
    """Whether the lower pod is plainly Pending: no reason, not refused by the lower scheduler,
    and every container (init containers too) not yet reported or still being created, never
    started. The upper pod, Pending already, would learn nothing a user acts on from it."""
    status = lower.get("status") or {}
    if status.get("phase", "Pending") != "Pending" or "reason" in status:
        return False
    if any(
        c.get("type") == "PodScheduled" and c.get("status") == "False"
        for c in status.get("conditions") or []
    ):
        return False
    for kind in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(kind) or []:
            state = container.get("state") or {}
            waiting = state.get("waiting")
            if container.get("restartCount") or container.get("lastState"):
                return False
            if state and (waiting is None or waiting.get("reason") not in _BEING_CREATED):
                return False
    return True


def _unschedulable(lower: Mapping[str, Any]) -> bool:
    """Whether the lower scheduler has refused to place the pod (and it is still Pending)."""
    status = lower.get("status") or {}
    if status.get("phase", "Pending") != "Pending" or (lower.get("spec") or {}).get("nodeName"):
        return False
    return any(
        c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in status.get("conditions") or []
    )
