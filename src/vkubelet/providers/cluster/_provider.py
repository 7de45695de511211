"""The cluster provider: the parts (`_translate`, `_deps`, `_status`, `_capacity`) wired to the
agent's provider protocols over one lower-cluster client. This module holds the pod lifecycle,
the lower pod and event watches, the dependency sync and the node protocol; the class is built
from `_core` (shared state, owner identity) and one part per concern: `_verbs` (kubectl verbs),
`_capacityloop` (capacity and labels), `_servicesync` (Services below) and `_tokenkeeper`
(upper tokens).

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
from lightkube.models.core_v1 import PodStatus, Taint
from lightkube.resources.core_v1 import Node, Pod

from ...kube import ApiError, Unreachable
from ...sdk.provider import EventType, NodeCondition, ProviderError, ResolvedPod
from ...sdk.tasks import supervise
from ._admission import ConstraintAdmission
from ._capacityloop import CANNOT_FIT_TAINT, LARGEST_FREE_ANNOTATION, CapacityFollowing
from ._convert import (
    JSON,
    convert_node,
    convert_pod,
    convert_podstatus,
    newer,
    newest,
    now_rfc3339,
    requests_and_limits,
    to_json,
    uid_of,
    upper_view,
)
from ._core import ADOPTION_WAIT
from ._deps import KINDS, SOURCE_VERSION, Key, plan_dependencies
from ._lower import MissingPermissions
from ._refs import Reference
from ._servicesync import ServiceReflection
from ._stamps import Claim, claim, describe_owner, is_ours, upper_identity
from ._status import gone_status, status_up, vanished_reason
from ._tokenkeeper import UpperTokens
from ._translate import needed_references, translate_pod
from ._verbs import LowerVerbs

__all__ = ["RUN_DAEMON_SET_ANNOTATION", "ClusterProvider"]

RUN_DAEMON_SET_ANNOTATION = "vkubelet.io/run-on-virtual-node"
# How long a new lower pod's plain Pending status is held back at most (see `_hold_pending`).
PENDING_HOLD = 5.0
# Waiting reasons of a container the lower kubelet is still creating: they tell nothing yet.
_BEING_CREATED = ("ContainerCreating", "PodInitializing")
# Lower events not mirrored: the lower kubelet's Created and Started say what the agent's own
# events on the upper pod say (and cost a mirrored event each, two per pod).
_NOT_MIRRORED = ("Created", "Started")

log = logging.getLogger(__name__)


class ClusterProvider(
    LowerVerbs, CapacityFollowing, ServiceReflection, UpperTokens, ConstraintAdmission
):
    """One virtual node standing for a whole lower cluster."""

    pass_through = True

    # -- start and stop ----------------------------------------------------------------
    def _start(self) -> None:
        if self._tasks or not self._background:
            return
        name = self.context.node_name
        self._tasks = [
            supervise(self._check_access, name=f"cluster {name}: lower permissions"),
            supervise(self._follow_pods, name=f"cluster {name}: lower pods"),
            supervise(self._follow_capacity, name=f"cluster {name}: capacity"),
            supervise(self._resync_dependencies, name=f"cluster {name}: dependencies"),
            supervise(self._follow_events, name=f"cluster {name}: lower events"),
        ]
        if self._upper is not None and self.config.service_account_tokens == "upper":
            self._tasks.append(supervise(self._refresh_tokens, name=f"cluster {name}: tokens"))
        if self._upper is not None:
            self._tasks += [
                supervise(self._follow_upper_services, name=f"cluster {name}: upper services"),
                supervise(self._reflect_services, name=f"cluster {name}: services below"),
            ]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
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
        lower = self._lower_pods.get(key)
        identity = upper_identity(lower) if lower is not None else None
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
        await self._dependencies_for(pod)
        await self._deliver_tokens(pod)  # before adoption too: a restart mints fresh ones
        body = translate_pod(self._prepared_pod(pod)[2], self.how)  # its JSON, made once
        namespace = body["metadata"]["namespace"]
        if self._pods_listed and key not in self._lower_pods:
            # The lower pod watch knows no pod of ours by this name: create at once, and read
            # only if the name turns out taken (a second round trip per pod halves a burst).
            existing = await self._create_or_find(key, body)
            if existing is None:
                return
        else:
            existing = await self._call(self.lower.get("Pod", namespace, pod.name))
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
                raise ProviderError(
                    "LowerPodReplacing",
                    f"lower pod {namespace}/{pod.name} ({describe_owner(existing)}) is being "
                    "removed first",
                    permanent=False,
                )
            raise ProviderError(
                "LowerNameConflict",
                f"lower pod {namespace}/{pod.name} already exists and is "
                f"{describe_owner(existing)}; it is left alone",
            )
        if verdict is Claim.STALE:
            assert existing is not None
            uid = str(existing["metadata"].get("uid", ""))
            await self._call(self.lower.delete("Pod", namespace, pod.name, grace_period=0, uid=uid))
            raise ProviderError(
                "LowerPodReplacing",
                f"an earlier lower pod {namespace}/{pod.name} is being removed first",
                permanent=False,
            )
        if await self._create_or_find(key, body) is not None:
            raise ProviderError(
                "LowerPodReplacing",
                f"lower pod {namespace}/{pod.name} appeared while it was being created",
                permanent=False,
            )

    async def _create_or_find(self, key: str, body: JSON) -> JSON | None:
        """Create the lower pod: None when created, else the pod that already holds the name."""
        await self._check_fit(body)
        # Before the request: the watch often sees the new pod before its answer is processed.
        self._created_at[key] = asyncio.get_running_loop().time()
        try:
            created = await self._call(self.lower.create(body), what="create the lower pod")
        except BaseException as e:
            self._created_at.pop(key, None)
            if not isinstance(e, ApiError) or not e.conflict:
                raise
            meta = body["metadata"]
            found: JSON | None = await self._call(
                self.lower.get("Pod", meta["namespace"], meta["name"])
            )
            if found is not None:
                return found
            raise ProviderError(
                "LowerPodReplacing",
                f"lower pod {meta['namespace']}/{meta['name']} was being removed",
                permanent=False,
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
        await self._sync_dependencies()
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
        current = self._lower_pods.get(key) or await self._call(
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
        path = f"/api/v1/namespaces/{namespace}/pods/{pod.name}"
        patch["metadata"]["uid"] = (current or {}).get("metadata", {}).get("uid")
        patched = await self._call(
            self.lower.client.patch(path, patch, "application/strategic-merge-patch+json"),
            what="update the lower pod",
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
            await self._call(
                self.lower.client.patch(
                    path + "/resize",
                    {"spec": {"containers": resized}},
                    "application/strategic-merge-patch+json",
                ),
                what="resize the lower pod",
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
        current = await self._call(self.lower.get("Pod", namespace, name))
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
        if self._on_vanished_node(lower):
            grace_period = 0  # no kubelet is left to stop it gracefully
        deleted: bool = await self._call(
            self.lower.delete(
                "Pod",
                str(metadata["namespace"]),
                str(metadata["name"]),
                grace_period=grace_period,
                uid=str(metadata.get("uid", "")),
            )
        )
        return deleted

    def _on_vanished_node(self, lower: Mapping[str, Any]) -> bool:
        """Whether the lower pod is bound to a lower node that no longer exists: a graceful
        deletion would wait for the lower pod garbage collector (a minute or so), and a
        mirrored node's drain with it."""
        where = (lower.get("spec") or {}).get("nodeName")
        if not where or self._snapshot is None:
            return False
        return not any(
            (n.get("metadata") or {}).get("name") == where for n in self._snapshot["Node"].values()
        )

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
        tracked = self._lower_pods.get(key)
        identity = None if tracked is None else upper_identity(tracked)
        if identity is None or identity[2] == uid:
            self._lower_pods.pop(key, None)  # deleted below before we saw its DELETED event
        failed = self._failed.pop(key, None)
        self._release_soon()
        self._drop_tokens(key, uid)
        if self._notify is None:
            return
        upper = to_json(given.pod if given is not None else pod)
        if failed is not None:
            upper["status"] = failed
        status = gone_status(upper, reason="Deleted", message="", now=now_rfc3339())
        self._notify(convert_pod({**upper, "status": status}))

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
            return convert_pod(upper)
        assert lower is not None
        return upper_view(lower, status)

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        key = f"{namespace}/{name}"
        if key in self._failed:
            return convert_podstatus(self._failed[key])
        lower = self._lower_pods.get(key)
        given = self._pods.get(key)
        upper = to_json(given.pod) if given is not None else {}
        if lower is None:
            return None
        return convert_podstatus(
            status_up(lower, upper, host_ip=self.context.internal_ip, now=now_rfc3339())
        )

    async def list_pods(self) -> list[Pod]:
        self._start()
        await self._ensure_owner()
        pods = await self._call(self.lower.list_objects("Pod", selector=self.owner.selector))
        found = []
        for lower in pods:
            if not is_ours(lower, self.owner):
                continue
            identity = upper_identity(lower)
            if identity is None:
                continue
            key = f"{identity[0]}/{identity[1]}"
            if not self._about_another(key, lower):
                self._remember(key, lower)
            if key not in self._pods:
                self._adopting.add(key)
            status = status_up(lower, {}, host_ip=self.context.internal_ip, now=now_rfc3339())
            found.append(upper_view(lower, convert_podstatus(status)))
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
        if self._lower_node is None and not self._capacity_known:
            # Ready with no allocatable yet would be a node the scheduler cannot use, and
            # the labels published from below would be missing for a moment.
            message = "waiting for the first listing of the lower cluster's nodes and pods"
            return [NodeCondition("Ready", "False", "LowerClusterUnknown", message)]
        return []

    def _mirrored_problem(self) -> NodeCondition | None:
        """Mirror mode: Ready follows the lower node's own Ready."""
        where = f"lower node {self._lower_node}"
        if self._snapshot is None:
            message = f"{where}: waiting for the first listing of the lower cluster"
            return NodeCondition("Ready", "False", "LowerNodeUnknown", message)
        if self._mirrored is None:
            return NodeCondition("Ready", "False", "LowerNodeGone", f"{where} does not exist")
        for condition in (self._mirrored.get("status") or {}).get("conditions") or []:
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
        allocatable = dict(self._capacity.allocatable)
        node.status.capacity = dict(allocatable)
        node.status.allocatable = dict(allocatable)
        # The node's own labels (the agent's and the operator's, not those published from
        # below): scheduling terms on them only chose this node and are dropped on the way down.
        common = self._capacity.labels
        own = {k: v for k, v in (node.metadata.labels or {}).items() if common.get(k) != v}
        own.setdefault("kubernetes.io/hostname", self.context.node_name)
        own.update(self._cluster_label())
        node.metadata.annotations = {
            **(node.metadata.annotations or {}),
            LARGEST_FREE_ANNOTATION: self._largest_free_annotation(),
        }
        if node.spec is not None and self._cannot_fit_tainted():
            node.spec.taints = [
                *(node.spec.taints or []),
                Taint(key=CANNOT_FIT_TAINT["key"], effect=CANNOT_FIT_TAINT["effect"]),
            ]
        if own != self.how.virtual_labels:  # a new `how` re-prepares every pod
            self.how = dataclasses.replace(self.how, virtual_labels=own)
        labels = {**(node.metadata.labels or {}), **self._cluster_label()}
        if self.config.publish_common_labels:
            for key, value in self._capacity.labels.items():
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
        allocatable = dict(self._capacity.allocatable)
        node.status.capacity = dict(allocatable)
        node.status.allocatable = dict(allocatable)
        published = self._capacity.labels if self.config.publish_common_labels else {}
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
        if self._mirrored is not None and node.spec is not None:
            node.spec.unschedulable = bool((self._mirrored.get("spec") or {}).get("unschedulable"))

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
            if self._node_notify is not None:
                self._node_notify(convert_node({"metadata": {"name": self.context.node_name}}))

    # -- background ----------------------------------------------------------------
    async def _follow_pods(self) -> None:
        """The one reflector of the lower pods: list, then watch, every lower pod, re-listed
        every `resync.pods` seconds so a pod that vanished without an event is noticed. It
        feeds both consumers: the capacity snapshot (pods not ours take room; per-node usage
        for the fit check) and our pods' statuses (the pods carrying our stamps). A second
        watch of our pods by label cost each of their events twice (received, decoded: ~4 %
        of the agent's CPU in a burst)."""
        await self._ensure_owner()
        while True:
            answer = await self.lower.client.get("/api/v1/pods")
            items = answer.get("items") or []
            version = str((answer.get("metadata") or {}).get("resourceVersion", ""))
            self._lower_listed("Pod", {uid_of(o): o for o in items})
            seen = {}
            for lower in items:
                key = self._key_of(lower)
                if key is not None and not self._about_another(key, lower):
                    seen[key] = lower
            self._pods_listed = True
            for key, known in list(self._lower_pods.items()):
                if key not in seen and not newer(known, version):
                    self._vanished(key, known)
            for key, lower in seen.items():
                self._observed(key, lower)
            timeout = max(1, int(self.config.resync.pods))
            params = {"resourceVersion": version, "allowWatchBookmarks": "true"}
            try:
                async for kind, raw in self.lower.client.watch(
                    "/api/v1/pods", params, timeout_seconds=timeout
                ):
                    if kind == "ERROR":
                        break
                    if kind == "BOOKMARK":
                        continue
                    lower = msgspec.json.decode(raw)
                    self._lower_pod_changed(kind, lower)
                    key = self._key_of(lower)
                    if key is None:
                        continue
                    if kind == "DELETED":
                        self._vanished(key, lower)
                    else:
                        self._observed(key, lower)
            except ApiError as e:
                if not e.gone:
                    raise

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
        upper = to_json(given.pod)
        if last is not None:
            upper["status"] = status_up(
                last, upper, host_ip=self.context.internal_ip, now=now_rfc3339()
            )
        self._failed[key] = gone_status(upper, reason=reason, message=message, now=now_rfc3339())
        self._services_dirty.set()
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
        upper = to_json(given.pod)
        upper["status"] = status_up(
            lower, upper, host_ip=self.context.internal_ip, now=now_rfc3339()
        )
        self._failed[key] = gone_status(
            upper, reason=UNSCHEDULABLE_BELOW, message=message, now=now_rfc3339()
        )
        log.warning("pod %s: %s", key, message)
        self.context.events.pod_event(given.pod, "Warning", UNSCHEDULABLE_BELOW, message)
        if self.config.mode == "aggregate" and self._start_cannot_fit_backoff(message):
            self._spawned.spawn(self._taint_published(), name=f"taint for {key}")
        self._push(key)
        namespace, _, name = key.partition("/")
        lower_uid = str((lower.get("metadata") or {}).get("uid", ""))
        self._spawned.spawn(
            self._call(
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
            status = status_up(lower, upper, host_ip=self.context.internal_ip, now=now_rfc3339())
        if given is not None:
            namespace, name, uid = given.namespace, given.name, given.uid
        else:
            identity = upper_identity(self._lower_pods.get(key) or {})
            if identity is None:
                return None
            namespace, name, uid = identity
        return convert_pod(
            {"metadata": {"namespace": namespace, "name": name, "uid": uid}, "status": status}
        )

    def _push_gone(self, key: str, last: JSON | None) -> None:
        """Our own deletion finished: report the containers stopped, so the agent removes it,
        and drop the copies no other pod needs."""
        given = self._pods.pop(key, None)
        self._deleting.pop(key, None)
        self._release_soon()
        identity = None if last is None else upper_identity(last)
        uid = identity[2] if identity is not None else (given.uid if given is not None else "")
        if uid:
            self._drop_tokens(key, uid)
        if given is None or self._notify is None:
            return
        upper = to_json(given.pod)
        if last is not None:
            upper["status"] = status_up(
                last, upper, host_ip=self.context.internal_ip, now=now_rfc3339()
            )
        status = gone_status(upper, reason="Deleted", message="", now=now_rfc3339())
        pod = convert_pod({**upper, "status": status})
        self._notify(pod)

    async def _follow_events(self) -> None:
        """Mirror the lower cluster's Events about our lower pods onto the upper pods (the
        agent's event sink aggregates and rate-limits them). Only new ones: a restart does not
        replay history."""
        skipped = "".join(f",reason!={r}" for r in _NOT_MIRRORED)
        selector = {"fieldSelector": "involvedObject.kind=Pod" + skipped}
        answer = await self.lower.client.get("/api/v1/events", {**selector, "limit": "1"})
        version = str((answer.get("metadata") or {}).get("resourceVersion", ""))
        while True:
            params = {**selector, "resourceVersion": version, "allowWatchBookmarks": "true"}
            try:
                async for kind, raw in self.lower.client.watch(
                    "/api/v1/events", params, timeout_seconds=300
                ):
                    if kind == "ERROR":
                        return  # expired: start again from now (supervised restart)
                    event = msgspec.json.decode(raw)
                    version = str(event.get("metadata", {}).get("resourceVersion", version))
                    if kind in ("ADDED", "MODIFIED"):
                        self._mirror(event)
            except ApiError as e:
                if e.gone:
                    return
                raise

    def _mirror(self, event: Mapping[str, Any]) -> None:
        involved = event.get("involvedObject") or {}
        namespace, name = involved.get("namespace"), involved.get("name")
        # Looked up by name (the lower pod's name is the upper one), not by a scan of every
        # pod per event: with ~3 lower events per pod, a scan made a burst quadratic.
        upper_namespace = self.how.namespaces.upper(str(namespace))
        key = f"{upper_namespace}/{name}"
        lower = self._lower_pods.get(key)
        if upper_namespace is None or lower is None:
            return
        metadata = lower.get("metadata") or {}
        if (metadata.get("namespace"), metadata.get("name")) != (namespace, name) or involved.get(
            "uid"
        ) not in (None, metadata.get("uid")):
            return
        given = self._pods.get(key)
        if given is not None:
            kind: EventType = "Warning" if event.get("type") == "Warning" else "Normal"
            message = f"lower cluster: {event.get('message') or ''}".strip()
            self.context.events.pod_event(
                given.pod, kind, str(event.get("reason") or "Lower"), message
            )

    async def _resync_dependencies(self) -> None:
        await self._ensure_owner()
        while True:
            await asyncio.sleep(self.config.resync.dependencies)
            await self._sync_dependencies(relist=True)

    async def _dependencies_for(self, pod: ResolvedPod) -> None:
        """Before a pod starts, the lower copies it needs. When our copies already hold every
        object it needs at least at the version it was given (always so for a pod that needs
        nothing but its namespace), a plan would write nothing for it: only the namespace is
        made sure of. A plan covers every running pod, so planning on each start made a burst
        quadratic (17 % of the agent's CPU in a 1,000-pod burst)."""
        key = f"{pod.namespace}/{pod.name}"
        prepared = self._prepared[key] = self._prepared_pod(pod)
        namespace = self.how.lower_namespace(pod.namespace)
        async with self._deps_lock:  # a plan under way may be deleting a copy it needs
            covered = self._copies_cover(pod, prepared[3])
            if covered:
                self._services_dirty.set()  # the pods changed: so may the Services below
                try:
                    await self.lower.ensure_namespace(namespace, self.owner)
                except ApiError as e:
                    message = f"namespace {namespace}: {e.message or e.reason}"
                    raise ProviderError("LowerDependencyFailed", message, permanent=False) from None
        if not covered:
            await self._sync_dependencies(block_for=key)

    async def _release_claims(self, unused: list[Key], uids: Mapping[Key, str]) -> None:
        """Lower claims no pod uses are deleted once their upper claim is gone (or re-created:
        another UID), never while it exists: a StatefulSet pod between two lives keeps its
        data. An upper claim this agent may not read (the Node authorizer lets a node read
        only its pods' claims) is kept: not knowing is not gone."""
        if self._upper is None or self._copies is None:
            return
        for key in unused:
            identity = upper_identity(self._copies.get(key) or {})
            if identity is None:
                continue
            namespace, name, uid = identity
            path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}"
            try:
                upper = await self._upper.get(path)
            except ApiError as e:
                if not e.not_found:
                    continue
                upper = {}
            if (upper.get("metadata") or {}).get("uid") == uid:
                continue
            kind, lower_namespace, lower_name = key
            await self._call(
                self.lower.delete(kind, lower_namespace, lower_name, uid=uids.get(key))
            )
            self._copies.pop(key, None)
            log.info("lower claim %s/%s released: its upper claim is gone", *key[1:])

    def _copies_cover(self, pod: ResolvedPod, needed: set[Reference]) -> bool:
        """Whether our known lower copies hold everything `pod` needs, each ours and copied
        from the upper object at the version the pod was given or later."""
        if self._copies is None:
            return False
        lower_namespace = self.how.lower_namespace(pod.namespace)
        for ref in needed:
            if ref.kind == "ServiceAccount" and ref.name == "default":
                continue  # the lower namespace's own account
            source = pod.references.get((ref.kind, pod.namespace, ref.name))
            copy = self._copies.get(
                (ref.kind, lower_namespace, self.how.lower_name(ref.kind, ref.name))
            )
            if source is None or copy is None or not is_ours(copy, self.owner):
                return False
            copied = ((copy.get("metadata") or {}).get("annotations") or {}).get(SOURCE_VERSION)
            given = (source.get("metadata") or {}).get("resourceVersion")
            try:
                if int(str(copied)) < int(str(given)):
                    return False  # the pod was given a later version: the copy is updated
            except ValueError:
                return False
        return True

    def _release_soon(self) -> None:
        """Drop the copies no pod needs any more, once for a run of deletions: a plan covers
        every running pod, so one per deleted pod made removing a burst quadratic."""
        self._release_wanted = True
        if self._releasing is None or self._releasing.done():
            self._releasing = self._spawned.spawn(self._release(), name="release copies")

    async def _release(self) -> None:
        while self._release_wanted:
            self._release_wanted = False
            await self._sync_dependencies()

    async def _sync_dependencies(
        self, block_for: str | None = None, *, relist: bool = False
    ) -> None:
        """Make the lower copies match what the pods need; raise for `block_for`'s blockers.

        The copies we own are listed (by owner label) once and on every periodic resync, and
        otherwise known from our own writes, so starting a pod costs no list requests.
        """
        self._services_dirty.set()  # the pods changed: so may the Services they need below
        async with self._deps_lock:
            running = [
                p
                for k, p in self._pods.items()
                if self._deleting.get(k) != p.uid and k not in self._failed
            ]
            references: dict[Key, Mapping[str, Any] | None] = {}
            for pod in running:
                for key, obj in pod.references.items():
                    references[key] = newest(references.get(key), obj)
            prepared = {f"{p.namespace}/{p.name}": self._prepared_pod(p) for p in running}
            self._prepared = prepared  # drops the pods no longer running
            if self._copies is None or relist:
                copies: dict[Key, JSON] = {}
                for kind in KINDS:
                    for obj in await self._call(
                        self.lower.list_objects(kind, selector=self.owner.selector)
                    ):
                        meta = obj["metadata"]
                        copies[(kind, meta["namespace"], meta["name"])] = obj
                self._copies = copies
            plan = plan_dependencies(
                [upper for _, _, upper, _ in prepared.values()],
                references,
                self._copies,
                self.how,
                pvc_storage_class=self.config.pvc_storage_class,
                needed={k: refs for k, (_, _, _, refs) in prepared.items()},
            )
            if self._still_adopting():
                plan.delete.clear()
                plan.release.clear()
            applied = await self.lower.apply_dependencies(plan, self.owner)
            for key, obj in applied.written.items():
                if obj is None:
                    self._copies.pop(key, None)
                else:
                    self._copies[key] = obj
            if relist:  # an upper read per unused claim: at the periodic resync only
                await self._release_claims(plan.release, plan.uids)
        if block_for is None:
            return
        why = plan.blocked.get(block_for)
        if why is not None:
            permanent = "not found" not in why
            reason = "LowerDependencyConflict" if permanent else "DependencyMissing"
            raise ProviderError(reason, why, permanent=permanent)
        given = self._pods.get(block_for)
        if given is not None and applied.conflicts:
            needed = {
                (
                    r.kind,
                    self.how.lower_namespace(given.namespace),
                    self.how.lower_name(r.kind, r.name),
                )
                for r in needed_references(to_json(given.pod), self.how)
            }
            for key, message in applied.conflicts.items():
                if key in needed:
                    raise ProviderError("LowerDependencyConflict", message)
        if applied.problems:
            raise ProviderError(
                "LowerDependencyFailed", "; ".join(applied.problems), permanent=False
            )


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
