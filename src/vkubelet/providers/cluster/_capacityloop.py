"""Following the lower nodes and pods for the virtual node's capacity and labels (`_capacity`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from ...node import ApiError
from ._capacity import lower_capacity
from ._convert import JSON, convert_node, uid_of
from ._core import ProviderCore
from ._stamps import is_ours

__all__ = ["CapacityFollowing"]

log = logging.getLogger(__name__)


class CapacityFollowing(ProviderCore):
    """The virtual node's capacity and labels, following the lower nodes and pods."""

    async def _follow_capacity(self) -> None:
        """Keep the capacity current: list the lower nodes and pods, then follow both with
        watches and recompute (at most once a second) on every change; re-list every
        `resync.nodes` seconds. A cordon or a new pod below shows upstairs within seconds."""
        await self._ensure_owner()
        while True:
            changed = asyncio.Event()
            objects: dict[str, dict[str, JSON]] = {}
            versions: dict[str, str] = {}
            for kind, path in (("Node", "/api/v1/nodes"), ("Pod", "/api/v1/pods")):
                answer = await self.lower.client.get(path)
                objects[kind] = {uid_of(o): o for o in answer.get("items") or []}
                versions[kind] = str((answer.get("metadata") or {}).get("resourceVersion", ""))
            timeout = max(1, int(self.config.resync.nodes))
            async with asyncio.TaskGroup() as group:
                for kind, path in (("Node", "/api/v1/nodes"), ("Pod", "/api/v1/pods")):
                    group.create_task(
                        self._watch_into(path, versions[kind], objects[kind], changed, timeout)
                    )
                group.create_task(self._recompute(objects, changed, timeout))

    async def _watch_into(
        self,
        path: str,
        version: str,
        into: dict[str, JSON],
        changed: asyncio.Event,
        seconds: int,
    ) -> None:
        params = {"resourceVersion": version, "allowWatchBookmarks": "true"}
        try:
            async for kind, raw in self.lower.client.watch(path, params, timeout_seconds=seconds):
                if kind in ("ERROR", "BOOKMARK"):
                    if kind == "ERROR":
                        return
                    continue
                obj = msgspec.json.decode(raw)
                if kind == "DELETED":
                    into.pop(uid_of(obj), None)
                else:
                    into[uid_of(obj)] = obj
                changed.set()
        except ApiError as e:
            if not e.gone:
                raise

    async def _recompute(
        self, objects: dict[str, dict[str, JSON]], changed: asyncio.Event, seconds: int
    ) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        changed.set()
        while asyncio.get_running_loop().time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=1.0)
            if not changed.is_set():
                continue
            changed.clear()
            capacity = lower_capacity(
                objects["Node"].values(),
                objects["Pod"].values(),
                lambda p: is_ours(p, self.owner),
                label_excluded=self.config.label_excluded,
            )
            if capacity != self._capacity:
                self._capacity = capacity
                if self._node_notify is not None:
                    self._node_notify(convert_node({"metadata": {"name": self.context.node_name}}))
            await asyncio.sleep(1.0)  # at most one recomputation a second
