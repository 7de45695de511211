"""Reflecting upper Services below: the upper watch and the sync loop around `_services`."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from ...kube import ApiError
from ._convert import name_key
from ._core import ProviderCore
from ._services import apply_service_plan, plan_services, selects_anything
from ._stamps import is_ours

__all__ = ["ServiceReflection"]

log = logging.getLogger(__name__)


class ServiceReflection(ProviderCore):
    """Upper Services of our pods kept below (`_services` plans, this follows and applies)."""

    async def _follow_upper_services(self) -> None:
        """List, then watch, the upper Services (every namespace: a `system:node` may)."""
        assert self._upper is not None
        while True:
            answer = await self._upper.get("/api/v1/services")
            self._upper_services = {name_key(s): s for s in answer.get("items") or []}
            self._upper_services_listed.set()
            self._services_dirty.set()
            version = str((answer.get("metadata") or {}).get("resourceVersion", ""))
            params = {"resourceVersion": version, "allowWatchBookmarks": "true"}
            try:
                async for kind, raw in self._upper.watch(
                    "/api/v1/services", params, timeout_seconds=300
                ):
                    if kind == "ERROR":
                        break
                    if kind == "BOOKMARK":
                        continue
                    service = msgspec.json.decode(raw)
                    if kind == "DELETED":
                        self._upper_services.pop(name_key(service), None)
                    else:
                        self._upper_services[name_key(service)] = service
                    self._services_dirty.set()
            except ApiError as e:
                if not e.gone:
                    raise

    async def _reflect_services(self) -> None:
        """Keep the lower Services (`_services`) matching the upper ones and our pods: at every
        change of either, and every `resync.dependencies` seconds from a fresh lower list."""
        await self._ensure_owner()
        await self._upper_services_listed.wait()  # never plan from an empty upper view
        relist = True
        while True:
            self._services_dirty.clear()
            await self._sync_services(relist=relist)
            relist = False
            try:
                async with asyncio.timeout(self.config.resync.dependencies):
                    await self._services_dirty.wait()
            except TimeoutError:
                relist = True
            await asyncio.sleep(0.2)  # gather a burst of changes (a Deployment scaling)

    async def _sync_services(self, *, relist: bool) -> None:
        if self._lower_services is None or relist:
            found = await self.lower.list_objects("Service", selector=self.owner.selector)
            self._lower_services = {name_key(s): s for s in found if is_ours(s, self.owner)}
        # Only pods in a namespace where some upper Service selects pods can be selected: in a
        # burst this runs every 0.2 s, and going over every pod each time cost ~1 % of the
        # agent's CPU when no Service selects any of them.
        selecting = {name_key(s)[0] for s in self._upper_services.values() if selects_anything(s)}
        running = [
            self._prepared_pod(p)[2]  # its JSON as prepared once per pod, not again per sync
            for k, p in self._pods.items()
            if p.namespace in selecting and self._deleting.get(k) != p.uid and k not in self._failed
        ]
        plan = plan_services(
            self._upper_services.values(),
            running,
            self._lower_services,
            self.owner,
            self.how.lower_namespace,
        )
        if self._still_adopting():
            plan.delete.clear()
        applied = await apply_service_plan(self.lower, plan, self.owner)
        for key, obj in applied.written.items():
            if obj is None:
                self._lower_services.pop(key, None)
            else:
                self._lower_services[key] = obj
        for key, message in applied.conflicts.items():
            if key not in self._service_conflicts:
                self._service_conflicts.add(key)
                log.warning("%s", message)
                self.context.events.node_event(
                    self.context.node_name, "Warning", "LowerServiceConflict", message
                )
        if applied.problems:
            log.warning("services below: %s", "; ".join(applied.problems))
            self._services_dirty.set()  # retried after the pause
            await asyncio.sleep(2.0)
