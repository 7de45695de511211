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
from collections.abc import Callable, Iterable
from fractions import Fraction

from ...kube import ApiError, Handler, Reflector, Unreachable
from ...sdk.provider import EventSink, ProviderError, UpperAPI
from ...sdk.retry import Backoff
from ...sdk.tasks import TaskSet
from ._capacity import (
    LowerCapacity,
    format_quantity,
    lower_capacity,
    mirror_capacity,
    node_ready,
    pod_requests,
)
from ._config import LowerConfig
from ._convert import JSON, uid_of
from ._fit import NodeUsage, fit_verdict, largest_free
from ._lower import LowerCluster
from ._stamps import Owner, is_ours

CANNOT_FIT = "LowerClusterCannotFit"
CANNOT_FIT_TAINT = {"key": "vkubelet.io/lower-cannot-fit", "effect": "NoSchedule"}
LARGEST_FREE_ANNOTATION = "vkubelet.io/largest-free"
_MAX_BACKOFF_FACTOR = 16

__all__ = ["CANNOT_FIT", "CANNOT_FIT_TAINT", "LARGEST_FREE_ANNOTATION", "CapacityFollowing"]

log = logging.getLogger(__name__)


class CapacityFollowing:
    """The virtual node's capacity and labels, following the lower nodes and pods; it tells the
    provider only that the node changed (`notify_node`). The lower pods come from the
    provider's one lower pod reflector (`pod_changed`, `listed`)."""

    def __init__(
        self,
        config: LowerConfig,
        lower: LowerCluster,
        owner: Callable[[], Owner],
        notify_node: Callable[[], None],
        events: EventSink,
        node_name: str,
        spawned: TaskSet,
        lower_node: str | None,
    ) -> None:
        """`lower_node`: mirror mode, this virtual node stands for that one lower node."""
        self.config, self.lower, self._owner, self._notify_node = config, lower, owner, notify_node
        self._events, self._node_name, self._spawned = events, node_name, spawned
        self.lower_node = lower_node
        self.upper: UpperAPI | None = None  # to see the taint published
        self.capacity = LowerCapacity(allocatable={})
        self.known = False  # aggregate mode: computed from a listing once
        self.mirrored: JSON | None = None  # mirror mode: that lower node, as last seen
        # The watch caches of every lower node and pod (the reflectors' stores): kind -> UID ->
        # object; the snapshot (capacity, fit check) is the same once both kinds have been
        # listed, else None.
        self._listed: dict[str, dict[str, JSON]] = {}
        self.snapshot: dict[str, dict[str, JSON]] | None = None
        self._deleted_nodes: set[str] = set()  # lower nodes the node watch saw deleted
        self._changed = asyncio.Event()  # a lower node or pod changed: recompute
        self._usage: NodeUsage | None = None  # the snapshot's pods' requests per lower node
        self._cannot_fit_until = 0.0  # loop time until which the node carries the taint
        self._taint_backoff = Backoff(jitter=0.0)  # its length doubles while refusals come
        self._taint_seconds = 0.0
        self._no_usable_reported = False  # see _explain_no_usable_node

    async def run(self) -> None:
        """Keep the capacity current: list, then watch, the lower nodes (re-listed every
        `resync.nodes` seconds), and recompute (at most once a second) on every change of
        them or of the lower pods. A cordon or a new pod below shows upstairs within seconds."""
        nodes: Reflector[JSON] = Reflector(
            self.lower.client,
            "/api/v1/nodes",
            dict,
            Handler(
                self._node_seen,
                lambda _old, node: self._node_seen(node),
                self._lower_node_deleted,
                on_listed=lambda: self._lower_listed("Node", nodes.items),
            ),
            relist_every=max(1, int(self.config.resync.nodes)),
        )
        async with asyncio.TaskGroup() as group:
            group.create_task(nodes.run())
            group.create_task(self._recompute())

    def listed(self, pods: dict[str, JSON]) -> None:
        self._lower_listed("Pod", pods)

    def _lower_listed(self, kind: str, objects: dict[str, JSON]) -> None:
        """A fresh listing of the lower nodes or pods (UID -> object) becomes the snapshot's;
        the snapshot exists once both have been listed. The pods' usage is kept pod by pod
        from then on (`pod_changed`)."""
        self._listed[kind] = objects
        if kind == "Pod" and self._usage is None:
            self._usage = NodeUsage(objects.items())
        if len(self._listed) == 2:
            self.snapshot = self._listed
            if self.lower_node is not None:
                self._follow_mirrored(self._listed)  # with the listing: no moment "gone"
        self._changed.set()

    def pod_changed(self, pod: JSON, *, deleted: bool = False) -> None:
        """A lower pod event, for the capacity's per-node usage."""
        key = uid_of(pod)
        if deleted:
            if self._usage is not None:
                self._usage.drop(key)
        else:
            if self._usage is not None:
                self._usage.put(key, pod)
            self._end_if_stranded(pod)
        self._changed.set()

    def _end_if_stranded(self, pod: JSON) -> None:
        """Our lower pod being deleted on a lower node whose deletion the node watch reported:
        deleted at once, by UID (see `_lower_node_deleted`)."""
        meta = pod.get("metadata") or {}
        if (
            meta.get("deletionTimestamp")
            and (pod.get("spec") or {}).get("nodeName") in self._deleted_nodes
            and is_ours(pod, self._owner())
        ):
            self._spawned.spawn(self._force_delete(meta), name=f"force-delete {uid_of(pod)} below")

    def on_vanished_node(self, lower: JSON) -> bool:
        """Whether the lower pod is bound to a lower node that no longer exists: a graceful
        deletion would wait for the lower pod garbage collector (a minute or so), and a
        mirrored node's drain with it."""
        where = (lower.get("spec") or {}).get("nodeName")
        if not where or self.snapshot is None:
            return False
        return not any(
            (n.get("metadata") or {}).get("name") == where for n in self.snapshot["Node"].values()
        )

    def _node_seen(self, node: JSON) -> None:
        self._deleted_nodes.discard((node.get("metadata") or {}).get("name", ""))
        self._changed.set()

    def _lower_node_deleted(self, node: JSON) -> None:
        """Our lower pods being deleted on a node that is now gone: no kubelet is left to end
        them, so their graceful deletion would wait for the lower pod garbage collector (40 s
        and more; a mirrored node's drain with it). They are deleted at once, by UID. A
        deletion seen before the node's is the case here; one seen after is in
        `pod_changed`, and one that starts after asks for no grace (`on_vanished_node`)."""
        self._changed.set()
        where = (node.get("metadata") or {}).get("name")
        if not where:
            return
        self._deleted_nodes.add(str(where))
        for pod in list((self._listed.get("Pod") or {}).values()):
            if (pod.get("spec") or {}).get("nodeName") == where:
                self._end_if_stranded(pod)

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

    async def _recompute(self) -> None:
        owner = self._owner()  # settled before the loops start
        while True:
            await self._changed.wait()
            self._changed.clear()
            objects, usage = self.snapshot, self._usage
            if objects is None or usage is None:
                continue  # the first listing of both kinds sets `changed` again
            if self.lower_node is not None:
                self._follow_mirrored(objects)
                await asyncio.sleep(1.0)
                continue
            capacity = dataclasses.replace(
                lower_capacity(
                    objects["Node"].values(),
                    objects["Pod"].values(),
                    lambda p: is_ours(p, owner),
                    label_excluded=self.config.label_excluded,
                ),
                largest_free=largest_free(objects["Node"].values(), usage),
            )
            if capacity != self.capacity or not self.known:
                self._explain_no_usable_node(objects["Node"].values(), capacity)
                self.capacity, self.known = capacity, True
                self._notify_node()
            await asyncio.sleep(1.0)  # at most one recomputation a second

    def _explain_no_usable_node(self, nodes: Iterable[JSON], capacity: LowerCapacity) -> None:
        """A node with no capacity only says "Too many pods" to the upper scheduler. When the
        lower cluster has Ready nodes but none counts (cordoned, or tainted NoSchedule or
        NoExecute: the mock provider's nodes are, by default), say which, once per change."""
        ready = [n for n in nodes if node_ready(n)]
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
        log.warning("node %s: %s", self._node_name, message)
        self._events.node_event(self._node_name, "Warning", "NoUsableLowerNode", message)

    def _follow_mirrored(self, objects: dict[str, dict[str, JSON]]) -> None:
        """Mirror mode: this virtual node's capacity, labels, cordon and readiness follow its
        one lower node (pods not ours subtracted)."""
        owner = self._owner()
        node = next(
            (
                n
                for n in objects["Node"].values()
                if (n.get("metadata") or {}).get("name") == self.lower_node
            ),
            None,
        )
        capacity = (
            LowerCapacity(allocatable={}, labels=self.capacity.labels)  # gone: keep its labels
            if node is None
            else mirror_capacity(
                node,
                objects["Pod"].values(),
                lambda p: is_ours(p, owner),
                label_excluded=self.config.label_excluded,
            )
        )
        before = (self.capacity, _node_state(self.mirrored))
        self.capacity, self.mirrored = capacity, node
        if (capacity, _node_state(node)) != before:
            self._notify_node()

    # -- the fit check (aggregate mode) ---------------------------------------------------------
    async def check_fit(self, body: JSON) -> None:
        """Refuse `body` (the lower pod about to be created) when no single lower node of the
        snapshot can take it. No snapshot yet, or the check turned off: let the lower
        scheduler decide."""
        if not self.config.fit_check or self.snapshot is None or self.lower_node is not None:
            return
        pods = self._usage if self._usage is not None else self.snapshot["Pod"].values()
        misfit = fit_verdict(body, self.snapshot["Node"].values(), pods)
        if misfit is None:
            self._taint_backoff.reset()  # a pod fits: the next refusal starts short again
            return
        wanted = pod_requests(body)
        largest = self.capacity.largest_free
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
        if self.start_cannot_fit_backoff(message):
            await self.taint_published()
        raise ProviderError(CANNOT_FIT, message, permanent=True)

    async def taint_published(self, limit: float = 3.0) -> None:
        """Wait (briefly) until the upper Node shows the taint, before the pod is failed: its
        replacement is created at once, and bound to this node again if the upper scheduler
        has not seen the taint yet (one wasted pod per back-off round, seen in tests)."""
        if self.upper is None:
            return
        path = f"/api/v1/nodes/{self._node_name}"
        deadline = asyncio.get_running_loop().time() + limit
        while asyncio.get_running_loop().time() < deadline:
            try:
                node = await self.upper.get(path)
            except ApiError:
                return
            taints = (node.get("spec") or {}).get("taints") or []
            if any(t.get("key") == CANNOT_FIT_TAINT["key"] for t in taints):
                return
            await asyncio.sleep(0.1)

    def start_cannot_fit_backoff(self, message: str) -> bool:
        """Taint the node for the next back-off; whether the taint is (now) wanted."""
        base = self.config.cannot_fit_backoff
        if base <= 0:
            return False
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now < self._cannot_fit_until:
            return True  # tainted already: pods bound before the taint landed
        backoff = self._taint_backoff  # the numbers of the config as it is now
        backoff.initial, backoff.cap = base, base * _MAX_BACKOFF_FACTOR
        self._taint_seconds = backoff.next_delay()
        self._cannot_fit_until = now + self._taint_seconds
        log.warning(
            "node %s: tainted %s for %.0fs: %s",
            self._node_name,
            CANNOT_FIT_TAINT["key"],
            self._taint_seconds,
            message,
        )
        self._events.node_event(
            self._node_name,
            "Warning",
            CANNOT_FIT,
            f"tainted {CANNOT_FIT_TAINT['key']}:NoSchedule for "
            f"{self._taint_seconds:.0f}s so that replacements go elsewhere: {message}",
        )
        self._notify_node()
        loop.call_later(self._taint_seconds + 0.05, self._notify_node)
        return True

    def cannot_fit_tainted(self) -> bool:
        with contextlib.suppress(RuntimeError):  # no running loop: no taint
            return asyncio.get_running_loop().time() < self._cannot_fit_until
        return False

    def largest_free_annotation(self) -> str:
        return json.dumps(self.capacity.largest_free, sort_keys=True, separators=(",", ":"))


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
