"""Following the lower nodes and pods for the virtual node's capacity and labels (`_capacity`),
and the aggregate node's fit check against that cached snapshot (`_fit`).

A pod no single lower node can take is refused at create (`LowerClusterCannotFit`, permanent:
the agent marks it Failed and records an Event with the message), so its controller replaces it.
The upper scheduler would bind the replacement to the same virtual node at once, whose summed
allocatable still "fits" it, and the controller would hammer the node with pods failing in a
loop. So the refusal also puts a NoSchedule taint `vkubelet.io/lower-cannot-fit` on the virtual
node for `cannotFitBackoff` seconds (doubling, up to 16x, while refusals keep coming; back to
the base once a pod fits): the replacement then goes to another node that fits, or waits Pending
upstairs with the scheduler's own reason, and is retried here once the taint is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterable
from fractions import Fraction

import msgspec

from ...kube import ApiError, Unreachable
from ...sdk.provider import ProviderError
from ._capacity import (
    LowerCapacity,
    format_quantity,
    lower_capacity,
    mirror_capacity,
    pod_requests,
)
from ._convert import JSON, convert_node, uid_of
from ._core import ProviderCore
from ._fit import NodeUsage, fit_verdict, largest_free
from ._stamps import is_ours

CANNOT_FIT = "LowerClusterCannotFit"
CANNOT_FIT_TAINT = {"key": "vkubelet.io/lower-cannot-fit", "effect": "NoSchedule"}
LARGEST_FREE_ANNOTATION = "vkubelet.io/largest-free"
_MAX_BACKOFF_FACTOR = 16

__all__ = ["CANNOT_FIT", "CANNOT_FIT_TAINT", "LARGEST_FREE_ANNOTATION", "CapacityFollowing"]

log = logging.getLogger(__name__)


class CapacityFollowing(ProviderCore):
    """The virtual node's capacity and labels, following the lower nodes and pods."""

    async def _follow_capacity(self) -> None:
        """Keep the capacity current: list, then watch, the lower nodes (re-listed every
        `resync.nodes` seconds), and recompute (at most once a second) on every change of
        them or of the lower pods, which the one lower pod reflector (`_follow_pods`) keeps in
        the same snapshot. A cordon or a new pod below shows upstairs within seconds."""
        await self._ensure_owner()
        while True:
            answer = await self.lower.client.get("/api/v1/nodes")
            nodes = {uid_of(o): o for o in answer.get("items") or []}
            version = str((answer.get("metadata") or {}).get("resourceVersion", ""))
            self._lower_listed("Node", nodes)
            timeout = max(1, int(self.config.resync.nodes))
            async with asyncio.TaskGroup() as group:
                group.create_task(self._watch_nodes(version, nodes, timeout))
                group.create_task(self._recompute(timeout))

    def _lower_listed(self, kind: str, objects: dict[str, JSON]) -> None:
        """A fresh listing of the lower nodes or pods (UID -> object) becomes the snapshot's;
        the snapshot exists once both have been listed."""
        self._listed[kind] = objects
        if kind == "Pod":
            self._usage = NodeUsage(objects.items())
        if len(self._listed) == 2:
            self._snapshot = self._listed
            if self._lower_node is not None:
                self._follow_mirrored(self._listed)  # with the listing: no moment "gone"
        self._lower_changed.set()

    def _lower_pod_changed(self, kind: str, pod: JSON) -> None:
        """A lower pod watch event, for the capacity's snapshot and per-node usage."""
        pods = self._listed.get("Pod")
        if pods is None:
            return
        key = uid_of(pod)
        if kind == "DELETED":
            pods.pop(key, None)
            if self._usage is not None:
                self._usage.drop(key)
        else:
            pods[key] = pod
            if self._usage is not None:
                self._usage.put(key, pod)
            meta = pod.get("metadata") or {}
            if (
                meta.get("deletionTimestamp")
                and self._on_gone_node(pod)
                and is_ours(pod, self.owner)
            ):
                self._spawned.spawn(self._force_delete(meta), name=f"force-delete {key} below")
        self._lower_changed.set()

    def _on_gone_node(self, pod: JSON) -> bool:
        """Bound to a lower node whose deletion the node watch reported."""
        return (pod.get("spec") or {}).get("nodeName") in self._deleted_nodes

    async def _watch_nodes(self, version: str, into: dict[str, JSON], seconds: int) -> None:
        """Keep `into` as the lower node watch tells."""
        params = {"resourceVersion": version, "allowWatchBookmarks": "true"}
        try:
            async for kind, raw in self.lower.client.watch(
                "/api/v1/nodes", params, timeout_seconds=seconds
            ):
                if kind == "ERROR":
                    return
                if kind == "BOOKMARK":
                    continue
                obj = msgspec.json.decode(raw)
                if kind == "DELETED":
                    into.pop(uid_of(obj), None)
                    self._lower_node_deleted(obj)
                else:
                    into[uid_of(obj)] = obj
                    self._deleted_nodes.discard((obj.get("metadata") or {}).get("name", ""))
                self._lower_changed.set()
        except ApiError as e:
            if not e.gone:
                raise

    def _lower_node_deleted(self, node: JSON) -> None:
        """Our lower pods being deleted on a node that is now gone: no kubelet is left to end
        them, so their graceful deletion would wait for the lower pod garbage collector (40 s
        and more; a mirrored node's drain with it). They are deleted at once, by UID. A
        deletion seen before the node's is the case here; one seen after is in
        `_lower_pod_changed`, and one that starts after asks for no grace (`_on_vanished_node`)."""
        where = (node.get("metadata") or {}).get("name")
        if where:
            self._deleted_nodes.add(str(where))
        pods = self._listed.get("Pod") or {}
        for pod in list(pods.values()):
            meta = pod.get("metadata") or {}
            if (
                where
                and (pod.get("spec") or {}).get("nodeName") == where
                and meta.get("deletionTimestamp")
                and is_ours(pod, self.owner)
            ):
                where_pod = f"{meta.get('namespace')}/{meta.get('name')}"
                self._spawned.spawn(
                    self._force_delete(meta), name=f"force-delete {where_pod} below"
                )

    async def _force_delete(self, meta: JSON) -> None:
        try:
            await self.lower.delete(
                "Pod",
                str(meta.get("namespace")),
                str(meta.get("name")),
                grace_period=0,
                uid=str(meta.get("uid", "")),
            )
        except (ApiError, Unreachable) as e:  # the lower pod GC still ends it, later
            log.warning(
                "lower pod %s/%s on a vanished node: cannot delete it now: %s",
                meta.get("namespace"),
                meta.get("name"),
                e,
            )

    async def _recompute(self, seconds: int) -> None:
        changed = self._lower_changed
        deadline = asyncio.get_running_loop().time() + seconds
        changed.set()
        while asyncio.get_running_loop().time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=1.0)
            if not changed.is_set():
                continue
            changed.clear()
            objects, usage = self._snapshot, self._usage
            if objects is None or usage is None:
                continue  # the first listing of both kinds sets `changed` again
            if self._lower_node is not None:
                self._follow_mirrored(objects)
                await asyncio.sleep(1.0)
                continue
            capacity = dataclasses.replace(
                lower_capacity(
                    objects["Node"].values(),
                    objects["Pod"].values(),
                    lambda p: is_ours(p, self.owner),
                    label_excluded=self.config.label_excluded,
                ),
                largest_free=largest_free(objects["Node"].values(), usage),
            )
            if capacity != self._capacity or not self._capacity_known:
                self._explain_no_usable_node(objects["Node"].values(), capacity)
                self._capacity, self._capacity_known = capacity, True
                if self._node_notify is not None:
                    self._node_notify(convert_node({"metadata": {"name": self.context.node_name}}))
            await asyncio.sleep(1.0)  # at most one recomputation a second

    def _explain_no_usable_node(self, nodes: Iterable[JSON], capacity: LowerCapacity) -> None:
        """A node with no capacity only says "Too many pods" to the upper scheduler. When the
        lower cluster has Ready nodes but none counts (cordoned, or tainted NoSchedule or
        NoExecute: the mock provider's nodes are, by default), say which, once per change."""
        ready = [n for n in nodes if _ready(n)]
        if capacity.usable_nodes or not ready:
            self._no_usable_reported = False
            return
        if self._no_usable_reported:
            return
        self._no_usable_reported = True
        names = ", ".join(sorted(str((n.get("metadata") or {}).get("name")) for n in ready)[:5])
        message = (
            f"no lower node counts for capacity: {len(ready)} Ready node(s) ({names}) are all "
            "cordoned or tainted NoSchedule/NoExecute; the virtual node's capacity is zero"
        )
        log.warning("node %s: %s", self.context.node_name, message)
        self.context.events.node_event(
            self.context.node_name, "Warning", "NoUsableLowerNode", message
        )

    def _follow_mirrored(self, objects: dict[str, dict[str, JSON]]) -> None:
        """Mirror mode: this virtual node's capacity, labels, cordon and readiness follow its
        one lower node (pods not ours subtracted)."""
        node = next(
            (
                n
                for n in objects["Node"].values()
                if (n.get("metadata") or {}).get("name") == self._lower_node
            ),
            None,
        )
        capacity = (
            LowerCapacity(allocatable={}, labels=self._capacity.labels)  # gone: keep its labels
            if node is None
            else mirror_capacity(
                node,
                objects["Pod"].values(),
                lambda p: is_ours(p, self.owner),
                label_excluded=self.config.label_excluded,
            )
        )
        before = (self._capacity, _node_state(self._mirrored))
        self._capacity, self._mirrored = capacity, node
        if (capacity, _node_state(node)) != before:
            self._notify_node()

    # -- the fit check (aggregate mode) ---------------------------------------------------------
    async def _check_fit(self, body: JSON) -> None:
        """Refuse `body` (the lower pod about to be created) when no single lower node of the
        snapshot can take it. No snapshot yet, or the check turned off: let the lower
        scheduler decide."""
        if not self.config.fit_check or self._snapshot is None or self._lower_node is not None:
            return
        pods = self._usage if self._usage is not None else self._snapshot["Pod"].values()
        misfit = fit_verdict(body, self._snapshot["Node"].values(), pods)
        if misfit is None:
            self._cannot_fit_backoff = 0.0  # a pod fits: the next refusal starts short again
            return
        wanted = pod_requests(body)
        largest = self._capacity.largest_free
        needs = "; ".join(
            f"{r}: needs {format_quantity(wanted.get(r, Fraction(1 if r == 'pods' else 0)))}, "
            f"at most {largest.get(r, '0')} free on one node"
            for r in misfit.lacking
        )
        message = (
            "no single node of the lower cluster can take this pod"
            + (f" (lacking {', '.join(misfit.lacking)}: {needs})" if misfit.lacking else "")
            + f"; lower cluster: {misfit.message}"
        )
        if self._start_cannot_fit_backoff(message):
            await self._taint_published()
        raise ProviderError(CANNOT_FIT, message, permanent=True)

    async def _taint_published(self, limit: float = 3.0) -> None:
        """Wait (briefly) until the upper Node shows the taint, before the pod is failed: its
        replacement is created at once, and bound to this node again if the upper scheduler
        has not seen the taint yet (one wasted pod per back-off round, seen in tests)."""
        if self._upper is None:
            return
        path = f"/api/v1/nodes/{self.context.node_name}"
        deadline = asyncio.get_running_loop().time() + limit
        while asyncio.get_running_loop().time() < deadline:
            try:
                node = await self._upper.get(path)
            except ApiError:
                return
            taints = (node.get("spec") or {}).get("taints") or []
            if any(t.get("key") == CANNOT_FIT_TAINT["key"] for t in taints):
                return
            await asyncio.sleep(0.1)

    def _start_cannot_fit_backoff(self, message: str) -> bool:
        """Taint the node for the next back-off; whether the taint is (now) wanted."""
        base = self.config.cannot_fit_backoff
        if base <= 0:
            return False
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now < self._cannot_fit_until:
            return True  # tainted already: pods bound before the taint landed
        self._cannot_fit_backoff = min(
            max(base, self._cannot_fit_backoff * 2), base * _MAX_BACKOFF_FACTOR
        )
        self._cannot_fit_until = now + self._cannot_fit_backoff
        log.warning(
            "node %s: tainted %s for %.0fs: %s",
            self.context.node_name,
            CANNOT_FIT_TAINT["key"],
            self._cannot_fit_backoff,
            message,
        )
        self.context.events.node_event(
            self.context.node_name,
            "Warning",
            CANNOT_FIT,
            f"tainted {CANNOT_FIT_TAINT['key']}:NoSchedule for "
            f"{self._cannot_fit_backoff:.0f}s so that replacements go elsewhere: {message}",
        )
        self._notify_node()
        loop.call_later(self._cannot_fit_backoff + 0.05, self._notify_node)
        return True

    def _cannot_fit_tainted(self) -> bool:
        with contextlib.suppress(RuntimeError):  # no running loop: no taint
            return asyncio.get_running_loop().time() < self._cannot_fit_until
        return False

    def _largest_free_annotation(self) -> str:
        return json.dumps(self._capacity.largest_free, sort_keys=True, separators=(",", ":"))

    def _notify_node(self) -> None:
        if self._node_notify is not None:
            self._node_notify(convert_node({"metadata": {"name": self.context.node_name}}))


def _node_state(node: JSON | None) -> tuple[object, ...]:
    """What of a mirrored lower node shows upstairs besides capacity: present, cordon, Ready."""
    if node is None:
        return (False,)
    ready = next(
        (
            (c.get("status"), c.get("reason"), c.get("message"))
            for c in (node.get("status") or {}).get("conditions") or []
            if c.get("type") == "Ready"
        ),
        None,
    )
    return (True, bool((node.get("spec") or {}).get("unschedulable")), ready)


def _ready(node: JSON) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
