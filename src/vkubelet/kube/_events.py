"""Kubernetes Events for pods, written in the background so they never slow a pod down.

Events are the lowest-priority writes an agent makes: like the kubelet (`--event-qps=50`,
`--event-burst=100`) we cap their rate, so that a burst of thousands of pods spends the
apiserver's capacity on pod status, not on "Created" events. Warnings go before normal events;
each kind has a bounded queue whose oldest entries are dropped (and counted) when it is full.
Repeats of the same (object, reason, message) within ten minutes bump the count of the existing
Event instead of creating a new one, as client-go's recorder does; repeats that arrive while
the first is still queued are folded into it, so a burst costs one write, not one per repeat.

The recorder is also the provider's `EventSink` (`pod_event`, `node_event`): a provider's events
share the node's queues, rate limit and aggregation with the agent's own.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightkube.resources.core_v1 import Pod

from ..sdk.clock import now_rfc3339
from ..sdk.provider import EventType
from ._client import MERGE_PATCH, KubeClient, TokenBucket
from ._errors import ApiError, Unreachable

log = logging.getLogger(__name__)

NORMAL = "Normal"
WARNING = "Warning"
_DEDUP_WINDOW = 600.0
_MAX_PENDING = 1000  # of each kind (warnings, normal events); the oldest are dropped


@dataclass(frozen=True)
class ObjectRef:
    kind: str
    namespace: str
    name: str
    uid: str
    api_version: str = "v1"

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> ObjectRef:
        """The reference to an object as the apiserver returned it (with apiVersion and kind)."""
        meta = obj.get("metadata") or {}
        return cls(
            str(obj.get("kind") or ""),
            str(meta.get("namespace") or ""),
            str(meta.get("name") or ""),
            str(meta.get("uid") or ""),
            str(obj.get("apiVersion") or "v1"),
        )


def node_ref(node_name: str) -> ObjectRef:
    return ObjectRef("Node", "", node_name, node_name)


@dataclass
class _Pending:
    ref: ObjectRef
    type: str
    reason: str
    message: str
    count: int = 1

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.ref.kind, self.ref.uid, self.type, self.reason, self.message)


class EventRecorder:
    def __init__(
        self,
        client: KubeClient,
        *,
        component: str,
        host: str,
        qps: float = 50.0,
        burst: int = 100,
    ) -> None:
        self._client = client
        self._component = component
        self._host = host
        self._bucket = TokenBucket(qps, burst)
        self._warnings: deque[_Pending] = deque(maxlen=_MAX_PENDING)
        self._normal: deque[_Pending] = deque(maxlen=_MAX_PENDING)
        self._wake = asyncio.Event()
        self._queued: dict[tuple[str, str, str, str, str], _Pending] = {}
        # (uid, reason, message) -> (event name, count, first seen)
        self._recent: OrderedDict[tuple[str, str, str], tuple[str, int, float]] = OrderedDict()
        self.dropped = 0
        self.sent = 0

    def emit(self, ref: ObjectRef, type: str, reason: str, message: str) -> None:
        item = _Pending(ref, type, reason, message[:1024])
        queued = self._queued.get(item.key)
        if queued is not None:
            queued.count += 1  # the same event, not yet written: one write for both
            return
        queue = self._warnings if type == WARNING else self._normal
        if len(queue) == queue.maxlen:
            self.dropped += 1
            self._queued.pop(queue.popleft().key, None)
        queue.append(item)
        self._queued[item.key] = item
        self._wake.set()

    def pod_event(self, pod: Pod, type: EventType, reason: str, message: str) -> None:
        """An event about one of the node's pods, from the provider (`EventSink`)."""
        meta = pod.metadata
        if meta is None or not meta.name or not meta.namespace:
            log.debug("event %s about a pod without a name dropped", reason)
            return
        self.emit(
            ObjectRef("Pod", meta.namespace, meta.name, meta.uid or ""), type, reason, message
        )

    def node_event(self, node_name: str, type: EventType, reason: str, message: str) -> None:
        """An event about the node, from the provider (`EventSink`). Like the kubelet's, it is
        recorded in the default namespace and refers to the node by name."""
        self.emit(node_ref(node_name), type, reason, message)

    @property
    def pending(self) -> int:
        return len(self._warnings) + len(self._normal)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._warnings or self._normal:
                await self._bucket.take()
                item = (self._warnings or self._normal).popleft()
                self._queued.pop(item.key, None)
                try:
                    await self._send(item)
                except (ApiError, Unreachable) as e:
                    log.debug("event %s/%s not recorded: %s", item.ref.name, item.reason, e)

    async def _send(self, item: _Pending) -> None:
        key = (item.ref.uid, item.reason, item.message)
        now = time.monotonic()
        recent = self._recent.get(key)
        namespace = item.ref.namespace or "default"
        path = f"/api/v1/namespaces/{namespace}/events"
        if recent and now - recent[2] < _DEDUP_WINDOW:
            name, count, first = recent
            try:
                # The answers are not read: request_raw spares decoding the whole Event.
                await self._client.request_raw(
                    "PATCH",
                    f"{path}/{name}",
                    body={"count": count + item.count, "lastTimestamp": now_rfc3339()},
                    content_type=MERGE_PATCH,
                )
                self._recent[key] = (name, count + item.count, first)
                self.sent += 1
                return
            except ApiError as e:
                if not e.not_found:
                    raise
        name = f"{item.ref.name}.{uuid.uuid4().hex[:16]}"
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {
                "apiVersion": item.ref.api_version,
                "kind": item.ref.kind,
                "namespace": item.ref.namespace,
                "name": item.ref.name,
                "uid": item.ref.uid,
            },
            "reason": item.reason,
            "message": item.message,
            "type": item.type,
            "count": item.count,
            "firstTimestamp": now_rfc3339(),
            "lastTimestamp": now_rfc3339(),
            "eventTime": None,
            "source": {"component": self._component, "host": self._host},
            "reportingComponent": self._component,
            "reportingInstance": self._host,
        }
        await self._client.request_raw("POST", path, body=body)
        self.sent += 1
        self._recent[key] = (name, item.count, now)
        self._recent.move_to_end(key)
        while len(self._recent) > 1000:
            self._recent.popitem(last=False)
