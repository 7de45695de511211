"""The cluster provider's shared state and owner identity (`ClusterProvider` is built on it)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from lightkube.resources.core_v1 import Node, Pod

from ...kube import ApiError
from ...sdk.provider import ProviderContext, ProviderError, ResolvedPod, UpperAPI
from ...sdk.tasks import TaskSet
from ...streaming import Endpoint
from ._capacity import LowerCapacity
from ._config import LowerConfig
from ._convert import JSON, convert_node, to_json
from ._deps import Key
from ._fit import NodeUsage
from ._lower import LowerCluster
from ._refs import Reference
from ._stamps import Owner
from ._translate import PodTranslation, needed_references

__all__ = ["ProviderCore"]

log = logging.getLogger(__name__)


# A pod as handed over, the translation settings, its JSON and the references it needs below.
Prepared = tuple[ResolvedPod, PodTranslation, JSON, set[Reference]]


# How long plans wait, after a start, for the agent to hand back the pods found running below.
ADOPTION_WAIT = 300.0


class ProviderCore:
    """The state every part of the provider shares, the owner stamps settled from the upper
    cluster's identity, and the translation of lower API refusals into pod reasons."""

    def __init__(
        self,
        config: LowerConfig,
        context: ProviderContext,
        lower: LowerCluster,
        *,
        background: bool = True,
        lower_node: str | None = None,
    ) -> None:
        """`background=False` leaves out the watch, capacity and resync loops (unit tests).
        `lower_node`: mirror mode, this virtual node stands for that one lower node."""
        self.config = config
        self._background = background
        self.context = context
        self.lower = lower
        self.owner = Owner(config.upper_cluster_id or "", context.node_name)
        self.how = PodTranslation(
            owner=self.owner,
            namespaces=config.namespaces,
            dependency_names=config.dependency_names,
            service_accounts=config.service_accounts,
            service_account_tokens=config.service_account_tokens,
            virtual_labels={"type": "virtual-kubelet", "kubernetes.io/hostname": context.node_name},
            lower_node=lower_node,
            virtual_topology_keys=(config.cluster_label,) if config.cluster_label else (),
        )
        self._lower_node = lower_node
        self._mirrored: JSON | None = None  # mirror mode: that lower node, as last seen
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
        self._capacity = LowerCapacity(allocatable={})
        self._capacity_known = False  # aggregate mode: computed from a listing once
        # The watch caches of every lower node (the capacity loop's) and pod (the one lower pod
        # reflector's, `_follow_pods`): kind -> UID -> object, as listed so far; the snapshot
        # (capacity, fit check) is the same once both kinds have been listed, else None.
        self._listed: dict[str, dict[str, JSON]] = {}
        self._snapshot: dict[str, dict[str, JSON]] | None = None
        self._deleted_nodes: set[str] = set()  # lower nodes the node watch saw deleted
        self._lower_changed = asyncio.Event()  # a lower node or pod changed: recompute
        self._usage: NodeUsage | None = None  # the snapshot's pods' requests per lower node
        self._cannot_fit_until = 0.0  # loop time until which the node carries the taint
        self._cannot_fit_backoff = 0.0  # the current taint length (doubles while failing)
        self._no_usable_reported = False  # see CapacityFollowing._explain_no_usable_node
        self._unreachable: str | None = None
        self._denied: str | None = None  # missing lower permissions, as MissingPermissions says
        self._tasks: list[asyncio.Task[None]] = []
        self._spawned = TaskSet(f"cluster {context.node_name}")
        self._deps_lock = asyncio.Lock()
        self._copies: dict[Key, JSON] | None = None  # our lower dependency copies
        self._prepared: dict[str, Prepared] = {}  # see _prepared_pod
        self._releasing: asyncio.Task[None] | None = None  # see ClusterProvider._release_soon
        self._release_wanted = False
        # Pods whose lower pod this agent created lately (loop time) and whose Pending status
        # is being held back (see ClusterProvider._hold_pending).
        self._created_at: dict[str, float] = {}
        self._held: set[str] = set()
        # Pods whose lower pod the lower scheduler cannot place: since when (loop time), with
        # the upper UID (see ClusterProvider._check_unschedulable).
        self._unschedulable: dict[str, tuple[float, str]] = {}
        self._stream_endpoint: Endpoint | None = None
        self._scrape_errors: dict[str, str] = {}  # lower node -> its last stats error
        # The upper cluster, when the agent hands us its client (`use_upper_api`): Services to
        # reflect, the default upper cluster ID.
        self._upper: UpperAPI | None = None
        self._owner_known = config.upper_cluster_id is not None
        self._owner_lock = asyncio.Lock()
        self._identity_problem: str | None = None
        self._upper_services: dict[tuple[str, str], JSON] = {}  # upper (namespace, name)
        self._upper_services_listed = asyncio.Event()
        self._lower_services: dict[tuple[str, str], JSON] | None = None  # ours, lower key
        self._services_dirty = asyncio.Event()
        self._service_conflicts: set[tuple[str, str]] = set()  # reported once each
        # serviceAccountTokens: upper -- upper pod "namespace/name" -> (UID, when to mint again)
        self._token_due: dict[str, tuple[str, float]] = {}
        self._token_check = 5.0  # seconds between looks for tokens due

    def _prepared_pod(self, pod: ResolvedPod) -> Prepared:
        """The pod as JSON and the references its lower pod needs, worked out once per pod the
        agent hands over (and translation settings), not on every plan."""
        key = f"{pod.namespace}/{pod.name}"
        known = self._prepared.get(key)
        if known is not None and known[0] is pod and known[1] is self.how:
            return known
        upper = to_json(pod.pod)
        return (pod, self.how, upper, needed_references(upper, self.how))

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
        self._upper = api

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
                    if self._node_notify is not None:
                        self._node_notify(
                            convert_node({"metadata": {"name": self.context.node_name}})
                        )
                    raise ProviderError(
                        "UpperClusterIDUnknown", self._identity_problem, permanent=False
                    ) from None
                cluster_id = str((found.get("metadata") or {}).get("uid") or "")
            self.owner = Owner(cluster_id, self.context.node_name)
            self.how = dataclasses.replace(self.how, owner=self.owner)
            self._identity_problem = None
            self._owner_known = True
            log.info("node %s: upper cluster ID %r", self.context.node_name, cluster_id)

    async def _call(self, action: Any, *, what: str = "") -> Any:
        """Await a lower API call; the lower API's refusals become the pod's reason."""
        try:
            return await action
        except ApiError as e:
            if e.status == 403 and "service account" in e.message and "not found" in e.message:
                # A namespace just created below gets its `default` account a moment later.
                raise ProviderError(
                    "LowerServiceAccountPending",
                    f"lower cluster: {what or 'request'}: {e.message}",
                    permanent=False,
                ) from None
            if e.status == 404 and "namespaces" in e.message:
                raise ProviderError(
                    "LowerNamespaceMissing",
                    f"lower cluster: {what or 'request'}: {e.message}",
                    permanent=not self.config.namespaces.create,  # else: re-created, retried
                ) from None
            if e.status in (400, 403, 422) or (e.status == 404 and what):
                raise ProviderError(
                    "LowerRejected" if e.status != 403 else "LowerForbidden",
                    f"lower cluster: {what or 'request'}: {e.message or e.reason}",
                ) from None
            raise
