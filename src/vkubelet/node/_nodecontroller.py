"""Registers one virtual Node and keeps it alive: lease renewals, status updates, re-creation.

Ownership is explicit so that other actors' edits survive: we patch only the labels, taints and
condition types we set (the node-lifecycle controller's taints, an admin's labels and other
controllers' conditions stay), and status goes through strategic-merge patches keyed by
condition type. The labels we set (ours and the provider's `configure_node`'s) are kept current
at every status update, so a provider may change them and push a node status notification; so
are the annotations and taints `configure_node` sets and, when it states it, `spec.unschedulable`
(written only when the provider's statement changes, so an admin's cordon is not undone by every
status update).
If someone deletes the Node, the next renewal notices (its Lease is garbage collected with it)
and the Node is registered again — the reference does this only opt-in.

Conditions come from three sources, merged at every status update: the agent's own view (the
kubelet's wording; Ready follows the provider's ping), the provider's `NodeConditions`, and
`extra_conditions` (the agent's other parts, such as its kubelet API). For each type a problem
wins over health — Ready other than True, any other standard type True — so a provider's
Ready=False makes the node NotReady with the provider's reason; without a problem the agent's
own statement stands, and types only a provider knows are published as it states them. A
condition's lastTransitionTime changes only when its status does, and survives an agent restart
(it is read back from the Node). A type a provider stops stating is deleted from the Node (a
type published before an agent restart and not stated since is left alone: it may be another
actor's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from lightkube.resources.core_v1 import Node

from .. import __version__
from ..kube import LEASES, NODES, STRATEGIC_MERGE_PATCH, ApiError, KubeClient, Unreachable
from ..sdk.clock import now_micro, now_rfc3339
from ..sdk.provider import (
    NodeCondition,
    NodeConditions,
    NodeConfigurer,
    NodeProvider,
    NodeStatusNotifier,
)
from ..sdk.retry import Backoff

log = logging.getLogger(__name__)

LEASE_NAMESPACE = "kube-node-lease"
MANAGED_LABELS_ANNOTATION = "vkubelet.io/managed-labels"
MANAGED_TAINTS_ANNOTATION = "vkubelet.io/managed-taints"
MANAGED_ANNOTATIONS_ANNOTATION = "vkubelet.io/managed-annotations"
_OUR_ANNOTATIONS = (
    MANAGED_LABELS_ANNOTATION,
    MANAGED_TAINTS_ANNOTATION,
    MANAGED_ANNOTATIONS_ANNOTATION,
)
OUR_CONDITIONS = ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable")

# The agent's own view, in the kubelet's words (its node status setters).
_READY = NodeCondition("Ready", "True", "KubeletReady", "kubelet is posting ready status")
_HEALTHY = (
    NodeCondition(
        "MemoryPressure",
        "False",
        "KubeletHasSufficientMemory",
        "kubelet has sufficient memory available",
    ),
    NodeCondition(
        "DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"
    ),
    NodeCondition(
        "PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"
    ),
    NodeCondition(
        "NetworkUnavailable", "False", "RouteCreated", "the provider manages the pods' network"
    ),
)


def _is_problem(condition: NodeCondition) -> bool:
    if condition.type == "Ready":
        return condition.status != "True"
    if condition.type in OUR_CONDITIONS:
        return condition.status != "False"
    return False  # a type only the provider knows: published as stated, never "a problem"


def merge_conditions(
    own: Sequence[NodeCondition], *others: Sequence[NodeCondition]
) -> list[NodeCondition]:
    """One condition per type: the first problem any source states, else the agent's own
    statement, else the last one stated (the order of the sources, then of their lists)."""
    merged: dict[str, NodeCondition] = {c.type: c for c in own}
    ours = set(merged)
    for source in others:
        for condition in source:
            current = merged.get(condition.type)
            if current is None or (
                not _is_problem(current) and (_is_problem(condition) or condition.type not in ours)
            ):
                merged[condition.type] = condition
    return list(merged.values())


@dataclass
class NodeSettings:
    name: str
    provider: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] | None = None  # None: the default provider taint
    kubelet_port: int = 10250
    addresses: list[dict[str, str]] = field(
        default_factory=lambda: [{"type": "InternalIP", "address": "127.0.0.1"}]
    )
    os: str = "linux"
    arch: str = "amd64"
    lease_duration_seconds: int = 40
    renew_interval: float = 10.0
    status_interval: float = 60.0
    ping_interval: float = 10.0
    ping_timeout: float = 5.0
    # Consecutive failed pings before the node stops renewing its lease: one slow answer (a
    # backend busy with a burst) is not an outage. 2 x 10 s + 5 s stays within the 40 s lease.
    ping_failures: int = 2
    # Running as system:node:<name>: the NodeRestriction admission plugin then forbids most
    # labels under kubernetes.io/ and k8s.io/, and changes to the node's own taints.
    node_restricted: bool = False

    @property
    def internal_ip(self) -> str:
        found = [a["address"] for a in self.addresses if a.get("type") == "InternalIP"]
        return found[0] if found else "127.0.0.1"

    def address_list(self) -> list[str]:
        """Every address and name the node is reached at (the serving certificate's SANs)."""
        return list(dict.fromkeys([*(a["address"] for a in self.addresses), self.name]))

    def effective_taints(self) -> list[dict[str, str]]:
        if self.taints is not None:
            return self.taints
        return [
            {"key": "virtual-kubelet.io/provider", "value": self.provider, "effect": "NoSchedule"}
        ]

    def effective_labels(self) -> dict[str, str]:
        labels = {
            "type": "virtual-kubelet",
            "kubernetes.io/role": "agent",
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": self.os,
            "kubernetes.io/arch": self.arch,
            "beta.kubernetes.io/os": self.os,
            "beta.kubernetes.io/arch": self.arch,
            **self.labels,
        }
        if self.node_restricted:
            return {k: v for k, v in labels.items() if node_may_set_label(k)}
        return labels


_NODE_LABEL_NAMESPACES = ("kubernetes.io/", "k8s.io/")
_NODE_ALLOWED_LABELS = {
    "kubernetes.io/hostname",
    "kubernetes.io/arch",
    "kubernetes.io/os",
    "beta.kubernetes.io/arch",
    "beta.kubernetes.io/os",
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "failure-domain.beta.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
}
_NODE_ALLOWED_PREFIXES = ("kubelet.kubernetes.io/", "node.kubernetes.io/")


def node_may_set_label(key: str) -> bool:
    """What NodeRestriction lets a node set on itself (the kubelet's own rule)."""
    prefix, slash, _ = key.rpartition("/")
    if not slash:
        return True
    namespace = prefix + "/"
    restricted = any(
        namespace == ns or namespace.endswith("." + ns) for ns in _NODE_LABEL_NAMESPACES
    )
    return (
        not restricted
        or key in _NODE_ALLOWED_LABELS
        or any(key.startswith(p) for p in _NODE_ALLOWED_PREFIXES)
    )


class NodeController:
    def __init__(
        self,
        client: KubeClient,
        settings: NodeSettings,
        provider: object,
        *,
        extra_conditions: Sequence[NodeConditions] = (),
    ) -> None:
        self._client = client
        self.settings = settings
        self._provider = provider
        self._extra_conditions = tuple(extra_conditions)
        # condition type -> (status, lastTransitionTime) as last published
        self._transitions: dict[str, tuple[str, str]] = {}
        self._published: set[str] = set()  # condition types the API has from us
        self._path = NODES.path(name=settings.name)
        self._lease_path = LEASES.path(LEASE_NAMESPACE, settings.name)
        self._wake = asyncio.Event()
        self.uid: str | None = None
        self.healthy = True
        self.ping_error: str | None = None
        self.registered = asyncio.Event()
        self.allocatable: dict[str, str] = {}
        self._labels: dict[str, str] | None = None  # the labels we set, as last written
        self._annotations: dict[str, str] = {}  # the provider's annotations, as last written
        self._taints: list[dict[str, str]] | None = None  # the taints we set, as last written
        self._unschedulable: bool | None = None  # the provider's statement, as last written
        self.renewals = 0
        self.late_renewals = 0  # renewals that happened later than renew_interval * 1.5

    # -- desired state ------------------------------------------------------------------------
    def desired(self) -> dict[str, Any]:
        """The Node as we want it, after the provider has had its say (capacity, addresses...)."""
        s = self.settings
        node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": s.name, "labels": s.effective_labels()},
            "spec": {"taints": s.effective_taints()},
            "status": {
                "capacity": {"cpu": "20", "memory": "100Gi", "pods": "110"},
                "allocatable": {},
                "addresses": s.addresses,
                "daemonEndpoints": {"kubeletEndpoint": {"Port": s.kubelet_port}},
                "nodeInfo": {
                    "architecture": s.arch,
                    "operatingSystem": s.os,
                    "kubeletVersion": f"v1.37.0-vkubelet-{__version__}",
                    "kernelVersion": platform.release(),
                    "osImage": f"vkubelet {s.provider} provider",
                    "containerRuntimeVersion": f"vkubelet://{s.provider}",
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kubeProxyVersion": "",
                },
            },
        }
        if isinstance(self._provider, NodeConfigurer):
            typed = msgspec.convert(node, Node)
            self._provider.configure_node(typed)
            node = msgspec.to_builtins(typed)
            node["metadata"].pop("creationTimestamp", None)
            node["metadata"]["annotations"] = {
                k: str(v)
                for k, v in (node["metadata"].get("annotations") or {}).items()
                if k not in _OUR_ANNOTATIONS
            }
            node["spec"]["taints"] = node["spec"].get("taints") or []
            if s.node_restricted:  # the provider's labels too: NodeRestriction would refuse
                labels = node["metadata"].get("labels") or {}
                node["metadata"]["labels"] = {
                    k: v for k, v in labels.items() if node_may_set_label(k)
                }
        status = node["status"]
        if not status.get("allocatable"):
            status["allocatable"] = dict(status["capacity"])
        self.allocatable = dict(status["allocatable"])
        return node

    def conditions(self) -> list[NodeCondition]:
        """The node's conditions as they should be published now (merged, without times)."""
        sources: list[Sequence[NodeCondition]] = []
        for source in (self._provider, *self._extra_conditions):
            if isinstance(source, NodeConditions):
                try:
                    sources.append(list(source.node_conditions()))
                except Exception as e:  # a provider's bug must not stop the node's heartbeat
                    log.warning("node %s: node_conditions failed: %s", self.settings.name, e)
        merged = merge_conditions([_READY, *_HEALTHY], *sources)
        if self.healthy:
            return merged
        # A failing ping makes the node NotReady; a provider that states its own Ready problem
        # (which backend is unreachable, say) explains it better than the ping's error does.
        unhealthy = NodeCondition(
            "Ready", "False", "ProviderUnhealthy", f"provider ping failed: {self.ping_error}"
        )
        return [unhealthy if c.type == "Ready" and not _is_problem(c) else c for c in merged]

    def _conditions(self) -> list[dict[str, str]]:
        """The conditions to publish, with their times, and a delete directive for each type
        we published before but no source states any more (a strategic merge patch would
        otherwise keep it forever)."""
        now = now_rfc3339()
        current = self.conditions()
        published: list[dict[str, str]] = []
        for kind in sorted(self._published - {c.type for c in current}):
            published.append({"type": kind, "$patch": "delete"})
            self._transitions.pop(kind, None)
        for condition in current:
            previous = self._transitions.get(condition.type)
            since = previous[1] if previous and previous[0] == condition.status else now
            self._transitions[condition.type] = (condition.status, since)
            published.append(
                {
                    "type": condition.type,
                    "status": condition.status,
                    "reason": condition.reason,
                    "message": condition.message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": since,
                }
            )
        return published

    def _remember_transitions(self, node: dict[str, Any]) -> None:
        """Keep the transition times of an existing Node (an agent restart is no transition)."""
        for condition in (node.get("status") or {}).get("conditions") or []:
            kind, status = condition.get("type"), condition.get("status")
            since = condition.get("lastTransitionTime")
            if kind and status and since and kind not in self._transitions:
                self._transitions[kind] = (status, since)

    # -- registration -------------------------------------------------------------------------
    async def register(self) -> None:
        """Create the Node, or take over an existing one without clobbering others' edits."""
        desired = self.desired()
        labels = desired["metadata"]["labels"]
        taints = desired["spec"]["taints"]
        provided = dict(desired["metadata"].get("annotations") or {})
        desired["metadata"]["annotations"] = {
            **provided,
            MANAGED_LABELS_ANNOTATION: ",".join(sorted(labels)),
            MANAGED_TAINTS_ANNOTATION: ",".join(sorted(_taint_id(t) for t in taints)),
            MANAGED_ANNOTATIONS_ANNOTATION: ",".join(sorted(provided)),
        }
        current: dict[str, Any] | None = None
        try:
            current = await self._client.get(self._path)
        except ApiError as e:
            if not e.not_found:
                raise
            desired["status"]["conditions"] = self._conditions()
            created = await self._client.create(NODES.path(), desired)
            self.uid = created["metadata"]["uid"]
            # Status in a create is dropped by the apiserver: set it through the subresource.
            await self._patch_status(desired["status"])
            log.info("registered node %s", self.settings.name)
        else:
            self._remember_transitions(current)
            await self._adopt(current, desired)
        self._labels = dict(labels)
        self._annotations = provided
        self._taints = [dict(t) for t in taints]
        self._unschedulable = desired["spec"].get("unschedulable")
        self.registered.set()
        await self._ensure_lease(renew_first=current is not None)

    async def _adopt(self, current: dict[str, Any], desired: dict[str, Any]) -> None:
        """Patch only the labels/taints we manage; drop ones we set earlier but no longer want."""
        for _ in range(5):
            meta = current["metadata"]
            annotations = meta.get("annotations") or {}
            labels = _dropping(
                desired["metadata"]["labels"], _managed(annotations, MANAGED_LABELS_ANNOTATION)
            )
            wanted_annotations = _dropping(
                desired["metadata"]["annotations"],
                _managed(annotations, MANAGED_ANNOTATIONS_ANNOTATION),
            )
            ours = desired["spec"]["taints"]
            mine = _managed(annotations, MANAGED_TAINTS_ANNOTATION) | {_taint_id(t) for t in ours}
            present = (current.get("spec") or {}).get("taints") or []
            kept = [t for t in present if _taint_id(t) not in mine]
            patch: dict[str, Any] = {
                "metadata": {
                    "resourceVersion": meta["resourceVersion"],  # optimistic concurrency
                    "labels": labels,
                    "annotations": wanted_annotations,
                },
            }
            if _taint_set(kept + ours) != _taint_set(present):
                # Only when they differ: NodeRestriction refuses a node any taint change.
                patch["spec"] = {"taints": kept + ours}
            unschedulable = desired["spec"].get("unschedulable")
            if unschedulable is not None:
                patch.setdefault("spec", {})["unschedulable"] = unschedulable
            if not _shows(current, patch):  # it mostly does: an agent restart
                try:
                    current = await self._client.patch(self._path, patch)
                except ApiError as e:
                    if not e.conflict:
                        raise
                    current = await self._client.get(self._path)
                    continue
            self.uid = current["metadata"]["uid"]
            await self._patch_status(desired["status"])
            log.info("took over existing node %s", self.settings.name)
            return
        raise RuntimeError(f"node {self.settings.name}: too many conflicting updates")

    async def _follow_labels(
        self, labels: dict[str, str], annotations: dict[str, str] | None = None
    ) -> None:
        """Keep the labels we set current after registration (a provider's `configure_node`
        may publish labels that change, such as those common to a lower cluster's nodes), and
        the provider's annotations likewise.

        Only keys we set are written or removed, and the managed-labels (managed-annotations)
        annotation is rewritten with them, so a label an admin added is never touched, now or
        after a restart.
        """
        annotations = self._annotations if annotations is None else annotations
        if self._labels is None or (labels, annotations) == (self._labels, self._annotations):
            return
        patch = _dropping(labels, self._labels)
        written: dict[str, str | None] = {MANAGED_LABELS_ANNOTATION: ",".join(sorted(labels))}
        if annotations != self._annotations:
            written.update(_dropping(annotations, self._annotations))
            written[MANAGED_ANNOTATIONS_ANNOTATION] = ",".join(sorted(annotations))
        await self._client.patch(
            self._path, {"metadata": {"labels": patch, "annotations": written}}
        )
        if labels != self._labels:
            log.info("node %s: labels now %s", self.settings.name, sorted(labels.items()))
        self._labels = dict(labels)
        self._annotations = dict(annotations)

    async def _follow_spec(self, taints: list[dict[str, str]], unschedulable: bool | None) -> None:
        """Keep the taints we set (the provider's too) current, leaving others' taints alone,
        and write `spec.unschedulable` when the provider's statement changes (a lower node
        cordoned, say); an admin's cordon stands until the provider states something new."""
        if self._taints is None:
            return
        taints_changed = _taint_set(taints) != _taint_set(self._taints)
        cordon_changed = unschedulable is not None and unschedulable != self._unschedulable
        if not taints_changed and not cordon_changed:
            return
        spec: dict[str, Any] = {}
        annotations: dict[str, str] = {}
        if cordon_changed:
            spec["unschedulable"] = unschedulable
        for _ in range(5):
            current = await self._client.get(self._path)
            if taints_changed:
                mine = {_taint_id(t) for t in self._taints} | {_taint_id(t) for t in taints}
                present = (current.get("spec") or {}).get("taints") or []
                spec["taints"] = [t for t in present if _taint_id(t) not in mine] + taints
                annotations[MANAGED_TAINTS_ANNOTATION] = ",".join(
                    sorted(_taint_id(t) for t in taints)
                )
            patch: dict[str, Any] = {
                "metadata": {
                    "resourceVersion": current["metadata"]["resourceVersion"],
                    "annotations": annotations,
                },
                "spec": spec,
            }
            try:
                await self._client.patch(self._path, patch)
            except ApiError as e:
                if not e.conflict:
                    raise
                continue
            self._taints = [dict(t) for t in taints]
            if unschedulable is not None:
                self._unschedulable = unschedulable
                log.info("node %s: unschedulable now %s", self.settings.name, unschedulable)
            return
        raise RuntimeError(f"node {self.settings.name}: too many conflicting updates")

    async def _patch_status(self, status: dict[str, Any]) -> None:
        conditions = self._conditions()
        await self._client.heartbeat(
            f"{self._path}/status",
            {"status": {**status, "conditions": conditions}},
            content_type=STRATEGIC_MERGE_PATCH,
        )
        self._published = {c["type"] for c in conditions if "$patch" not in c}

    async def _ensure_lease(self, *, renew_first: bool = False) -> None:
        """Create the node's Lease, or renew an existing one. `renew_first` (the Node existed:
        a restart, mostly): one renewal that also points the lease at this Node, instead of a
        create refused as a conflict and two patches."""
        owners = [{"apiVersion": "v1", "kind": "Node", "name": self.settings.name, "uid": self.uid}]
        if renew_first:
            try:
                await self._client.heartbeat(
                    self._lease_path,
                    {"metadata": {"ownerReferences": owners}, "spec": self._lease_spec()},
                )
                return
            except ApiError as e:
                if not e.not_found:
                    raise
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.settings.name,
                "namespace": LEASE_NAMESPACE,
                "ownerReferences": owners,
            },
            "spec": self._lease_spec(),
        }
        try:
            await self._client.create(LEASES.path(LEASE_NAMESPACE), lease)
        except ApiError as e:
            if not e.conflict:
                raise
            # An existing lease may belong to an earlier Node object of the same name (deleted
            # and registered again): point it at this one, or garbage collection deletes it.
            await self._client.patch(
                self._lease_path,
                {"metadata": {"ownerReferences": owners}},
            )
            await self._renew()

    def _lease_spec(self) -> dict[str, Any]:
        return {
            "holderIdentity": self.settings.name,
            "leaseDurationSeconds": self.settings.lease_duration_seconds,
            "renewTime": now_micro(),
        }

    async def _renew(self) -> None:
        await self._client.heartbeat(self._lease_path, {"spec": self._lease_spec()})

    # -- loops ----------------------------------------------------------------------------------
    def notify_status_changed(self) -> None:
        """Ask for a status update now (provider push, health change)."""
        self._wake.set()

    async def run(self) -> None:
        """Register (retrying until it works), then run the lease, status and ping loops."""
        backoff = Backoff(initial=0.5, cap=30.0)
        while not self.registered.is_set():
            try:
                await self.register()
            except (ApiError, Unreachable) as e:
                delay = backoff.next_delay()
                log.warning(
                    "node %s: registration failed (%s); retrying in %.1fs",
                    self.settings.name,
                    e,
                    delay,
                )
                await asyncio.sleep(delay)
        for source in (self._provider, *self._extra_conditions):
            if isinstance(source, NodeStatusNotifier):
                source.notify_node_status(lambda _node: self.notify_status_changed())
        async with asyncio.TaskGroup() as group:
            group.create_task(self._lease_loop())
            group.create_task(self._status_loop())
            if isinstance(self._provider, NodeProvider):
                group.create_task(self._ping_loop())

    async def _lease_loop(self) -> None:
        interval = self.settings.renew_interval
        loop = asyncio.get_running_loop()
        # Spread many nodes' renewals over the interval instead of renewing them all at once.
        await asyncio.sleep(random.uniform(0, interval))  # noqa: S311
        last = loop.time()
        while True:
            if not self.healthy:
                last = loop.time()  # renewals stopped on purpose: the next one is not late
            else:
                try:
                    await self._renew()
                except (ApiError, Unreachable) as e:
                    await self._failed("lease renewal", e, gone="its Lease is gone")
                else:
                    now = loop.time()
                    if self.renewals and now - last > interval * 1.5:
                        self.late_renewals += 1
                    last = now
                    self.renewals += 1
            # Keep the rhythm from the last renewal, not from the end of this one: a slow
            # round-trip must not push every later renewal back by as much.
            await asyncio.sleep(max(0.0, last + interval - loop.time()))

    async def _status_loop(self) -> None:
        while True:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives just
            # as the awaited call completes, and the loop would then never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.status_interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                desired = self.desired()
                try:
                    await self._follow_labels(
                        desired["metadata"]["labels"], desired["metadata"].get("annotations")
                    )
                    await self._follow_spec(
                        desired["spec"]["taints"], desired["spec"].get("unschedulable")
                    )
                except (ApiError, RuntimeError) as e:
                    if isinstance(e, ApiError) and e.not_found:
                        raise
                    # A refused label (NodeRestriction, say) must not stop status updates.
                    log.warning("node %s: label update failed: %s", self.settings.name, e)
                await self._patch_status(desired["status"])
            except (ApiError, Unreachable) as e:
                await self._failed("status update", e, gone="the Node object is gone")

    async def _failed(self, what: str, e: ApiError | Unreachable, *, gone: str) -> None:
        """A heartbeat that failed; a 404 says the Node was deleted (its Lease with it)."""
        if isinstance(e, ApiError) and e.not_found:
            await self._reregister(gone)
        else:
            log.warning("node %s: %s failed: %s", self.settings.name, what, e)

    async def _ping_loop(self) -> None:
        assert isinstance(self._provider, NodeProvider)
        failures = 0
        while True:
            try:
                async with asyncio.timeout(self.settings.ping_timeout):  # not wait_for: see above
                    await self._provider.ping()
            except Exception as e:
                failures += 1
                why = str(e) or (
                    f"no answer within {self.settings.ping_timeout:g} s"
                    if isinstance(e, TimeoutError)
                    else type(e).__name__
                )
                if self.healthy and failures >= self.settings.ping_failures:
                    log.warning(
                        "node %s: provider ping failed %d times: %s; stopping lease renewals",
                        self.settings.name,
                        failures,
                        why,
                    )
                    self.ping_error = why
                    self.healthy = False
                    self.notify_status_changed()
                elif self.healthy:
                    log.info("node %s: provider ping failed: %s", self.settings.name, why)
            else:
                failures = 0
                if not self.healthy:
                    log.info("node %s: provider healthy again", self.settings.name)
                    self.healthy = True
                    self.ping_error = None
                    self.notify_status_changed()
                    with contextlib.suppress(ApiError, Unreachable):
                        await self._renew()
            await asyncio.sleep(self.settings.ping_interval)

    async def _reregister(self, why: str) -> None:
        log.warning("node %s: %s; registering it again", self.settings.name, why)
        try:
            self.registered.clear()
            await self.register()
        except (ApiError, Unreachable) as e:
            log.warning("node %s: re-registration failed: %s", self.settings.name, e)


def _shows(current: dict[str, Any], patch: dict[str, Any]) -> bool:
    """Whether the Node `current` already has what the takeover `patch` would write."""
    meta = current.get("metadata") or {}
    for part in ("labels", "annotations"):
        present = meta.get(part) or {}
        if any(present.get(k) != v for k, v in patch["metadata"].get(part, {}).items()):
            return False
    spec = current.get("spec") or {}
    wanted = patch.get("spec") or {}
    if "taints" in wanted:
        return False  # only there when they differ
    return "unschedulable" not in wanted or bool(spec.get("unschedulable")) == bool(
        wanted["unschedulable"]
    )


def _managed(annotations: dict[str, str], key: str) -> set[str]:
    """What one of our managed-* annotations lists (label keys, annotation keys, taint ids)."""
    return set(filter(None, annotations.get(key, "").split(",")))


def _dropping(wanted: dict[str, str], before: Iterable[str]) -> dict[str, str | None]:
    """`wanted`, with a null (a merge patch's removal) for each key of `before` not wanted."""
    return {**dict.fromkeys(set(before) - set(wanted)), **wanted}


def _taint_set(taints: list[dict[str, str]]) -> set[tuple[str, str, str]]:
    return {(t.get("key", ""), t.get("value", ""), t.get("effect", "")) for t in taints}


def _taint_id(taint: dict[str, str]) -> str:
    return f"{taint.get('key')}:{taint.get('effect')}"
